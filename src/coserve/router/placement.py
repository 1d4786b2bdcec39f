"""Where a request goes: its conversation's pin, found or made, the decoder and the prefiller it uses.

Who calls it: ``coserve.router.app.Router.handle`` once per admitted request (``route``),
``coserve.router.offline`` for batch lines that take the online placement (``route``, ``forward_failed``),
and the router's poller after each refresh (``expire``). The choices themselves are
``coserve.router.policy``'s (``PinTable``, ``choose_decoder``, ``choose_prefill_site``); the requests are
``coserve.router.upstream``'s.

A request's path (``placement: conversation``, the default):

1. its conversation is pinned to a decoder already in this replica's pin table, or, when this replica holds
   no pin and the request may continue an earlier turn, it is found by asking the decoders which holds it
   (``find_pin``): every decoder records the conversations the router sends it, so a turn lands on its
   decoder whatever router replica it reaches and however many replicas restarted;
2. otherwise it is placed now (turn 1, or a re-placement when the pinned decoder is gone): it is pinned to
   the decoder with the lowest KV occupancy, and prefilled where its first token comes soonest
   (``choose_prefill_site``): on a prefiller, so the decoder loads its KV instead of computing it, or on
   the decoder itself (``prefillSite: prefiller`` keeps it off the decoder while a prefiller is up);
3. it is forwarded to its decoder. A decoder that fails before anything was sent to the client has the
   request retried once on another decoder, re-placing and re-pinning that conversation alone. The failure
   is counted; a decoder is down and its conversations lose their pins only after ``pinDropFailures``
   failures in a row within ``pinDropWindowS`` (an answered request resets the count).

``placement: turn`` places every turn as a new conversation; ``placement: request`` pins nothing and sends
each request to the least-occupied decoder (the baselines).

Counted once across replicas: a conversation is new (``conversations_total``, its turn-1 prompt in
``conversation_input_tokens``) only on the replica that placed it, and only that replica reports its
lifetime (W) when it ends (``expire``), after asking the decoder when the conversation was last served by any
replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from coserve.router.admission import error_response
from coserve.router.config import RouterConfig
from coserve.router.engines import Engines
from coserve.router.metrics import RouterMetrics
from coserve.router.policy import (
    PROMPT_PREFIX_CHARS,
    PROMPT_PREFIX_TOKENS,
    EngineLoad,
    Pin,
    PinTable,
    choose_decoder,
    choose_prefill_site,
    first_token_s,
)
from coserve.router.upstream import Unavailable, Upstream

logger = logging.getLogger("coserve.router")


@dataclass
class Placed:
    """A placed request: the decoder it goes to, the body to send (with the prefiller's transfer parameters
    when turn 1 was prefilled there), the prompt tokens the decoder computes, and its conversation's pin
    (``None`` under ``placement: request``)."""

    decoder: EngineLoad
    body: dict[str, Any]
    computes: int
    pin: Pin | None


def endpoint_path(endpoint: str) -> str:
    """The engines' path for an endpoint (``chat`` or ``completions``)."""
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


class Placement:
    """Pins conversations to decoders and sends each request where its conversation lives."""

    def __init__(
        self, config: RouterConfig, engines: Engines, upstream: Upstream, pins: PinTable, metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.config = config
        self.engines = engines
        self.upstream = upstream
        self.pins = pins
        self.metrics = metrics
        self.clock = clock
        # the tightest TPOT objective of any class: a local prefill must keep every stream within it
        self._tightest_tpot_s = min(config.classes.get(name).tpot_slo_s for name in config.classes.names)

    async def route(
        self, endpoint: str, body: dict[str, Any], conversation: str, cls: str, slo_s: float, arrived: float,
        named: bool = False,
    ) -> Response:  # fmt: skip
        """The decoder's answer to an admitted request, placed as the module says; 502/503 when none answers."""
        path = endpoint_path(endpoint)
        if self.config.placement == "request":
            return await self._route_request(path, body, cls, slo_s, arrived)
        conversation, pin = await self.known_pin(endpoint, body, conversation, named)
        tried: set[str] = set()
        for attempt in range(2):
            placed = await self.place_on(path, body, conversation, pin, slo_s, tried, first=attempt == 0)
            if not isinstance(placed, Placed):
                return placed
            pin = placed.pin
            first_arrival = pin.first_arrival_s if pin is not None else arrived
            try:
                return await self.upstream.forward(
                    placed.decoder, path, placed.body, cls, slo_s, arrived, first_arrival, conversation,
                    placed.computes,
                )  # fmt: skip
            except Unavailable as failure:
                tried.add(placed.decoder.url)
                self.forward_failed(placed.decoder, failure, conversation)
        return error_response(502, "the decoders failed to answer; the request was tried twice")

    async def known_pin(
        self, endpoint: str, body: Mapping[str, Any], conversation: str, named: bool
    ) -> tuple[str, Pin | None]:
        """The conversation's name as placed (``placement: turn`` makes each turn a new one) and its pin, from
        this replica's table or, for a request that may continue an earlier turn, from the decoders."""
        now = self.clock()
        if self.config.placement == "turn":
            conversation = f"{conversation}/{uuid.uuid4().hex}"  # every turn a new conversation
        pin = self.pins.get(conversation, now)
        continued = is_continuation(endpoint, body, named)
        if pin is None and self.config.placement == "conversation" and continued is not False:
            pin = await self.find_pin(conversation, now)
        return conversation, pin

    async def place_on(
        self, path: str, body: dict[str, Any], conversation: str, pin: Pin | None, slo_s: float,
        tried: set[str] | frozenset[str] = frozenset(), first: bool = True,
    ) -> Placed | Response:  # fmt: skip
        """Where a pinned request goes: its pin's decoder while that is up (and not in ``tried``); otherwise a
        new placement, prefilled where its first token comes soonest and pinned. A 503 when no decoder can
        take it. Who calls it: ``route`` (then forwards), and ``coserve.epp`` (Envoy forwards)."""
        now = self.clock()
        decoder = self.engines.decoders.get(pin.decoder) if pin is not None else None
        if decoder is None or not decoder.healthy or decoder.url in tried:
            new = pin is None and first  # no pin here, and no decoder holds it
            if new:
                self.metrics.conversations.inc()
            else:  # its decoder is gone
                self.metrics.replacements.inc()
            candidates = [d for d in self.engines.decoders.values() if d.url not in tried]
            decoder = choose_decoder(candidates, self.config.decoder_full, self._first_tokens(candidates, body))
            if decoder is None:
                return error_response(
                    503, "no decoder can take a new conversation now (all full or down); retry shortly"
                )
            body, computes = await self._prefill(path, body, slo_s, decoder, count_input=new)
            pin = self.pins.pin(conversation, decoder.url, now)
        else:
            self.metrics.turns.inc()
            computes = 0  # its earlier turns' KV is there: what it appends is not counted
        assert pin is not None  # noqa: S101 - set on both branches above (for the type checker)
        pin.turns += 1
        decoder.admitted_tokens += estimate_tokens(body)
        return Placed(decoder, body, computes, pin)

    def least_occupied(
        self, body: Mapping[str, Any], excluded: set[str] | frozenset[str] = frozenset()
    ) -> Placed | Response:
        """``placement: request`` for one request whose proxy forwards it (``coserve.epp``): the least-occupied
        decoder (not in ``excluded``) computes what it lacks; nothing is pinned."""
        candidates = [d for d in self.engines.decoders.values() if d.url not in excluded]
        decoder = choose_decoder(candidates, self.config.decoder_full)
        if decoder is None:
            return error_response(503, "no decoder can take the request now (all full or down); retry shortly")
        tokens = estimate_tokens(body)
        decoder.admitted_tokens += tokens
        return Placed(decoder, dict(body), tokens, None)

    async def _route_request(self, path: str, body: dict[str, Any], cls: str, slo_s: float, arrived: float) -> Response:
        """The per-request baseline: the least-occupied decoder computes what it lacks; nothing is pinned."""
        tried: set[str] = set()
        for _ in range(2):
            decoder = choose_decoder(
                [d for d in self.engines.decoders.values() if d.url not in tried], self.config.decoder_full
            )
            if decoder is None:
                break
            tokens = estimate_tokens(body)
            decoder.admitted_tokens += tokens
            try:
                return await self.upstream.forward(decoder, path, body, cls, slo_s, arrived, arrived, None, tokens)
            except Unavailable as failure:
                tried.add(decoder.url)
                self.forward_failed(decoder, failure)
        return error_response(503, "no decoder can take the request now (all full or down); retry shortly")

    def forward_failed(self, decoder: EngineLoad, failure: Unavailable, conversation: str | None = None) -> None:
        """A request failed on ``decoder`` before anything reached the client: counted; the decoder is down and
        its conversations lose their pins only once that confirms it lost (``pinDropFailures`` in a row
        within ``pinDropWindowS``). The caller retries the request elsewhere (and re-pins its conversation)."""
        config = self.config
        if decoder.forward_failed(self.clock(), config.pin_drop_failures, config.pin_drop_window_s):
            dropped = self.pins.drop_decoder(decoder.url)
            logger.warning(
                "decoder %s failed %d requests in a row within %g s (last: %s): down, %d conversations lose "
                "their pins", decoder.url, config.pin_drop_failures, config.pin_drop_window_s, failure, dropped,
            )  # fmt: skip
        elif conversation is not None:
            logger.warning("decoder %s failed (%s): re-placing conversation %s", decoder.url, failure, conversation)
        else:
            logger.warning("decoder %s failed (%s): retrying the request elsewhere", decoder.url, failure)

    async def _prefill(
        self, path: str, body: dict[str, Any], slo_s: float, decoder: EngineLoad, count_input: bool = True
    ) -> tuple[dict[str, Any], int]:
        """Turn 1 where it starts soonest (``choose_prefill_site``): on a prefiller, whose KV then goes to
        ``decoder`` (handoff), or on ``decoder`` itself; a failed prefill leaves it to the decoder too. Returns
        the body to forward and the prompt tokens the decoder computes. Either way a new conversation's L_in
        is observed (the prefiller's own count when it answered)."""
        tokens = estimate_tokens(body)
        config = self.config
        site = choose_prefill_site(
            list(self.engines.prefillers.values()), decoder, tokens, slo_s, config.prefill_latency,
            transfer_s_per_token=config.kv_transfer_s_per_token, tpot_slo_s=self._tightest_tpot_s,
            mean_prompt_tokens=self._mean_prompt(), local=config.prefill_site == "fastest",
        )  # fmt: skip
        prefiller = site.prefiller
        self.metrics.prefill_site.labels("decoder" if prefiller is None else "prefiller", site.reason).inc()
        if prefiller is None:
            if count_input:
                self.metrics.input_tokens.observe(tokens)
            return body, tokens
        answer = await self.upstream.prefill(prefiller, path, body, tokens)
        usage = answer.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        tokens = counted if isinstance(counted, int) else tokens
        if count_input:
            self.metrics.input_tokens.observe(tokens)
        if answer:
            self.metrics.prefill_tokens.labels(prefiller.url).inc(tokens)
        params = answer.get("kv_transfer_params")
        return ({**body, "kv_transfer_params": params}, 0) if params else (body, 0 if answer else tokens)

    def _first_tokens(self, decoders: Sequence[EngineLoad], body: Mapping[str, Any]) -> dict[str, float] | None:
        """Each decoder's estimated seconds to ``body``'s first token were it prefilled there (``first_token_s``
        on the pool's prefill curve); ``None`` without a curve."""
        curve = self.config.prefill_latency
        if curve is None:
            return None
        tokens, mean = estimate_tokens(body), self._mean_prompt()
        return {d.url: first_token_s(d, tokens, curve, mean_prompt_tokens=mean) for d in decoders}

    def _mean_prompt(self) -> float | None:
        """The mean prompt the router sent to any engine (for engines it sent nothing yet)."""
        engines = [*self.engines.prefillers.values(), *self.engines.decoders.values()]
        sent = sum(e.sent_requests for e in engines)
        return sum(e.sent_prompt_tokens for e in engines) / sent if sent else None

    # -- pins other replicas made ------------------------------------------------------------------

    async def find_pin(self, conversation: str, now: float) -> Pin | None:
        """The decoder another replica (or this one, before a restart) placed ``conversation`` on, if any
        decoder holds it: the one that served it last."""
        decoders = [d for d in self.engines.decoders.values() if d.healthy]
        answers = await asyncio.gather(*(self.upstream.lookup(d, [conversation]) for d in decoders))
        best: tuple[float, EngineLoad, dict[str, float]] | None = None
        for decoder, found in zip(decoders, answers, strict=True):
            seen = found.get(conversation)
            if isinstance(seen, dict) and float(seen.get("idle_s", 1e18)) <= self.config.pin_ttl_s:
                idle = float(seen["idle_s"])
                if best is None or idle < best[0]:
                    best = (idle, decoder, seen)
        if best is None:
            return None
        self.metrics.found.inc()
        first = now - float(best[2].get("age_s", 0.0))
        return self.pins.pin(conversation, best[1].url, now, first_arrival_s=first, owned=False)

    async def expire(self) -> None:
        """Drop the pins idle past ``pinTtlS``; the ones this replica placed report their lifetime (W) once the
        decoder confirms the conversation is over; one still served through other replicas is kept."""
        now = self.clock()
        names, ended = self.pins.expire_named(now)
        if not ended:
            return
        by_decoder: dict[str, list[tuple[str, Pin]]] = {}  # decoder url -> (conversation, its expired pin)
        for name, pin in zip(names, ended, strict=True):
            if pin.owned:
                by_decoder.setdefault(pin.decoder, []).append((name, pin))
        for url, pins in by_decoder.items():
            decoder = self.engines.decoders.get(url)
            found = await self.upstream.lookup(decoder, [n for n, _ in pins]) if decoder is not None else {}
            for name, pin in pins:
                seen = found.get(name)
                idle = float(seen["idle_s"]) if isinstance(seen, dict) and "idle_s" in seen else None
                if idle is not None and idle <= self.config.pin_ttl_s:
                    kept = self.pins.pin(name, url, now - idle)  # still live elsewhere: keep owning it
                    kept.first_arrival_s, kept.turns = pin.first_arrival_s, pin.turns
                    continue
                last = pin.last_used_s if idle is None else max(pin.last_used_s, now - idle)
                self.metrics.lifetime.observe(max(0.0, last - pin.first_arrival_s))


def is_continuation(endpoint: str, body: Mapping[str, Any], named: bool) -> bool | None:
    """Whether a request carries earlier turns: True for chat with an assistant or tool message; False for
    chat without one (turn 1) and for a completion whose prompt is too short for a stable name (no earlier
    turn can share it); None (ask the decoders) for other completions and any explicitly named one."""
    if endpoint == "chat":
        messages = body.get("messages") or ()
        return any(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in messages)
    if named:
        return None
    prompt = body.get("prompt")
    short = (isinstance(prompt, str) and len(prompt) <= PROMPT_PREFIX_CHARS) or (
        isinstance(prompt, list) and len(prompt) <= PROMPT_PREFIX_TOKENS
    )
    return False if short else None


def estimate_tokens(body: Mapping[str, Any]) -> int:
    """A cheap size estimate for the admitted-token accounting (4 characters a token)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt) // 4
    return sum(len(str(m.get("content", ""))) for m in body.get("messages") or [] if isinstance(m, dict)) // 4
