"""Result files, tables and pictures: how every benchmark reports.

Who calls what: each benchmark script calls ``write_result`` once per result it measured (the file is
stamped by ``freshness.stamp`` with the code it measured), prints its comparison with a ``Table``, and
draws a PNG inside ``figure``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freshness import begin_run, stamp

from .stats import finite

RESULTS = Path(__file__).resolve().parents[1] / "results"
begin_run()  # the code this run measures is the code it starts with (freshness.stamp)


def write_result(name: str, document: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json``, stamped (``freshness.stamp``) with what it measured, the
    date and the machine's core count."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    stamped = {**document, **stamp(name)}
    path.write_text(json.dumps(finite(stamped), indent=2, allow_nan=False) + "\n")
    return path


def show(value: float | None, fmt: str = "{:.2f}") -> str:
    """``value`` formatted, or ``-`` when there is none (too few samples, an arm that failed)."""
    return "-" if value is None else fmt.format(value)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or theirs is not positive."""
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


@dataclass
class Table:
    """A plain-text table on stdout: a first column of labels, then right-aligned columns.

    ``Table("arm", ("TTFT p50 s", 12), ("p95 s", 9))`` prints its header at once; ``row(label, *cells)``
    prints a row, each cell a string (``show``) or a number (formatted with the column's ``fmt``).
    """

    label: str
    columns: Sequence[tuple[str, int]]
    label_width: int = 24
    fmt: str = "{:.2f}"
    rows: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        print("\n" + self._line(self.label, [name for name, _ in self.columns]))

    def row(self, label: str, *cells: object) -> None:
        texts = [cell if isinstance(cell, str) else show(cell, self.fmt) for cell in cells]  # type: ignore[arg-type]
        self.rows.append([label, *texts])
        print(self._line(label, texts))

    def _line(self, label: str, cells: Sequence[str]) -> str:
        widths = [width for _, width in self.columns]
        cells_text = "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=False))
        return f"{label:{self.label_width}}{cells_text}"


@contextmanager
def figure(
    path: Path,
    *,
    rows: int = 1,
    columns: int = 1,
    size: tuple[float, float] = (7.0, 4.5),
    dpi: int = 120,
    **layout: Any,
) -> Iterator[Any]:
    """A matplotlib figure (headless) whose axes the block draws on; saved to ``path`` when it ends.

    Yields what ``plt.subplots(rows, columns)`` gives: one axis, or an array of them (``layout`` goes to
    ``plt.subplots`` too: ``squeeze=False`` for a grid always two-dimensional, ``gridspec_kw``). The
    figure itself is any axis's ``.figure`` (a ``suptitle``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(rows, columns, figsize=size, **layout)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
