"""The operator's decisions for one CoServePool, as plain data: what to create, what to patch, what status to write.

Who calls it: ``coserve.operator.reconciler`` (``PoolReconciler``), for every
trigger the kopf handlers in ``coserve.operator.handlers`` pass on (a pool or
child watch event that is news, a resync, taking the Lease over). It reads the
pool and its children from the watch-fed cache, calls ``reconcile``, then
carries out the actions, writes the status and posts the events. Everything that decides lives here and is
pure (no kopf, no Kubernetes client, no clock: ``now`` is an argument), so the
decisions are tested table-driven without a cluster.

Rules:

- A spec that the schema accepts but the provisioning model rejects (min above
  max, an SLO the profile can never meet, ...) gives PlanValid=False naming the
  field, a Warning event, and **no** child created or changed.
- Children are created when missing and patched when they drifted from the
  desired state (a field the operator sets has another value); fields the API
  server or other controllers add are left alone, so the operator never fights
  defaulting. Drift is judged as the API server stores objects: resource
  quantities by value (``1`` is ``"1"``, ``"0.5"`` is ``"500m"``), a ``false`` or
  empty value as an absent field, and list items without ``apiVersion``/``kind``
  (see ``drift``). Two reconciles of the same generation and state do nothing.
- While ``spec.autoscaling.enabled``, the Deployments' replica counts belong to
  the autoscaler (``coserve.operator.autoscaler``): they are created at the
  plan's counts and never reset, and its ``status.autoscaling`` is kept. While
  it is off they belong to the plan: a replica count changed by hand is reset,
  with a ReplicasReset Warning event saying why and what to change instead.
- A child that exists but is not controlled by this pool (no owner reference
  with the pool's uid) is never touched: Degraded=True with reason ChildConflict.
- Some children are optional: ``CHILDREN`` names every child a pool may have,
  ``build_children`` renders those its spec asks for. One it does not render is
  neither created nor waited for. A PodDisruptionBudget it no longer renders (the
  user turned it off) is deleted if this pool controls it; any other (a
  PersistentVolumeClaim holding a model cache above all) is left as it is, and
  goes with the pool through its owner reference.
- A PersistentVolumeClaim is changed only as the API server allows: its metadata,
  and a larger ``spec.resources.requests.storage``. Any other difference (another
  storage class or access mode, a smaller size) is not patched: Degraded=True with
  reason ChildImmutable names it. Fields the server or the provisioner fill in
  (``volumeName``, a defaulted ``storageClassName`` or ``volumeMode``) are not
  drift, as for every child.
- Warnings about a problem (InvalidSpec, ChildConflict, ChildImmutable) are posted
  when the problem appears or changes, not on every resync: the condition carries it.
- The security-relevant children are the operator's whole (``_AUTHORITATIVE``): the
  NetworkPolicy's ``spec``, the Role's ``rules``, the RoleBinding's ``roleRef`` and
  ``subjects`` are compared both ways, so a label added to a selector or a
  ``namespaceSelector: {}`` added to a peer is drift too, and the patch removes it
  (``null`` for a map key; a list is replaced whole). What the API server defaults
  there (``_SERVER_DEFAULTS``) is not drift. The router-token Secret holds exactly the
  key ``token``, not empty: another key is removed, and an empty or missing token is
  left out of the patch, for the adapter to generate a new one.
- Pod templates are tolerant but not naive: containers, init containers and volumes
  are matched by name, so a sidecar, an init container or a volume an admission
  webhook adds is not drift and is kept by a patch; but a dangerous addition
  (``_pod_dangers``: host namespaces, a privileged container, privilege escalation,
  added capabilities, a hostPath volume) that the rendered template does not ask for
  is drift, and the patch takes it out.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError

from coserve.api.conditions import find_condition, set_condition
from coserve.api.parse import parse_pool
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import CoServePool
from coserve.api.spec import PoolShape
from coserve.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    Plan,
    ReplicaStatus,
    RoleReplicas,
    StatusModel,
)
from coserve.operator.normalize import is_blank, same_quantity, stored_quantity
from coserve.operator.resources import (
    GATEWAY_API_KINDS,
    GATEWAY_CHILDREN,
    TOKEN_KEY,
    Component,
    Manifest,
    build_children,
    child_name,
)
from coserve.provisioning import plan_for

__all__ = ["DELETED_WHEN_NOT_RENDERED", "ChildAction", "ChildKey", "PoolEvent", "Reconciliation", "drift", "reconcile"]

ChildKey = tuple[str, str]  # (kind, name)

_ROLE_DEPLOYMENTS = (("prefillers", "prefiller"), ("decoders", "decoder"), ("routers", "router"))

# Children deleted when the pool no longer renders them (and controls them): the PodDisruptionBudgets and gateway
# mode's children. Others (a model cache's claim above all) are left to the garbage collector.
DELETED_WHEN_NOT_RENDERED: frozenset[tuple[str, Component]] = frozenset(
    {("PodDisruptionBudget", "router"), ("PodDisruptionBudget", "prefiller"), ("PodDisruptionBudget", "decoder"),
     *GATEWAY_CHILDREN}
)  # fmt: skip
# kind -> spec fields of which an object holds at most one: setting one removes the other
_ONE_OF: dict[str, tuple[tuple[str, str], ...]] = {"PodDisruptionBudget": (("minAvailable", "maxUnavailable"),)}
_CLAIM = "PersistentVolumeClaim"
_CLAIM_STORAGE = "spec.resources.requests.storage"

# kind -> top-level fields the operator owns whole: what the object holds there and the operator does not send is
# drift too. They decide who reaches the engines and what the router's identity may do.
_AUTHORITATIVE: dict[str, tuple[str, ...]] = {
    "NetworkPolicy": ("spec",),
    "Role": ("rules",),
    "RoleBinding": ("roleRef", "subjects"),
}
# What the API server fills into those fields when it is not sent: (field names from the top, "[]" for a list
# item) -> the values it defaults to. Only these may be present without the operator sending them.
_SERVER_DEFAULTS: dict[tuple[str, ...], tuple[Any, ...]] = {
    ("spec", "policyTypes"): (["Ingress"], ["Ingress", "Egress"]),
    ("spec", "ingress", "[]", "ports", "[]", "protocol"): ("TCP",),
    ("spec", "egress", "[]", "ports", "[]", "protocol"): ("TCP",),
    ("subjects", "[]", "apiGroup"): ("", "rbac.authorization.k8s.io"),
}
_TOKEN_SECRET = "Secret"  # noqa: S105 - a kind, not a secret
# Pod template lists whose items are matched by name: others' items (a webhook's sidecar) are not drift.
_NAMED_LISTS = ("containers", "initContainers", "volumes")
_HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")


@dataclass(frozen=True)
class ChildAction:
    """Create ``body``; merge-patch the child with ``body`` (the desired object, or for a
    PersistentVolumeClaim the part that may change); or delete the child, ``body`` holding its
    ``metadata.name`` and ``metadata.uid`` (the object observed, and only that one)."""

    verb: Literal["create", "patch", "delete"]
    kind: str
    name: str
    body: Manifest
    reason: str


@dataclass(frozen=True)
class PoolEvent:
    """A Kubernetes Event to post on the pool."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Reconciliation:
    actions: tuple[ChildAction, ...]
    status: dict[str, Any]
    events: tuple[PoolEvent, ...]
    plan_valid: bool


def reconcile(
    body: Mapping[str, Any],
    observed: Mapping[ChildKey, Mapping[str, Any] | None],
    now: datetime,
    *,
    measured_profile: EngineProfile | None = None,
    profile_problem: Problem | None = None,
    operator_image_tag: str | None = None,
    unserved: frozenset[str] = frozenset(),
) -> Reconciliation:
    """Decide one reconcile of the pool ``body`` given its ``observed`` children (``None``: absent).

    ``measured_profile`` is the profile ``spec.profile.configMapRef`` points at, read
    by the adapter; ``profile_problem`` says why it could not be read. ``unserved`` are the gateway-mode
    kinds the API server does not serve (their CRDs are not installed): their children are neither created
    nor patched, and the GatewayReady condition names what to install.
    """
    previous = _previous_status(body.get("status"))
    generation = _generation(body)
    try:
        pool = parse_pool({k: v for k, v in body.items() if k != "status"})
        if profile_problem is not None:
            raise InvalidInput([profile_problem])
        plan = plan_for(pool.spec, measured_profile, kept_shape=kept_shape(previous, generation))
    except InvalidInput as error:
        return _invalid(previous, generation, error.problems, now)

    desired = build_children(pool, plan, operator_image_tag=operator_image_tag)
    autoscaled = pool.spec.autoscaling.enabled
    uid = pool.metadata.uid
    actions: list[ChildAction] = []
    conflicts: list[str] = []
    immutable: list[str] = []
    for child in desired:
        kind, name = child["kind"], child["metadata"]["name"]
        if kind in unserved:
            continue
        current = observed.get((kind, name))
        if current is None:
            actions.append(ChildAction("create", kind, name, child, "missing"))
            continue
        if uid is not None and not _controlled_by(current, uid):
            conflicts.append(f"{kind} {name} exists and is not controlled by this pool")
            continue
        wanted = _keep_autoscaled_replicas(child, current) if autoscaled else child
        if kind == _CLAIM:
            action, kept = _claim_patch(wanted, current)
            actions += [action] if action is not None else []
            immutable += [kept] if kept is not None else []
            continue
        wanted = _without_replaced_alternatives(wanted, current)
        changed = list(dict.fromkeys([*drift(wanted, current), *_owned_whole(wanted, current)]))
        if changed:
            body = _patch_body(wanted, current)
            actions.append(ChildAction("patch", kind, name, body, "drifted: " + ", ".join(changed[:5])))
    actions += _deletions(pool.metadata.name, desired, observed, uid)

    status = _status(pool, plan, previous, generation, observed, actions, conflicts, immutable, now, unserved)
    # One Event per verb, not per child: a new pool gets "Created" once, naming them all.
    events = [
        PoolEvent("Normal", reason, "; ".join(_action_message(a) for a in actions if _verb_reason(a) == reason))
        for reason in dict.fromkeys(_verb_reason(a) for a in actions)
    ]
    if conflicts and not _said(previous, ConditionType.DEGRADED, "; ".join(conflicts)):
        events += [PoolEvent("Warning", "ChildConflict", message) for message in conflicts]
    if immutable and not _said(previous, ConditionType.DEGRADED, "; ".join(immutable)):
        events += [PoolEvent("Warning", "ChildImmutable", message) for message in immutable]
    if not autoscaled:
        # A manual `kubectl scale` is undone, but said so: the plan owns replicas while autoscaling is off.
        events += [
            PoolEvent("Warning", "ReplicasReset", f"{a.kind} {a.name} was scaled outside the operator; reset to the "
                      f"plan's {a.body['spec']['replicas']} replicas (change spec.workload, or enable "
                      "spec.autoscaling to let replicas follow load)")
            for a in actions
            if a.kind == "Deployment" and "spec.replicas" in a.reason.removeprefix("drifted: ").split(", ")
        ]  # fmt: skip
    if previous.plan is None or (previous.plan.prefillers, previous.plan.decoders) != (plan.prefillers, plan.decoders):
        events.insert(0, PoolEvent("Normal", "Planned", _plan_message(plan)))
    return Reconciliation(tuple(actions), status, tuple(events), True)


def drift(desired: Any, observed: Any, path: str = "") -> list[str]:
    """Paths where ``observed`` differs from ``desired`` in a field ``desired`` sets, as the API server stores it.

    Fields only ``observed`` has (server defaults, other controllers' annotations)
    are not drift. Lists must match element by element. What the server does to
    what it is sent is not drift either (see ``coserve.operator.normalize``):

    - ``apiVersion`` and ``kind`` absent at the top of ``observed`` (LIST and watch
      items carry neither); present with another value, they are drift;
    - a resource quantity under ``resources.requests``/``resources.limits`` is compared
      by value (``1`` == ``"1"``, ``"0.5"`` == ``"500m"``, ``"1024Mi"`` == ``"1Gi"``);
    - a desired ``false``, ``""``, ``[]`` or ``{}`` matches an absent field (the server
      leaves them out); a desired ``true`` or non-empty value against an absent one is drift.
      Not under ``securityContext``: those fields are pointers the server keeps, and an
      absent ``allowPrivilegeEscalation`` means ``true``, so removing it by hand is drift.
    - a pod template's ``containers``, ``initContainers`` and ``volumes`` are matched by
      ``name``: each desired item must be there and match; items only ``observed`` has
      are not drift here (``_pod_dangers`` judges them). A path names the desired index.
    """
    return _drift(desired, observed, path, ())


_TYPE_KEYS = ("apiVersion", "kind")
_RESOURCE_LISTS = ("limits", "requests")


def _drift(desired: Any, observed: Any, path: str, keys: tuple[str, ...]) -> list[str]:
    """``drift`` below ``keys``: the field names from the top object down to ``desired`` (``[]`` for a list item)."""
    if observed is None and is_blank(desired) and "securityContext" not in keys:
        return []  # NOTE: securityContext fields are pointers the server keeps; absent there is not false
    if isinstance(desired, Mapping):
        if not isinstance(observed, Mapping):
            return [path or "."]
        out: list[str] = []
        for key, value in desired.items():
            if not keys and key in _TYPE_KEYS and observed.get(key) is None:
                continue  # a LIST or watch item: the server leaves apiVersion and kind out
            out += _drift(value, observed.get(key), f"{path}.{key}" if path else str(key), (*keys, str(key)))
        return out
    if isinstance(desired, list):
        if _named_list(keys, desired) and isinstance(observed, list):
            have = _by_name(observed)
            out = []
            for index, want in enumerate(desired):
                item = f"{path}[{index}]"
                found = have.get(want["name"])
                out += [item] if found is None else _drift(want, found, item, (*keys, "[]"))
            return out
        if not isinstance(observed, list) or len(observed) != len(desired):
            return [path]
        out = []
        for index, (want, have) in enumerate(zip(desired, observed, strict=True)):
            out += _drift(want, have, f"{path}[{index}]", (*keys, "[]"))
        return out
    if isinstance(desired, bool) or isinstance(observed, bool):
        return [] if desired is observed else [path]
    if desired == observed:
        return []
    return [] if _in_resource_list(keys) and same_quantity(desired, observed) else [path]


def _named_list(keys: tuple[str, ...], items: list[Any]) -> bool:
    """True for a pod template's ``containers``, ``initContainers`` or ``volumes``: items matched by name."""
    return (
        len(keys) >= 3
        and keys[-3:-1] == ("template", "spec")
        and keys[-1] in _NAMED_LISTS
        and all(isinstance(item, Mapping) and isinstance(item.get("name"), str) for item in items)
    )


def _by_name(items: Sequence[Any]) -> dict[str, Mapping[str, Any]]:
    return {item["name"]: item for item in items if isinstance(item, Mapping) and isinstance(item.get("name"), str)}


def _owned_whole(desired: Manifest, observed: Mapping[str, Any]) -> list[str]:
    """Paths of what ``observed`` holds beyond ``desired`` where the operator owns the whole field: the
    ``_AUTHORITATIVE`` fields, the router token's keys, and a pod template's dangerous additions."""
    kind = desired.get("kind")
    out: list[str] = []
    for field in _AUTHORITATIVE.get(str(kind), ()):
        out += _extra(desired.get(field), observed.get(field), field, (field,))
    if kind == _TOKEN_SECRET:
        out += _token_problems(observed)
    if kind == "Deployment":
        out += _pod_dangers(_template_spec(desired), _template_spec(observed), "spec.template.spec")
    return out


def _extra(desired: Any, observed: Any, path: str, keys: tuple[str, ...]) -> list[str]:
    """Paths of fields ``observed`` has and ``desired`` does not send (server defaults aside)."""
    if isinstance(desired, Mapping) and isinstance(observed, Mapping):
        out: list[str] = []
        for key, value in observed.items():
            here, below = f"{path}.{key}", (*keys, str(key))
            if desired.get(key) is None:
                out += [] if value is None or _defaulted(below, value) else [here]
            else:
                out += _extra(desired[key], value, here, below)
        return out
    if isinstance(desired, list) and isinstance(observed, list):
        out = []
        for index, (want, have) in enumerate(zip(desired, observed, strict=False)):
            out += _extra(want, have, f"{path}[{index}]", (*keys, "[]"))
        return out
    return []  # a different value or length is drift's to report


def _defaulted(keys: tuple[str, ...], value: Any) -> bool:
    return value in _SERVER_DEFAULTS.get(keys, ())


def _without_extras(desired: Any, observed: Any, keys: tuple[str, ...]) -> Any:
    """``desired`` as a merge patch that also removes what ``observed`` has beyond it: ``None`` for a map key
    (server defaults kept); a list is replaced whole by the patch anyway."""
    if not isinstance(desired, Mapping) or not isinstance(observed, Mapping):
        return desired
    out = {key: _without_extras(value, observed.get(key), (*keys, str(key))) for key, value in desired.items()}
    for key, value in observed.items():
        if key not in out and value is not None and not _defaulted((*keys, str(key)), value):
            out[key] = None
    return out


def _token(secret: Mapping[str, Any]) -> str | None:
    """The router token the Secret holds (base64, as stored), or ``None`` when it is missing or empty."""
    value = (secret.get("data") or {}).get(TOKEN_KEY)
    if not isinstance(value, str):
        return None
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return value if decoded.strip() else None


def _token_problems(secret: Mapping[str, Any]) -> list[str]:
    data = secret.get("data") or {}
    extra = [f"data.{key}" for key in data if key != TOKEN_KEY] if isinstance(data, Mapping) else ["data"]
    return ([] if _token(secret) is not None else [f"data.{TOKEN_KEY}"]) + extra


def _template_spec(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    template = (deployment.get("spec") or {}).get("template") or {}
    spec = template.get("spec") if isinstance(template, Mapping) else None
    return spec if isinstance(spec, Mapping) else {}


def _pod_dangers(desired: Mapping[str, Any], observed: Mapping[str, Any], path: str) -> list[str]:
    """Paths of the security-relevant additions to a pod spec that ``desired`` does not ask for: a host
    namespace, a privileged container, privilege escalation, added capabilities, a hostPath volume."""
    out = [f"{path}.{field}" for field in _HOST_NAMESPACES if observed.get(field) is True and not desired.get(field)]
    for field in ("containers", "initContainers", "ephemeralContainers"):
        wanted = _by_name(desired.get(field) or [])
        for index, container in enumerate(observed.get(field) or []):
            if isinstance(container, Mapping):
                own = wanted.get(str(container.get("name")), {})
                out += [
                    f"{path}.{field}[{index}].securityContext.{name}" for name in _container_dangers(own, container)
                ]
    wanted_volumes = _by_name(desired.get("volumes") or [])
    for index, volume in enumerate(observed.get("volumes") or []):
        if (
            isinstance(volume, Mapping)
            and volume.get("hostPath") is not None
            and wanted_volumes.get(str(volume.get("name")), {}).get("hostPath") is None
        ):
            out.append(f"{path}.volumes[{index}].hostPath")
    return out


def _container_dangers(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """The ``securityContext`` fields of ``observed`` that give more than ``desired`` does."""
    want, have = desired.get("securityContext") or {}, observed.get("securityContext") or {}
    if not isinstance(have, Mapping):
        return []
    out = [f for f in ("privileged", "allowPrivilegeEscalation") if have.get(f) is True and want.get(f) is not True]
    added = (have.get("capabilities") or {}).get("add") or []
    if set(added) - set((want.get("capabilities") or {}).get("add") or []):
        out.append("capabilities.add")
    return out


def _patch_body(wanted: Manifest, current: Mapping[str, Any]) -> Manifest:
    """The merge patch that brings ``current`` to ``wanted``: the desired object, plus what removes the extras
    of the fields the operator owns whole, and for a Deployment the tolerated additions of others, kept."""
    kind = wanted.get("kind")
    body = dict(wanted)
    for field in _AUTHORITATIVE.get(str(kind), ()):
        if field in body:
            body[field] = _without_extras(body[field], current.get(field), (field,))
    if kind == _TOKEN_SECRET:
        data = current.get("data") if isinstance(current.get("data"), Mapping) else {}
        removed: dict[str, Any] = {key: None for key in data or {} if key != TOKEN_KEY}
        token = _token(current)
        # NOTE: no token here means "generate one": the adapter fills a missing token in (it is random, not pure)
        body["data"] = {**removed, **({TOKEN_KEY: token} if token is not None else {})}
    if kind == "Deployment":
        spec = dict(body["spec"])
        template = dict(spec["template"])
        template["spec"] = _pod_spec_patch(template["spec"], _template_spec(current))
        body["spec"] = {**spec, "template": template}
    return body


def _pod_spec_patch(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> Manifest:
    """``desired`` pod spec with others' containers, init containers and volumes kept after the operator's (a
    merge patch replaces lists whole), each without its dangerous additions; and host namespaces turned off."""
    out: Manifest = dict(desired)
    for field in _HOST_NAMESPACES:
        if observed.get(field) is True and not desired.get(field):
            out[field] = None
    own_volumes = _by_name(desired.get("volumes") or [])
    dropped = {
        str(v.get("name"))
        for v in observed.get("volumes") or []
        if isinstance(v, Mapping) and v.get("hostPath") is not None
        and own_volumes.get(str(v.get("name")), {}).get("hostPath") is None
    }  # fmt: skip
    for field in _NAMED_LISTS:
        own = list(desired.get(field) or [])
        names = {item["name"] for item in own if isinstance(item, Mapping)}
        theirs = [
            item for item in observed.get(field) or []
            if isinstance(item, Mapping) and item.get("name") not in names and item.get("name") not in dropped
        ]  # fmt: skip
        if field != "volumes":
            theirs = [_safe_container(item, dropped) for item in theirs]
        if theirs:
            out[field] = [*own, *theirs]
    return out


def _safe_container(container: Mapping[str, Any], dropped_volumes: set[str]) -> Manifest:
    """Another's container without privilege, privilege escalation, added capabilities or mounts of removed
    hostPath volumes."""
    out = dict(container)
    context = container.get("securityContext")
    if isinstance(context, Mapping):
        context = {k: v for k, v in context.items() if k != "privileged" or v is not True}
        if context.get("allowPrivilegeEscalation") is True:
            context["allowPrivilegeEscalation"] = False
        capabilities = context.get("capabilities")
        if isinstance(capabilities, Mapping) and capabilities.get("add"):
            context["capabilities"] = {k: v for k, v in capabilities.items() if k != "add"}
        out["securityContext"] = context
    mounts = container.get("volumeMounts")
    if isinstance(mounts, list):
        out["volumeMounts"] = [m for m in mounts if not (isinstance(m, Mapping) and m.get("name") in dropped_volumes)]
    return out


def _in_resource_list(keys: tuple[str, ...]) -> bool:
    """True for ``...resources.limits.<name>`` and ``...resources.requests.<name>``: the value is a quantity."""
    return len(keys) >= 3 and keys[-3] == "resources" and keys[-2] in _RESOURCE_LISTS


# --- helpers --------------------------------------------------------------------------------------


def _generation(body: Mapping[str, Any]) -> int | None:
    metadata = body.get("metadata")
    value = metadata.get("generation") if isinstance(metadata, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def kept_shape(previous: StatusModel, generation: int | None) -> PoolShape | None:
    """The shape a running pool keeps under ``spec.shape: Auto``: its last plan's, while the spec it was planned
    for is the current one (the same generation). A plan from before shapes existed was P/D. ``None``: decide
    afresh (a new pool, an edited spec). So an operator upgrade never changes a pool's shape by itself.

    Who calls it: ``reconcile``; the autoscaler follows the shape in status (``coserve.operator.autoscaler``)."""
    if previous.plan is None or generation is None or previous.observed_generation != generation:
        return None
    return previous.plan.shapes.shape if previous.plan.shapes is not None else PoolShape.DISAGGREGATED


def _previous_status(raw: object) -> StatusModel:
    """The status the operator wrote last time; anything unreadable (or kopf's own keys) is dropped."""
    if not isinstance(raw, Mapping):
        return StatusModel()
    known = {k: v for k, v in raw.items() if k in _STATUS_KEYS}
    try:
        return StatusModel.model_validate_json(json.dumps(known))
    except (ValidationError, TypeError, ValueError):
        conditions = []
        for item in raw.get("conditions") or []:
            try:
                conditions.append(Condition.model_validate_json(json.dumps(item)))
            except (ValidationError, TypeError, ValueError):
                continue
        return StatusModel(conditions=conditions)


_STATUS_KEYS = {f.alias or name for name, f in StatusModel.model_fields.items()}


def _controlled_by(child: Mapping[str, Any], uid: str) -> bool:
    references = (child.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == uid and ref.get("controller") for ref in references)


def _without_replaced_alternatives(child: Manifest, current: Mapping[str, Any]) -> Manifest:
    """``child`` with ``None`` for a field the object holds whose alternative ``child`` now sets (``_ONE_OF``).

    A merge patch leaves fields it does not name, and the API server refuses a PodDisruptionBudget with both
    ``minAvailable`` and ``maxUnavailable``: the one no longer wanted is removed (``None``), which ``drift`` sees.
    """
    spec, have = child.get("spec"), current.get("spec")
    if not isinstance(spec, Mapping) or not isinstance(have, Mapping):
        return child
    removed = {
        field: None
        for pair in _ONE_OF.get(child["kind"], ())
        for field, other in (pair, pair[::-1])
        if spec.get(other) is not None and spec.get(field) is None and have.get(field) is not None
    }
    return {**child, "spec": {**spec, **removed}} if removed else child


def _claim_patch(child: Manifest, current: Mapping[str, Any]) -> tuple[ChildAction | None, str | None]:
    """A PersistentVolumeClaim's patch (metadata, a larger storage request) and what cannot be changed, if any.

    The API server refuses any other change to a claim's spec, so the rest of the drift is reported, not patched.
    """
    kind, name = child["kind"], child["metadata"]["name"]
    changed = [path for path in drift(child, current) if path not in _TYPE_KEYS]
    patch: dict[str, Any] = {}
    applied, kept = [], []
    for path in changed:
        if path == "metadata" or path.startswith("metadata."):
            patch["metadata"] = child["metadata"]
            applied.append(path)
        elif path == _CLAIM_STORAGE and _grows(child, current):
            patch["spec"] = {"resources": {"requests": {"storage": _claim_storage(child)}}}
            applied.append(path)
        elif path == _CLAIM_STORAGE:
            kept.append(f"{path} (cannot shrink from {_claim_storage(current)} to {_claim_storage(child)})")
        else:
            kept.append(path)
    action = ChildAction("patch", kind, name, patch, "drifted: " + ", ".join(applied[:5])) if applied else None
    problem = (
        f"{kind} {name} keeps {', '.join(kept)}: a claim's spec cannot change once created, except for a larger "
        "storage request"
    ) if kept else None  # fmt: skip
    return action, problem


def _claim_storage(claim: Mapping[str, Any]) -> object:
    return (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")


def _grows(child: Manifest, current: Mapping[str, Any]) -> bool:
    want, have = stored_quantity(_claim_storage(child)), stored_quantity(_claim_storage(current))
    return want is not None and have is not None and want > have


def _deletions(
    pool_name: str,
    desired: Sequence[Manifest],
    observed: Mapping[ChildKey, Mapping[str, Any] | None],
    uid: str | None,
) -> list[ChildAction]:
    """Children the pool no longer renders and that go when it stops asking for them (``DELETED_WHEN_NOT_RENDERED``).

    Only what this pool controls, and not already being deleted.
    """
    rendered = {(child["kind"], child["metadata"]["name"]) for child in desired}
    deletable = {(kind, child_name(pool_name, component)) for kind, component in DELETED_WHEN_NOT_RENDERED}
    out = []
    for (kind, name), current in observed.items():
        if current is None or (kind, name) not in deletable or (kind, name) in rendered or uid is None:
            continue
        metadata = current.get("metadata") or {}
        if not _controlled_by(current, uid) or metadata.get("deletionTimestamp"):
            continue
        body = {"metadata": {"name": name, "uid": metadata.get("uid")}}
        out.append(ChildAction("delete", kind, name, body, "the pool's spec no longer asks for it"))
    return out


def _keep_autoscaled_replicas(child: Manifest, current: Mapping[str, Any]) -> Manifest:
    if child["kind"] != "Deployment" or child["metadata"]["labels"].get("coserve.dev/role") == "router":
        return child
    replicas = (current.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int):
        return child
    return {**child, "spec": {**child["spec"], "replicas": replicas}}


def _ready(observed: Mapping[ChildKey, Mapping[str, Any] | None], name: str) -> int:
    deployment = observed.get(("Deployment", name)) or {}
    value = (deployment.get("status") or {}).get("readyReplicas", 0)
    return value if isinstance(value, int) else 0


def _desired_replicas(desired_count: int, observed: Mapping[ChildKey, Mapping[str, Any] | None], name: str) -> int:
    deployment = observed.get(("Deployment", name))
    value = ((deployment or {}).get("spec") or {}).get("replicas")
    return value if isinstance(value, int) and deployment is not None else desired_count


def _failing(observed: Mapping[ChildKey, Mapping[str, Any] | None], names: Sequence[str]) -> list[str]:
    """Deployments the controller gave up on (progress deadline exceeded, or pods failing to be created)."""
    out = []
    for name in names:
        deployment = observed.get(("Deployment", name)) or {}
        for condition in (deployment.get("status") or {}).get("conditions") or []:
            kind, state, reason = condition.get("type"), condition.get("status"), condition.get("reason")
            if (kind == "Progressing" and state == "False") or (kind == "ReplicaFailure" and state == "True"):
                out.append(f"Deployment {name}: {reason or kind}: {condition.get('message', '')}".rstrip(": "))
    return out


def _status(
    pool: CoServePool,
    plan: Plan,
    previous: StatusModel,
    generation: int | None,
    observed: Mapping[ChildKey, Mapping[str, Any] | None],
    actions: Sequence[ChildAction],
    conflicts: Sequence[str],
    immutable: Sequence[str],
    now: datetime,
    unserved: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    name = pool.metadata.name
    wanted = {"prefillers": plan.prefillers, "decoders": plan.decoders, "routers": pool.spec.router.replicas}
    autoscaled = pool.spec.autoscaling.enabled
    replicas = {}
    for role, component in _ROLE_DEPLOYMENTS:
        deployment = child_name(name, component)
        desired = wanted[role]
        if autoscaled and role != "routers":
            desired = _desired_replicas(desired, observed, deployment)
        replicas[role] = RoleReplicas(desired=desired, ready=_ready(observed, deployment))
    lagging = [f"{role} {r.ready}/{r.desired} ready" for role, r in replicas.items() if r.ready < r.desired]
    failing = _failing(observed, [child_name(name, c) for _, c in _ROLE_DEPLOYMENTS])

    conditions = previous.conditions
    conditions = set_condition(
        conditions, ConditionType.PLAN_VALID, ConditionStatus.TRUE, "PlanComputed", _plan_message(plan), now, generation
    )
    if actions:
        progressing = (ConditionStatus.TRUE, "Reconciling", "; ".join(_action_message(a) for a in actions))
    elif lagging:
        progressing = (ConditionStatus.TRUE, "WaitingForReplicas", ", ".join(lagging))
    else:
        progressing = (ConditionStatus.FALSE, "Converged", "every child matches the plan")
    conditions = set_condition(conditions, ConditionType.PROGRESSING, *progressing, now, generation)
    if conflicts or immutable:
        reason = "ChildConflict" if conflicts else "ChildImmutable"
        degraded = (ConditionStatus.TRUE, reason, "; ".join([*conflicts, *immutable]))
    elif failing:
        degraded = (ConditionStatus.TRUE, "DeploymentFailing", "; ".join(failing))
    else:
        degraded = (ConditionStatus.FALSE, "AsExpected", "no child is failing")
    conditions = set_condition(conditions, ConditionType.DEGRADED, *degraded, now, generation)
    if not actions and not lagging and not conflicts:
        ready = (ConditionStatus.TRUE, "AllReplicasReady", "every role has its desired replicas ready")
    else:
        ready = (ConditionStatus.FALSE, "ReplicasNotReady", ", ".join(lagging) or "children are being reconciled")
    conditions = set_condition(conditions, ConditionType.READY, *ready, now, generation)
    gateway = _gateway_condition(pool, observed, unserved, conditions)
    if gateway is not None:
        conditions = set_condition(conditions, ConditionType.GATEWAY_READY, *gateway, now, generation)
    was_autoscaled = previous.autoscaling is not None or any(
        c.type == ConditionType.AUTOSCALING_ACTIVE and c.status == ConditionStatus.TRUE for c in conditions
    )
    if not autoscaled and was_autoscaled:
        message = "spec.autoscaling.enabled is false: replicas follow the plan"
        conditions = set_condition(
            conditions, ConditionType.AUTOSCALING_ACTIVE, ConditionStatus.FALSE, "Disabled", message, now, generation
        )

    status = StatusModel(
        observed_generation=generation,
        conditions=conditions,
        plan=plan,
        replicas=ReplicaStatus(**replicas),
        # ready/desired, as kubectl prints a Deployment's READY; no column for a role the shape does not have
        prefillers=None if plan.aggregated else f"{replicas['prefillers'].ready}/{replicas['prefillers'].desired}",
        decoders=f"{replicas['decoders'].ready}/{replicas['decoders'].desired}",
        autoscaling=previous.autoscaling if autoscaled else None,
    )
    wire = status.to_wire()
    if plan.aggregated and previous.prefillers is not None:
        wire["prefillers"] = None  # a merge patch removes a key only when told to
    if not autoscaled and previous.autoscaling is not None:
        wire["autoscaling"] = None  # a merge patch removes a key only when told to
    return wire


def _gateway_condition(
    pool: CoServePool,
    observed: Mapping[ChildKey, Mapping[str, Any] | None],
    unserved: frozenset[str],
    conditions: Sequence[Condition],
) -> tuple[ConditionStatus, str, str] | None:
    """GatewayReady: whether a gateway can send the pool requests through its InferencePool; ``None``: leave it
    out (gateway mode was never on). In order: the API kinds missing, the picker's replicas, the gateways'
    verdict on the InferencePool (its ``status.parents``)."""
    gateway = pool.spec.gateway
    if not gateway.enabled:
        if find_condition(conditions, ConditionType.GATEWAY_READY) is None:
            return None
        return ConditionStatus.FALSE, "Disabled", "spec.gateway.enabled is false: clients reach the pool's router"
    missing = [kind for kind in GATEWAY_API_KINDS if kind in unserved and (kind != "HTTPRoute" or gateway.http_route)]
    if missing:
        installs = {
            "InferencePool": "the Gateway API Inference Extension's CRDs",
            "HTTPRoute": "the Gateway API's CRDs (or set spec.gateway.httpRoute false)",
        }
        message = "; ".join(
            f"the API server serves no {kind} ({GATEWAY_API_KINDS[kind][0]}): install {installs[kind]}"
            for kind in missing
        )
        return ConditionStatus.FALSE, "GatewayAPIMissing", message
    picker = child_name(pool.metadata.name, "picker")
    ready = _ready(observed, picker)
    if ready < 1:
        message = f"endpoint picker {picker}: {ready}/{gateway.picker_replicas} ready"
        return ConditionStatus.FALSE, "PickerNotReady", message
    inference_pool = child_name(pool.metadata.name, "inference-pool")
    accepted = _accepting_parents(observed.get(("InferencePool", inference_pool)))
    if not accepted:
        return ConditionStatus.FALSE, "NotAccepted", (
            f"no gateway has accepted InferencePool {inference_pool} yet: a Gateway of a class that supports the "
            "Inference Extension must route to it (an HTTPRoute backendRef)")  # fmt: skip
    return ConditionStatus.TRUE, "Accepted", (
        f"InferencePool {inference_pool} accepted by {', '.join(accepted)}; endpoint picker {picker}: "
        f"{ready}/{gateway.picker_replicas} ready")  # fmt: skip


def _accepting_parents(inference_pool: Mapping[str, Any] | None) -> list[str]:
    """The parents (gateways) whose status on the InferencePool says Accepted=True, as ``Kind namespace/name``."""
    out = []
    for parent in ((inference_pool or {}).get("status") or {}).get("parents") or []:
        conditions = parent.get("conditions") or []
        if any(c.get("type") == "Accepted" and c.get("status") == "True" for c in conditions):
            ref = parent.get("parentRef") or {}
            where = f"{ref['namespace']}/" if ref.get("namespace") else ""
            out.append(f"{ref.get('kind', 'Gateway')} {where}{ref.get('name', '')}")
    return out


def _invalid(
    previous: StatusModel, generation: int | None, problems: Sequence[Problem], now: datetime
) -> Reconciliation:
    message = "; ".join(str(p) for p in problems)
    conditions = set_condition(
        previous.conditions, ConditionType.PLAN_VALID, ConditionStatus.FALSE, "InvalidSpec", message, now, generation
    )
    conditions = set_condition(
        conditions,
        ConditionType.READY,
        ConditionStatus.FALSE,
        "InvalidSpec",
        "no child is created or changed until the spec is fixed",
        now,
        generation,
    )
    status = previous.model_copy(update={"observed_generation": generation, "conditions": conditions})
    # A new Warning only when the problem is new: the condition already says it to every resync.
    events = () if _reported(previous, ConditionType.PLAN_VALID, "InvalidSpec", message) else (
        PoolEvent("Warning", "InvalidSpec", message),)  # fmt: skip
    return Reconciliation((), status.to_wire(), events, False)


def _reported(previous: StatusModel, kind: ConditionType, reason: str, message: str) -> bool:
    """The last status already carried this problem (same condition reason and message)."""
    condition = find_condition(previous.conditions, kind)
    return condition is not None and condition.reason == reason and condition.message == message


def _said(previous: StatusModel, kind: ConditionType, message: str) -> bool:
    """The last status already reported this problem: the condition is True and its message says it."""
    condition = find_condition(previous.conditions, kind)
    return condition is not None and condition.status == ConditionStatus.TRUE and message in condition.message


def _plan_message(plan: Plan) -> str:
    return (
        f"{plan.prefillers} prefillers, {plan.decoders} decoders; binding constraint "
        f"{plan.binding_constraint.value}, first bottleneck {plan.bottleneck.value}"
    )


_PAST = {"create": "created", "patch": "patched", "delete": "deleted"}


def _verb_reason(action: ChildAction) -> str:
    return {"create": "Created", "patch": "Patched", "delete": "Deleted"}[action.verb]


def _action_message(action: ChildAction) -> str:
    verb = "created" if action.verb == "create" else f"{_PAST[action.verb]} ({action.reason})"
    return f"{action.kind} {action.name} {verb}"
