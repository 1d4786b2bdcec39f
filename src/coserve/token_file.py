"""The pool's router token, as its mounted Secret file holds it now: re-read when the file changes.

Who calls it: ``coserve.engine.validation.RequestClassValidator`` (engines check the token on every
request) and ``coserve.router.upstream.Upstream`` (the router sends it). The operator keeps the Secret's
``token`` key (it regenerates an emptied or missing one); the kubelet updates a mounted Secret in place,
swapping the file behind a symlink. A file that is re-read only at start-up would leave every running
pod on the old token: routers silently demoted, their conversation lookups refused.

So the file is looked at again at most every ``check_every_s`` (one ``stat``), read when it changed,
and the token it held before stays accepted for ``grace_s`` more: requests a router signed with the old
token, and routers whose kubelet refreshes the file a little later than the engine's, keep working
through a rotation. A file that becomes empty or unreadable keeps the last good token (trusting every
request because a Secret was emptied would silently open what the token closes). Stdlib only.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable

__all__ = ["TokenFile"]

logger = logging.getLogger("coserve.token")


class TokenFile:
    """The token in ``path``; ``ValueError`` at construction when the file is unreadable or empty."""

    def __init__(
        self,
        path: str,
        *,
        variable: str = "COSERVE_ROUTER_TOKEN_FILE",
        grace_s: float = 120.0,
        check_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._variable = variable
        self._grace_s = grace_s
        self._check_every_s = check_every_s
        self._clock = clock
        self._signature = self._stat()
        token = self._read()
        if token is None:
            raise ValueError(f"{variable}: {path} is empty or unreadable")
        self._token = token
        self._previous: bytes | None = None
        self._previous_until = 0.0
        self._checked = clock()

    def current(self) -> bytes:
        """The token to send: the file's, re-read when it changed since the last look."""
        now = self._clock()
        if now - self._checked >= self._check_every_s:
            self._checked = now
            signature = self._stat()
            if signature != self._signature:
                self._signature = signature
                token = self._read()
                if token is None:
                    logger.warning(
                        "%s: %s is empty or unreadable now; keeping the last token", self._variable, self.path
                    )
                elif token != self._token:
                    logger.info("%s: the router token changed; the old one is accepted %.0f s more", self._variable,
                                self._grace_s)  # fmt: skip
                    self._previous, self._previous_until = self._token, now + self._grace_s
                    self._token = token
        return self._token

    def accepts(self, value: bytes) -> bool:
        """Whether ``value`` is the token, or the one before it within its grace (constant-time compares)."""
        token = self.current()
        ok = hmac.compare_digest(value, token)
        previous = self._previous
        if previous is not None and self._clock() < self._previous_until:
            ok = hmac.compare_digest(value, previous) or ok
        return ok

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            info = os.stat(self.path)  # follows the kubelet's ..data symlink
        except OSError:
            return None
        return (info.st_ino, info.st_mtime_ns, info.st_size)

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as handle:
                token = handle.read().strip()
        except OSError:
            return None
        return token or None
