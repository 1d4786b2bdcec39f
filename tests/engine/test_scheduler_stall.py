"""A step that ran nothing is followed by one that runs what the policy held back, and the engine lives on.

``TDGScheduler`` runs here in-process as vLLM's engine core drives it: vLLM's own ``Scheduler`` machinery
(KV cache manager, block pool, prefix-cache hashing, waiting queue) on the tiny model's config, with no
model runner. The model runner is the one part replaced, by ``run_step`` below, because the path under
test is the scheduler's bookkeeping between steps: what a forward pass would return (one sampled token
per request that has finished its prompt) is all the scheduler reads from it.

The path: two offline requests hold most of the KV cache; an interactive request arrives whose first
chunk needs more blocks than are free. The policy puts it first and gives it the whole token budget, so
the running offline requests are held back; vLLM cannot allocate the interactive request's blocks, so
the step schedules nothing ("stalled"). The next step must hold nothing back so the engine progresses;
the running requests then have no allowance from the policy, which once raised ``KeyError`` and killed
the engine core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from coserve.engine.scheduler import TDGScheduler

BLOCK = 16
NUM_BLOCKS = 40  # 39 usable blocks: 624 tokens, enough for one max_model_len request
MAX_MODEL_LEN = 512
STEP_TOKENS = 256


def make_scheduler(model: Path, tweak: Callable[[VllmConfig], None] | None = None) -> TDGScheduler:
    init_none_hash(sha256)
    model_config = ModelConfig(
        model=str(model), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=BLOCK, cache_dtype="auto")
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config)
    if tweak is not None:
        tweak(vllm_config)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return TDGScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def with_coserve_connector(
    engine_id: str, kv_role: str, extra: dict[str, Any], load_failure_policy: str | None = None
) -> Callable[[VllmConfig], None]:
    """A ``make_scheduler`` tweak: coserve's connector as ``kv_role`` with ``extra`` (and vLLM's
    kv_load_failure_policy when given), as the engine's --kv-transfer-config would set it."""
    from vllm.config import KVTransferConfig

    def tweak(vllm_config: VllmConfig) -> None:
        policy = {"kv_load_failure_policy": load_failure_policy} if load_failure_policy else {}
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="CoServeConnector", kv_connector_module_path="coserve.engine.connector", kv_role=kv_role,
            engine_id=engine_id, kv_connector_extra_config=extra, **policy,
        )  # fmt: skip
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True  # as VllmConfig sets it for a connector

    return tweak


def make_request(request_id: str, prompt_tokens: int, cls: str, max_tokens: int, first_token: int) -> Request:
    """A prompt of distinct token ids from ``first_token`` (no prefix shared with another request's)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"coserve_class": cls})
    return Request(
        request_id,
        list(range(first_token, first_token + prompt_tokens)),
        params,
        None,
        arrival_time=time.time(),
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def run_step(scheduler: TDGScheduler) -> dict[str, int]:
    """One engine-core step: schedule, then what the forward pass returns, then the scheduler's update."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in ids
    ]
    runner: Any = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    scheduler.update_from_output(output, runner)
    return dict(output.num_scheduled_tokens)


def test_after_a_step_that_ran_nothing_the_held_requests_run_and_the_urgent_one_starts(tiny_model: Path) -> None:
    scheduler = make_scheduler(tiny_model)
    for index, name in enumerate(("offline-0", "offline-1")):
        scheduler.add_request(make_request(name, 200, "offline", max_tokens=24, first_token=1 + 200 * index))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or len(scheduler.running) < 2:
        run_step(scheduler)
    free_tokens = scheduler.kv_cache_manager.block_pool.get_num_free_blocks() * BLOCK
    assert free_tokens < STEP_TOKENS, "the urgent request's first chunk must not fit beside the offline ones"

    scheduler.add_request(make_request("urgent", 300, "interactive", max_tokens=4, first_token=500))
    steps: list[dict[str, int]] = []
    while "urgent" not in (step := run_step(scheduler)):
        steps.append(step)
        assert len(steps) < 200, f"the urgent request never started: {steps[-4:]}"
    assert {} in steps, "no step stalled: the path under test was not reached"
    stalled_at = steps.index({})
    # the step after a stall runs the offline requests the policy held back
    assert set(steps[stalled_at + 1]) == {"offline-0", "offline-1"}
    # it starts once an offline request has finished and freed the KV it needed
    assert {"offline-0", "offline-1"} - set(scheduler.requests)
    assert step["urgent"] == STEP_TOKENS


def test_a_new_request_beside_running_decodes_gets_its_allowance_not_one_token(tiny_model: Path) -> None:
    """vLLM caps every prefill chunk at one threshold: it must come from the prefills' allowances, not the decodes'.

    With only decodes running, their allowance of 1 token once capped a new request's first chunk at 1 token,
    so every request under load lost a step before its prefill began (and vLLM started every waiting request
    the budget had room for, at one token each).
    """
    scheduler = make_scheduler(tiny_model)
    for index in range(3):
        scheduler.add_request(
            make_request(f"decode-{index}", 32, "standard", max_tokens=40, first_token=1 + 32 * index)
        )
    while len(scheduler.running) < 3 or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        run_step(scheduler)
    scheduler.add_request(make_request("new", 120, "standard", max_tokens=4, first_token=300))
    step = run_step(scheduler)
    assert all(step[f"decode-{index}"] == 1 for index in range(3))
    assert step.get("new", 0) > 1, f"the new request's first chunk was {step.get('new', 0)} tokens"


# --- one step in flight ----------------------------------------------------------------------------------
# The CPU platform forces async scheduling off when VllmConfig is built, so these set it afterwards, as
# vLLM's CUDA platform leaves it (tests/engine/test_cuda_config.py resolves that configuration).


def _async_on(config: VllmConfig) -> None:
    config.scheduler_config.async_scheduling = True


def _two_stages(config: VllmConfig) -> None:
    config.parallel_config.pipeline_parallel_size = 2


@pytest.mark.parametrize(
    ("tweak", "flag"), [(_async_on, "--no-async-scheduling"), (_two_stages, "--pipeline-parallel-size")],
    ids=["async scheduling", "pipeline parallelism"],
)  # fmt: skip
def test_the_scheduler_refuses_to_start_with_several_steps_in_flight(
    tiny_model: Path, tweak: Callable[[VllmConfig], None], flag: str
) -> None:
    with pytest.raises(ValueError, match=flag):
        make_scheduler(tiny_model, tweak)


# --- steps too short to need a safepoint --------------------------------------------------------------------


def test_a_step_predicted_within_the_threshold_runs_without_safepoints(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cost model of 10 ms per step plus 1 ms per token and ``safepoint_min_step_s`` 0.05: a
    16-token step (26 ms) is sent to the workers without safepoints, a 256-token one (266 ms) with them."""

    from coserve.engine.connector import find_metadata
    from coserve.scheduling.config import CONFIG_ENV

    config = tmp_path / "engine.json"
    config.write_text('{"costModel": {"k1": 0.001, "k2": 0, "k3": 0, "k4": 0, "k5": 0.01}}')
    monkeypatch.setenv(CONFIG_ENV, str(config))

    with_connector = with_coserve_connector(f"minstep{tmp_path.name[-10:]}", "kv_both", {"safepoint_min_step_s": 0.05})

    scheduler = make_scheduler(tiny_model, with_connector)
    try:
        checked = {}
        for name, tokens in (("short", 16), ("long", 256)):
            scheduler.add_request(
                make_request(name, tokens, "standard", max_tokens=2, first_token=1 + 300 * len(checked))
            )
            output = scheduler.schedule()
            metadata = find_metadata(output.kv_connector_metadata)
            assert metadata is not None
            checked[name] = metadata.safepoints
            assert scheduler.board is not None and scheduler.board.posted_step() is not None  # posted all the same
            for request_id in list(output.num_scheduled_tokens):
                scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        assert checked == {"short": False, "long": True}
        assert scheduler.num_steps_unchecked == 1
    finally:
        scheduler.shutdown()


# --- a KV load that fails ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_scheduler_refuses_an_engine_that_fails_a_request_whose_handoff_did_not_load(
    tiny_model: Path, tmp_path: Path, policy: str
) -> None:
    """vLLM's default kv_load_failure_policy ends a request with an error and no token when a block it planned to
    load is gone (the prefiller's bounded handoff directory dropped it): coserve's engines recompute instead."""
    handoff = {"handoff_backend": "shm", "handoff_path": str(tmp_path / "handoff")}
    with_handoff = with_coserve_connector(f"loadfail{policy}{tmp_path.name[-10:]}", "kv_consumer", handoff, policy)

    if policy == "fail":
        with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
            make_scheduler(tiny_model, with_handoff)
        return
    scheduler = make_scheduler(tiny_model, with_handoff)
    try:
        assert scheduler.recompute_kv_load_failures
    finally:
        scheduler.shutdown()
