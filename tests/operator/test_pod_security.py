"""Every pod the operator renders for the shipped examples passes the Pod Security Standards' restricted profile.

The checker below implements the profile's controls as the Kubernetes documentation lists them
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, "Baseline" and "Restricted"; the
restricted profile includes every baseline control), each rule citing the control it checks. It looks at a
pod spec as the Pod Security Admission controller does: the pod, its containers, init containers and ephemeral
containers. A namespace labelled ``pod-security.kubernetes.io/enforce: restricted`` admits exactly such pods.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLES
from coserve.api import parse_pool
from coserve.api.profile import EngineProfile
from coserve.operator.resources import build_children
from coserve.provisioning import plan_for

Pod = Mapping[str, Any]

# Baseline "Capabilities": adding any capability beyond this set is disallowed.
BASELINE_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
     "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
# Baseline "Sysctls": the safe subset.
SAFE_SYSCTLS = frozenset(
    {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
     "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
     "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
     "net.ipv4.tcp_keepalive_probes"}
)  # fmt: skip
# Baseline "SELinux": the allowed seLinuxOptions.type values (undefined/"" too).
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted "Volume Types": only these volume sources.
RESTRICTED_VOLUME_SOURCES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
# Restricted "Seccomp": the allowed profile types (Unconfined is refused by baseline already).
RESTRICTED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})


def containers(pod: Pod) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(field) or []:
            yield f"{field}[{container['name']}]", container


def baseline(pod: Pod, annotations: Mapping[str, str]) -> list[str]:
    """Violations of the baseline profile's controls."""
    out: list[str] = []
    context = pod.get("securityContext") or {}
    # HostProcess: windowsOptions.hostProcess must be unset or false (pod and containers).
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: securityContext.windowsOptions.hostProcess")
    # Host Namespaces: hostNetwork, hostPID, hostIPC must be unset or false.
    out += [f"Host Namespaces: {f}" for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    # HostPath Volumes: forbidden.
    out += [f"HostPath Volumes: volumes[{v['name']}]" for v in pod.get("volumes") or [] if "hostPath" in v]
    # AppArmor (annotations): only runtime/default and localhost/*.
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"AppArmor: annotation {key}={value}")
    # Sysctls: only the safe subset.
    out += [f"Sysctls: {s['name']}" for s in context.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    for where, sc in [("pod", context), *((w, c.get("securityContext") or {}) for w, c in containers(pod))]:
        # AppArmor: appArmorProfile.type undefined, RuntimeDefault or Localhost.
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where}.appArmorProfile")
        # SELinux: type in the allowed set; user and role unset.
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"SELinux: {where}.seLinuxOptions")
        # Seccomp: the profile type must not be Unconfined.
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where}.seccompProfile Unconfined")
        if where != "pod" and (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}")
    for where, container in containers(pod):
        sc = container.get("securityContext") or {}
        # Privileged Containers: privileged must be unset or false.
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}")
        # Capabilities: nothing added beyond the baseline set.
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"Capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        # Host Ports: hostPort unset or 0.
        out += [f"Host Ports: {where}" for p in container.get("ports") or [] if p.get("hostPort")]
        # /proc Mount Type: procMount unset or Default.
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {where}")
    return out


def restricted(pod: Pod, annotations: Mapping[str, str]) -> list[str]:
    """Violations of the restricted profile: the baseline's, and its own controls."""
    out = baseline(pod, annotations)
    context = pod.get("securityContext") or {}
    # Volume Types: only the listed volume sources.
    for volume in pod.get("volumes") or []:
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            out.append(f"Volume Types: volumes[{volume['name']}] {sorted(sources)}")
    # Running as Non-root user: runAsUser must not be 0 (pod and containers).
    if context.get("runAsUser") == 0:
        out.append("Running as Non-root user: pod runAsUser 0")
    pod_non_root = context.get("runAsNonRoot")
    pod_seccomp = (context.get("seccompProfile") or {}).get("type")
    # Running as Non-root: a pod runAsNonRoot set must be true.
    if pod_non_root is not None and pod_non_root is not True:
        out.append("Running as Non-root: pod runAsNonRoot is not true")
    # Seccomp: a pod seccompProfile set must be RuntimeDefault or Localhost.
    if pod_seccomp is not None and pod_seccomp not in RESTRICTED_SECCOMP:
        out.append(f"Seccomp: pod seccompProfile {pod_seccomp}")
    for where, container in containers(pod):
        sc = container.get("securityContext") or {}
        # Privilege Escalation: allowPrivilegeEscalation must be set to false.
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where}")
        # Running as Non-root: true at the pod, or on every container; a container's set value must be true.
        non_root = sc.get("runAsNonRoot")
        if (non_root is not None and non_root is not True) or (non_root is None and pod_non_root is not True):
            out.append(f"Running as Non-root: {where}")
        # Running as Non-root user: runAsUser must not be 0.
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where}")
        # Seccomp: RuntimeDefault or Localhost at the pod, or on every container; a container's set value too.
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if (seccomp is not None and seccomp not in RESTRICTED_SECCOMP) or (seccomp is None and pod_seccomp is None):
            out.append(f"Seccomp: {where}")
        # Capabilities: drop ALL, and add only NET_BIND_SERVICE.
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"Capabilities: {where} adds more than NET_BIND_SERVICE")
    return out


def rendered_pods(path: Path) -> Iterator[tuple[str, Pod, Mapping[str, str]]]:
    pool = parse_pool(yaml.safe_load(path.read_text()))
    measured = None
    if pool.spec.profile.config_map_ref is not None:
        profile = yaml.safe_load((EXAMPLES / "profile.yaml").read_text())
        measured = EngineProfile.model_validate_json(json.dumps(profile))
    for child in build_children(pool, plan_for(pool.spec, measured)):
        if child["kind"] == "Deployment":
            template = child["spec"]["template"]
            yield child["metadata"]["name"], template["spec"], template["metadata"].get("annotations") or {}


EXAMPLE_POOLS = sorted(EXAMPLES.glob("pool*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_POOLS, ids=lambda p: p.name)
def test_every_rendered_pod_of_every_example_passes_the_restricted_profile(path: Path) -> None:
    pods = list(rendered_pods(path))
    assert {name.rsplit("-", 1)[1] for name, _, _ in pods} == {"prefiller", "decoder", "router"}
    for name, pod, pod_annotations in pods:
        assert restricted(pod, pod_annotations) == [], name


def test_the_examples_cover_the_model_download_init_container() -> None:
    assert any(pod.get("initContainers") for path in EXAMPLE_POOLS for _, pod, _ in rendered_pods(path))


_GOOD_CONTAINER = {
    "name": "c",
    "securityContext": {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    },
}


@pytest.mark.parametrize(
    ("pod", "violation"),
    [
        ({"hostNetwork": True}, "Host Namespaces: hostNetwork"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "HostPath Volumes: volumes[h]"),
        ({"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}, "Volume Types: volumes[n] ['nfs']"),
        ({"securityContext": {"runAsUser": 0}}, "Running as Non-root user: pod runAsUser 0"),
        ({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, "Sysctls: kernel.msgmax"),
        ({"containers": [{"name": "c"}]}, "Privilege Escalation: containers[c]"),
        ({"containers": [{"name": "c"}]}, "Running as Non-root: containers[c]"),
        ({"containers": [{"name": "c"}]}, "Seccomp: containers[c]"),
        ({"containers": [{"name": "c"}]}, "Capabilities: containers[c] does not drop ALL"),
        (
            {"containers": [{**_GOOD_CONTAINER, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
            "Host Ports: containers[c]",
        ),
    ],
)
def test_the_checker_catches_what_the_profile_forbids(pod: dict[str, Any], violation: str) -> None:
    assert violation in restricted(pod, {})


def test_the_checker_passes_a_restricted_pod() -> None:
    pod = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}}
    assert restricted({**pod, "containers": [_GOOD_CONTAINER], "volumes": [{"name": "e", "emptyDir": {}}]}, {}) == []
