"""Tests of coserve.model_cache: the model-download init container that fills a shared cache once.

The Hugging Face Hub cannot be reached from these machines, so the locking and the
completion marker are tested with an injected downloader that writes files (a test
double standing in for ``huggingface_hub.snapshot_download``); the real Hub path is
exercised only offline (``HF_HUB_OFFLINE=1``), where it must fail with a clear message.
Concurrent pods are separate processes on one directory, as pods are on one volume.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coserve.model_cache import (
    ModelCacheError,
    fill_cache,
    lock_path,
    main,
    marker_path,
)

MODEL = "Qwen/Qwen3-8B"
FORK = multiprocessing.get_context("fork")


def writing_downloader(count_file: Path, delay_s: float = 0.0, started: object = None) -> Callable[[str, Path], None]:
    """A downloader that records each call in ``count_file`` (one line per download) and writes a weight file."""

    def download(model: str, cache_dir: Path) -> None:
        with count_file.open("a") as counter:
            counter.write(f"{os.getpid()}\n")
        if started is not None:
            started.set()  # type: ignore[attr-defined]
        time.sleep(delay_s)
        folder = cache_dir / f"models--{model.replace('/', '--')}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights")

    return download


def downloads(count_file: Path) -> int:
    return len(count_file.read_text().splitlines()) if count_file.exists() else 0


def fill_in_process(cache_dir: Path, count_file: Path, log_file: Path, delay_s: float, started: object) -> None:
    """One pod's init container: exit 0 when the model is in the cache, as ``main`` does."""

    def log(message: str) -> None:
        with log_file.open("a") as out:
            out.write(message + "\n")

    fill_cache(MODEL, cache_dir, writing_downloader(count_file, delay_s, started), log)


def test_the_first_call_downloads_and_writes_the_marker(tmp_path: Path) -> None:
    count_file = tmp_path / "count"
    messages: list[str] = []

    assert fill_cache(MODEL, tmp_path / "hub", writing_downloader(count_file), messages.append) is True

    assert downloads(count_file) == 1
    record = json.loads(marker_path(tmp_path / "hub", MODEL).read_text())
    assert record["model"] == MODEL and record["completedAt"].endswith("Z")
    assert messages[0] == f"downloading {MODEL} into {tmp_path / 'hub'}"
    assert messages[-1].startswith(f"downloaded {MODEL} in ")


def test_a_marker_skips_the_download_without_locking(tmp_path: Path) -> None:
    cache_dir = tmp_path / "hub"
    fill_cache(MODEL, cache_dir, writing_downloader(tmp_path / "count"), lambda _: None)
    lock_path(cache_dir, MODEL).unlink()  # a pod that finds the marker does not even open the lock
    messages: list[str] = []

    assert fill_cache(MODEL, cache_dir, writing_downloader(tmp_path / "count"), messages.append) is False

    assert downloads(tmp_path / "count") == 1
    assert messages == [f"{MODEL} is already in {cache_dir}"]
    assert not lock_path(cache_dir, MODEL).exists()


def test_two_concurrent_pods_download_once(tmp_path: Path) -> None:
    """The second pod starts while the first downloads: it waits on the lock, then finds the marker."""
    cache_dir, count_file = tmp_path / "hub", tmp_path / "count"
    started = FORK.Event()
    first = FORK.Process(target=fill_in_process, args=(cache_dir, count_file, tmp_path / "first.log", 1.0, started))
    first.start()
    assert started.wait(timeout=30), "the first pod never started downloading"
    second = FORK.Process(target=fill_in_process, args=(cache_dir, count_file, tmp_path / "second.log", 0.0, None))
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)

    assert (first.exitcode, second.exitcode) == (0, 0)
    assert downloads(count_file) == 1
    second_log = (tmp_path / "second.log").read_text().splitlines()
    assert second_log[0] == f"another pod is downloading {MODEL}; waiting for it"
    assert second_log[-1] == f"{MODEL} was put into {cache_dir} by another pod"
    assert marker_path(cache_dir, MODEL).exists()


def test_many_pods_starting_together_download_once(tmp_path: Path) -> None:
    cache_dir, count_file = tmp_path / "hub", tmp_path / "count"
    pods = [
        FORK.Process(target=fill_in_process, args=(cache_dir, count_file, tmp_path / f"{i}.log", 0.2, None))
        for i in range(6)
    ]
    for pod in pods:
        pod.start()
    for pod in pods:
        pod.join(timeout=60)

    assert [pod.exitcode for pod in pods] == [0] * 6
    assert downloads(count_file) == 1


def test_a_failed_download_leaves_no_marker_and_exits_2_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(model: str, cache_dir: Path) -> None:
        raise RuntimeError("401 Client Error: gated repo\n  (request id abc)")

    code = main(["--model", MODEL, "--cache-dir", str(tmp_path / "hub")], download=failing)

    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[-1] == (
        f"model-download: could not download {MODEL}: RuntimeError: 401 Client Error: gated repo (request id abc)"
    )
    assert "Traceback" not in err
    assert not marker_path(tmp_path / "hub", MODEL).exists()
    # the lock went with the failed pod: the next one downloads
    assert (
        main(["--model", MODEL, "--cache-dir", str(tmp_path / "hub")], download=writing_downloader(tmp_path / "n")) == 0
    )
    assert downloads(tmp_path / "n") == 1


def test_an_unwritable_cache_is_a_reason_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")

    code = main(["--model", MODEL, "--cache-dir", str(not_a_dir / "hub")], download=writing_downloader(tmp_path / "c"))

    assert code == 2
    assert f"model-download: cannot write to the cache {not_a_dir / 'hub'}: " in capsys.readouterr().err
    assert downloads(tmp_path / "c") == 0


def test_a_file_system_without_flock_is_a_reason_not_a_soft_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where flock fails (ENOSYS: the file system has no locks), the command stops: no soft-lock fallback,
    no download. ``fcntl.flock`` is replaced because no file system here lacks locks."""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    cache_dir = tmp_path / "hub"

    code = main(["--model", MODEL, "--cache-dir", str(cache_dir)], download=writing_downloader(tmp_path / "c"))

    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"model-download: cannot lock {lock_path(cache_dir, MODEL)}: {os.strerror(errno.ENOSYS)}"
        " (the cache's file system must support file locks)"
    )
    assert downloads(tmp_path / "c") == 0
    assert not marker_path(cache_dir, MODEL).exists()


def test_the_real_hub_path_offline_fails_with_a_reason(tmp_path: Path) -> None:
    """Through the console process, with huggingface_hub itself: offline and uncached, it must say so and exit 2."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_TOKEN", None)

    proc = subprocess.run(
        [sys.executable, "-m", "coserve.model_cache", "--model", "coserve-test/absent", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )

    assert proc.returncode == 2, proc.stderr
    assert "model-download: could not download coserve-test/absent: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker_path(tmp_path, "coserve-test/absent").exists()


@pytest.mark.parametrize(
    ("model", "readable"),
    [
        ("Qwen/Qwen3-8B", "Qwen--Qwen3-8B-"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama--Llama-3.1-8B-Instruct-"),
        ("../../etc/passwd", "etc--passwd-"),
        ("gpt2", "gpt2-"),
    ],
)
def test_marker_names_are_readable_unique_and_stay_in_the_state_folder(
    tmp_path: Path, model: str, readable: str
) -> None:
    marker = marker_path(tmp_path, model)

    assert marker.parent == tmp_path / ".coserve"
    assert marker.name.startswith(readable) and marker.name.endswith(".complete")
    assert marker_path(tmp_path, model + "x") != marker
    assert lock_path(tmp_path, model).with_suffix(".complete") == marker


def test_a_downloader_may_raise_its_own_reason(tmp_path: Path) -> None:
    def refusing(model: str, cache_dir: Path) -> None:
        raise ModelCacheError("huggingface_hub is not installed in this image")

    with pytest.raises(ModelCacheError, match=r"^huggingface_hub is not installed in this image$"):
        fill_cache(MODEL, tmp_path, refusing, lambda _: None)
