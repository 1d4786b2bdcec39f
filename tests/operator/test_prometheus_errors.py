"""What a failing ``prometheusUrl`` puts into status: the query's name and the HTTP status, never the answer.

``spec.autoscaling.prometheusUrl`` is the user's: it may point at any service in the cluster, and the
AutoscalingActive condition and its Warning event are readable by anyone who can read the pool. A local aiohttp
server on 127.0.0.1 answers every query with a body (HTML, Prometheus-shaped error JSON, odd successes) and a
reason phrase that carry a secret; no message may carry it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import kmock as kmocklib
import pytest
from aiohttp import web

from coserve.operator.autoscaler import PrometheusError, query_prometheus
from operator_kmock import MERGE, NS, POOL, POOLS, POOLS_URL, condition, eventually, running_operator
from router_served import free_port

CANARY = "SECRET-TOKEN-123"
HTML = f"<html><body><h1>Internal admin</h1><p>api key: {CANARY}</p></body></html>"
QUERY_NAMES = ("arrivalRate", "inputTokens", "outputTokens", "lifetime", "prefillTokensRate", "prefillerQueue",
               "decoderKvUsage", "decoderWaiting", "prefillerRequests", "decoderRequests")  # fmt: skip


def html(status: int) -> web.Response:
    return web.Response(status=status, text=HTML, content_type="text/html")


def prometheus_error(status: int, error_type: str) -> web.Response:
    body = {"status": "error", "errorType": error_type, "error": f"parse error at char 4: {CANARY}"}
    return web.json_response(body, status=status)


def success(data: Any) -> web.Response:
    return web.json_response({"status": "success", "data": data})


# path -> the answer to /{path}/api/v1/query
ANSWERS: dict[str, Callable[[], web.Response]] = {
    "html-200": lambda: html(200),
    "html-400": lambda: html(400),
    "html-500": lambda: html(500),
    "html-503": lambda: html(503),
    "prom-400": lambda: prometheus_error(400, "bad_data"),
    "prom-422": lambda: prometheus_error(422, "execution"),
    "prom-503": lambda: prometheus_error(503, "timeout"),
    "prom-500-undocumented-type": lambda: prometheus_error(500, CANARY),
    "prom-200-error": lambda: prometheus_error(200, "internal"),
    "json-200-list": lambda: web.json_response([CANARY, {"status": "success"}]),
    "reason-500": lambda: web.Response(status=500, reason=f"Oops {CANARY}", text=HTML),
    "status-599": lambda: web.Response(status=599, text=HTML),
    "result-type-secret": lambda: success({"resultType": CANARY, "result": [CANARY]}),
    "result-type-matrix": lambda: success({"resultType": "matrix", "result": [{"metric": {"k": CANARY}}]}),
    "two-series": lambda: success(
        {
            "resultType": "vector",
            "result": [{"metric": {"token": CANARY}, "value": [1, "1"]}, {"metric": {}, "value": [1, "2"]}],
        }
    ),
    "value-secret": lambda: success({"resultType": "vector", "result": [{"metric": {}, "value": [1, CANARY]}]}),
    "scalar-secret": lambda: success({"resultType": "scalar", "result": [1, CANARY]}),
}


@contextlib.asynccontextmanager
async def secret_server() -> AsyncIterator[str]:
    """The answering server on 127.0.0.1; its base URL. ``/slow/`` answers after 2 s (for timeouts)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        case = request.match_info["case"]
        if case == "slow":
            await asyncio.sleep(2)
            return html(200)
        if case not in ANSWERS:
            return web.Response(status=404, text=HTML)
        return ANSWERS[case]()

    app = web.Application()
    app.router.add_get("/{case}/api/v1/query", answer)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def failure(base_url: str, name: str = "arrivalRate", timeout_s: float = 5) -> PrometheusError:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        with pytest.raises(PrometheusError) as raised:
            await query_prometheus(client, base_url, "sum(rate(x[1m]))", name=name)
    return raised.value


def assert_no_leak(message: str) -> None:
    for leaked in (CANARY, "Internal admin", "api key", "parse error", "Oops"):
        assert leaked not in message, message


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("html-200", "HTTP 200 OK but the answer is not JSON"),
        ("html-400", "HTTP 400 Bad Request"),
        ("html-500", "HTTP 500 Internal Server Error"),
        ("html-503", "HTTP 503 Service Unavailable"),
        ("prom-400", "HTTP 400 Bad Request (bad_data)"),
        ("prom-422", "HTTP 422 Unprocessable Entity (execution)"),
        ("prom-503", "HTTP 503 Service Unavailable (timeout)"),
        ("prom-500-undocumented-type", "HTTP 500 Internal Server Error"),
        ("prom-200-error", "HTTP 200 OK (internal)"),
        ("json-200-list", "HTTP 200 OK but not a Prometheus success response"),
        ("reason-500", "HTTP 500 Internal Server Error"),
        ("status-599", "HTTP 599"),
    ],
)
async def test_a_failing_answer_is_reported_by_status_and_query_name_only(case: str, says: str) -> None:
    async with secret_server() as url:
        error = await failure(f"{url}/{case}", name="prefillerQueue")
    assert error.reason == "QueryFailed"
    message = str(error)
    assert message.startswith("Prometheus query prefillerQueue failed: "), message
    assert message.endswith(says), message
    assert_no_leak(message)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("result-type-secret", "returns an unknown result type, not a number"),
        ("result-type-matrix", "returns a matrix, not a number"),
        ("two-series", "returns 2 series; aggregate it to one (sum, avg)"),
        ("value-secret", "returns a sample that is not a number"),
        ("scalar-secret", "returns a sample that is not a number"),
    ],
)
async def test_an_unusable_success_is_reported_in_fixed_words(case: str, says: str) -> None:
    async with secret_server() as url:
        error = await failure(f"{url}/{case}", name="decoderKvUsage")
    assert error.reason == "QueryFailed"
    assert str(error) == f"Prometheus query decoderKvUsage {says}"
    assert_no_leak(str(error))


@pytest.mark.asyncio
async def test_an_unreachable_prometheus_is_reported_without_the_urls_userinfo() -> None:
    port = free_port()  # nothing listens
    error = await failure(f"http://admin:{CANARY}@127.0.0.1:{port}/prometheus/", name="lifetime")
    assert error.reason == "PrometheusUnreachable"
    assert str(error) == (
        f"Prometheus query lifetime: http://127.0.0.1:{port}/prometheus/api/v1/query is unreachable, "
        "connection failed (ConnectError)"
    )
    token_only = await failure(f"http://{CANARY}@127.0.0.1:{port}?token={CANARY}", name="lifetime")
    assert token_only.reason == "PrometheusUnreachable"
    assert f"http://127.0.0.1:{port} is unreachable" in str(token_only)
    assert CANARY not in str(token_only)


@pytest.mark.asyncio
async def test_a_timeout_is_reported_by_class_and_query_name() -> None:
    async with secret_server() as url:
        base = url.replace("http://", f"http://admin:{CANARY}@") + "/slow"
        error = await failure(base, name="outputTokens", timeout_s=0.3)
    assert error.reason == "PrometheusUnreachable"
    message = str(error)
    assert message.startswith(f"Prometheus query outputTokens: {url}/slow/api/v1/query is unreachable, timed out")
    assert "(ReadTimeout)" in message
    assert_no_leak(message)
    assert "admin" not in message


def autoscaled(prometheus_url: str) -> dict[str, Any]:
    pool = copy.deepcopy(POOL)
    pool["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": prometheus_url,
        "evaluationIntervalS": 1,
        "prefillers": {"minReplicas": 1, "maxReplicas": 8},
        "decoders": {"minReplicas": 1, "maxReplicas": 32},
    }
    return pool


def status_and_warnings(kmock: kmocklib.KubernetesEmulator) -> str:
    """The pool's status and every Event the operator posted, as one text."""
    posted = [
        dict(request.data)
        for request in kmock
        if str(request.method).upper().endswith("POST")
        and request.resource is not None
        and request.resource.plural == "events"
        and isinstance(request.data, dict)
    ]
    return json.dumps([kmock.objects[POOLS, NS, "chat"]["status"], posted], default=dict)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_operator_puts_no_answer_of_a_user_supplied_url_into_status_or_events(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    async with secret_server() as url, running_operator(kmock, autoscale_tick_s=0.2) as operator:
        secret_url = url.replace("http://", f"http://admin:{CANARY}@") + "/html-500"
        response = await operator.post(POOLS_URL, json=autoscaled(secret_url))
        assert response.status_code in (200, 201), response.text
        await eventually(lambda: condition(kmock, "AutoscalingActive")["reason"] == "QueryFailed", "QueryFailed", 20)
        held = condition(kmock, "AutoscalingActive")
        assert held["status"] == "False"
        assert "failed: HTTP 500 Internal Server Error; replicas held at" in held["message"]
        # every query failed alike: one sentence naming them all, sorted, whichever failed first
        every = ", ".join(sorted(QUERY_NAMES))
        assert held["message"].startswith(f"Prometheus queries {every} failed: HTTP 500"), held["message"]
        await eventually(lambda: "QueryFailed" in status_and_warnings(kmock), "a Warning event")
        seen = status_and_warnings(kmock)
        assert_no_leak(seen)
        assert "admin" not in seen

        gone = f"http://admin:{CANARY}@127.0.0.1:{free_port()}"  # nothing listens
        fixed = {"spec": {"autoscaling": {"prometheusUrl": gone}}}
        await operator.patch(f"{POOLS_URL}/chat", json=fixed, headers=MERGE)
        await eventually(
            lambda: condition(kmock, "AutoscalingActive")["reason"] == "PrometheusUnreachable", "unreachable", 20
        )
        assert "is unreachable, connection failed (ConnectError)" in condition(kmock, "AutoscalingActive")["message"]
        seen = status_and_warnings(kmock)
        assert_no_leak(seen)
        assert "admin" not in seen
