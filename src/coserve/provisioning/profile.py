"""Merge ``spec.profile`` with a referenced measured profile into the numbers the model needs."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.spec import PrefillLatencyCurve, SpecModel

__all__ = ["ResolvedProfile", "resolve_profile"]


@dataclass(frozen=True)
class ResolvedProfile:
    """One engine replica's speed, every field known. ``source`` says where each came from."""

    prefill_latency: PrefillLatencyCurve
    decode_throughput_tokens_per_s: float
    kv_capacity_tokens: int
    live_context_tokens: int
    source: str


def resolve_profile(spec: SpecModel, measured: EngineProfile | None = None) -> ResolvedProfile:
    """Inline ``spec.profile`` fields win; missing ones come from ``measured``.

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
    decode = pick("decode_throughput_tokens_per_s")
    kv = pick("kv_capacity_tokens")
    live = inline.live_context_tokens
    if live is None and measured is not None:
        live = measured.live_context_tokens
    if live is None:
        live = spec.workload.input_tokens + spec.workload.output_tokens
    if problems:
        raise InvalidInput(problems)
    if not (isinstance(curve, PrefillLatencyCurve) and isinstance(decode, float) and isinstance(kv, int)):
        raise TypeError("spec.profile fields have unexpected types")  # unreachable after validation
    origin = f"ConfigMap {ref.name}" if ref is not None else "the --profile file"
    source = f"{', '.join(taken)} from {origin}, the rest from spec.profile" if taken else "spec.profile"
    return ResolvedProfile(curve, decode, kv, live, source)
