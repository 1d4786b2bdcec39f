"""Where turn 1 prefills (coserve.router.policy.choose_prefill_site): a prefiller or the decoder, the sooner."""

from __future__ import annotations

import pytest

from coserve.router.policy import PREFILL_REASONS, EngineLoad, choose_prefill_site, local_prefill_step_s

CURVE = (0.01, 1e-4, 0.0)  # s per step, s per token, s per token squared


def load(url: str, queued: int = 0, decoding: int = 0, healthy: bool = True) -> EngineLoad:
    """An engine with ``queued`` prompt tokens not yet prefilled and ``decoding`` streams, 100 tokens left each."""
    engine = EngineLoad(url, kv_capacity_tokens=100_000, healthy=healthy)
    if queued:
        engine.sent("queued", queued, 1)
    for i in range(decoding):
        engine.sent(f"s{i}", 0, 101)
        engine.progressed(f"s{i}", 1)
    return engine


@pytest.mark.parametrize(
    ("prefiller_queue", "decoder_queue", "decoding", "tpot_s", "site", "reason"),
    [
        # both idle: the decoder, by the KV's move and the decoder's first step (0.42 s against 0.43 s)
        (0, 0, 0, 0.1, "decoder", "sooner_on_decoder"),
        (0, 8000, 0, 0.1, "p", "sooner_on_prefiller"),  # the decoder has 0.8 s of prefill queued
        (20_000, 0, 0, 0.1, "decoder", "sooner_on_decoder"),  # the prefiller has 2 s queued
        # 4 streams: each step with a 2,048-token chunk lasts 0.01 + 1e-4 x 2,052 = 0.215 s per token
        (20_000, 0, 4, 0.3, "decoder", "sooner_on_decoder"),
        (20_000, 0, 4, 0.2, "p", "decoder_stall_over_tpot"),
        # 4 streams lose 0.4 s each (1.6 s) against 2.1 s gained; 8 lose 3.2 s together: the prefiller
        (20_000, 0, 8, 0.3, "p", "streams_lose_more"),
    ],
)
def test_turn_one_prefills_where_its_first_token_comes_soonest(
    prefiller_queue: int, decoder_queue: int, decoding: int, tpot_s: float, site: str, reason: str
) -> None:
    prefiller, decoder = load("p", queued=prefiller_queue), load("d", queued=decoder_queue, decoding=decoding)

    chosen = choose_prefill_site([prefiller], decoder, 4000, 10.0, CURVE, tpot_slo_s=tpot_s)

    assert (chosen.prefiller.url if chosen.prefiller else "decoder", chosen.reason) == (site, reason)
    assert chosen.reason in PREFILL_REASONS
    assert chosen.remote_s is not None and chosen.local_s is not None


def test_the_prediction_counts_the_kv_move_and_the_decoders_first_step() -> None:
    prefiller, decoder = load("p"), load("d")
    # 4,000 tokens: two steps. On the prefiller 0.02 + 0.4, the move 4,000 x 1e-5, the decoder's first step 0.01.
    chosen = choose_prefill_site([prefiller], decoder, 4000, 10.0, CURVE, transfer_s_per_token=1e-5)
    assert chosen.remote_s == pytest.approx(0.02 + 0.4 + 0.04 + 0.01)
    assert chosen.local_s == pytest.approx(0.02 + 0.4)
    assert chosen.prefiller is None and chosen.reason == "sooner_on_decoder"


def test_the_soonest_prefiller_is_the_one_weighed_against_the_decoder() -> None:
    busy, idle, decoder = load("busy", queued=50_000), load("idle"), load("d", queued=8000)
    chosen = choose_prefill_site([busy, idle], decoder, 4000, 10.0, CURVE)
    assert chosen.prefiller is idle and chosen.reason == "sooner_on_prefiller"


def test_without_a_prefiller_up_the_decoder_prefills_whatever_its_streams() -> None:
    down, decoder = load("p", healthy=False), load("d", decoding=500)
    for curve in (CURVE, None):
        chosen = choose_prefill_site([down], decoder, 4000, 10.0, curve, tpot_slo_s=0.01)
        assert chosen.prefiller is None and chosen.reason == "no_prefiller"


def test_without_a_curve_or_when_asked_the_prefiller_is_taken() -> None:
    prefiller, decoder = load("p", queued=1_000_000), load("d")
    assert choose_prefill_site([prefiller], decoder, 4000, 1.0, None).reason == "no_curve"
    only = choose_prefill_site([prefiller], decoder, 4000, 1.0, CURVE, local=False)
    assert only.prefiller is prefiller and only.reason == "prefiller_only"


def test_a_local_prefill_step_carries_one_chunk_and_every_stream() -> None:
    decoder = load("d", decoding=30)
    assert local_prefill_step_s(decoder, 100, CURVE) == pytest.approx(0.01 + 1e-4 * 130)
    assert local_prefill_step_s(decoder, 10_000, CURVE, step_tokens=512) == pytest.approx(0.01 + 1e-4 * 542)
