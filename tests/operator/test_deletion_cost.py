"""Tests of coserve.operator.deletion_cost: decoder pods' deletion costs from the router's pin counts, pure."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.operator.deletion_cost import (
    DELETION_COST_ANNOTATION,
    MAX_DELETION_COST,
    CostPatch,
    DecoderPod,
    deletion_costs,
    pinned_conversations_query,
    pins_by_ip,
)


def costs(pods: list[DecoderPod], pins: dict[str, float]) -> dict[str, int]:
    return {patch.pod: patch.cost for patch in deletion_costs(pods, pins)}


@pytest.mark.parametrize(
    ("pods", "pins", "expected"),
    [
        # each pod gets its own decoder URL's count
        ([DecoderPod("a", "10.0.0.1"), DecoderPod("b", "10.0.0.2")],
         {"http://10.0.0.1:8000": 5, "http://10.0.0.2:8000": 2}, {"a": 5, "b": 2}),
        # IPv6: the router writes the address in brackets; compared in canonical form
        ([DecoderPod("a", "fd00::5")], {"http://[fd00::5]:8000": 3}, {"a": 3}),
        ([DecoderPod("a", "fd00:0:0::5")], {"http://[FD00::5]:8000": 3}, {"a": 3}),
        # a pod with no sample (no conversation, or no IP yet) costs 0: no patch without an annotation ...
        ([DecoderPod("a", "10.0.0.1"), DecoderPod("b", None)], {}, {}),
        # ... and back to 0 where an older cost was written
        ([DecoderPod("a", "10.0.0.1", "7"), DecoderPod("b", None, "3")], {}, {"a": 0, "b": 0}),
        # only pods whose cost changes
        ([DecoderPod("a", "10.0.0.1", "5"), DecoderPod("b", "10.0.0.2", "1")],
         {"http://10.0.0.1:8000": 5, "http://10.0.0.2:8000": 2}, {"b": 2}),
        ([DecoderPod("a", "10.0.0.1", "0")], {}, {}),
        # a value not written as written here is replaced
        ([DecoderPod("a", "10.0.0.1", "05")], {"http://10.0.0.1:8000": 5}, {"a": 5}),
        ([DecoderPod("a", "10.0.0.1", "lots")], {"http://10.0.0.1:8000": 5}, {"a": 5}),
        # whole numbers, clamped to the annotation's int32; negative counts (a mistaken query) read as 0
        ([DecoderPod("a", "10.0.0.1", "1")], {"http://10.0.0.1:8000": 2.6}, {"a": 3}),
        ([DecoderPod("a", "10.0.0.1")], {"http://10.0.0.1:8000": 1e12}, {"a": MAX_DELETION_COST}),
        ([DecoderPod("a", "10.0.0.1")], {"http://10.0.0.1:8000": float("inf")}, {"a": MAX_DELETION_COST}),
        ([DecoderPod("a", "10.0.0.1", "4")], {"http://10.0.0.1:8000": -3}, {"a": 0}),
        ([DecoderPod("a", "10.0.0.1", "4")], {"http://10.0.0.1:8000": float("nan")}, {"a": 0}),
        # samples of decoders that are gone, or that are not addresses, change nothing
        ([DecoderPod("a", "10.0.0.1")], {"http://10.0.0.9:8000": 4, "http://decoder-0:8000": 4, "::": 1}, {}),
        # the same address on two ports: the larger count
        ([DecoderPod("a", "10.0.0.1")], {"http://10.0.0.1:8000": 1, "http://10.0.0.1:9000": 4}, {"a": 4}),
    ],
)  # fmt: skip
def test_each_decoder_costs_its_pinned_conversations(
    pods: list[DecoderPod], pins: dict[str, float], expected: dict[str, int]
) -> None:
    assert costs(pods, pins) == expected


def test_a_patch_is_the_annotation_as_a_string() -> None:
    assert CostPatch("a", 12).annotations() == {DELETION_COST_ANNOTATION: "12"}
    assert DELETION_COST_ANNOTATION == "controller.kubernetes.io/pod-deletion-cost"


def test_pins_are_keyed_by_canonical_address() -> None:
    assert pins_by_ip({"http://[fd00:0::1]:8000": 2, "http://10.1.2.3:8000": 1, "not a url": 5}) == {
        "fd00::1": 2,
        "10.1.2.3": 1,
    }


def test_the_query_takes_the_max_over_router_replicas_with_the_pool_selector() -> None:
    assert pinned_conversations_query("llm", "chat") == (
        'max by (decoder) (coserve_router_pinned_conversations{namespace="llm",pool="chat"})'
    )
    assert pinned_conversations_query("llm", "chat", 'kubernetes_namespace="{namespace}",app="{pool}"') == (
        'max by (decoder) (coserve_router_pinned_conversations{kubernetes_namespace="llm",app="chat"})'
    )


ips = st.ip_addresses().map(str)
counts = st.one_of(st.integers(min_value=-(2**40), max_value=2**40), st.floats(allow_nan=True))


# NOTE: no deadline or too-slow check: the shared CI machines are slow, the property is not
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(ips, st.tuples(counts, st.one_of(st.none(), st.text(max_size=12))), max_size=8))
def test_applying_the_patches_leaves_nothing_to_patch_and_more_pins_never_cost_less(
    world: dict[str, tuple[float, str | None]],
) -> None:
    # pod IP -> (pinned conversations, the annotation the pod carries)
    pods = [DecoderPod(f"pod-{ip}", ip, annotation) for ip, (_, annotation) in world.items()]
    pins = {(f"http://[{ip}]:8000" if ":" in ip else f"http://{ip}:8000"): count for ip, (count, _) in world.items()}
    patches = deletion_costs(pods, pins)
    assert len({p.pod for p in patches}) == len(patches)
    assert all(-(2**31) <= p.cost <= MAX_DELETION_COST for p in patches)
    written = {p.pod: p.annotations()[DELETION_COST_ANNOTATION] for p in patches}
    after = [DecoderPod(p.name, p.ip, written.get(p.name, p.cost)) for p in pods]
    assert deletion_costs(after, pins) == []
    pinned = sorted((0.0 if count != count else count, int(pod.cost or 0)) for pod, (count, _) in
                    zip(after, world.values(), strict=True))  # fmt: skip
    assert [cost for _, cost in pinned] == sorted(cost for _, cost in pinned)
