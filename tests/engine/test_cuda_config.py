"""Every rendered GPU engine resolves, through vLLM's own configuration code on the CUDA platform, to what
coserve relies on: one step in flight, its scheduler and worker, its KV connectors, the CUDA-graph mode
the README describes, and NIXL's side channel on the pod's own address.

vLLM on CUDA is configured differently from vLLM on CPU: on CUDA vLLM 0.32 turns async scheduling on by
default (two steps in flight), while the CPU platform forces it off, so no engine test on this machine
can see it. ``tests/cuda_config_probe.py`` runs vLLM's parser, ``EngineArgs`` and ``VllmConfig`` on an
H100's platform with no device (its docstring lists the substitutions: the platform's device answers, one
empty compiled module, and the model's and connectors' imports done first under the CPU platform). The
only change made here to a rendered container is its model: the tiny Llama in place of the HF id, with
the same ``--max-model-len``; and the pod IP that the kubelet fills in from the downward API.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coserve.cli.manifest import load_pool, load_profile, read_file
from coserve.engine.rendered import connector_names, engine_container
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model
from coserve.provisioning import plan_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "cuda_config_probe.py"
POD_IP = "10.42.7.19"  # what the kubelet would put in a status.podIP fieldRef
GPU = "nvidia.com/gpu"
PROFILE = ROOT / "examples" / "profile-h100-published.yaml"  # for an example whose profile is a ConfigMap


def render(path: Path) -> list[dict[str, Any]]:
    """What `coserve render` prints for the example (with a profile file where it names a ConfigMap)."""
    coserve = Path(sys.executable).with_name("coserve")
    profile = ["--profile", str(PROFILE)] if "configMapRef" in path.read_text() else []
    result = subprocess.run(
        [str(coserve), "render", str(path), *profile, "-o", "json"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["items"])


def gpu_examples() -> list[Path]:
    """The example pools whose engines run on GPUs (explicitly, or by the API's default resources)."""
    found = []
    for path in sorted((ROOT / "examples").glob("pool*.yaml")):
        text = path.read_text()
        if GPU in text or "resources" not in yaml.safe_load(text)["spec"].get("engine", {}):
            found.append(path)
    return found


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: literal values, and the pod IP from the downward API.

    Secret references (the HF token) have no value here and are left out."""
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif (entry.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = POD_IP
    return env


def max_model_len(args: list[str]) -> int | None:
    return int(args[args.index("--max-model-len") + 1]) if "--max-model-len" in args else None


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(example/role, rendered container, resolved config) for every GPU engine of every example."""
    rendered: list[tuple[str, dict[str, Any]]] = []
    for path in gpu_examples():
        objects = render(path)
        for role in ("prefiller", "decoder"):
            rendered.append((f"{path.name}/{role}", engine_container(objects, role)))
    lengths = {max_model_len(list(c["args"])) or 0 for _, c in rendered}
    model = build_tiny_model(tmp_path_factory.mktemp("models"), TinyModelSpec(max_position_embeddings=max(lengths)))
    launches = []
    for _, container in rendered:
        args = list(container["args"])
        args[args.index("--model") + 1] = str(model)
        launches.append({"args": args, "env": pod_env(container)})
    out = tmp_path_factory.mktemp("resolved") / "configs.json"
    result = subprocess.run(
        [sys.executable, str(PROBE), str(out)], input=json.dumps(launches), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    configs = json.loads(out.read_text())
    return [(name, container, config) for (name, container), config in zip(rendered, configs, strict=True)]


def test_every_example_renders_gpu_engines() -> None:
    assert {p.name for p in gpu_examples()} >= {"pool.yaml", "pool-tiered.yaml", "pool-production.yaml"}


def test_the_resolution_is_cudas(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    for name, _, config in resolved:
        assert config["platform"] == "NonNvmlCudaPlatform", name


def test_one_step_in_flight(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """coserve's scheduler, safepoints, rollback and KV copies follow one step at a time; on CUDA vLLM would
    keep two in flight unless the rendering turns async scheduling off (and the scheduler refuses otherwise)."""
    for name, _, config in resolved:
        assert config["async_scheduling"] is False, f"{name}: vLLM on CUDA resolves async scheduling on"
        assert config["max_concurrent_batches"] == 1, name


def test_scheduler_and_worker(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    for name, _, config in resolved:
        assert config["scheduler_cls"] == "coserve.engine.scheduler.TDGScheduler", name
        assert config["worker_cls"] == "coserve.engine.worker.SafepointGPUWorker", name


def test_cuda_graphs_as_the_readme_says(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """FULL_AND_PIECEWISE (decode steps as full graphs, anything with prefill piecewise, where safepoints run)
    unless coserve's connector reloads KV per layer (host offload or the shm handoff): then every step is
    piecewise. ``--enforce-eager`` turns graphs off."""
    for name, container, config in resolved:
        args = list(container["args"])
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        coserve = next(c for c in [transfer, *transfer.get("kv_connector_extra_config", {}).get("connectors", [])]
                       if c.get("kv_connector") == "CoServeConnector")  # fmt: skip
        extra = coserve.get("kv_connector_extra_config", {})
        reloads = extra.get("host_memory_bytes", 0) > 0 or extra.get("handoff_backend") == "shm"
        expected = "PIECEWISE" if reloads else "FULL_AND_PIECEWISE"
        if "--enforce-eager" in args:
            expected = "NONE"
        assert config["cudagraph_mode"] == expected, name


def aggregated_examples() -> set[str]:
    """The examples whose plan takes aggregated engines: their engines hand no KV over (no NIXL, vLLM's kv_both)."""
    out = set()
    for path in gpu_examples():
        profile = load_profile(read_file(str(PROFILE))) if "configMapRef" in path.read_text() else None
        if plan_for(load_pool(read_file(str(path))).spec, profile).aggregated:
            out.add(path.name)
    return out


def test_kv_connectors_by_role(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """Both roles on GPUs: vLLM's MultiConnector, coserve's connector first (safepoints) and NixlConnector
    after it (the handoff), each with the role's direction. An aggregated pool's engines: coserve's alone, both
    directions (its prefiller Deployment, at 0 replicas, is rendered the same)."""
    aggregated = aggregated_examples()
    assert aggregated and aggregated < {p.name for p in gpu_examples()}  # both kinds are checked
    for name, _, config in resolved:
        transfer = config["kv_transfer_config"]
        if name.split("/")[0] in aggregated:
            assert transfer["kv_role"] == "kv_both", name
            assert connector_names(transfer) == ["CoServeConnector"], name
            continue
        role = "kv_producer" if name.endswith("/prefiller") else "kv_consumer"
        assert transfer["kv_role"] == role, name
        assert connector_names(transfer) == ["CoServeConnector", "NixlConnector"], name
        assert {c["kv_role"] for c in transfer["kv_connector_extra_config"]["connectors"]} == {role}, name


def test_nixl_side_channel_on_the_pod_ip(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """NixlConnector's side channel is where a prefiller listens and what it tells a decoder to connect to;
    vLLM's default, ``localhost``, makes a decoder in another pod connect to itself. Aggregated engines run no
    NIXL, and get neither."""
    aggregated = aggregated_examples()
    for name, container, config in resolved:
        if name.split("/")[0] in aggregated:
            assert "NIXL_SIDE_CHANNEL_HOST" not in pod_env(container), name
            continue
        assert config["nixl_side_channel_host"] == POD_IP, (
            f"{name}: the side channel binds {config['nixl_side_channel_host']}"
        )
        ports = {p["containerPort"] for p in container.get("ports") or []}
        assert config["nixl_side_channel_port"] in ports, f"{name}: the side-channel port is not a container port"


def test_the_v1_model_runner_as_the_readme_says(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """With Triton present, as on the CUDA image, vLLM 0.32 resolves its V2 model runner, which calls the KV
    connectors outside any ``finally``; coserve supports V1, and the rendering says so
    (``VLLM_USE_V2_MODEL_RUNNER=0``) for every engine."""
    for name, container, config in resolved:
        assert config["use_v2_model_runner"] is False, f"{name}: vLLM on CUDA resolves the V2 model runner"
        assert pod_env(container).get("VLLM_USE_V2_MODEL_RUNNER") == "0", name


def test_no_speculative_decoding_and_one_data_parallel_rank(
    resolved: list[tuple[str, dict[str, Any], dict[str, Any]]],
) -> None:
    """Drafting runs inside the sampling step with the connector bound, and each DP rank is an engine core of its
    own: coserve supports neither, and no example renders them."""
    for name, _, config in resolved:
        assert config["speculative_config"] is None, name
        assert config["data_parallel_size"] == 1, name


def test_compiled_unless_eager(resolved: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """torch.compile (vLLM's own compilation, under which the connector's per-layer calls still run), or none
    with ``--enforce-eager``."""
    for name, container, config in resolved:
        expected = "NONE" if "--enforce-eager" in container["args"] else "VLLM_COMPILE"
        assert config["compilation_mode"] == expected, name
