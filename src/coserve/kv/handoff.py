"""How a pool hands turn 1's KV from a prefiller to a decoder: one decision every component reads.

The router, the prefiller and the decoder must agree on it, or a pool pays for disaggregation and gets
none: a router that never asks for a remote decode makes the prefiller compute turn 1 and drop it, and
the decoder compute it again. So nothing sets it twice. The operator decides the pool's ``Handoff`` from
its rendering (``coserve.operator.resources.pool_handoff``: NixlConnector when both roles run on GPUs)
and renders the engines' connectors and the router's ``kvTransferParams`` from that one value; ``coserve
up`` does the same with the shared-memory handoff.

Both transports follow vLLM's P/D protocol (NixlConnector's):

1. the router sends turn 1 to a prefiller with ``kv_transfer_params: {"do_remote_decode": true}``
   (``ASK_REMOTE_DECODE``), one output token;
2. the prefiller keeps the prompt's KV for a decoder and answers with the parameters a decoder needs,
   ``do_remote_prefill: true`` among them;
3. the router sends the turn to the decoder with those parameters, and the decoder loads the KV instead
   of computing it.

coserve's shared-memory handoff (``handoff_backend: shm``, engines on one machine) writes a prompt's
blocks only for a request that asked for a remote decode (``asks_remote_decode``), and a decoder loads
them only for a request that carries a remote prefill (``has_remote_prefill``), exactly where
NixlConnector would.

A load can fail: a handoff block the prefiller's bounded directory dropped before the decoder read it, a NIXL
transfer that timed out, a host-pool block evicted. Every engine coserve renders or starts sets vLLM's
``kv_load_failure_policy`` to ``KV_LOAD_FAILURE_POLICY`` (the decoder recomputes what it could not load; vLLM's
default fails the request), and coserve's scheduler refuses to start with the other. Pure: no vLLM, no
Kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from coserve.kv.transfer_params import HANDOFF_KEY

# vLLM's kv_load_failure_policy (top level of --kv-transfer-config) on every engine: a block that did not load is
# recomputed, never a failed request (vLLM's default, "fail", ends the request with an error before its first token)
KV_LOAD_FAILURE_POLICY = "recompute"

__all__ = [
    "ASK_REMOTE_DECODE",
    "KV_LOAD_FAILURE_POLICY",
    "Handoff",
    "asks_remote_decode",
    "has_remote_prefill",
    "router_sends_transfer_params",
    "shm_prefill_answer",
]


class Handoff(StrEnum):
    """The transport of a pool's prefill-to-decode handoff."""

    NONE = "none"  # the decoder computes turn 1 itself (engines on CPUs in different pods)
    NIXL = "nixl"  # vLLM's NixlConnector (GPUs, across pods)
    SHM = "shm"  # coserve's shared-memory handoff (engines on one machine: ``coserve up``)


ASK_REMOTE_DECODE: Mapping[str, Any] = {"do_remote_decode": True}


def router_sends_transfer_params(handoff: Handoff) -> bool:
    """Whether the router speaks the P/D protocol (``RouterConfig.kv_transfer_params``): whenever KV moves."""
    return handoff is not Handoff.NONE


def asks_remote_decode(params: object) -> bool:
    """A prefill request's ``kv_transfer_params`` ask for its KV to be kept for a remote decode."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def has_remote_prefill(params: object) -> bool:
    """A decode request's ``kv_transfer_params`` say its prompt was prefilled elsewhere, to be loaded."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


def shm_prefill_answer() -> dict[str, Any]:
    """What a prefiller with the shm handoff answers a remote-decode request with (vLLM returns it to the
    router, which passes it to the decoder): the decoder finds the blocks by their content hashes."""
    return {"do_remote_prefill": True, "do_remote_decode": False, HANDOFF_KEY: Handoff.SHM.value}
