"""GoRouting's estimate of the work an engine has left, and where offline batch lines go (coserve.router.policy)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coserve.router.policy import (
    EngineLoad,
    choose_for_request,
    first_token_s,
    place_offline,
    prefill_deadlines,
)

LATENCY = (0.01, 1e-4, 1e-9)  # s per step, s per token, s per token squared


def engine(url: str, usage: float = 0.0, waiting: int = 0, healthy: bool = True) -> EngineLoad:
    load = EngineLoad(url, kv_capacity_tokens=1000, waiting=waiting, healthy=healthy)
    load.kv_usage = usage
    return load


def test_the_ledger_follows_what_the_router_sent_and_saw_come_back() -> None:
    e = engine("e")
    e.sent("a", 1000, 10)
    e.sent("b", 500, 1)
    assert (e.prefill_left_tokens, e.prefill_left_squares, e.decode_left_tokens, e.decoding) == (
        1500, 1000**2 + 500**2, 0, 0,
    )  # fmt: skip
    e.progressed("a", 1)  # its first token: the prefill is done, 9 tokens to come
    assert (e.prefill_left_tokens, e.prefill_left_squares, e.decode_left_tokens, e.decoding) == (500, 500**2, 9, 1)
    e.progressed("a", 4)
    assert e.decode_left_tokens == 6
    e.progressed("a", 10)
    assert (e.decode_left_tokens, e.decoding) == (0, 0)
    e.answered("a")
    e.answered("b")
    e.answered("never sent")
    assert (e.prefill_left_tokens, e.prefill_left_squares, e.decode_left_tokens, e.decoding, e.in_flight) == (
        0, 0, 0, 0, {},
    )  # fmt: skip


OPS = st.lists(
    st.tuples(st.sampled_from(("sent", "progressed", "answered")), st.sampled_from("abcd"), st.integers(0, 40)),
    max_size=60,
)


@given(OPS)
def test_the_ledgers_sums_are_always_its_entries_sums(ops: list[tuple[str, str, int]]) -> None:
    e = engine("e")
    for op, request, n in ops:
        if op == "sent":
            e.sent(request, n, n // 2)
        elif op == "progressed":
            e.progressed(request, n)
        else:
            e.answered(request)
    entries = list(e.in_flight.values())
    assert e.prefill_left_tokens == sum(prompt for prompt, _, _ in entries)
    assert e.prefill_left_squares == sum(prompt * prompt for prompt, _, _ in entries)
    assert e.decode_left_tokens == sum(max(left, 0) for _, _, left in entries)
    assert e.decoding == sum(1 for _, _, left in entries if left > 0)
    assert e.prefill_pending == sum(1 for _, _, left in entries if left < 0)


def test_an_engine_busy_with_running_work_is_not_taken_for_free() -> None:
    """Nothing waits on ``busy`` (its long prompt is running), yet its first token for a new request is far off."""
    busy, free = engine("busy"), engine("free")
    busy.sent("long", 9000, 1)
    assert prefill_deadlines([busy, free], 1000, 1.0, (0.01, 1e-4, 0.0)) == {"busy": False, "free": True}


def test_running_decodes_ride_in_every_step_of_the_prefill() -> None:
    e = engine("e")
    for i in range(100):  # 100 requests decoding, 50 tokens to come each
        e.sent(f"r{i}", 10, 51)
        e.progressed(f"r{i}", 1)
    one_step = 0.01 + 1e-4 * (1000 + 100) + 1e-9 * 1000**2  # 1,000 tokens: one step, 100 decode tokens in it
    assert first_token_s(e, 1000, LATENCY) == pytest.approx(one_step)
    two_steps = 2 * 0.01 + 1e-4 * (3000 + 200) + 1e-9 * 3000**2  # 3,000 tokens: two steps of at most 2,048
    assert first_token_s(e, 3000, LATENCY) == pytest.approx(two_steps)
    e.waiting = 3  # another router replica's requests: the mean prompt sent here (10 tokens) each
    assert first_token_s(e, 1000, LATENCY) == pytest.approx(0.01 + 1e-4 * (1030 + 100) + 1e-9 * (3 * 10**2 + 1000**2))


def test_the_queue_floor_counts_what_waits_at_its_own_length_or_the_mean_never_the_new_prompts() -> None:
    e = engine("e", waiting=2)
    e.sent("a", 3000, 1)
    e.sent("b", 1000, 1)  # the two waiting requests are the ledger's own: counted at their own lengths
    own = first_token_s(e, 100, (0.0, 1.0, 0.0), step_tokens=10**9)
    assert own == pytest.approx(3000 + 1000 + 100)
    e.waiting = 5  # three more than the ledger knows: each at the mean sent here, 2,000
    assert first_token_s(e, 100, (0.0, 1.0, 0.0), step_tokens=10**9) == pytest.approx(4100 + 3 * 2000)
    assert first_token_s(e, 50_000, (0.0, 1.0, 0.0), step_tokens=10**9) == pytest.approx(4000 + 6000 + 50_000)

    fresh = engine("fresh", waiting=4)  # nothing sent here: the pool's mean, else nothing
    assert first_token_s(fresh, 100, (0.0, 1.0, 0.0), step_tokens=10**9, mean_prompt_tokens=500) == 2100
    assert first_token_s(fresh, 100, (0.0, 1.0, 0.0), step_tokens=10**9) == 100


def test_gain_oriented_routing_takes_the_soonest_first_token() -> None:
    emptier, busier, busiest = engine("emptier", 0.1), engine("busier", 0.4), engine("busiest", 0.6)
    emptier.sent("long", 12_000, 1)  # prefilling a long prompt: the lowest KV, the latest first token
    busiest.sent("short", 1_000, 1)
    assert choose_for_request([emptier, busier, busiest], 500, 1.0, LATENCY) is busier
    assert choose_for_request([emptier, busiest], 500, 1.0, LATENCY) is busiest
    assert choose_for_request([emptier, busier], 500, 1.0, None) is emptier  # no curve: the KV threshold alone
    busier.healthy = False
    assert choose_for_request([emptier, busier], 500, 1.0, LATENCY) is emptier


@pytest.mark.parametrize(
    ("decoders", "prefillers", "decoder", "prefiller"),
    [
        ([0.6, 0.3, 0.45], [(1, False)], "d1", None),  # the prefiller has a queue: the emptiest decoder prefills
        ([0.6, 0.3, 0.45], [(0, True)], "d1", None),  # nothing waits, but the router has a prefill in flight there
        ([0.6, 0.3, 0.45], [(1, False), (0, False)], "d1", "p1"),  # an idle prefiller prefills it
        ([0.5, 0.7], [(0, False)], None, None),  # no decoder below spare: the line waits
    ],
)
def test_offline_lines_go_where_the_capacity_is(
    decoders: list[float], prefillers: list[tuple[int, bool]], decoder: str | None, prefiller: str | None
) -> None:
    ds = [engine(f"d{i}", usage) for i, usage in enumerate(decoders)]
    ps = []
    for i, (waiting, in_flight) in enumerate(prefillers):
        p = engine(f"p{i}", waiting=waiting)
        if in_flight:
            p.sent("online", 15_000, 1)
        ps.append(p)
    placed = place_offline(ds, ps, spare=0.5)
    if decoder is None:
        assert placed is None
        return
    assert placed is not None and placed.decoder.url == decoder
    assert (placed.prefiller.url if placed.prefiller else None) == prefiller


def test_offline_lines_skip_a_decoder_that_is_down_or_at_spare() -> None:
    down, at_spare, open_ = engine("down", 0.0, healthy=False), engine("at", 0.5), engine("open", 0.49)
    placed = place_offline([down, at_spare, open_], [])
    assert placed is not None and placed.decoder is open_ and placed.prefiller is None
    open_.admitted_tokens = 20  # the router's own lines since the last poll count
    assert place_offline([down, at_spare, open_], []) is None
