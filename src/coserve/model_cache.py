"""Fill a shared model cache once: the model-download init container of every engine pod.

Who calls it: with ``spec.model.cache`` set, each engine pod starts with the init
container ``model-download``, which runs ``python3 -m coserve.model_cache --model
<name> --cache-dir <mountPath>/hub`` (``coserve.operator.resources.model_download_command``)
on the cache volume, mounted read-write; the vLLM container then mounts it
read-only with ``HF_HUB_CACHE`` pointing here and ``HF_HUB_OFFLINE=1``.

Many pods start at once on one shared volume. The first takes the model's lock
and downloads; the others wait on the lock, then find the completion marker and
finish at once; a pod that starts later finds the marker without locking::

    <cache-dir>/                                 the Hugging Face hub cache (models--org--name/...)
    <cache-dir>/.coserve/<model>-<hash>.lock     held (flock, via filelock) while a pod downloads the model
    <cache-dir>/.coserve/<model>-<hash>.complete written once the download succeeded

A failed download leaves no marker, so the next pod (or the kubelet's retry of
this init container) tries again, resuming from the files already fetched.

NOTE: ``flock`` on a network file system: Linux NFS clients emulate it with
POSIX byte-range locks, which NFSv4 servers enforce across clients, and CephFS and
most CSI file systems support it natively. Where locks are not supported the
command says so and exits 2 rather than risk two pods writing one file. So the lock is
filelock's ``UnixFileLock`` with its soft-lock fallback off: a soft lock is a marker
file, and once the pod that wrote it dies mid-download, pods on other nodes cannot
tell it from a live holder.

The downloader is injected (``fill_cache(download=...)``), so the locking and the
marker are tested without the Hub; ``main`` uses ``huggingface_hub.snapshot_download``,
imported when needed (it is in the engine image, not in coserve's own dependencies).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import filelock

__all__ = [
    "STATE_DIR",
    "Downloader",
    "ModelCacheError",
    "fill_cache",
    "hub_download",
    "lock_path",
    "main",
    "marker_path",
]

STATE_DIR = ".coserve"  # inside the cache dir: coserve's locks and markers, beside the hub's own folders
PROGRESS_EVERY_S = 30.0
_MAX_REASON_CHARS = 500
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

Downloader = Callable[[str, Path], None]  # (model, cache_dir): put the model's files into cache_dir, or raise
Log = Callable[[str], None]


class ModelCacheError(Exception):
    """The cache could not be filled; the message says why, for a person reading the pod's log."""


def _stderr(message: str) -> None:
    print(f"model-download: {message}", file=sys.stderr, flush=True)


def _file_stem(model: str) -> str:
    """A file name for ``model``: readable (``Qwen--Qwen3-8B``) and unique (a digest of the exact name)."""
    readable = _UNSAFE.sub("_", model.replace("/", "--")).lstrip(".-")[:100] or "model"
    return f"{readable}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


def marker_path(cache_dir: Path, model: str) -> Path:
    """The file whose presence says ``model`` is completely in ``cache_dir``."""
    return cache_dir / STATE_DIR / f"{_file_stem(model)}.complete"


def lock_path(cache_dir: Path, model: str) -> Path:
    """The file a pod holds an exclusive lock on while it downloads ``model``."""
    return cache_dir / STATE_DIR / f"{_file_stem(model)}.lock"


def fill_cache(model: str, cache_dir: Path, download: Downloader, log: Log = _stderr) -> bool:
    """Make sure ``model`` is in ``cache_dir``, downloading it at most once across every pod sharing the volume.

    Returns True when this call downloaded it, False when it was already there (or another
    pod finished it while this one waited). Raises ``ModelCacheError`` when the cache cannot
    be written or locked, or the download fails; no marker is written then.
    """
    marker = marker_path(cache_dir, model)
    if marker.exists():
        log(f"{model} is already in {cache_dir}")
        return False
    with _model_lock(cache_dir, model, log):
        if marker.exists():
            log(f"{model} was put into {cache_dir} by another pod")
            return False
        log(f"downloading {model} into {cache_dir}")
        started = time.monotonic()
        try:
            download(model, cache_dir)
        except ModelCacheError:
            raise
        except Exception as error:  # any failure of the downloader is reported, never a traceback
            raise ModelCacheError(f"could not download {model}: {_describe(error)}") from error
        _write_marker(marker, model)
        log(f"downloaded {model} in {time.monotonic() - started:.0f} s")
        return True


@contextlib.contextmanager
def _model_lock(cache_dir: Path, model: str, log: Log) -> Iterator[None]:
    path = lock_path(cache_dir, model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()  # here, not in filelock: a cache we cannot write is told apart from one we cannot lock
    except OSError as error:
        raise ModelCacheError(f"cannot write to the cache {cache_dir}: {error.strerror or error}") from None
    lock = filelock.UnixFileLock(path, fallback_to_soft=False)  # flock or nothing (the module's NOTE)
    try:
        try:
            lock.acquire(blocking=False)
        except filelock.Timeout:
            log(f"another pod is downloading {model}; waiting for it")
            waited = time.monotonic()
            lock.acquire()
            log(f"waited {time.monotonic() - waited:.0f} s for the other pod")
    except OSError as error:
        raise ModelCacheError(
            f"cannot lock {path}: {error.strerror or error} (the cache's file system must support file locks)"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _write_marker(marker: Path, model: str) -> None:
    """Write the marker atomically: a pod never sees a half-written one."""
    record = {"model": model, "completedAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    partial = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, marker)
    except OSError as error:
        raise ModelCacheError(f"downloaded {model} but cannot write {marker}: {error.strerror or error}") from None


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no details"
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}"


# --- the Hugging Face Hub -------------------------------------------------------------------------


def hub_download(model: str, cache_dir: Path) -> None:
    """Download every file of ``model`` from the Hugging Face Hub into the hub cache ``cache_dir``.

    The token is ``HF_TOKEN`` (from ``spec.model.hfTokenSecretRef``), and ``HF_ENDPOINT``
    and proxy variables apply as usual. Progress is logged every 30 s as bytes on disk.
    """
    try:
        from huggingface_hub import snapshot_download  # in the engine image, not a coserve dependency
    except ImportError:
        raise ModelCacheError("huggingface_hub is not installed in this image") from None
    with _progress(model, cache_dir, _stderr):
        snapshot_download(repo_id=model, cache_dir=str(cache_dir), token=os.environ.get("HF_TOKEN") or None)


@contextlib.contextmanager
def _progress(model: str, cache_dir: Path, log: Log, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Log the size of ``model``'s folder in the hub cache every ``every_s`` while the body runs."""
    folder = cache_dir / f"models--{model.replace('/', '--')}"
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(every_s):
            log(f"{_folder_bytes(folder) / 2**30:.2f} GiB of {model} on disk so far")

    thread = threading.Thread(target=report, name="model-download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file renamed or removed meanwhile
                total += (Path(root) / name).lstat().st_size
    return total


# --- the command ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m coserve.model_cache",
        description="Download a model into a shared Hugging Face hub cache once, however many pods start at once.",
    )
    parser.add_argument("--model", required=True, help="the Hugging Face model id, for example Qwen/Qwen3-8B")
    parser.add_argument("--cache-dir", required=True, type=Path, help="the hub cache (the engines' HF_HUB_CACHE)")
    return parser


def main(argv: Sequence[str] | None = None, download: Downloader | None = None) -> int:
    """Run the command; 0 when the model is in the cache, 2 with a one-line reason on stderr when not."""
    args = _parser().parse_args(argv)
    # NOTE: progress bars redraw with carriage returns, which a pod's log keeps as one long line per update;
    # the periodic "GiB on disk" line replaces them (an env var of the user's still wins).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        fill_cache(args.model, args.cache_dir, download or hub_download)
    except ModelCacheError as error:
        _stderr(str(error))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
