"""The router's view of its engines: which prefillers and decoders there are, and how loaded each is.

Who calls it: ``coserve.router.app.Router`` builds one ``Engines`` and calls ``refresh`` at start-up and then
every ``pollS`` (its poller), and ``publish`` after each refresh; ``coserve.router.placement`` and
``coserve.router.offline`` read ``prefillers`` and ``decoders`` on every request, and the ``/ready`` route
reads ``decoders``.

At each refresh, with ``prefillerService`` / ``decoderService`` the headless Services are resolved (DNS); an
engine that leaves its Service (Kubernetes deleting its pod: a scale-down, a rollout, a node drain) is
draining: it gets no new request, its in-flight ones finish (its pod's preStop hook, ``coserve.drain``, waits
for them), and each conversation pinned to it is re-placed at its next turn. Then every engine is polled for
``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting`` and its KV capacity (``vllm:cache_config_info``),
read with ``prometheus_client``'s parser; an engine is down after ``decoderFailures`` consecutive failed polls
(one slow answer is not a death).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from coserve.router.config import RouterConfig
from coserve.router.metrics import RouterMetrics
from coserve.router.policy import EngineLoad, PinTable
from coserve.router.upstream import Upstream

logger = logging.getLogger("coserve.router")


class Engines:
    """The prefillers and decoders the router knows, by URL, with their polled and admitted load."""

    def __init__(self, config: RouterConfig, upstream: Upstream, pins: PinTable, metrics: RouterMetrics) -> None:
        self.config = config
        self.upstream = upstream
        self.pins = pins  # read only, to say how many conversations a leaving decoder had
        self.metrics = metrics
        self.prefillers: dict[str, EngineLoad] = {url: EngineLoad(url) for url in config.prefillers}  # url -> load
        self.decoders: dict[str, EngineLoad] = {url: EngineLoad(url) for url in config.decoders}  # url -> load

    async def refresh(self) -> None:
        """Resolve the Services (if configured), then read every engine's load."""
        for service, engines in (
            (self.config.prefiller_service, self.prefillers),
            (self.config.decoder_service, self.decoders),
        ):
            if service:
                await self._resolve(service, engines)
        everyone = [*self.prefillers.values(), *self.decoders.values()]
        await asyncio.gather(*(self._poll(engine) for engine in everyone))

    def publish(self) -> None:
        """Set the gauges from the pins and the last poll (after a refresh)."""
        self.metrics.active.set(len(self.pins))
        counts = self.pins.per_decoder()
        for url in self.decoders:
            self.metrics.pinned.labels(url).set(counts.get(url, 0))
        for url, engine in self.prefillers.items():
            self.metrics.prefill_queue.labels(url).set(engine.waiting)

    async def _resolve(self, service: str, engines: dict[str, EngineLoad]) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(service, self.config.engine_port, type=socket.SOCK_STREAM)
        except OSError as error:
            logger.warning("cannot resolve %s: %s", service, error)
            return
        port = self.config.engine_port
        hosts = {str(info[4][0]) for info in infos}
        urls = {f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}" for h in hosts}  # IPv6 in brackets
        for url in urls - set(engines):
            engines[url] = EngineLoad(url)
        for url in set(engines) - urls:
            self._left_service(url, engines)

    def _left_service(self, url: str, engines: dict[str, EngineLoad]) -> None:
        """An engine left its Service (Kubernetes is deleting its pod, or it is not ready): it gets no new work.

        Its in-flight requests finish (the pod's preStop hook waits for them). Pins to a leaving decoder are
        kept, not dropped: a conversation's next turn finds its decoder gone and is re-placed (prefilled again,
        its KV handed to another decoder), counted as a re-placement with its first arrival kept (R, L_in and
        W stay right); a decoder back in the Service before that turn keeps its conversations.
        """
        del engines[url]
        gauge = self.metrics.pinned if engines is self.decoders else self.metrics.prefill_queue
        with contextlib.suppress(KeyError):  # no series for a pod that is gone
            gauge.remove(url)
        if engines is self.decoders:
            pinned = self.pins.per_decoder().get(url, 0)
            logger.info("decoder %s left its Service: draining; %d conversations move at their next turn", url, pinned)

    async def _poll(self, engine: EngineLoad) -> None:
        try:
            usage, waiting, capacity = engine_load(await self.upstream.metrics_text(engine.url))
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            engine.failed(self.config.decoder_failures)
            if not engine.healthy:
                logger.warning("%s is down after %d failed polls (%s)", engine.url, engine.failures, error)
            return
        engine.polled(usage, waiting)
        engine.kv_capacity_tokens = capacity or engine.kv_capacity_tokens


def engine_load(text: str) -> tuple[float, int, int]:
    """KV usage (the highest engine's), requests waiting and KV capacity in tokens from an engine's /metrics."""
    usage, waiting, capacity = 0.0, 0.0, 0
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:kv_cache_usage_perc":
            usage = max((sample.value for sample in family.samples), default=0.0)
        elif family.name == "vllm:num_requests_waiting":
            waiting = sum(sample.value for sample in family.samples)
        elif family.name in ("vllm:cache_config_info", "vllm:cache_config"):  # its labels: the KV capacity
            for sample in family.samples:
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    capacity += int(blocks) * int(size)
    return usage, int(waiting), capacity
