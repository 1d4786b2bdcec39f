"""The chart's Grafana dashboard: shipped as a ConfigMap the dashboard sidecar finds, every panel's PromQL
parsed by Prometheus's own promtool, and every metric it names one that coserve or vLLM exports."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from charts.test_chart import CHART, render  # tests/ is on the path (pyproject: pythonpath)

DASHBOARD = CHART / "dashboards" / "coserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# a metric name directly followed by its selector or range: what a panel reads
METRIC = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(?=[{\[])")


def expressions() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel["targets"]]


def exported(registry: CollectorRegistry, prefix: str) -> set[str]:
    names = set()
    for family in registry.collect():
        if family.name.startswith(prefix):
            names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def test_the_chart_ships_the_dashboard_where_grafanas_sidecar_looks() -> None:
    maps = [d for d in render() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["coserve.json"]) == json.loads(DASHBOARD.read_text())
    assert not [d for d in render("dashboard.enabled=false") if d["metadata"]["name"].endswith("-dashboard")]


def test_every_panel_query_parses(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: `make` installs Debian's prometheus package, which has it")
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"panel_{i}", "expr": expr}
                                                        for i, (_, expr) in enumerate(expressions())]}]}  # fmt: skip
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = path.with_name("broken.yaml")  # the check can fail: a panel with a typo is refused
    bad = {"groups": [{"name": "x", "rules": [{"record": "x", "expr": "sum(rate(x[5m])"}]}]}
    broken.write_text(yaml.safe_dump(bad))
    assert subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, check=False).returncode != 0


def engine_registry() -> CollectorRegistry:
    """The coserve vLLM plugin's metrics (KV offload, safepoints), registered as vLLM registers them, with
    prometheus_client's own classes bound to a registry of their own."""
    from coserve.engine.kv_metrics import CoServeKVPromMetrics

    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    CoServeKVPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    return registry


def test_every_metric_a_panel_reads_is_exported() -> None:
    import coserve.operator.metrics  # noqa: F401 - registers the operator's metrics in the default registry
    from coserve.router.metrics import RouterMetrics

    ours = (
        exported(RouterMetrics().registry, "coserve_router_")
        | exported(REGISTRY, "coserve_operator_")
        | exported(engine_registry(), "coserve:")
    )
    assert {"coserve:safepoint_steps_total", "coserve_operator_plan_replicas"} <= ours  # every source is read
    vllm_source = "".join(
        path.read_text() for path in (Path(__import__("vllm").__file__).parent / "v1" / "metrics").glob("*.py")
    )
    missing = []
    for title, expr in expressions():
        for name in METRIC.findall(expr):
            if name.startswith("vllm:"):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                if f'"{base}"' not in vllm_source:
                    missing.append((title, name))
            elif name not in ours:
                missing.append((title, name))
    assert not missing, f"panels read metrics nothing exports: {missing}"
    assert len({n for _, e in expressions() for n in METRIC.findall(e)}) >= 12


def test_the_pod_monitor_scrapes_every_pools_router_and_engines_as_pool_and_role() -> None:
    """Its selector matches the pods the operator renders for a pool (router, prefillers, decoders, not the
    config), on the port they serve metrics from, and it relabels their series with the labels the default
    autoscaling queries and the dashboard select on."""
    from coserve.cli.manifest import load_pool, read_file
    from coserve.operator.resources import build_children
    from coserve.provisioning import plan_for

    assert not [d for d in render() if d["kind"] == "PodMonitor"]  # off by default, like the ServiceMonitor
    (monitor,) = [d for d in render("podMonitor.enabled=true") if d["kind"] == "PodMonitor"]
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    scoped = [d for d in render("podMonitor.enabled=true", "watchNamespaces={llm}") if d["kind"] == "PodMonitor"]
    assert scoped[0]["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}

    for example in ("pool.yaml", "pool-production.yaml"):  # the production one adds its own pod labels
        pool = load_pool(read_file(str(CHART.parents[1] / "examples" / example)))
        pods = {
            child["metadata"]["name"]: child["spec"]["template"]
            for child in build_children(pool, plan_for(pool.spec))
            if child["kind"] == "Deployment"
        }
        assert len(pods) >= 3
        for name, template in pods.items():
            assert_scraped(spec, name, template, pool.metadata.name)


def assert_scraped(spec: dict[str, Any], name: str, template: dict[str, Any], pool: str) -> None:
    """The PodMonitor ``spec`` selects ``template``'s pods, on a port they serve, labelled pool and role."""
    selector = spec["selector"]
    labels = template["metadata"]["labels"]
    selected = all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and all(
        labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
    )
    assert selected, f"{name}'s pods are not scraped: {labels}"
    endpoint = spec["podMetricsEndpoints"][0]
    ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports, name
    relabelled = {
        r["targetLabel"]: labels.get(
            next(k for k in labels if "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", k)
                 == r["sourceLabels"][0])
        )
        for r in endpoint["relabelings"]
    }  # fmt: skip
    assert relabelled["pool"] == pool
    assert relabelled["role"] in {"router", "prefiller", "decoder"}
