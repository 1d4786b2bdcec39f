"""How long an engine's step lasts while a prompt's prefill rides in it beside the streams it decodes.

One rule, read by two callers that must agree: the router, when it decides whether turn 1 may prefill on the
decoder that will hold the conversation (``coserve.router.policy.choose_prefill_site``), and the plan, when it
decides whether aggregated engines, which prefill every turn 1 beside their decoding streams, keep the pool's
time-per-output-token objective (``coserve.provisioning.shape``).

The curve is the prefill latency curve ``(constant, linear, quadratic)`` in seconds: a step computes at most
``step_tokens`` prompt tokens (a longer prompt takes several steps) and one token for each decoding stream.
"""

from __future__ import annotations

from coserve.scheduling.slide_batching import SlideConfig

__all__ = ["STEP_TOKENS", "chunked_step_s"]

# the most tokens an engine computes in one step: SlideConfig.max_tokens_per_step's default (a prefill of more
# takes several steps, each paying the step's constant cost)
STEP_TOKENS = SlideConfig.max_tokens_per_step


def chunked_step_s(
    curve: tuple[float, float, float], prompt_tokens: float, decoding: float, step_tokens: int = STEP_TOKENS
) -> float:
    """One step's seconds while ``prompt_tokens`` are prefilled: a chunk of at most ``step_tokens`` beside one
    token for each of ``decoding`` streams. Each stream's time between tokens, meanwhile."""
    constant, linear, quadratic = curve
    chunk = min(prompt_tokens, step_tokens)
    return constant + linear * (chunk + decoding) + quadratic * chunk * chunk
