"""The scheduler half of the KV offload (coserve.engine.offload.OffloadPlanner), step by step.

vLLM's Request and SchedulerOutput are stood in for by plain objects carrying
only the fields the planner reads (a test double: building real ones needs a
running engine; tests/engine/test_kv_offload.py covers the planner inside one).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coserve.engine.offload import OffloadPlanner, model_salt
from coserve.kv.config import KVSettings
from coserve.scheduling.config import parse_engine_config

BLOCK = 4
BLOCK_BYTES = 1000


def request(rid: str, tokens: list[int], cls: str) -> Any:
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        priority=0,
        sampling_params=SimpleNamespace(extra_args={"coserve_class": cls}),
    )


def new_step(*entries: tuple[Any, list[int], int, int]) -> Any:
    """(request, block ids, computed before, scheduled) for requests scheduled for the first time."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(blocks,), num_computed_tokens=before)
            for r, blocks, before, _ in entries
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={r.request_id: n for r, _, _, n in entries},
        total_num_scheduled_tokens=sum(n for *_, n in entries),
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )


def cached_step(*entries: tuple[Any, int, int], finished: set[str] = frozenset(), preempted: Any = frozenset()) -> Any:
    """(request, computed before, scheduled) for requests scheduled again, no new blocks; and what finished or
    was preempted since the last step (``preempted=None``: a vLLM that does not report preemptions)."""
    cached = SimpleNamespace(
        req_ids=[r.request_id for r, _, _ in entries],
        new_block_ids=[None for _ in entries],
        num_computed_tokens=[before for _, before, _ in entries],
        resumed_req_ids=set(),
    )
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.request_id: n for r, _, n in entries},
        total_num_scheduled_tokens=sum(n for *_, n in entries),
        finished_req_ids=set(finished),
        preempted_req_ids=None if preempted is None else set(preempted),
    )


def planner(capacity_blocks: int, bandwidth: float = 1e12) -> OffloadPlanner:
    config = parse_engine_config({"costModel": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0.01}}, 64)
    settings = KVSettings(host_memory_bytes=capacity_blocks * BLOCK_BYTES, copy_bandwidth_bytes_per_s=bandwidth)
    return OffloadPlanner(
        settings, block_size=BLOCK, block_bytes=BLOCK_BYTES, salt=model_salt("m"), config=config,
        produce=False, consume=False,
    )  # fmt: skip


def test_completed_blocks_are_saved_once_and_found_after_the_step_completed() -> None:
    p = planner(8)
    r = request("a", list(range(10)), "standard")  # 2 full blocks of 4, and 2 tokens
    p.allocated(r, [7, 3, 9], 0)
    plan = p.plan_step(new_step((r, [7, 3, 9], 0, 10)))
    assert [c.device_block for c in plan.saves] == [7, 3]
    again = request("b", list(range(10)), "standard")
    assert p.matched_tokens(again, 0) == 0  # the copies of that step are not known to be done yet
    p.step_done()
    assert p.matched_tokens(again, 0) == 2 * BLOCK
    p.allocated(again, [1, 2, 5], 2 * BLOCK)
    assert [(c.device_block, c.slot) for c in p.plan_step(new_step()).loads] == [(1, 0), (2, 1)]


def test_the_copy_budget_limits_a_step_and_the_top_class_goes_first() -> None:
    p = planner(8, bandwidth=0.1 * BLOCK_BYTES / 0.01 / 0.1)  # 10 ms step, 10 %: one block per step
    low, top = request("low", list(range(8)), "offline"), request("top", list(range(100, 108)), "interactive")
    for r, blocks in ((low, [1, 2]), (top, [3, 4])):
        p.allocated(r, blocks, 0)
    plan = p.plan_step(new_step((low, [1, 2], 0, 8), (top, [3, 4], 0, 8)))
    assert [c.device_block for c in plan.saves] == [3]  # the interactive request's first block
    p.step_done()
    cached = SimpleNamespace(req_ids=["low", "top"], new_block_ids=[None, None], num_computed_tokens=[8, 8],
                             resumed_req_ids=set())  # fmt: skip
    step = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"low": 1, "top": 1}, total_num_scheduled_tokens=2,
                           finished_req_ids=set(), preempted_req_ids=set())  # fmt: skip
    assert [c.device_block for c in p.plan_step(step).saves] == [4]  # the rest follows in later steps


def test_an_abandoned_step_never_commits_its_copies() -> None:
    p = planner(8)
    r = request("a", list(range(8)), "standard")
    p.allocated(r, [1, 2], 0)
    p.plan_step(new_step((r, [1, 2], 0, 8)))
    # the step was abandoned at a safepoint: vLLM never reports it (no step_done)
    p.plan_step(new_step())
    p.step_done()
    assert p.matched_tokens(request("b", list(range(9)), "standard"), 0) == 0
    assert p.pool.stats.aborted == 2


def test_an_abandoned_steps_blocks_are_copied_out_again_once_recomputed() -> None:
    """Its copy-outs were dropped (partly computed blocks); the rollback puts the request back, and the step
    that recomputes the blocks copies them out."""
    p = planner(8)
    r = request("a", list(range(8)), "standard")
    p.allocated(r, [1, 2], 0)
    assert [c.device_block for c in p.plan_step(new_step((r, [1, 2], 0, 8))).saves] == [1, 2]
    p.roll_back({"a": 0})  # the step was abandoned: TDGScheduler rolled it back to 0 computed tokens
    assert [c.device_block for c in p.plan_step(cached_step((r, 0, 8))).saves] == [1, 2]


def test_the_measured_copy_bandwidth_replaces_the_setting() -> None:
    p = planner(8, bandwidth=2e9)
    p.observe_copies(1e6, 0.01)
    assert p.bandwidth_bytes_per_s == 1e8
    p.observe_copies(2e6, 0.01)
    assert p.bandwidth_bytes_per_s == 0.8 * 1e8 + 0.2 * 2e8
    p.observe_copies(0, 0)  # nothing copied: nothing learned
    assert p.bandwidth_bytes_per_s == 0.8 * 1e8 + 0.2 * 2e8


def fence_after(finished: set[str], preempted: set[str] | None, scheduled_again: tuple[str, ...] = ("a", "b")) -> bool:
    """Step 1 copies out request a's blocks and none of b's (b has no full block yet); step 2 schedules
    ``scheduled_again`` after ``finished`` finished and ``preempted`` were preempted: its ``fence_saves``."""
    p = planner(8)
    a, b = request("a", list(range(8)), "standard"), request("b", list(range(100, 104)), "standard")
    p.allocated(a, [1, 2], 0)
    p.allocated(b, [3], 0)
    first = p.plan_step(new_step((a, [1, 2], 0, 8), (b, [3], 0, 3)))
    assert [c.device_block for c in first.saves] == [1, 2] and not first.fence_saves
    p.step_done()
    computed = {"a": (a, 8, 1), "b": (b, 3, 1)}
    return p.plan_step(cached_step(*(computed[r] for r in scheduled_again), finished=finished,
                                   preempted=preempted)).fence_saves  # fmt: skip


def test_the_next_forward_is_fenced_when_a_request_being_copied_out_finishes_or_is_preempted() -> None:
    # on CUDA the copy-outs overlap the next forward; it may rewrite their blocks only if they were freed
    assert fence_after({"a"}, set(), scheduled_again=("b",))
    assert fence_after(set(), {"a"}, scheduled_again=("b",))
    assert not fence_after(set(), set())  # nothing freed
    assert not fence_after({"b"}, set(), scheduled_again=("a",))  # b had no copy-outs
    assert not fence_after(set(), {"b"}, scheduled_again=("a",))
    # a vLLM that does not report preemptions: any finish, or a request being copied out not scheduled again
    assert fence_after({"b"}, None, scheduled_again=("a",))
    assert fence_after(set(), None, scheduled_again=("b",))
    assert not fence_after(set(), None)


def test_no_fence_follows_a_step_without_copy_outs() -> None:
    p = planner(8)
    a = request("a", list(range(3)), "standard")  # no full block: nothing to copy out
    p.allocated(a, [1], 0)
    assert not p.plan_step(new_step((a, [1], 0, 3))).saves
    p.step_done()
    assert not p.plan_step(cached_step(finished={"a"}, preempted={"a"})).fence_saves


def handoff_planner(produce: bool, consume: bool, directory: str) -> OffloadPlanner:
    config = parse_engine_config({"costModel": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0.01}}, 64)
    settings = KVSettings(handoff_backend="shm", handoff_path=directory, copy_bandwidth_bytes_per_s=1e12)
    return OffloadPlanner(
        settings, block_size=BLOCK, block_bytes=BLOCK_BYTES, salt=model_salt("m"), config=config,
        produce=produce, consume=consume,
    )  # fmt: skip


def with_params(r: Any, params: dict[str, Any] | None) -> Any:
    r.kv_transfer_params = params
    return r


def test_a_prefiller_keeps_blocks_for_a_decoder_only_when_the_router_asked_for_a_remote_decode(tmp_path: Any) -> None:
    """vLLM's P/D protocol, as NixlConnector follows it: do_remote_decode in, do_remote_prefill out."""
    p = handoff_planner(produce=True, consume=False, directory=str(tmp_path))
    asked = with_params(request("a", list(range(10)), "standard"), {"do_remote_decode": True})
    plain = with_params(request("b", list(range(100, 110)), "standard"), None)
    for r, blocks in ((asked, [1, 2, 3]), (plain, [4, 5, 6])):
        assert p.matched_tokens(r, 0) == 0
        p.allocated(r, blocks, 0)
    plan = p.plan_step(new_step((asked, [1, 2, 3], 0, 10), (plain, [4, 5, 6], 0, 10)))
    assert [(c.device_block, c.handoff is not None) for c in plan.saves] == [(1, True), (2, True)]
    assert p.remote_decode_answer(asked) == {"do_remote_prefill": True, "do_remote_decode": False,
                                             "coserve_handoff": "shm"}  # fmt: skip
    assert p.remote_decode_answer(plain) is None


def test_a_decoder_loads_handed_off_blocks_only_for_a_request_that_carries_a_remote_prefill(tmp_path: Any) -> None:
    producer = handoff_planner(produce=True, consume=False, directory=str(tmp_path))
    tokens = list(range(10))
    asked = with_params(request("a", tokens, "standard"), {"do_remote_decode": True})
    producer.matched_tokens(asked, 0)
    producer.allocated(asked, [1, 2, 3], 0)
    for copy in producer.plan_step(new_step((asked, [1, 2, 3], 0, 10))).saves:  # what the worker writes
        (tmp_path / f"{copy.handoff}.0.kv").write_bytes(b"kv")
    decoder = handoff_planner(produce=False, consume=True, directory=str(tmp_path))
    routed = with_params(request("d1", tokens, "standard"), {"do_remote_prefill": True, "coserve_handoff": "shm"})
    unasked = with_params(request("d2", tokens, "standard"), None)
    assert decoder.matched_tokens(routed, 0) == 2 * BLOCK
    assert decoder.matched_tokens(unasked, 0) == 0  # without the prefiller's answer the decoder computes it


def test_a_remote_decode_requests_blocks_are_all_written_whatever_the_copy_budget(tmp_path: Any) -> None:
    """The copy budget bounds host-offload copies per step; a prefiller's remote-decode request ends with its
    prefill step (its blocks are freed then), so every block a decoder will look for is written in that step.
    Under the budget alone a 10 ms step would write one block and the decoder recompute the other two."""
    config = parse_engine_config({"costModel": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0.01}}, 64)
    settings = KVSettings(handoff_backend="shm", handoff_path=str(tmp_path),
                          copy_bandwidth_bytes_per_s=0.1 * BLOCK_BYTES / 0.01 / 0.1)  # one block per step  # fmt: skip
    p = OffloadPlanner(settings, block_size=BLOCK, block_bytes=BLOCK_BYTES, salt=model_salt("m"), config=config,
                       produce=True, consume=False)  # fmt: skip
    asked = with_params(request("a", list(range(13)), "standard"), {"do_remote_decode": True})
    p.matched_tokens(asked, 0)
    p.allocated(asked, [1, 2, 3, 4], 0)
    plan = p.plan_step(new_step((asked, [1, 2, 3, 4], 0, 13)))
    assert [c.device_block for c in plan.saves] == [1, 2, 3]
    assert all(c.handoff is not None for c in plan.saves)


def test_a_decoder_waits_for_handoff_files_still_being_written_then_gives_up(tmp_path: Any) -> None:
    """The prefiller answers as its step ends; its worker writes the files just after. A decoder that looks
    first answers None (vLLM asks again next step) until they are there, for at most handoff_wait_s; then it
    loads what is there and computes the rest, and says so."""
    producer = handoff_planner(produce=True, consume=False, directory=str(tmp_path))
    tokens = list(range(10))
    asked = with_params(request("a", tokens, "standard"), {"do_remote_decode": True})
    producer.matched_tokens(asked, 0)
    producer.allocated(asked, [1, 2, 3], 0)
    written = [copy.handoff for copy in producer.plan_step(new_step((asked, [1, 2, 3], 0, 10))).saves]
    assert len(written) == 2
    (tmp_path / f"{written[0]}.0.kv").write_bytes(b"kv")  # the second block is not written yet
    decoder = handoff_planner(produce=False, consume=True, directory=str(tmp_path))
    routed = with_params(request("d", tokens, "standard"), {"do_remote_prefill": True, "coserve_handoff": "shm"})
    assert decoder.matched_tokens(routed, 0) is None
    assert decoder.matched_tokens(routed, 0) is None
    (tmp_path / f"{written[1]}.0.kv").write_bytes(b"kv")
    assert decoder.matched_tokens(routed, 0) == 2 * BLOCK
    assert decoder.take_stats()["handoff_waits"] == 2
    # a block that never comes: the decoder waits handoff_wait_s (0 here), then loads what it found
    impatient = OffloadPlanner(
        KVSettings(handoff_backend="shm", handoff_path=str(tmp_path), handoff_wait_s=0.0), block_size=BLOCK,
        block_bytes=BLOCK_BYTES, salt=model_salt("m"), config=decoder.config, produce=False, consume=True,
    )  # fmt: skip
    (tmp_path / f"{written[1]}.0.kv").unlink()
    routed_again = with_params(request("e", tokens, "standard"), {"do_remote_prefill": True})
    assert impatient.matched_tokens(routed_again, 0) == BLOCK
    assert impatient.take_stats()["handoff_misses"] == 1
