"""Which decoders a scale-down removes: pod deletion costs from the live conversations pinned to each. Pure.

Who calls it: the operator's autoscaler (``coserve.operator.autoscaler``), just
before it lowers the decoder Deployment's replicas. It runs
``pinned_conversations_query`` against Prometheus, lists the decoder pods, and
merge-patches the annotations ``deletion_costs`` returns. The ReplicaSet
controller then deletes the pods with the lowest
``controller.kubernetes.io/pod-deletion-cost`` first (after pending and not-ready
pods), so the decoders holding the fewest conversations go and the busiest stay.

The counts come from the router's gauge ``coserve_router_pinned_conversations``,
labelled ``decoder="http://<pod IP>:8000"`` (``http://[<IPv6>]:8000``). Each router
replica keeps its own pin table and a conversation can be pinned in several
replicas' tables, so the query takes the ``max`` over replicas, not the sum.

The cost is a hint, not a guarantee: the counts are as old as the last scrape, and
a decoder chosen for deletion still drains its conversations before it exits.
This module imports nothing but the standard library and ``coserve.autoscaling``.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from coserve.autoscaling.queries import fill_query

__all__ = [
    "DECODER_LABEL",
    "DELETION_COST_ANNOTATION",
    "MAX_DELETION_COST",
    "MIN_DELETION_COST",
    "PINNED_CONVERSATIONS_QUERY",
    "CostPatch",
    "DecoderPod",
    "deletion_costs",
    "pinned_conversations_query",
    "pins_by_ip",
]

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# the annotation holds an int32 (the API server rejects anything else)
MIN_DELETION_COST = -(2**31)
MAX_DELETION_COST = 2**31 - 1

# One sample per decoder URL; {selector} as in coserve.autoscaling.queries (spec.autoscaling.selector).
PINNED_CONVERSATIONS_QUERY = "max by (decoder) (coserve_router_pinned_conversations{{selector}})"
DECODER_LABEL = "decoder"


@dataclass(frozen=True)
class DecoderPod:
    """A decoder pod as the autoscaler read it: ``ip`` is ``status.podIP`` (``None`` before it has one)."""

    name: str
    ip: str | None
    cost: str | None = None  # the deletion-cost annotation as written on the pod, if any


@dataclass(frozen=True)
class CostPatch:
    """Set ``pod``'s deletion cost to ``cost``."""

    pod: str
    cost: int

    def annotations(self) -> dict[str, str]:
        """The pod's ``metadata.annotations`` to merge-patch (annotation values are strings)."""
        return {DELETION_COST_ANNOTATION: str(self.cost)}


def pinned_conversations_query(namespace: str, pool: str, selector: str | None = None) -> str:
    """The PromQL for one pool's pins per decoder; ``selector`` is ``spec.autoscaling.selector``.

    Placeholders are filled as the autoscaler's signals are (``coserve.autoscaling.queries.fill_query``).
    """
    return fill_query(PINNED_CONVERSATIONS_QUERY, namespace, pool, selector)


def pins_by_ip(pins: Mapping[str, float]) -> dict[str, float]:
    """Decoder URL -> pins, as pod IP -> pins; a URL whose host is no IP, and NaN values, are dropped.

    Addresses are compared in canonical form (``fd00:0::5`` is ``fd00::5``). Two URLs
    of one address (another port) keep the larger count.
    """
    out: dict[str, float] = {}  # canonical IP -> pinned conversations
    for url, value in pins.items():
        ip = _canonical_ip(_host(url))
        if ip is None or math.isnan(value):
            continue
        out[ip] = max(out.get(ip, value), value)
    return out


def deletion_costs(pods: Sequence[DecoderPod], pins: Mapping[str, float]) -> list[CostPatch]:
    """The annotation patches that make each pod's deletion cost its pinned-conversation count.

    ``pins``: decoder URL -> conversations pinned to it (``max by (decoder)`` of the
    router's gauge). A pod with no sample (no IP yet, or no conversation ever
    pinned to it) costs 0. Costs are whole numbers clamped to the annotation's int32
    range; a negative count (a mistaken query) reads as 0. Only pods whose cost
    changes are returned: an absent annotation already means 0; any other value not
    written as this function writes it (``"7"``, not ``"07"`` or ``"x"``) is replaced.
    """
    counts = pins_by_ip(pins)
    patches = []
    for pod in pods:
        ip = _canonical_ip(pod.ip) if pod.ip else None
        cost = _cost(counts.get(ip, 0.0) if ip is not None else 0.0)
        if (pod.cost if pod.cost is not None else "0") != str(cost):  # absent: the controller's default, 0
            patches.append(CostPatch(pod.name, cost))
    return patches


def _cost(count: float) -> int:
    if math.isnan(count) or count <= 0:
        return 0
    if math.isinf(count):
        return MAX_DELETION_COST
    return max(MIN_DELETION_COST, min(MAX_DELETION_COST, round(count)))


def _host(url: str) -> str | None:
    try:
        return urlsplit(url).hostname  # lower-cased, IPv6 brackets removed
    except ValueError:
        return None


def _canonical_ip(host: str | None) -> str | None:
    if not host:
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None
