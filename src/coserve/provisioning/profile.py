"""Merge ``spec.profile`` with a referenced measured profile into the numbers the model needs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.spec import PrefillLatencyCurve, SpecModel
from coserve.scheduling.cost_model import StepCostModel

__all__ = ["ResolvedProfile", "final_context_tokens", "resolve_profile"]


@dataclass(frozen=True)
class ResolvedProfile:
    """One engine replica's speed, every field known. ``source`` says where each came from."""

    prefill_latency: PrefillLatencyCurve
    decode_throughput_tokens_per_s: float
    kv_capacity_tokens: int
    live_context_tokens: int
    source: str
    decode_basis: str = ""  # how T_d was derived when it came from the cost model; empty when it was given
    cost_model: StepCostModel | None = None  # the measured profile's step cost model, when it has one

    def spread_s(self, variance_tokens2: float) -> float:
        """What a spread of prompt lengths adds to the mean prefill: the quadratic term times the variance
        (E[L²] = mean² + σ²), k2·σ² with a cost model, perTokenSquaredS·σ² without."""
        quadratic = self.cost_model.k2 if self.cost_model is not None else self.prefill_latency.per_token_squared_s
        return max(quadratic, 0.0) * variance_tokens2

    def prefill_s(self, new_tokens: float, context_tokens: float) -> float:
        """Seconds a decoder spends prefilling ``new_tokens`` over ``context_tokens`` it already holds.

        With a cost model: k1·a + k2·a·(a + c) + k4·(a + c), the step's fixed k5 left out because the chunk
        rides in a step the decoder runs anyway for its decode batch. Without one: the prefill latency curve's
        increment latency(c + a) - latency(c), which drops the constant for the same reason (and, as the
        curve is fitted on whole prompts, charges each new token twice the attention to the context that
        the per-request cost model does: an upper bound).
        """
        if new_tokens <= 0:
            return 0.0
        model = self.cost_model
        if model is not None:
            total = new_tokens + context_tokens
            seconds = (model.k1 + model.k3) * new_tokens + model.k2 * new_tokens * total + model.k4 * total
        else:
            curve = self.prefill_latency
            seconds = curve.latency_s(context_tokens + new_tokens) - curve.latency_s(context_tokens)
        return max(seconds, 0.0)


def resolve_profile(spec: SpecModel, measured: EngineProfile | None = None) -> ResolvedProfile:
    """Inline ``spec.profile`` fields win; missing ones come from ``measured``.

    The decoder throughput T_d, unless set inline, comes from the measured profile's step cost model when
    it has one: at the pool's own operating point, every KV slot decoding at the live context (see
    ``_decode_from_cost_model``); otherwise from its ``decodeThroughputTokensPerS``.

    Raises ``InvalidInput`` naming each field that neither provides. ``measured``
    is the profile that ``spec.profile.configMapRef`` points at, loaded by the
    caller (the operator reads the ConfigMap, the CLI a ``--profile`` file).
    """
    inline = spec.profile
    ref = inline.config_map_ref
    problems: list[Problem] = []
    taken: list[str] = []

    def pick(field: str) -> object:
        value = getattr(inline, field)
        if value is None and measured is not None:
            value = getattr(measured, field)
            if value is not None:
                taken.append(type(inline).model_fields[field].alias or field)
        if value is None:
            alias = type(inline).model_fields[field].alias
            if ref is not None and measured is None:
                reason = (
                    f"not set inline, and the profile in ConfigMap {ref.name!r} (key {ref.key!r}) "
                    "was not loaded (pass --profile FILE to the CLI)"
                )
            elif ref is not None:
                reason = f"not set inline, nor in the profile referenced by configMapRef {ref.name!r}"
            else:
                reason = "required: set it inline or point spec.profile.configMapRef at a measured profile"
            problems.append(Problem(f"spec.profile.{alias}", reason))
        return value

    curve = pick("prefill_latency")
    kv = pick("kv_capacity_tokens")
    live = inline.live_context_tokens
    if live is None and measured is not None:
        live = measured.live_context_tokens
    if live is None:
        live = final_context_tokens(spec)
    cost_model = _cost_model(measured)
    priced = cost_model if inline.decode_throughput_tokens_per_s is None else None
    derived = _decode_from_cost_model(priced, kv // live, live) if priced and isinstance(kv, int) else None
    decode_basis = ""
    decode: object
    if derived is not None:
        decode, decode_basis = derived
        taken.append("costModel")
    else:
        decode = pick("decode_throughput_tokens_per_s")
    if problems:
        raise InvalidInput(problems)
    if not (isinstance(curve, PrefillLatencyCurve) and isinstance(decode, float) and isinstance(kv, int)):
        raise TypeError("spec.profile fields have unexpected types")  # unreachable after validation
    origin = f"ConfigMap {ref.name}" if ref is not None else "the --profile file"
    source = f"{', '.join(taken)} from {origin}, the rest from spec.profile" if taken else "spec.profile"
    return ResolvedProfile(curve, decode, kv, live, source, decode_basis, cost_model)


def final_context_tokens(spec: SpecModel) -> int:
    """A conversation's whole context at its last token: L_in + L_d + (n - 1)·a, the most KV a running turn of
    it reserves (``spec.profile.liveContextTokens``' default)."""
    workload = spec.workload
    appended = (workload.turns - 1) * workload.appended_tokens
    return workload.input_tokens + workload.output_tokens + math.ceil(appended)


def _cost_model(measured: EngineProfile | None) -> StepCostModel | None:
    """The measured profile's step cost model, if it has a usable one (else the measured T_d is used)."""
    if measured is None or not measured.cost_model:
        return None
    try:
        return StepCostModel.from_dict(measured.cost_model)
    except ValueError:
        return None  # NOTE: a profile's schema checks the cost model's keys; a malformed one is not T_d's business


def _decode_from_cost_model(model: StepCostModel, slots: int, live: int) -> tuple[float, str] | None:
    """T_d of a decoder whose every KV slot decodes: ``slots`` requests at ``live`` tokens of context each.

    The cost model's attention term is per request, so a batch of B requests at c tokens each costs one
    step of latency(B, B·c, requests=B), and the decoder emits B tokens per step. This is the decoder's
    throughput where the provisioning model needs it (all slots busy), not at whatever batch and context
    the profile's ``decodeThroughputTokensPerS`` happened to be measured.
    """
    if slots < 1:
        return None  # the KV cache holds no conversation: validation says so
    step_s = model.latency_s(slots, slots * live, requests=slots)
    if step_s <= 0:
        return None
    throughput = slots / step_s
    basis = (
        f"T_d = B / step(B requests at {live} tokens each) = {slots} / {step_s:.4g} s = {throughput:,.0f} tokens/s "
        "(profile.costModel)"
    )
    return throughput, basis
