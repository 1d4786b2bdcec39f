"""Host KV offload and the shared-memory prefill-to-decode handoff, the two halves CoServeConnector runs.

``OffloadPlanner`` (scheduler side, engine-core process) decides, once per step:

- which newly completed token blocks of the scheduled requests to copy out to the
  host pool (incremental checkpointing: each block once, right after the step
  that filled it, at most ``copy_budget`` blocks per step, more important
  classes first), evicting by ``coserve.kv.pool.HostPool``'s rules;
- which blocks a request that vLLM (re)schedules from the waiting queue can load
  instead of recomputing: its prefix from the host pool, then, on a decoder,
  from the handoff directory a prefiller filled.

``OffloadWorker`` (worker side, one per rank) owns the bytes: one preallocated
host tensor of ``capacity`` slots holding every layer of a block. Who calls it:
the connector's ``bind_connector_metadata`` (before the forward) calls
``begin``, ``wait_for_layer_load`` (before each attention layer) calls
``wait_layer``, ``wait_for_save`` (after the forward) calls ``end``.

On a CPU, copies run on one background thread. A step's copy-outs start when
its forward ends and run while vLLM samples, reports and schedules the next
step; the next step's forward waits for them first, so no block is rewritten
while it is being read (copying during the forward slowed it down: see
``OffloadWorker.end``). Reloads are pipelined: layer L+1's copy-in runs while
layer L computes, and ``wait_for_layer_load`` waits for layer L's only.

On CUDA, ``coserve.engine.kv_copies.DeviceKVCopier`` does the copies, with the
host pool in pinned memory and one copy stream: ``begin`` queues every layer's
reload at once, ``wait_layer`` makes the compute stream wait for its layer's
(device-side, the host never blocks), ``end`` queues the step's copy-outs,
which overlap the next step's forward. That forward waits for them only when
``StepPlan.fence_saves`` says it may rewrite a block they read (the planner
sets it when a request whose blocks were being copied out finished or was
preempted, the only way such a block is freed and reused). The background
thread then only writes the handoff files, after the copies have landed.

A step abandoned at a safepoint still reaches ``wait_for_save``: vLLM calls it in a ``finally``
(``kv_connector_model_runner_mixin``). The connector then calls ``abandon`` instead of ``end``: the
step's blocks are partly computed, so nothing is copied out and no handoff file is written, and the
planner plans those blocks again once they are recomputed (``OffloadPlanner.roll_back``). Its
reloads are completed instead, every layer: the tokens they carry stay counted as computed.

Handoff (``handoff_backend: shm``): the prefiller's worker also writes each
block it copies out to ``handoff_path/<hash>.<rank>.kv`` (write, then an atomic
rename), bounded by ``handoff_max_bytes`` (its oldest files go first). A
decoder's planner finds turn 1's blocks there by the same chain hashes, so the
decoder loads them instead of recomputing the prompt. The directory must be on
a memory filesystem (``/dev/shm``) shared by the pool's engines on one machine;
across machines the operator renders vLLM's NixlConnector instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coserve.engine.kv_copies import CopyStreams, DeviceKVCopier, SaveBatch
from coserve.kv.config import KVSettings
from coserve.kv.handoff import asks_remote_decode, has_remote_prefill, shm_prefill_answer
from coserve.kv.pool import BlockHash, HostPool, block_hashes, copy_budget
from coserve.scheduling.config import EngineSchedulingConfig

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["BlockCopy", "OffloadPlanner", "OffloadWorker", "StepPlan"]

logger = logging.getLogger("coserve.engine.offload")


@dataclass(frozen=True)
class BlockCopy:
    """One block to move: ``device_block`` in vLLM's KV cache, ``slot`` in the host pool (-1: none), and
    ``handoff`` (the block's hash, hex) when it also goes to, or comes from, the handoff directory."""

    device_block: int
    slot: int
    handoff: str | None = None


@dataclass
class StepPlan:
    """What the workers copy in one step (part of the connector metadata).

    ``fence_saves``: the step's forward must wait for the previous step's copy-outs, because a block
    they read may have been freed and reallocated to this step (see ``OffloadPlanner.plan_step``).
    """

    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)
    fence_saves: bool = False


@dataclass
class _Tracked:
    request: Request
    class_name: str
    rank: int
    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    saved: int = 0  # blocks from the start already copied out, held, or given up on
    remote_decode: bool = False  # a prefiller keeps its blocks for a decoder (the router asked: do_remote_decode)
    handoff_wait_since: float | None = None  # a decoder first looked for its handoff blocks and missed one
    handoff_given_up: bool = False  # it waited handoff_wait_s and computes the rest


def model_salt(*identity: object) -> bytes:
    """The root of every chain hash: blocks of different models, block sizes or layouts never match."""
    return hashlib.blake2b(repr(identity).encode(), digest_size=16).digest()


def handoff_file(directory: str, block: str, rank: int) -> Path:
    return Path(directory) / f"{block}.{rank}.kv"


class OffloadPlanner:
    """Scheduler-side bookkeeping of the offload and handoff; one per engine."""

    def __init__(
        self,
        settings: KVSettings,
        *,
        block_size: int,
        block_bytes: int,
        salt: bytes,
        config: EngineSchedulingConfig,
        produce: bool,
        consume: bool,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.salt = salt
        self.config = config
        capacity = settings.host_memory_bytes // block_bytes if settings.offload else 0
        self.pool = HostPool(capacity, settings.class_shares)
        self.produce = settings.handoff and produce
        self.consume = settings.handoff and consume
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, tuple[int, list[BlockCopy], list[BlockHash]]] = {}
        self._step_loads: list[BlockCopy] = []
        self._pinned: list[BlockHash] = []
        self._saving: set[str] = set()  # requests with copy-outs in the last plan
        self._step = 0
        self.loaded_blocks = 0
        self.handoff_blocks = 0
        self.handoff_waits = 0  # steps a request waited for its prefiller's handoff files
        self.handoff_misses = 0  # requests that gave up waiting and recompute the blocks still missing
        self._reported: dict[str, float] = {}
        # the copy bandwidth the budget assumes: the setting until the workers' copies have been timed
        self.bandwidth_bytes_per_s = settings.copy_bandwidth_bytes_per_s
        self._bandwidth_measured = False

    # -- vLLM's scheduler calls these through the connector ------------------------------------------

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) this connector can load for ``request``;
        ``None`` while a remote-prefill request's handoff files are still being written (vLLM asks again next
        step), for at most ``handoff_wait_s``: the prefiller answers as its step ends, and its worker writes the
        files just after."""
        tracked = self._track(request)
        start = num_computed_tokens // self.block_size
        # vLLM must compute at least the last prompt token itself
        limit = max(0, (request.num_tokens - 1) // self.block_size)
        tracked.hashes = block_hashes(request.all_token_ids, self.block_size, self.salt, tracked.hashes)
        wanted = tracked.hashes[start:limit]
        found = self.pool.lookup(wanted, self._step) if self.pool.capacity else 0
        copies = [BlockCopy(-1, self.pool.slot(h)) for h in wanted[:found]]
        # the shm handoff follows vLLM's P/D protocol: a decoder loads a prompt's blocks only for a request the
        # router sent with the prefiller's answer (do_remote_prefill), as NixlConnector would
        if self.consume and has_remote_prefill(getattr(request, "kv_transfer_params", None)):
            missing = False
            for block in wanted[found:]:
                if not handoff_file(self.settings.handoff_path, block.hex(), 0).exists():
                    missing = True
                    break
                copies.append(BlockCopy(-1, -1, block.hex()))
            if missing and self._wait_for_handoff(tracked):
                self._pending_loads.pop(request.request_id, None)
                return None
        if not copies:
            self._pending_loads.pop(request.request_id, None)
            return 0
        self._pending_loads[request.request_id] = (start, copies, wanted[:found])
        return len(copies) * self.block_size

    def _wait_for_handoff(self, tracked: _Tracked) -> bool:
        """Whether to wait another step for a handoff file that is not there yet (``handoff_wait_s`` in all)."""
        now = time.monotonic()
        if tracked.handoff_wait_since is None:
            tracked.handoff_wait_since = now
        if not tracked.handoff_given_up and now - tracked.handoff_wait_since < self.settings.handoff_wait_s:
            self.handoff_waits += 1
            return True
        if not tracked.handoff_given_up:  # counted and logged once
            tracked.handoff_given_up = True
            self.handoff_misses += 1
            logger.warning(
                "request %s: its prefiller's handoff blocks did not all appear in %s within %.1f s; the decoder "
                "computes the rest of the prompt", tracked.request.request_id, self.settings.handoff_path,
                self.settings.handoff_wait_s,
            )  # fmt: skip
        return False

    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave ``request`` its blocks; plan the load of the ``num_external_tokens`` it will not compute."""
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        pending = self._pending_loads.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        start, copies, pooled = pending
        count = num_external_tokens // self.block_size
        for offset, copy in enumerate(copies[:count]):
            block = block_ids[start + offset]
            self._step_loads.append(BlockCopy(block, copy.slot, copy.handoff))
            if copy.handoff is not None:
                self.handoff_blocks += 1
        self.loaded_blocks += count
        self.pool.pin(pooled[:count])
        self._pinned += pooled[:count]

    def plan_step(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """Called once per step (``build_connector_meta``): this step's loads and copy-outs."""
        self._step += 1
        self.pool.abort_before(self._step)  # an abandoned step never reported back: its copies are partial
        plan = StepPlan(loads=self._step_loads)
        self._step_loads = []
        self._pending_loads.clear()
        scheduled: list[tuple[_Tracked, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                scheduled.append((tracked, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                tracked.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                tracked.block_ids += new_blocks[0]
            scheduled.append(
                (tracked, cached.num_computed_tokens[index] + scheduler_output.num_scheduled_tokens[req_id])
            )
        plan.fence_saves = self._must_fence(scheduler_output, {tracked.request.request_id for tracked, _ in scheduled})
        saving: set[str] = set()
        if self.pool.capacity or self.produce:
            plan.saves = self._copy_outs(scheduled, scheduler_output.total_num_scheduled_tokens, saving)
        self._saving = saving
        return plan

    def _must_fence(self, scheduler_output: SchedulerOutput, scheduled: set[str]) -> bool:
        """Whether this step's forward may write a device block the last step's copy-outs still read.

        On CUDA those copy-outs overlap this forward. A block they read belongs to a request that was
        running; its blocks are freed, and can be given to this step, only when it finished or was
        preempted since. This step's reloads need no fence: they run on the same copy stream after those
        copy-outs, so they cannot overwrite a block before it has been copied out. Copy-outs older than
        the last step's are always waited for by the worker, so a finish that vLLM reports one step late
        (async scheduling) is covered as well.

        NOTE: vLLM zeroes newly allocated blocks before the forward, ahead of this fence, but only for
        caches with Mamba layers or mixed precisions (``needs_kv_cache_zeroing``); this offload assumes
        one uniform KV cache group.
        """
        if not self._saving:
            return False
        finished = set(scheduler_output.finished_req_ids)
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted is None:
            # This vLLM does not say which requests it preempted: fence after any finish, and whenever a
            # request that was being copied out is not scheduled now (it may have been preempted).
            return bool(finished) or not self._saving <= scheduled
        return bool(self._saving & (finished | set(preempted)))

    def roll_back(self, computed_tokens: dict[str, int]) -> None:
        """An abandoned step's requests are back at these computed-token counts (``TDGScheduler._roll_back``):
        their blocks past that point were never written, so they are copied out again once recomputed."""
        for request_id, computed in computed_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.saved = min(tracked.saved, computed // self.block_size)

    def step_done(self) -> None:
        """The workers finished the last planned step (``update_connector_output``): its copies are usable."""
        self.pool.commit(self._step)
        self.pool.unpin(self._pinned)
        self._pinned = []

    def observe_copies(self, num_bytes: float, seconds: float) -> None:
        """The workers copied ``num_bytes`` in ``seconds``: the copy budget follows the measured bandwidth."""
        if num_bytes <= 0 or seconds <= 0:
            return
        measured = num_bytes / seconds
        if self._bandwidth_measured:
            self.bandwidth_bytes_per_s = 0.8 * self.bandwidth_bytes_per_s + 0.2 * measured
        else:
            self.bandwidth_bytes_per_s, self._bandwidth_measured = measured, True

    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call, and the pool's occupancy now."""
        stats = self.pool.stats
        now: dict[str, float] = {
            "hits": stats.hits,
            "misses": stats.misses,
            "saved": stats.saved,
            "dropped": stats.dropped,
            "evicted": stats.evicted,
            "aborted": stats.aborted,
            "loaded_blocks": self.loaded_blocks,
            "handoff_blocks": self.handoff_blocks,
            "handoff_waits": self.handoff_waits,
            "handoff_misses": self.handoff_misses,
        }
        delta = stats_delta(now, self._reported)
        self._reported = now
        return {
            **delta,
            "pool_occupancy": self.pool.occupancy(),
            "pool_blocks": len(self.pool),
            "copy_bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
        }

    def finished(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._pending_loads.pop(request_id, None)

    # -- internals ------------------------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            cls = self._class_of(request)
            remote = self.produce and asks_remote_decode(getattr(request, "kv_transfer_params", None))
            tracked = self._tracked[request.request_id] = _Tracked(request, cls[0], cls[1], remote_decode=remote)
        return tracked

    def remote_decode_answer(self, request: Request) -> dict[str, Any] | None:
        """What a prefiller answers a request the router asked to decode elsewhere (``request_finished``)."""
        if not (self.produce and asks_remote_decode(getattr(request, "kv_transfer_params", None))):
            return None
        return shm_prefill_answer()

    def _class_of(self, request: Request) -> tuple[str, int]:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        try:
            cls, _, _ = self.config.classes.resolve(extra, request.priority)
        except ValueError:
            cls = self.config.classes.default
        return cls.name, cls.rank

    def _copy_outs(self, scheduled: list[tuple[_Tracked, int]], num_tokens: int, saving: set[str]) -> list[BlockCopy]:
        predicted = self.config.cost_model.latency_s(num_tokens, 0)
        budget = copy_budget(
            predicted, self.settings.copy_budget_fraction, self.bandwidth_bytes_per_s, self.block_bytes
        )
        saves: list[BlockCopy] = []
        for tracked, computed_after in sorted(scheduled, key=lambda item: item[0].rank):
            full = min(computed_after // self.block_size, len(tracked.block_ids))
            if full <= tracked.saved:
                continue
            tokens = tracked.request.all_token_ids
            tracked.hashes = block_hashes(tokens[: full * self.block_size], self.block_size, self.salt, tracked.hashes)
            for index in range(tracked.saved, full):
                # a decoder waits for a remote-decode request's blocks and computes any that never come, so they
                # are written whatever the budget: the request ends with this step and its blocks are freed
                if budget <= 0 and not tracked.remote_decode:
                    break
                block = tracked.hashes[index]
                slot = (
                    self.pool.reserve(block, tracked.class_name, tracked.rank, index, self._step, self._step)
                    if self.pool.capacity
                    else None
                )
                tracked.saved = index + 1
                handoff = block.hex() if tracked.remote_decode else None
                if slot is None and handoff is None:
                    continue
                saves.append(BlockCopy(tracked.block_ids[index], -1 if slot is None else slot, handoff))
                saving.add(tracked.request.request_id)
                budget -= 1
        return saves


class OffloadWorker:
    """Worker-side copies between vLLM's paged KV cache and the host pool / handoff directory.

    Three paths, chosen at ``register`` by vLLM's cache tensors: CUDA caches go through
    ``DeviceKVCopier`` (pinned pool, one copy stream, device-side waits); CPU caches with the block
    dimension first and contiguous through numpy memcpys on the background thread; any other CPU layout
    through torch index copies on the same thread (the CPU schedule, not the copier's inline mode).
    """

    def __init__(self, settings: KVSettings, *, capacity: int, rank: int, produce: bool) -> None:
        self.settings = settings
        self.capacity = capacity
        self.rank = rank
        self.produce = settings.handoff and produce
        self._layers: list[str] = []
        self._index: dict[str, int] = {}
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._host: torch.Tensor | None = None  # (layers, capacity, *block shape)
        self._block_shape: tuple[int, ...] = ()
        self._np_caches: list[np.ndarray] | None = None  # byte views of vLLM's caches (CPU)
        self._np_host: np.ndarray | None = None  # byte view of the host pool (CPU)
        self._copier: DeviceKVCopier | None = None  # CUDA caches
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-kv")
        self._futures: list[Future[None]] = []
        self._layer_loads: dict[int, Future[None]] = {}
        self._layers_started: set[int] = set()  # layers whose reload of this step has started (CPU)
        self._plan = StepPlan()
        self._staged: np.ndarray | None = None  # handoff blocks read for this step's loads, (n, layers, bytes)
        self._written: OrderedDict[Path, int] = OrderedDict()
        self._written_bytes = 0
        self.stats: dict[str, float] = {"bytes_offloaded": 0, "bytes_reloaded": 0, "copy_s": 0.0, "handoff_files": 0}
        self.load_errors: set[int] = set()
        self.step_copy_s: list[float] = []
        self._copy_s_reported = 0.0
        self._reported: dict[str, float] = {}
        self._lock = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, streams: CopyStreams | None = None) -> None:
        """vLLM hands over its KV cache tensors once, at start-up: allocate the host pool to match.

        ``streams``: run the CUDA path (``DeviceKVCopier``) with these stream operations, whatever the
        caches' device (tests drive it on CPU tensors this way); by default CUDA caches only take it.
        """
        import torch

        self._layers = list(kv_caches)
        self._index = {name: i for i, name in enumerate(self._layers)}
        self._caches = [kv_caches[name] for name in self._layers]
        first = self._caches[0]
        dims = [d for d, size in enumerate(first.shape[:2]) if size == num_blocks]
        if not dims:
            raise ValueError(f"cannot find the block dimension of a KV cache of shape {tuple(first.shape)}")
        self._block_dim = dims[0]
        block_shape = first.select(self._block_dim, 0).shape
        self._block_shape = tuple(block_shape)
        if first.is_cuda or streams is not None:
            # the pinned, page-touched pool is the copier's (layer-major as below)
            self._copier = DeviceKVCopier(self._caches, self._block_dim, self.capacity, streams)
            self._host = self._copier.host
        elif self.capacity:
            # layer-major: one layer's slot is one contiguous run of bytes
            self._host = torch.empty(
                (len(self._caches), self.capacity, *block_shape), dtype=first.dtype, pin_memory=first.is_cuda
            )
            # NOTE: touch every page now. Untouched memory faults on its first write, and a copy-out into
            # it ran at 0.7 GB/s instead of 13 GB/s (measured here); 2 GiB take 0.35 s at start-up.
            self._host.zero_()
        # On the CPU, copies are single memcpys through numpy (byte views): torch would split each one
        # across the OpenMP threads the forward is using, and wait for them.
        if self._copier is None and self._block_dim == 0 and all(c.is_contiguous() for c in self._caches):
            self._np_caches = [c.view(torch.uint8).numpy() for c in self._caches]
            self._np_host = self._host.view(torch.uint8).numpy() if self._host is not None else None
        logger.info(
            "KV offload: %d host slots of %d layers x %s (%s), %.1f MiB; handoff %s; %s copies",
            self.capacity,
            len(self._caches),
            tuple(block_shape),
            first.dtype,
            (self._host.numel() * self._host.element_size() / 2**20) if self._host is not None else 0.0,
            self.settings.handoff_backend,
            "cuda stream" if self._copier is not None else "memcpy" if self._np_caches is not None else "torch",
        )

    @property
    def block_bytes(self) -> int:
        first = self._caches[0]
        return int(first.select(self._block_dim, 0).numel() * first.element_size() * len(self._caches))

    # -- one step --------------------------------------------------------------------------------------

    def begin(self, plan: StepPlan) -> None:
        """Before the forward: an abandoned step's copies are finished or dropped before slots are reused."""
        if self._copier is not None:
            self._begin_cuda(plan, self._copier)
            return
        self._drain()
        self._plan = plan
        self._layer_loads = {}
        self._layers_started = set()
        self._staged = None
        if plan.loads and self._caches:
            handoffs = [copy for copy in plan.loads if copy.handoff is not None]
            if handoffs:
                self._staged, readable = self._read_handoff(handoffs)
                # a file the prefiller dropped meanwhile: vLLM recomputes those blocks (get_block_ids_with_load_errors)
                self.load_errors |= {c.device_block for c in handoffs if c not in readable}
                self._plan = StepPlan([c for c in plan.loads if c.handoff is None] + readable, plan.saves)
            self._start_load(0)

    def wait_layer(self, layer_name: str) -> None:
        """Before layer L's attention: wait for its KV, and start copying layer L+1's."""
        if self._copier is not None:
            layer = self._index.get(layer_name)
            if layer is not None:
                self._copier.wait_layer(layer)
            return
        if not self._layer_loads:
            return
        layer = self._index.get(layer_name)
        if layer is None:
            return
        if layer not in self._layers_started:
            self._start_load(layer)
        future = self._layer_loads.pop(layer, None)
        if layer + 1 < len(self._caches) and layer + 1 not in self._layers_started:
            self._start_load(layer + 1)
        if future is not None:
            future.result()

    def _start_load(self, layer: int) -> None:
        self._layers_started.add(layer)
        self._layer_loads[layer] = self._thread.submit(self._load_layer, layer)

    def save_layer(self, layer_name: str) -> None:
        """After layer L's attention: nothing to do yet (see ``end``)."""
        return None

    def end(self) -> None:
        """End of the step: start the step's copy-outs on the background thread, and return at once; on a
        prefiller, a step with handoff blocks writes them first, so its answer never precedes its files.

        NOTE: copying while the forward runs was measured to slow it down by 5-15 % on 2 cores: the
        copy thread preempts the OpenMP threads of the forward, which then wait for each other at
        every barrier. Between two forwards those threads idle, so the copies run there. They are
        safe: vLLM writes KV blocks only inside a forward, and the next step's ``begin`` waits for
        them before its forward starts. An abandoned step goes to ``abandon`` instead: it copies nothing out.
        """
        plan = self._plan
        self._plan = StepPlan()
        if self._copier is not None:
            self._end_cuda(plan.saves, self._copier)
            return
        self._loaded(plan)
        if plan.saves and self.produce and any(copy.handoff is not None for copy in plan.saves):
            # NOTE: a decoder looks for these files as soon as the router has the answer this step ends with, and
            # on a CPU the next forward would wait for them anyway (``begin`` drains): written before the step
            # returns, they are there when it looks (else it finds one missing and retries a decoder step later).
            self._drain()
            self._save_step(plan.saves)
        elif plan.saves:
            self._futures.append(self._thread.submit(self._save_step, plan.saves))

    def abandon(self) -> None:
        """End of a step abandoned at a safepoint (the connector's ``wait_for_save``, which vLLM calls in a
        ``finally``): no copy-out and no handoff file, since the step's blocks are partly computed; every
        layer's reload completes, since the scheduler keeps the reloaded tokens counted as computed.

        On a CPU, reloads go one layer at a time, a layer ahead of the forward: an abort before layer L
        leaves layers past L + 1 unloaded, so they are loaded here, before the next step can run on them.
        On CUDA ``begin`` queued every layer's reload, and the next step's forward waits for the whole copy
        stream after an abandoned step (``DeviceKVCopier.begin``).
        """
        plan = self._plan  # the layers' loads read it: replaced once they are done
        if self._copier is None and plan.loads and self._caches:
            for layer in range(len(self._caches)):
                if layer not in self._layers_started:
                    self._start_load(layer)
            self._drain()
            self._loaded(plan)
        self._plan = StepPlan()
        self._staged = None

    # -- CUDA: DeviceKVCopier ----------------------------------------------------------------------------

    def _begin_cuda(self, plan: StepPlan, copier: DeviceKVCopier) -> None:
        """Order the forward after the copy-outs it must not overlap, then queue every layer's reload."""
        import torch

        self._collect()
        copier.begin(plan.fence_saves)
        self._plan = plan
        pooled = [(c.device_block, c.slot) for c in plan.loads if c.handoff is None]
        handoffs = [c for c in plan.loads if c.handoff is not None]
        staged: torch.Tensor | None = None
        readable: list[BlockCopy] = []
        if handoffs:
            raw, readable = self._read_handoff(handoffs)
            # a file the prefiller dropped meanwhile: vLLM recomputes those blocks (get_block_ids_with_load_errors)
            self.load_errors |= {c.device_block for c in handoffs if c not in readable}
            if readable:
                by_block = torch.from_numpy(raw).view(self._caches[0].dtype)
                staged = by_block.view(len(readable), len(self._caches), *self._block_shape).transpose(0, 1)
        copier.issue_loads(pooled, [c.device_block for c in readable], staged)

    def _end_cuda(self, saves: list[BlockCopy], copier: DeviceKVCopier) -> None:
        """Queue the step's copy-outs on the copy stream; a producer's handoff files follow on the thread."""
        # The handoff writer reads pool slots these copy-outs may rewrite (a slot evicted and reused).
        self._drain()
        pooled = [(c.device_block, c.slot) for c in saves if c.slot >= 0]
        handoff_only = [c for c in saves if c.slot < 0 and c.handoff is not None] if self.produce else []
        batch = copier.issue_saves(pooled, [c.device_block for c in handoff_only])
        if batch is not None and self.produce and any(c.handoff is not None for c in saves):
            self._futures.append(self._thread.submit(self._write_handoff_cuda, saves, handoff_only, batch))

    def _write_handoff_cuda(self, saves: list[BlockCopy], handoff_only: list[BlockCopy], batch: SaveBatch) -> None:
        import torch

        batch.synchronize()
        position = {id(copy): index for index, copy in enumerate(handoff_only)}

        def payload(copy: BlockCopy) -> bytes:
            if copy.slot >= 0 and self._host is not None:
                block = self._host[:, copy.slot]
            elif batch.extra is not None and id(copy) in position:
                block = batch.extra[:, position[id(copy)]]
            else:
                raise ValueError(f"block {copy.device_block} was not copied out")
            return bytes(block.contiguous().view(torch.uint8).numpy().tobytes())

        self._write_handoff(saves, payload)

    def _collect(self) -> None:
        """Count the copier's batches the device has finished (bytes with their seconds, so they match)."""
        if self._copier is None:
            return
        done = self._copier.completed()
        if not done:
            return
        with self._lock:
            for key, num_bytes, seconds in done:
                self.stats[key] += num_bytes
                self.stats["copy_s"] += seconds
                self.step_copy_s.append(seconds)
            self._copy_s_reported = self.stats["copy_s"]

    def _loaded(self, plan: StepPlan) -> None:
        if plan.loads:
            with self._lock:
                self.step_copy_s.append(self.stats["copy_s"] - self._copy_s_reported)
                self._copy_s_reported = self.stats["copy_s"]

    def _save_step(self, saves: list[BlockCopy]) -> None:
        started = self.stats["copy_s"]
        for layer in range(len(self._caches)):
            self._save_layer(layer, saves)
        if self.produce:
            self._write_handoff(saves, self._block_bytes_of)
        with self._lock:
            self.step_copy_s.append(self.stats["copy_s"] - started)
            self._copy_s_reported = self.stats["copy_s"]

    def take_stats(self) -> dict[str, Any] | None:
        """Counters since the last call and each copying step's copy time; ``None`` when nothing happened.

        On CUDA a batch of copies counts once the device has finished it (its bytes and its copy-stream
        time together), so a step's copies may show in a later call."""
        self._collect()
        with self._lock:
            delta = stats_delta(self.stats, self._reported)
            self._reported = dict(self.stats)
            steps, self.step_copy_s = self.step_copy_s, []
        if not delta and not steps:
            return None
        return {**delta, "step_copy_s": steps}

    def close(self) -> None:
        self._drain()
        if self._copier is not None:
            self._copier.synchronize()
            self._collect()
        self._thread.shutdown(wait=True)

    # -- copies (on the background thread) -------------------------------------------------------------

    def _drain(self) -> None:
        futures, self._futures = self._futures, []
        futures += list(self._layer_loads.values())
        self._layer_loads = {}
        for future in futures:
            future.result()

    def _load_layer(self, layer: int) -> None:
        started = time.perf_counter()
        pooled = [copy for copy in self._plan.loads if copy.handoff is None]
        handoffs = [copy for copy in self._plan.loads if copy.handoff is not None]
        moved = 0
        if self._np_caches is not None:
            cache = self._np_caches[layer]
            if self._np_host is not None:
                for copy in pooled:
                    np.copyto(cache[copy.device_block], self._np_host[layer, copy.slot])
                    moved += cache[0].nbytes
            if self._staged is not None:
                for index, copy in enumerate(handoffs):
                    np.copyto(cache[copy.device_block], self._staged[index, layer].reshape(cache[0].shape))
                    moved += cache[0].nbytes
        else:
            moved = self._torch_load(layer, pooled, handoffs)
        if moved:
            self._count("bytes_reloaded", moved, started)

    def _torch_load(self, layer: int, pooled: list[BlockCopy], handoffs: list[BlockCopy]) -> int:
        """Reload into a CPU cache of an unusual layout: batched index copies."""
        import torch

        cache = self._caches[layer]
        moved = 0
        if pooled and self._host is not None:
            slots = torch.tensor([copy.slot for copy in pooled], dtype=torch.long)
            blocks = torch.tensor([copy.device_block for copy in pooled], dtype=torch.long, device=cache.device)
            source = self._host[layer].index_select(0, slots).to(cache.device, non_blocking=True)
            cache.index_copy_(self._block_dim, blocks, source.movedim(0, self._block_dim))
            moved += source.numel() * source.element_size()
        if handoffs and self._staged is not None:
            blocks = torch.tensor([copy.device_block for copy in handoffs], dtype=torch.long, device=cache.device)
            raw = torch.from_numpy(np.ascontiguousarray(self._staged[:, layer]))
            source = raw.view(cache.dtype).view(len(handoffs), *self._block_shape).to(cache.device)
            cache.index_copy_(self._block_dim, blocks, source.movedim(0, self._block_dim))
            moved += source.numel() * source.element_size()
        return moved

    def _save_layer(self, layer: int, step_saves: list[BlockCopy]) -> None:
        started = time.perf_counter()
        saves = [copy for copy in step_saves if copy.slot >= 0]
        if not saves or self._host is None:
            return
        if self._np_caches is not None and self._np_host is not None:
            cache = self._np_caches[layer]
            for copy in saves:
                np.copyto(self._np_host[layer, copy.slot], cache[copy.device_block])
            moved = len(saves) * cache[0].nbytes
        else:
            import torch

            source_cache = self._caches[layer]
            blocks = torch.tensor([c.device_block for c in saves], dtype=torch.long, device=source_cache.device)
            slots = torch.tensor([c.slot for c in saves], dtype=torch.long)
            source = source_cache.index_select(self._block_dim, blocks).movedim(self._block_dim, 0)
            self._host[layer].index_copy_(0, slots, source.to("cpu"))
            moved = source.numel() * source.element_size()
        self._count("bytes_offloaded", moved, started)

    def _block_bytes_of(self, copy: BlockCopy) -> bytes:
        """All layers of one block as the handoff file holds them: from the host pool, else from vLLM's cache."""
        if copy.slot >= 0 and self._np_host is not None:
            return bytes(np.ascontiguousarray(self._np_host[:, copy.slot]).tobytes())
        if self._np_caches is not None:
            return b"".join(cache[copy.device_block].tobytes() for cache in self._np_caches)
        import torch

        layers = [c.select(self._block_dim, copy.device_block).to("cpu").contiguous() for c in self._caches]
        return b"".join(layer.view(torch.uint8).numpy().tobytes() for layer in layers)

    def _write_handoff(self, saves: list[BlockCopy], payload_of: Callable[[BlockCopy], bytes]) -> None:
        """Each block, all layers, to its file (written, then renamed into place), within the byte bound."""
        directory = Path(self.settings.handoff_path)
        directory.mkdir(parents=True, exist_ok=True)
        for copy in saves:
            if copy.handoff is None:
                continue
            path = handoff_file(str(directory), copy.handoff, self.rank)
            partial = path.with_suffix(f".tmp{os.getpid()}")
            payload = payload_of(copy)
            partial.write_bytes(payload)
            os.replace(partial, path)
            # NOTE: a block written again (a later turn's prompt shares its prefix) is the newest, counted once:
            # counted twice, the bytes held drifted above the bound for good, and every write then removed every
            # file, the ones a decoder was about to read among them
            self._written_bytes += len(payload) - self._written.pop(path, 0)
            self._written[path] = len(payload)
            self.stats["handoff_files"] += 1
        while self._written and self._written_bytes > self.settings.handoff_max_bytes:
            oldest, size = self._written.popitem(last=False)
            oldest.unlink(missing_ok=True)
            self._written_bytes -= size

    def _read_handoff(self, copies: list[BlockCopy]) -> tuple[np.ndarray, list[BlockCopy]]:
        """The blocks' files as bytes, (n, layers, bytes per layer), in the order of the returned copies."""
        first = self._caches[0]
        per_layer = first.element_size() * int(np.prod(self._block_shape))
        expected = per_layer * len(self._caches)
        arrays, readable = [], []
        for copy in copies:
            try:
                raw = handoff_file(self.settings.handoff_path, str(copy.handoff), self.rank).read_bytes()
            except OSError as error:
                logger.warning("handoff block %s unreadable (%s): recomputing it", copy.handoff, error)
                continue
            if len(raw) != expected:
                logger.warning(
                    "handoff block %s has %d bytes, not %d: recomputing it", copy.handoff, len(raw), expected
                )
                continue
            arrays.append(np.frombuffer(raw, dtype=np.uint8).reshape(len(self._caches), per_layer))
            readable.append(copy)
        staged = np.stack(arrays) if arrays else np.empty((0, len(self._caches), per_layer), dtype=np.uint8)
        return staged, readable

    def _count(self, key: str, num_bytes: int, started: float) -> None:
        with self._lock:
            self.stats[key] += num_bytes
            self.stats["copy_s"] += time.perf_counter() - started

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.stats)


# -- metrics: vLLM carries these from the workers and the scheduler to the API server's /metrics -----------

COUNTERS = (
    "bytes_offloaded",  # worker: device -> host pool
    "bytes_reloaded",  # worker: host pool or handoff file -> device
    "handoff_files",  # worker: blocks written for a decoder
    "handoff_waits",  # scheduler: steps a remote-prefill request waited for its handoff files
    "handoff_misses",  # scheduler: remote-prefill requests that stopped waiting and compute what is missing
    "hits",  # scheduler: blocks found in the host pool
    "misses",  # scheduler: lookups that stopped at a missing block
    "saved",  # scheduler: blocks reserved for a copy-out
    "dropped",  # scheduler: blocks not kept (pool full of more important blocks)
    "evicted",  # scheduler: blocks removed to make room
    "aborted",  # scheduler: copies of abandoned steps released
    "loaded_blocks",  # scheduler: blocks planned for reload (pool or handoff)
    "handoff_blocks",  # scheduler: of those, from the handoff directory
)


def stats_delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: now.get(key, 0) - before.get(key, 0) for key in COUNTERS if now.get(key, 0) != before.get(key, 0)}
