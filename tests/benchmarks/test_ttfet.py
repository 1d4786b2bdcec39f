"""The ttfet benchmark's judgement: vllm-router's best policy and the ratios against it; its command lines."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def arm(p95: float | None, computed: float = 1000.0) -> dict[str, Any]:
    return {"ttfet_p95_s": p95, "decoder_computed_prompt_tokens": computed}


def test_vllm_routers_best_policy_is_its_lowest_p95_among_those_with_one(ttfet: ModuleType) -> None:
    peers = {"vllm-router round_robin": arm(90.0), "vllm-router consistent_hash": arm(40.0),
             "vllm-router cache_aware": arm(None), "vllm-router P/D cache_aware": arm(40.0)}  # fmt: skip
    assert ttfet.best_peer(peers) == "vllm-router consistent_hash"  # the first of a tie
    assert ttfet.best_peer({"vllm-router cache_aware": arm(None)}) is None
    assert ttfet.best_peer({}) is None


def test_the_ratios_are_the_baselines_over_ours(ttfet: ModuleType) -> None:
    p95, recompute = ttfet.ratios(arm(20.0, 500.0), arm(26.0, 1000.0))
    assert abs(p95 - 1.3) < 1e-9 and recompute == 2.0
    assert ttfet.ratios(arm(20.0), arm(None))[0] is None  # too few conversations for a p95


def test_vllm_router_runs_over_the_decoders_or_in_its_pd_mode(ttfet: ModuleType) -> None:
    """ttfet's vllm-router arms: ``harness.peers``' command lines, over the decoders or in its P/D mode."""
    plain = ttfet.vllm_router_command(9000, "consistent_hash", ["http://d0", "http://d1"])
    assert plain[plain.index("--worker-urls") :] == ["--worker-urls", "http://d0", "http://d1"]
    assert plain[plain.index("--policy") + 1] == "consistent_hash" and "--vllm-pd-disaggregation" not in plain
    assert plain[plain.index("--log-level") + 1] == "error"  # warning logs every request
    pd = ttfet.vllm_router_pd_command(9000, "cache_aware", ["http://p"], ["http://d0", "http://d1"])
    assert "--vllm-pd-disaggregation" in pd and "--worker-urls" not in pd
    assert pd[pd.index("--prefill") + 1] == "http://p"
    assert [pd[i + 1] for i, a in enumerate(pd) if a == "--decode"] == ["http://d0", "http://d1"]


def test_the_gateway_is_judged_within_5_percent_and_within_the_routers_own_spread(ttfet: ModuleType) -> None:
    """Both bars are reported: 5 % (the target) and the router's runs against each other (the machine's noise)."""
    samples = [float(i) for i in range(1, 101)]

    def results(gateway_scale: float, router_p95s: list[float]) -> dict[str, Any]:
        runs = [{"arm": ttfet.ROUTER_PROCESS, "ttfet_p95_s": p} for p in router_p95s]
        gateway = {"ttfet_s": [s * gateway_scale for s in samples], "repetitions": runs}
        gateway["ttfet_p95_s"] = ttfet.percentile(gateway["ttfet_s"], 95)
        router = {"ttfet_s": samples, "ttfet_p95_s": ttfet.percentile(samples, 95)}
        return {ttfet.GATEWAY: gateway, ttfet.ROUTER_PROCESS: router}

    close = ttfet.gateway_verdict(results(1.03, [10.0, 10.5]))
    assert close["met"] and close["within_router_spread"]
    noisy = ttfet.gateway_verdict(results(1.3, [10.0, 14.0]))  # 30 % off, but the router alone spread 40 %
    assert not noisy["met"] and noisy["within_router_spread"] and abs(noisy["router_run_spread"] - 0.4) < 1e-9
    worse = ttfet.gateway_verdict(results(1.3, [10.0, 10.5]))
    assert not worse["met"] and not worse["within_router_spread"]
    once = ttfet.gateway_verdict(results(1.0, [10.0]))  # one run has no spread to judge by
    assert once["met"] and once["router_run_spread"] is None and not once["within_router_spread"]
