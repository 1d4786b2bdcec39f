"""`coserve up` sizes each local decoder's host KV pool to this machine: a manifest written for a GPU node's host
memory (examples/pool-long-lived.yaml asks 64 GiB) must not stop the engines from starting."""

from __future__ import annotations

import os

import pytest

from coserve import local


def free_pages(pages: int) -> object:
    def sysconf(name: str) -> int:
        return {"SC_AVPHYS_PAGES": pages, "SC_PAGE_SIZE": 4096}[name]

    return sysconf


def test_a_pool_larger_than_this_machine_takes_its_share_of_the_free_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "sysconf", free_pages(8 * 2**30 // 4096))  # 8 GiB free
    assert local._host_pool_here(64 * 2**30, 2) == 2**30  # a quarter, shared by two decoders
    assert "64 GiB per decoder; on this machine each gets 1 GiB" in capsys.readouterr().err


def test_a_pool_that_fits_is_the_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sysconf", free_pages(8 * 2**30 // 4096))
    assert local._host_pool_here(2**28, 2) == 2**28
