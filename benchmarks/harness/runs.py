"""A benchmark's runs kept on disk as they finish, so that a long matched sweep can stop and resume.

Who calls what: ``ttfet.py`` opens a ``RunStore`` for its setup, skips every run the store already holds,
adds each run as it finishes (the file is rewritten whole each time, atomically), and judges from the store
once every run is in it. A store resumes only with the same setup and the same measured code
(``freshness.stamp_code``): runs of other code, or of another workload, are never pooled with these. A
mismatch is a clear error naming what differs; ``--fresh`` starts over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from freshness import stamp_code

PARTIAL = Path(__file__).resolve().parents[1] / "partial"  # committed: a sweep may span several sessions


class StoreMismatch(RuntimeError):
    """The stored runs measured another setup or other code than this run would."""


class RunStore:
    """Finished runs of one benchmark, keyed by the run's identity (arm, load, repetition), on disk."""

    def __init__(self, name: str, setup: Mapping[str, Any], *, fresh: bool = False, path: Path | None = None) -> None:
        self.path = path or PARTIAL / f"{name}.json"
        self.code = stamp_code(name)["files"]
        self.setup = dict(setup)
        self.runs: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}  # what the sweep measured once and every later session must reuse
        if self.path.exists() and not fresh:
            stored = json.loads(self.path.read_text())
            self._check(stored)
            self.runs, self.facts = list(stored["runs"]), dict(stored.get("facts", {}))

    def _check(self, stored: Mapping[str, Any]) -> None:
        if stored.get("setup") != self.setup:
            raise StoreMismatch(
                f"{self.path} holds runs of another setup ({stored.get('setup')} against {self.setup}): "
                "run with the same options, or pass --fresh to start over"
            )
        changed = sorted(
            path for path in set(stored.get("code", {})) | set(self.code)
            if stored.get("code", {}).get(path) != self.code.get(path)
        )  # fmt: skip
        if changed:
            raise StoreMismatch(
                f"{self.path} holds runs of other code ({', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''} "
                "changed since): pass --fresh to start over"
            )

    @staticmethod
    def key(run: Mapping[str, Any]) -> tuple[str, str, int]:
        return (str(run["arm"]), str(run["load"]), int(run["repetition"]))

    def has(self, arm: str, load: str, repetition: int) -> bool:
        return any(self.key(run) == (arm, load, repetition) for run in self.runs)

    def add(self, run: Mapping[str, Any]) -> None:
        """Keep ``run`` (it must name ``arm``, ``load`` and ``repetition``) and rewrite the file."""
        self.runs = [r for r in self.runs if self.key(r) != self.key(run)] + [dict(run)]
        self.save()

    def remember(self, **facts: Any) -> None:
        self.facts.update(facts)
        self.save()

    def select(self, arm: str, load: str) -> list[dict[str, Any]]:
        return sorted((r for r in self.runs if (r["arm"], r["load"]) == (arm, load)), key=lambda r: r["repetition"])

    def complete(self, plan: Iterable[tuple[str, str, int]]) -> bool:
        return all(self.has(*item) for item in plan)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        document = {"setup": self.setup, "code": self.code, "facts": self.facts, "runs": self.runs}
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(document, indent=1) + "\n")
        os.replace(temporary, self.path)

    def discard(self) -> None:
        """The sweep is judged and written: its runs now live in the result."""
        self.path.unlink(missing_ok=True)
