"""The production example (examples/pool-production.yaml) against what the chart installs.

The pool validates against the CRD the chart ships; every object `coserve render` makes of it is valid
for the Kubernetes API (strict, the chart's Kubernetes version); and the chart's RBAC, cluster-wide and
per namespace, lets the operator read, create and patch every one of them: a kind the operator renders
but may not create would fail only in a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from charts.test_chart import (
    CHART,
    KUBERNETES_VERSION,
    granted_by,
    render,
)  # tests/ is on the path (pyproject: pythonpath)
from coserve.api.spec import GatewaySpec
from coserve.cli.manifest import load_pool, read_file
from coserve.operator.handlers import CHILD_RESOURCES
from coserve.operator.reconcile import DELETED_WHEN_NOT_RENDERED
from coserve.operator.resources import GATEWAY_API_KINDS, build_children
from coserve.provisioning import plan_for
from crd_schema import apply_crd_defaults, cel_failures

EXAMPLE = CHART.parents[1] / "examples" / "pool-production.yaml"


def children(*, gateway: bool = False) -> list[dict[str, Any]]:
    """What ``coserve render`` makes of the example; ``gateway``: with ``spec.gateway.enabled`` too."""
    pool = load_pool(read_file(str(EXAMPLE)))
    if gateway:
        pool = pool.model_copy(update={"spec": pool.spec.model_copy(update={"gateway": GatewaySpec(enabled=True)})})
    return build_children(pool, plan_for(pool.spec))


def test_the_example_validates_against_the_crd_the_chart_installs() -> None:
    (crd,) = [yaml.safe_load(path.read_text()) for path in sorted((CHART / "crds").glob("*.yaml"))]
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    document = yaml.safe_load(Path(EXAMPLE).read_text())
    jsonschema.Draft4Validator(schema).validate(document["spec"])  # OpenAPI 3.0's schema dialect
    defaulted = apply_crd_defaults(schema, document["spec"])
    assert cel_failures(schema, defaulted, "spec") == []  # and its CEL rules, as the API server runs them


def test_the_example_renders_every_production_piece_and_all_are_valid_kubernetes_objects() -> None:
    rendered = children()
    kinds = {child["kind"] for child in rendered}
    # the token Secret reference, the model cache claim, budgets, spread, the drain hook
    assert {"PersistentVolumeClaim", "PodDisruptionBudget", "Deployment"} <= kinds
    decoder = next(c for c in rendered if c["metadata"]["name"] == "assistant-decoder")
    pod = decoder["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["name"] == "model-download"
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    (engine,) = pod["containers"]
    assert engine["lifecycle"]["preStop"]["exec"]["command"][:3] == ["python3", "-m", "coserve.drain"]
    assert any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "hf-token" for e in engine["env"])
    for child in [*rendered, *children(gateway=True)]:
        if child["kind"] not in GATEWAY_API_KINDS:  # custom kinds: checked against their CRDs (test_gateway_mode)
            kubernetes_validate.validate(child, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("sets", "kind"),
    [((), "ClusterRole"), (("watchNamespaces={llm}",), "Role")],
    ids=["cluster-wide", "namespaced"],
)
def test_the_charts_rbac_lets_the_operator_create_every_object_of_the_example(sets: tuple[str, ...], kind: str) -> None:
    roles = [o for o in render(*sets) if o["kind"] == kind and not o["metadata"]["name"].endswith("leader-election")]
    assert roles
    granted = granted_by([rule for role in roles for rule in role["rules"]])
    missing = [
        (child["kind"], verb)
        for child in children(gateway=True)
        for verb in ("get", "list", "watch", "create", "patch")
        if (*CHILD_RESOURCES[child["kind"]], verb) not in granted
    ]
    # and delete the children a pool stops asking for (its budgets, gateway mode's)
    missing += [
        (kind, "delete") for kind, _ in DELETED_WHEN_NOT_RENDERED if (*CHILD_RESOURCES[kind], "delete") not in granted
    ]
    assert missing == []
