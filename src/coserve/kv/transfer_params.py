"""Engine-internal request fields: the one rule for where vLLM reads them and what a well-formed one is.

vLLM reads a request's KV-transfer parameters (and the encoder cache's) from the body's top level, and, since
it copies ``vllm_xargs`` into the sampling parameters' ``extra_args`` where the engine core looks them up,
from ``vllm_xargs`` too; ``/inference/v1/generate`` carries them in ``sampling_params.extra_args``. With
NixlConnector they name the host, port, engine and blocks a decoder pulls KV from, and a value of the wrong
shape reaches the connector's scheduler side, where it kills the engine core (``params.get`` on a string,
``params["remote_host"]`` on a dict without it).

- ``strip_engine_fields``: what the router does to every client body (chat, completions, each batch line)
  before anything else reads it: the fields go, wherever vLLM would read them (and from a literal
  ``extra_body`` object, which some clients send instead of merging it).
- ``transfer_params_problem``: what the engine's middleware asks of every body, trusted or not, before vLLM
  parses it: ``(field path, reason)`` for a malformed one, answered with a 400.

Who calls it: ``coserve.router.admission`` (``drop_engine_fields``) and ``coserve.engine.validation``
(``check_request``). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ENGINE_INTERNAL_FIELDS", "HANDOFF_KEY", "NESTED_IN", "strip_engine_fields", "transfer_params_problem"]

ENGINE_INTERNAL_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# the objects inside a request body where vLLM (or a client that did not merge its extra_body) puts them
NESTED_IN = ("vllm_xargs", "extra_body")

_MISSING = object()
# coserve's shm handoff's parameters carry it (``coserve.kv.handoff.shm_prefill_answer``)
HANDOFF_KEY = "coserve_handoff"
_BOOL = ("do_remote_prefill", "do_remote_decode")
_STR = ("remote_engine_id", "remote_request_id", "remote_host")
_INT = ("remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens", "remote_block_size")
_NUMBER = ("remote_blocks_expiry_time",)
# what NixlConnector indexes without a default once a request asks for a remote prefill
_REQUIRED_FOR_REMOTE_PREFILL = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                                "remote_port")  # fmt: skip


def strip_engine_fields(body: dict[str, Any]) -> list[str]:
    """Remove every engine-internal field from a client's ``body``, in place; the paths removed."""
    removed = [name for name in ENGINE_INTERNAL_FIELDS if body.pop(name, _MISSING) is not _MISSING]
    for outer in NESTED_IN:
        inner = body.get(outer)
        if isinstance(inner, dict):
            removed += [f"{outer}.{name}" for name in ENGINE_INTERNAL_FIELDS
                        if inner.pop(name, _MISSING) is not _MISSING]  # fmt: skip
    params = body.get("sampling_params")
    extra = params.get("extra_args") if isinstance(params, dict) else None
    if isinstance(extra, dict):
        removed += [f"sampling_params.extra_args.{name}" for name in ENGINE_INTERNAL_FIELDS
                    if extra.pop(name, _MISSING) is not _MISSING]  # fmt: skip
    return removed


def transfer_params_problem(body: Mapping[str, Any], generate: bool = False) -> tuple[str, str] | None:
    """The first malformed engine-internal field in ``body`` as (field path, reason), or None.

    Top level: an object (or null). In ``vllm_xargs`` (or, for ``generate``, ``sampling_params.extra_args``,
    where it belongs): vLLM's schema admits no object in ``vllm_xargs``, so any value there is refused; in
    ``extra_args`` an object. Inside the object, the keys NixlConnector reads have their types, and a remote
    prefill names what it pulls."""
    for name in ENGINE_INTERNAL_FIELDS:
        if name in body and body[name] is not None:
            problem = _params_problem(name, body[name])
            if problem is not None:
                return problem
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, Mapping) and name in xargs:
            return f"vllm_xargs.{name}", f"engine-internal: {name} is set by the pool's router, at the top level"
        params = body.get("sampling_params") if generate else None
        extra = params.get("extra_args") if isinstance(params, Mapping) else None
        if isinstance(extra, Mapping) and extra.get(name) is not None:
            problem = _params_problem(f"sampling_params.extra_args.{name}", extra[name])
            if problem is not None:
                return problem
    return None


def _params_problem(path: str, value: Any) -> tuple[str, str] | None:
    if not isinstance(value, Mapping):
        return path, f"must be an object, got {type(value).__name__}"
    checks: tuple[tuple[tuple[str, ...], Any, str], ...] = (
        (_BOOL, lambda v: isinstance(v, bool), "true or false"),
        (_STR, lambda v: isinstance(v, str), "a string"),
        (_INT, _is_int, "an integer"),
        (_NUMBER, lambda v: _is_int(v) or isinstance(v, float), "a number"),
    )
    for keys, valid, expected in checks:
        for key in keys:
            if value.get(key) is not None and not valid(value[key]):  # None: absent, as NIXL's own answers send
                return f"{path}.{key}", f"must be {expected}, got {value[key]!r}"[:200]
    blocks = value.get("remote_block_ids")
    if blocks is not None and not _block_ids(blocks):
        return f"{path}.remote_block_ids", "must be a list of block ids (integers), or a list of such lists"
    # coserve's own handoff (``coserve_handoff``) finds the KV by the prompt's block hashes: it names nothing
    if value.get("do_remote_prefill") and HANDOFF_KEY not in value:
        missing = [key for key in _REQUIRED_FOR_REMOTE_PREFILL if value.get(key) is None]
        if missing:
            return path, f"a remote prefill needs {', '.join(missing)}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids(value: Any) -> bool:
    if not isinstance(value, list):
        return False
    return all(_is_int(v) for v in value) or all(isinstance(v, list) and all(_is_int(i) for i in v) for v in value)
