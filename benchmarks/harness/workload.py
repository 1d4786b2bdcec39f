"""What the benchmarks replay: the real traces in ``data/traces``, requests and prompts.

Who calls what: trace-driven scripts take ``--trace`` (``add_trace_argument``), read it with
``load_trace`` and draw their requests from its rows; every prompt is a list of token ids
(``random_prompt``), so no tokenizer is involved.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"  # the real traces in this checkout (README.md there)
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
# Token ids below this are the tiny model's special tokens.
FIRST_PLAIN_ID = 16


@dataclass(frozen=True)
class TraceRow:
    offset_s: float
    context_tokens: int
    generated_tokens: int


TRACE_FORMATS = "an Azure LLM inference CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a Mooncake JSONL trace"


def load_trace(path: Path) -> list[TraceRow]:
    """Any trace in the formats of ``data/traces/README.md``: arrival offsets (s) and token counts.

    Azure CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or Mooncake JSONL
    (``timestamp`` in ms, ``input_length``, ``output_length``), told apart by content,
    sorted by arrival, offsets from the first arrival. A file that is neither is a clear error.
    """
    if not path.exists():
        raise SystemExit(f"trace not found: {path} (the benchmarks replay data/traces by default)")
    with path.open() as handle:
        first = handle.readline().strip()
        handle.seek(0)
        if first.startswith("{"):
            lines = enumerate(handle, 1)
            rows = [_mooncake_row(json.loads(line), path, number) for number, line in lines if line.strip()]
        elif first.replace(" ", "").startswith("TIMESTAMP,ContextTokens,GeneratedTokens"):
            rows = [_azure_row(row, path) for row in csv.DictReader(handle)]
        else:
            raise SystemExit(f"{path}: not a trace this harness reads; expected {TRACE_FORMATS}")
    if not rows:
        raise SystemExit(f"{path}: the trace has no requests")
    rows.sort(key=lambda row: row.offset_s)
    origin = rows[0].offset_s
    return [TraceRow(row.offset_s - origin, row.context_tokens, row.generated_tokens) for row in rows]


def _azure_row(row: dict[str, str], path: Path) -> TraceRow:
    try:
        stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])  # "2023-11-16 18:15:46.6805900"
        return TraceRow(stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
    except (KeyError, ValueError) as error:
        raise SystemExit(f"{path}: bad Azure row {row!r}: {error}") from None


def _mooncake_row(row: dict[str, Any], path: Path, number: int) -> TraceRow:
    try:
        return TraceRow(float(row["timestamp"]) / 1000.0, int(row["input_length"]), int(row["output_length"]))
    except (KeyError, TypeError, ValueError) as error:
        raise SystemExit(f"{path}:{number}: bad Mooncake row: {error}") from None


def azure_conversation_trace() -> list[TraceRow]:
    """The Azure LLM inference trace (conversation), 2023: arrival offsets and token counts."""
    return load_trace(AZURE_CONV)


def add_trace_argument(parser: argparse.ArgumentParser, default: Path = AZURE_CONV) -> None:
    """``--trace FILE`` for a trace-driven benchmark (results name the trace they replayed)."""
    parser.add_argument(
        "--trace",
        type=Path,
        default=default,
        help=f"the trace to replay: {TRACE_FORMATS} (default: data/traces/{default.name})",
    )


def trace_label(path: Path) -> str:
    """How a result names its trace: the file name, and the path when it is not one of the traces in ``TRACES``."""
    return path.name if path.resolve().parent == TRACES.resolve() else str(path)


@dataclass
class BenchRequest:
    """One request to send ``at_s`` after the phase starts."""

    at_s: float
    prompt: list[int]
    max_tokens: int
    cls: str
    priority: int


def random_prompt(rng: random.Random, length: int, vocab: int = 1024) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(length)]
