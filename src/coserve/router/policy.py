"""The router's decisions, as plain data: which conversation a request belongs to, where it goes, at what class.

Who calls it: the router once per request (``coserve.router.admission``:
``conversation_id``, ``resolve_class``; ``coserve.router.placement``: ``PinTable``,
``choose_decoder``) and its engine poller once per poll (``coserve.router.engines``:
``EngineLoad``). Nothing here does I/O or reads a clock: ``now`` is
an argument, so every rule is tested table-driven.

Rules:

- A conversation is named by the ``X-Conversation-Id`` header, else the body's
  ``conversation_id`` field, else a hash of what every turn of it repeats: for
  chat, the model and every message up to and including the first user message;
  for completions, the model and the first ``PROMPT_PREFIX_CHARS`` characters
  of a text prompt (or ``PROMPT_PREFIX_TOKENS`` token ids).
- A client's id is canonical (``canonical_conversation_id``): at most
  ``MAX_CONVERSATION_ID_BYTES`` bytes of printable ASCII (no leading or trailing
  space) are kept as they are; any other id (longer, non-ASCII, control
  characters) becomes ``sha256:`` and the hex digest of its bytes (the header's
  bytes as received, the body string's UTF-8), so the same bytes name the same
  conversation in the header or the body, on every router replica and in the
  engine's ConversationLog (which reads the router's header as latin-1), and an
  id costs bounded memory. An empty or non-string id is ``InvalidConversationId``
  (a ``null`` body field is no id).
- Turn 1 of a conversation is placed on the decoder with the lowest KV
  occupancy (the engine's ``vllm:kv_cache_usage_perc`` plus the tokens the
  router admitted since that reading) among those below ``full``; it stays
  pinned there. A pinned decoder that is gone or failed is replaced (the caller
  counts a re-placement); a live conversation is never moved otherwise.
- A decoder is lost (down, its pins dropped) only when it is confirmed:
  ``EngineLoad.forward_failed`` says so after ``allowed`` forwarded requests
  failed in a row within ``window_s``; a forwarded request it answers resets
  the count. One failure moves only the conversation whose request failed.
- Pins expire after ``ttl_s`` idle and the table holds at most ``max_pins``
  (the least recently used goes first), whatever order the last uses are
  given in.
- Gain-oriented choice among instances (GoRouting, ``choose_for_request``):
  with the engines' prefill curve, the candidate that would give this request
  its first token soonest (``first_token_s``); one that meets the request's
  TTFT deadline is thereby always taken over one that misses it. (The dual
  threshold's middle band, the busiest candidate that still meets the
  deadline, packed engines to their slot and KV limits in the simulated pool
  and lost top-class attainment to round-robin wherever it engaged, and
  skipping candidates above ``heavy`` KV occupancy lost 5 points at 8 engines
  and 3x load; the dual threshold is kept for routers without a prefill curve:
  a candidate below ``light`` KV occupancy at once, the busiest below
  ``heavy`` that meets the deadline, else the least loaded.)
- The estimated first token counts all the work an engine has left before it
  (``first_token_s``), from the router's own ledger of
  what it sent there (``EngineLoad.sent`` / ``progressed`` / ``answered``):
  the prompt tokens not yet prefilled (this one's included, and the polled
  ``waiting`` requests beyond the ledger's, which other router replicas may
  have sent, at the mean prompt sent there), computed in steps of at most ``step_tokens``,
  each step costing the latency curve's constant, and the running requests'
  decode tokens, one per step per request for as many steps as the prefill
  takes and as each has tokens left, at the curve's cost per token.
- Turn 1 prefills where its first token comes soonest (``choose_prefill_site``):
  on a prefiller, whose KV then moves to the decoder once, or on the decoder
  that will hold the conversation, which computes it itself, as an aggregated
  engine under session affinity would. A local prefill is allowed only while
  the decoder's steps with a prefill chunk in them keep its streams within
  their TPOT objective, and while the request gains more than the decoder's
  streams lose together. Later turns stay on the pinned decoder.
- Offline batch lines go where the capacity is (``place_offline``): straight to
  the decoder with the lowest KV occupancy among those below ``spare`` (it
  prefills and decodes them), since decoders are the over-provisioned role and
  the prefiller the deliberate bottleneck; through a prefiller only when one is
  left idle (nothing waiting and nothing in flight from this router); nowhere
  while every decoder is at or above ``spare``.
- A request's class is the one it asks for (``vllm_xargs.coserve_class`` or
  ``priority``) capped at its tenant's class: no client raises its own priority.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coserve.scheduling.requests import ClassRegistry, RequestClass
from coserve.scheduling.steps import STEP_TOKENS, chunked_step_s

__all__ = [
    "CONVERSATION_ID_HEADER",
    "MAX_CONVERSATION_ID_BYTES",
    "PREFILL_REASONS",
    "PROMPT_PREFIX_CHARS",
    "PROMPT_PREFIX_TOKENS",
    "STEP_TOKENS",
    "EngineLoad",
    "InvalidConversationId",
    "OfflinePlacement",
    "PinTable",
    "PrefillSite",
    "canonical_conversation_id",
    "choose_decoder",
    "choose_for_request",
    "choose_gain_oriented",
    "choose_prefill_site",
    "conversation_id",
    "explicit_conversation_id",
    "first_token_s",
    "local_prefill_step_s",
    "place_offline",
    "prefill_deadlines",
    "resolve_class",
]

PROMPT_PREFIX_CHARS = 512
PROMPT_PREFIX_TOKENS = 128
CONVERSATION_ID_HEADER = "x-conversation-id"
MAX_CONVERSATION_ID_BYTES = 256
# printable ASCII, no leading or trailing space (HTTP strips those from a header value: the engine would
# record another id than the router looks up)
_KEPT_ID = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


class InvalidConversationId(ValueError):
    """A client's conversation id that names nothing: not a string, or empty; ``field`` is where it was."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def canonical_conversation_id(raw: bytes) -> str:
    """The id the router and the engines use for a client's id of ``raw`` bytes (module rules)."""
    if len(raw) <= MAX_CONVERSATION_ID_BYTES and _KEPT_ID.fullmatch(raw):
        return raw.decode("ascii")
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def explicit_conversation_id(headers: Mapping[str, str], body: Mapping[str, object]) -> str | None:
    """The client's own id, canonical; ``None`` when it names none; ``InvalidConversationId`` when the header
    or the body's ``conversation_id`` is empty or not a string. ``headers``: lower-case keys, values as
    ASGI servers decode them (latin-1, so each character is one byte as received)."""
    header = headers.get(CONVERSATION_ID_HEADER)
    if header is not None:
        if not header:
            raise InvalidConversationId(CONVERSATION_ID_HEADER, f"the {CONVERSATION_ID_HEADER} header is empty")
        try:
            raw = header.encode("latin-1")
        except UnicodeEncodeError:  # a caller's own str, not one read off the wire
            raw = header.encode("utf-8", "surrogatepass")
        return canonical_conversation_id(raw)
    value = body.get("conversation_id")
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidConversationId("conversation_id", f"conversation_id must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidConversationId("conversation_id", "conversation_id must not be empty")
    return canonical_conversation_id(value.encode("utf-8", "surrogatepass"))


# What a conversation's hash reads: json.dumps(basis, sort_keys=True, separators=(",", ":"), default=str).
# That call builds an encoder and its C encoder on every request; the C encoder, built once, writes the
# same text (``JSONEncoder.encode`` joins its chunks the same way), without the circular-reference check a
# value parsed from JSON never needs.
_ID_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)
_MAKE_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # None where CPython's _json is missing
_ID_C_ENCODER = (
    _MAKE_C_ENCODER(None, str, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True)
    if _MAKE_C_ENCODER is not None
    else None
)


def _id_text(basis: object) -> str:
    if _ID_C_ENCODER is None:
        return _ID_ENCODER.encode(basis)
    return "".join(_ID_C_ENCODER(basis, 0))


def conversation_id(headers: Mapping[str, str], body: Mapping[str, object]) -> str:
    """The conversation's identity (see the module rules); ``headers`` keys are lower-case; raises
    ``InvalidConversationId`` (see ``explicit_conversation_id``)."""
    explicit = explicit_conversation_id(headers, body)
    if explicit is not None:
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
    encoded = _id_text(basis).encode()
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


# decoders whose KV occupancy is within this of the lowest are equally occupied for a new conversation's placement
# (``choose_decoder``): then where its first token comes soonest decides
OCCUPANCY_TIE = 0.1


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
    # when each forwarded request failed, since the last one it answered (at most the ``allowed`` last)
    forward_failures: list[float] = field(default_factory=list)
    # the router's ledger of what it sent here and has not seen answered: request -> [prompt tokens not yet
    # prefilled, output tokens asked for, decode tokens still to come]; the sums below follow the entries
    in_flight: dict[str, list[int]] = field(default_factory=dict, repr=False)
    prefill_left_tokens: int = 0
    prefill_left_squares: int = 0  # the sum of the squares of the prompts not yet prefilled (the curve's c term)
    decode_left_tokens: int = 0  # of the requests past their first token
    decoding: int = 0  # requests past their first token with tokens still to come
    prefill_pending: int = 0  # requests in the ledger with no first token yet
    sent_prompt_tokens: int = 0  # every prompt the router ever sent here, summed (their mean: ``mean_prompt``)
    sent_requests: int = 0

    def sent(self, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """The router sends ``request_id`` here (called as it forwards it): ``prompt_tokens`` to prefill,
        then ``output_tokens`` to come."""
        self.answered(request_id)  # a retry under the same id replaces the old entry
        self.in_flight[request_id] = [prompt_tokens, output_tokens, -1]  # -1: no token seen yet
        self.prefill_left_tokens += prompt_tokens
        self.prefill_left_squares += prompt_tokens * prompt_tokens
        self.prefill_pending += 1
        self.sent_prompt_tokens += prompt_tokens
        self.sent_requests += 1

    def progressed(self, request_id: str, tokens_seen: int) -> None:
        """``tokens_seen`` output tokens of ``request_id`` have come back so far (as the relay counts them):
        the first one ends its prefill; each one is a decode token fewer to come."""
        entry = self.in_flight.get(request_id)
        if entry is None or tokens_seen < 1:
            return
        prompt, output, old_left = entry
        if old_left < 0:  # its first token: the prefill is done
            self.prefill_left_tokens -= prompt
            self.prefill_left_squares -= prompt * prompt
            self.prefill_pending -= 1
            entry[0] = old_left = 0
        left = max(output - tokens_seen, 0)
        self.decode_left_tokens += left - old_left
        self.decoding += (left > 0) - (old_left > 0)
        entry[2] = left

    def answered(self, request_id: str) -> None:
        """``request_id`` is done here (answered, failed, or its KV moved on): it leaves the ledger."""
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return
        prompt, _, left = entry
        self.prefill_left_tokens -= prompt
        self.prefill_left_squares -= prompt * prompt
        self.prefill_pending -= left < 0
        if left > 0:
            self.decode_left_tokens -= left
            self.decoding -= 1

    def mean_prompt(self) -> float | None:
        """The mean prompt the router sent here, over every request it ever sent; ``None``: none yet."""
        return self.sent_prompt_tokens / self.sent_requests if self.sent_requests else None

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

    def forward_failed(self, now_s: float, allowed: int, window_s: float) -> bool:
        """A request forwarded to this engine failed (an HTTP 502/503/504, a connection error): whether that
        confirms it lost, ``allowed`` failures in a row within ``window_s``; then it is down too."""
        recent = [t for t in self.forward_failures if now_s - t <= window_s]
        recent.append(now_s)
        if len(recent) >= allowed:
            self.forward_failures = []
            self.healthy = False
            return True
        self.forward_failures = recent[-allowed:]
        return False

    def forward_answered(self) -> None:
        """A forwarded request was answered: the failures in a row start again from none."""
        if self.forward_failures:
            self.forward_failures = []


def choose_decoder(
    decoders: Sequence[EngineLoad], full: float = 0.9, first_token: Mapping[str, float] | None = None,
    tie: float = OCCUPANCY_TIE,
) -> EngineLoad | None:  # fmt: skip
    """Turn 1's decoder among the healthy ones below ``full`` (``None``: every one is full): the lowest KV
    occupancy. With ``first_token`` (by URL: each one's estimated seconds to this request's first token,
    ``first_token_s``), the decoders within ``tie`` of the lowest occupancy count as equally occupied, and the
    one that gives the first token soonest among them is taken: where KV memory does not bind, the occupancy
    polled every ``pollS`` says little of which engine is busy (a queued request holds no KV yet, a
    conversation between turns none that vLLM counts), and the router's own ledger of what it sent says more."""
    open_ = [d for d in decoders if d.healthy and d.occupancy() < full]
    if not open_:
        return None
    if first_token:
        lowest = min(d.occupancy() for d in open_)
        near = [d for d in open_ if d.occupancy() <= lowest + tie]
        return min(near, key=lambda d: (first_token.get(d.url, 0.0), d.occupancy(), d.url))
    return min(open_, key=lambda d: (d.occupancy(), d.waiting, d.url))


def choose_gain_oriented(
    candidates: Sequence[EngineLoad],
    meets_deadline: Mapping[str, bool],
    light: float = 0.5,
    heavy: float = 0.85,
    first_token: Mapping[str, float] | None = None,
) -> EngineLoad | None:
    """GoRouting's choice (module rules); ``meets_deadline`` by URL, missing means yes; ``first_token``: each
    candidate's estimated seconds to this request's first token (``first_token_s``), when the router has them.

    With estimates, the candidate that gives the first token soonest (so one that meets the deadline is always
    taken over one that misses it). Without, the dual threshold on KV occupancy."""
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        return None
    if first_token:
        return min(healthy, key=lambda c: (first_token.get(c.url, 0.0), c.occupancy(), c.url))
    lightly = [c for c in healthy if c.occupancy() < light]
    if lightly:
        return min(lightly, key=lambda c: (c.occupancy(), c.waiting, c.url))
    middle = [c for c in healthy if c.occupancy() < heavy and meets_deadline.get(c.url, True)]
    if middle:
        return max(middle, key=lambda c: (c.occupancy(), c.url))
    return min(healthy, key=lambda c: (c.occupancy(), c.waiting, c.url))


def first_token_s(
    engine: EngineLoad, prompt_tokens: int, latency: tuple[float, float, float], step_tokens: int = STEP_TOKENS,
    mean_prompt_tokens: float | None = None,
) -> float:  # fmt: skip
    """When a request of ``prompt_tokens`` sent to ``engine`` now would get its first token, in seconds from now
    (module rules): the prefill left there and this prompt, in steps of ``step_tokens``, with the running
    requests' decode tokens in those steps; ``latency`` is the engine's prefill curve (constant s, s per token,
    s per token squared).

    The queue ahead is the ledger's own prompts; the engine's polled ``waiting`` beyond the ledger's requests
    with no first token yet (another replica's, or sent before a restart) count at the mean prompt the router
    sent there (``EngineLoad.mean_prompt``), else at ``mean_prompt_tokens`` (the caller's mean over the pool),
    else as nothing: never at this request's own length, which is no estimate of theirs."""
    constant, linear, quadratic = latency
    unknown = max(engine.waiting - engine.prefill_pending, 0)
    own_mean = engine.mean_prompt()
    mean = own_mean if own_mean is not None else (mean_prompt_tokens or 0.0)
    queued = engine.prefill_left_tokens + unknown * mean
    squares = engine.prefill_left_squares + unknown * mean * mean
    prefill = queued + prompt_tokens
    steps = max(1, math.ceil(prefill / step_tokens))
    decode = min(engine.decode_left_tokens, engine.decoding * steps)
    return constant * steps + linear * (prefill + decode) + quadratic * (squares + prompt_tokens * prompt_tokens)


def prefill_deadlines(
    prefillers: Sequence[EngineLoad], prompt_tokens: int, ttft_slo_s: float,
    latency: tuple[float, float, float] | None, step_tokens: int = STEP_TOKENS,
) -> dict[str, bool]:  # fmt: skip
    """Whether each engine would give this prompt its first token within ``ttft_slo_s`` (``first_token_s``);
    ``latency``: see there; ``None``: no estimate, every one meets it."""
    if latency is None:
        return {}
    return {p.url: first_token_s(p, prompt_tokens, latency, step_tokens) <= ttft_slo_s for p in prefillers}


def choose_for_request(
    candidates: Sequence[EngineLoad], prompt_tokens: int, ttft_slo_s: float,
    latency: tuple[float, float, float] | None, step_tokens: int = STEP_TOKENS,
) -> EngineLoad | None:  # fmt: skip
    """GoRouting for one request: ``choose_gain_oriented`` given each candidate's ``first_token_s`` (without a
    ``latency`` curve, the dual threshold on KV occupancy alone).

    Who calls it: the router for each prefill (``Router._prefill``) and the simulated pool for each request it
    routes with ``goroute`` (``coserve.sim.pool``): the same decision from the same ledger."""
    if latency is None:
        return choose_gain_oriented(candidates, {})
    first = {c.url: first_token_s(c, prompt_tokens, latency, step_tokens) for c in candidates}
    return choose_gain_oriented(
        candidates, {url: seconds <= ttft_slo_s for url, seconds in first.items()}, first_token=first
    )


# why turn 1 prefills where it does (the router's ``coserve_router_prefill_site_total`` label)
PREFILL_REASONS = ("sooner_on_prefiller", "sooner_on_decoder", "decoder_stall_over_tpot", "streams_lose_more",
                   "no_prefiller", "no_curve", "prefiller_only")  # fmt: skip


@dataclass(frozen=True)
class PrefillSite:
    """Where turn 1 prefills: on ``prefiller`` (its KV then moves to the decoder once), or, when it is ``None``,
    on the decoder that will hold the conversation; ``reason`` is one of ``PREFILL_REASONS``; ``remote_s`` and
    ``local_s`` the predicted first-token times (None where not predicted)."""

    prefiller: EngineLoad | None
    reason: str
    remote_s: float | None = None
    local_s: float | None = None


def local_prefill_step_s(
    decoder: EngineLoad, prompt_tokens: int, latency: tuple[float, float, float], step_tokens: int = STEP_TOKENS
) -> float:
    """How long each of ``decoder``'s steps lasts while it prefills ``prompt_tokens`` itself: a chunk of at most
    ``step_tokens`` beside one token for each stream it decodes (``chunked_step_s``, the rule the plan's shape
    choice reads too). Each stream's time between tokens, meanwhile."""
    return chunked_step_s(latency, prompt_tokens, decoder.decoding, step_tokens)


def choose_prefill_site(
    prefillers: Sequence[EngineLoad], decoder: EngineLoad, prompt_tokens: int, ttft_slo_s: float,
    latency: tuple[float, float, float] | None, *, transfer_s_per_token: float = 0.0,
    tpot_slo_s: float | None = None, step_tokens: int = STEP_TOKENS, mean_prompt_tokens: float | None = None,
    local: bool = True,
) -> PrefillSite:  # fmt: skip
    """Turn 1's prefill site: the candidate (each healthy prefiller, and ``decoder``, which will hold the
    conversation) with the soonest predicted first token.

    - On a prefiller: its ``first_token_s``, plus the KV's move (``transfer_s_per_token`` per prompt token)
      and the decoder's first step (the curve's constant).
    - On the decoder: its ``first_token_s``; allowed only while each of its steps with a prefill chunk in it
      (``local_prefill_step_s``) stays within ``tpot_slo_s``, the tightest objective of the streams it decodes,
      and while what this request gains over the prefiller exceeds what the streams lose together (each waits
      the prefill's compute, the curve without its per-step constant), unless no prefiller is up.

    ``local=False`` never prefills on the decoder while a prefiller is up (the P/D shape alone). Without a
    ``latency`` curve there is no prediction: GoRouting's choice among the prefillers (``choose_for_request``),
    the decoder when none is up. Who calls it: the router for each turn 1 (``Placement._prefill``) and the
    simulated pool (``coserve.sim.pool``), the same decision from the same ledgers."""
    up = [p for p in prefillers if p.healthy]
    if latency is None:
        chosen = choose_for_request(up, prompt_tokens, ttft_slo_s, None, step_tokens)
        return PrefillSite(chosen, "no_curve" if chosen is not None else "no_prefiller")
    local_s = first_token_s(decoder, prompt_tokens, latency, step_tokens, mean_prompt_tokens)
    if not up:
        return PrefillSite(None, "no_prefiller", None, local_s)
    first = {p.url: first_token_s(p, prompt_tokens, latency, step_tokens, mean_prompt_tokens) for p in up}
    remote = choose_gain_oriented(up, {u: t <= ttft_slo_s for u, t in first.items()}, first_token=first)
    assert remote is not None  # noqa: S101 - ``up`` is not empty
    remote_s = first[remote.url] + transfer_s_per_token * prompt_tokens + latency[0]
    if not local:
        return PrefillSite(remote, "prefiller_only", remote_s, local_s)
    stalls = bool(decoder.decoding) and tpot_slo_s is not None
    if stalls and local_prefill_step_s(decoder, prompt_tokens, latency, step_tokens) > (tpot_slo_s or 0.0):
        return PrefillSite(remote, "decoder_stall_over_tpot", remote_s, local_s)
    # NOTE: each stream the decoder runs waits, over the prefill's steps, for all of its tokens: what this
    # request would gain must exceed what they lose together (the twin's operating point lost TTFET otherwise).
    _, linear, quadratic = latency
    streams_lose = decoder.decoding * (linear * prompt_tokens + quadratic * prompt_tokens * prompt_tokens)
    if local_s < remote_s and remote_s - local_s <= streams_lose:
        return PrefillSite(remote, "streams_lose_more", remote_s, local_s)
    if local_s < remote_s:
        return PrefillSite(None, "sooner_on_decoder", remote_s, local_s)
    return PrefillSite(remote, "sooner_on_prefiller", remote_s, local_s)


@dataclass(frozen=True)
class OfflinePlacement:
    """Where one offline batch line goes: ``decoder`` decodes it; ``prefiller`` prefills it first, or ``None``:
    the decoder prefills it too."""

    decoder: EngineLoad
    prefiller: EngineLoad | None = None


def place_offline(
    decoders: Sequence[EngineLoad], prefillers: Sequence[EngineLoad], spare: float = 0.5
) -> OfflinePlacement | None:
    """An offline line's placement (module rules); ``None``: no decoder is below ``spare``, the line waits.

    Who calls it: the router's batch runner before each line (``Router.run_offline``) and the simulated pool's
    (``coserve.sim.pool``)."""
    open_ = [d for d in decoders if d.healthy and d.occupancy() < spare]
    if not open_:
        return None
    decoder = min(open_, key=lambda d: (d.occupancy(), d.waiting, d.url))
    idle = [p for p in prefillers if p.healthy and not p.waiting and not p.in_flight]
    return OfflinePlacement(decoder, min(idle, key=lambda p: (p.occupancy(), p.url)) if idle else None)


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

    The order holds whatever last use a pin is given: one given a last use no later than the newest
    entry's (a pin kept with a past last use, a request's clock read before an await) goes to a heap of
    late pins instead of the end of the ordered dict, and expiry and eviction take the older of the two
    heads. Late pins are few, so the hot path stays an ordered dict's append and move-to-end.
    """

    def __init__(self, ttl_s: float = 1800.0, max_pins: int = 100_000) -> None:
        if ttl_s <= 0 or max_pins <= 0:
            raise ValueError("pin TTL and table size must be positive")
        self.ttl_s = ttl_s
        self.max_pins = max_pins
        self._pins: dict[str, Pin] = {}
        self._order: OrderedDict[str, Pin] = OrderedDict()  # non-decreasing last use: least recent first
        self._late: list[tuple[float, int, str]] = []  # heap of (last use, stamp, conversation); stale allowed
        self._late_stamp: dict[str, int] = {}  # the live heap entry of each late pin
        self._stamps = itertools.count()
        self._by_decoder: dict[str, set[str]] = {}
        self._ended: list[tuple[str, Pin]] = []  # expired on lookup, reported by the next expire()
        self.touched = 0  # entries examined by expire() and drop_decoder() (tests hold the cost to this)

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, conversation: object) -> bool:
        return conversation in self._pins

    def get(self, conversation: str, now_s: float) -> Pin | None:
        pin = self._pins.get(conversation)
        if pin is None:
            return None
        if now_s - pin.last_used_s > self.ttl_s:
            self._ended.append((conversation, self._remove(conversation)))
            return None
        if now_s >= pin.last_used_s:
            self._unplace(conversation)
            pin.last_used_s = now_s
            self._place(conversation, pin)
        return pin

    def pin(self, conversation: str, decoder: str, now_s: float, first_arrival_s: float | None = None,
            owned: bool = True) -> Pin:  # fmt: skip
        """Pin ``conversation`` to ``decoder`` (a new conversation, a re-placement, or one another replica
        placed: then ``owned`` is False and ``first_arrival_s`` is what the decoder says), last used at
        ``now_s``: a pin older than every other one in a full table is the one that goes."""
        old = self._pins.get(conversation)
        if old is not None:
            self._remove(conversation)
        first = old.first_arrival_s if old else (now_s if first_arrival_s is None else first_arrival_s)
        pin = Pin(decoder, now_s, old.turns if old else 0, first, old.owned if old else owned)
        self._pins[conversation] = pin
        self._place(conversation, pin)
        self._by_decoder.setdefault(decoder, set()).add(conversation)
        while len(self._pins) > self.max_pins:
            oldest = self._oldest()
            assert oldest is not None  # noqa: S101 - the table is not empty (for the type checker)
            self._remove(oldest[0])
        return pin

    def drop_decoder(self, decoder: str) -> int:
        """A decoder is lost: forget its pins (their next turns are re-placed); how many."""
        gone = self._by_decoder.pop(decoder, set())
        self.touched += len(gone)
        for conversation in gone:
            del self._pins[conversation]
            self._unplace(conversation)
        return len(gone)

    def expire(self, now_s: float) -> list[Pin]:
        """Forget conversations idle for longer than the TTL (they ended); their pins."""
        return self.expire_named(now_s)[1]

    def expire_named(self, now_s: float) -> tuple[list[str], list[Pin]]:
        """``expire``, with the conversations' names beside their pins."""
        ended, self._ended = self._ended, []
        while True:
            oldest = self._oldest(count=True)
            if oldest is None or now_s - oldest[1].last_used_s <= self.ttl_s:
                break
            ended.append((oldest[0], self._remove(oldest[0])))
        return [name for name, _ in ended], [pin for _, pin in ended]

    def per_decoder(self) -> dict[str, int]:
        return {decoder: len(members) for decoder, members in self._by_decoder.items() if members}

    def _place(self, conversation: str, pin: Pin) -> None:
        """Put a pin not in the order yet where its last use says: the end, or the late heap."""
        if self._order:
            newest = self._order[next(reversed(self._order))]
            if pin.last_used_s < newest.last_used_s:
                stamp = next(self._stamps)
                self._late_stamp[conversation] = stamp
                heapq.heappush(self._late, (pin.last_used_s, stamp, conversation))
                if len(self._late) > 2 * len(self._late_stamp) + 64:  # mostly stale entries: rebuild
                    self._late = [entry for entry in self._late if self._late_stamp.get(entry[2]) == entry[1]]
                    heapq.heapify(self._late)
                return
        self._order[conversation] = pin

    def _unplace(self, conversation: str) -> None:
        if self._order.pop(conversation, None) is None:
            self._late_stamp.pop(conversation, None)  # its heap entry is stale now

    def _oldest(self, count: bool = False) -> tuple[str, Pin] | None:
        """The least recently used pin (``count``: each entry looked at adds to ``touched``)."""
        while self._late and self._late_stamp.get(self._late[0][2]) != self._late[0][1]:
            heapq.heappop(self._late)  # stale: that pin was used again, moved or removed
            self.touched += count
        late = self._late[0] if self._late else None
        first = next(iter(self._order.items())) if self._order else None
        self.touched += count
        if late is not None and (first is None or late[0] < first[1].last_used_s):
            return late[2], self._pins[late[2]]
        return first

    def _remove(self, conversation: str) -> Pin:
        pin = self._pins.pop(conversation)
        self._unplace(conversation)
        members = self._by_decoder.get(pin.decoder)
        if members is not None:
            members.discard(conversation)
            if not members:
                del self._by_decoder[pin.decoder]
        return pin
