"""The chart's Grafana dashboard: shipped as a ConfigMap the dashboard sidecar finds, every panel's PromQL
parsed by Prometheus's own promtool, and every metric it names one that coserve or vLLM exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

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


def test_every_metric_a_panel_reads_is_exported() -> None:
    import coserve.operator.metrics  # noqa: F401 - registers the operator's metrics in the default registry
    from coserve.router.app import _Metrics

    ours = exported(_Metrics().registry, "coserve_router_") | exported(REGISTRY, "coserve_operator_")
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
