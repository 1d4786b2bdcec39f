"""CoServeConnector: coserve's vLLM KV connector: layer safepoints, host KV offload, the shm handoff.

vLLM calls a KV connector's worker-side ``wait_for_layer_load`` before every
attention layer and ``save_kv_layer`` after it, in eager and in torch.compile
mode (plain forward hooks do not fire under compilation). coserve uses those
calls as safepoints (``coserve.engine.layer_safepoints``): one shared-memory
read each, and ``StepPreempted`` when the step must be abandoned. On a GPU each
safepoint also bounds how far the host runs ahead of the device
(``safepoint_runahead`` in ``kv_connector_extra_config``, default 1), or the
host would pass every safepoint long before the GPU reached it. The
scheduler-side half numbers the steps so that a stale abort flag can never
stop a later step.

Enable it with
``--kv-transfer-config '{"kv_connector": "CoServeConnector",
"kv_connector_module_path": "coserve.engine.connector", "kv_role": "kv_both"}'``
(the operator renders it). On GPUs it asks vLLM for piecewise CUDA graphs so
that the per-layer callback runs (see ``requires_piecewise_for_cudagraph``).

With ``host_memory_bytes`` > 0 in ``kv_connector_extra_config`` it also
checkpoints every completed KV block to a bounded host pool and reloads a
preempted or returning request's prefix from it instead of recomputing; with
``handoff_backend: shm`` a prefiller (``kv_role: kv_producer``) leaves its
blocks in a shared-memory directory where a decoder (``kv_consumer``) loads
them. ``coserve.engine.offload`` has the two halves, ``coserve.kv`` the policy
and the settings (``coserve.kv.config`` lists them; a bad one stops the engine
at start-up naming it).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from coserve.engine.in_flight import require_supported_engine
from coserve.engine.kv_metrics import CoServeKVPromMetrics, CoServeKVStats, merge_stats, own_stats
from coserve.engine.layer_safepoints import (
    DEFAULT_RUNAHEAD,
    CudaEvents,
    LayerSafepoints,
    RunAheadBound,
    StepPreempted,
)
from coserve.engine.offload import OffloadPlanner, OffloadWorker, StepPlan, model_salt
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.kv.config import KVSettings, parse_kv_settings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CoServeConnector", "CoServeConnectorMetadata", "StepPreempted", "sibling_transfer_work"]

logger = logging.getLogger("coserve.engine.connector")

BOARD_RETRY_S = 5.0  # how often a worker without the board looks for it again


@dataclass
class CoServeConnectorMetadata(KVConnectorMetadata):
    """Sent to the workers with every step: the step's number and the board to check."""

    step_id: int
    board: str
    safepoints: bool
    kv: StepPlan = field(default_factory=StepPlan)


class CoServeConnector(KVConnectorBase_V1):
    """Scheduler side numbers steps; worker side checks the safepoint before every layer."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if role == KVConnectorRole.SCHEDULER:
            require_supported_engine(vllm_config, "coserve's CoServeConnector")
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.safepoints, runahead, self.safepoint_min_step_s = _safepoint_settings(extra)
        self.in_multi_connector = False  # set by the TDGScheduler that finds it inside vLLM's MultiConnector
        self.board_name = board_name(str(self._kv_transfer_config.engine_id))
        self._next_step_id = 0
        self._board: SafepointBoard | None = None
        self._next_attach_s = 0.0  # worker side: when to look for the board again if it is not attached
        self.scheduler_board: SafepointBoard | None = None  # set by the TDGScheduler that creates it
        # Worker side. On a GPU the host runs ahead of the device; bound it (on a CPU, where the host is the
        # device, there is nothing to bound).
        bound = RunAheadBound(runahead, CudaEvents) if role == KVConnectorRole.WORKER and _on_cuda() else None
        self._safepoints = LayerSafepoints(bound)
        self._abandoned = False  # the bound step was abandoned at a safepoint (worker side)
        self._step_open = False  # the bound step's copies began and wait_for_save has not ended them (worker side)
        self._abandoned_step = -1  # scheduler side: the step whose output the scheduler is rolling back
        self.kv_settings: KVSettings = parse_kv_settings(extra)
        role_name = str(self._kv_transfer_config.kv_role)
        self._produce = role_name in ("kv_producer", "kv_both")
        self._consume = role_name in ("kv_consumer", "kv_both")
        self.planner: OffloadPlanner | None = None
        self.kv_worker: OffloadWorker | None = None
        if not (self.kv_settings.offload or self.kv_settings.handoff) or kv_cache_config is None:
            return
        block_size = vllm_config.cache_config.block_size
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        if role == KVConnectorRole.SCHEDULER:
            from coserve.scheduling.config import CONFIG_ENV, load_engine_config

            config = load_engine_config(
                extra.get("coserve_config") or os.environ.get(CONFIG_ENV),
                vllm_config.scheduler_config.max_num_batched_tokens,
            )
            salt = model_salt(
                vllm_config.model_config.model,
                block_size,
                str(vllm_config.cache_config.cache_dtype),
                str(vllm_config.model_config.dtype),
                len(group.layer_names),
                vllm_config.parallel_config.tensor_parallel_size,
            )
            self.planner = OffloadPlanner(
                self.kv_settings,
                block_size=block_size,
                block_bytes=block_bytes,
                salt=salt,
                config=config,
                produce=self._produce,
                consume=self._consume,
            )
            logger.info(
                "KV offload: %d host blocks of %.2f MiB (%d bytes bound), handoff %s (%s)",
                self.planner.pool.capacity,
                block_bytes / 2**20,
                self.kv_settings.host_memory_bytes,
                self.kv_settings.handoff_backend,
                role_name,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            capacity = self.kv_settings.host_memory_bytes // block_bytes if self.kv_settings.offload else 0
            self.kv_worker = OffloadWorker(
                self.kv_settings, capacity=capacity, rank=get_tensor_model_parallel_rank(), produce=self._produce
            )
            self._num_blocks = kv_cache_config.num_blocks

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by vLLM's scheduler for a request it takes from the waiting queue: tokens we can load."""
        if self.planner is None:
            return 0, False
        return self.planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.planner is not None:
            self.planner.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called by vLLM's scheduler once per step; gives the step its number and its KV copies."""
        self._next_step_id += 1
        plan = self.planner.plan_step(scheduler_output) if self.planner is not None else StepPlan()
        board = self.scheduler_board
        safepoints = self.safepoints and not (board is not None and board.paused())
        return CoServeConnectorMetadata(self._next_step_id, self.board_name, safepoints, plan)

    def step_abandoned(self, step_id: int) -> None:
        """Called by the ``TDGScheduler`` before it hands vLLM an abandoned step's output: that output still
        carries the connectors' transfer results, but this step's own copies must not be committed."""
        self._abandoned_step = step_id

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Called by vLLM's scheduler after every step with the workers' connector output; an abandoned step's
        too (its transfer results are real), but then the host pool commits none of its copies.

        The host pool's counters join the workers' stats here, before the scheduler reads them for /metrics.
        """
        super().update_connector_output(connector_output)
        if self.planner is None:
            return
        if self._abandoned_step != self._next_step_id:
            self.planner.step_done()  # an abandoned step's copies are partial: the next plan_step aborts them
        workers = own_stats(connector_output.kv_connector_stats)
        if workers is not None:
            copied = float(workers.data.get("bytes_offloaded", 0)) + float(workers.data.get("bytes_reloaded", 0))
            self.planner.observe_copies(copied, float(sum(workers.data.get("step_copy_s") or [])))
        stats = CoServeKVStats(data=self.planner.take_stats())
        connector_output.kv_connector_stats = merge_stats(
            connector_output.kv_connector_stats, stats, nested=self.in_multi_connector
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CoServeKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return CoServeKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """``POST /reset_prefix_cache?reset_external=true``: empty the host pool too."""
        if self.planner is not None:
            self.planner.pool.clear()
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended. On a prefiller with the shm handoff, one the router asked to decode elsewhere
        answers with the parameters the decoder loads its KV by (``coserve.kv.handoff``); vLLM returns them
        in the response, and the router passes them on."""
        if self.planner is None:
            return False, None
        answer = self.planner.remote_decode_answer(request)
        self.planner.finished(request.request_id)
        return False, answer

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether vLLM must split every CUDA graph at attention, so that the per-layer calls run in every step.

        Safepoints alone do not ask for it. vLLM then keeps its FULL_AND_PIECEWISE mode: a batch with any
        prefill work runs as piecewise graphs split at attention, where the safepoints run; a uniform decode
        batch runs as one full graph, with no safepoint. A decode step lasts 5-23 ms on an H200, less than
        any urgent request's slack, while splitting it into pieces with the run-ahead bound costs it up to
        2 % (``benchmarks/gpu/torch_check.py``, ``torch_decode_graphs_cuda``). Per-layer KV reloads (the host
        pool, the shm handoff) do ask for it: a request whose prompt but its last token is reloaded computes
        one token, so its step can be a uniform decode batch, and a full graph would skip the reload.
        """
        settings = parse_kv_settings(extra_config)
        return settings.offload or settings.handoff

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.kv_worker is not None:
            self.kv_worker.register(kv_caches, self._num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called by the model runner before each forward: remember which step is running, start its loads."""
        super().bind_connector_metadata(connector_metadata)
        if self._step_open and self.kv_worker is not None:
            # NOTE: the last step never reached wait_for_save (a runner that calls it elsewhere or not at all):
            # finish it now, so that its reloads complete in every layer before this forward runs on them.
            self._finish_step()
        if isinstance(connector_metadata, CoServeConnectorMetadata):
            if self._board is None and connector_metadata.safepoints and time.monotonic() >= self._next_attach_s:
                self._board = SafepointBoard.attach(connector_metadata.board)
                # NOTE: a rank on another node than the engine's never finds it: look again only now and then
                self._next_attach_s = time.monotonic() + BOARD_RETRY_S
            self._safepoints.begin(connector_metadata.step_id, self._board, connector_metadata.safepoints)
            self._abandoned = False
            if self.kv_worker is not None:
                self.kv_worker.begin(connector_metadata.kv)
                self._step_open = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # bind_connector_metadata already started the first layer's reload

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The safepoint, called by vLLM before every attention layer of every step; then the layer's reload."""
        self._safepoint(layer_name)
        if self.kv_worker is not None:
            self.kv_worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Called after each attention layer: a second safepoint, so the wait is at most half a layer
        (attention or MLP) instead of a whole one."""
        if self.kv_worker is not None:
            self.kv_worker.save_layer(layer_name)
        self._safepoint(layer_name)

    def _safepoint(self, layer_name: str) -> None:
        """The check; a step it abandons is marked, so that ``wait_for_save`` saves none of it."""
        try:
            self._safepoints.check(layer_name)
        except StepPreempted:
            self._abandoned = True
            raise

    def wait_for_save(self) -> None:
        """End of the forward: start the step's copy-outs (on a CPU the next forward waits for them; on CUDA
        they overlap it unless the planner fenced it: see ``coserve.engine.offload``).

        vLLM calls it in a ``finally``, so a step abandoned at a safepoint gets here too, with its blocks
        partly computed: it copies nothing out and writes no handoff file, and its reloads complete."""
        if self.kv_worker is not None and self._step_open:
            self._finish_step()

    def _finish_step(self) -> None:
        """The bound step's end, once: copy-outs for a completed step, completed reloads for an abandoned one."""
        self._step_open = False
        if self.kv_worker is None:
            return
        if self._abandoned:
            self.kv_worker.abandon()
        else:
            self.kv_worker.end()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Called by the model runner after each step: this worker's copy and safepoint counters since the last call."""
        data = (self.kv_worker.take_stats() if self.kv_worker is not None else None) or {}
        seconds, steps = self._safepoints.take_stats()
        if steps:
            data = {**data, "safepoint_s": seconds, "safepoint_steps": steps}
        return CoServeKVStats(data=data) if data else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.kv_worker is None or not self.kv_worker.load_errors:
            return set()
        errors, self.kv_worker.load_errors = self.kv_worker.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.close()

    @property
    def board(self) -> SafepointBoard | None:
        return self._board


def _safepoint_settings(extra: dict[str, Any]) -> tuple[bool, int, float]:
    """``safepoints``, ``safepoint_runahead`` and ``safepoint_min_step_s`` from the connector's extra config.

    ``safepoint_min_step_s``: a step the cost model predicts to end within it needs no safepoint (an urgent
    arrival waits at most that long for it anyway, and on a GPU each run-ahead wait costs the step)."""
    safepoints = extra.get("safepoints", True)
    if not isinstance(safepoints, bool):
        raise ValueError(f"kv_connector_extra_config.safepoints: must be true or false, got {safepoints!r}")
    runahead = extra.get("safepoint_runahead", DEFAULT_RUNAHEAD)
    if isinstance(runahead, bool) or not isinstance(runahead, int) or runahead < 0:
        raise ValueError(
            f"kv_connector_extra_config.safepoint_runahead: must be a whole number of safepoints >= 0, got {runahead!r}"
        )
    min_step_s = extra.get("safepoint_min_step_s", 0.0)
    if isinstance(min_step_s, bool) or not isinstance(min_step_s, (int, float)) or not min_step_s >= 0:
        raise ValueError(
            f"kv_connector_extra_config.safepoint_min_step_s: must be a number of seconds >= 0, got {min_step_s!r}"
        )
    return safepoints, runahead, float(min_step_s)


def _on_cuda() -> bool:
    """Whether this worker's device runs asynchronously from its host (CUDA or ROCm)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


# --- finding coserve's connector wherever vLLM put it ----------------------------------------------
# On GPUs the operator renders MultiConnector with coserve's connector first and NixlConnector (or an
# offload connector) after it; on CPUs coserve's alone. The scheduler, the worker and the validator
# must find it either way, or safepoint preemption is silently off where it matters most.

CONNECTOR_NAME = "CoServeConnector"


def find_connector(connector: object) -> CoServeConnector | None:
    """coserve's connector: ``connector`` itself, or one of a MultiConnector's (at any depth)."""
    if isinstance(connector, CoServeConnector):
        return connector
    for child in getattr(connector, "_connectors", None) or ():
        found = find_connector(child)
        if found is not None:
            return found
    return None


def sibling_transfer_work(metadata: object) -> list[str]:
    """The kinds of the other connectors' metadata in a step's MultiConnector metadata that carry transfer work.

    Called by ``TDGScheduler`` for every step it posts: a step with any is run to its end, never abandoned at
    a layer. Another connector's work in a step cannot be rolled back by coserve: NIXL's receives, sends and
    host saves (``reqs_to_recv``, ``reqs_to_send``, ``reqs_to_save``), vLLM's OffloadingConnector's and
    LMCache's stores of the step's blocks, which would keep partly computed KV under its block hashes.
    Whatever the connector, metadata carries work when any of its attributes is a non-empty collection
    (conservative: a connector coserve has not read is treated the same way), except NIXL's bookkeeping
    (``BOOKKEEPING``: which requests a batch holds, which were aborted, lease heartbeats), which moves no KV
    and which vLLM's V1 runner hands the connector in its ``finally`` (``start_load_kv``), abandoned step or not.
    """
    if isinstance(metadata, CoServeConnectorMetadata) or metadata is None:
        return []
    children = getattr(metadata, "metadata", None)
    if isinstance(children, tuple):  # MultiConnector's metadata: one per connector, in the connectors' order
        return [kind for child in children for kind in sibling_transfer_work(child)]
    fields = vars(metadata) if hasattr(metadata, "__dict__") else {}
    for name, value in fields.items():
        if name not in BOOKKEEPING and isinstance(value, (dict, list, set, frozenset, tuple)) and value:
            return [type(metadata).__name__]
    return []


# NixlConnectorMetadata's fields that move no KV (vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py)
BOOKKEEPING = frozenset({"reqs_in_batch", "reqs_not_processed", "heartbeat_by_engine"})


def find_metadata(metadata: object) -> CoServeConnectorMetadata | None:
    """coserve's part of a step's connector metadata (MultiConnector wraps each connector's in a tuple)."""
    if isinstance(metadata, CoServeConnectorMetadata):
        return metadata
    for child in getattr(metadata, "metadata", None) or ():
        found = find_metadata(child)
        if found is not None:
            return found
    return None
