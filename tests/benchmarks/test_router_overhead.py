"""The router_overhead benchmark's judgement: vllm-router's best configuration for each figure, and the ratios."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from coserve.api.spec.gateway import GatewaySpec


def row(policy: str, threads: int, p99: float, cpu: float, rps: float) -> dict[str, Any]:
    return {"policy": policy, "worker_threads": threads, "added_p99_s": p99, "cpu_s_per_request": cpu,
            "requests_per_s": rps}  # fmt: skip


SWEEP = [
    row("round_robin", 1, 0.0004, 0.00020, 6000),
    row("consistent_hash", 1, 0.0003, 0.00025, 7000),
    row("cache_aware", 2, 0.0006, 0.00015, 5000),
]


def test_each_figure_is_compared_with_the_configuration_best_at_it(router_overhead: ModuleType) -> None:
    ours = {"added_p99_s": 0.0006, "cpu_s_per_request": 0.0003, "requests_per_s": 3500}
    verdict = router_overhead.peer_comparison(ours, SWEEP)
    assert verdict["best"]["added_p99_s"]["policy"] == "consistent_hash"
    assert verdict["best"]["cpu_s_per_request"] == {"policy": "cache_aware", "worker_threads": 2,
                                                    "cpu_s_per_request": 0.00015}  # fmt: skip
    assert verdict["best"]["requests_per_s"]["requests_per_s"] == 7000
    assert abs(verdict["added_p99_ratio"] - 2.0) < 1e-9 and verdict["added_p99_met"]  # at most 2x: met
    assert abs(verdict["cpu_per_request_ratio"] - 2.0) < 1e-9 and not verdict["cpu_met"]  # over 1.5x
    assert abs(verdict["requests_per_s_ratio"] - 0.5) < 1e-9


def test_a_peer_latency_within_the_noise_of_direct_gives_no_ratio_and_no_target_met(
    router_overhead: ModuleType,
) -> None:
    sweep = [row("round_robin", 1, -0.0001, 0.0002, 6000), row("cache_aware", 1, 0.0, 0.0002, 6000)]
    verdict = router_overhead.peer_comparison({"added_p99_s": 0.0001, "cpu_s_per_request": 0.0002,
                                               "requests_per_s": 6000}, sweep)  # fmt: skip
    assert verdict["added_p99_ratio"] is None and not verdict["added_p99_met"]
    assert verdict["cpu_met"]


def test_the_best_of_a_tie_is_the_first_swept(router_overhead: ModuleType) -> None:
    tied = [row("round_robin", 1, 0.001, 0.0002, 6000), row("round_robin", 2, 0.001, 0.0002, 6000)]
    assert router_overhead.best_of(tied, "added_p99_s")["worker_threads"] == 1
    assert router_overhead.best_of(tied, "requests_per_s", highest=True)["worker_threads"] == 1


def test_vllm_router_runs_over_the_upstream_without_health_checks_during_the_run(router_overhead: ModuleType) -> None:
    command = router_overhead.peer_command("http://up", 9000, "cache_aware")
    assert command[command.index("--worker-urls") :] == ["--worker-urls", "http://up"]
    assert command[command.index("--health-check-interval-secs") + 1] == "3600"
    assert command[command.index("--log-level") + 1] == "error"  # warning logs every request


def test_the_profile_is_attributed_by_the_innermost_frame(router_overhead: ModuleType) -> None:
    raw = "\n".join([
        "main (coserve/cli/main.py:1);run (uvicorn/main.py:2);data_received (uvicorn/protocols/http/x.py:3) 6",
        "run (asyncio/runners.py:118) 3",
        "forward (coserve/router/upstream.py:9);post (aiohttp/client.py:1) 1",
    ])  # fmt: skip
    shares = router_overhead.attribute(raw)
    assert shares == {"HTTP server (uvicorn, httptools)": 0.6, "event loop (asyncio, uvloop)": 0.3,
                      "HTTP client to the engines (aiohttp)": 0.1}  # fmt: skip


def test_the_ratios_intervals_hold_the_ratio_of_a_clear_difference(router_overhead: ModuleType) -> None:
    arm = router_overhead.Arm
    direct = arm([0.001 + 0.0001 * (i % 100) / 100 for i in range(1000)], 0.0, 0.0)
    ours = arm([x + 0.002 for x in direct.latencies], 0.4, 0.0, [(0.04, 100)] * 10)  # 0.4 ms per request
    theirs = arm([x + 0.001 for x in direct.latencies], 0.2, 0.0, [(0.02, 100)] * 10)  # 0.2 ms per request
    found = router_overhead.intervals(ours, theirs, direct)
    low, high = found["added_p99_ratio_ci95"]
    assert low <= 2.0 <= high and high - low < 0.5
    assert found["cpu_per_request_ratio_ci95"] == [2.0, 2.0]  # identical slices: no spread


def test_the_judged_gateway_arm_runs_the_picker_as_the_operator_renders_it(
    router_overhead: ModuleType, tmp_path: Path
) -> None:
    """The gateway a pool renders by default serves ext_proc over TLS: the judged arm's picker is started with
    --secure-serving and Envoy reaches it over TLS; the cleartext arm with neither."""
    gateway = importlib.import_module("harness.gateway")
    assert GatewaySpec().secure_serving  # the operator's default, which the judged arm follows
    judged = router_overhead.GATEWAY_MODES[router_overhead.GATEWAY]
    cleartext = router_overhead.GATEWAY_MODES[router_overhead.GATEWAY_CLEARTEXT]
    for (mode, secure), tls in ((judged, True), (cleartext, False)):
        picker, envoy, bootstrap = gateway.gateway_commands(tmp_path / "r.json", tmp_path / "e.json", (1, 2, 3, 4),
                                                            mode, secure)  # fmt: skip
        assert mode == "full-duplex" and ("--secure-serving" in picker) is tls
        clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
        assert any("transport_socket" in c for c in clusters.values()) is tls
        assert envoy[envoy.index("-c") + 1] == str(tmp_path / "e.json")
