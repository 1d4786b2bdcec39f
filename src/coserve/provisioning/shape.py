"""The pool's shape: conversation-level P/D (prefillers and decoders) or aggregated engines, whichever sustains
the higher rate on the same engines within the objectives.

Aggregated engines are what a vLLM user runs with a router's session affinity: every engine prefills its own
conversations' first turns, then decodes them, and later turns stay on it. At ``E = M + N`` engines (the P/D
plan's count) each shape sustains the lowest of its limits:

- P/D: the prefillers' saturation ``M·R*``; the decoders' throughput ``N / ((L_d + w·A) / T_d)`` and KV memory
  ``N·B / W_kv`` (``coserve.provisioning.model``); their time-per-output-token objective with later turns'
  chunks in their steps (below).
- Aggregated: throughput ``E / (p_1 + (L_d + w·A) / T_d)``, where ``p_1`` is turn 1's prefill computed inside
  the engine's own steps (``ResolvedProfile.prefill_s``); KV memory ``E·B / W_kv``; and the objective with
  turn 1's chunks in the steps.

The objective: a step that carries a prefill chunk lasts ``chunked_step_s`` (the rule the router applies before
it lets a decoder prefill turn 1: ``coserve.scheduling.steps``), and every stream the engine decodes waits it
out. At the tightest ``tpotSloMs`` an engine decodes ``r·L_d·TPOT`` streams at once (Little's law at ``r``
conversations/s per engine), so the step stays within the objective while
``r <= (TPOT - step(chunk, 0)) / (b·L_d·TPOT)``, ``b`` the curve's per-token seconds; none at all when one
chunk alone exceeds it. TTFT is not a separate limit here: both shapes queue turn 1 without bound only at
their saturation rate, which is what is compared.

``spec.shape`` Auto takes the higher rate (P/D on a tie: its prefillers' load is observable); Disaggregated or
Aggregated keeps that shape and the comparison is still reported. Who calls it: ``make_plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coserve.api.spec import PoolShape, SpecModel
from coserve.api.status import ShapeComparison
from coserve.provisioning.decoders import DecoderLoad
from coserve.provisioning.profile import ResolvedProfile
from coserve.scheduling.steps import chunked_step_s

__all__ = ["ShapeRates", "compare_shapes", "tpot_rate"]


@dataclass(frozen=True)
class ShapeRates:
    """One shape's sustainable rate on a number of engines, and the limit that sets it."""

    rate_per_s: float
    limit: str  # Prefiller, DecoderThroughput, DecoderMemory or TPOT

    @staticmethod
    def lowest(limits: dict[str, float]) -> ShapeRates:
        name, rate = min(limits.items(), key=lambda item: item[1])  # ties: the first listed
        return ShapeRates(rate, name)


def tpot_rate(
    engines: int, curve: tuple[float, float, float], chunk_tokens: float, output_tokens: float, tpot_s: float
) -> float:
    """Conversations/s ``engines`` sustain while each step with a ``chunk_tokens`` prefill chunk in it stays within
    ``tpot_s`` (module docstring); 0 when the chunk alone exceeds it, infinite when streams cost nothing."""
    if chunk_tokens <= 0:
        return math.inf
    spare = tpot_s - chunked_step_s(curve, chunk_tokens, 0.0)
    if spare <= 0:
        return 0.0
    per_rate = curve[1] * output_tokens * tpot_s  # seconds the decoding streams add to a step, per conversation/s
    return math.inf if per_rate <= 0 else engines * spare / per_rate


def compare_shapes(
    spec: SpecModel, profile: ResolvedProfile, load: DecoderLoad, prefillers: int, decoders: int,
    pool_saturation: float, turn1_prefill_s: float, kept: PoolShape | None = None,
) -> ShapeComparison:  # fmt: skip
    """Both shapes' rates on the P/D plan's ``prefillers + decoders`` engines, and the shape the pool takes.

    ``kept``: the shape a running pool has, which ``Auto`` keeps (a pool changes shape when its spec changes,
    not when the operator is upgraded: ``coserve.operator.reconcile``)."""
    workload = spec.workload
    engines = prefillers + decoders
    curve = profile.prefill_latency
    points = (curve.constant_s, curve.per_token_s, curve.per_token_squared_s)
    tpot_s = min(cls.tpot_slo_ms for cls in spec.priority_classes) / 1000.0
    memory = (lambda n: n / load.slot_s) if load.slot_s > 0 else (lambda n: math.inf)
    split = ShapeRates.lowest({
        "Prefiller": pool_saturation,
        "DecoderThroughput": decoders / load.work_s,
        "DecoderMemory": memory(decoders),
        "TPOT": tpot_rate(decoders, points, workload.appended_tokens if workload.turns > 1 else 0.0,
                          workload.output_tokens, tpot_s),
    })  # fmt: skip
    aggregated = ShapeRates.lowest({
        "DecoderThroughput": engines / (turn1_prefill_s + load.work_s),
        "DecoderMemory": memory(engines),
        "TPOT": tpot_rate(engines, points, workload.input_tokens, workload.output_tokens, tpot_s),
    })  # fmt: skip
    better = aggregated.rate_per_s > split.rate_per_s
    if spec.shape is PoolShape.AUTO and kept is not None:
        chosen = kept
        reason = (f"kept {kept.value}: the spec has not changed since the pool took that shape (edit it, or set "
                  f"spec.shape, to change; {'aggregated' if better else 'P/D'} sustains the higher rate)")  # fmt: skip
    elif spec.shape is PoolShape.AUTO:
        chosen = PoolShape.AGGREGATED if better else PoolShape.DISAGGREGATED
        why = "sustains the higher rate" if better or aggregated.rate_per_s < split.rate_per_s else "ties (P/D kept)"
        reason = f"{'aggregated' if better else 'P/D'} {why}"
    else:
        chosen = spec.shape
        reason = f"spec.shape asks for {chosen.value}"
    return ShapeComparison(
        shape=chosen,
        engines=engines,
        disaggregated_rate_per_s=_finite(split.rate_per_s),
        disaggregated_limit=split.limit,
        aggregated_rate_per_s=_finite(aggregated.rate_per_s),
        aggregated_limit=aggregated.limit,
        reason=(
            f"{reason}: on {engines} engines, P/D ({prefillers} prefillers, {decoders} decoders) sustains "
            f"{_rate(split.rate_per_s)} conversations/s ({split.limit} limits) and aggregated engines "
            f"{_rate(aggregated.rate_per_s)} ({aggregated.limit} limits)"
        ),
    )


_LARGE = 1e12  # a rate no limit bounds, as a number status can hold (JSON has no infinity)


def _finite(rate: float) -> float:
    return min(rate, _LARGE)


def _rate(value: float) -> str:
    return "unbounded" if value >= _LARGE else f"{value:.4g}"
