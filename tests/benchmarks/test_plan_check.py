"""benchmarks/plan_check.py: the workload numbers it derives from a trace, and its committed verdict."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from coserve.bench.workload import agentic

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_numbers_of_a_known_workload(plan_check: ModuleType) -> None:
    """Three turns of 1,000 + (16 answered + 64 appended) tokens: n = 3, a = 64 (the answer's KV is held)."""
    conversations = agentic(20, 1.0, turns=3, first_tokens=1_000, appended_tokens=64, answer_tokens=16)
    numbers = plan_check.static_numbers(conversations)
    assert numbers["turns"] == 3
    assert numbers["appended_tokens"] == 64
    assert numbers["input_tokens"] == 1_000 and numbers["input_tokens_std_dev"] == 0
    assert numbers["output_tokens"] == 48
    assert numbers["later_turns"] == 40


def test_the_committed_verdict_is_computed_from_its_figures(plan_check: ModuleType) -> None:
    document = json.loads((BENCHMARKS / "results" / "plan_check.json").read_text())
    cases = document["cases"]
    assert {(c["trace"], c["profile"]) for c in cases} == {
        (t, p) for t in ("azure", "mooncake") for p in ("h100-published", "h200-measured")
    }
    for case in cases:
        up_to = [r["attainment"] for r in case["sweep"] if r["factor"] <= 1.0]
        past = [r["first_bottleneck"] for r in case["sweep"] if r["factor"] > 1.0]
        assert case["met"] == (min(up_to) >= plan_check.ONLINE_ATTAINMENT and all(p == "Prefiller" for p in past))
    grid = document["shape_grid"]
    cells = grid["cells"]
    assert {c["workload"] for c in cells} == {"agentic", "mooncake", "chat"}
    assert {c["factor"] for c in cells} == set(plan_check.GRID_FACTORS)
    for cell in cells:
        chosen = cell["shapes"][cell["plan_picks"]]
        other = cell["shapes"]["Aggregated" if cell["plan_picks"] == "Disaggregated" else "Disaggregated"]
        measured, alternative = chosen["twin_p95_ttfet_s"], other["twin_p95_ttfet_s"]
        assert cell["pick_right"] == bool(
            measured and alternative and measured <= (1 + plan_check.PICK_TOLERANCE) * alternative
        )
        error = None if not measured else chosen["predicted_p95_ttfet_s"] / measured - 1
        assert cell["prediction_within"] == (error is not None and abs(error) <= plan_check.PREDICTION_TOLERANCE)
    right = sum(c["pick_right"] for c in cells)
    within = sum(c["prediction_within"] for c in cells)
    assert grid["met"] == (right >= plan_check.PICK_SHARE * len(cells) and within == len(cells))
    assert document["met"] == (all(c["met"] for c in cases) and grid["met"])
