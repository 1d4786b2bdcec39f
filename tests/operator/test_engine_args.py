"""The vLLM command line and environment the operator renders for each engine role, and the extraArgs it refuses.

Three decisions, each checked here on the rendered Deployments:

- every engine role runs with ``--no-async-scheduling`` (vLLM 0.32 turns async scheduling on by default on
  CUDA: two steps in flight, which coserve's scheduler and layer safepoints do not support);
- every engine container runs vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: vLLM 0.32 picks its V2
  runner on CUDA whenever Triton is installed, and coserve's preemption does not support it), and a user's
  env entry cannot change that;
- a pool whose handoff is NixlConnector (both roles on GPUs) tells each engine its own pod's address for
  NIXL's side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``; vLLM's default, localhost, is advertised to the
  decoder in another pod, which then connects to itself) and names the side channel's port;
- extraArgs may not set a flag the operator renders: vLLM keeps a repeated flag's last value, and the
  user's arguments come last, so one would silently replace coserve's. Refused in every spelling vLLM reads
  (``tests/operator/test_engine_args_vllm.py`` checks the spellings against vLLM's own parser).
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLES
from coserve.api import parse_pool
from coserve.api.parse import parse_profile
from coserve.api.problems import InvalidInput, Problem
from coserve.api.spec import OPERATOR_ENGINE_FLAGS, V2_RUNNER_ENV, V2_RUNNER_OFF
from coserve.engine.rendered import without_gpus
from coserve.operator.reconcile import reconcile
from coserve.operator.resources import ENGINE_CONTAINER, NIXL_SIDE_CHANNEL_PORT, build_children, engine_args
from coserve.provisioning import plan_for
from pool_builders import sample_pool

GPU: dict[str, Any] = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
CPU: dict[str, Any] = {"resources": {"limits": {"cpu": "8"}}}
# CPU prefillers, GPU decoders: no NixlConnector (it needs GPUs on both sides)
MIXED: dict[str, Any] = {**GPU, "prefiller": {"resources": {"requests": {"cpu": "4"}}}}
ENGINES = {"gpu": GPU, "cpu": CPU, "mixed": MIXED}
ROLES = ("prefiller", "decoder")
HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_PORT_NAME = "nixl-side"


def pool(engine: dict[str, Any]) -> dict[str, Any]:
    document = sample_pool()
    document["spec"]["engine"] = copy.deepcopy(engine)
    return document


def render(document: dict[str, Any]) -> list[dict[str, Any]]:
    parsed = parse_pool(document)
    return build_children(parsed, plan_for(parsed.spec))


def container(children: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (deployment,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"chat-{role}"]
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    return vllm  # type: ignore[no-any-return]


def env_of(vllm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in vllm["env"]}


def side_ports(vllm: dict[str, Any]) -> list[dict[str, Any]]:
    return [port for port in vllm["ports"] if port["name"] == SIDE_PORT_NAME]


def refusal(document: dict[str, Any]) -> list[Problem]:
    with pytest.raises(InvalidInput) as raised:
        parse_pool(document)
    return raised.value.problems


# --- async scheduling ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES, ids=str)
@pytest.mark.parametrize("role", ROLES)
def test_every_engine_role_runs_without_async_scheduling(engine: str, role: str) -> None:
    args = container(render(pool(ENGINES[engine])), role)["args"]
    assert args.count("--no-async-scheduling") == 1
    assert "--async-scheduling" not in args


# --- the V1 model runner --------------------------------------------------------------------------

EXAMPLE_POOLS = sorted(EXAMPLES.glob("pool*.yaml"))


def test_the_model_runner_variable_is_the_one_vllm_reads() -> None:
    assert (V2_RUNNER_ENV, V2_RUNNER_OFF) == ("VLLM_USE_V2_MODEL_RUNNER", "0")


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
@pytest.mark.parametrize("path", EXAMPLE_POOLS, ids=lambda path: path.name)
def test_every_engine_of_every_example_runs_the_v1_model_runner(path: Path, variant: str) -> None:
    document = yaml.safe_load(path.read_text())
    parsed = parse_pool(document if variant == "gpu" else without_gpus(document))
    profile = parse_profile(yaml.safe_load((EXAMPLES / "profile.yaml").read_text()))
    engines = [
        child
        for child in build_children(parsed, plan_for(parsed.spec, profile))
        if child["kind"] == "Deployment" and child["metadata"]["labels"]["coserve.dev/role"] in ROLES
    ]
    assert sorted(child["metadata"]["labels"]["coserve.dev/role"] for child in engines) == sorted(ROLES)
    for child in engines:
        (vllm,) = [c for c in child["spec"]["template"]["spec"]["containers"] if c["name"] == ENGINE_CONTAINER]
        assert [entry for entry in vllm["env"] if entry["name"] == V2_RUNNER_ENV] == [
            {"name": V2_RUNNER_ENV, "value": V2_RUNNER_OFF}
        ], child["metadata"]["name"]


@pytest.mark.parametrize("value", [V2_RUNNER_OFF, "1"])
@pytest.mark.parametrize("where", ["engine", "prefiller", "decoder"])
def test_a_users_env_entry_may_not_choose_the_model_runner(where: str, value: str) -> None:
    engine: dict[str, Any] = copy.deepcopy(GPU)
    entries = [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": V2_RUNNER_ENV, "value": value}]
    (engine if where == "engine" else engine.setdefault(where, {}))["env"] = entries
    path = "spec.engine" if where == "engine" else f"spec.engine.{where}"

    (problem,) = refusal(pool(engine))
    assert problem.path == f"{path}.env[1].name"
    assert problem.reason.startswith("is set by the operator") and V2_RUNNER_ENV in problem.reason


# --- NIXL's side channel ---------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_a_nixl_pool_gives_each_engine_its_pods_address_for_the_side_channel(role: str) -> None:
    vllm = container(render(pool(GPU)), role)
    env = env_of(vllm)
    assert env[HOST_ENV] == {"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env[PORT_ENV] == {"name": PORT_ENV, "value": str(NIXL_SIDE_CHANNEL_PORT)}
    # the port vLLM listens on is the one the pod declares: one constant renders both
    assert side_ports(vllm) == [{"name": SIDE_PORT_NAME, "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"}]
    assert NIXL_SIDE_CHANNEL_PORT == 5600  # vLLM's default: a pod whose variable is lost still listens there


@pytest.mark.parametrize("engine", ["cpu", "mixed"])
@pytest.mark.parametrize("role", ROLES)
def test_pools_without_the_nixl_handoff_render_no_side_channel(engine: str, role: str) -> None:
    vllm = container(render(pool(ENGINES[engine])), role)
    assert not {HOST_ENV, PORT_ENV} & set(env_of(vllm))
    assert side_ports(vllm) == []


def test_a_users_side_channel_variables_replace_the_operators_and_the_port_follows() -> None:
    """A role's own port moves the variable and the declared port together; the other role keeps the default."""
    engine = {
        **GPU,
        "env": [{"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
        "decoder": {"env": [{"name": PORT_ENV, "value": "5700"}]},
    }
    children = render(pool(engine))
    decoder, prefiller = container(children, "decoder"), container(children, "prefiller")
    for vllm in (decoder, prefiller):
        names = [entry["name"] for entry in vllm["env"]]
        assert names.count(HOST_ENV) == 1 and names.count(PORT_ENV) == 1
        assert env_of(vllm)[HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env_of(decoder)[PORT_ENV]["value"] == "5700"
    assert [port["containerPort"] for port in side_ports(decoder)] == [5700]
    assert [port["containerPort"] for port in side_ports(prefiller)] == [NIXL_SIDE_CHANNEL_PORT]


def test_a_side_channel_port_the_operator_cannot_read_declares_no_port() -> None:
    """From a ConfigMap, the port is known only in the pod: no containerPort rather than a wrong one."""
    from_config = {"configMapKeyRef": {"name": "nixl", "key": "port"}}
    vllm = container(render(pool({**GPU, "env": [{"name": PORT_ENV, "valueFrom": from_config}]})), "decoder")
    assert env_of(vllm)[PORT_ENV] == {"name": PORT_ENV, "valueFrom": from_config}
    assert side_ports(vllm) == []
    assert [port["name"] for port in vllm["ports"]] == ["http"]


# --- extraArgs may not set what the operator renders -----------------------------------------------


@pytest.mark.parametrize("engine", ENGINES, ids=str)
@pytest.mark.parametrize("role", ROLES)
def test_the_flags_extra_args_may_not_set_are_exactly_the_ones_rendered(engine: str, role: str) -> None:
    """One list renders the flags and refuses them: the operator's part of the command line is that list."""
    args = engine_args(parse_pool(pool(ENGINES[engine])).spec, role)  # type: ignore[arg-type]
    assert [arg for arg in args if arg.startswith("--")] == list(OPERATOR_ENGINE_FLAGS)


# (extraArgs, the index at fault, the flag named): each spelling vLLM's parser reads as a flag coserve renders
REFUSED = [
    (["--max-model-len", "8192", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], 2,
     "--kv-transfer-config"),
    (['--kv-transfer-config={"kv_connector":"NixlConnector"}'], 0, "--kv-transfer-config"),
    (["--kv_transfer_config", "{}"], 0, "--kv-transfer-config"),  # vLLM reads _ as -
    (["--kv-transfer-config.kv_role", "kv_both"], 0, "--kv-transfer-config"),  # replaces the whole config
    (["--kv-transfer", "{}"], 0, "--kv-transfer-config"),  # argparse takes an unambiguous abbreviation
    (["--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"], 0, "--scheduler-cls"),
    (["--worker-cls=auto"], 0, "--worker-cls"),
    (["--enforce-eager", "--middleware", "my.Middleware"], 1, "--middleware"),
    (["--model", "Qwen/Qwen3-0.6B"], 0, "--model"),
    (["--served_model_name", "other"], 0, "--served-model-name"),
    (["--port=9000"], 0, "--port"),
    (["--tensor-parallel-size", "2"], 0, "--tensor-parallel-size"),
    (["-tp", "2"], 0, "--tensor-parallel-size"),
    (["-tp=2"], 0, "--tensor-parallel-size"),
    (["--async-scheduling"], 0, "--no-async-scheduling"),
    (["--no-async-scheduling"], 0, "--no-async-scheduling"),
    (["--async"], 0, "--no-async-scheduling"),
]  # fmt: skip


@pytest.mark.parametrize(("extra_args", "index", "flag"), REFUSED, ids=lambda value: str(value)[:40])
@pytest.mark.parametrize("where", ["engine", "prefiller", "decoder"])
def test_extra_args_that_set_a_rendered_flag_are_refused_with_the_field_path(
    extra_args: list[str], index: int, flag: str, where: str
) -> None:
    engine: dict[str, Any] = copy.deepcopy(GPU)
    (engine if where == "engine" else engine.setdefault(where, {}))["extraArgs"] = extra_args
    path = "spec.engine" if where == "engine" else f"spec.engine.{where}"

    (problem,) = refusal(pool(engine))
    assert problem.path == f"{path}.extraArgs[{index}]"
    assert problem.reason.startswith(f"'{flag}' is set by coserve (")
    assert OPERATOR_ENGINE_FLAGS[flag] in problem.reason  # what to use instead


def test_every_offending_argument_is_named() -> None:
    engine = {"extraArgs": ["--port", "9000", "--max-model-len", "8192", "--model=x"],
              "decoder": {"extraArgs": ["--scheduler-cls", "x"]}}  # fmt: skip
    assert [p.path for p in refusal(pool(engine))] == [
        "spec.engine.extraArgs[0]",
        "spec.engine.extraArgs[4]",
        "spec.engine.decoder.extraArgs[0]",
    ]


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--max-model-len", "32768", "--enable-prefix-caching"],
        ["--gpu-memory-utilization=0.9", "--enforce-eager"],
        ["--kv-cache-dtype", "fp8", "--max-num-seqs", "256"],
        ["--model-impl", "vllm"],  # longer than --model: another flag, not an abbreviation
        ["--data-parallel-size", "1", "--dtype", "bfloat16"],
        ["--override-generation-config", '{"temperature": 0.6}'],
    ],
    ids=lambda args: args[0],
)
def test_extra_args_that_set_other_flags_are_rendered_after_coserves(extra_args: list[str]) -> None:
    children = render(pool({**GPU, "extraArgs": extra_args}))
    for role in ROLES:
        args = container(children, role)["args"]
        assert args[-len(extra_args) :] == extra_args


def test_the_operator_reports_refused_extra_args_as_plan_valid_false() -> None:
    document = pool({**GPU, "decoder": {"extraArgs": ["--kv-transfer-config", "{}"]}})
    result = reconcile(document, {}, datetime(2026, 12, 3, tzinfo=UTC))
    assert not result.plan_valid and result.actions == ()
    (condition,) = [c for c in result.status["conditions"] if c["type"] == "PlanValid"]
    assert condition["status"] == "False" and condition["reason"] == "InvalidSpec"
    assert condition["message"].startswith("spec.engine.decoder.extraArgs[0]: '--kv-transfer-config' is set by coserve")


def test_every_engine_renders_the_safepoint_threshold_from_its_tightest_online_ttft() -> None:
    """Steps the cost model predicts shorter than 2 % of the tightest online TTFT objective run unchecked; the
    offline class's objective does not count. The connector reads the rendered value as it parses its settings."""
    import json

    from coserve.engine.rendered import engine_container
    from coserve.scheduling.preemption import EXIT_SHARE_OF_TTFT, safepoint_min_step_s

    assert safepoint_min_step_s([0.8, 3.0]) == pytest.approx(EXIT_SHARE_OF_TTFT * 0.8)
    assert safepoint_min_step_s([]) == 0.0
    for path in sorted(EXAMPLES.glob("pool*.yaml")):
        document = yaml.safe_load(path.read_text())
        if (document["spec"].get("profile") or {}).get("configMapRef") is not None:
            continue  # rendering reads the profile from the cluster
        pool = parse_pool(document)
        spec = pool.spec
        offline = spec.offline.class_name if spec.offline.enabled else None
        tightest = min(c.ttft_slo_ms for c in spec.priority_classes if c.name != offline) / 1000
        objects = build_children(pool, plan_for(spec))
        for role in ("prefiller", "decoder"):
            args = engine_container(objects, role)["args"]  # type: ignore[arg-type]
            transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
            coserve = next(
                c for c in [transfer, *transfer.get("kv_connector_extra_config", {}).get("connectors", [])]
                if c.get("kv_connector") == "CoServeConnector"
            )  # fmt: skip
            rendered = coserve["kv_connector_extra_config"]["safepoint_min_step_s"]
            assert rendered == pytest.approx(EXIT_SHARE_OF_TTFT * tightest), (path.name, role)
