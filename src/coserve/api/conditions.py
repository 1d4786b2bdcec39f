"""Status conditions that follow the Kubernetes API conventions.

One entry per ``type``; ``lastTransitionTime`` changes only when ``status``
changes, so a reconcile that re-asserts the same state does not make the
condition look new. Who calls it: the operator, whenever it writes status.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from coserve.api.status import Condition, ConditionStatus, ConditionType

__all__ = ["find_condition", "rfc3339", "set_condition"]


def rfc3339(moment: datetime) -> str:
    """``2026-12-02T17:00:00Z``: the form metav1.Time serialises to (second precision, UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: Sequence[Condition], kind: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type is kind), None)


def set_condition(
    conditions: Sequence[Condition],
    kind: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
    observed_generation: int | None = None,
) -> list[Condition]:
    """A new list with ``kind`` set; the others are kept in their order, ``kind`` replaces its old entry."""
    previous = find_condition(conditions, kind)
    moved = previous is None or previous.status is not status
    updated = Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=rfc3339(now) if moved or previous is None else previous.last_transition_time,
        observed_generation=observed_generation,
    )
    out = [updated if c.type is kind else c for c in conditions]
    if previous is None:
        out.append(updated)
    return out
