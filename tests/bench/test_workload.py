"""coserve.bench.workload: generated and replayed conversations (pure, table-driven and property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coserve.bench.workload import agentic, from_azure, from_mooncake, percentile, summarize


@given(
    conversations=st.integers(1, 6),
    turns=st.integers(1, 5),
    first=st.integers(1, 64),
    appended=st.integers(0, 32),
    answer=st.integers(1, 8),
)
def test_every_agentic_turn_extends_the_previous_prompt(
    conversations: int, turns: int, first: int, appended: int, answer: int
) -> None:
    workload = agentic(conversations, 2.0, turns, first, appended, answer, gap_s=0.5, seed=3)
    assert len(workload) == conversations
    assert [c.start_s for c in workload] == sorted(c.start_s for c in workload)
    for conversation in workload:
        assert len(conversation.turns) == turns
        assert len(conversation.turns[0].prompt) == first
        for earlier, later in zip(conversation.turns, conversation.turns[1:], strict=False):
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt
            assert len(later.prompt) == len(earlier.prompt) + answer + appended
            assert later.gap_s == 0.5


def test_agentic_is_reproducible_and_seeded() -> None:
    assert agentic(3, 1.0, seed=1) == agentic(3, 1.0, seed=1)
    assert agentic(3, 1.0, seed=1) != agentic(3, 1.0, seed=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"conversations": 0}, "conversations must be at least 1"),
        ({"turns": 0}, "turns must be at least 1"),
        ({"rate_per_s": 0.0}, "rate_per_s must be a positive number"),
        ({"rate_per_s": float("inf")}, "rate_per_s must be a positive number"),
        ({"gap_s": -1.0}, "must not be negative"),
    ],
)
def test_agentic_rejects_bad_sizes(kwargs: dict[str, float], message: str) -> None:
    arguments: dict[str, float] = {"conversations": 2, "rate_per_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        agentic(**arguments)  # type: ignore[arg-type]


MOONCAKE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [0, 4]},
    {"timestamp": 2000, "input_length": 1700, "output_length": 50, "hash_ids": [0, 1, 2, 3, 5]},
]


def test_mooncake_groups_turns_by_their_first_two_blocks_and_shares_prefix_tokens() -> None:
    workload = from_mooncake(MOONCAKE, speedup=2.0, scale=0.25)
    assert [c.conversation_id for c in workload] == ["mooncake-0-1", "mooncake-0-4"]
    first, second = workload
    assert [len(t.turns) for t in workload] == [2, 1]
    turn1, turn2 = first.turns
    assert (len(turn1.prompt), turn1.max_tokens) == (300, 25)  # lengths scaled by 1/4
    assert len(turn2.prompt) == 425
    assert turn2.prompt[:300] == turn1.prompt  # the same blocks are the same tokens
    assert turn1.prompt[:128] == second.turns[0].prompt[:128]  # block 0, shared by every request
    assert (turn1.arrival_s, turn2.arrival_s, second.start_s) == (0.0, 1.0, 0.25)  # sped up twice


def test_mooncake_limits_conversations_and_lengths() -> None:
    workload = from_mooncake(MOONCAKE, max_conversations=1, max_input_tokens=100, max_output_tokens=7)
    assert len(workload) == 1 and len(workload[0].turns) == 2
    assert all(len(t.prompt) == 100 and t.max_tokens == 7 for t in workload[0].turns)


def test_azure_rows_are_one_turn_conversations_at_their_timestamps() -> None:
    rows = [
        {"TIMESTAMP": "2023-11-16 18:15:46.6805900", "ContextTokens": "374", "GeneratedTokens": "44"},
        {"TIMESTAMP": "2023-11-16 18:15:50.9951690", "ContextTokens": "396", "GeneratedTokens": "109"},
    ]
    workload = from_azure(rows, speedup=4.0, scale=0.5)
    assert [len(c.turns) for c in workload] == [1, 1]
    assert workload[0].start_s == 0.0
    assert workload[1].start_s == pytest.approx((50.995169 - 46.68059) / 4.0)
    assert (len(workload[1].turns[0].prompt), workload[1].turns[0].max_tokens) == (198, 54)


@pytest.mark.parametrize(("speedup", "scale"), [(0.0, 1.0), (1.0, -1.0), (float("nan"), 1.0)])
def test_replays_reject_bad_speedup_or_scale(speedup: float, scale: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        from_mooncake(MOONCAKE, speedup=speedup, scale=scale)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_summary_counts_errors_and_ttfet_of_final_turns_only() -> None:
    records = [
        {"ttft_s": 0.1, "tbt_s": [0.01, 0.02], "e2e_s": 0.2, "output_tokens": 3, "final": False, "ttfet_s": 9.0},
        {"ttft_s": 0.3, "tbt_s": [0.03], "e2e_s": 0.4, "output_tokens": 2, "final": True, "ttfet_s": 1.5},
        {"error": "HTTP 503"},
    ]
    summary = summarize(records, duration_s=2.0)
    assert (summary["requests"], summary["errors"]) == (3, 1)
    assert summary["ttfet_s"] == {"p50": 1.5, "p90": 1.5, "p95": 1.5, "p99": 1.5}
    assert summary["output_tokens_per_s"] == 2.5
    assert summary["tbt_s"]["p99"] == 0.03  # type: ignore[index]
