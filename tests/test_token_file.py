"""The router token's file: re-read when the kubelet updates the mounted Secret, the old token kept a grace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coserve.token_file import TokenFile


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rotate(path: Path, token: bytes) -> None:
    """As the kubelet updates a mounted Secret: a new file swapped in (a new inode), not written in place."""
    fresh = path.with_suffix(".new")
    fresh.write_bytes(token + b"\n")
    os.replace(fresh, path)


def test_a_rotated_token_is_picked_up_and_the_old_one_accepted_for_its_grace(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"old-token\n")
    clock = Clock()
    token = TokenFile(str(path), grace_s=60, check_every_s=1, clock=clock)
    assert token.current() == b"old-token" and token.accepts(b"old-token") and not token.accepts(b"new-token")
    rotate(path, b"new-token")
    clock.now = 0.5
    assert token.current() == b"old-token"  # looked at again at most once a second
    clock.now = 1.0
    assert token.current() == b"new-token"
    assert token.accepts(b"new-token") and token.accepts(b"old-token")  # in flight during the rotation
    clock.now = 61.5
    assert token.accepts(b"new-token") and not token.accepts(b"old-token")


def test_an_emptied_file_keeps_the_last_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"good")
    clock = Clock()
    token = TokenFile(str(path), check_every_s=1, clock=clock)
    rotate(path, b"")
    clock.now = 2.0
    assert token.current() == b"good" and token.accepts(b"good") and not token.accepts(b"")
    path.unlink()
    clock.now = 4.0
    assert token.current() == b"good"


@pytest.mark.parametrize("content", [None, b"", b"  \n"])
def test_an_unreadable_or_empty_file_is_refused_at_start(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"COSERVE_ROUTER_TOKEN_FILE: .* is empty or unreadable"):
        TokenFile(str(path))
