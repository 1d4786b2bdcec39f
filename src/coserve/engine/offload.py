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
host tensor of ``capacity`` slots holding every layer of a block. Copies run on
one background thread: a step's copy-out of layer L is queued right after
layer L's attention wrote it (``save_kv_layer``) and overlaps the following
layers; ``wait_for_save`` waits for them before the step ends, so vLLM never
frees or reuses a block while it is being read. Reloads are pipelined: layer
L+1's copy-in runs while layer L computes, and ``wait_for_layer_load`` waits
for layer L's only.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coserve.kv.config import KVSettings
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
    """What the workers copy in one step (part of the connector metadata)."""

    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Request
    class_name: str
    rank: int
    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    saved: int = 0  # blocks from the start already copied out, held, or given up on


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
        self._step = 0
        self.loaded_blocks = 0
        self.handoff_blocks = 0
        self._reported: dict[str, float] = {}

    # -- vLLM's scheduler calls these through the connector ------------------------------------------

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) this connector can load for ``request``."""
        tracked = self._track(request)
        start = num_computed_tokens // self.block_size
        # vLLM must compute at least the last prompt token itself
        limit = max(0, (request.num_tokens - 1) // self.block_size)
        tracked.hashes = block_hashes(request.all_token_ids, self.block_size, self.salt, tracked.hashes)
        wanted = tracked.hashes[start:limit]
        found = self.pool.lookup(wanted, self._step) if self.pool.capacity else 0
        copies = [BlockCopy(-1, self.pool.slot(h)) for h in wanted[:found]]
        if self.consume:
            for block in wanted[found:]:
                if not handoff_file(self.settings.handoff_path, block.hex(), 0).exists():
                    break
                copies.append(BlockCopy(-1, -1, block.hex()))
        if not copies:
            self._pending_loads.pop(request.request_id, None)
            return 0
        self._pending_loads[request.request_id] = (start, copies, wanted[:found])
        return len(copies) * self.block_size

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
        if self.pool.capacity or self.produce:
            plan.saves = self._copy_outs(scheduled, scheduler_output.total_num_scheduled_tokens)
        return plan

    def step_done(self) -> None:
        """The workers finished the last planned step (``update_connector_output``): its copies are usable."""
        self.pool.commit(self._step)
        self.pool.unpin(self._pinned)
        self._pinned = []

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
        }
        delta = stats_delta(now, self._reported)
        self._reported = now
        return {**delta, "pool_occupancy": self.pool.occupancy(), "pool_blocks": len(self.pool)}

    def finished(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._pending_loads.pop(request_id, None)

    # -- internals ------------------------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            cls = self._class_of(request)
            tracked = self._tracked[request.request_id] = _Tracked(request, cls[0], cls[1])
        return tracked

    def _class_of(self, request: Request) -> tuple[str, int]:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        try:
            cls, _, _ = self.config.classes.resolve(extra, request.priority)
        except ValueError:
            cls = self.config.classes.default
        return cls.name, cls.rank

    def _copy_outs(self, scheduled: list[tuple[_Tracked, int]], num_tokens: int) -> list[BlockCopy]:
        predicted = self.config.cost_model.latency_s(num_tokens, 0)
        budget = copy_budget(
            predicted, self.settings.copy_budget_fraction, self.settings.copy_bandwidth_bytes_per_s, self.block_bytes
        )
        saves: list[BlockCopy] = []
        for tracked, computed_after in sorted(scheduled, key=lambda item: item[0].rank):
            full = min(computed_after // self.block_size, len(tracked.block_ids))
            if full <= tracked.saved:
                continue
            tokens = tracked.request.all_token_ids
            tracked.hashes = block_hashes(tokens[: full * self.block_size], self.block_size, self.salt, tracked.hashes)
            for index in range(tracked.saved, full):
                if budget <= 0:
                    break
                block = tracked.hashes[index]
                slot = (
                    self.pool.reserve(block, tracked.class_name, tracked.rank, index, self._step, self._step)
                    if self.pool.capacity
                    else None
                )
                tracked.saved = index + 1
                handoff = block.hex() if self.produce else None
                if slot is None and handoff is None:
                    continue
                saves.append(BlockCopy(tracked.block_ids[index], -1 if slot is None else slot, handoff))
                budget -= 1
        return saves


class OffloadWorker:
    """Worker-side copies between vLLM's paged KV cache and the host pool / handoff directory."""

    def __init__(self, settings: KVSettings, *, capacity: int, rank: int, produce: bool) -> None:
        self.settings = settings
        self.capacity = capacity
        self.rank = rank
        self.produce = settings.handoff and produce
        self._layers: list[str] = []
        self._index: dict[str, int] = {}
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._host: torch.Tensor | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-kv")
        self._futures: list[Future[None]] = []
        self._layer_loads: dict[int, Future[None]] = {}
        self._plan = StepPlan()
        self._staged: torch.Tensor | None = None  # handoff blocks read for this step's loads
        self._written: OrderedDict[Path, int] = OrderedDict()
        self._written_bytes = 0
        self.stats: dict[str, float] = {"bytes_offloaded": 0, "bytes_reloaded": 0, "copy_s": 0.0, "handoff_files": 0}
        self.load_errors: set[int] = set()
        self.step_copy_s: list[float] = []
        self._copy_s_reported = 0.0
        self._reported: dict[str, float] = {}
        self._lock = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """vLLM hands over its KV cache tensors once, at start-up: allocate the host pool to match."""
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
        if self.capacity:
            self._host = torch.empty(
                (self.capacity, len(self._caches), *block_shape),
                dtype=first.dtype,
                pin_memory=first.is_cuda,
            )
        logger.info(
            "KV offload: %d host slots of %d layers x %s (%s), %.1f MiB; handoff %s",
            self.capacity,
            len(self._caches),
            tuple(block_shape),
            first.dtype,
            (self._host.numel() * self._host.element_size() / 2**20) if self._host is not None else 0.0,
            self.settings.handoff_backend,
        )

    @property
    def block_bytes(self) -> int:
        first = self._caches[0]
        return int(first.select(self._block_dim, 0).numel() * first.element_size() * len(self._caches))

    # -- one step --------------------------------------------------------------------------------------

    def begin(self, plan: StepPlan) -> None:
        """Before the forward: an abandoned step's copies are finished or dropped before slots are reused."""
        self._drain()
        self._plan = plan
        self._layer_loads = {}
        self._staged = None
        if plan.loads and self._caches:
            handoffs = [copy for copy in plan.loads if copy.handoff is not None]
            if handoffs:
                self._staged, readable = self._read_handoff(handoffs)
                # a file the prefiller dropped meanwhile: vLLM recomputes those blocks (get_block_ids_with_load_errors)
                self.load_errors |= {c.device_block for c in handoffs if c not in readable}
                self._plan = StepPlan([c for c in plan.loads if c.handoff is None] + readable, plan.saves)
            self._layer_loads[0] = self._thread.submit(self._load_layer, 0)

    def wait_layer(self, layer_name: str) -> None:
        """Before layer L's attention: wait for its KV, and start copying layer L+1's."""
        if not self._layer_loads:
            return
        layer = self._index.get(layer_name)
        if layer is None:
            return
        future = self._layer_loads.pop(layer, None)
        if future is None:
            future = self._thread.submit(self._load_layer, layer)
        if layer + 1 < len(self._caches):
            self._layer_loads[layer + 1] = self._thread.submit(self._load_layer, layer + 1)
        future.result()

    def save_layer(self, layer_name: str) -> None:
        """After layer L's attention wrote its KV: queue its copy-out (overlaps the next layers)."""
        if not self._plan.saves:
            return
        layer = self._index.get(layer_name)
        if layer is not None:
            self._futures.append(self._thread.submit(self._save_layer, layer))

    def end(self) -> None:
        """End of the step: every copy-out is in the pool (and the handoff directory) before vLLM moves on."""
        if self._plan.saves and self.produce:
            self._futures.append(self._thread.submit(self._write_handoff, self._plan.saves))
        copying = bool(self._plan.saves or self._plan.loads)
        self._drain()
        if copying:
            with self._lock:
                self.step_copy_s.append(self.stats["copy_s"] - self._copy_s_reported)
                self._copy_s_reported = self.stats["copy_s"]
        self._plan = StepPlan()

    def take_stats(self) -> dict[str, Any] | None:
        """Counters since the last call and each copying step's copy time; ``None`` when nothing happened."""
        with self._lock:
            delta = stats_delta(self.stats, self._reported)
            self._reported = dict(self.stats)
            steps, self.step_copy_s = self.step_copy_s, []
        if not delta and not steps:
            return None
        return {**delta, "step_copy_s": steps}

    def close(self) -> None:
        self._drain()
        self._thread.shutdown(wait=True)

    # -- copies (on the background thread) -------------------------------------------------------------

    def _drain(self) -> None:
        futures, self._futures = self._futures, []
        futures += list(self._layer_loads.values())
        self._layer_loads = {}
        for future in futures:
            future.result()

    def _load_layer(self, layer: int) -> None:
        import torch

        started = time.perf_counter()
        cache = self._caches[layer]
        pooled = [copy for copy in self._plan.loads if copy.handoff is None]
        if pooled and self._host is not None:
            slots = torch.tensor([copy.slot for copy in pooled], dtype=torch.long)
            blocks = torch.tensor([copy.device_block for copy in pooled], dtype=torch.long, device=cache.device)
            source = self._host[:, layer].index_select(0, slots)
            cache.index_copy_(self._block_dim, blocks, source.to(cache.device, non_blocking=True))
            self._count("bytes_reloaded", source.numel() * source.element_size(), started)
        handoffs = [copy for copy in self._plan.loads if copy.handoff is not None]
        if handoffs and self._staged is not None:
            started = time.perf_counter()
            blocks = torch.tensor([copy.device_block for copy in handoffs], dtype=torch.long, device=cache.device)
            source = self._staged[:, layer]
            cache.index_copy_(self._block_dim, blocks, source.to(cache.device, non_blocking=True))
            self._count("bytes_reloaded", source.numel() * source.element_size(), started)

    def _save_layer(self, layer: int) -> None:
        import torch

        started = time.perf_counter()
        saves = [copy for copy in self._plan.saves if copy.slot >= 0]
        if not saves or self._host is None:
            return
        cache = self._caches[layer]
        blocks = torch.tensor([copy.device_block for copy in saves], dtype=torch.long, device=cache.device)
        slots = torch.tensor([copy.slot for copy in saves], dtype=torch.long)
        source = cache.index_select(self._block_dim, blocks)
        if self._block_dim != 0:
            source = source.movedim(self._block_dim, 0)
        self._host[:, layer].index_copy_(0, slots, source.to("cpu"))
        self._count("bytes_offloaded", source.numel() * source.element_size(), started)

    def _write_handoff(self, saves: list[BlockCopy]) -> None:
        """Each block, all layers, to its file: from the host pool when it is there, else from the device."""
        import torch

        directory = Path(self.settings.handoff_path)
        directory.mkdir(parents=True, exist_ok=True)
        for copy in saves:
            if copy.handoff is None:
                continue
            if copy.slot >= 0 and self._host is not None:
                data = self._host[copy.slot]
            else:
                data = torch.stack([c.select(self._block_dim, copy.device_block).to("cpu") for c in self._caches])
            path = handoff_file(str(directory), copy.handoff, self.rank)
            partial = path.with_suffix(f".tmp{os.getpid()}")
            payload = data.contiguous().view(torch.uint8).numpy().tobytes()
            partial.write_bytes(payload)
            os.replace(partial, path)
            self._written[path] = len(payload)
            self._written_bytes += len(payload)
            self.stats["handoff_files"] += 1
        while self._written and self._written_bytes > self.settings.handoff_max_bytes:
            oldest, size = self._written.popitem(last=False)
            oldest.unlink(missing_ok=True)
            self._written_bytes -= size

    def _read_handoff(self, copies: list[BlockCopy]) -> tuple[torch.Tensor, list[BlockCopy]]:
        """The blocks' files, stacked in the order of the returned copies (those whose file could be read)."""
        import torch

        first = self._caches[0]
        shape = (len(self._caches), *first.select(self._block_dim, 0).shape)
        expected = first.element_size() * int(torch.Size(shape).numel())
        tensors, readable = [], []
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
            tensors.append(torch.frombuffer(bytearray(raw), dtype=first.dtype).view(shape))
            readable.append(copy)
        staged = torch.stack(tensors) if tensors else torch.empty((0, *shape), dtype=first.dtype)
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
