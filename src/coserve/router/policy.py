"""The router's decisions, as plain data: which conversation a request belongs to, where it goes, at what class.

Who calls it: ``coserve.router.app`` once per request (``conversation_id``,
``resolve_class``, ``PinTable``, ``choose_decoder``) and the engine poller once
per poll (``EngineLoad``). Nothing here does I/O or reads a clock: ``now`` is
an argument, so every rule is tested table-driven.

Rules:

- A conversation is named by the ``X-Conversation-Id`` header, else the body's
  ``conversation_id`` field, else a hash of what every turn of it repeats: for
  chat, the model and every message up to and including the first user message;
  for completions, the model and the first ``PROMPT_PREFIX_CHARS`` characters
  of a text prompt (or ``PROMPT_PREFIX_TOKENS`` token ids).
- Turn 1 of a conversation is placed on the decoder with the lowest KV
  occupancy (the engine's ``vllm:kv_cache_usage_perc`` plus the tokens the
  router admitted since that reading) among those below ``full``; it stays
  pinned there. A pinned decoder that is gone or failed is replaced (the caller
  counts a re-placement); a live conversation is never moved otherwise.
- Pins expire after ``ttl_s`` idle and the table holds at most ``max_pins``
  (the least recently used goes first).
- Gain-oriented choice among instances (GoRouting's dual threshold): a
  candidate below ``light`` load is taken at once (the least loaded of them);
  when every candidate is above ``heavy``, the least loaded; in between, the
  busiest candidate that still meets the request's deadline, which keeps the
  lighter ones free for long or high-class work that arrives next. For
  prefillers, "meets the deadline" is ``prefill_deadlines``: the requests
  waiting there plus this one, each costed at this prompt's prefill latency,
  finish within the class's TTFT SLO.
- A request's class is the one it asks for (``vllm_xargs.coserve_class`` or
  ``priority``) capped at its tenant's class: no client raises its own priority.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coserve.scheduling.requests import ClassRegistry, RequestClass

__all__ = [
    "PROMPT_PREFIX_CHARS",
    "PROMPT_PREFIX_TOKENS",
    "EngineLoad",
    "PinTable",
    "choose_decoder",
    "choose_gain_oriented",
    "conversation_id",
    "prefill_deadlines",
    "resolve_class",
]

PROMPT_PREFIX_CHARS = 512
PROMPT_PREFIX_TOKENS = 128


def conversation_id(headers: Mapping[str, str], body: Mapping[str, object]) -> str:
    """The conversation's identity (see the module rules); ``headers`` keys are lower-case."""
    explicit = headers.get("x-conversation-id") or body.get("conversation_id")
    if isinstance(explicit, str) and explicit:
        return explicit
    model = body.get("model")
    messages = body.get("messages")
    if isinstance(messages, list):
        leading = []
        for message in messages:
            leading.append(message)
            if isinstance(message, Mapping) and message.get("role") == "user":
                break
        basis: object = ["chat", model, leading]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            basis = ["text", model, prompt[:PROMPT_PREFIX_CHARS]]
        elif isinstance(prompt, list):
            basis = ["tokens", model, prompt[:PROMPT_PREFIX_TOKENS]]
        else:
            basis = ["other", model, prompt]
    encoded = json.dumps(basis, sort_keys=True, separators=(",", ":"), default=str).encode()
    return "h-" + hashlib.blake2b(encoded, digest_size=12).hexdigest()


def resolve_class(
    classes: ClassRegistry, tenant_class: str | None, asked: str | None, priority: int | None
) -> RequestClass:
    """The class a request runs at: what it asks for, never above its tenant's (``ValueError``: unknown name)."""
    if asked is not None:
        wanted = classes.get(asked)
    elif priority:
        wanted = classes.by_priority(priority)
    else:
        wanted = classes.get(tenant_class) if tenant_class is not None else classes.default
    if tenant_class is None:
        return wanted
    cap = classes.get(tenant_class)
    return wanted if wanted.rank >= cap.rank else cap


@dataclass
class EngineLoad:
    """What the router knows of one engine's load."""

    url: str
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc at the last poll (0..1)
    kv_capacity_tokens: int = 0  # the engine's KV capacity, when known (0: unknown)
    admitted_tokens: int = 0  # tokens the router sent it since that poll
    waiting: int = 0  # vllm:num_requests_waiting at the last poll
    healthy: bool = True
    failures: int = 0  # consecutive failed polls

    def occupancy(self) -> float:
        extra = self.admitted_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
        return min(1.0, self.kv_usage + extra)

    def polled(self, kv_usage: float, waiting: int) -> None:
        self.kv_usage, self.waiting, self.admitted_tokens, self.healthy = kv_usage, waiting, 0, True
        self.failures = 0

    def failed(self, allowed: int) -> None:
        """A poll failed: the engine is down once ``allowed`` polls in a row have (one slow answer is not)."""
        self.failures += 1
        if self.failures >= allowed:
            self.healthy = False


def choose_decoder(decoders: Sequence[EngineLoad], full: float = 0.9) -> EngineLoad | None:
    """Turn 1's decoder: the lowest occupancy among healthy ones below ``full``; ``None``: every one is full."""
    open_ = [d for d in decoders if d.healthy and d.occupancy() < full]
    return min(open_, key=lambda d: (d.occupancy(), d.waiting, d.url)) if open_ else None


def choose_gain_oriented(
    candidates: Sequence[EngineLoad],
    meets_deadline: Mapping[str, bool],
    light: float = 0.5,
    heavy: float = 0.85,
) -> EngineLoad | None:
    """GoRouting's dual-threshold choice (module rules); ``meets_deadline`` by URL, missing means yes."""
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        return None
    lightly = [c for c in healthy if c.occupancy() < light]
    if lightly:
        return min(lightly, key=lambda c: (c.occupancy(), c.waiting, c.url))
    middle = [c for c in healthy if c.occupancy() < heavy and meets_deadline.get(c.url, True)]
    if middle:
        return max(middle, key=lambda c: (c.occupancy(), c.url))
    return min(healthy, key=lambda c: (c.occupancy(), c.waiting, c.url))


def prefill_deadlines(
    prefillers: Sequence[EngineLoad], prompt_tokens: int, ttft_slo_s: float,
    latency: tuple[float, float, float] | None,
) -> dict[str, bool]:  # fmt: skip
    """Whether each prefiller would finish this prompt within ``ttft_slo_s`` (module rules); ``latency`` is
    (constant s, s per token, s per token squared) of one prefill; ``None``: no estimate, every one meets it."""
    if latency is None:
        return {}
    constant, linear, quadratic = latency
    one = constant + linear * prompt_tokens + quadratic * prompt_tokens**2
    return {p.url: (p.waiting + 1) * one <= ttft_slo_s for p in prefillers}


@dataclass
class Pin:
    decoder: str
    last_used_s: float
    turns: int = 0
    first_arrival_s: float = 0.0
    # True on the replica that placed turn 1: it alone reports the conversation's lifetime (W) when it ends
    owned: bool = True


class PinTable:
    """Conversation -> decoder, with an idle TTL and a bound on entries (LRU).

    Every operation costs what it touches, never the table: entries are kept in last-use order, so expiry
    pops from the old end only the pins that expired, and per-decoder counts and members are kept as pins
    are added, moved, dropped and expired (``per_decoder`` is a copy of the counts, not a recount).
    """

    def __init__(self, ttl_s: float = 1800.0, max_pins: int = 100_000) -> None:
        if ttl_s <= 0 or max_pins <= 0:
            raise ValueError("pin TTL and table size must be positive")
        self.ttl_s = ttl_s
        self.max_pins = max_pins
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # least recently used first
        self._by_decoder: dict[str, set[str]] = {}
        self._ended: list[tuple[str, Pin]] = []  # expired on lookup, reported by the next expire()
        self.touched = 0  # entries examined by expire() and drop_decoder() (tests hold the cost to this)

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, conversation: str, now_s: float) -> Pin | None:
        pin = self._pins.get(conversation)
        if pin is None:
            return None
        if now_s - pin.last_used_s > self.ttl_s:
            self._ended.append((conversation, self._remove(conversation)))
            return None
        pin.last_used_s = now_s
        self._pins.move_to_end(conversation)
        return pin

    def pin(self, conversation: str, decoder: str, now_s: float, first_arrival_s: float | None = None,
            owned: bool = True) -> Pin:  # fmt: skip
        """Pin ``conversation`` to ``decoder`` (a new conversation, a re-placement, or one another replica
        placed: then ``owned`` is False and ``first_arrival_s`` is what the decoder says)."""
        old = self._pins.get(conversation)
        if old is not None:
            self._remove(conversation)
        first = old.first_arrival_s if old else (now_s if first_arrival_s is None else first_arrival_s)
        pin = Pin(decoder, now_s, old.turns if old else 0, first, old.owned if old else owned)
        self._pins[conversation] = pin
        self._by_decoder.setdefault(decoder, set()).add(conversation)
        while len(self._pins) > self.max_pins:
            self._remove(next(iter(self._pins)))
        return pin

    def drop_decoder(self, decoder: str) -> int:
        """A decoder left: forget its pins (their next turns are re-placed); how many."""
        gone = self._by_decoder.pop(decoder, set())
        self.touched += len(gone)
        for conversation in gone:
            del self._pins[conversation]
        return len(gone)

    def expire(self, now_s: float) -> list[Pin]:
        """Forget conversations idle for longer than the TTL (they ended); their pins."""
        return self.expire_named(now_s)[1]

    def expire_named(self, now_s: float) -> tuple[list[str], list[Pin]]:
        """``expire``, with the conversations' names beside their pins."""
        ended, self._ended = self._ended, []
        while self._pins:
            conversation, oldest = next(iter(self._pins.items()))
            self.touched += 1
            if now_s - oldest.last_used_s <= self.ttl_s:
                break
            ended.append((conversation, self._remove(conversation)))
        return [name for name, _ in ended], [pin for _, pin in ended]

    def per_decoder(self) -> dict[str, int]:
        return {decoder: len(members) for decoder, members in self._by_decoder.items() if members}

    def _remove(self, conversation: str) -> Pin:
        pin = self._pins.pop(conversation)
        members = self._by_decoder.get(pin.decoder)
        if members is not None:
            members.discard(conversation)
            if not members:
                del self._by_decoder[pin.decoder]
        return pin
