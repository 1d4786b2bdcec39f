"""Which conversations an engine holds: the source of truth every router replica asks.

A conversation's KV lives on the decoder that served its turns, so that decoder
is where the fact "conversation c is pinned here" belongs: it survives the death
or restart of any router replica, and it dies with the KV it describes. Who calls
it: ``coserve.engine.validation.RequestClassValidator``, in the engine's API
server, records the conversation of every request the pool's router sends
(``X-Coserve-Conversation``) and answers the routers' lookups
(``POST /coserve/v1/conversations:lookup``). Routers ask only for conversations
they hold no pin for; see ``coserve.router.placement``.

Plain data: ``now_s`` is an argument (a monotonic clock of the engine's own), and
answers give ages, so router and engine clocks never meet. Entries expire after
``ttl_s`` idle, lazily and from the oldest end (the cost of an expiry is the
entries that expire), and at most ``max_entries`` are kept (least recently used
first out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ConversationLog", "Seen"]


@dataclass
class Seen:
    """One conversation as this engine saw it (monotonic seconds)."""

    first_s: float
    last_s: float
    turns: int = 1


class ConversationLog:
    """Conversation id -> when this engine first and last served it; LRU with an idle TTL."""

    def __init__(self, ttl_s: float = 7200.0, max_entries: int = 200_000) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("conversation TTL and bound must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, Seen] = OrderedDict()  # least recently served first

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, conversation: str, now_s: float) -> None:
        """A turn of ``conversation`` reached this engine."""
        seen = self._seen.get(conversation)
        if seen is None:
            self._seen[conversation] = Seen(now_s, now_s)
        else:
            seen.last_s = now_s
            seen.turns += 1
            self._seen.move_to_end(conversation)
        self._expire(now_s)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def lookup(self, conversations: Iterable[str], now_s: float) -> dict[str, dict[str, float]]:
        """The ones this engine holds: ``{id: {"age_s", "idle_s", "turns"}}`` (absent: not held, or expired)."""
        self._expire(now_s)
        found: dict[str, dict[str, float]] = {}
        for conversation in conversations:
            seen = self._seen.get(conversation)
            if seen is not None:
                found[conversation] = {
                    "age_s": now_s - seen.first_s,
                    "idle_s": now_s - seen.last_s,
                    "turns": seen.turns,
                }
        return found

    def _expire(self, now_s: float) -> None:
        while self._seen:
            oldest = next(iter(self._seen.values()))
            if now_s - oldest.last_s <= self.ttl_s:
                return
            self._seen.popitem(last=False)
