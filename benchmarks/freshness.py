"""Whether each committed benchmark result still describes this checkout's code: reported, never enforced.

A result is stamped, when ``harness.results.write_result`` writes it, with a fingerprint of every file on its
measured path. The measured path of a result is the set of roots ``measured_paths.MEASURED`` lists for it
(its script, and the modules vLLM loads by name in the engines it starts), followed through every in-repo
module they import. A Python file's fingerprint hashes its syntax tree with
docstrings removed (the same on every supported Python), so comments, docstrings and formatting change
nothing while any code change does; any other file is hashed byte for byte.

A result is fresh when every file on its measured path, as the checkout has it now, has the fingerprint
the result recorded. Nothing here reads git history: a shallow clone, a squash merge or a rebase keeps
a result fresh as long as the code it measured is the code that is here.

Who calls what:

- ``harness.results.write_result`` (every benchmark, and the GPU check) calls ``stamp_code`` when it writes a result;
- ``make bench-status`` runs this file: a table of every result, fresh or stale, and for a stale one
  the measured files that changed (``--readme`` also rewrites the README table's "measured at" column);
  CI runs it too and never fails on what it finds;
- ``tests/benchmarks/test_freshness.py`` checks that the stamping itself works.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from measured_paths import MEASURED  # the neighbouring module: its folder is on sys.path, as for every script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
# What the stamping reads but no result measures: which roots a result has, and this file.
NOT_MEASURED = frozenset({"benchmarks/measured_paths.py", "benchmarks/freshness.py"})
SCHEME = "ast-2"  # how fingerprints are computed; a result stamped by another scheme is stale

# Where a module name is looked up, in this order: the installed package's source, then the repository's
# root (``benchmarks.x``, ``tests.y``); a file's own folder comes first for the scripts' neighbours.
SOURCE_ROOTS = ("src", "")

Reader = Callable[[str], bytes | None]
"""Reads a file by its path relative to the project root; ``None`` when there is no such file."""


def worktree(root: Path = ROOT) -> Reader:
    """The files as they are in ``root`` now (committed or not)."""

    def read(path: str) -> bytes | None:
        file = root / path
        return file.read_bytes() if file.is_file() else None

    return read


def cached(read: Reader) -> Reader:
    """``read``, each file read once: a snapshot of the tree as the first read of each file found it."""
    files: dict[str, bytes | None] = {}

    def read_once(path: str) -> bytes | None:
        if path not in files:
            files[path] = read(path)
        return files[path]

    return read_once


@functools.cache
def fingerprint(path: str, content: bytes) -> str:
    """A hash of what ``content`` does: for Python, its syntax tree without docstrings; otherwise its bytes."""
    if path.endswith(".py"):
        try:
            tree = ast.parse(content, filename=path)
        except SyntaxError:
            pass  # hashed as bytes: any edit to a file that does not parse counts
        else:
            content = repr(_canonical(_without_docstrings(tree))).encode()
    return hashlib.sha256(content).hexdigest()[:16]


def _canonical(node: object) -> object:
    """The tree as nested tuples of node names and the fields that hold something.

    Neither ``ast.dump`` nor ``ast.unparse`` reads the same on every Python this project supports: 3.12
    added fields that are empty in this code (``type_params``) and prints f-strings otherwise. Leaving out
    empty fields makes the tree of the same source read the same on 3.11, 3.12 and 3.13 (and so does
    leaving out the empty pieces some 3.12 releases put in f-strings).
    """
    if isinstance(node, ast.JoinedStr):
        node = ast.JoinedStr([v for v in node.values if not (isinstance(v, ast.Constant) and v.value == "")])
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        return (type(node).__name__, *((name, _canonical(value)) for name, value in fields if value not in (None, [])))
    if isinstance(node, list):
        return tuple(_canonical(item) for item in node)
    return (type(node).__name__, node)


def _without_docstrings(tree: ast.Module) -> ast.Module:
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, scopes) and node.body and _is_docstring(node.body[0]):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def _module_files(name: str, near: str, read: Reader) -> list[str]:
    """The files importing ``name`` runs: each package's ``__init__.py`` on the way, then the module."""
    parts = name.split(".")
    for base in (near, *SOURCE_ROOTS):
        prefix = f"{base}/" if base else ""
        files: list[str] = []
        for depth in range(1, len(parts) + 1):
            stem = prefix + "/".join(parts[:depth])
            if read(f"{stem}/__init__.py") is not None:
                files.append(f"{stem}/__init__.py")
            elif read(f"{stem}.py") is not None:
                files.append(f"{stem}.py")
                break  # what follows is an attribute of the module
            else:
                break
        if files:
            return files
    return []


@functools.cache
def _imports(path: str, content: bytes) -> tuple[tuple[str, str], ...]:
    """(module name, folder to try first) for every import in a Python file, at any depth."""
    try:
        tree = ast.parse(content, filename=path)
    except SyntaxError:
        return ()
    return tuple(_walk_imports(tree, path))


def _walk_imports(tree: ast.Module, path: str) -> Iterable[tuple[str, str]]:
    folder = path.rpartition("/")[0]
    package = folder.split("/")
    if package[:1] == ["src"]:
        package = package[1:]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, folder
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing file's package
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            yield base, folder
            for alias in node.names:  # ``from package import module``
                yield f"{base}.{alias.name}", folder


def _expand(root: str, read: Reader, listing: Callable[[str], list[str]]) -> list[str]:
    """A root names a file or a folder (all its files)."""
    return [root] if read(root) is not None else listing(root)


def measured_files(name: str, read: Reader, listing: Callable[[str], list[str]] | None = None) -> list[str]:
    """Every file on the measured path of result ``name``: its roots and, transitively, what they import."""
    return closure(MEASURED[name], read, listing)


def closure(roots: Iterable[str], read: Reader, listing: Callable[[str], list[str]] | None = None) -> list[str]:
    """``roots`` (files or folders) and every in-repo file they import, transitively."""
    if listing is None:
        listing = _folder_listing(ROOT)
    pending = [file for root in roots for file in _expand(root, read, listing)]
    seen: set[str] = set()
    while pending:
        path = pending.pop()
        if path in seen or path in NOT_MEASURED:
            continue
        content = read(path)
        if content is None:
            continue
        seen.add(path)
        if path.endswith(".py"):
            for module, near in _imports(path, content):
                pending.extend(_module_files(module, near, read))
    return sorted(seen)


def _folder_listing(root: Path) -> Callable[[str], list[str]]:
    def listing(folder: str) -> list[str]:
        base = root / folder
        if not base.is_dir():
            return []
        return sorted(
            str(file.relative_to(root))
            for file in base.rglob("*")
            if file.is_file() and "__pycache__" not in file.parts and not file.name.endswith(".pyc")
        )

    return listing


def stamp_code(name: str, read: Reader | None = None) -> dict[str, Any]:
    """The ``code`` stamp of a result: the scheme and each measured file's fingerprint."""
    read = read or worktree()
    files = {}
    for path in measured_files(name, read):
        content = read(path)
        assert content is not None  # measured_files lists only files that exist
        files[path] = fingerprint(path, content)
    return {"scheme": SCHEME, "files": files}


def stamp(name: str) -> dict[str, Any]:
    """What every result carries besides its figures (also used by the GPU check).

    ``code`` fingerprints every file on the result's measured path as this run found them (taken when
    the benchmark imports the harness, so an edit made while it runs does not count), which is what
    ``make bench-status`` compares with the checkout (``freshness.py``). ``commit`` is HEAD then, with the
    measured files that differed from it: provenance for the README's "measured at", never a test."""
    if name not in MEASURED:
        raise KeyError(f"{name}: list the paths it measures in benchmarks/measured_paths.py")
    commit, read = _RUN or begin_run()
    code = stamp_code(name, read)
    dirty = commit["dirty"]
    return {
        "commit": {
            "sha": commit["sha"],
            "dirty": None if dirty is None else sorted(f for f in dirty if f in code["files"]),
        },
        "code": code,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
    }


def code_version() -> dict[str, Any]:
    """HEAD and the paths that differ from it (tracked and changed, or untracked).

    Outside a git checkout (a copy of the tree on a lent GPU machine) the commit is ``COSERVE_COMMIT``,
    when the one who copied it says so, with ``dirty`` unknown (``None``)."""
    git = shutil.which("git")
    outside = {"sha": os.environ.get("COSERVE_COMMIT") or None, "dirty": None}
    if git is None:
        return outside
    try:
        head = subprocess.run(  # noqa: S603 - git, with fixed arguments
            [git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        status = subprocess.run(  # noqa: S603 - git, with fixed arguments
            [git, "status", "--porcelain", "--untracked-files=all", "--", "src", "benchmarks"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return outside
    dirty = [line[3:].split(" -> ")[-1] for line in status.stdout.splitlines() if line.strip()]
    return {"sha": head.stdout.strip(), "dirty": dirty}


_RUN: tuple[dict[str, Any], Reader] | None = None


def begin_run() -> tuple[dict[str, Any], Reader]:
    """Take the run's commit and a snapshot of every file on every measured path, once per process.

    ``harness.results`` calls it when a benchmark imports it: the code a benchmark measures is the code it
    started with, and an edit made while it runs is not in its stamp."""
    global _RUN
    if _RUN is None:
        read = cached(worktree())
        closure({root for roots in MEASURED.values() for root in roots}, read)
        _RUN = (code_version(), read)
    return _RUN


@dataclass(frozen=True)
class Status:
    """One result's standing against the checkout: fresh, or stale with the reason and the changed files."""

    name: str
    commit: str | None  # the commit the run started from (provenance only; freshness never reads it)
    date: str | None
    met: object
    problem: str | None  # None when fresh
    changed: tuple[str, ...] = ()

    @property
    def fresh(self) -> bool:
        return self.problem is None


def status(name: str, document: Mapping[str, Any], read: Reader | None = None) -> Status:
    """Whether the result ``document`` (named ``name``) still describes the code ``read`` returns."""
    commit = document.get("commit")
    sha = commit.get("sha") if isinstance(commit, Mapping) else None
    common = {"name": name, "commit": sha, "date": document.get("date"), "met": document.get("met")}
    if name not in MEASURED:
        return Status(**common, problem="benchmarks/measured_paths.py does not say what it measures")
    code = document.get("code")
    if not isinstance(code, Mapping) or not isinstance(code.get("files"), Mapping):
        return Status(**common, problem="records no fingerprint of the code it measured")
    if code.get("scheme") != SCHEME:
        return Status(**common, problem=f"fingerprinted by {code.get('scheme')!r}, not {SCHEME!r}")
    now = stamp_code(name, read)["files"]
    then: Mapping[str, str] = code["files"]
    changed = tuple(sorted(path for path in {*now, *then} if now.get(path) != then.get(path)))
    if changed:
        return Status(**common, problem=f"{len(changed)} measured file(s) changed", changed=changed)
    return Status(**common, problem=None)


def all_statuses(results: Path = RESULTS, read: Reader | None = None) -> list[Status]:
    read = cached(read or worktree())
    return [status(path.stem, json.loads(path.read_text()), read) for path in sorted(results.glob("*.json"))]


def table(statuses: list[Status]) -> str:
    rows = [("result", "measured at", "date", "met", "status")]
    for entry in statuses:
        rows.append(
            (
                entry.name,
                (entry.commit or "?")[:7],
                (entry.date or "?")[:10],
                "yes" if entry.met is True else "no" if entry.met is False else "?",
                "fresh" if entry.fresh else f"STALE: {entry.problem}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    for entry in statuses:
        if entry.changed:
            lines.append(f"\n{entry.name}: changed since it was measured: {', '.join(entry.changed)}")
            lines.append(f"  to refresh it: {rerun_hint(entry.name)}")
    return "\n".join(lines)


def rerun_hint(name: str) -> str:
    """How to measure ``name`` again: its benchmark script, or, for a result measured on a GPU (``*_cuda``),
    where to find the GPU command (those runs need a CUDA machine and, but for ``torch_*``, the GPU image)."""
    if name.endswith("_cuda"):
        script = "benchmarks/gpu/torch_check.py" if name.startswith("torch_") else "benchmarks/gpu/check.sh"
        return f"needs a CUDA GPU: {script}, as benchmarks/README.md's table says"
    scripts = [root for root in MEASURED.get(name, ()) if root.startswith("benchmarks/") and root.endswith(".py")]
    if not scripts:
        return "see benchmarks/README.md"
    return f".venv/bin/python {scripts[-1]} (with the machine to itself; benchmarks/README.md says how long)"


# The README's benchmark table: each row starts with the result's name in backticks; its last cell is
# "measured at": the short commit, and "stale" when the code on its measured path has changed since.
_README_ROW = re.compile(r"^\| `(?P<name>[a-z0-9_]+)` \|.*\| (?P<at>[^|]*) \|$")


def readme_cell(entry: Status) -> str:
    at = f"`{(entry.commit or '?')[:7]}`"
    return at if entry.fresh else f"{at} (stale)"


def update_readme(text: str, statuses: list[Status]) -> str:
    """``text`` (the README) with each benchmark row's "measured at" cell set from ``statuses``."""
    by_name = {entry.name: entry for entry in statuses}
    lines = []
    for line in text.splitlines(keepends=True):
        match = _README_ROW.match(line.rstrip("\n"))
        if match and match["name"] in by_name:
            head = line.rstrip("\n")[: match.start("at")]
            line = f"{head}{readme_cell(by_name[match['name']])} |\n"
        lines.append(line)
    return "".join(lines)


def readme_cells(text: str) -> dict[str, str]:
    """The README table's "measured at" cell of every result row."""
    return {match["name"]: match["at"].strip() for line in text.splitlines() if (match := _README_ROW.match(line))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", action="store_true", help="also rewrite the README table's 'measured at' cells")
    parser.add_argument("--json", action="store_true", help="print the statuses as JSON")
    args = parser.parse_args(argv)
    statuses = all_statuses()
    if args.json:
        print(json.dumps([entry.__dict__ for entry in statuses], indent=2, default=list))
    else:
        print(table(statuses))
        stale = sum(not entry.fresh for entry in statuses)
        print(f"\n{len(statuses) - stale} fresh, {stale} stale (a stale figure is reported, never a failure)")
    if args.readme:
        README.write_text(update_readme(README.read_text(), statuses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
