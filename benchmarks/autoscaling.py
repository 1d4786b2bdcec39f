"""coserve's autoscaler against an HPA/KEDA-style queue-length rule, in coserve's pool simulator.

The world is ``coserve.sim.PoolSim``, the simulated pool ``coserve simulate``
runs, not coserve's provisioning model. A real trace's requests (replayed as
below) are played through it, each as a one-turn conversation:

- every engine step is decided by SlideBatching (the engines' scheduler policy,
  at the pool's one priority class) and lasts what the step cost model
  (``coserve.scheduling.cost_model``, latency(P, C) = k1·P + k2·P·(P + C) +
  k3·P + k4·(P + C) + k5) gives for it, each request's attention over its own
  context, as ``coserve.sim`` times a batch: for requests computing p new
  tokens over c cached ones,

      step = k5 + sum over the batch of (k1·p + k2·p·(p + c) + k4·(p + c))

  with GPU-like constants (``COST_MODEL``: an 8B model with grouped-query
  attention on one H100-class GPU, k3 = 0; the numbers are in the JSON
  ``setup``) and at most ``max_tokens_per_step`` new tokens a step, so long
  prompts prefill in chunks and decode steps slow down as the batch and its
  contexts grow;
- the router places each request on a prefiller by GoRouting (its deadlines
  from the spec's prefill curve); the prefilled KV moves over a 25 GB/s link to
  the decoder with the lowest KV occupancy, which decodes the rest;
- an engine starts a request only in a free one of its ``max_num_seqs`` slots
  and when the request's whole KV (prompt + output) fits in
  ``kv_capacity_tokens``; until then it waits there;
- a request misses its SLO when its TTFT exceeds the class's TTFT SLO or its
  mean time per output token (first to last token, decoder queueing included)
  exceeds the TPOT SLO; one that has not finished when the run ends missed it;
- a new replica serves ``--startup`` seconds after it is asked for; a removed
  replica gets no new work, hands its not-yet-started requests back to the
  router and drains what it started (draining pods count as replica-hours).

What the world does not model: KV swapping to host memory (an engine that
runs out of KV preempts and recomputes, as vLLM does), speculative decoding, CUDA graph
padding, the API server's and the router's own latency, pod failures, and
prefix reuse across requests (each trace row is its own conversation).

NOTE: nothing in the world uses N·T_d >= R·L_d, N·B >= R·W or T_p: those are
what coserve's policy believes. The pool spec it plans from is what an operator
would write: the trace's own mean lengths and rate, and ``spec.profile.configMapRef``
naming the profile ``coserve profile`` would measure on the world's engine
(``engine_profile``: the profiler's fit on its grid of the world's steps, which
recovers the world's cost model and the prefill curve latency(L, 0) exactly;
T_d as its default decode run measures it, 16 requests of 32 prompt tokens
decoding 64 tokens each). Nothing is set inline, so the plan takes T_d from the
profile's cost model at the pool's operating point, every KV slot decoding at
the measured context, as it would in a cluster; the operator and the benchmark
hand the same profile to every autoscaling evaluation.

Both autoscalers see only what Prometheus would show (``coserve.sim.Observation``):
the router's arrival rate (2 m), mean prompt and output lengths (5 m),
conversation lifetime (10 m), the prefillers' prompt-token rate (2 m) and
queues, the decoders' KV occupancy and waiting requests, and the running +
waiting requests of the pods that serve. The simulator evaluates them every
``--interval`` seconds with the same bounds, the same stabilization window for
scaling down and the same start-up delay:

- coserve: ``coserve.autoscaling.policy.decide`` (``coserve.sim.coserve_scaler``)
  with its defaults: the rule below at its default targets (2 running +
  waiting per prefiller; per decoder, the conversations its KV cache holds) is
  one of its candidates, and it is told the start-up delay
  (``spec.autoscaling.replicaStartupS``);
- baseline: ``replicas = ceil(current · per_pod / target)`` on vLLM's
  ``num_requests_running + num_requests_waiting`` per pod (averaged over every
  replica asked for, pods still starting counting as idle, as the HPA does),
  10 % tolerance, up at once, down to the highest recommendation of the
  stabilization window once it has a window of recommendations (as coserve).
  Its decoder and prefiller targets are swept over a 5x5 grid, and the
  sweep's **Pareto frontier** over (replica-hours, SLO-violation minutes) is
  what coserve is judged against (``pareto_frontier``): the settings no other
  setting beats on both counts, sorted by replica-hours.

Both start at the spec's plan and begin evaluating once the 2-minute rate
window is full (``WARMUP_S``).

Traces (``--trace``, repeatable; default both traces in data/traces) are replayed
``--speedup`` times faster (load changes come faster than pods start), their
rate multiplied by a per-trace scale: by default the one at which the trace's
mean prompt-token rate needs ``--prefillers-at-mean`` prefillers at the
profile's prefill speed (Azure conversation: ~4x, about every request of the
trace once; Mooncake, whose prompts are ~10x longer, ~0.6x); ``--scale`` sets
it for every trace. A trace's copies of one request are spread evenly to the
next arrival (a scale below the speedup keeps a seeded random subset). The TTFT SLO is max(2 s, twice the unloaded
prefill time of the trace's 99.9th-percentile prompt), so the rare very long
prompts of Mooncake do not miss it with the pool idle; the TPOT SLO is 100 ms.

Measured per trace: SLO-violation minutes (minutes in which more than 1 % of the
requests that arrived missed the SLO), replica-hours over the trace (every
replica asked for or draining, sampled each simulated second), scale
direction changes against the load's own steps and, for coserve, what drove
each replica change (``scaling_steps``: the model's re-plan from the measured
workload, the measured T_p, the prefiller queue or KV guard, as the decision's
reasons name them; the stabilization window down). The frontier is read linearly
between its points (``frontier_minutes_at`` and its inverse ``frontier_hours_at``)
and held flat beyond them: cheaper than its cheapest point it keeps that point's
minutes (a cheaper rule would have no fewer), dearer than its dearest point it
keeps that point's minutes (the fewest any setting reached; no setting reaching
coserve's minutes at all is reported as ``None``). Target (``met``): on every
trace, no setting of the rule is at least as good on both counts (violation
minutes and replica-hours: a setting with no more of either dominates coserve),
and at most one direction change per load step for each role. Each setting is
picked afterwards, with the trace in hand; an operator picks one before. So the
JSON also counts the settings at least as good on both counts on every trace at
once (``rule_settings_at_least_as_good_on_every_trace``).

The runs are independent and deterministic; they run in ``--jobs`` processes
(default: one per core), which changes nothing but the wall time. A run's cost
grows with its pool and its queues (SlideBatching scores every waiting request
each step), so the default load is two prefillers' worth at the mean;
``--prefillers-at-mean 4`` doubles it and the wall time more than doubles.

    .venv/bin/python benchmarks/autoscaling.py      # ~10 min on 2 cores: 26 runs per trace

Writes benchmarks/results/autoscaling.json and autoscaling.png.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import random
import sys
import time
from collections.abc import Generator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.results import RESULTS, Table, figure, show, write_result
from harness.stats import say
from harness.sweep import best_of, pareto
from harness.workload import TRACES, TraceRow, load_trace, trace_label

from coserve.api.parse import parse_pool
from coserve.api.profile import EngineProfile
from coserve.api.spec import SpecModel
from coserve.autoscaling.policy import Decision, Replicas, Thresholds, rule_count
from coserve.bench.workload import Conversation, Turn
from coserve.provisioning import plan_for
from coserve.scheduling import ClassRegistry, RequestClass, SlideConfig, StepCostModel, slo_attained
from coserve.scheduling.cost_model import CostSample
from coserve.scheduling.profile_fit import ProfileGrid, ProfileMeasurements, build_profile
from coserve.sim import Observation, PoolSim, Scaler, SimConfig, SimResult, coserve_scaler

# The world's engine (``World``): GPU-like, an 8B model (GQA, 128 KiB of KV per token) on one H100-class GPU.
# k1: per new token (matmuls), k2: attention per (new token x attended token), k3: 0 (folded into k1, as the
# profiler fits it), k4: per token of KV read, k5: per step (weights read, launch).
COST_MODEL = StepCostModel(k1=7.0e-5, k2=7.0e-10, k3=0.0, k4=4.4e-8, k5=7.0e-3)
DEFAULT_TRACES = (TRACES / "azure_llm_2023_conv.csv", TRACES / "mooncake_conversation.jsonl")
DECODER_TARGETS = (16, 32, 64, 128, 256)  # running + waiting requests per decoder
PREFILLER_TARGETS = (1, 2, 4, 8, 16)  # running + waiting requests per prefiller
TPOT_SLO_MS = 100.0
SLO_MISS_FRACTION = 0.01  # a minute violates the SLO when more than this share of its arrivals missed
TAIL_S = 120  # simulated after the last arrival, so late requests can finish
# NOTE: the autoscalers start once Prometheus holds a full 2-minute rate window; until then the pool runs at
# the spec's plan, for both (a first evaluation on a second of data would read the trace's start as no load).
WARMUP_S = 120
PROFILE_CONFIG_MAP = "bench-profile"  # the ConfigMap the pool's spec.profile.configMapRef names


@dataclass(frozen=True)
class World:
    """One replica's speed (``COST_MODEL``) and memory, and how the simulated pool runs it."""

    cost_model: StepCostModel = COST_MODEL
    max_tokens_per_step: int = 8192  # new tokens per step (chunked prefill's budget)
    max_num_seqs: int = 256  # sequences an engine runs at once
    kv_capacity_tokens: int = 400_000  # ~52 GB of KV cache at 128 KiB per token
    prefill_site: str = "fastest"  # the router's prefillSite: turn 1 on a prefiller or its decoder, the sooner

    def prefill_s(self, tokens: float) -> float:
        """One prompt alone on an idle engine, in one step: latency(L, 0)."""
        return self.cost_model.latency_s(tokens, 0)

    def prefill_curve(self) -> tuple[float, float, float]:
        """latency(L, 0) as the spec's prefill curve: (constant s, s per token, s per token squared)."""
        model = self.cost_model
        return model.k5, model.k1 + model.k3 + model.k4, model.k2

    def config(self, prefillers: int, decoders: int, **settings: Any) -> SimConfig:
        """The simulated pool of ``prefillers`` + ``decoders`` of this engine, coserve's placement; ``settings``
        override any other ``SimConfig`` field."""
        coserve = {
            "placement": "conversation",
            "max_num_seqs": self.max_num_seqs,
            "slide": SlideConfig(max_tokens_per_step=self.max_tokens_per_step),
            "prefill_latency": self.prefill_curve(),
            "prefill_site": self.prefill_site,
        }
        return SimConfig(
            prefillers=prefillers,
            decoders=decoders,
            cost_model=self.cost_model,
            kv_capacity_tokens=self.kv_capacity_tokens,
            **(coserve | settings),
        )

    def profiled_decode_tokens_per_s(self, requests: int = 16, prompt: int = 32, output: int = 64) -> float:
        """T_d as ``coserve profile`` measures it (its defaults): ``requests`` prompts sent together to one
        engine, decoded to ``output`` tokens each; output tokens over the time to the last one."""
        # generous SLOs: the profiler's batch is not deadline-bound
        cls = RequestClass("profile", 1.0, 1.0, ttft_slo_s=60.0, tpot_slo_s=1.0, rank=0)
        conversations = [Conversation(f"profile-{i}", 0.0, (Turn((0,) * prompt, output),)) for i in range(requests)]
        config = self.config(0, 1, placement="per-request")
        result = PoolSim(config, conversations, dict.fromkeys((c.conversation_id for c in conversations), cls)).run()
        return requests * output / max(r.request.token_times[-1] for r in result.records)


WORLD = World()


@dataclass
class Arrivals:
    """One trace, replayed: request arrivals (simulated seconds) and token counts."""

    label: str
    times_s: list[float]
    prompts: list[int]
    outputs: list[int]
    scale: float
    speedup: float

    @property
    def seconds(self) -> int:
        return int(self.times_s[-1]) + 1 if self.times_s else 1


def replay(rows: Sequence[TraceRow], label: str, speedup: float, scale: float, seed: int = 0) -> Arrivals:
    """The trace ``speedup`` times faster with ``scale`` times its rate: each row yields ``scale/speedup``
    requests on average (the fraction drawn with a seeded generator), spread evenly up to the next row."""
    rng = random.Random(seed)
    copies_per_row = scale / speedup
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    for index, row in enumerate(rows):
        at = row.offset_s / speedup
        gap = (rows[index + 1].offset_s / speedup - at) if index + 1 < len(rows) else 0.0
        count = int(copies_per_row) + (rng.random() < copies_per_row - int(copies_per_row))
        for copy in range(count):
            times.append(at + gap * copy / count)
            prompts.append(max(1, row.context_tokens))
            outputs.append(max(1, row.generated_tokens))
    order = sorted(range(len(times)), key=times.__getitem__)
    return Arrivals(
        label, [times[i] for i in order], [prompts[i] for i in order], [outputs[i] for i in order], scale, speedup
    )


def auto_scale(rows: Sequence[TraceRow], world: World, prefillers_at_mean: float) -> float:
    """The rate multiplier at which the trace's mean prompt-token rate needs ``prefillers_at_mean`` prefillers
    prefilling one mean prompt at a time (the profile's T_p)."""
    rate = len(rows) / max(rows[-1].offset_s, 1.0)
    mean_prompt = sum(row.context_tokens for row in rows) / len(rows)
    return prefillers_at_mean / (rate * world.prefill_s(mean_prompt))


@functools.cache
def engine_profile(world: World) -> EngineProfile:
    """The profile ``coserve profile`` would write for the world's engine, in the ConfigMap the pool names.

    The profiler's own fitting code (``build_profile``) on its default grid, each step timed by the world,
    and T_d as its default decode run measures it (``World.profiled_decode_tokens_per_s``): the world
    times a step exactly by its cost model, so the fit recovers that model and the prefill curve
    latency(L, 0). The operator loads this profile for the plan and for every autoscaling evaluation; so
    does the benchmark."""
    model, grid = world.cost_model, ProfileGrid.default()

    def steps(points: Sequence[tuple[int, int]], decode: Sequence[tuple[int, int]]) -> tuple[CostSample, ...]:
        single = [CostSample(p, c, model.latency_s(p, c)) for p, c in points]
        batched = [CostSample(b, b * c, model.latency_s(b, b * c, requests=b), requests=b) for b, c in decode]
        return (*single, *batched)

    measured = ProfileMeasurements(
        train=steps(grid.train, grid.decode_train),
        holdout=steps(grid.holdout, grid.decode_holdout),
        decode_throughput_tokens_per_s=world.profiled_decode_tokens_per_s(),
        kv_capacity_tokens=world.kv_capacity_tokens,
        model="bench",
        engine="coserve.sim (the benchmark's world)",
    )
    return build_profile(measured)[0]


def pool_spec(rows: Sequence[TraceRow], scale: float, world: World) -> dict[str, Any]:
    """The CoServePool an operator would write for this trace: its mean lengths and scaled rate, and a
    reference to the profile ``coserve profile`` measured on the world's engine (``engine_profile``)."""
    mean_prompt = sum(row.context_tokens for row in rows) / len(rows)
    mean_output = sum(row.generated_tokens for row in rows) / len(rows)
    rate = len(rows) / max(rows[-1].offset_s, 1.0) * scale
    decode_tps = world.profiled_decode_tokens_per_s()
    prompts = sorted(row.context_tokens for row in rows)
    long_prompt = prompts[min(len(prompts) - 1, int(0.999 * len(prompts)))]
    ttft_slo_s = max(2.0, math.ceil(2 * world.prefill_s(long_prompt)))
    return {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": "bench", "namespace": "bench"},
        "spec": {
            "model": {"name": "bench"},
            # what the pool was provisioned for; the autoscaler replaces R, L_in, L_d, W with measurements
            "workload": {
                "arrivalRatePerS": round(rate, 3),
                "inputTokens": round(mean_prompt),
                "outputTokens": round(mean_output),
                # one mean request alone: its prefill, then decoding at the profiled speed
                "lifetimeS": round(world.prefill_s(mean_prompt) + mean_output * 16 / decode_tps, 3),
            },
            # NOTE: nothing inline, so T_d comes from the profile's cost model at the pool's own operating
            # point (every KV slot decoding), not from the profiler's small decode batch
            "profile": {"configMapRef": {"name": PROFILE_CONFIG_MAP}},
            # the P/D autoscaler against the rule (the plan's own shape choice is plan_check's and ttfet_at_scale's)
            "shape": "Disaggregated",
            "priorityClasses": [
                {"name": "standard", "weight": 1, "ttftSloMs": 1000 * ttft_slo_s, "tpotSloMs": TPOT_SLO_MS}
            ],
        },
    }


@dataclass
class Run:
    """What one run leaves for ``summarize``: per-second series and the requests' fates."""

    name: str
    replicas: list[tuple[int, int]] = field(default_factory=list)  # asked for, each simulated second
    draining: list[int] = field(default_factory=list)  # replicas removed but still serving, each second
    arrived: list[int] = field(default_factory=list)  # per arrival second
    missed: list[int] = field(default_factory=list)
    span_s: int = 0  # seconds with arrivals (replica-hours are counted over these)
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)  # coserve's replica changes and their drivers


def request_class(spec: SpecModel) -> RequestClass:
    """The pool's (first) priority class as the engines resolve it."""
    classes = ClassRegistry([c.model_dump(by_alias=True, exclude_none=True) for c in spec.priority_classes])
    return classes.get(spec.priority_classes[0].name)


def conversations(arrivals: Arrivals) -> list[Conversation]:
    """Each request as a one-turn conversation; only a prompt's length matters to the simulator."""
    prompts: dict[int, tuple[int, ...]] = {}  # length -> a prompt of that length (shared: 40k prompts add up)
    return [
        Conversation(f"r{index}", at, (Turn(prompts.setdefault(prompt, (0,) * prompt), output, arrival_s=at),))
        for index, (at, prompt, output) in enumerate(
            zip(arrivals.times_s, arrivals.prompts, arrivals.outputs, strict=True)
        )
    ]


def pool_sim(
    spec: SpecModel,
    arrivals: Arrivals,
    scaler: Scaler | None,
    args: argparse.Namespace,
    world: World = WORLD,
    fixed: Replicas | None = None,
) -> PoolSim:
    """The world for one run: ``arrivals`` on a pool of ``world``'s engines at the spec's plan, ``scaler``
    deciding every ``args.interval`` seconds after ``WARMUP_S`` (never, with ``fixed``: a pool of that size)."""
    plan = plan_for(spec, engine_profile(world))
    start = fixed or Replicas(plan.prefillers, plan.decoders)
    config = world.config(
        start.prefillers,
        start.decoders,
        startup_s=args.startup,
        scale_interval_s=args.interval,
        scale_warmup_s=WARMUP_S,
    )
    work = conversations(arrivals)
    cls = request_class(spec)
    return PoolSim(config, work, dict.fromkeys((c.conversation_id for c in work), cls), None if fixed else scaler)


def simulate(
    name: str,
    spec: SpecModel,
    arrivals: Arrivals,
    scaler: Scaler | None,
    args: argparse.Namespace,
    world: World = WORLD,
    fixed: Replicas | None = None,
) -> Run:
    """One run of ``pool_sim``, to ``TAIL_S`` after the last arrival: what ``summarize`` needs."""
    sim = pool_sim(spec, arrivals, scaler, args, world, fixed)
    run = Run(name, span_s=arrivals.seconds)
    sim.env.process(_sample_replicas(sim, run))
    started = time.perf_counter()
    result = sim.run(until_s=arrivals.seconds + TAIL_S)
    run.wall_s = time.perf_counter() - started
    _count_misses(result, run, request_class(spec))
    return run


def _sample_replicas(sim: PoolSim, run: Run) -> Generator[Any, Any, None]:
    """A simpy process on the pool's clock: replicas asked for and draining, each simulated second."""
    while True:
        run.replicas.append((len(sim.prefillers), len(sim.decoders)))
        run.draining.append(sum(1 for engine in sim.draining if not engine.idle))
        yield sim.env.timeout(1.0)


def _count_misses(result: SimResult, run: Run, cls: RequestClass) -> None:
    run.arrived = [0] * run.span_s
    run.missed = [0] * run.span_s
    for record in result.records:
        request = record.request
        slot = int(request.arrival_s)
        times = request.token_times
        finished = len(times) >= request.max_output_tokens
        run.arrived[slot] += 1
        run.missed[slot] += not (finished and slo_attained(request.arrival_s, cls.ttft_slo_s, cls.tpot_slo_s, times))
        if times:
            run.ttft_s.append(times[0] - request.arrival_s)


def threshold_scaler(thresholds: Thresholds, decoder_target: float, prefiller_target: float) -> Scaler:
    """An HPA/KEDA-style rule on running + waiting requests per pod, with the HPA's tolerance and down-scale
    stabilization."""
    history: list[tuple[float, Replicas]] = []

    def one(current: int, requests: float, target: float) -> int:
        count = rule_count(current, requests, target)  # the rule as coserve's autoscaler computes its candidate
        return current if count is None else count

    def scaler(now_s: float, current: Replicas, seen: Observation) -> Replicas:
        # the HPA averages over every replica it asked for, counting pods not ready yet as idle
        raw = Replicas(
            one(current.prefillers, seen.prefiller_requests, prefiller_target),
            one(current.decoders, seen.decoder_requests, decoder_target),
        )
        raw = Replicas(
            min(max(raw.prefillers, thresholds.min_replicas.prefillers), thresholds.max_replicas.prefillers),
            min(max(raw.decoders, thresholds.min_replicas.decoders), thresholds.max_replicas.decoders),
        )
        history.append((now_s, raw))
        window_s = thresholds.stabilization_window_s
        recent = [r for at, r in history if now_s - at < window_s]
        # HPA: up at once; down to the highest recommendation of the stabilization window, once there is a
        # window of recommendations (as coserve's rule 4, so neither scales down on its first minutes of data)
        covered = now_s - history[0][0] >= window_s

        def stable(role: str) -> int:
            want, have = getattr(raw, role), getattr(current, role)
            if want >= have or not covered:
                return max(want, have)
            return min(have, max(getattr(r, role) for r in recent))

        return Replicas(stable("prefillers"), stable("decoders"))

    return scaler


def run_one(
    pool: dict[str, Any],
    arrivals: Arrivals,
    targets: tuple[float, float] | None,
    args: argparse.Namespace,
    thresholds: Thresholds,
) -> Run:
    """One autoscaled run (a process-pool job): coserve's scaler, or the rule at (decoder, prefiller) targets."""
    spec = parse_pool(pool).spec
    if targets is None:
        decisions: list[tuple[float, Decision]] = []
        scaler = coserve_scaler(spec, thresholds, engine_profile(WORLD), decisions)
        seen: list[Replicas] = []  # the replicas each recorded decision started from

        def recorded(now_s: float, current: Replicas, observed: Observation) -> Replicas:
            count = len(decisions)
            wanted = scaler(now_s, current, observed)
            seen.extend([current] * (len(decisions) - count))  # none when the model rejected the workload
            return wanted

        run = simulate("coserve", spec, arrivals, recorded, args)
        run.steps = scaling_steps(decisions, seen)
    else:
        run = simulate("threshold", spec, arrivals, threshold_scaler(thresholds, *targets), args)
    name = "coserve" if targets is None else f"rule d{targets[0]:g}/p{targets[1]:g}"
    say(f"{arrivals.label}: {name} simulated in {run.wall_s:.0f} s")
    return run


# A phrase of decide()'s reasons -> the rule it names; a role that went up with none of its phrases present
# went up on the model's re-plan from the measured workload.
DRIVERS = {
    "prefillers": (
        ("busy prefillers measure T_p", "measured T_p"),
        ("prefiller queue", "prefiller queue guard"),
        ("the queue-length rule", "queue-length rule"),
    ),
    "decoders": (("decoder KV occupancy", "KV guard"), ("the queue-length rule", "queue-length rule")),
}


def scaling_steps(decisions: Sequence[tuple[float, Decision]], seen: Sequence[Replicas]) -> list[dict[str, Any]]:
    """Each change of a role's replicas that coserve decided and what drove it: up, the model's re-plan or
    the guards named in the decision's reasons; down, the stabilization window."""
    steps = []
    for (at_s, decision), current in zip(decisions, seen, strict=True):
        for role in ("prefillers", "decoders"):
            before, after = getattr(current, role), getattr(decision.replicas, role)
            if after == before:
                continue
            # what the role went up on: its reasons, less the candidates the model did not add
            added = [r for r in decision.reasons if role.rstrip("s") in r and "not added" not in r]
            fired = [name for phrase, name in DRIVERS[role] if any(phrase in reason for reason in added)]
            drivers = ["stabilization window"] if after < before else fired or ["model re-plan"]
            steps.append({"at_s": at_s, "role": role, "from": before, "to": after, "drivers": drivers})
    return steps


def summarize(run: Run) -> dict[str, Any]:
    minutes = math.ceil(run.span_s / 60)
    violated = 0
    for minute in range(minutes):
        arrived = sum(run.arrived[minute * 60 : minute * 60 + 60])
        missed = sum(run.missed[minute * 60 : minute * 60 + 60])
        violated += int(arrived > 0 and missed / arrived > SLO_MISS_FRACTION)
    changes = {}
    for index, role in enumerate(("prefillers", "decoders")):
        series = [r[index] for r in run.replicas]
        moves = [b > a for a, b in itertools.pairwise(series) if b != a]
        changes[role] = sum(1 for a, b in itertools.pairwise(moves) if a != b)
    span = run.replicas[: run.span_s]
    ttfts = sorted(run.ttft_s)
    return {
        "slo_violation_minutes": violated,
        "minutes": minutes,
        "requests": sum(run.arrived),
        "requests_missing_slo_pct": 100 * sum(run.missed) / max(1, sum(run.arrived)),
        "replica_hours": (sum(p + d for p, d in span) + sum(run.draining[: run.span_s])) / 3600,
        "direction_changes": changes,
        "max_replicas": {"prefillers": max(p for p, _ in run.replicas), "decoders": max(d for _, d in run.replicas)},
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else math.nan,
        "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else math.nan,
    } | (_drivers(run.steps) if run.steps else {})


def _drivers(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """coserve's steps, and per role how many went up on each driver (a step with two counts for both)."""
    counts: dict[str, dict[str, int]] = {"prefillers": {}, "decoders": {}}
    for step in steps:
        for driver in step["drivers"]:
            counts[step["role"]][driver] = counts[step["role"]].get(driver, 0) + 1
    return {"scaling_drivers": counts, "scaling_steps": list(steps)}


def load_steps(arrived: Sequence[float], smooth_s: int = 120, tolerance: float = 0.1) -> int:
    """Direction changes of the load itself: turns of its 2-minute average by more than ``tolerance``."""
    rates = list(arrived)
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


def best_point(sweep: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rule's setting with the fewest SLO-violation minutes, then the fewest replica-hours (the frontier's
    most expensive point)."""
    return best_of(sweep, lambda s: (s["slo_violation_minutes"], s["replica_hours"]))


# (replica-hours, SLO-violation minutes)
Point = tuple[float, float]


def pareto_frontier(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both counts, sorted by replica-hours; each one has strictly fewer
    violation minutes than every cheaper one (a tie in replica-hours keeps the fewer minutes)."""
    return sorted(pareto(points, lambda point: (-point[0], -point[1])))  # fewer of both is better


def frontier_minutes_at(frontier: Sequence[Point], hours: float) -> float:
    """The frontier's violation minutes at ``hours`` replica-hours, linear between its points.

    Outside the swept range the frontier is flat: below its cheapest point it keeps that point's minutes
    (no setting ran that cheap, and a cheaper one would not have had fewer, so this is the rule's best case);
    above its most expensive point it keeps that point's minutes (the fewest any setting reached)."""
    if not frontier:
        raise ValueError("an empty frontier")
    if hours <= frontier[0][0]:
        return frontier[0][1]
    for (h0, m0), (h1, m1) in itertools.pairwise(frontier):
        if hours <= h1:
            # from the segment's far end, so that a point's own replica-hours give its minutes exactly
            return m1 + (m0 - m1) * (h1 - hours) / (h1 - h0)
    return frontier[-1][1]


def frontier_hours_at(frontier: Sequence[Point], minutes: float) -> float | None:
    """The frontier's replica-hours at ``minutes`` violation minutes, linear between its points (the inverse
    of ``frontier_minutes_at``). ``None`` below the fewest minutes any setting reached (the rule never gets
    there); at or above the cheapest point's minutes, that point's replica-hours."""
    if not frontier:
        raise ValueError("an empty frontier")
    if minutes >= frontier[0][1]:
        return frontier[0][0]
    for (h0, m0), (h1, m1) in itertools.pairwise(frontier):
        if minutes >= m1:
            return h1 - (h1 - h0) * (minutes - m1) / (m0 - m1)
    return None


def against_frontier(frontier: Sequence[Point], hours: float, minutes: float) -> dict[str, Any]:
    """coserve's point (``hours``, ``minutes``) against the rule's frontier.

    It beats the frontier when, at its own replica-hours, it has fewer violation minutes than the frontier
    there. A tie at zero (the frontier too has 0 minutes at coserve's replica-hours) is judged on cost:
    coserve must need no more replica-hours than the frontier's cheapest point with 0 minutes."""
    at_hours = frontier_minutes_at(frontier, hours)
    at_minutes = frontier_hours_at(frontier, minutes)
    tie_at_zero = minutes == 0 and at_hours == 0
    beats = minutes < at_hours or (tie_at_zero and at_minutes is not None and hours <= at_minutes)
    return {
        "frontier_minutes_at_coserve_replica_hours": at_hours,
        "frontier_replica_hours_at_coserve_minutes": at_minutes,
        "on_or_below_frontier": bool(minutes <= at_hours),
        "tie_at_zero_minutes": bool(tie_at_zero),
        "beats_frontier": bool(beats),
    }


@dataclass
class Trace:
    """One trace, ready to run: its replay, the pool spec an operator would write, the load's steps."""

    path: Path
    label: str
    scale: float
    arrivals: Arrivals
    pool: dict[str, Any]
    steps: int


def prepare(path: Path, args: argparse.Namespace) -> Trace:
    rows = load_trace(path)
    label = trace_label(path)
    scale = args.scale or auto_scale(rows, WORLD, args.prefillers_at_mean)
    arrivals = replay(rows, label, args.speedup, scale)
    pool = pool_spec(rows, scale, WORLD)
    steps = load_steps(per_second(arrivals))
    spec = parse_pool(pool).spec
    plan = plan_for(spec, engine_profile(WORLD))
    say(
        f"{label}: {len(arrivals.times_s):,} requests over {arrivals.seconds} simulated s (x{scale:.2f} rate, "
        f"{args.speedup:g}x sped up), {steps} load steps; TTFT SLO {spec.priority_classes[0].ttft_slo_ms / 1000:g} s; "
        f"plan {plan.prefillers} prefillers + {plan.decoders} decoders"
    )
    return Trace(path, label, scale, arrivals, pool, steps)


def submit(
    executor: Executor, trace: Trace, args: argparse.Namespace, thresholds: Thresholds
) -> dict[tuple[float, float] | None, Future[Run]]:
    """coserve's run (key None) and one run per rule setting (key (decoder target, prefiller target))."""
    settings = [None, *itertools.product(args.decoder_targets, args.prefiller_targets)]
    return {
        targets: executor.submit(run_one, trace.pool, trace.arrivals, targets, args, thresholds) for targets in settings
    }


def judge(trace: Trace, runs: dict[tuple[float, float] | None, Run]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trace's result (for the JSON) and what its plot needs."""
    label, steps = trace.label, trace.steps
    coserve_run = runs[None]
    ours = summarize(coserve_run)
    say(f"{label}: coserve {ours['slo_violation_minutes']} violation minutes, {ours['replica_hours']:.2f} replica-h")
    sweep = [
        {"decoder_target": targets[0], "prefiller_target": targets[1], **summarize(run)}
        for targets, run in runs.items()
        if targets is not None
    ]
    best = best_point(sweep)
    frontier = pareto_frontier([(s["replica_hours"], s["slo_violation_minutes"]) for s in sweep])
    versus = against_frontier(frontier, ours["replica_hours"], ours["slo_violation_minutes"])
    at_minutes = versus["frontier_replica_hours_at_coserve_minutes"]
    say(
        f"{label}: the rule's frontier has {versus['frontier_minutes_at_coserve_replica_hours']:.2f} violation "
        f"minutes at coserve's replica-hours and needs "
        f"{'more than any setting' if at_minutes is None else f'{at_minutes:.2f}'} replica-h at its minutes"
    )
    stable = max(ours["direction_changes"].values()) <= steps
    result = {
        "trace": label,
        "requests": len(trace.arrivals.times_s),
        "scale": trace.scale,
        "speedup": trace.arrivals.speedup,
        "load_steps": steps,
        "met": bool(stable) and not dominated_by(ours, sweep),
        **versus,
        "direction_changes_within_load_steps": bool(stable),
        "coserve": ours,
        # (replica-hours, violation minutes), sorted by replica-hours
        "baseline_frontier": [
            {"replica_hours": hours, "slo_violation_minutes": minutes} for hours, minutes in frontier
        ],
        "best_baseline": best,
        "baseline_settings_at_least_as_good_on_both": len(dominated_by(ours, sweep)),
        "baseline_sweep": sweep,
        "pool": trace.pool["spec"],
        "profile": engine_profile(WORLD).model_dump(mode="json", by_alias=True, exclude_none=True),
        "simulation_wall_s": round(sum(run.wall_s for run in runs.values()), 1),
    }
    best_run = runs[(best["decoder_target"], best["prefiller_target"])]
    return result, {
        "arrivals": trace.arrivals,
        "coserve": coserve_run,
        "baseline": best_run,
        "sweep": sweep,
        "frontier": frontier,
        "ours": ours,
        "best": best,
    }


def dominated_by(ours: dict[str, Any], sweep: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """The rule's settings (decoder target, prefiller target) with no more violation minutes and no more
    replica-hours than coserve's run ``ours``."""
    return [
        (s["decoder_target"], s["prefiller_target"])
        for s in sweep
        if s["slo_violation_minutes"] <= ours["slo_violation_minutes"] and s["replica_hours"] <= ours["replica_hours"]
    ]


def dominant_everywhere(results: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """The rule's settings at least as good as coserve on both counts on every trace at once (one setting, as an
    operator would deploy it)."""
    sets = [set(dominated_by(r["coserve"], r["baseline_sweep"])) for r in results]
    return sorted(set.intersection(*sets)) if sets else []


def per_second(arrivals: Arrivals) -> list[int]:
    counts = [0] * arrivals.seconds
    for at in arrivals.times_s:
        counts[int(at)] += 1
    return counts


class _Inline(Executor):
    """Runs each job when it is submitted (``--jobs 1``)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", type=Path, action="append", help="a trace to replay (repeatable; default: both in data/traces)"
    )
    parser.add_argument("--speedup", type=float, default=4.0, help="replay this many times faster (default 4)")
    parser.add_argument("--scale", type=float, default=None, help="rate multiplier for every trace (default: auto)")
    parser.add_argument(
        "--prefillers-at-mean",
        type=float,
        default=2.0,
        help="auto scale: the trace's mean load needs this many prefillers (default 2)",
    )
    parser.add_argument("--interval", type=int, default=15, help="evaluation interval, s (default 15)")
    parser.add_argument("--window", type=float, default=300.0, help="stabilization window, s (default 300)")
    parser.add_argument("--startup", type=float, default=60.0, help="replica start-up, s (default 60)")
    parser.add_argument("--decoder-targets", type=float, nargs="+", default=list(DECODER_TARGETS))
    parser.add_argument("--prefiller-targets", type=float, nargs="+", default=list(PREFILLER_TARGETS))
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="runs at once, in processes (default: one per core)"
    )
    args = parser.parse_args()
    thresholds = Thresholds(
        min_replicas=Replicas(1, 1),
        max_replicas=Replicas(16, 64),
        stabilization_window_s=args.window,
        startup_s=args.startup,
    )
    started = time.perf_counter()
    traces = [prepare(path, args) for path in args.trace or DEFAULT_TRACES]
    executor: Executor = ProcessPoolExecutor(args.jobs) if args.jobs > 1 else _Inline()
    with executor:
        futures = [submit(executor, trace, args, thresholds) for trace in traces]
        judged = [
            judge(trace, {targets: future.result() for targets, future in jobs.items()})
            for trace, jobs in zip(traces, futures, strict=True)
        ]
    results = [result for result, _ in judged]
    plots = [plotted for _, plotted in judged]
    say(f"{sum(len(jobs) for jobs in futures)} runs in {time.perf_counter() - started:.0f} s ({args.jobs} jobs)")
    print_table(results)
    write_result(
        "autoscaling",
        {
            "benchmark": "autoscaling",
            "world": "coserve.sim",
            "target": "on every trace, no setting of the swept queue-length rule at least as good on both "
            "SLO-violation minutes and replica-hours; at most one scale direction change per load step",
            "met": all(r["met"] for r in results),
            "rule_settings_at_least_as_good_on_every_trace": [
                {"decoder_target": d, "prefiller_target": p} for d, p in dominant_everywhere(results)
            ],
            "traces": results,
            "setup": {
                k: getattr(args, k)
                for k in (
                    "speedup",
                    "scale",
                    "prefillers_at_mean",
                    "interval",
                    "window",
                    "startup",
                    "decoder_targets",
                    "prefiller_targets",
                )
            }
            | {
                "engine": {
                    **WORLD.cost_model.to_dict(),
                    "max_tokens_per_step": WORLD.max_tokens_per_step,
                    "max_num_seqs": WORLD.max_num_seqs,
                    "kv_capacity_tokens": WORLD.kv_capacity_tokens,
                },
                "engine_note": "coserve.sim.PoolSim: SlideBatching decides each step; a step takes k5 + the sum over "
                "its requests of k1·p + k2·p·(p + c) + k4·(p + c) seconds (p new tokens over c cached ones); "
                "GPU-like (8B model, GQA, one H100-class GPU)",
                "kv_link": {
                    "kv_bytes_per_token": WORLD.config(1, 1).kv_bytes_per_token,
                    "kv_bandwidth_bytes_per_s": WORLD.config(1, 1).kv_bandwidth_bytes_per_s,
                },
                "profiled_decode_tokens_per_s": WORLD.profiled_decode_tokens_per_s(),
                "thresholds": {"min": [1, 1], "max": [16, 64], "stabilization_window_s": args.window},
                "warmup_s": WARMUP_S,
                "tail_s": TAIL_S,
                "slo": f"TTFT SLO = max(2 s, 2 x unloaded prefill of the p99.9 prompt); TPOT SLO {TPOT_SLO_MS:g} ms; "
                f"a violation minute has > {SLO_MISS_FRACTION:.0%} of its arrivals missing the SLO",
                "baseline_frontier": "the sweep's Pareto frontier over (replica-hours, SLO-violation minutes), "
                "linear between its points; below its cheapest point it keeps that point's minutes, above its "
                "most expensive point that point's minutes",
                "best_baseline_rule": "fewest SLO-violation minutes, ties broken by fewest replica-hours (the "
                "frontier's most expensive point; its replicas are plotted over time)",
                "jobs": args.jobs,
                "wall_s": round(time.perf_counter() - started, 1),
            },
        },
    )
    plot(plots)
    return 0


def print_table(results: Sequence[dict[str, Any]]) -> None:
    for result in results:
        ours, best = result["coserve"], result["best_baseline"]
        head = f"best rule (d{best['decoder_target']:g}/p{best['prefiller_target']:g})"
        print(
            f"\n{result['trace']}: {result['requests']:,} requests, x{result['scale']:.2f} rate, "
            f"{result['load_steps']} load steps"
        )
        table = Table("", [("coserve", 12), (head, 26)], label_width=34)
        for label, key, fmt in (
            ("SLO-violation minutes", "slo_violation_minutes", "{}"),
            ("requests missing the SLO (%)", "requests_missing_slo_pct", "{:.2f}"),
            ("replica-hours", "replica_hours", "{:.2f}"),
            ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}"),
        ):
            table.row(label, show(ours[key], fmt), show(best[key], fmt))
        for role in ("prefillers", "decoders"):
            table.row(
                f"{role} direction changes", str(ours["direction_changes"][role]), str(best["direction_changes"][role])
            )
            table.row(f"max {role}", str(ours["max_replicas"][role]), str(best["max_replicas"][role]))
        frontier = ", ".join(
            f"{point['replica_hours']:.2f} h/{point['slo_violation_minutes']:g} min"
            for point in result["baseline_frontier"]
        )
        at_minutes = result["frontier_replica_hours_at_coserve_minutes"]
        print(f"the rule's frontier: {frontier}")
        for role, counts in ours.get("scaling_drivers", {}).items():
            named = ", ".join(f"{driver} {count}" for driver, count in counts.items()) or "none"
            print(f"coserve's {role} steps by driver: {named}")
        print(
            f"at coserve's {ours['replica_hours']:.2f} replica-h the frontier has "
            f"{result['frontier_minutes_at_coserve_replica_hours']:.2f} violation minutes (coserve "
            f"{ours['slo_violation_minutes']}); at coserve's minutes it needs "
            f"{'more than any setting' if at_minutes is None else f'{at_minutes:.2f} replica-h'}"
        )
        print(
            f"met: {result['met']} (rule settings (of {len(result['baseline_sweep'])}) at least as good on both "
            f"counts: {result['baseline_settings_at_least_as_good_on_both']}; direction changes within load steps: "
            f"{result['direction_changes_within_load_steps']}; beats the frontier: {result['beats_frontier']})"
        )
    everywhere = dominant_everywhere(results)
    print(
        f"\nrule settings at least as good as coserve on both counts on every trace at once: {len(everywhere)}"
        + (f" ({', '.join(f'd{d:g}/p{p:g}' for d, p in everywhere)})" if everywhere else "")
    )


def plot(plots: Sequence[dict[str, Any]]) -> None:
    size = (7 * len(plots), 10)
    with figure(RESULTS / "autoscaling.png", rows=4, columns=len(plots), size=size, dpi=90, squeeze=False) as axes:
        for column, plotted in enumerate(plots):
            plot_trace([row[column] for row in axes], plotted)
        axes[0][0].figure.suptitle("autoscaling in coserve.sim (the simulated pool of `coserve simulate`)")


def plot_trace(axes: Sequence[Any], plotted: dict[str, Any]) -> None:
    """One trace's column: its arrivals, each role's replicas (coserve and the best rule), and the sweep."""
    arrivals: Arrivals = plotted["arrivals"]
    counts = per_second(arrivals)
    length = len(plotted["coserve"].replicas)
    minutes = [s / 60 for s in range(length)]
    smooth = [sum(counts[max(0, i - 60) : i + 1]) / min(i + 1, 61) if i < len(counts) else 0.0 for i in range(length)]
    best = plotted["best"]
    axes[0].plot(minutes, smooth)
    axes[0].set_ylabel("requests/s (1-min mean)")
    axes[0].set_title(f"{arrivals.label} (x{arrivals.scale:.2f} rate, {arrivals.speedup:g}x sped up)")
    for index, role in enumerate(("prefillers", "decoders")):
        axis = axes[index + 1]
        axis.plot(minutes, [r[index] for r in plotted["coserve"].replicas], label="coserve")
        axis.plot(
            minutes,
            [r[index] for r in plotted["baseline"].replicas],
            label=f"best rule (d{best['decoder_target']:g}/p{best['prefiller_target']:g})",
        )
        axis.set_ylabel(role)
        axis.legend()
    axes[2].set_xlabel("simulated minutes")
    sweep_axis = axes[3]
    sweep_axis.scatter(
        [s["replica_hours"] for s in plotted["sweep"]],
        [s["slo_violation_minutes"] for s in plotted["sweep"]],
        label="rule sweep",
        s=14,
    )
    plot_frontier(sweep_axis, plotted["frontier"], plotted["ours"]["replica_hours"])
    sweep_axis.scatter(
        [best["replica_hours"]],
        [best["slo_violation_minutes"]],
        marker="s",
        s=50,
        facecolors="none",
        edgecolors="C1",
        label="best rule",
    )
    sweep_axis.scatter(
        [plotted["ours"]["replica_hours"]],
        [plotted["ours"]["slo_violation_minutes"]],
        marker="*",
        s=120,
        color="C3",
        label="coserve",
        zorder=3,
    )
    sweep_axis.set_xlabel("replica-hours")
    sweep_axis.set_ylabel("SLO-violation minutes")
    sweep_axis.legend()


def plot_frontier(axis: Any, frontier: Sequence[Point], coserve_hours: float) -> None:
    """The rule's frontier: solid between its points, dashed where it is held flat beyond them."""
    hours = [h for h, _ in frontier]
    minutes = [m for _, m in frontier]
    axis.plot(hours, minutes, color="C2", label="rule frontier")
    low, high = min(hours[0], coserve_hours) * 0.97, max(hours[-1], coserve_hours) * 1.03
    axis.plot([low, hours[0]], [minutes[0]] * 2, color="C2", linestyle="--")
    axis.plot([hours[-1], high], [minutes[-1]] * 2, color="C2", linestyle="--")
    axis.scatter(
        [coserve_hours], [frontier_minutes_at(frontier, coserve_hours)], marker="x", color="C2",
        label="frontier at coserve's replica-h",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
