"""What each benchmark result measures: the roots of its measured path.

Who reads it: ``freshness.py``, which follows each root (a file, or a folder for all its files) through
every in-repo module it imports, and fingerprints every file it reaches. So a root is only what no
import reaches: the benchmark's own script, and the modules a coserve engine loads by name (the plugin
through ``pyproject.toml``'s entry point; the scheduler, worker, request validator and KV connector
through the flags ``coserve.engine.launch`` and the operator render). A result with no entry here is reported as
unknown by ``make bench-status``; ``freshness.stamp`` refuses to write one.
"""

from __future__ import annotations

# What vLLM imports by name in an engine started with coserve's flags (stock engines load none of it).
ENGINE = (
    "src/coserve/engine/plugin.py",
    "src/coserve/engine/scheduler.py",
    "src/coserve/engine/worker.py",
    "src/coserve/engine/validation.py",
    "src/coserve/engine/connector.py",
)
GPU = ("benchmarks/gpu",)
# What the GPU scripts import from ``benchmarks/`` by putting it on sys.path (an import this file's
# resolution, which starts in the script's own folder, does not find).
GPU_STATS = ("benchmarks/harness/stats.py",)

MEASURED: dict[str, tuple[str, ...]] = {
    "preemption_latency": (*ENGINE, "benchmarks/preemption.py"),
    "safepoint_overhead": (*ENGINE, "benchmarks/preemption.py"),
    "priority_scheduling": (*ENGINE, "benchmarks/priority_scheduling.py"),
    "coserving": (*ENGINE, "benchmarks/coserving.py"),
    "cost_model": (*ENGINE, "benchmarks/cost_model.py"),
    "kv_reload": (*ENGINE, "benchmarks/kv_offload.py"),
    "checkpoint_overhead": (*ENGINE, "benchmarks/kv_offload.py"),
    "kv_pool": ("benchmarks/kv_pool.py",),
    "ttfet": (*ENGINE, "benchmarks/ttfet.py"),
    "ttfet_gateway": (*ENGINE, "benchmarks/ttfet.py", "src/coserve/epp/server.py"),
    "harvest_pool": (*ENGINE, "benchmarks/harvest_pool.py"),
    # the script starts ``coserve router`` processes: the router app (and what it imports) is a root, not an import
    "router_overhead": ("benchmarks/router_overhead.py", "src/coserve/router/app.py", "src/coserve/epp/server.py"),
    "router_overhead_stream": (
        "benchmarks/router_overhead.py",
        "src/coserve/router/app.py",
        "src/coserve/epp/server.py",
    ),
    "router_pins": ("benchmarks/router_overhead.py", "src/coserve/router/app.py"),
    "reconcile": ("benchmarks/reconcile.py",),
    "autoscaling": ("benchmarks/autoscaling.py",),
    # the simulator against the engine it measures (its engine included)
    "simulator_fidelity": (*ENGINE, "benchmarks/simulator_fidelity.py"),
    "ttfet_at_scale": ("benchmarks/simulator_at_scale.py",),
    "goroute_at_scale": ("benchmarks/simulator_at_scale.py",),
    "harvest_at_scale": ("benchmarks/simulator_at_scale.py",),
    "plan_check": ("benchmarks/plan_check.py",),
    "simulator_speed": ("benchmarks/simulator_at_scale.py",),
    # the GPU check's results (``*_cuda.json``) measure the GPU path as well
    "preemption_latency_cuda": (*ENGINE, *GPU, "benchmarks/preemption.py"),
    "safepoint_overhead_cuda": (*ENGINE, *GPU, "benchmarks/preemption.py"),
    "kv_reload_cuda": (*ENGINE, *GPU, "benchmarks/kv_offload.py"),
    # the plain-PyTorch GPU check: coserve's safepoint objects without vLLM
    "torch_preemption_latency_cuda": ("benchmarks/gpu/torch_check.py", *GPU_STATS),
    "torch_safepoint_overhead_cuda": ("benchmarks/gpu/torch_check.py", *GPU_STATS),
    "torch_decode_graphs_cuda": ("benchmarks/gpu/torch_check.py", *GPU_STATS),
    "torch_kv_offload_cuda": ("benchmarks/gpu/torch_check.py", *GPU_STATS),
    "torch_cost_model_cuda": ("benchmarks/gpu/torch_check.py", *GPU_STATS),
}
