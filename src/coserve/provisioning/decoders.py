"""What one conversation asks of the decoders: decoder seconds and KV seconds, as vLLM spends them.

Symbols (beyond ``coserve.provisioning.model``'s) and their names here:

    n     requests (turns) per conversation        -> workload.turns
    a     tokens each later turn appends           -> workload.appended_tokens
    g     idle time between turns (tool, user)     -> workload.idle_s
    A     prompt tokens a decoder prefills per conversation
    w     decoder time of one such token, in decode tokens (T_d x its seconds)
    W_kv  seconds a conversation's KV is held on its decoder

A decoder does more than decode. Every later turn runs on the conversation's
decoder, which prefills what the turn appends (the previous answer's KV it
already holds), so the decoders' throughput must cover ``N·T_d >= R·(L_d + w·A)``.

vLLM keeps KV for running requests only. Between turns a conversation's KV is
prefix cache: kept while nothing newer needs the room, evicted least recently
used when something does, and then recomputed when the next turn comes. So
there are two ways to size decoders, and the plan takes the one that needs
fewer (``DecoderLoad`` each):

- ``Kept``: enough KV to keep every idle conversation cached, ``N·B >= R·W``,
  and the decoders prefill only what later turns append, ``A = (n - 1)·a``;
- ``Evicted``: KV for the running conversations only, ``N·B >= R·W_run`` with
  ``W_run = W - (n - 1)·g``, and every later turn recomputes its whole prompt,
  ``A = (n - 1)·(c + a)``, c its context before the appended tokens.

With one turn, or no idle time, both are the old ``N·T_d >= R·L_d`` and
``N·B >= R·W``. Who calls it: ``make_plan``, once per plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.api.spec import WorkloadSpec
from coserve.api.status import IdleKV
from coserve.provisioning.profile import ResolvedProfile

__all__ = ["DecoderLoad", "decoder_loads", "later_turn_context_tokens"]


@dataclass(frozen=True)
class DecoderLoad:
    """One conversation's demand on the decoders under one assumption about its idle KV."""

    idle_kv: IdleKV
    prefill_tokens: float  # A: prompt tokens a decoder prefills per conversation
    prefill_s: float  # the decoder seconds those cost
    decode_s: float  # L_d / T_d
    kv_held_s: float  # W_kv
    kv_slots: int  # B

    @property
    def work_s(self) -> float:
        """Decoder seconds per conversation: its decode tokens and its prefill, ``(L_d + w·A) / T_d``."""
        return self.decode_s + self.prefill_s

    @property
    def slot_s(self) -> float:
        """KV-slot seconds per conversation, in decoders: ``W_kv / B``."""
        return self.kv_held_s / self.kv_slots

    @property
    def per_rate(self) -> float:
        """Decoders needed per conversation/s, the larger of throughput and memory."""
        return max(self.work_s, self.slot_s)

    def weight(self, decode_tokens_per_s: float) -> float:
        """w: one prefilled token's decoder time in decode tokens (0 when the decoders prefill nothing)."""
        return decode_tokens_per_s * self.prefill_s / self.prefill_tokens if self.prefill_tokens > 0 else 0.0


def later_turn_context_tokens(workload: WorkloadSpec) -> float:
    """c: the mean context a later turn's appended tokens attend to.

    Turn k (k >= 2) holds turn 1's prompt, k - 1 answers of L_d / n tokens and k - 2 earlier appends, so over
    k = 2..n the mean is ``L_in + (n/2)·(L_d/n) + ((n - 2)/2)·a`` (n may be a mean, so not an integer).
    """
    turns = workload.turns
    answer = workload.output_tokens / turns
    return workload.input_tokens + turns / 2 * answer + max(turns - 2, 0.0) / 2 * workload.appended_tokens


def decoder_loads(workload: WorkloadSpec, profile: ResolvedProfile) -> tuple[DecoderLoad, DecoderLoad]:
    """The (Kept, Evicted) demands of one conversation (module docstring)."""
    later = workload.turns - 1
    appended = workload.appended_tokens
    context = later_turn_context_tokens(workload)
    slots = profile.kv_capacity_tokens // profile.live_context_tokens
    decode_s = workload.output_tokens / profile.decode_throughput_tokens_per_s
    kept = DecoderLoad(
        IdleKV.KEPT,
        prefill_tokens=later * appended,
        prefill_s=later * profile.prefill_s(appended, context),
        decode_s=decode_s,
        kv_held_s=workload.lifetime_s,
        kv_slots=slots,
    )
    evicted = DecoderLoad(
        IdleKV.EVICTED,
        prefill_tokens=later * (context + appended),
        # the context a later turn recomputes varies as turn 1's prompt does (Jensen: E[x²] = mean² + σ²)
        prefill_s=later
        * (profile.prefill_s(context + appended, 0) + profile.spread_s(workload.input_tokens_std_dev**2)),
        decode_s=decode_s,
        kv_held_s=max(workload.lifetime_s - later * workload.idle_s, 0.0),
        kv_slots=slots,
    )
    return kept, evicted
