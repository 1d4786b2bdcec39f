"""The benchmarks' client side: streamed requests over real HTTP, their timings, and what engines report.

Who calls what: a script sends its requests with ``replay`` (open loop, token times from the stream) or
``first_token_at`` (one streamed turn), judges them with ``class_report``, reads an engine's Prometheus
counters with ``metric_total`` and empties engines' prefix caches between arms with
``reset_prefix_caches``. Every request goes to a real vLLM server or the coserve router over HTTP;
token times are taken from the stream (``continuous_usage_stats`` says how many tokens each chunk
carries), so a request's gain and SLO attainment are judged from what its client saw, with arrival =
the moment the client sent it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from coserve.scheduling.gain import request_gain, slo_attained
from coserve.scheduling.requests import ClassRegistry

from .stats import reportable_percentile, say
from .workload import BenchRequest


@dataclass
class Outcome:
    request: BenchRequest
    sent_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def warm_up(base: str, lengths: tuple[int, ...] = (8, 200), timeout_s: float = 300.0) -> None:
    """One short completion per prompt length at ``base`` (an engine or the router), before anything is timed:
    vLLM's first steps of each shape, and a pool's first handoff, are slow."""
    for length in lengths:
        httpx.post(
            f"{base}/v1/completions",
            timeout=timeout_s,
            json={"model": "tiny", "prompt": list(range(20, 20 + length)), "max_tokens": 4},
        ).raise_for_status()


async def stream_one(
    client: httpx.AsyncClient, base: str, request: BenchRequest, outcome: Outcome | None = None
) -> Outcome:
    """Send one streaming completion and record when each output token arrived.

    Pass ``outcome`` to keep the tokens received so far if the task is cancelled.
    """
    outcome = outcome or Outcome(request)
    outcome.sent_s = time.time()
    payload = {
        "model": "tiny",
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "priority": request.priority,
        "vllm_xargs": {"coserve_class": request.cls},
    }
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=payload) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.time()
                usage = json.loads(line[6:]).get("usage") or {}
                produced = int(usage.get("completion_tokens") or 0)
                outcome.token_times.extend([now] * (produced - len(outcome.token_times)))
    except httpx.HTTPError as error:
        outcome.error = f"{type(error).__name__}: {error}"
    if outcome.error is None and len(outcome.token_times) != request.max_tokens:
        outcome.error = f"got {len(outcome.token_times)} of {request.max_tokens} tokens"
    return outcome


async def replay(base: str, requests: Sequence[BenchRequest], label: str) -> list[Outcome]:
    """Send every request at its offset (open loop) and wait for all of them to finish."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.monotonic()
        done = 0

        async def at_offset(request: BenchRequest) -> Outcome:
            nonlocal done
            await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
            outcome = await stream_one(client, base, request)
            done += 1
            return outcome

        async def progress() -> None:
            while True:
                await asyncio.sleep(15)
                say(f"{label}: {done}/{len(requests)} finished, {time.monotonic() - start:.0f} s")

        reporter = asyncio.create_task(progress())
        try:
            return list(await asyncio.gather(*(at_offset(r) for r in requests)))
        finally:
            reporter.cancel()


def class_report(outcomes: Sequence[Outcome], classes: ClassRegistry) -> dict[str, dict[str, Any]]:
    """Per class: requests, failures, SLO attainment, TDG gain earned/possible, TTFT and TPOT percentiles."""
    report: dict[str, dict[str, Any]] = {}
    for name in classes.names:
        cls = classes.get(name)
        mine = [o for o in outcomes if o.request.cls == name]
        ok = [o for o in mine if o.error is None]
        earned = possible = 0.0
        attained = classic = 0
        for o in ok:
            gain = request_gain(cls, o.sent_s, cls.ttft_slo_s, cls.tpot_slo_s, o.token_times)
            earned += gain.earned
            possible += gain.possible
            attained += gain.all_on_time
            classic += slo_attained(o.sent_s, cls.ttft_slo_s, cls.tpot_slo_s, o.token_times)
        ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
        tpots = [o.tpot_s for o in ok if o.tpot_s is not None]
        report[name] = {
            "requests": len(mine),
            "failed": len(mine) - len(ok),
            # every token by its deadline (arrival + TTFT SLO + i * TPOT SLO), as the issue defines deadlines
            "slo_attainment": attained / len(mine) if mine else None,
            # the common alternative: TTFT within its SLO and mean time per output token within its SLO
            "ttft_and_mean_tpot_attainment": classic / len(mine) if mine else None,
            "gain": earned,
            "possible_gain": possible,
            "output_tokens": sum(len(o.token_times) for o in ok),
            "n": len(ok),
            # each percentile only from enough requests to support it (MIN_SAMPLES), else null
            "ttft_p50_s": reportable_percentile(ttfts, 50),
            "ttft_p95_s": reportable_percentile(ttfts, 95),
            "ttft_p99_s": reportable_percentile(ttfts, 99),
            "tpot_p50_s": reportable_percentile(tpots, 50),
            "tpot_p95_s": reportable_percentile(tpots, 95),
            "tpot_p99_s": reportable_percentile(tpots, 99),
        }
    return report


def dump_outcome(outcome: Outcome) -> dict[str, Any]:
    """One request's raw record (for ``--dump``): offsets from when it was sent."""
    request = outcome.request
    return {
        "at_s": request.at_s,
        "cls": request.cls,
        "prompt_tokens": len(request.prompt),
        "max_tokens": request.max_tokens,
        "sent_s": outcome.sent_s,
        "token_offsets_s": [t - outcome.sent_s for t in outcome.token_times],
        "error": outcome.error,
    }


def failures(outcomes: Sequence[Outcome]) -> list[str]:
    return [f"{o.request.cls}: {o.error}" for o in outcomes if o.error is not None]


def reset_prefix_caches(urls: Iterable[str]) -> None:
    """Empty each engine's prefix cache, the host KV pool's too (between arms, so none inherits another's)."""
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", params={"reset_external": "true"}, timeout=60).raise_for_status()


def metric_total(urls: str | Iterable[str], sample: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum, over ``urls``' /metrics, of every sample named ``sample`` whose labels include ``labels``.

    Sample names are Prometheus's: a counter's ``_total``, a histogram's ``_sum`` and ``_count``.
    """
    total = 0.0
    for url in [urls] if isinstance(urls, str) else urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for found in family.samples:
                if found.name == sample and all(found.labels.get(k) == v for k, v in (labels or {}).items()):
                    total += found.value
    return total


class TurnFailed(RuntimeError):
    """A streamed turn answered with an HTTP error."""


async def first_token_at(
    session: aiohttp.ClientSession, base: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> float:
    """Stream one completion (``body``, streamed) to ``base``; when its first token arrived (``perf_counter``).

    Reads the stream to its end, so the turn is over when this returns. Raises ``TurnFailed`` on an HTTP
    error and when no token came.
    """
    first = 0.0
    error = b""
    async with session.post(f"{base}/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        if response.status != 200:
            raise TurnFailed(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not first and line.startswith(b"data: ") and b'"text"' in line:
                first = time.perf_counter()
            elif line.startswith(b"data: ") and b'"error"' in line:  # the router's event for a failure mid-answer
                error = line[6:].strip()
    if not first:
        said = f": {error.decode(errors='replace')[:300]}" if error else ""
        raise TurnFailed(f"the stream ended without a token{said}")
    return first
