"""Benchmark freshness is reported by content, and the stamping itself works.

``benchmarks/freshness.py`` fingerprints every file on a result's measured path. These tests check what
that promises: a comment or docstring changes no fingerprint while a code change does; an edit to one
module makes stale exactly the results whose measured path reaches it; no git history is read (a
shallow clone and a squash merge keep a result fresh); and every committed result carries a stamp the
status can read. Whether the committed results are fresh is not tested: ``make bench-status`` reports it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"
SCHEDULER = "src/coserve/engine/scheduler.py"


def overlay(freshness: ModuleType, path: str, content: bytes) -> Any:
    """The checkout as it is, but with ``path`` holding ``content``."""
    live = freshness.worktree()
    return lambda name: content if name == path else live(name)


def edited(source: str, old: str, new: str) -> bytes:
    assert old in source, f"the edit's anchor {old!r} is not in the file"
    return source.replace(old, new, 1).encode()


def stamped_now(freshness: ModuleType) -> dict[str, dict[str, Any]]:
    """Every result as if it had been measured on the checkout as it is now."""
    return {name: {"code": freshness.stamp_code(name)} for name in freshness.MEASURED}


def stale_after(freshness: ModuleType, read: Any) -> dict[str, tuple[str, ...]]:
    statuses = {name: freshness.status(name, doc, read) for name, doc in stamped_now(freshness).items()}
    return {name: entry.changed for name, entry in statuses.items() if not entry.fresh}


SCHEDULER_SOURCE = (ROOT / SCHEDULER).read_text()
COMMENT_ONLY = {
    "a comment": ("        now_s = time.time()\n", "        now_s = time.time()  # the policy's clock\n"),
    "a docstring": ('"""Called by the engine core once per step', '"""Called once per step by the engine core'),
    "a blank line": ("        now_s = time.time()\n", "\n        now_s = time.time()\n"),
}
CODE_CHANGES = {
    "a constant": ("ARRIVAL_WAIT_S = 0.05", "ARRIVAL_WAIT_S = 0.06"),
    "an expression": ("decision.allowances.get(r.request_id, 0)", "decision.allowances.get(r.request_id, 1)"),
}


@pytest.mark.parametrize("change", COMMENT_ONLY.values(), ids=COMMENT_ONLY.keys())
def test_a_comment_or_docstring_in_the_scheduler_leaves_every_result_fresh(
    freshness: ModuleType, change: tuple[str, str]
) -> None:
    content = edited(SCHEDULER_SOURCE, *change)
    assert freshness.fingerprint(SCHEDULER, content) == freshness.fingerprint(SCHEDULER, SCHEDULER_SOURCE.encode())
    assert stale_after(freshness, overlay(freshness, SCHEDULER, content)) == {}


@pytest.mark.parametrize("change", CODE_CHANGES.values(), ids=CODE_CHANGES.keys())
def test_a_code_change_in_the_scheduler_stales_exactly_the_results_that_run_it(
    freshness: ModuleType, change: tuple[str, str]
) -> None:
    stale = stale_after(freshness, overlay(freshness, SCHEDULER, edited(SCHEDULER_SOURCE, *change)))
    # the results whose engines run coserve's scheduler ...
    engine_results = {
        "preemption_latency", "safepoint_overhead", "priority_scheduling", "coserving", "cost_model",
        "kv_reload", "checkpoint_overhead", "ttfet", "ttfet_gateway", "harvest_pool", "simulator_fidelity",
        "preemption_latency_cuda", "safepoint_overhead_cuda", "kv_reload_cuda",
    }  # fmt: skip
    assert set(stale) == engine_results
    # ... each for that file alone; the router, operator, KV pool and simulator results stay fresh
    assert set(stale.values()) == {(SCHEDULER,)}
    for name in ("kv_pool", "router_overhead", "router_pins", "reconcile", "autoscaling", "plan_check"):
        assert name not in stale


def test_a_module_newly_imported_on_a_measured_path_stales_the_results_that_reach_it(freshness: ModuleType) -> None:
    path = "src/coserve/kv/pool.py"
    source = (ROOT / path).read_text()
    content = edited(
        source, "from __future__ import annotations\n", "from __future__ import annotations\n\nimport coserve.local\n"
    )
    stale = stale_after(freshness, overlay(freshness, path, content))
    assert "kv_pool" in stale
    assert "src/coserve/local.py" in stale["kv_pool"]  # reached only through the new import
    assert "router_overhead" not in stale


def test_what_a_result_measures_follows_imports_and_the_modules_vllm_loads_by_name(freshness: ModuleType) -> None:
    read = freshness.worktree()
    kv_pool = freshness.measured_files("kv_pool", read)
    assert {"benchmarks/kv_pool.py", "benchmarks/harness/results.py", "src/coserve/kv/pool.py"} <= set(kv_pool)
    assert SCHEDULER not in kv_pool
    engine = freshness.measured_files("priority_scheduling", read)
    assert {SCHEDULER, "src/coserve/engine/worker.py", "src/coserve/engine/connector.py"} <= set(engine)
    assert "src/coserve/operator/reconcile.py" not in engine
    # what says what a result measures is not itself measured
    assert not {"benchmarks/measured_paths.py", "benchmarks/freshness.py"} & set(engine)


def test_a_result_without_a_stamp_or_entry_is_reported_not_raised(freshness: ModuleType) -> None:
    assert "no fingerprint" in freshness.status("kv_pool", {"commit": {"sha": "0" * 40}}).problem
    assert "measured_paths" in freshness.status("unknown_benchmark", {}).problem
    old_scheme = {"code": {"scheme": "git-history", "files": {}}}
    assert "git-history" in freshness.status("kv_pool", old_scheme).problem


def test_write_results_stamp_is_what_the_status_reads(freshness: ModuleType) -> None:
    document = freshness.stamp("kv_pool")
    assert document["code"] == freshness.stamp_code("kv_pool")
    assert set(document["commit"]) == {"sha", "dirty"}
    assert freshness.status("kv_pool", document).fresh


@pytest.mark.skipif(shutil.which("git") is None, reason="git makes the clone")
def test_a_shallow_clone_and_a_squash_merge_keep_every_status(freshness: ModuleType, tmp_path: Path) -> None:
    """Statuses come from content alone: a one-commit clone, squashed again, answers as the full history."""
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    squash = "git checkout --quiet --orphan squashed && git commit --quiet -m squashed"
    subprocess.run(["sh", "-c", squash], cwd=clone, check=True, env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})  # fmt: skip

    def committed(path: str) -> bytes | None:  # the full history's HEAD, read through git
        shown = subprocess.run(["git", "show", f"{here.stdout.strip()}:{path}"], cwd=ROOT, capture_output=True)
        return shown.stdout if shown.returncode == 0 else None

    in_clone = freshness.all_statuses(clone / "benchmarks" / "results", freshness.worktree(clone))
    at_head = freshness.all_statuses(clone / "benchmarks" / "results", committed)
    assert in_clone and [(s.name, s.changed, s.problem) for s in in_clone] == [
        (s.name, s.changed, s.problem) for s in at_head
    ]


def result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.stem)
def test_every_result_carries_what_the_status_reads(freshness: ModuleType, path: Path) -> None:
    document = json.loads(path.read_text())
    assert document.get("benchmark"), f"{path.name} names no benchmark"
    for key in ("target", "met", "date", "cpu_count", "commit", "code"):
        assert key in document, f"{path.name} has no {key!r}"
    assert isinstance(document["met"], bool)
    assert path.stem in freshness.MEASURED, f"benchmarks/measured_paths.py does not say what {path.stem} measures"
    assert document["code"]["scheme"] == freshness.SCHEME and document["code"]["files"]


def test_the_readme_table_says_where_each_result_was_measured(freshness: ModuleType) -> None:
    cells = freshness.readme_cells((ROOT / "README.md").read_text())
    for path in result_files():
        sha = json.loads(path.read_text())["commit"]["sha"]
        assert cells.get(path.stem, "").startswith(f"`{sha[:7]}`"), (
            f"README's row for {path.stem} should say `{sha[:7]}`: run `make bench-status-readme`"
        )


def test_the_readme_cell_marks_a_stale_result(freshness: ModuleType) -> None:
    row = "| `kv_pool` | target | figures | yes | `1234567` |\n"
    fresh = freshness.Status("kv_pool", "abcdef0123", None, True, None)
    stale = freshness.Status("kv_pool", "abcdef0123", None, True, "1 measured file(s) changed", ("x.py",))
    assert freshness.update_readme(row, [fresh]) == "| `kv_pool` | target | figures | yes | `abcdef0` |\n"
    assert freshness.update_readme(row, [stale]) == "| `kv_pool` | target | figures | yes | `abcdef0` (stale) |\n"


def test_a_fingerprint_reads_the_same_on_every_supported_python(freshness: ModuleType) -> None:
    """3.12 added fields that stay empty here (``type_params``), and some 3.12 releases put empty pieces in
    f-strings; neither may change a fingerprint, or a result measured on one Python is stale on another."""
    import ast

    tree = ast.parse("def f(x):\n    return f'{x}!'\n")
    function = tree.body[0]
    canonical = freshness._canonical(tree)
    function.type_params = []  # as 3.12 parses it
    joined = function.body[0].value
    joined.values.append(ast.Constant(""))  # as 3.12.0 and 3.12.1 parse some f-strings
    assert freshness._canonical(tree) == canonical
    joined.values.append(ast.Constant("?"))  # a real change still shows
    assert freshness._canonical(tree) != canonical


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("priority_scheduling", ".venv/bin/python benchmarks/priority_scheduling.py"),
        ("router_pins", ".venv/bin/python benchmarks/router_overhead.py"),
        ("torch_decode_graphs_cuda", "needs a CUDA GPU: benchmarks/gpu/torch_check.py"),
        ("preemption_latency_cuda", "needs a CUDA GPU: benchmarks/gpu/check.sh"),
    ],
)
def test_a_stale_result_says_how_to_refresh_it(freshness: ModuleType, name: str, wanted: str) -> None:
    stale = freshness.Status(name, "0" * 40, "2026-01-01", True, "1 measured file(s) changed", ("x.py",))
    listing = freshness.table([stale])
    assert f"to refresh it: {wanted}" in listing
    assert "to refresh it" not in freshness.table([freshness.Status(name, "0" * 40, "2026-01-01", True, None)])
