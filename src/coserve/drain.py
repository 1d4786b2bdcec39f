"""Graceful drain of an engine pod: the preStop hook of every prefiller and decoder.

Who calls it: the kubelet, as the engine container's preStop hook, with the command
``coserve.operator.resources`` renders (``python3 -m coserve.drain --port 8000
--quiet-s 15 --timeout-s <spec.engine.drainTimeoutS>``); tests launch the same command.

What happens when Kubernetes deletes an engine pod (a scale-down, a rollout, a node drain):

1. the pod is marked terminating and leaves its role's headless Service at once;
   every router replica re-resolves the Service each ``pollS``, so from then on it
   places no new conversation on this engine, and a conversation pinned here is
   re-placed at its next turn (prefilled again, its KV handed to another decoder);
2. meanwhile this hook runs, before the container gets SIGTERM: it waits until the
   engine has had no running and no waiting request for ``quiet-s`` seconds in a
   row (long enough for every router replica to have seen the Service change:
   DNS TTL plus one poll), so every request already sent here is answered in full;
3. it returns, and the kubelet stops vLLM. ``timeout-s`` bounds the wait; the pod's
   ``terminationGracePeriodSeconds`` is sized above it, so the bound is the hook's,
   not a kill in the middle of a stream.

An engine that answers slowly is busy, not gone: a reading waits for the answer
as long as the drain may still last, and an answer that is an HTTP error, a
reset or garbled counts as "alive, count unknown" (the drain keeps waiting).
Only an engine that is gone (the connection refused: nothing listens on its
port any more) ends the wait early, after ``quiet-s`` of such readings; the
bound ends it otherwise.

The decision (``DrainWatch``) is pure; ``main`` only reads vLLM's own ``/metrics``
(``vllm:num_requests_running`` and ``vllm:num_requests_waiting``) on loopback. The
hook always exits 0: the kubelet only records a failing hook, and stopping is what
comes next either way; what happened is on stderr, which the kubelet keeps in the
pod's events when the hook fails, and in the container log here.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BUSY_METRICS", "BUSY_UNKNOWN", "DrainWatch", "Verdict", "busy_requests", "main"]

BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# A reading of an engine that is alive but gave no count (too slow for the drain's bound, an HTTP error, a reset
# connection, a page that does not parse): busy for the drain, which keeps waiting.
BUSY_UNKNOWN = -1
# What a refused or unroutable connection says: nothing listens there any more, the engine is gone.
_GONE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL})


@dataclass(frozen=True)
class Verdict:
    """Why the drain ended: ``idle`` (nothing ran for ``quiet_s``), ``timeout`` or ``unreachable``."""

    reason: str
    waited_s: float


class DrainWatch:
    """Decides when a leaving engine may stop, from successive readings of its busy-request count.

    ``observe(now, busy)`` is called once per reading: ``busy`` is running + waiting
    requests, ``BUSY_UNKNOWN`` when the engine answered without a count (alive:
    busy), or ``None`` when it is gone (its connection refused). It returns a
    ``Verdict`` once the engine has been idle (or gone: nothing left to wait for)
    for ``quiet_s`` in a row, or when ``timeout_s`` has passed since ``started``.
    """

    def __init__(self, quiet_s: float, timeout_s: float, started: float) -> None:
        if quiet_s < 0 or timeout_s < 0:
            raise ValueError("quiet_s and timeout_s must be non-negative")
        self.quiet_s = quiet_s
        self.timeout_s = timeout_s
        self.started = started
        self._state: str | None = None  # "idle" or "unreachable" since self._since
        self._since = started

    def observe(self, now: float, busy: int | None) -> Verdict | None:
        state = "unreachable" if busy is None else ("idle" if busy == 0 else None)
        if state != self._state:
            self._state, self._since = state, now
        if state is not None and now - self._since >= self.quiet_s:
            return Verdict(state, now - self.started)
        if now - self.started >= self.timeout_s:
            return Verdict("timeout", now - self.started)
        return None


def busy_requests(metrics_text: str) -> int:
    """Running plus waiting requests in a vLLM ``/metrics`` page (every engine of a data-parallel server)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in BUSY_METRICS:
            total += sum(sample.value for sample in family.samples if sample.name == family.name)
    return round(total)


def _read_busy(url: str, timeout_s: float) -> int | None:
    """One reading (see ``DrainWatch.observe``): waits up to ``timeout_s`` for the engine's answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - the pod's own loopback
            return busy_requests(response.read().decode("utf-8"))
    except urllib.error.HTTPError:
        return BUSY_UNKNOWN  # it answered, with an error: alive
    except urllib.error.URLError as error:  # before an answer: gone only if nothing listens
        return None if _gone(error.reason) else BUSY_UNKNOWN
    except OSError as error:  # a timeout (slow, not dead), a reset mid-answer
        return None if _gone(error) else BUSY_UNKNOWN
    except ValueError:  # a page that does not parse: alive
        return BUSY_UNKNOWN


def _gone(reason: object) -> bool:
    """Whether a connection error says nothing listens at the engine's address any more."""
    if isinstance(reason, (ConnectionRefusedError, socket.gaierror)):
        return True
    return isinstance(reason, OSError) and not isinstance(reason, TimeoutError) and reason.errno in _GONE_ERRNOS


def drain(
    url: str,
    quiet_s: float,
    timeout_s: float,
    *,
    period_s: float = 1.0,
    read: Callable[[str, float], int | None] = _read_busy,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Verdict:
    """Poll ``url`` (an engine's ``/metrics``) every ``period_s`` until ``DrainWatch`` says stop; each reading
    may wait for the engine's answer as long as the drain may still last."""
    watch = DrainWatch(quiet_s, timeout_s, clock())
    log(f"coserve drain: waiting for {url} to stay idle for {quiet_s:g} s (at most {timeout_s:g} s)")
    last: int | None = -2
    while True:
        left = timeout_s - (clock() - watch.started)
        busy = read(url, max(left, 0.1))
        if busy != last:
            log(f"coserve drain: {_describe(busy)}")
            last = busy
        verdict = watch.observe(clock(), busy)
        if verdict is not None:
            log(f"coserve drain: done after {verdict.waited_s:.1f} s ({verdict.reason})")
            return verdict
        sleep(period_s)


def _describe(busy: int | None) -> str:
    if busy is None:
        return "engine unreachable (connection refused)"
    if busy == BUSY_UNKNOWN:
        return "engine alive, no count (slow, an error or a reset): waiting"
    return f"{busy} requests running or waiting"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m coserve.drain",
        description="Wait until the local vLLM engine has finished its requests (an engine pod's preStop hook).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the engine's address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="the engine's HTTP port (default: 8000)")
    parser.add_argument("--quiet-s", type=float, default=15.0, help="idle seconds in a row that end the drain")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the longest the drain waits")
    parser.add_argument("--period-s", type=float, default=1.0, help="seconds between readings")
    args = parser.parse_args(argv)
    if args.quiet_s < 0 or args.timeout_s < 0 or args.period_s <= 0:
        parser.error("--quiet-s and --timeout-s must be >= 0, --period-s > 0")
    host = f"[{args.host}]" if ":" in args.host else args.host
    drain(f"http://{host}:{args.port}/metrics", args.quiet_s, args.timeout_s, period_s=args.period_s)
    return 0


if __name__ == "__main__":  # pragma: no cover - the preStop hook's entry point
    sys.exit(main())
