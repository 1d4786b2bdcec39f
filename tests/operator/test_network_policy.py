"""Who may reach a pool's engines: the NetworkPolicy the operator renders, evaluated on a table of sources.

A NetworkPolicy is enforced by the cluster's CNI plugin (Calico, Cilium, ...), which cannot run here. So
this file holds a small model of the NetworkPolicy ingress semantics, as the Kubernetes API reference states
them (networking.k8s.io/v1 NetworkPolicySpec, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort;
meta/v1 LabelSelector) and the concepts page "Network Policies" explains them, and evaluates the rendered
policy with it. What the model holds:

- A policy applies to the pods of its own namespace that ``spec.podSelector`` selects (``{}`` selects every
  pod), for ingress when ``policyTypes`` holds Ingress (absent, Ingress is implied). A pod that no policy
  selects for ingress accepts every connection; a pod that some do accepts one when any ingress rule of any
  of them allows it (policies add up; none denies).
- An ingress rule allows a connection when its ``from`` allows the source and its ``ports`` the destination
  port. ``from`` empty or absent: every source; otherwise any of its peers (ORed). ``ports`` empty or
  absent: every port; otherwise any entry, matching the protocol (default TCP) and the port (absent: every
  port; with ``endPort``, the range).
- A peer with a podSelector and a namespaceSelector selects the pods the podSelector selects in the
  namespaces the namespaceSelector selects (both must hold); with only a podSelector, those pods in the
  policy's own namespace; with only a namespaceSelector, every pod of those namespaces. ipBlock and named
  ports are not modelled: the evaluator refuses them rather than guess.
- A label selector selects what every one of its matchLabels and matchExpressions selects: In (the label is
  set to one of the values), NotIn (the label is absent or set to none of them), Exists, DoesNotExist;
  ``{}`` selects everything.
- Every namespace carries the label ``kubernetes.io/metadata.name`` with its name, set by the API server
  (so no namespace can carry another's name there).

The table covers the pool's own router, prefillers and decoders; a pod of another namespace that labels
itself app.kubernetes.io/name=prometheus; another pool's pods in the same namespace; and a scraper the spec
names, in and out of its namespace and with and without its labels, on the engine port and on another.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from coserve.api import parse_pool
from coserve.operator.resources import ENGINE_PORT, ENGINE_ROLES, build_children
from coserve.provisioning import plan_for
from pool_builders import sample_pool

NAME_LABEL_OF_NAMESPACE = "kubernetes.io/metadata.name"
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
KV_PORT = 5600  # any port besides the engine's: the pool's own pods may use every one (KV handoff)

Labels = dict[str, str]


# --- the model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Labels
    namespace_labels: Labels = field(default_factory=dict)  # besides kubernetes.io/metadata.name

    def labels_of_namespace(self) -> Labels:
        return {**self.namespace_labels, NAME_LABEL_OF_NAMESPACE: self.namespace}  # the API server's, always


def selects(selector: dict[str, Any], labels: Labels) -> bool:
    """metav1.LabelSelector: every matchLabels entry and every matchExpressions requirement holds."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    assert not unknown, f"not a label selector: {unknown}"
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for requirement in selector.get("matchExpressions") or []:
        key, operator, values = requirement["key"], requirement["operator"], requirement.get("values") or []
        if operator == "In":
            holds = key in labels and labels[key] in values
        elif operator == "NotIn":
            holds = key not in labels or labels[key] not in values
        elif operator == "Exists":
            holds = key in labels
        elif operator == "DoesNotExist":
            holds = key not in labels
        else:
            raise AssertionError(f"not a label selector operator: {operator}")
        if not holds:
            return False
    return True


def peer_admits(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    """NetworkPolicyPeer: podSelector AND namespaceSelector; a podSelector alone is the policy's namespace."""
    assert "ipBlock" not in peer, "ipBlock is not modelled"
    assert set(peer) <= {"podSelector", "namespaceSelector"} and peer, f"not a peer: {peer}"
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.labels_of_namespace())
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)


def port_admits(entry: dict[str, Any], protocol: str, port: int) -> bool:
    """NetworkPolicyPort: the protocol (default TCP) and the port (absent: every one; endPort: a range)."""
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    assert isinstance(entry["port"], int), "named ports are not modelled"
    return bool(entry["port"] <= port <= entry.get("endPort", entry["port"]))


def rule_admits(rule: dict[str, Any], policy_namespace: str, source: Pod, protocol: str, port: int) -> bool:
    peers = rule.get("from") or []
    ports = rule.get("ports") or []
    from_ok = not peers or any(peer_admits(peer, policy_namespace, source) for peer in peers)
    ports_ok = not ports or any(port_admits(entry, protocol, port) for entry in ports)
    return from_ok and ports_ok


def admitted(policies: list[dict[str, Any]], target: Pod, source: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether ``source`` may open a connection to ``target``'s ``port``, under ``policies``."""
    selecting = [
        policy
        for policy in policies
        if policy["metadata"]["namespace"] == target.namespace
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and selects(policy["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    return any(
        rule_admits(rule, policy["metadata"]["namespace"], source, protocol, port)
        for policy in selecting
        for rule in policy["spec"].get("ingress") or []
    )


# --- the model against the API reference's own examples ----------------------------------------------


def _policy(spec: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": namespace}, "spec": spec}


DB = Pod("default", {"role": "db"})


def test_the_model_reads_selectors_as_the_api_reference_defines_them() -> None:
    labels = {"tier": "gpu", "zone": "a"}
    assert selects({}, labels) and selects({}, {})
    assert selects({"matchLabels": {"tier": "gpu"}}, labels)
    assert not selects({"matchLabels": {"tier": "gpu", "zone": "b"}}, labels)
    assert selects({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, labels)
    assert selects({"matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["1"]}]}, labels)  # absent
    assert not selects({"matchExpressions": [{"key": "rack", "operator": "In", "values": ["1"]}]}, labels)
    assert selects({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, labels)
    assert not selects({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, labels)
    assert not selects({"matchLabels": {"tier": "gpu"},
                        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}, labels)  # fmt: skip


def test_the_model_reads_peers_and_ports_as_the_api_reference_defines_them() -> None:
    frontend = Pod("default", {"role": "frontend"})
    frontend_elsewhere = Pod("shop", {"role": "frontend"}, {"project": "myproject"})
    anyone_in_project = Pod("shop", {"role": "cron"}, {"project": "myproject"})
    in_project = {"namespaceSelector": {"matchLabels": {"project": "myproject"}}}
    frontends = {"podSelector": {"matchLabels": {"role": "frontend"}}}
    dbs = {"matchLabels": {"role": "db"}}
    # one peer with both selectors: the pods AND the namespaces
    both = _policy({"podSelector": dbs, "ingress": [{"from": [{**in_project, **frontends}]}]})
    assert admitted([both], DB, frontend_elsewhere, 1)
    assert not admitted([both], DB, anyone_in_project, 1) and not admitted([both], DB, frontend, 1)
    # two peers: the pods OR the namespaces
    either = _policy({"podSelector": dbs, "ingress": [{"from": [in_project, frontends]}]})
    assert admitted([either], DB, anyone_in_project, 1) and admitted([either], DB, frontend, 1)
    assert not admitted([either], DB, Pod("default", {"role": "cron"}), 1)
    # a podSelector alone is the policy's namespace
    assert not admitted([either], DB, Pod("shop", {"role": "frontend"}), 1)
    # ports: protocol (default TCP), a port, a range; none listed: every port
    port_entries = [{"port": 6379}, {"protocol": "UDP", "port": 32000, "endPort": 32768}]
    ports = _policy({"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}], "ports": port_entries}]})
    assert admitted([ports], DB, frontend, 6379) and not admitted([ports], DB, frontend, 6379, "UDP")
    assert admitted([ports], DB, frontend, 32100, "UDP") and not admitted([ports], DB, frontend, 32769, "UDP")
    assert admitted([either], DB, frontend, 65535)
    # default deny (no rule), allow all (one empty rule); an unselected pod, or another namespace's, is open
    deny = _policy({"podSelector": {}, "policyTypes": ["Ingress"]})
    assert not admitted([deny], DB, frontend, 1)
    assert admitted([deny, _policy({"podSelector": {}, "ingress": [{}]})], DB, frontend, 1)  # policies add up
    assert admitted([both], Pod("default", {"role": "web"}), anyone_in_project, 1)
    assert admitted([deny], Pod("shop", {"role": "db"}), frontend, 1)
    assert admitted([_policy({"podSelector": {}, "policyTypes": ["Egress"]})], DB, frontend, 1)


def test_no_namespace_carries_another_namespaces_name_label() -> None:
    assert Pod("attacker", {}, {NAME_LABEL_OF_NAMESPACE: "monitoring"}).labels_of_namespace() == {
        NAME_LABEL_OF_NAMESPACE: "attacker"
    }


# --- the rendered policy -----------------------------------------------------------------------------

POOL_NAMESPACE = "serving"
NAMED_SCRAPERS = [
    {"namespaceLabels": {NAME_LABEL_OF_NAMESPACE: "monitoring"}, "podLabels": PROMETHEUS},
    {"namespaceLabels": {"team": "observability", "env": "prod"}, "podLabels": {"app": "vmagent"}},
]


def render(name: str = "chat", scrapers: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    document = sample_pool(name=name, namespace=POOL_NAMESPACE)
    if scrapers is not None:
        document["spec"]["engine"] = {"metricsScrapers": copy.deepcopy(scrapers)}
    pool = parse_pool(document)
    return build_children(pool, plan_for(pool.spec))


def policies(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [child for child in children if child["kind"] == "NetworkPolicy"]


def pod_of(children: list[dict[str, Any]], role: str) -> Pod:
    """A pod of the role's Deployment, labelled as its template labels it, in the pool's namespace."""
    (deployment,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith(f"-{role}")]
    return Pod(deployment["metadata"]["namespace"], dict(deployment["spec"]["template"]["metadata"]["labels"]))


OWN = render()  # the pool chat, as rendered by default
OTHER = render("other")  # another pool in the same namespace


def source(who: str) -> Pod:
    """The sources of the table, by name."""
    own_labels = pod_of(OWN, "router").labels
    return {
        "own-router": pod_of(OWN, "router"),
        "own-prefiller": pod_of(OWN, "prefiller"),
        "own-decoder": pod_of(OWN, "decoder"),
        "other-pools-router": pod_of(OTHER, "router"),
        "other-pools-decoder": pod_of(OTHER, "decoder"),
        "self-labelled-prometheus-elsewhere": Pod("attacker", dict(PROMETHEUS)),
        "self-labelled-prometheus-in-the-pools-namespace": Pod(POOL_NAMESPACE, dict(PROMETHEUS)),
        "prometheus-in-monitoring": Pod("monitoring", {**PROMETHEUS, "prometheus": "k8s"}),
        "other-pod-in-monitoring": Pod("monitoring", {"app.kubernetes.io/name": "grafana"}),
        "prometheus-in-a-namespace-claiming-monitorings-name": Pod(
            "attacker", dict(PROMETHEUS), {NAME_LABEL_OF_NAMESPACE: "monitoring"}
        ),
        "vmagent-in-the-labelled-namespace": Pod(
            "metrics", {"app": "vmagent"}, {"team": "observability", "env": "prod"}
        ),
        "vmagent-in-a-namespace-with-one-of-the-labels": Pod("metrics", {"app": "vmagent"}, {"team": "observability"}),
        "pod-elsewhere-with-the-pools-labels": Pod("attacker", dict(own_labels)),
        # Pods of the pool's namespace are trusted with the pool's labels: the namespace is the boundary.
        "pod-in-the-pools-namespace-with-the-pools-labels": Pod(POOL_NAMESPACE, dict(own_labels)),
    }[who]


@dataclass(frozen=True)
class Case:
    who: str
    port: int
    allowed: bool
    scrapers: bool = False  # the pool names NAMED_SCRAPERS (else: the default, none)
    protocol: str = "TCP"

    @property
    def id(self) -> str:
        return f"{'named' if self.scrapers else 'default'}:{self.who}:{self.protocol}/{self.port}"


CASES = [
    # by default: the pool's own pods, on any port, and nobody else
    Case("own-router", ENGINE_PORT, True),
    Case("own-router", KV_PORT, True),
    Case("own-prefiller", KV_PORT, True),
    Case("own-decoder", ENGINE_PORT, True),
    Case("self-labelled-prometheus-elsewhere", ENGINE_PORT, False),
    Case("self-labelled-prometheus-in-the-pools-namespace", ENGINE_PORT, False),
    Case("prometheus-in-monitoring", ENGINE_PORT, False),
    Case("other-pools-router", ENGINE_PORT, False),
    Case("other-pools-decoder", KV_PORT, False),
    Case("pod-elsewhere-with-the-pools-labels", ENGINE_PORT, False),
    Case("pod-in-the-pools-namespace-with-the-pools-labels", ENGINE_PORT, True),
    # with named scrapers: each on the engine port, from its namespaces, with its labels
    Case("own-router", KV_PORT, True, scrapers=True),
    Case("prometheus-in-monitoring", ENGINE_PORT, True, scrapers=True),
    Case("prometheus-in-monitoring", KV_PORT, False, scrapers=True),
    Case("prometheus-in-monitoring", ENGINE_PORT, False, scrapers=True, protocol="UDP"),
    Case("self-labelled-prometheus-elsewhere", ENGINE_PORT, False, scrapers=True),
    Case("self-labelled-prometheus-in-the-pools-namespace", ENGINE_PORT, False, scrapers=True),
    Case("prometheus-in-a-namespace-claiming-monitorings-name", ENGINE_PORT, False, scrapers=True),
    Case("other-pod-in-monitoring", ENGINE_PORT, False, scrapers=True),
    Case("vmagent-in-the-labelled-namespace", ENGINE_PORT, True, scrapers=True),
    Case("vmagent-in-a-namespace-with-one-of-the-labels", ENGINE_PORT, False, scrapers=True),
    Case("other-pools-router", ENGINE_PORT, False, scrapers=True),
]


@pytest.mark.parametrize("role", ENGINE_ROLES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_who_reaches_the_engines(case: Case, role: str) -> None:
    children = render(scrapers=NAMED_SCRAPERS) if case.scrapers else OWN
    target = pod_of(children, role)
    assert admitted(policies(children), target, source(case.who), case.port, case.protocol) is case.allowed


def test_the_policy_covers_the_pools_engines_and_nothing_else() -> None:
    """The router takes clients' requests (it checks them itself); other pools' engines have their own policy."""
    (policy,) = policies(OWN)
    selected = {role: selects(policy["spec"]["podSelector"], pod_of(OWN, role).labels)
                for role in ("router", "prefiller", "decoder")}  # fmt: skip
    assert selected == {"router": False, "prefiller": True, "decoder": True}
    assert not selects(policy["spec"]["podSelector"], pod_of(OTHER, "decoder").labels)
    stranger = source("self-labelled-prometheus-elsewhere")
    assert admitted(policies(OWN), pod_of(OWN, "router"), stranger, 8080)
    # each pool's engines admit their own pool's pods, not the other's
    both = policies(OWN) + policies(OTHER)
    assert admitted(both, pod_of(OTHER, "decoder"), pod_of(OTHER, "router"), ENGINE_PORT)
    assert not admitted(both, pod_of(OTHER, "decoder"), pod_of(OWN, "router"), ENGINE_PORT)


# --- NIXL's side channel between the pool's engines ---------------------------------------------------


def side_channel_port(children: list[dict[str, Any]], role: str) -> int:
    """The port the role's engines listen on for NIXL's handshake: the declared containerPort, which is the
    port vLLM reads from VLLM_NIXL_SIDE_CHANNEL_PORT."""
    (deployment,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith(f"-{role}")]
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = [p["containerPort"] for p in vllm["ports"] if p["name"] == "nixl-side"]
    env = {entry["name"]: entry for entry in vllm["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(port)}
    return int(port)


@pytest.mark.parametrize(
    ("source_role", "target_role"),
    [("decoder", "prefiller"), ("prefiller", "decoder")],
    ids=["decoder-pulls-from-the-prefiller", "prefiller-pushes-to-the-decoder"],
)
def test_the_pools_engines_reach_each_others_nixl_side_channel(source_role: str, target_role: str) -> None:
    """The sample pool runs on GPUs, so NixlConnector hands turn 1's KV over: the decoder connects to the
    prefiller's side channel (the remote_host and remote_port the prefiller advertises); in NIXL's push mode
    the prefiller connects to the decoder's. The policy must admit both, and only the pool's own pods."""
    port = side_channel_port(OWN, target_role)
    target, own_source = pod_of(OWN, target_role), pod_of(OWN, source_role)
    assert port != ENGINE_PORT
    assert admitted(policies(OWN), target, own_source, port)
    assert not admitted(policies(OWN), target, pod_of(OTHER, source_role), port)
    assert not admitted(policies(OWN), target, source("self-labelled-prometheus-in-the-pools-namespace"), port)
    with_scrapers = render(scrapers=NAMED_SCRAPERS)
    assert not admitted(policies(with_scrapers), pod_of(with_scrapers, target_role), source("prometheus-in-monitoring"),
                        side_channel_port(with_scrapers, target_role))  # fmt: skip
    # The check above is what fails if the pool's own pods are ever admitted on the engine port alone.
    narrowed = copy.deepcopy(policies(OWN))
    for policy in narrowed:
        for rule in policy["spec"]["ingress"]:
            rule["ports"] = [{"protocol": "TCP", "port": ENGINE_PORT}]
    assert admitted(narrowed, target, own_source, ENGINE_PORT)
    assert not admitted(narrowed, target, own_source, port)
