"""What ``coserve bench`` sends, as plain data: conversations of turns with their arrival times and prompts.

Who calls it: ``coserve.bench.run`` builds one workload per run with
``agentic``, ``from_mooncake`` or ``from_azure`` and replays it; tests build
them directly. Nothing here does I/O: the trace readers take the lines or rows.

Prompts are token ids (``/v1/completions`` accepts them), so the same tokens
reach every engine whatever its tokenizer, and a later turn's prompt starts with
every token of the earlier one (the engines' prefix cache and coserve's
conversation placement see a real conversation):

- ``agentic``: conversations arrive as a Poisson process at ``rate_per_s``; turn
  1 is ``first_tokens`` long; every later turn appends ``answer_tokens`` (the
  previous answer) and ``appended_tokens`` (a tool's result) and is sent
  ``gap_s`` after the previous turn's answer ended (the tool call).
- ``from_mooncake``: the Mooncake conversation trace. A conversation is the
  requests sharing their first two 512-token blocks (block 0 is a system prompt
  every request shares); a block's tokens are drawn from its hash id, so shared
  blocks are shared tokens. Times are divided by ``speedup``, lengths multiplied
  by ``scale`` (these CPU engines cannot prefill 12k-token prompts quickly).
- ``from_azure``: the Azure LLM conversation trace: every row is its own one-turn
  conversation at its timestamp.

A later turn waits for the earlier one to finish: it is sent at its own arrival
time or when the previous answer (plus the gap) is complete, whichever is later.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["Conversation", "Turn", "agentic", "from_azure", "from_mooncake", "percentile", "summarize"]

# Token ids below this are special tokens in common vocabularies (and the tiny test model's).
FIRST_PLAIN_ID = 16
LAST_PLAIN_ID = 1000
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its whole prompt (token ids) and how many tokens to answer."""

    prompt: tuple[int, ...]
    max_tokens: int
    gap_s: float = 0.0  # wait this long after the previous turn's answer before sending
    arrival_s: float | None = None  # the trace's own arrival time (from the run's start), when it has one
    length: int = 0  # the prompt's length when ``prompt`` is left empty (a trace read for the simulator)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) or self.length


@dataclass(frozen=True)
class Conversation:
    """A conversation arriving ``start_s`` after the run starts."""

    conversation_id: str
    start_s: float
    turns: tuple[Turn, ...] = field(default_factory=tuple)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, LAST_PLAIN_ID) for _ in range(count)]


def agentic(
    conversations: int,
    rate_per_s: float,
    turns: int = 4,
    first_tokens: int = 1024,
    appended_tokens: int = 64,
    answer_tokens: int = 16,
    gap_s: float = 1.0,
    seed: int = 0,
) -> list[Conversation]:
    """A generated agentic workload (module rules); ``ValueError`` on a non-positive size."""
    for name, value in (("conversations", conversations), ("turns", turns), ("first_tokens", first_tokens),
                        ("answer_tokens", answer_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"rate_per_s must be a positive number, got {rate_per_s}")
    if appended_tokens < 0 or gap_s < 0:
        raise ValueError("appended_tokens and gap_s must not be negative")
    rng = random.Random(seed)  # noqa: S311 - reproducible load, not secrets
    result, at = [], 0.0
    for index in range(conversations):
        prompt = _tokens(rng, first_tokens)
        steps = [Turn(tuple(prompt), answer_tokens)]
        for _ in range(turns - 1):
            prompt += _tokens(rng, answer_tokens + appended_tokens)
            steps.append(Turn(tuple(prompt), answer_tokens, gap_s=gap_s))
        result.append(Conversation(f"agentic-{seed}-{index}", at, tuple(steps)))
        at += rng.expovariate(rate_per_s)
    return result


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def _lengths(
    prompt: object, answer: object, scale: float, max_input: int | None, max_output: int | None
) -> tuple[int, int]:
    """A trace row's prompt and answer lengths, scaled and capped."""
    length = _scaled(int(prompt), scale)  # type: ignore[call-overload]
    output = _scaled(int(answer), scale)  # type: ignore[call-overload]
    return (min(length, max_input) if max_input else length), (min(output, max_output) if max_output else output)


def from_mooncake(
    rows: Iterable[Mapping[str, object]],
    *,
    speedup: float = 1.0,
    scale: float = 1.0,
    max_conversations: int | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    lengths_only: bool = False,
) -> list[Conversation]:
    """The Mooncake conversation trace as conversations (module rules); ``lengths_only``: no prompt tokens,
    only their number (``Turn.length``), which is all the simulator reads and far quicker to build."""
    _check_replay(speedup, scale)
    block = _scaled(MOONCAKE_BLOCK_TOKENS, scale)
    grouped: dict[tuple[int, ...], list[Mapping[str, object]]] = {}
    for row in rows:
        hashes = row.get("hash_ids")
        if not isinstance(hashes, list) or not hashes:
            continue
        key = tuple(int(h) for h in hashes[:2])
        if key not in grouped and max_conversations is not None and len(grouped) >= max_conversations:
            continue
        grouped.setdefault(key, []).append(row)
    conversations = []
    for key, requests in grouped.items():
        steps = []
        for row in requests:
            length, output = _lengths(row["input_length"], row["output_length"], scale, max_input_tokens,
                                      max_output_tokens)  # fmt: skip
            arrival = float(row["timestamp"]) / 1000.0 / speedup  # type: ignore[arg-type]
            if lengths_only:  # as long as the tokens would be: its blocks, cut at its length
                blocks = len(row["hash_ids"]) * block  # type: ignore[arg-type]
                steps.append(Turn((), output, arrival_s=arrival, length=min(length, blocks)))
                continue
            prompt: list[int] = []
            for hash_id in row["hash_ids"]:  # type: ignore[attr-defined]
                prompt += _tokens(random.Random(int(hash_id)), block)  # noqa: S311 - a block's tokens from its id
            steps.append(Turn(tuple(prompt[:length]), output, arrival_s=arrival))
        start = steps[0].arrival_s or 0.0
        conversations.append(Conversation("mooncake-" + "-".join(map(str, key)), start, tuple(steps)))
    return sorted(conversations, key=lambda c: c.start_s)


def from_azure(
    rows: Iterable[Mapping[str, str]],
    *,
    speedup: float = 1.0,
    scale: float = 1.0,
    max_conversations: int | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    seed: int = 0,
    lengths_only: bool = False,
) -> list[Conversation]:
    """The Azure LLM trace (``TIMESTAMP,ContextTokens,GeneratedTokens``): one-turn conversations
    (``lengths_only`` as ``from_mooncake``)."""
    _check_replay(speedup, scale)
    rng = random.Random(seed)  # noqa: S311 - reproducible load, not secrets
    result: list[Conversation] = []
    origin: datetime | None = None
    for index, row in enumerate(rows):
        if max_conversations is not None and index >= max_conversations:
            break
        stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
        origin = origin or stamp
        length, output = _lengths(row["ContextTokens"], row["GeneratedTokens"], scale, max_input_tokens,
                                  max_output_tokens)  # fmt: skip
        arrival = (stamp - origin).total_seconds() / speedup
        if lengths_only:
            turn = Turn((), output, arrival_s=arrival, length=length)
        else:
            turn = Turn(tuple(_tokens(rng, length)), output, arrival_s=arrival)
        result.append(Conversation(f"azure-{index}", arrival, (turn,)))
    return result


def _check_replay(speedup: float, scale: float) -> None:
    if speedup <= 0 or not math.isfinite(speedup):
        raise ValueError(f"speedup must be a positive number, got {speedup}")
    if scale <= 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive number, got {scale}")


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The ``pct`` percentile (nearest rank); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(records: Sequence[Mapping[str, object]], duration_s: float) -> dict[str, object]:
    """The report's summary of per-turn records (``ttft_s``, ``tbt_s`` list, ``e2e_s``, ``output_tokens``,
    ``error``, ``final``, ``ttfet_s``)."""
    ok = [r for r in records if not r.get("error")]
    ttft = [float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None]  # type: ignore[arg-type]
    tbt = [float(gap) for r in ok for gap in r.get("tbt_s") or []]  # type: ignore[attr-defined]
    e2e = [float(r["e2e_s"]) for r in ok]  # type: ignore[arg-type]
    ttfet = [float(r["ttfet_s"]) for r in ok if r.get("final") and r.get("ttfet_s") is not None]  # type: ignore[arg-type]
    output = sum(int(r.get("output_tokens") or 0) for r in ok)  # type: ignore[call-overload]

    def spread(values: Sequence[float]) -> dict[str, float | None]:
        return {f"p{p}": percentile(values, p) for p in (50, 90, 95, 99)}

    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": output / duration_s if duration_s > 0 else None,
        "ttft_s": spread(ttft),
        "tbt_s": spread(tbt),
        "e2e_s": spread(e2e),
        "ttfet_s": spread(ttfet),
    }
