"""coserve's autoscaler against a queue-length threshold rule, on the load curve of a real trace.

The Azure LLM conversation trace (one hour, 19,366 requests; its load climbs
from ~200 to ~500 requests/min and steps down twice) is replayed ``--speedup``
times faster (load changes come faster than pods start) with its rate scaled by
``--scale``, second by second, through each autoscaler's decision loop and a
capacity model of the pool:

- prefillers: a fluid queue of prompt tokens drained at T_p per ready
  prefiller; a request's TTFT is the queue's wait plus its own prefill latency;
- decoders: R·L_d output tokens/s against T_d per ready decoder, and R·W live
  conversations against B per decoder; a request misses its SLO when its TTFT
  exceeds the class's SLO or the decoders are over either capacity;
- a new replica serves ``--startup`` seconds after it is asked for (an engine
  pod loading its model); removed replicas stop at once.

Both autoscalers evaluate every ``--interval`` seconds with the same bounds,
the same stabilization window for scaling down and the same start-up delay:

- coserve (``coserve.autoscaling.policy.decide``) sees what Prometheus would:
  R, L_in and L_d as 2-minute rates, W, the mean prefiller queue and the
  decoders' KV occupancy;
- the baseline is the rule common Kubernetes setups use (an HPA or KEDA on
  vLLM's ``num_requests_running + num_requests_waiting`` per pod):
  ``replicas = ceil(current · per_pod / target)`` with a 10 % tolerance, the
  per-pod value averaged over every replica asked for (pods still starting
  count as idle, as the HPA does),
  targets ``--baseline-decoder-target`` running conversations per decoder and
  ``--baseline-prefiller-target`` waiting requests per prefiller. A sweep of
  other targets is reported too.

Measured: SLO-violation minutes (minutes in which more than 1 % of requests
missed the SLO), replica-hours (every provisioned replica, starting or not) and
scale direction changes against the load curve's own direction changes (its
steps). Target: fewer violation minutes at no more replica-hours than the
baseline, and no more than one direction change per load step.

    .venv/bin/python benchmarks/autoscaling.py      # ~20 s

Writes benchmarks/results/autoscaling.json and autoscaling.png.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _harness import RESULTS, azure_conversation_trace, say, write_result

from coserve.api.parse import parse_pool
from coserve.api.spec import SpecModel
from coserve.autoscaling.policy import Replicas, Signals, Thresholds, decide
from coserve.provisioning import plan_for

POOL: dict[str, Any] = {
    "apiVersion": "coserve.dev/v1alpha1",
    "kind": "CoServePool",
    "metadata": {"name": "bench", "namespace": "bench"},
    "spec": {
        "model": {"name": "bench"},
        # what the pool was provisioned for; the autoscaler replaces R, L_in, L_d with measurements
        "workload": {"arrivalRatePerS": 30.0, "inputTokens": 1155, "outputTokens": 211, "lifetimeS": 10.0},
        "profile": {
            "prefillLatency": {"constantS": 0.02, "perTokenS": 1.0e-4},
            "decodeThroughputTokensPerS": 1500.0,
            "kvCapacityTokens": 200000,
        },
        "priorityClasses": [{"name": "standard", "weight": 1, "ttftSloMs": 2000, "tpotSloMs": 100}],
    },
}


@dataclass
class Pool:
    """Replicas asked for, and when each becomes ready."""

    startup_s: float
    prefillers: list[float] = field(default_factory=list)  # ready-at times, one per replica
    decoders: list[float] = field(default_factory=list)

    def resize(self, role: str, count: int, now: float) -> None:
        replicas = getattr(self, role)
        while len(replicas) < count:
            replicas.append(now + self.startup_s)
        while len(replicas) > count:
            replicas.remove(max(replicas))  # the youngest (not yet ready) go first

    def ready(self, role: str, now: float) -> int:
        return sum(1 for at in getattr(self, role) if at <= now)


@dataclass
class Run:
    name: str
    replicas: list[tuple[int, int]] = field(default_factory=list)  # per simulated second (asked for)
    ready: list[tuple[int, int]] = field(default_factory=list)
    missed: list[float] = field(default_factory=list)  # requests that missed the SLO, per second
    arrived: list[float] = field(default_factory=list)


def load_curve(speedup: float, scale: float) -> list[tuple[float, float, float]]:
    """(requests, prompt tokens, output tokens) per simulated second."""
    rows = azure_conversation_trace()
    seconds = math.ceil(rows[-1].offset_s / speedup) + 1
    curve = [[0.0, 0.0, 0.0] for _ in range(seconds)]
    for row in rows:
        slot = curve[int(row.offset_s / speedup)]
        slot[0] += scale / speedup
        slot[1] += row.context_tokens * scale / speedup
        slot[2] += row.generated_tokens * scale / speedup
    return [(a, b, c) for a, b, c in curve]


Decider = Callable[[int, Replicas, dict[str, float]], Replicas]


def simulate(name: str, spec: SpecModel, curve: list[tuple[float, float, float]], decider: Decider,
             args: argparse.Namespace) -> Run:  # fmt: skip
    plan = plan_for(spec)
    profile = spec.profile
    latency = profile.prefill_latency
    assert latency is not None and profile.decode_throughput_tokens_per_s and profile.kv_capacity_tokens
    decode_tps = profile.decode_throughput_tokens_per_s
    slo_s = spec.priority_classes[0].ttft_slo_ms / 1000
    lifetime_s = spec.workload.lifetime_s
    pool = Pool(args.startup)
    pool.resize("prefillers", plan.prefillers, -args.startup)
    pool.resize("decoders", plan.decoders, -args.startup)
    run = Run(name)
    queue_tokens = 0.0
    window: deque[tuple[float, float, float]] = deque(maxlen=120)  # Prometheus's 2-minute rate window
    live: deque[float] = deque(maxlen=int(lifetime_s))  # conversations arriving in the last W seconds
    processed_window: deque[float] = deque(maxlen=120)  # prompt tokens the prefillers processed
    for second, (requests, prompt, output) in enumerate(curve):
        window.append((requests, prompt, output))
        live.append(requests)
        prefillers, decoders = pool.ready("prefillers", second), pool.ready("decoders", second)
        mean_prompt = prompt / requests if requests else spec.workload.input_tokens
        one_prefill = latency.constant_s + latency.per_token_s * mean_prompt
        capacity = prefillers * mean_prompt / one_prefill if prefillers else 0.0  # tokens/s
        processed = min(queue_tokens + prompt, capacity)
        queue_tokens = max(0.0, queue_tokens + prompt - capacity)
        processed_window.append(processed)
        ttft = (queue_tokens / capacity if capacity else math.inf) + one_prefill
        conversations = sum(live) * lifetime_s / max(1, len(live))  # R·W
        slots = decoders * math.floor(profile.kv_capacity_tokens / (mean_prompt + output / max(requests, 1e-9)))
        over_decode = output > decoders * decode_tps
        over_kv = conversations > slots
        run.missed.append(requests if (ttft > slo_s or over_decode or over_kv) else 0.0)
        run.arrived.append(requests)
        current = Replicas(len(pool.prefillers), len(pool.decoders))
        if second % args.interval == 0:
            seen = {
                "rate": sum(w[0] for w in window) / len(window),
                "input": sum(w[1] for w in window) / max(1e-9, sum(w[0] for w in window)),
                "output": sum(w[2] for w in window) / max(1e-9, sum(w[0] for w in window)),
                "queue": (queue_tokens / mean_prompt) / max(1, prefillers),  # requests waiting per prefiller
                # avg(rate(vllm:prompt_tokens_total)) over the prefillers that serve
                "prefill_tokens": sum(processed_window) / len(processed_window) / max(1, prefillers),
                "kv": min(1.0, conversations / slots) if slots else 1.0,
                "running": conversations,  # running conversations on decoders (vllm:num_requests_running)
                "prefillers_ready": prefillers,
                "decoders_ready": decoders,
            }
            wanted = decider(second, current, seen)
            pool.resize("prefillers", wanted.prefillers, second)
            pool.resize("decoders", wanted.decoders, second)
        run.replicas.append((len(pool.prefillers), len(pool.decoders)))
        run.ready.append((pool.ready("prefillers", second), pool.ready("decoders", second)))
    return run


def coserve_decider(spec: SpecModel, thresholds: Thresholds) -> Decider:
    state: dict[str, Any] = {"history": (), "kv_high": 0, "queue": None}

    def decider(second: int, current: Replicas, seen: dict[str, float]) -> Replicas:
        signals = Signals(
            arrival_rate_per_s=seen["rate"], input_tokens=seen["input"], output_tokens=seen["output"],
            lifetime_s=spec.workload.lifetime_s, prefiller_queue=seen["queue"], decoder_kv_usage=seen["kv"],
            prefill_tokens_per_s=seen["prefill_tokens"],
        )  # fmt: skip
        decision = decide(spec, signals, current, float(second), thresholds=thresholds, history=state["history"],
                          kv_high_evaluations=state["kv_high"], last_prefiller_queue=state["queue"])  # fmt: skip
        state.update(history=decision.history, kv_high=decision.kv_high_evaluations, queue=decision.prefiller_queue)
        return decision.replicas

    return decider


def threshold_decider(thresholds: Thresholds, decoder_target: float, prefiller_target: float) -> Decider:
    """An HPA/KEDA-style rule on requests per pod, with the HPA's tolerance and down-scale stabilization."""
    history: list[tuple[int, Replicas]] = []

    def one(current: int, per_pod: float, target: float) -> int:
        ratio = per_pod / target
        return current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)

    def decider(second: int, current: Replicas, seen: dict[str, float]) -> Replicas:
        # the HPA averages over every replica it asked for, counting pods not ready yet as idle (no overshoot
        # while they start)
        waiting = seen["queue"] * seen["prefillers_ready"]
        raw = Replicas(
            one(current.prefillers, waiting / current.prefillers, prefiller_target),
            one(current.decoders, seen["running"] / current.decoders, decoder_target),
        )
        raw = Replicas(
            min(max(raw.prefillers, thresholds.min_replicas.prefillers), thresholds.max_replicas.prefillers),
            min(max(raw.decoders, thresholds.min_replicas.decoders), thresholds.max_replicas.decoders),
        )
        history.append((second, raw))
        recent = [r for at, r in history if second - at < thresholds.stabilization_window_s]
        # HPA: up at once; down to the highest recommendation of the stabilization window
        return Replicas(
            raw.prefillers if raw.prefillers >= current.prefillers else max(r.prefillers for r in recent),
            raw.decoders if raw.decoders >= current.decoders else max(r.decoders for r in recent),
        )

    return decider


def summarize(run: Run) -> dict[str, Any]:
    minutes = math.ceil(len(run.arrived) / 60)
    violated = 0
    for minute in range(minutes):
        arrived = sum(run.arrived[minute * 60 : minute * 60 + 60])
        missed = sum(run.missed[minute * 60 : minute * 60 + 60])
        violated += int(arrived > 0 and missed / arrived > 0.01)
    changes = {}
    for index, role in enumerate(("prefillers", "decoders")):
        series = [r[index] for r in run.replicas]
        moves = [b > a for a, b in itertools.pairwise(series) if b != a]
        changes[role] = sum(1 for a, b in itertools.pairwise(moves) if a != b)
    return {
        "slo_violation_minutes": violated,
        "minutes": minutes,
        "requests_missing_slo_pct": 100 * sum(run.missed) / max(1e-9, sum(run.arrived)),
        "replica_hours": sum(p + d for p, d in run.replicas) / 3600,
        "direction_changes": changes,
        "max_replicas": {"prefillers": max(p for p, _ in run.replicas), "decoders": max(d for _, d in run.replicas)},
    }


def load_steps(curve: list[tuple[float, float, float]], smooth_s: int = 120, tolerance: float = 0.1) -> int:
    """Direction changes of the load itself: turns of its 2-minute average by more than ``tolerance``."""
    rates = [c[0] for c in curve]
    smooth = [sum(rates[max(0, i - smooth_s) : i + 1]) / min(i + 1, smooth_s + 1) for i in range(len(rates))]
    turns, direction, anchor = 0, 0, smooth[0]
    for value in smooth:
        if direction >= 0 and value < anchor * (1 - tolerance):
            turns, direction, anchor = turns + (direction == 1), -1, value
        elif direction <= 0 and value > anchor * (1 + tolerance):
            turns, direction, anchor = turns + (direction == -1), 1, value
        elif (direction == 1 and value > anchor) or (direction == -1 and value < anchor):
            anchor = value
    return turns + 1  # segments: the first step plus one per turn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--scale", type=float, default=6.0, help="multiply the trace's request rate (default 6)")
    parser.add_argument("--interval", type=int, default=15, help="evaluation interval, s (default 15)")
    parser.add_argument("--window", type=float, default=300.0, help="stabilization window, s (default 120)")
    parser.add_argument("--startup", type=float, default=60.0, help="replica start-up, s (default 60)")
    parser.add_argument("--baseline-decoder-target", type=float, default=64.0)
    parser.add_argument("--baseline-prefiller-target", type=float, default=2.0)
    args = parser.parse_args()
    spec = parse_pool(POOL).spec
    thresholds = Thresholds(min_replicas=Replicas(1, 1), max_replicas=Replicas(16, 64),
                            stabilization_window_s=args.window)  # fmt: skip
    curve = load_curve(args.speedup, args.scale)
    steps = load_steps(curve)
    say(f"{len(curve)} simulated seconds ({args.speedup:g}x sped up), {steps} load steps")
    baseline_run = simulate("threshold", spec, curve, threshold_decider(
        thresholds, args.baseline_decoder_target, args.baseline_prefiller_target), args)  # fmt: skip
    baseline = summarize(baseline_run)
    coserve_run = simulate("coserve", spec, curve, coserve_decider(spec, thresholds), args)
    ours = summarize(coserve_run)
    sweep = []
    for decoder_target in (16, 32, 64, 128, 256):
        for prefiller_target in (0.5, 1, 2, 4):
            rule = threshold_decider(thresholds, decoder_target, prefiller_target)
            result = summarize(simulate("threshold", spec, curve, rule, args))
            sweep.append({"decoder_target": decoder_target, "prefiller_target": prefiller_target, **result})
    dominated_by = [s for s in sweep if s["slo_violation_minutes"] <= ours["slo_violation_minutes"]
                    and s["replica_hours"] <= ours["replica_hours"]]  # fmt: skip
    fewer = ours["slo_violation_minutes"] < baseline["slo_violation_minutes"]
    cheaper = ours["replica_hours"] <= baseline["replica_hours"]
    most_changes = max(ours["direction_changes"].values())
    stable = most_changes <= steps

    print(f"\n{'':34}{'coserve':>12}{'threshold':>12}")
    for label, key, fmt in (("SLO-violation minutes", "slo_violation_minutes", "{}"),
                            ("requests missing the SLO (%)", "requests_missing_slo_pct", "{:.2f}"),
                            ("replica-hours", "replica_hours", "{:.2f}")):  # fmt: skip
        print(f"{label:34}{fmt.format(ours[key]):>12}{fmt.format(baseline[key]):>12}")
    for role in ("prefillers", "decoders"):
        print(f"{role + ' direction changes':34}{ours['direction_changes'][role]:>12}"
              f"{baseline['direction_changes'][role]:>12}")  # fmt: skip
    print(f"load steps in the trace: {steps}; baseline settings (of {len(sweep)}) at least as good on both "
          f"counts: {len(dominated_by)}")  # fmt: skip
    write_result(
        "autoscaling",
        {
            "benchmark": "autoscaling",
            "target": "fewer SLO-violation minutes than a queue-length threshold rule at no more replica-hours; "
            "at most one scale direction change per load step",
            "met": bool(fewer and cheaper and stable),
            "fewer_violation_minutes": bool(fewer),
            "no_more_replica_hours": bool(cheaper),
            "direction_changes_within_load_steps": bool(stable),
            "load_steps": steps,
            "coserve": ours,
            "baseline": {"name": "HPA/KEDA-style threshold on running+waiting requests per pod",
                         "decoder_target": args.baseline_decoder_target,
                         "prefiller_target": args.baseline_prefiller_target, **baseline},
            "baseline_sweep": sweep,
            "baseline_settings_at_least_as_good_on_both": len(dominated_by),
            "setup": {k: getattr(args, k) for k in ("speedup", "scale", "interval", "window", "startup")}
            | {"trace": "azure_llm_2023_conv.csv", "pool": POOL["spec"]},
        },
    )
    plot(curve, coserve_run, baseline_run)
    return 0


def plot(curve: list[tuple[float, float, float]], ours: Run, baseline: Run) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s / 60 for s in range(len(curve))]
    figure, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    smooth = [sum(c[0] for c in curve[max(0, i - 60) : i + 1]) / min(i + 1, 61) for i in range(len(curve))]
    axes[0].plot(minutes, smooth)
    axes[0].set_ylabel("conversations/s")
    for index, role in enumerate(("prefillers", "decoders")):
        axes[index + 1].plot(minutes, [r[index] for r in ours.replicas], label="coserve")
        axes[index + 1].plot(minutes, [r[index] for r in baseline.replicas], label="threshold rule")
        axes[index + 1].set_ylabel(role)
        axes[index + 1].legend()
    axes[2].set_xlabel("simulated minutes")
    figure.suptitle("autoscaling on the Azure conversation trace")
    figure.tight_layout()
    figure.savefig(RESULTS / "autoscaling.png", dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
