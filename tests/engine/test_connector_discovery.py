"""coserve's connector and its step metadata are found alone and inside vLLM's MultiConnector (GPU pods)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorMetadata

from coserve.engine.connector import (
    CoServeConnector,
    CoServeConnectorMetadata,
    find_connector,
    find_metadata,
)
from coserve.engine.validation import configured


def bare_connector() -> CoServeConnector:
    return object.__new__(CoServeConnector)  # its __init__ needs a whole vLLM config; identity is what matters


def test_the_connector_is_found_alone_first_last_and_nested() -> None:
    ours, other = bare_connector(), SimpleNamespace()
    assert find_connector(ours) is ours
    assert find_connector(SimpleNamespace(_connectors=[ours, other])) is ours
    assert find_connector(SimpleNamespace(_connectors=[other, ours])) is ours
    assert find_connector(SimpleNamespace(_connectors=[SimpleNamespace(_connectors=[ours])])) is ours
    assert find_connector(SimpleNamespace(_connectors=[other])) is None
    assert find_connector(None) is None


def test_the_step_metadata_is_found_inside_multiconnector_metadata() -> None:
    ours = CoServeConnectorMetadata(step_id=7, board="coserve-sp-x", safepoints=True)
    assert find_metadata(ours) is ours
    assert find_metadata(MultiKVConnectorMetadata(metadata=(ours, KVConnectorMetadata()))) is ours
    assert find_metadata(MultiKVConnectorMetadata(metadata=(KVConnectorMetadata(), ours))) is ours
    assert find_metadata(MultiKVConnectorMetadata(metadata=(KVConnectorMetadata(),))) is None
    assert find_metadata(None) is None


@pytest.mark.parametrize(
    ("transfer", "expected"),
    [
        (None, False),
        (SimpleNamespace(kv_connector="CoServeConnector", kv_connector_extra_config={}), True),
        (
            SimpleNamespace(
                kv_connector="MultiConnector",
                kv_connector_extra_config={
                    "connectors": [{"kv_connector": "CoServeConnector"}, {"kv_connector": "NixlConnector"}]
                },
            ),
            True,
        ),
        (
            SimpleNamespace(
                kv_connector="MultiConnector",
                kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector"}]},
            ),
            False,
        ),
        (SimpleNamespace(kv_connector="NixlConnector", kv_connector_extra_config=None), False),
    ],
)
def test_the_validator_sees_coserves_connector_in_either_configuration(transfer: object, expected: bool) -> None:
    assert configured(transfer) is expected


@pytest.mark.parametrize(
    ("extra", "piecewise"),
    [
        ({"safepoints": True}, False),  # uniform decode as full graphs; prefill steps piecewise, with safepoints
        ({"safepoints": False}, False),
        ({"safepoints": True, "host_memory_bytes": 1 << 30}, True),  # per-layer reloads must run in every step
        ({"safepoints": True, "handoff_backend": "shm"}, True),
    ],
)
def test_only_per_layer_reloads_force_piecewise_cuda_graphs(extra: dict[str, object], piecewise: bool) -> None:
    assert CoServeConnector.requires_piecewise_for_cudagraph(extra) is piecewise


def test_the_host_pools_counters_join_coserves_entry_of_multiconnector_stats() -> None:
    """In a MultiConnector (GPU pods) the step's stats are keyed by connector; coserve's scheduler-side counters
    go into its own entry, never beside the entries (vLLM's to_dict died on a bare number there)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    from coserve.engine.kv_metrics import CoServeKVStats, merge_stats, own_stats

    workers = MultiKVConnectorStats()
    workers["CoServeConnector"] = CoServeKVStats(data={"bytes_offloaded": 100, "step_copy_s": [0.01]})
    assert own_stats(workers) is workers["CoServeConnector"]
    merged = merge_stats(workers, CoServeKVStats(data={"hits": 3, "pool_occupancy": 0.5}))
    assert merged.to_dict() == {"CoServeConnector": {"bytes_offloaded": 100, "step_copy_s": [0.01], "hits": 3,
                                                     "pool_occupancy": 0.5}}  # fmt: skip
    alone = merge_stats(MultiKVConnectorStats(), CoServeKVStats(data={"hits": 1}))  # only the other connector ran
    assert alone.to_dict() == {"CoServeConnector": {"hits": 1}}
    assert merge_stats(None, CoServeKVStats(data={"hits": 1})).data == {"hits": 1}
    single = CoServeKVStats(data={"hits": 1})
    assert merge_stats(single, CoServeKVStats(data={"hits": 2})).data == {"hits": 3}
