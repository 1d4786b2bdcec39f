"""Engine-internal fields (coserve.kv.transfer_params): the router strips them wherever vLLM reads them, and
whatever is left, the engine's check finds nothing malformed in."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from coserve.kv.transfer_params import ENGINE_INTERNAL_FIELDS, strip_engine_fields, transfer_params_problem

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from(["remote_host", "remote_port", "do_remote_prefill", "x"]),
                    st.one_of(st.integers(), st.text(max_size=3), st.booleans()), max_size=3),
)  # fmt: skip
WHERE = st.sampled_from(["top", "vllm_xargs", "extra_body", "sampling_params.extra_args"])


def place(body: dict[str, Any], where: str, name: str, value: Any) -> None:
    if where == "top":
        body[name] = value
    elif where == "sampling_params.extra_args":
        body.setdefault("sampling_params", {}).setdefault("extra_args", {})[name] = value
    else:
        body.setdefault(where, {})[name] = value


def read_by_vllm(body: dict[str, Any]) -> list[Any]:
    """Every value vLLM (or a client's literal extra_body) could hand the engine core as transfer parameters."""
    found = []
    for name in ENGINE_INTERNAL_FIELDS:
        for container in (body, body.get("vllm_xargs"), body.get("extra_body"),
                          (body.get("sampling_params") or {}).get("extra_args")):  # fmt: skip
            if isinstance(container, dict) and name in container:
                found.append(container[name])
    return found


@given(st.lists(st.tuples(WHERE, st.sampled_from(ENGINE_INTERNAL_FIELDS), VALUES), max_size=6))
def test_after_the_router_strips_a_body_no_engine_field_is_left_anywhere_vllm_reads(
    placed: list[tuple[str, str, Any]],
) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "vllm_xargs": {"repetition_window": 4}}
    for where, name, value in placed:
        place(body, where, name, value)
    before = copy.deepcopy(body)

    removed = strip_engine_fields(body)

    assert read_by_vllm(body) == []
    assert transfer_params_problem(body) is None and transfer_params_problem(body, generate=True) is None
    assert body["vllm_xargs"]["repetition_window"] == 4 and body["prompt"] == "hi"  # the rest is kept
    assert len(removed) == len(read_by_vllm(before))


def test_only_objects_of_the_right_shape_pass_the_engines_check() -> None:
    assert transfer_params_problem({"kv_transfer_params": None}) is None
    assert transfer_params_problem({"kv_transfer_params": {"do_remote_decode": True}}) is None
    assert transfer_params_problem({"kv_transfer_params": "boom"}) == (
        "kv_transfer_params",
        "must be an object, got str",
    )
    blocks = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h",
              "remote_port": 1}  # fmt: skip
    assert transfer_params_problem({"kv_transfer_params": {**blocks, "remote_block_ids": [[1, 2], [3]]}}) is None
    assert transfer_params_problem({"kv_transfer_params": blocks}) == (
        "kv_transfer_params",
        "a remote prefill needs remote_block_ids",
    )
    assert transfer_params_problem({"kv_transfer_params": {**blocks, "remote_block_ids": [1], "remote_port": True}})


def test_coserves_own_handoff_answer_passes_the_engines_check() -> None:
    """The shm handoff's answer names no remote host or blocks (the decoder finds them by hash): it must pass."""
    from coserve.kv.handoff import shm_prefill_answer

    assert transfer_params_problem({"kv_transfer_params": shm_prefill_answer()}) is None


def test_a_nixl_prefillers_answer_with_nulls_passes() -> None:
    """vLLM 0.32's NixlConnector answers with ``remote_blocks_expiry_time: null`` (seen on the topology test)."""
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
              "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "10.0.0.2", "remote_port": 5600,
              "tp_size": 1, "remote_blocks_expiry_time": None, "remote_block_size": None}  # fmt: skip
    assert transfer_params_problem({"kv_transfer_params": answer}) is None
    assert transfer_params_problem({"kv_transfer_params": {**answer, "remote_host": None}}) == (
        "kv_transfer_params",
        "a remote prefill needs remote_host",
    )
