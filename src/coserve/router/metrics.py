"""The router's metrics: every series ``/metrics`` serves, and what the autoscaler and the dashboard read.

Who calls it: ``coserve.router.app.Router`` builds one ``RouterMetrics`` per router; the request path
(``coserve.router.upstream`` for TTFT, TBT and token counts, ``coserve.router.placement`` for conversations,
turns and re-placements) and the engine poller (``coserve.router.engines``) update it; the ``/metrics`` route
serves its registry. The names are the dashboard's and the autoscaler's queries' (``coserve.autoscaling.queries``):
renaming one breaks them.
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """The router's Prometheus series, in a registry of its own (``registry``: what ``/metrics`` serves).

    The request path updates them through the ``*_of`` lookups; the poller sets the gauges.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "coserve_router_requests", "Requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "coserve_router_ttft_seconds",
            "Time to first token (first streamed chunk, or the whole answer when not streaming), by class.",
            ["cls"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tbt = Histogram(
            "coserve_router_tbt_seconds",
            "Time between streamed events.",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.ttfet = Histogram(
            "coserve_router_ttfet_seconds",
            "From a conversation's first arrival to the first token of its latest turn.",
            registry=r,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.slo = Counter(
            "coserve_router_ttft_slo",
            "Requests by class and whether TTFT met the class's SLO.",
            ["cls", "met"],
            registry=r,
        )
        self.replacements = Counter(
            "coserve_router_replacements", "Conversations re-placed because their decoder was gone.", registry=r
        )
        self.conversations = Counter("coserve_router_conversations", "New conversations (turn 1 arrivals).", registry=r)
        self.turns = Counter("coserve_router_turns", "Turns of pinned conversations (turn 2 and later).", registry=r)
        self.prefill_site = Counter(
            "coserve_router_prefill_site",
            "Where turn 1 prefilled (site: prefiller or decoder), and why (reason).",
            ["site", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "coserve_router_prompt_tokens",
            "Prompt tokens of answered requests (engines' usage), by class.",
            ["cls"],
            registry=r,
        )
        self.output_tokens = Counter(
            "coserve_router_output_tokens",
            "Output tokens of answered requests (engines' usage), by class: the offline class's is the harvest.",
            ["cls"],
            registry=r,
        )
        self._add_pool_series(r)
        # The labelled series the request path updates, looked up once per label values (``labels`` validates,
        # locks and builds a key on every call; the child it returns is the same object each time).
        self.requests_of = functools.cache(self.requests.labels)
        self.ttft_of = functools.cache(self.ttft.labels)
        self.slo_of = functools.cache(self.slo.labels)
        self.prompt_tokens_of = functools.cache(self.prompt_tokens.labels)
        self.output_tokens_of = functools.cache(self.output_tokens.labels)

    def _add_pool_series(self, r: CollectorRegistry) -> None:
        """The pool's series: pins, prefiller queues, and what the autoscaler reads."""
        self.pinned = Gauge(
            "coserve_router_pinned_conversations", "Pinned conversations by decoder.", ["decoder"], registry=r
        )
        self.prefill_queue = Gauge(
            "coserve_router_prefiller_waiting",
            "Requests waiting in each prefiller (polled).",
            ["prefiller"],
            registry=r,
        )
        self.prefill_failures = Counter(
            "coserve_router_prefill_failures", "Prefills that failed; the decoder computed the prompt.", registry=r
        )
        # What the autoscaler reads (the provisioning model's R, L_in, L_d, W and the prefillers' load):
        # R = rate(conversations_total); L_in from conversation_input_tokens; L_d = rate(output_tokens_total)
        # / R; W from conversation_lifetime_seconds; prompt tokens sent to each prefiller, prefill_tokens_total.
        self.input_tokens = Histogram(
            "coserve_router_conversation_input_tokens",
            "Turn-1 prompt tokens of new conversations (L_in; the prefiller's count when it answered).",
            registry=r,
            buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
        )
        self.lifetime = Histogram(
            "coserve_router_conversation_lifetime_seconds",
            "From a conversation's first turn to its last, observed when its pin expires (W).",
            registry=r,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200),
        )
        self.prefill_tokens = Counter(
            "coserve_router_prefill_tokens", "Prompt tokens sent to each prefiller.", ["prefiller"], registry=r
        )
        self.active = Gauge(
            "coserve_router_active_conversations", "Conversations pinned to a decoder (all decoders).", registry=r
        )
        self.found = Counter(
            "coserve_router_found_conversations",
            "Conversations this replica held no pin for, found on the decoder that holds them.",
            registry=r,
        )
