"""Every committed benchmark result measured the code that is here now.

A result records the commit its run started from and the measured paths that were
uncommitted then (``benchmarks/_harness.stamp``). It is stale, and this test fails
naming it, when any path it measures (``benchmarks/measured_paths.MEASURED``)
differs between that commit and HEAD, when it was measured on uncommitted code,
or when its commit is not in this history. The fix is to run the benchmark again
(the README's benchmark table says how) and commit the new result.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _measured() -> ModuleType:
    spec = importlib.util.spec_from_file_location("measured_paths", ROOT / "benchmarks" / "measured_paths.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEASURED: dict[str, tuple[str, ...]] = _measured().MEASURED


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    git = shutil.which("git")
    assert git is not None, "git is needed to tell whether a result is older than its code"
    return subprocess.run([git, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def staleness(name: str, document: dict[str, object]) -> str | None:
    """Why the result ``name`` does not describe this checkout's code, or ``None`` when it does."""
    paths = MEASURED.get(name)
    if paths is None:
        return f"{name}: no entry in benchmarks/measured_paths.py says what it measures"
    commit = document.get("commit")
    if not isinstance(commit, dict) or not commit.get("sha"):
        return f"{name}: records no commit"
    sha = str(commit["sha"])
    if commit.get("dirty"):
        return f"{name}: measured with uncommitted changes to {commit['dirty']}"
    if not isinstance(commit.get("dirty"), list):
        return f"{name}: does not record which measured paths were uncommitted (older harness)"
    if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return f"{name}: its commit {sha[:12]} is not in this history"
    changed = _git("diff", "--name-only", sha, "HEAD", "--", *paths)
    assert changed.returncode == 0, changed.stderr
    if changed.stdout.strip():
        files = ", ".join(changed.stdout.split())
        return f"{name}: measured at {sha[:12]}; since then these measured paths changed: {files}"
    return None


def result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_there_are_results() -> None:
    assert result_files(), f"no results under {RESULTS}"


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.stem)
def test_result_is_fresh(path: Path) -> None:
    document = json.loads(path.read_text())
    assert document.get("benchmark"), f"{path.name} names no benchmark"
    for key in ("target", "met", "date", "cpu_count"):
        assert key in document, f"{path.name} has no {key!r}"
    assert isinstance(document["met"], bool)
    problem = staleness(path.stem, document)
    assert problem is None, problem


def test_a_change_to_a_measured_path_makes_a_result_stale() -> None:
    """The check itself: stamped just before a commit that touched its code, a result is stale."""
    touched = _git("log", "-n", "1", "--format=%H", "--", "src/coserve/engine/safepoint.py").stdout.strip()
    assert touched
    before = {"commit": {"sha": _git("rev-parse", f"{touched}~1").stdout.strip(), "dirty": []}}
    assert "src/coserve/engine/safepoint.py" in (staleness("safepoint_overhead", before) or "")
    # a result that does not measure that file is not made stale by it
    assert "safepoint.py" not in (staleness("router_pins", before) or "")
    head = _git("rev-parse", "HEAD").stdout.strip()
    assert staleness("safepoint_overhead", {"commit": {"sha": head, "dirty": []}}) is None
    assert "uncommitted" in (staleness("safepoint_overhead", {"commit": {"sha": head, "dirty": ["src/x"]}}) or "")
    assert "not in this history" in (staleness("safepoint_overhead", {"commit": {"sha": "0" * 40, "dirty": []}}) or "")
    assert "no entry" in (staleness("unknown_benchmark", before) or "")
