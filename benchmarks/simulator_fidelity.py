"""How well the simulator (``coserve simulate``) predicts three serving runs measured on this machine.

coserve's discrete-event simulator (``coserve.sim``: every engine step decided by SlideBatching and
timed by the step cost model, the router's placement and pins) replays the exact workloads of three
benchmarks whose measured results are committed, with the engine knobs those runs used, calibrated
with the same ``coserve profile`` their engines got (``_harness.measured_cost_model`` of the
16-layer, 512-hidden bench model, read from its cache; nothing is profiled or started here):

- ``ttfet`` (``results/ttfet.json``): the local pool, one prefiller and two decoders behind the
  router, 100 agentic conversations (Poisson at ``setup.rate``, 3 turns, 512 first tokens, 16 + 64
  appended per turn, 16-token answers, 1 s tool gaps), once per placement: conversation (coserve),
  per-turn and per-request -> ``PoolSim`` with the same placement, 1 prefiller and 2 decoders.
- ``coserving`` (``results/coserving.json``, the coserve arm): one engine; a time-stretched window
  of the Azure conversation trace online plus 8 closed-loop offline clients (512-token prompts, 64
  output tokens) for 90 s, then the same offline clients with no online load -> ``PoolSim``
  ``per-request`` with one decoder and ``OfflineWork(concurrency=8, spare=1.01)`` (the measured
  clients sent straight to the engine, so no spare-KV gate).
- ``priority_scheduling`` (``results/priority_scheduling.json``, the coserve arm): one engine,
  Poisson arrivals at 5/s for 60 s, Azure lengths scaled, three classes -> ``PoolSim``
  ``per-request`` with one decoder.

Workloads come from the benchmark scripts' own functions (``coserving.online_workload``,
``priority_scheduling.workload``, the same trace and seed) or, for ``ttfet`` whose generator is
inline in its async client, are rebuilt with its seeds (7 for arrivals, 100 + i for conversation i).
Engine knobs are those the runs' engines had: the coserve engine configuration each script wrote,
parsed by ``coserve.scheduling.config.parse_engine_config`` as the TDG scheduler parses it (classes
with first-token factor 2, the offline class, ``SlideConfig`` with the 256-token step budget);
``max_num_seqs`` 128 (vLLM 0.32's CPU default for its API server); KV capacity 32,768 tokens per
engine (1 GiB of ``VLLM_CPU_KVCACHE_SPACE`` at 32 KiB per token: 16 layers x 2 x 4 KV heads x 64 x
4 bytes, the profile's ``kvCapacityTokens`` too, and what vLLM logged when these engines started).

Every figure the measured JSON reports with enough samples (``_harness.reportable_percentile``:
p50 from 10, p95 from 100) is paired with the simulated one: TTFT (or TTFET) p50 and p95, and both
SLO attainments (every token by its deadline; TTFT and mean TPOT within SLO). A measured null is
skipped and listed. Target: every pair within 10% relative error (Vidur's bar: 9% at p95); ``met``
is computed from the pairs. TPOT, offline tokens/s, the runs' makespans and the decoders'
prompt recomputation are reported beside them as diagnostics, not judged.

    .venv/bin/python benchmarks/simulator_fidelity.py       # about 5 s on 2 cores; starts no engine

Writes benchmarks/results/simulator_fidelity.json (pairs, skipped pairs, diagnostics, the
simulated set-up, and ``notes`` on where the simulation departs from the runs).

Known limits, each checked against the measured runs' scripts and results:

- The ``ttfet`` run started its prefiller and both decoders (plus the router and the client) on
  one 2-core machine (``cpu_count`` 2 in its result); the simulator runs three independent engines,
  each at the profile's speed.
- The profile was measured in-process (``vllm.LLM``, ``coserve.engine.profiler``) on single
  requests: the quick grid's prefill steps, P <= 512 new tokens over C <= 512 cached ones. The
  measured runs go through vLLM's API server and HTTP streaming (and the router for ``ttfet``);
  the simulator applies latency(P, C) to batched decode steps whose contexts sum to thousands.
- The simulated engine does not preempt running requests for KV (it admits conservatively) and
  has no host KV pool (the ``ttfet`` decoders had 1 GiB each).
- ``ttfet``'s later turns append 16 random tokens standing in for the answer, and vLLM's CPU
  prefix cache reuses whole 128-token blocks, so a real decoder recomputes 80 and then 160 prompt
  tokens; the simulator's prefix cache holds the answer too and recomputes 64 per later turn.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import coserving
import priority_scheduling
import ttfet
import yaml
from _harness import (
    MIN_SAMPLES,
    PROFILE_FILE,
    RESULTS,
    TRACES,
    bench_model,
    load_trace,
    measured_cost_model,
    reportable_percentile,
    say,
    write_result,
)

from coserve.bench.workload import Conversation, Turn
from coserve.engine.launch import EngineSettings
from coserve.router.config import RouterConfig, parse_router_config
from coserve.scheduling import StepCostModel
from coserve.scheduling.config import EngineSchedulingConfig, parse_engine_config
from coserve.scheduling.gain import request_gain, slo_attained
from coserve.scheduling.profile_fit import ProfileGrid
from coserve.scheduling.requests import RequestClass
from coserve.sim import OfflineWork, PoolSim, SimConfig, SimEngine, SimRequest, SimResult

TOLERANCE = 0.10
# vLLM 0.32 on CPU, API server: max_num_seqs defaults to 128 x world size (EngineArgs.get_batch_defaults),
# capped at max_num_batched_tokens; no measured run set it.
VLLM_CPU_MAX_NUM_SEQS = 128
# Every measured engine got VLLM_CPU_KVCACHE_SPACE=1 (EngineServer.environment): 1 GiB of KV per engine.
KV_CACHE_BYTES = 1 << 30
# ttfet.py: one prefiller and two decoders (its engine table), 16-token answers (``ttfet.turn``), and each
# later turn appends 16 tokens standing in for the answer plus ``appended`` (``ttfet.conversation``).
TTFET_DECODERS = 2
TTFET_ANSWER_TOKENS = 16
TTFET_PLACEMENTS = {"conversation": "conversation", "baseline": "turn", "per_request": "request"}  # key -> router's
SIM_PLACEMENT = {"conversation": "conversation", "turn": "per-turn", "request": "per-request"}  # router's -> sim's
# the closed-loop offline clients never wait for spare KV: a spare threshold above 1 disables the gate
NO_SPARE_GATE = 1.01


# --- comparing ----------------------------------------------------------------------------------


def relative_error(measured: float, simulated: float | None) -> float | None:
    """|simulated - measured| / |measured|; ``None`` when there is no simulated value or it is undefined."""
    if simulated is None:
        return None
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return abs(simulated - measured) / abs(measured)


def compare(
    run: str, arm: str, figure: str, measured: float | None, simulated: float | None, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """One figure, measured beside simulated; ``within`` is whether the relative error is at most ``tolerance``."""
    error = None if measured is None else relative_error(measured, simulated)
    return {
        "run": run,
        "arm": arm,
        "figure": figure,
        "measured": measured,
        "simulated": simulated,
        "relative_error": error,
        "within": error is not None and error <= tolerance,
    }


def met(pairs: Sequence[dict[str, Any]]) -> bool:
    """The target: at least one pair, and every pair within its tolerance."""
    return bool(pairs) and all(p["within"] for p in pairs)


def percentile_figure(name: str) -> int | None:
    """``ttft_p95_s`` -> 95; ``None`` for a figure that is not a percentile."""
    for part in name.split("_"):
        if part.startswith("p") and part[1:].isdigit():
            return int(part[1:])
    return None


@dataclass
class Comparison:
    """What the runs contribute: judged pairs, pairs skipped for a null measurement, and diagnostics."""

    pairs: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    diagnostics: list[dict[str, Any]]

    def judge(
        self, run: str, arm: str, figures: Iterable[str], measured: dict[str, Any], simulated: dict[str, Any]
    ) -> None:
        """Pair every figure the measured side reports; a null measured value is skipped, with the reason."""
        for figure in figures:
            value = measured.get(figure)
            if value is None:
                q = percentile_figure(figure)
                why = f"measured null: fewer than {MIN_SAMPLES[q]} samples" if q else "measured null"
                self.skipped.append({"run": run, "arm": arm, "figure": figure, "why": why})
                continue
            self.pairs.append(compare(run, arm, figure, float(value), simulated.get(figure)))

    def note(self, run: str, arm: str, figure: str, measured: float | None, simulated: float | None) -> None:
        self.diagnostics.append(compare(run, arm, figure, measured, simulated))


def class_figures(requests: Sequence[SimRequest], cls: RequestClass) -> dict[str, Any]:
    """The simulated counterpart of ``_harness.class_report`` for one class: attainment over every request,
    percentiles over the finished ones (as a client that received every token)."""
    done = [r for r in requests if len(r.token_times) >= r.max_output_tokens]
    attained = classic = 0
    gain = 0.0
    for r in done:
        report = request_gain(cls, r.arrival_s, cls.ttft_slo_s, cls.tpot_slo_s, r.token_times)
        attained += report.all_on_time
        gain += report.earned
        classic += slo_attained(r.arrival_s, cls.ttft_slo_s, cls.tpot_slo_s, r.token_times)
    ttfts = [r.token_times[0] - r.arrival_s for r in done]
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in done if len(r.token_times) > 1]
    n = len(requests)
    return {
        "requests": n,
        "n": len(done),
        "slo_attainment": attained / n if n else None,
        "ttft_and_mean_tpot_attainment": classic / n if n else None,
        "gain": gain,
        "ttft_p50_s": reportable_percentile(ttfts, 50),
        "ttft_p95_s": reportable_percentile(ttfts, 95),
        "tpot_p50_s": reportable_percentile(tpots, 50),
        "tpot_p95_s": reportable_percentile(tpots, 95),
    }


CLASS_FIGURES = ("ttft_p50_s", "ttft_p95_s", "slo_attainment", "ttft_and_mean_tpot_attainment")
TPOT_FIGURES = ("tpot_p50_s", "tpot_p95_s")


# --- the measured set-ups -------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """What every simulated engine shares: the profile's cost model and the engines' KV capacity."""

    cost_model: dict[str, float]
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    profile: dict[str, Any]


def calibration(layers: int, hidden_size: int) -> Calibration:
    """The cached profile of the bench model the measured runs used; never profiles (that would start vLLM)."""
    model = bench_model(layers, hidden_size)
    path = model / PROFILE_FILE
    if not path.exists():
        raise SystemExit(f"{path} is missing: run the measured benchmarks (or `coserve profile`) first")
    profile = yaml.safe_load(path.read_text())
    kv_bytes = kv_bytes_per_token(json.loads((model / "config.json").read_text()))
    return Calibration(measured_cost_model(model), KV_CACHE_BYTES // kv_bytes, kv_bytes, profile)


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """KV bytes one token holds in a Llama-shaped model (its HF ``config.json``): K and V, every layer and KV head."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes)


def sim_config(
    engine: EngineSchedulingConfig, cal: Calibration, *, placement: str, prefillers: int, decoders: int, **extra: Any
) -> SimConfig:
    return SimConfig(
        prefillers=prefillers,
        decoders=decoders,
        cost_model=engine.cost_model,
        kv_capacity_tokens=cal.kv_capacity_tokens,
        placement=placement,
        max_num_seqs=VLLM_CPU_MAX_NUM_SEQS,
        slide=engine.slide,
        kv_bytes_per_token=float(cal.kv_bytes_per_token),
        **extra,
    )


def one_turn(requests: Sequence[Any], prefix: str) -> list[Conversation]:
    """``_harness.BenchRequest``s sent at fixed times, as one-turn conversations."""
    return [
        Conversation(f"{prefix}-{i}", r.at_s, (Turn(tuple(r.prompt), r.max_tokens, arrival_s=r.at_s),))
        for i, r in enumerate(requests)
    ]


def ttfet_conversations(setup: dict[str, Any]) -> list[Conversation]:
    """``ttfet.run_arm``'s conversations: arrivals from ``Random(7)``, conversation i from ``Random(100 + i)``."""
    arrivals = random.Random(7)
    conversations, at = [], 0.0
    for index in range(setup["conversations"]):
        rng = random.Random(100 + index)
        prompt = [rng.randrange(16, 1000) for _ in range(setup["first"])]
        turns = [Turn(tuple(prompt), TTFET_ANSWER_TOKENS)]
        for _ in range(setup["turns"] - 1):
            prompt += [rng.randrange(16, 1000) for _ in range(TTFET_ANSWER_TOKENS + setup["appended"])]
            turns.append(Turn(tuple(prompt), TTFET_ANSWER_TOKENS, gap_s=setup["gap"]))
        conversations.append(Conversation(f"ttfet-{index}", at, tuple(turns)))
        at += arrivals.expovariate(setup["rate"])
    return conversations


def ttfet_router(arm_placement: str) -> RouterConfig:
    """The router configuration ``ttfet.py`` built for one arm (its URLs are placeholders)."""
    config: dict[str, Any] = {
        "model": "tiny",
        "decoders": ["http://decoder-0", "http://decoder-1"],
        "priorityClasses": ttfet.CLASSES,
        "placement": arm_placement,
        "pollS": 0.5,
    }
    if arm_placement != "request":
        config["prefillers"] = ["http://prefiller-0"]
    return parse_router_config(config)


def coserving_engine(budget: int, cost_model: dict[str, float]) -> tuple[EngineSettings, dict[str, Any]]:
    """``coserving.py``'s coserve engine: its configuration and settings (not started)."""
    config = {
        "priorityClasses": coserving.CLASSES,
        "offline": {"enabled": True, "className": "offline"},
        "scheduler": {"maxTokensPerStep": budget, "defaultClass": "online"},
        "costModel": cost_model,
    }
    return EngineSettings(model=Path("unused"), workdir=Path("unused"), engine_config=config), config


def priority_engine(cost_model: dict[str, float]) -> EngineSettings:
    """``priority_scheduling.py``'s coserve engine settings (not started)."""
    return priority_scheduling.Setup("coserve", coserve=True).settings(Path("unused"), Path("unused"), cost_model)


def trace_path(label: str) -> Path:
    path = Path(label)
    return path if path.is_absolute() else TRACES / label


# --- the runs -------------------------------------------------------------------------------------


def makespan_s(starts: Sequence[float], ttfets: Sequence[float]) -> float:
    """When the last conversation's final turn gave its first token."""
    return max(s + t for s, t in zip(starts, ttfets, strict=True))


def decoder_prompt_tokens(result: SimResult) -> int:
    """Prompt tokens the decoders computed (what they did not hold or receive), as vLLM's ``local_compute``."""
    return sum(r.request.prompt_tokens - r.request.cached for r in result.records if r.decoder)


def run_ttfet(measured: dict[str, Any], cal: Calibration, out: Comparison) -> dict[str, Any]:
    setup = measured["setup"]
    conversations = ttfet_conversations(setup)
    starts = [c.start_s for c in conversations]
    # ttfet.py's engines: its classes and cost model, EngineSettings' default step budget
    engine = parse_engine_config(
        {"priorityClasses": ttfet.CLASSES, "costModel": cal.cost_model},
        EngineSettings(Path("unused"), Path("unused")).max_num_batched_tokens,
    )
    arms: dict[str, Any] = {}
    for key, placement in TTFET_PLACEMENTS.items():
        router = ttfet_router(placement)
        cls = engine.classes.get(router.classes.default.name)  # the router labels unlabelled turns
        config = sim_config(
            engine,
            cal,
            placement=SIM_PLACEMENT[placement],
            prefillers=1 if placement != "request" else 0,
            decoders=TTFET_DECODERS,
            poll_s=router.poll_s,
            full=router.decoder_full,
            pin_ttl_s=router.pin_ttl_s,
        )
        started = time.monotonic()
        result = PoolSim(config, conversations, {c.conversation_id: cls for c in conversations}).run()
        say(f"[ttfet] {placement}: simulated in {time.monotonic() - started:.1f} s")
        simulated = result.ttfet_s()
        arm = f"{placement} placement"
        mine = measured[key]
        out.judge(
            "ttfet",
            arm,
            ("ttfet_p50_s", "ttfet_p95_s"),
            mine,
            {"ttfet_p50_s": reportable_percentile(simulated, 50), "ttfet_p95_s": reportable_percentile(simulated, 95)},
        )
        finals = [r.request.token_times[0] for r in result.records if r.last_turn and r.request.token_times]
        out.note("ttfet", arm, "last_final_turn_first_token_s", makespan_s(starts, mine["ttfet_s"]), max(finals))
        out.note(
            "ttfet",
            arm,
            "decoder_computed_prompt_tokens",
            mine["decoder_computed_prompt_tokens"],
            decoder_prompt_tokens(result),
        )
        arms[key] = {
            "placement": config.placement,
            "conversations": len(simulated),
            "ttfet_s": simulated,
            "decoder_prompt_tokens": decoder_prompt_tokens(result),
            "utilisation": result.utilisation(),
        }
    return {
        "measured": "benchmarks/results/ttfet.json",
        "measured_commit": measured["commit"]["sha"],
        "workload": {**setup, "answer_tokens": TTFET_ANSWER_TOKENS, "class": cls.name},
        "sim": {
            "prefillers": "1 (none with per-request placement)",
            "decoders": TTFET_DECODERS,
            "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
            "max_tokens_per_step": engine.slide.max_tokens_per_step,
            "poll_s": config.poll_s,
            "decoder_full": config.full,
        },
        "arms": arms,
    }


def offline_phase(
    config: SimConfig, conversations: list[Conversation], class_of: dict[str, RequestClass], duration_s: float
) -> tuple[SimResult, list[SimRequest], float]:
    """One ``coserving.phase``: the online requests and the closed-loop offline clients, until the online
    requests are done and ``duration_s`` has passed. Returns the result, every offline request the clients
    sent (finished or not), and the window's end."""
    if config.offline is None:
        raise ValueError("offline: a co-serving phase needs offline work")
    offline = config.offline.cls.name
    sim = PoolSim(config, conversations, class_of)
    finished: list[SimRequest] = []
    for engine in sim.by_name.values():
        engine.on_finish = _recording(engine.on_finish, finished, offline)
    result = sim.run(until_s=None if conversations else duration_s)
    if sim.env.now < duration_s:
        sim.env.run(until=duration_s)  # the offline clients run on until the window closes
    in_flight = [r for e in sim.by_name.values() for r in [*e.running, *e.waiting] if r.cls.name == offline]
    return result, finished + in_flight, float(sim.env.now)


def _recording(
    inner: Callable[[SimEngine, SimRequest, float], None], into: list[SimRequest], cls_name: str
) -> Callable[[SimEngine, SimRequest, float], None]:
    """An engine's ``on_finish`` that also keeps the requests of class ``cls_name`` that finished there.

    NOTE: ``SimResult`` keeps no record of offline requests (only their token count), and the co-serving
    benchmark's figures need each one's token times.
    """

    def on_finish(engine: SimEngine, request: SimRequest, now: float) -> None:
        if request.cls.name == cls_name:
            into.append(request)
        inner(engine, request, now)

    return on_finish


def offline_tokens_per_s(requests: Sequence[SimRequest], window_s: float) -> float:
    """``coserving.phase``'s count: output tokens emitted in the window, prompt tokens once the first token came."""
    processed = sum(len(r.token_times) + (r.prompt_tokens if r.token_times else 0) for r in requests)
    return processed / window_s


def run_coserving(measured: dict[str, Any], cal: Calibration, out: Comparison) -> dict[str, Any]:
    workload = measured["workload"]
    concurrency = measured["coserve"]["offline_concurrency"]
    settings, engine_json = coserving_engine(measured["setup"]["coserve_budget"], cal.cost_model)
    engine = parse_engine_config(engine_json, settings.max_num_batched_tokens)
    offline = OfflineWork(
        cls=engine.classes.get(engine.offline_class or "offline"),
        prompt_tokens=coserving.OFFLINE_PROMPT,
        output_tokens=coserving.OFFLINE_OUTPUT,
        concurrency=concurrency,
        spare=NO_SPARE_GATE,
    )
    config = sim_config(
        engine, cal, placement="per-request", prefillers=0, decoders=1, offline=offline, fast_forward=False
    )  # the window ends mid-run: token times step by step
    online = coserving.online_workload(
        load_trace(trace_path(workload["trace"])),
        workload["online_rate_per_s"],
        workload["duration_s"],
        workload["seed"],
    )
    conversations = one_turn(online, "online")
    online_cls = engine.classes.get("online")
    phases: dict[str, Any] = {}
    for key, label, sent in (("coserve", "co-serving", conversations), ("coserve_offline_only", "offline only", [])):
        started = time.monotonic()
        result, offline_requests, window_s = offline_phase(
            config, sent, {c.conversation_id: online_cls for c in sent}, workload["duration_s"]
        )
        say(f"[coserving] {label}: simulated in {time.monotonic() - started:.1f} s")
        mine = measured[key]
        arm = f"coserve, {label}"
        finished_offline = [r for r in offline_requests if len(r.token_times) >= r.max_output_tokens]
        simulated_offline = class_figures(finished_offline, offline.cls)
        if sent:
            simulated_online = class_figures([r.request for r in result.records], online_cls)
            out.judge("coserving", f"{arm}, online", CLASS_FIGURES, mine["online"], simulated_online)
            out.judge("coserving", f"{arm}, offline", CLASS_FIGURES, mine["offline"], simulated_offline)
            for figure in TPOT_FIGURES:
                out.note("coserving", f"{arm}, online", figure, mine["online"][figure], simulated_online[figure])
        else:
            simulated_online = None
            out.judge("coserving", f"{arm}, offline", CLASS_FIGURES, mine["offline"], simulated_offline)
        for figure in TPOT_FIGURES:
            out.note("coserving", f"{arm}, offline", figure, mine["offline"][figure], simulated_offline[figure])
        tokens_per_s = offline_tokens_per_s(offline_requests, window_s)
        out.note("coserving", arm, "offline_tokens_per_s", mine["offline_tokens_per_s"], tokens_per_s)
        out.note("coserving", arm, "offline_requests_finished", mine["offline"]["requests"], len(finished_offline))
        phases[key] = {
            "window_s": window_s,
            "offline_tokens_per_s": tokens_per_s,
            "online": simulated_online,
            "offline": simulated_offline,
        }
    return {
        "measured": "benchmarks/results/coserving.json",
        "measured_commit": measured["commit"]["sha"],
        "workload": {
            **{k: workload[k] for k in ("trace", "online_rate_per_s", "duration_s", "seed")},
            "online_requests": len(online),
            "offline_concurrency": concurrency,
            "offline_prompt_tokens": offline.prompt_tokens,
            "offline_output_tokens": offline.output_tokens,
        },
        "sim": {
            "placement": "per-request",
            "prefillers": 0,
            "decoders": 1,
            "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
            "max_tokens_per_step": config.slide.max_tokens_per_step,
            "offline_spare": NO_SPARE_GATE,
        },
        "phases": phases,
    }


def run_priority(measured: dict[str, Any], cal: Calibration, out: Comparison) -> dict[str, Any]:
    workload = measured["workload"]
    settings = priority_engine(cal.cost_model)
    engine = parse_engine_config(settings.engine_config, settings.max_num_batched_tokens)
    requests = priority_scheduling.workload(
        load_trace(trace_path(workload["trace"])), workload["rate_per_s"], workload["duration_s"], workload["seed"]
    )
    conversations = one_turn(requests, "req")
    class_of = {c.conversation_id: engine.classes.get(r.cls) for c, r in zip(conversations, requests, strict=True)}
    config = sim_config(engine, cal, placement="per-request", prefillers=0, decoders=1)
    started = time.monotonic()
    result = PoolSim(config, conversations, class_of).run()
    say(f"[priority_scheduling] simulated in {time.monotonic() - started:.1f} s")
    classes: dict[str, Any] = {}
    gain = 0.0
    for name in engine.classes.names:
        cls = engine.classes.get(name)
        simulated = class_figures([r.request for r in result.records if r.request.cls.name == name], cls)
        mine = measured["coserve"]["classes"][name]
        out.judge("priority_scheduling", f"coserve, {name}", CLASS_FIGURES, mine, simulated)
        for figure in TPOT_FIGURES:
            out.note("priority_scheduling", f"coserve, {name}", figure, mine[figure], simulated[figure])
        classes[name] = simulated
        gain += simulated["gain"]
    out.note("priority_scheduling", "coserve", "total_gain", measured["coserve"]["total_gain"], gain)
    drain_s = measured["coserve"]["drain_s"]
    out.note("priority_scheduling", "coserve", "drain_s", drain_s, result.duration_s)
    # every prompt and output token of the workload, over the time the engine took to serve them
    tokens = sum(len(r.prompt) + r.max_tokens for r in requests)
    out.note(
        "priority_scheduling",
        "coserve",
        "engine_tokens_per_s",
        tokens / drain_s,
        sum(result.tokens_computed.values()) / result.duration_s,
    )
    return {
        "measured": "benchmarks/results/priority_scheduling.json",
        "measured_commit": measured["commit"]["sha"],
        "workload": {
            **{k: workload[k] for k in ("trace", "rate_per_s", "duration_s", "seed")},
            "requests": len(requests),
            "mean_prompt_tokens": statistics.fmean(len(r.prompt) for r in requests),
            "mean_output_tokens": statistics.fmean(r.max_tokens for r in requests),
        },
        "sim": {
            "placement": "per-request",
            "prefillers": 0,
            "decoders": 1,
            "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
            "max_tokens_per_step": config.slide.max_tokens_per_step,
        },
        "classes": classes,
        "duration_s": result.duration_s,
    }


# --- why it departs -------------------------------------------------------------------------------


def findings(
    cal: Calibration, measured: dict[str, dict[str, Any]], runs: dict[str, Any], diagnostics: list[dict[str, Any]]
) -> list[str]:
    """Where the simulation departs from the runs, with the arithmetic that shows it."""
    model = StepCostModel.from_dict(cal.cost_model)
    notes = []
    quick = ProfileGrid.quick()
    fitted = cal.profile.get("costModel", {})
    if (fitted.get("numTrain"), fitted.get("numHoldout")) == (len(quick.train), len(quick.holdout)):
        points = [*quick.train, *quick.holdout]
        notes.append(
            f"The cost model was fitted on the quick profile grid: {len(quick.train)} steps (and {len(quick.holdout)} "
            f"held out) of one request each, P <= {max(p for p, _ in points)} new tokens over C <= "
            f"{max(c for _, c in points)} cached ones, no batched decode step. The simulator (like SlideBatching) "
            "evaluates latency(P, C) at a step's totals: P all its new tokens, C every scheduled request's context."
        )
    priority = runs["priority_scheduling"]
    workload = priority["workload"]
    drain_s = measured["priority_scheduling"]["coserve"]["drain_s"]
    notes.append(
        f"priority_scheduling: the measured engine served all {workload['requests']} requests in {drain_s:.0f} s, "
        f"{workload['duration_s']:.0f} s of them arrivals; the simulated engine needed {priority['duration_s']:.0f} s "
        "(engine_tokens_per_s: the same tokens at a fraction of the measured rate)."
    )
    # a prefill chunk beside 100 decodes (of the 128 slots), each over the workload's mean prompt and half its answer
    chunk, decodes = 128, 100
    measured_rate = sum(r["measured"] for r in diagnostics if r["figure"] == "engine_tokens_per_s")
    context = round(workload["mean_prompt_tokens"] + workload["mean_output_tokens"] / 2)
    total_p, total_c = chunk + decodes, decodes * context
    cross_totals = model.k2 * total_p * (total_p + total_c)
    cross_each = model.k2 * (chunk * chunk + decodes * (1 + context))
    notes.append(
        f"Batch totals: a step with one {chunk}-token prefill chunk and {decodes} decodes over {context} tokens of "
        f"context each (that run's mean prompt plus half its mean answer) is predicted at "
        f"{model.latency_s(total_p, total_c):.2f} s, of which k2*P*(P+C) at the totals is {cross_totals:.2f} s and "
        f"k4*(P+C) {model.k4 * (total_p + total_c):.2f} s; the attention that cross term stands for, summed per "
        f"request (chunk x chunk + each decode x its context), would be {cross_each:.3f} s. A full 256-token "
        f"prefill step alone is predicted at {model.latency_s(256, 0):.2f} s; at the measured run's mean "
        f"{measured_rate:.0f} tokens/s, a {total_p}-token step averages {total_p / measured_rate:.2f} s."
    )
    offline = measured["coserving"]["coserve_offline_only"]
    batch = offline["offline_concurrency"]
    per_request = coserving.OFFLINE_PROMPT + coserving.OFFLINE_OUTPUT // 2
    predicted = model.latency_s(batch, batch * per_request)
    tpot = offline["offline"]["tpot_p50_s"]
    if tpot:
        notes.append(
            f"Decode steps: {batch} offline requests decoding at their mean context ({per_request} tokens each) make "
            f"a step predicted at {predicted:.3f} s, {model.k4 * batch * per_request:.3f} s of it from the context "
            f"term k4 ({model.k4:.3g} s per context token). The measured offline-only phase's median TPOT was "
            f"{tpot:.3f} s, an upper bound on the mean step those requests ran in: the model overstates such "
            f"steps at least {predicted / tpot:.1f}x, so simulated TPOT and offline tokens/s are too slow."
        )
    setup = measured["ttfet"]["setup"]
    arms = runs["ttfet"]["arms"]
    prefill = model.latency_s(256, 0) + model.latency_s(256, 256)
    busy = arms["conversation"]["utilisation"]
    notes.append(
        f"ttfet: the profile has one engine prefill a {setup['first']}-token first turn in {prefill:.2f} s "
        f"(two 256-token chunks), {setup['first'] / prefill:.0f} tokens/s, above the "
        f"{setup['rate'] * setup['first']:.0f} tokens/s the conversations bring. The measured run shared "
        f"{measured['ttfet']['cpu_count']} cores among the prefiller, {TTFET_DECODERS} decoders, the router and "
        "the client, and its TTFETs run to minutes; the simulator's engines are independent, each at profile "
        f"speed (with conversation placement its prefiller was busy {busy.get('prefiller_busy', 0):.0%} and its "
        f"decoders {busy.get('decoder_busy', 0):.0%} of the run), so none of that contention is in its TTFETs."
    )
    conversation = measured["ttfet"]["conversation"]["decoder_computed_prompt_tokens"]
    needed = setup["conversations"] * sum(block_miss_tokens(setup, turn) for turn in range(1, setup["turns"]))
    notes.append(
        f"ttfet recomputation: with conversation placement the real decoders computed {conversation:.0f} prompt "
        f"tokens, where a 128-token-block prefix cache that kept every conversation would compute {needed} "
        f"(the stand-in answer tokens break the match); the simulated decoders computed "
        f"{arms['conversation']['decoder_prompt_tokens']} (they hold the answer and evicted nothing). The real "
        f"decoders computed {conversation - needed:.0f} tokens more: prefixes they did not hold when the next turn "
        "came, which the simulator does not reproduce."
    )
    return notes


def block_miss_tokens(setup: dict[str, Any], turn: int, block: int = 128) -> int:
    """Prompt tokens a real decoder computes for a later turn: its prompt beyond the previous prompt's whole blocks."""
    grown = TTFET_ANSWER_TOKENS + int(setup["appended"])
    previous = int(setup["first"]) + (turn - 1) * grown
    return previous + grown - (previous // block) * block


# --- output ---------------------------------------------------------------------------------------


def show(value: float | None, figure: str) -> str:
    if value is None:
        return "-"
    if "attainment" in figure:
        return f"{100 * value:.1f}%"
    if figure.endswith("_s"):
        return f"{value:.3f}"
    return f"{value:.0f}"


def table(rows: Sequence[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(f"{'run':20}{'arm':36}{'figure':32}{'measured':>11}{'simulated':>11}{'rel. error':>11}")
    for row in rows:
        error = "-" if row["relative_error"] is None else f"{100 * row['relative_error']:.0f}%"
        mark = " ok" if row["within"] else ""
        print(
            f"{row['run']:20}{row['arm']:36}{row['figure']:32}{show(row['measured'], row['figure']):>11}"
            f"{show(row['simulated'], row['figure']):>11}{error:>11}{mark}"
        )


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    started = time.monotonic()
    measured = {name: _read(RESULTS / f"{name}.json") for name in ("ttfet", "coserving", "priority_scheduling")}
    model = measured["ttfet"]["setup"]
    for name in ("coserving", "priority_scheduling"):
        shape = measured[name]["setup"]["model"]
        if (shape["layers"], shape["hidden_size"]) != (model["layers"], model["hidden_size"]):
            raise SystemExit(f"{name}.json measured another model ({shape}); one profile cannot calibrate both")
    cal = calibration(model["layers"], model["hidden_size"])
    for name in ("coserving", "priority_scheduling"):
        if measured[name]["setup"]["cost_model"] != cal.cost_model:
            raise SystemExit(f"{name}.json ran with another cost model than the cached profile's")
    out = Comparison([], [], [])
    runs = {
        "ttfet": run_ttfet(measured["ttfet"], cal, out),
        "coserving": run_coserving(measured["coserving"], cal, out),
        "priority_scheduling": run_priority(measured["priority_scheduling"], cal, out),
    }
    table(out.pairs, f"judged pairs (target: each within {TOLERANCE:.0%})")
    table(out.diagnostics, "diagnostics (not judged)")
    print("\nskipped (measured null):")
    for row in out.skipped:
        print(f"  {row['run']}, {row['arm']}, {row['figure']}: {row['why']}")
    within = sum(p["within"] for p in out.pairs)
    errors = [p["relative_error"] for p in out.pairs if p["relative_error"] is not None]
    achieved = met(out.pairs)
    print(
        f"\n{within} of {len(out.pairs)} pairs within {TOLERANCE:.0%}; median relative error "
        f"{statistics.median(errors):.0%}, worst {max(errors):.0%}; target {'met' if achieved else 'NOT met'}"
    )
    notes = findings(cal, measured, runs, out.diagnostics)
    for note in notes:
        print(f"- {note}")
    path = write_result(
        "simulator_fidelity",
        {
            "benchmark": "simulator_fidelity",
            "target": (
                "p50 and p95 TTFT/TTFET and SLO attainment within 10% of the measured runs (Vidur's bar: 9% at p95), "
                "for every figure the measured results report with enough samples"
            ),
            "met": achieved,
            "tolerance": TOLERANCE,
            "pairs_within": within,
            "pairs_judged": len(out.pairs),
            "median_relative_error": statistics.median(errors) if errors else None,
            "worst_relative_error": max(errors) if errors else None,
            "pairs": out.pairs,
            "skipped": out.skipped,
            "diagnostics": out.diagnostics,
            "calibration": {
                "profile": str(bench_model(model["layers"], model["hidden_size"]) / PROFILE_FILE),
                "profile_measured_at": cal.profile.get("measuredAt"),
                "cost_model": cal.cost_model,
                "kv_capacity_tokens": cal.kv_capacity_tokens,
                "kv_capacity_source": (
                    f"1 GiB (VLLM_CPU_KVCACHE_SPACE=1) / {cal.kv_bytes_per_token} bytes per token (layers x 2 x KV "
                    "heads x head_dim x 4 bytes, float32)"
                ),
                "profile_kv_capacity_tokens": cal.profile.get("kvCapacityTokens"),
                "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
            },
            "runs": runs,
            "notes": notes,
            "elapsed_s": time.monotonic() - started,
        },
    )
    say(f"wrote {path}")
    return 0


def _read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


if __name__ == "__main__":
    sys.exit(main())
