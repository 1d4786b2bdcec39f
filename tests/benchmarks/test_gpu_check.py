"""The prepared GPU check (benchmarks/gpu/check.sh) without a GPU: its dry run, and its parts that need none.

No vLLM engine starts here: the dry run renders the decoder and prints the engine command lines the GPU
run would launch; ``GPUEngine`` is exercised against a stand-in server (a process that creates a
safepoint board and answers /health), because a real engine needs CUDA for this rendering.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from coserve.engine.layer_safepoints import RunAheadBound
from coserve.engine.safepoint import SafepointBoard, board_name

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"
GPU_DIR = ROOT / "benchmarks" / "gpu"
WORKER = "coserve.engine.worker.SafepointGPUWorker"


@pytest.fixture(scope="module")
def gpu_modules() -> Iterator[SimpleNamespace]:
    """benchmarks/gpu's two modules, imported as check.sh runs them (their folder first on sys.path)."""
    saved = list(sys.path)
    sys.path.insert(0, str(GPU_DIR))
    try:
        import gpu_check
        import rendered_engine

        yield SimpleNamespace(check=gpu_check, engine=rendered_engine)
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def dry_run() -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(CHECK), "--dry-run"], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def engine_argv(output: str, label: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if line.startswith(f"ENGINE_COMMAND[{label}]: ")]
    return shlex.split(line.split(": ", 1)[1])


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def transfer_children(argv: list[str]) -> list[dict[str, Any]]:
    transfer = json.loads(flag_value(argv, "--kv-transfer-config"))
    assert transfer["kv_connector"] == "MultiConnector"
    return list(transfer["kv_connector_extra_config"]["connectors"])


def test_check_sh_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(CHECK)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_check_sh_passes_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(CHECK)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


def test_the_dry_run_passes_and_prints_the_rendered_gpu_engine(dry_run: subprocess.CompletedProcess[str]) -> None:
    assert dry_run.returncode == 0, dry_run.stdout + dry_run.stderr
    assert "dry run passed" in dry_run.stderr
    for label in ("on", "off"):
        argv = engine_argv(dry_run.stdout, label)
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert flag_value(argv, "--worker-cls") == WORKER
        assert flag_value(argv, "--scheduler-cls") == "coserve.engine.scheduler.TDGScheduler"
        assert "--enforce-eager" not in argv, "the GPU check must run with CUDA graphs"
        assert flag_value(argv, "--host") == "127.0.0.1"
        children = transfer_children(argv)
        assert [c["kv_connector"] for c in children] == ["CoServeConnector", "NixlConnector"]
        coserve = children[0]["kv_connector_extra_config"]
        assert coserve["host_memory_bytes"] > 0, "kv_reload needs the host pool"
        assert coserve.get("safepoints", True) is (label == "on")
        assert Path(coserve["coserve_config"]).name == "engine.json"
        assert not coserve["coserve_config"].startswith("/etc/coserve/"), "the ConfigMap mount is substituted"
    assert "VLLM_SERVER_DEV_MODE=1" in dry_run.stdout


def test_the_dry_run_launches_every_flag_the_operator_renders(dry_run: subprocess.CompletedProcess[str]) -> None:
    rendered = subprocess.run(
        [sys.executable, "-m", "coserve", "render", str(ROOT / "examples" / "pool.yaml"), "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    (decoder,) = [
        o
        for o in json.loads(rendered.stdout)["items"]
        if o["kind"] == "Deployment" and o["metadata"]["labels"].get("coserve.dev/role") == "decoder"
    ]
    flags = {a for a in decoder["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--")}
    launched = {a for a in engine_argv(dry_run.stdout, "on") if a.startswith("--")}
    assert flags <= launched, f"rendered but not launched: {sorted(flags - launched)}"


def test_check_sh_rejects_an_unknown_argument() -> None:
    result = subprocess.run(["bash", str(CHECK), "--bogus"], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "unknown argument" in result.stderr


# --- the parts that need no GPU --------------------------------------------------------------------------------


def rendered_decoder(engine: ModuleType, env: list[dict[str, str]]) -> Any:
    connectors = [
        {"kv_connector": "CoServeConnector", "kv_connector_module_path": "coserve.engine.connector",
         "kv_role": "kv_consumer", "kv_connector_extra_config": {"coserve_config": "/etc/coserve/engine.json"}},
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    ]  # fmt: skip
    transfer = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"connectors": connectors}}  # fmt: skip
    args = ["--model", "Org/Model", "--served-model-name", "m", "--port", "8000", "--worker-cls", WORKER]
    container = {
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": [*args, "--kv-transfer-config", json.dumps(transfer)],
        "env": env,
        "volumeMounts": [{"name": "config", "mountPath": "/etc/coserve"}],
    }
    return engine.Rendered(container, {"engine.json": "{}"})


def test_nixl_is_replaced_in_place_and_only_the_config_mount_is_rewritten(
    gpu_modules: SimpleNamespace, tmp_path: Path
) -> None:
    engine = gpu_modules.engine
    env = [
        {"name": "COSERVE_CONFIG", "value": "/etc/coserve/engine.json"},
        {"name": "OTHER", "value": "/etc/coserve-other/file"},
        {"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"},
    ]
    launch = engine.plan_launch(
        rendered_decoder(engine, env), tmp_path / "model", tmp_path / "cfg",
        safepoints=True, substitute_nixl=True, kv_dir=tmp_path / "kv",
    )  # fmt: skip
    children = transfer_children(launch.argv)
    assert [c["kv_connector"] for c in children] == ["CoServeConnector", "ExampleConnector"]
    assert children[1]["kv_role"] == "kv_consumer"
    assert children[0]["kv_connector_extra_config"]["coserve_config"] == str(tmp_path / "cfg" / "engine.json")
    assert launch.env["COSERVE_CONFIG"] == str(tmp_path / "cfg" / "engine.json")
    assert launch.env["OTHER"] == "/etc/coserve-other/file"
    assert "COSERVE_ROUTER_TOKEN_FILE" not in launch.env  # the benchmark clients send no token
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in launch.env
    assert flag_value(launch.argv, "--model") == str(tmp_path / "model")
    assert launch.argv[launch.argv.index("--served-model-name") + 1 :][:2] == ["m", "tiny"]
    assert any("ExampleConnector" in s for s in launch.substitutions)


def test_a_rendering_with_enforce_eager_or_another_worker_is_refused(
    gpu_modules: SimpleNamespace, tmp_path: Path
) -> None:
    engine = gpu_modules.engine
    for bad in (["--enforce-eager"], ["--worker-cls", "coserve.engine.worker.SafepointCPUWorker"]):
        rendered = rendered_decoder(engine, [])
        rendered.container["args"] = [a for a in rendered.container["args"] if a not in ("--worker-cls", WORKER)] + bad
        with pytest.raises(ValueError, match=r"enforce-eager|worker"):
            engine.plan_launch(rendered, tmp_path, tmp_path, safepoints=True, substitute_nixl=False, kv_dir=tmp_path)


def test_the_log_facts_see_piecewise_graphs_in_tqdm_bars(gpu_modules: SimpleNamespace, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO Initializing a V1 LLM engine with config: model='m', dtype=torch.bfloat16, seed=0\n"
        "WARNING KV connector MultiConnector requires PIECEWISE CUDA graph mode due to layerwise async operations\n"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|#####| 33/67\r"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67\n"
        "INFO Graph capturing finished in 9 secs, took 0.30 GiB\n"
    )
    facts = gpu_modules.engine.log_facts(log)
    assert facts["captured"] == ["mixed prefill-decode, PIECEWISE"]
    assert facts["piecewise_captured"] and facts["override_to_piecewise_logged"]
    assert not facts["full_graphs_captured"] and not facts["cudagraphs_disabled"]
    assert facts["dtype"] == "torch.bfloat16"
    log.write_text(
        "Capturing CUDA graphs (decode, FULL): 100%\nCapturing CUDA graphs (mixed prefill-decode, PIECEWISE)\n"
    )
    assert gpu_modules.engine.log_facts(log)["full_graphs_captured"]


def test_only_a_failure_naming_nixl_or_ucx_swaps_the_connector(gpu_modules: SimpleNamespace) -> None:
    nixl_failed = gpu_modules.engine.nixl_failed
    assert nixl_failed("INFO NIXL is available\nRuntimeError: NIXL is not available")
    assert nixl_failed("ERROR ucp_init failed: UCX transport not found")
    assert not nixl_failed("INFO NIXL is available\ntorch.OutOfMemoryError: CUDA out of memory")


STAND_IN = """
import http.server, sys
from coserve.engine.safepoint import SafepointBoard
port = int(sys.argv[sys.argv.index("--port") + 1])
board = SafepointBoard.create("coserve-sp-standin" + str(port))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("stand-in engine up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_gpu_engine_finds_its_board_and_cleans_up(gpu_modules: SimpleNamespace, tmp_path: Path) -> None:
    engine = gpu_modules.engine
    port = engine.free_port()
    launch = engine.Launch([sys.executable, "-c", STAND_IN, "--port", str(port)], {}, [])
    with engine.GPUEngine(launch, tmp_path / "standin.log", startup_timeout_s=60) as running:
        assert running.base == f"http://127.0.0.1:{port}"
        # what preemption.measure_latency does with the engine it is given
        board = SafepointBoard.attach(board_name(running.engine_id))
        assert board is not None
        board.close()
        process = running._process
    assert process is not None and process.poll() is not None
    assert SafepointBoard.attach(f"coserve-sp-standin{port}") is None, "the board outlived its engine"


def test_gpu_engine_reports_an_engine_that_exits(gpu_modules: SimpleNamespace, tmp_path: Path) -> None:
    engine = gpu_modules.engine
    launch = engine.Launch([sys.executable, "-c", "print('no CUDA here'); raise SystemExit(3)", "--port", "1"], {}, [])
    with pytest.raises(engine.EngineStartError, match="exited with 3") as caught:
        engine.GPUEngine(launch, tmp_path / "dead.log", startup_timeout_s=60).__enter__()
    assert "no CUDA here" in caught.value.log_tail


def test_results_are_written_as_they_come_tagged_cuda(gpu_modules: SimpleNamespace, tmp_path: Path) -> None:
    check = gpu_modules.check
    args = SimpleNamespace(reps=5, samples=3, throughput_runs=2)
    results = check.Results(tmp_path, "NVIDIA H200, 143771 MiB")
    results.on.throughput = [1000.0, 1010.0]
    results.flush(args)  # the baseline engine has not run yet: written, marked incomplete, not met
    overhead = json.loads((tmp_path / "safepoint_overhead_cuda.json").read_text())
    assert overhead["device"] == "cuda" and overhead["met"] is False and overhead["incomplete"]
    results.off.throughput = [1005.0, 1008.0]
    step = {"exit_s": [0.0001, 0.0002] * 100, "ttft_s": [0.01, 0.02] * 100, "median_step_s": 0.008}
    results.on.latency = step
    results.off.latency = {**step, "exit_s": [0.004, 0.006] * 100}
    results.correctness = {"equal": True, "abandoned_steps": 4}
    results.reload = {str(n): {"speedup": 3.5} for n in check.kv_offload.CONTEXTS}
    results.flush(args)
    for name in ("preemption_latency", "safepoint_overhead", "kv_reload"):
        document = json.loads((tmp_path / f"{name}_cuda.json").read_text())
        assert document["benchmark"] == name and document["device"] == "cuda"
        assert {"target", "met"} <= set(document)
        assert document.get("incomplete") is None
    latency = json.loads((tmp_path / "preemption_latency_cuda.json").read_text())
    assert latency["met"] is True  # 0.2 ms <= 1.5 x 0.5 ms, and stock is 30x slower
    assert set(results.written) == {"preemption_latency", "safepoint_overhead", "kv_reload"}


def test_the_plain_pytorch_gpu_check_runs_its_smoke_mode_on_a_cpu_without_vllm(tmp_path: Path) -> None:
    """benchmarks/gpu/torch_check.py, the check a lent GPU machine can run: its CPU smoke run (the same code
    with a toy model on an emulated device, the KV offload and cost-model parts included), with every import of
    vLLM, pydantic and the serving stack refused, as on that machine (PyTorch and no vLLM), so a broken import
    or result shape shows before device time is spent. Its figures are not asserted on, only their shape, and
    the run-ahead bound's promise on the emulated device."""
    script = GPU_DIR / "torch_check.py"
    guarded = (
        "import builtins, runpy, sys\n"
        "real = builtins.__import__\n"
        "def guard(name, *args, **kwargs):\n"
        "    if name.split('.')[0] in ('vllm', 'httpx', 'yaml', 'aiohttp', 'kopf', 'lightkube', 'pydantic'):\n"
        "        raise ImportError(f'{name} is not on the GPU machine')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = guard\n"
        f"sys.argv = [{str(script)!r}, '--smoke', '--out', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", guarded], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    latency = json.loads((tmp_path / "torch_preemption_latency_cuda.json").read_text())
    overhead = json.loads((tmp_path / "torch_safepoint_overhead_cuda.json").read_text())
    assert latency["met"] is False and overhead["met"] is False  # a smoke run never meets a GPU target
    # On a CPU every check preempts; an abort that lands in the last layer's MLP, after the step's last
    # safepoint, finds nothing left to check (the CPU step can run faster than the timing it was drawn from).
    coserve = latency["coserve"]
    assert coserve["aborts"] > 0 and coserve["preempted"] >= 0.75 * coserve["aborts"]
    assert overhead["overhead"]["n"] >= 4
    assert "src/coserve/engine/layer_safepoints.py" in latency["code"]["files"]
    # the bound really waited on the emulated device: the host was ahead by K safepoints at most, and by K at times
    emulated = overhead["setup"]["emulated_device"]
    assert emulated["records"] > 0 and 0 <= emulated["max_lead_safepoints"] <= emulated["runahead_k"] == 1
    grid = overhead["grid"]
    assert [row["row"] for row in grid] == ["mixed_small", "mixed_mid", "decode_pieces", "prefill_large"]
    assert all(row["treatment"] == "bounded" and row["baseline"] == "off" for row in grid)
    assert all(row["pairs"] == row["pairs_budget"] == 4 and row["met"] is False for row in grid)
    assert all(len(row["loss_ci95"]) == 2 and math.isfinite(row["loss_mean"]) for row in grid)
    assert overhead["overhead"] == grid[-1]["overhead"]  # the 16k-token prefill row, where it was before the grid
    events = overhead["events"]
    assert [(row["row"], row["treatment"], row["baseline"]) for row in events["rows"]] == [
        ("decode_pieces", "blocking", "bounded"), ("prefill_large", "blocking", "bounded")]  # fmt: skip
    assert all(set(row["cpu_ms_per_step"]) == {"bounded", "blocking"} for row in events["rows"])
    assert events["better"] in ("spinning", "blocking", "undecided")
    graphs = json.loads((tmp_path / "torch_decode_graphs_cuda.json").read_text())
    assert graphs["met"] is False and [row["batch"] for row in graphs["decode"]] == [1, 8]
    # the host KV pool's GPU copy path (DeviceKVCopier), its inline mode on the CPU
    offload = json.loads((tmp_path / "torch_kv_offload_cuda.json").read_text())
    assert offload["met"] is False and offload["reload_equal"] is True
    assert [row["tokens"] for row in offload["bandwidth"]] == [32, 128]
    assert [row["tokens"] for row in offload["baseline"]["rows"]] == [32, 128]
    assert all(row["save_gbps"] > 0 and row["reload_gbps"] > 0 for row in offload["bandwidth"])
    assert offload["overhead"]["n"] >= 4
    assert offload["setup"]["kv_layout"][0] == 2 and offload["setup"]["block_tokens"] == 16  # vLLM's CUDA layout
    assert "src/coserve/engine/kv_copies.py" in offload["code"]["files"]
    fitted = json.loads((tmp_path / "torch_cost_model_cuda.json").read_text())
    assert fitted["met"] is False and fitted["num_train"] + fitted["num_holdout"] == len(fitted["samples"]) == 17
    assert {row["kind"] for row in fitted["samples"]} == {"prefill", "chunk", "decode"}
    # the fit's fields, not its accuracy: a smoke run's timings on a shared CPU mean nothing
    fit = [fitted["max_relative_error_holdout"], fitted["r2_holdout"], fitted["r2_train"]]
    assert set(fitted["coefficients"]) == {"k1", "k2", "k3", "k4", "k5"}
    assert all(isinstance(value, float) and math.isfinite(value) for value in [*fit, *fitted["coefficients"].values()])
    assert fitted["max_relative_error_holdout"] >= 0
    assert "src/coserve/scheduling/cost_model.py" in fitted["code"]["files"]


def drive(torch_check: ModuleType, k: int, blocking: bool = False) -> Any:
    """Three steps of 24 safepoints through ``RunAheadBound`` on an emulated device (1 ms per half-layer), the
    host queueing each half-layer's work after its safepoint as the model does; returns the device."""
    stream = torch_check.EmulatedStream(item_s=0.001)
    bound = RunAheadBound(k, lambda count: torch_check.EmulatedEvents(stream, count, blocking))
    try:
        for _ in range(3):
            for index in range(24):
                bound.reach(index)
                stream.launch()
            stream.synchronize()
    finally:
        stream.close()
    return stream


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_run_ahead_bound_keeps_the_host_within_k_safepoints_of_an_emulated_device(
    torch_check: ModuleType, k: int, blocking: bool
) -> None:
    """The smoke run's stand-in for CUDA events gives the bound a device that lags the host: ``reach`` must
    wait there, and the host is never more than K safepoints ahead (and is K ahead when the device lags)."""
    stream = drive(torch_check, k, blocking)
    assert stream.records == 3 * 24
    assert stream.max_lead <= k  # at most K; how close it gets depends on the machine's load


def test_the_emulated_device_catches_a_host_that_does_not_wait(torch_check: ModuleType) -> None:
    """The check above can fail: with K past the step's safepoints, ``reach`` never waits and the host runs ahead."""
    assert drive(torch_check, k=1000).max_lead > 2
