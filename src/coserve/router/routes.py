"""The router's HTTP surface: the route table, its handlers, and the ASGI app that fronts them.

Who calls it: ``coserve.router.app.build_app`` builds the Starlette app from ``route_table`` and ``lifespan``;
Starlette calls a handler once per request. Each handler is a module-level function that finds the router in
``request.app.state.router`` (and the config ``build_app`` was given in ``request.app.state.config``).

- ``/v1/chat/completions`` and ``/v1/completions`` (``HOT_PATHS``): ``Router.handle``.
  ``coserve.router.app.RouterApp`` sends them there straight from the ASGI scope (``RawRequest``), around
  Starlette; these routes serve the same handler for anything that reaches them another way.
- ``/v1/models``, ``/live`` (the process serves), ``/ready`` and ``/health`` (a request can be placed: a
  healthy decoder below full), ``/metrics``.
- With ``batchDir``: the OpenAI Files and Batches subset (``/v1/files``, ``/v1/batches``) over
  ``coserve.router.batches.BatchStore``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coserve.router.admission import RequestBody, error_response, read_json
from coserve.router.batches import ENDPOINTS, BatchStore, public
from coserve.router.config import RouterConfig
from coserve.router.metrics import RouterMetrics
from coserve.router.policy import EngineLoad, PinTable, choose_decoder

logger = logging.getLogger("coserve.router")


class Serving(Protocol):
    """What the routes need of ``coserve.router.app.Router``."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def decoders(self) -> dict[str, EngineLoad]: ...
    @property
    def pins(self) -> PinTable: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def batches(self) -> BatchStore | None: ...

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def handle(self, request: RequestBody, endpoint: str) -> Response: ...


def _router(request: Request) -> Serving:
    router: Serving = request.app.state.router
    return router


def _config(request: Request) -> RouterConfig:
    config: RouterConfig = request.app.state.config
    return config


def _store(request: Request) -> BatchStore:
    store = _router(request).batches
    assert store is not None  # noqa: S101 - the batch routes are mounted only with a store
    return store


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """The router starts (first poll, poller, batch runner) with the app and closes with it."""
    router: Serving = app.state.router
    await router.start()
    try:
        yield
    finally:
        await router.close()


# -- completions, models, probes, metrics ----------------------------------------------------------


async def chat(request: Request) -> Response:
    return await _router(request).handle(request, "chat")


async def completions(request: Request) -> Response:
    return await _router(request).handle(request, "completions")


async def models(request: Request) -> Response:
    model = _config(request).model
    return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "coserve"}]})


async def live(_: Request) -> Response:
    """Liveness: the process serves (a router without decoders is waiting, not broken)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: the router can place a request (a healthy decoder below full)."""
    router = _router(request)
    up = [d.url for d in router.decoders.values() if d.healthy]
    placeable = choose_decoder(list(router.decoders.values()), _config(request).decoder_full) is not None
    return JSONResponse({"decoders_up": len(up), "pinned": len(router.pins)}, 200 if placeable else 503)


async def metrics(request: Request) -> Response:
    registry = _router(request).metrics.registry
    return Response(generate_latest(registry), headers={"content-type": "text/plain; version=0.0.4"})


# -- files and batches -----------------------------------------------------------------------------


async def upload(request: Request) -> Response:
    try:
        form = await request.form(max_part_size=64 << 20)
    except Exception as error:  # noqa: BLE001 - any malformed multipart body is the client's
        return error_response(400, f"expected a multipart form with a file: {error}", "file")
    upload_file = form.get("file")
    if upload_file is None or isinstance(upload_file, str):
        return error_response(400, "required: a file field with the JSONL of requests", "file")
    purpose = form.get("purpose", "batch")
    try:
        meta = _store(request).add_file(await upload_file.read(), upload_file.filename or "input.jsonl", str(purpose))
    except (ValueError, UnicodeDecodeError) as error:
        return error_response(400, str(error), "file")
    return JSONResponse(meta)


async def file_meta(request: Request) -> Response:
    meta = _store(request).file(request.path_params["file_id"])
    return JSONResponse(meta) if meta else error_response(404, "no such file", "file_id")


async def file_content(request: Request) -> Response:
    content = _store(request).content(request.path_params["file_id"])
    if content is None:
        return error_response(404, "no such file", "file_id")
    return Response(content, headers={"content-type": "application/jsonl"})


async def create_batch(request: Request) -> Response:
    body, problem = await read_json(request, _router(request).config.max_body_bytes)
    if body is None:
        return problem or error_response(400, "no body")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        return error_response(400, f"must be one of {', '.join(ENDPOINTS)}", "endpoint")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        return error_response(400, "required: the id of an uploaded file", "input_file_id")
    try:
        return JSONResponse(public(_store(request).create_batch(file_id, endpoint)))
    except KeyError:
        return error_response(404, f"no file {file_id!r}", "input_file_id")


async def get_batch(request: Request) -> Response:
    batch = _store(request).batch(request.path_params["batch_id"])
    return JSONResponse(public(batch)) if batch else error_response(404, "no such batch", "batch_id")


async def cancel_batch(request: Request) -> Response:
    store = _store(request)
    batch = store.batch(request.path_params["batch_id"])
    if batch is None:
        return error_response(404, "no such batch", "batch_id")
    if batch["status"] == "in_progress":
        batch["status"] = "cancelling"
        store.save(batch)
    return JSONResponse(public(batch))


BATCH_ROUTES = [
    Route("/v1/files", upload, methods=["POST"]),
    Route("/v1/files/{file_id}", file_meta, methods=["GET"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
ROUTES = [
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/live", live, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/health", ready, methods=["GET"]),  # kept for existing probes and scripts: readiness
    Route("/metrics", metrics, methods=["GET"]),
]


def route_table(batches: bool) -> list[Route]:
    """The routes, the batch API's first when the router has a batch store."""
    return [*BATCH_ROUTES, *ROUTES] if batches else list(ROUTES)


# -- the hot path ----------------------------------------------------------------------------------

HOT_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}  # path -> endpoint


class RawRequest:
    """The hot path's request: headers and body straight from the ASGI scope, without Starlette's Request."""

    def __init__(self, scope: Mapping[str, Any], receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
        self.headers: dict[str, str] = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self._receive = receive

    async def stream(self) -> AsyncIterator[bytes]:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return
            yield message.get("body", b"")
            if not message.get("more_body"):
                return
