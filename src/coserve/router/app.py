"""The OpenAI-compatible router: conversation-level P/D placement in front of vLLM engines, wired together.

Who calls it: ``coserve router --config FILE`` (uvicorn) and ``coserve up``; tests build it with
``build_app``. This module only builds the parts and connects them; each holds one concern:

- ``coserve.router.admission``: read, strip, check and class a request (once per request);
- ``coserve.router.placement``: pins, lookups, the choice of decoder and prefiller (once per admitted
  request; pin expiry after each poll);
- ``coserve.router.upstream``: the engines' client: prefill, forward, the SSE relay, lookups, scrapes;
- ``coserve.router.engines``: the view of the engines: Services and polls (at start-up, then every ``pollS``);
- ``coserve.router.offline``: offline batch lines (per line, from ``coserve.router.batches``' runner);
- ``coserve.router.routes``: the HTTP routes (per request that reaches Starlette);
- ``coserve.router.metrics``: the series all of the above update.

The decisions are ``coserve.router.policy``'s. A request to ``/v1/chat/completions`` or ``/v1/completions``
(``Router.handle``) is admitted, then placed and forwarded, and counted by endpoint and status. The poller
(``Router.refresh``) follows the router token, refreshes the engines, expires pins and sets the gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.responses import Response

from coserve.router.admission import Admitted, RequestBody, admit, error_response
from coserve.router.batch_lock import batch_locks
from coserve.router.batches import BatchRunner, BatchStore
from coserve.router.config import RouterConfig
from coserve.router.engines import Engines
from coserve.router.metrics import RouterMetrics
from coserve.router.offline import Offline
from coserve.router.placement import Placement
from coserve.router.policy import EngineLoad, PinTable
from coserve.router.routes import HOT_PATHS, RawRequest, lifespan, route_table
from coserve.router.upstream import ROUTER_TOKEN_FILE_ENV, ROUTER_TOKEN_HEADER, Upstream, router_token_headers

__all__ = [
    "ROUTER_TOKEN_FILE_ENV",
    "ROUTER_TOKEN_HEADER",
    "Router",
    "RouterApp",
    "build_app",
    "error_response",
    "router_token_headers",
]

logger = logging.getLogger("coserve.router")


class Router:
    """The router's state, wired: engines, pins, the upstream connection pool, metrics, the batch runner."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.pins = PinTable(config.pin_ttl_s, config.max_pins)
        self.metrics = RouterMetrics()
        self.upstream = Upstream(config, self.metrics, clock)  # reads the router token: fails fast without one
        self.engines = Engines(config, self.upstream, self.pins, self.metrics)
        self.placement = Placement(config, self.engines, self.upstream, self.pins, self.metrics, clock)
        self.offline = Offline(config, self.engines, self.upstream, self.placement, clock)
        self._poller: asyncio.Task[None] | None = None
        self.batches = BatchStore(Path(config.batch_dir)) if config.batch_dir else None
        self._runner = (
            BatchRunner(
                self.batches, self.run_offline, self.has_spare_capacity,
                locks=batch_locks(config.batch_lock, self.batches.batches, namespace=os.environ.get("POD_NAMESPACE")),
            )
            if self.batches
            else None
        )  # fmt: skip

    @property
    def prefillers(self) -> dict[str, EngineLoad]:
        return self.engines.prefillers

    @property
    def decoders(self) -> dict[str, EngineLoad]:
        return self.engines.decoders

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll_forever())
        if self._runner is not None:
            self._runner.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.upstream.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:
                await self.refresh()
            except Exception:  # the poller must outlive any one bad poll
                logger.exception("engine poll failed")

    async def refresh(self) -> None:
        """Follow the router token, resolve Services (if configured), read every engine's load, expire pins."""
        self.upstream.follow_token()
        await self.engines.refresh()
        await self.placement.expire()
        self.engines.publish()

    async def handle(self, request: RequestBody, endpoint: str) -> Response:
        """One request to ``/v1/chat/completions`` (``endpoint`` ``chat``) or ``/v1/completions``."""
        arrived = self.clock()
        admitted = await admit(request, endpoint, self.config)
        if isinstance(admitted, Admitted):
            cls = admitted.cls
            response = await self.placement.route(
                endpoint, admitted.body, admitted.conversation, cls.name, cls.ttft_slo_s, arrived, admitted.named
            )
        else:
            response = admitted
        self.metrics.requests_of(endpoint, str(response.status_code)).inc()
        return response

    def has_spare_capacity(self, spare: float = 0.5) -> bool:
        return self.offline.has_spare_capacity(spare)

    async def run_offline(self, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        return await self.offline.run(endpoint, body)


def build_app(config: RouterConfig, router: Router | None = None) -> RouterApp:
    """The ASGI app; ``router`` (tests) or a new one, started and closed with the app."""
    state = router or Router(config)
    app = Starlette(routes=route_table(batches=state.batches is not None), lifespan=lifespan)
    app.state.router = state
    app.state.config = config
    return RouterApp(app, state)


class RouterApp:
    """The ASGI app: the two completion endpoints straight to the router, everything else through Starlette.

    NOTE: Starlette's middleware, routing and Request cost about a fifth of the router's CPU per request
    (profiled at 500 requests/s), and on 2 shared cores CPU per request is what the p99 latency is made of.
    """

    def __init__(self, app: Starlette, router: Router) -> None:
        self.app = app
        self.state = app.state
        self.router = router

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        endpoint = HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.router.handle(RawRequest(scope, receive), endpoint)
        except Exception:  # what Starlette's error middleware would do: a 500, logged, no traceback to the client
            logger.exception("unhandled error on %s", scope["path"])
            response = error_response(500, "internal error in the router; it is logged")
        await response(scope, receive, send)
