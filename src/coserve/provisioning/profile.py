"""Merge ``spec.profile`` with a referenced measured profile into the numbers the model needs."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.spec import PrefillLatencyCurve, SpecModel
from coserve.scheduling.cost_model import StepCostModel

__all__ = ["ResolvedProfile", "resolve_profile"]


@dataclass(frozen=True)
class ResolvedProfile:
    """One engine replica's speed, every field known. ``source`` says where each came from."""

    prefill_latency: PrefillLatencyCurve
    decode_throughput_tokens_per_s: float
    kv_capacity_tokens: int
    live_context_tokens: int
    source: str
    decode_basis: str = ""  # how T_d was derived when it came from the cost model; empty when it was given


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
        live = spec.workload.input_tokens + spec.workload.output_tokens
    cost_model = _cost_model(measured) if inline.decode_throughput_tokens_per_s is None else None
    derived = _decode_from_cost_model(cost_model, kv // live, live) if cost_model and isinstance(kv, int) else None
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
    return ResolvedProfile(curve, decode, kv, live, source, decode_basis)


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
