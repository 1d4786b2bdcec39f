"""A pool on a simulated clock: router placement, prefillers, KV moves and decoders, running the real policies.

Who calls it: ``coserve simulate`` (``coserve.cli.simulate``) and the benchmarks
build a ``PoolSim`` from a pool spec's sizes, a step cost model and a workload
(``coserve.bench.workload`` conversations), call ``run()`` and read the
``SimResult``. Events come from simpy; the decisions come from coserve's own
policies, called as the live components call them:

- engines: ``SlideBatching`` decides every step, ``StepCostModel`` gives its
  duration (``coserve.sim.engine``);
- the router: ``choose_gain_oriented`` with ``prefill_deadlines`` picks a
  prefiller (GoRouting), ``choose_decoder`` picks turn 1's decoder (lowest KV
  occupancy), ``PinTable`` keeps conversations on their decoder; the router's
  view of the engines (``EngineLoad``) is refreshed every ``poll_s`` as it
  polls /metrics, plus what it admitted since.

Placements (``placement``):

- ``conversation`` (coserve): turn 1 prefills on a prefiller, its KV moves once
  to the chosen decoder, later turns go to that decoder, which holds the history;
- ``per-turn``: every turn prefills on a prefiller (which may hold the prefix)
  and its whole KV moves to the emptiest decoder (per-turn P/D disaggregation);
- ``per-request``: every turn goes to the emptiest decoder, which computes what
  it does not hold (a least-loaded balancer, no P/D).

A KV move takes ``prompt tokens x kv_bytes_per_token / kv_bandwidth_bytes_per_s``.
A later turn is sent when its trace time comes or ``gap_s`` after the previous
answer ended, whichever is later (the closed loop an agent runs).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from coserve.bench.workload import Conversation
from coserve.router.policy import EngineLoad, PinTable, choose_decoder, choose_gain_oriented, prefill_deadlines
from coserve.scheduling import SlideBatching, SlideConfig, StepCostModel
from coserve.scheduling.gain import request_gain, slo_attained
from coserve.scheduling.requests import RequestClass
from coserve.sim.engine import SimEngine, SimRequest

# a simpy process body: yields events, is resumed with their values
Process = Generator[Any, Any, None]

__all__ = ["PLACEMENTS", "PoolSim", "SimConfig", "SimResult"]

PLACEMENTS = ("conversation", "per-turn", "per-request")


@dataclass(frozen=True)
class SimConfig:
    """The simulated pool: sizes, engine limits, the router's settings and the KV link."""

    prefillers: int
    decoders: int
    cost_model: StepCostModel
    kv_capacity_tokens: int
    placement: str = "conversation"
    max_num_seqs: int = 256
    slide: SlideConfig = field(default_factory=SlideConfig)
    kv_bytes_per_token: float = 131072.0  # an 8B Llama in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes
    kv_bandwidth_bytes_per_s: float = 25e9  # one 200 Gb/s RDMA link
    pin_ttl_s: float = 1800.0
    poll_s: float = 0.5
    full: float = 0.9
    prefill_latency: tuple[float, float, float] | None = None  # (s, s/token, s/token^2) for GoRouting's deadlines

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.decoders < 1 or (self.placement != "per-request" and self.prefillers < 1):
            raise ValueError("a pool needs at least one decoder, and one prefiller unless placement is per-request")


@dataclass
class TurnRecord:
    conversation_id: str
    turn: int
    last_turn: bool
    request: SimRequest
    decoder: str = ""


@dataclass
class SimResult:
    """What a run measured: every turn's record, and the engines' utilisation and KV over time."""

    records: list[TurnRecord]
    conversations: dict[str, float]  # conversation -> first arrival
    duration_s: float
    busy_s: dict[str, float]
    kv_occupancy: dict[str, list[tuple[float, float]]]  # decoder -> (time, KV usage)

    def ttfet_s(self) -> list[float]:
        """Per conversation: first arrival to the final turn's first token (finished conversations only)."""
        return [
            r.request.token_times[0] - self.conversations[r.conversation_id]
            for r in self.records
            if r.last_turn and r.request.token_times
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


class PoolSim:
    """One run: ``PoolSim(config, conversations, class_of).run(until_s)``."""

    def __init__(
        self, config: SimConfig, conversations: Sequence[Conversation], class_of: dict[str, RequestClass]
    ) -> None:
        self.config = config
        self.env = simpy.Environment()
        self.conversations = list(conversations)
        self.class_of = class_of
        policy = SlideBatching(config.cost_model, config.slide)

        def engine(name: str, prefiller: bool) -> SimEngine:
            built = SimEngine(self.env, name, config.cost_model, policy, config.kv_capacity_tokens,
                              config.max_num_seqs, stop_after_first=prefiller)  # fmt: skip
            built.on_finish = self._finished
            return built

        uses_prefillers = config.placement != "per-request"
        self.prefillers = [engine(f"prefiller-{i}", True) for i in range(config.prefillers if uses_prefillers else 0)]
        self.decoders = [engine(f"decoder-{i}", False) for i in range(config.decoders)]
        self.by_name = {e.name: e for e in [*self.prefillers, *self.decoders]}
        self.loads = {
            e.name: EngineLoad(e.name, kv_capacity_tokens=config.kv_capacity_tokens) for e in self.by_name.values()
        }
        self.pins = PinTable(ttl_s=config.pin_ttl_s)
        self.records: list[TurnRecord] = []
        self.first_arrival: dict[str, float] = {}
        self.kv_occupancy: dict[str, list[tuple[float, float]]] = {d.name: [] for d in self.decoders}
        self._answered: dict[tuple[str, int], simpy.Event] = {}
        self._record_of: dict[str, TurnRecord] = {}  # request id -> its turn (engines report requests)
        self._ids = itertools.count()

    def run(self, until_s: float | None = None) -> SimResult:
        """Simulate until every conversation's last answer (or ``until_s``)."""
        processes = [self.env.process(self._conversation(c)) for c in self.conversations]
        self.env.process(self._poll())
        self.env.run(until=until_s if until_s is not None else self.env.all_of(processes))
        return SimResult(
            self.records,
            dict(self.first_arrival),
            float(self.env.now),
            {e.name: e.busy_s for e in self.by_name.values()},
            self.kv_occupancy,
        )

    # --- processes -------------------------------------------------------------------------------

    def _poll(self) -> Process:
        """The router's view of each engine, refreshed as it polls /metrics."""
        while True:
            for name, engine in self.by_name.items():
                self.loads[name].polled(engine.kv_usage(), len(engine.waiting))
            for decoder in self.decoders:
                self.kv_occupancy[decoder.name].append((self.env.now, decoder.kv_usage()))
            yield self.env.timeout(self.config.poll_s)

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
                arrival_s=env.now, prompt_tokens=len(turn.prompt), max_output_tokens=max(1, turn.max_tokens),
            )  # fmt: skip
            record = TurnRecord(conversation.conversation_id, index, index == len(conversation.turns) - 1, request)
            answered = env.event()
            self._answered[(conversation.conversation_id, index)] = answered
            self.records.append(record)
            self._record_of[request.request_id] = record
            self._place(record, first=index == 0)
            yield answered

    # --- the router ------------------------------------------------------------------------------

    def _place(self, record: TurnRecord, first: bool) -> None:
        request, now = record.request, self.env.now
        placement = self.config.placement
        if placement == "per-request":
            self._to_decoder(record, self._emptiest_decoder())
            return
        if placement == "conversation" and not first:
            pin = self.pins.get(record.conversation_id, now)
            if pin is not None:
                self.pins.pin(record.conversation_id, pin.decoder, now)
                self._to_decoder(record, self.by_name[pin.decoder])
                return
        loads = [self.loads[p.name] for p in self.prefillers]
        deadlines = prefill_deadlines(loads, request.prompt_tokens, request.cls.ttft_slo_s, self.config.prefill_latency)
        chosen = choose_gain_oriented(loads, deadlines) or loads[0]
        chosen.admitted_tokens += request.prompt_tokens
        self.by_name[chosen.url].submit(request)

    def _emptiest_decoder(self) -> SimEngine:
        loads = [self.loads[d.name] for d in self.decoders]
        chosen = choose_decoder(loads, self.config.full) or min(loads, key=lambda d: (d.occupancy(), d.url))
        return self.by_name[chosen.url]

    def _to_decoder(self, record: TurnRecord, decoder: SimEngine) -> None:
        request = record.request
        record.decoder = decoder.name
        self.loads[decoder.name].admitted_tokens += request.footprint
        decoder.submit(request)

    def _finished(self, engine: SimEngine, request: SimRequest, now: float) -> None:
        record = self._record_of[request.request_id]
        if engine.stop_after_first and request.output < request.max_output_tokens:
            self.env.process(self._move_kv(record))
            return
        self._answered[(record.conversation_id, record.turn)].succeed()  # a one-token answer ends on the prefiller

    def _move_kv(self, record: TurnRecord) -> Process:
        """The prefilled KV moves to a decoder, which continues from the first token."""
        request = record.request
        yield self.env.timeout(
            request.prompt_tokens * self.config.kv_bytes_per_token / self.config.kv_bandwidth_bytes_per_s
        )
        decoder = self._emptiest_decoder()
        if self.config.placement == "conversation":
            self.pins.pin(record.conversation_id, decoder.name, self.env.now)
        request.computed = request.prompt_tokens  # the moved KV; the decoder holds it from here
        request.cached = request.prompt_tokens
        self._to_decoder(record, decoder)
