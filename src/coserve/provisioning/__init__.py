"""Pure provisioning policy: from a CoServePool spec and an engine profile to a Plan.

Imports the API types and the stdlib only (the import-linter contract in
``.importlinter`` checks it). Entry point: ``plan_for``.
"""

from __future__ import annotations

from coserve.api.problems import InvalidInput
from coserve.api.profile import EngineProfile
from coserve.api.spec import PoolShape, SpecModel
from coserve.api.status import Plan
from coserve.provisioning.model import MAX_REPLICAS_PER_ROLE, Capacities, make_plan
from coserve.provisioning.profile import ResolvedProfile, resolve_profile
from coserve.provisioning.validation import check_spec, spec_warnings

__all__ = [
    "MAX_REPLICAS_PER_ROLE",
    "Capacities",
    "ResolvedProfile",
    "check_spec",
    "make_plan",
    "plan_for",
    "resolve_profile",
]


def plan_for(spec: SpecModel, measured: EngineProfile | None = None, *, kept_shape: PoolShape | None = None) -> Plan:
    """Resolve the profile, check the spec, and make the plan; ``InvalidInput`` lists every problem.

    Who calls it: the CLI (``coserve plan``/``render``) and the operator's reconcile
    handler, which turns ``InvalidInput`` into PlanValid=False, and passes ``kept_shape``,
    the shape a running pool keeps until its spec changes.
    """
    profile = resolve_profile(spec, measured)
    problems = check_spec(spec, profile)
    if problems:
        raise InvalidInput(problems)
    plan = make_plan(spec, profile, kept_shape)
    plan.warnings = spec_warnings(spec) + plan.warnings
    return plan
