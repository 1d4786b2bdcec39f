"""coserve.engine.rendered: a rendered engine container turned into a launch here. Pure: no engine starts."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest
import yaml

from coserve.cli.manifest import load_planned
from coserve.engine.rendered import (
    Substitutions,
    config_files,
    connector_names,
    engine_container,
    example_connector,
    flag_values,
    local_launch,
    substitute_transfer,
    substitution_notes,
)
from coserve.operator.resources import build_children
from rendered_cpu_engine import cpu_variant

ROOT = Path(__file__).resolve().parents[2]
GPU_WORKER = "coserve.engine.worker.SafepointGPUWorker"
CPU_WORKER = "coserve.engine.worker.SafepointCPUWorker"
CFG = Path("/work/cfg")
TOKEN = Path("/work/token")


def coserve_child(role: str = "kv_consumer") -> dict[str, Any]:
    return {"kv_connector": "CoServeConnector", "kv_connector_module_path": "coserve.engine.connector",
            "kv_role": role, "kv_connector_extra_config": {"coserve_config": "/etc/coserve/engine.json"}}  # fmt: skip


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": list(children)}}  # fmt: skip


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def container(transfer: dict[str, Any] | None = None, env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A decoder container as the operator renders one (the GPU rendering unless ``transfer`` says otherwise)."""
    transfer = transfer or multi(coserve_child(), NIXL)
    args = ["--model", "Org/Model", "--served-model-name", "m", "--port", "8000", "--enable-prefix-caching",
            "--worker-cls", GPU_WORKER, "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip
    return {
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": args,
        "env": env if env is not None else [{"name": "COSERVE_CONFIG", "value": "/etc/coserve/engine.json"}],
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/coserve"},
            {"name": "router-token", "mountPath": "/etc/coserve-token"},
        ],
    }


def subs(**changes: Any) -> Substitutions:
    return Substitutions(**{"model": "/work/model", "port": 9000, "mounts": {"config": CFG}, **changes})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_launch_runs_the_rendered_flags_with_model_port_and_host_substituted() -> None:
    launch = local_launch(container(), subs())

    transfer = json.loads(flag(launch.argv, "--kv-transfer-config"))
    assert launch.argv == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/work/model",
        "--served-model-name", "m", "--port", "9000", "--enable-prefix-caching", "--worker-cls", GPU_WORKER,
        "--kv-transfer-config", json.dumps(transfer), "--host", "127.0.0.1",
    ]  # fmt: skip
    local_config = {"coserve_config": "/work/cfg/engine.json"}
    assert transfer == multi({**coserve_child(), "kv_connector_extra_config": local_config}, NIXL)
    assert launch.env == {"COSERVE_CONFIG": "/work/cfg/engine.json", "HF_HUB_OFFLINE": "1"}
    assert launch.connectors == ["CoServeConnector", "NixlConnector"]


@pytest.mark.parametrize(
    ("value", "local"),
    [
        ("/etc/coserve/engine.json", "/work/cfg/engine.json"),
        ("/etc/coserve", "/work/cfg"),
        ('{"path":"/etc/coserve"}', '{"path":"/work/cfg"}'),
        ("/etc/coserve-token/token", "/work/token/token"),  # the longer mount, not the ConfigMap's plus "-token"
        ("/etc/coserve-other/file", "/etc/coserve-other/file"),  # no such mount: unchanged
        ("/etc/coservefile", "/etc/coservefile"),
        ("/etc/coserve/a:/etc/coserve-token/b", "/work/cfg/a:/work/token/b"),
        ("relative/etc/coserve/x", "relative/work/cfg/x"),  # a mount path anywhere a component ends, as rendered
    ],
)
def test_mount_paths_become_their_folders_where_a_path_component_ends(value: str, local: str) -> None:
    rendered = container(env=[{"name": "V", "value": value}, {"name": "S", "valueFrom": {"secretKeyRef": {}}}])

    launch = local_launch(rendered, subs(mounts={"config": CFG, "router-token": TOKEN}))

    assert launch.env == {"V": local, "HF_HUB_OFFLINE": "1"}  # a valueFrom variable is the kubelet's: left out


def test_without_mounts_no_path_changes() -> None:
    launch = local_launch(container(), subs(mounts={}))

    assert launch.env["COSERVE_CONFIG"] == "/etc/coserve/engine.json"
    assert "/etc/coserve/engine.json" in flag(launch.argv, "--kv-transfer-config")


@pytest.mark.parametrize(
    ("transfer", "changes", "expected"),
    [
        # NixlConnector's stand-in takes its place and its kv_role; coserve's connector is untouched
        (multi(coserve_child(), NIXL), {"nixl": example_connector(Path("/kv"))},
         multi(coserve_child(), {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"shared_storage_path": "/kv"}})),
        # the baseline: safepoints off in coserve's connector only, its other settings kept
        (multi(coserve_child(), NIXL), {"safepoints": False},
         multi({**coserve_child(), "kv_connector_extra_config": {"coserve_config": "/etc/coserve/engine.json",
                                                                 "safepoints": False}}, NIXL)),
        # the CPU rendering: coserve's connector alone, not in a MultiConnector
        (coserve_child(), {"nixl": example_connector(Path("/kv"))}, coserve_child()),
        (coserve_child(), {"safepoints": False},
         {**coserve_child(), "kv_connector_extra_config": {"coserve_config": "/etc/coserve/engine.json",
                                                           "safepoints": False}}),
        (multi(coserve_child(), NIXL), {}, multi(coserve_child(), NIXL)),
        # NixlConnector kept, a setting added to it (the KV in host memory); a stand-in gets none of it
        (multi(coserve_child(), NIXL), {"nixl_settings": {"kv_buffer_device": "cpu"}},
         multi(coserve_child(), {**NIXL, "kv_buffer_device": "cpu"})),
        (multi(coserve_child(), NIXL), {"nixl_settings": {"kv_buffer_device": "cpu"},
                                        "nixl": example_connector(Path("/kv"))},
         multi(coserve_child(), {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"shared_storage_path": "/kv"}})),
    ],
)  # fmt: skip
def test_connectors_change_in_place_only_where_asked(
    transfer: dict[str, Any], changes: dict[str, Any], expected: dict[str, Any]
) -> None:
    before = json.dumps(transfer)

    assert substitute_transfer(transfer, subs(**changes)) == expected
    assert json.dumps(transfer) == before  # the rendering itself is not changed


def test_the_pod_ip_is_the_host_and_fills_what_the_downward_api_sets_from_it() -> None:
    env = [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5600"}]  # fmt: skip

    in_pod = local_launch(container(env=env), subs(pod_ip="10.0.0.7"))
    loopback = local_launch(container(env=env), subs())

    assert flag(in_pod.argv, "--host") == "10.0.0.7" and flag(loopback.argv, "--host") == "127.0.0.1"
    assert in_pod.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7" and "NODE" not in in_pod.env
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in loopback.env  # no pod IP: vLLM's default, as before
    assert in_pod.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == loopback.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST (status.podIP) -> 10.0.0.7" in in_pod.substitutions


def test_the_stand_in_of_nixl_is_launched_in_its_position() -> None:
    launch = local_launch(container(), subs(nixl=example_connector(Path("/kv"))))

    assert launch.connectors == ["CoServeConnector", "ExampleConnector"]
    assert connector_names(json.loads(flag(launch.argv, "--kv-transfer-config"))) == launch.connectors


def test_worker_and_served_alias_are_substituted_only_when_asked() -> None:
    plain = local_launch(container(), subs()).argv
    cpu = local_launch(container(), subs(worker_cls=CPU_WORKER, served_alias="tiny")).argv
    same_name = local_launch(container(), subs(served_alias="m")).argv

    assert flag(plain, "--worker-cls") == GPU_WORKER and flag(cpu, "--worker-cls") == CPU_WORKER
    assert cpu[cpu.index("--served-model-name") + 1 :][:3] == ["m", "tiny", "--port"]
    assert same_name.count("m") == 1  # the alias is the rendered name already: not twice


def test_the_router_token_variable_is_left_out_only_when_asked() -> None:
    env = [{"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"}]
    mounts = {"config": CFG, "router-token": TOKEN}

    kept = local_launch(container(env=env), subs(mounts=mounts))
    left_out = local_launch(container(env=env), subs(mounts=mounts, router_token=False))

    assert kept.env["COSERVE_ROUTER_TOKEN_FILE"] == str(TOKEN / "token")
    assert "COSERVE_ROUTER_TOKEN_FILE" not in left_out.env


def test_each_substitution_made_is_noted_and_no_other() -> None:
    env = [{"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"}]
    asked = subs(served_alias="tiny", nixl=example_connector(Path("/kv")), safepoints=False, router_token=False)

    every = substitution_notes(container(env=env), replace(asked, worker_cls=CPU_WORKER))
    fewest = substitution_notes(container(env=env), subs(model="Org/Model", mounts={}, worker_cls=GPU_WORKER))

    assert every == [
        "python3 -> this interpreter",
        "--model Org/Model -> /work/model",
        "--port -> a free port, plus --host 127.0.0.1",
        f"--worker-cls {GPU_WORKER} -> {CPU_WORKER}",
        "--served-model-name + alias 'tiny'",
        "volume 'config' at /etc/coserve -> /work/cfg",
        "COSERVE_ROUTER_TOKEN_FILE left out: the engine trusts each request's class",
        "NixlConnector -> ExampleConnector (same position, same kv_role)",
        "\"safepoints\": false in CoServeConnector's settings",
    ]  # fmt: skip
    assert fewest == ["python3 -> this interpreter", "--port -> a free port, plus --host 127.0.0.1"]
    assert local_launch(container(env=env), asked).substitutions == substitution_notes(container(env=env), asked)


def test_another_command_or_an_unmounted_volume_is_refused() -> None:
    with pytest.raises(ValueError, match=r"runs \['vllm', 'serve'\]"):
        local_launch({**container(), "command": ["vllm", "serve"]}, subs())
    with pytest.raises(ValueError, match=r"mounts no volume model-cache; it mounts \['config', 'router-token'\]"):
        local_launch(container(), subs(mounts={"model-cache": Path("/cache")}))


@pytest.mark.parametrize(
    ("args", "pairs"),
    [
        (["--a", "1", "--b", "--c", "x"], [("--a", "1"), ("--b", None), ("--c", "x")]),
        (["--a", "1", "--b"], [("--a", "1"), ("--b", None)]),
        ([], []),
    ],
)
def test_flag_values_pairs_each_flag_with_its_value(args: list[str], pairs: list[tuple[str, str | None]]) -> None:
    assert list(flag_values(args)) == pairs


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu-rendering", "cpu-rendering"])
@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_a_real_rendering_keeps_every_flag_and_value_but_the_substituted(role: str, cpu: bool, tmp_path: Path) -> None:
    """The operator's own objects for examples/pool-tiered.yaml (or its CPU variant: no GPU resources)."""
    manifest = tmp_path / "pool.yaml"
    document = yaml.safe_load((ROOT / "examples" / "pool-tiered.yaml").read_text())
    manifest.write_text(yaml.safe_dump(cpu_variant(document) if cpu else document))
    objects = build_children(*itemgetter(0, 2)(load_planned(str(manifest), None)))
    rendered = engine_container(objects, role)
    assert "engine.json" in config_files(objects)

    launch = local_launch(rendered, subs(mounts={"config": CFG, "router-token": TOKEN}))

    before, after = dict(flag_values(rendered["args"])), dict(flag_values(launch.argv[3:]))
    assert list(after) == [*before, "--host"]
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {"--model", "--port", "--kv-transfer-config"}
    transfer = json.loads(flag(launch.argv, "--kv-transfer-config"))
    assert transfer == json.loads((before["--kv-transfer-config"] or "").replace("/etc/coserve/", "/work/cfg/"))
    assert launch.connectors == (["CoServeConnector"] if cpu else ["CoServeConnector", "NixlConnector"])
