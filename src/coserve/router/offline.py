"""Offline batch lines: the same checks as online traffic, at the lowest class, placed where capacity is spare.

Who calls it: ``coserve.router.batches.BatchRunner`` (built by ``coserve.router.app.Router``) asks
``has_spare_capacity`` before each line and sends each line to ``run``. The choice is
``coserve.router.policy.place_offline``'s: straight to the decoder with the lowest KV occupancy among those
below ``spare`` (it prefills and decodes the line, and nothing is pinned), or, when a prefiller is left idle,
through the online placement (``coserve.router.placement``), as a new conversation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from coserve.router.admission import check, client_xargs, drop_engine_fields, error_response, lowest_class
from coserve.router.config import RouterConfig
from coserve.router.engines import Engines
from coserve.router.placement import Placement, endpoint_path, estimate_tokens
from coserve.router.policy import InvalidConversationId, conversation_id, place_offline
from coserve.router.upstream import Unavailable, Upstream


class Offline:
    """Runs batch lines through the pool's spare capacity."""

    def __init__(
        self, config: RouterConfig, engines: Engines, upstream: Upstream, placement: Placement,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.config = config
        self.engines = engines
        self.upstream = upstream
        self.placement = placement
        self.clock = clock

    def has_spare_capacity(self, spare: float = 0.5) -> bool:
        """Offline batch work runs only while some decoder is below ``spare`` KV occupancy (``place_offline``)."""
        decoders, prefillers = list(self.engines.decoders.values()), list(self.engines.prefillers.values())
        return place_offline(decoders, prefillers, spare) is not None

    async def run(self, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """One batch line through the same checks and placement as online traffic, at the lowest class."""
        drop_engine_fields(body)  # before anything else reads the line
        body.setdefault("model", self.config.model)
        body["stream"] = False
        problem = check(body, endpoint, self.config.model)
        if problem is not None:
            return _answer(problem)
        xargs = body.get("vllm_xargs") or {}
        if not isinstance(xargs, dict):
            return _answer(error_response(400, "must be an object", "vllm_xargs"))
        try:
            conversation = conversation_id({}, body)
        except InvalidConversationId as error:
            return _answer(error_response(400, error.reason, error.field))
        lowest = lowest_class(self.config)
        slos = {"ttft_slo_ms": lowest.ttft_slo_s * 1000, "tpot_slo_ms": lowest.tpot_slo_s * 1000}
        body["vllm_xargs"] = {**client_xargs(xargs), "coserve_class": lowest.name, **slos}
        body.pop("priority", None)
        body.pop("conversation_id", None)
        arrived = self.clock()
        placed = place_offline(list(self.engines.decoders.values()), list(self.engines.prefillers.values()))
        if placed is not None and placed.prefiller is None:  # the decoder prefills it too: no prefiller, no pin
            decoder = placed.decoder
            tokens = estimate_tokens(body)
            decoder.admitted_tokens += tokens
            try:
                response = await self.upstream.forward(
                    decoder, endpoint_path(endpoint), body, lowest.name, lowest.ttft_slo_s, arrived, arrived,
                    None, tokens,
                )  # fmt: skip
            except Unavailable as failure:
                self.placement.forward_failed(decoder, failure)
                response = error_response(503, f"decoder {decoder.url} failed ({failure}); retry shortly")
            return _answer(response)
        # an idle prefiller (GoRouting takes it) or no spare decoder: the online placement
        response = await self.placement.route(endpoint, body, conversation, lowest.name, lowest.ttft_slo_s, arrived)
        return _answer(response)


def _answer(response: Response) -> tuple[int, bytes]:
    return response.status_code, bytes(response.body)
