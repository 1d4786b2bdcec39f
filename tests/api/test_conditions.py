"""Conditions keep one entry per type and move lastTransitionTime only on a status change."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from coserve.api.conditions import find_condition, rfc3339, set_condition
from coserve.api.status import ConditionStatus, ConditionType

T0 = datetime(2026, 12, 2, 17, 0, 0, tzinfo=UTC)


def test_first_set_appends_with_the_time() -> None:
    conditions = set_condition([], ConditionType.PLAN_VALID, ConditionStatus.TRUE, "Planned", "ok", T0, 3)
    (condition,) = conditions
    assert (condition.type, condition.status, condition.reason) == (
        ConditionType.PLAN_VALID,
        ConditionStatus.TRUE,
        "Planned",
    )
    assert condition.last_transition_time == "2026-12-02T17:00:00Z"
    assert condition.observed_generation == 3


def test_same_status_keeps_transition_time_but_updates_reason_and_message() -> None:
    first = set_condition([], ConditionType.READY, ConditionStatus.FALSE, "Waiting", "0/3 ready", T0)
    second = set_condition(
        first, ConditionType.READY, ConditionStatus.FALSE, "Waiting", "2/3 ready", T0 + timedelta(minutes=1)
    )
    (condition,) = second
    assert condition.message == "2/3 ready"
    assert condition.last_transition_time == rfc3339(T0)


def test_status_change_moves_transition_time_and_keeps_order() -> None:
    conditions = set_condition([], ConditionType.READY, ConditionStatus.FALSE, "Waiting", "", T0)
    conditions = set_condition(conditions, ConditionType.PLAN_VALID, ConditionStatus.TRUE, "Planned", "", T0)
    later = T0 + timedelta(minutes=5)
    conditions = set_condition(conditions, ConditionType.READY, ConditionStatus.TRUE, "AllReady", "", later)
    assert [c.type for c in conditions] == [ConditionType.READY, ConditionType.PLAN_VALID]
    ready = find_condition(conditions, ConditionType.READY)
    assert ready is not None and ready.last_transition_time == rfc3339(later)
    assert find_condition(conditions, ConditionType.DEGRADED) is None
