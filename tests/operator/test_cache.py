"""The operator's watch-fed object cache (coserve.operator.cache), table-driven where it decides."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.operator.cache import ObjectCache


def obj(name: str, rv: str | None = None, namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if rv is not None:
        metadata["resourceVersion"] = rv
    return {"metadata": metadata, "spec": spec}


def test_put_reports_news_and_ignores_echoes() -> None:
    cache = ObjectCache()
    assert cache.put("Service", obj("a", "5", port=80)) is True
    assert cache.put("Service", obj("a", "5", port=80)) is False  # the watch echo of our own write
    assert cache.put("Service", obj("a", "6", port=81)) is True
    assert cache.get("Service", "ns", "a") == obj("a", "6", port=81)
    assert cache.get("Deployment", "ns", "a") is None  # kinds do not mix


@pytest.mark.parametrize(
    ("cached_rv", "event_rv", "kept"),
    [
        ("10", "9", "10"),  # an event older than our own write arrives late: ignored
        ("10", "11", "11"),
        (None, "3", "3"),  # no resourceVersion (kmock): the newest arrival wins
        ("10", None, None),
        ("abc", "9", "9"),  # an opaque resourceVersion is never compared
    ],
)
def test_an_older_resource_version_never_replaces_a_newer_one(
    cached_rv: str | None, event_rv: str | None, kept: str | None
) -> None:
    cache = ObjectCache()
    cache.put("Deployment", obj("d", cached_rv, replicas=1))
    cache.observe("Deployment", "MODIFIED", obj("d", event_rv, replicas=2))
    assert (cache.get("Deployment", "ns", "d") or {})["metadata"].get("resourceVersion") == kept


def test_a_deletion_event_forgets_and_says_whether_it_was_news() -> None:
    cache = ObjectCache()
    cache.put("ConfigMap", obj("c"))
    assert cache.observe("ConfigMap", "DELETED", obj("c")) is True
    assert cache.get("ConfigMap", "ns", "c") is None
    assert cache.observe("ConfigMap", "DELETED", obj("c")) is False


def test_replace_drops_ghosts_but_not_what_arrived_after_the_list() -> None:
    cache = ObjectCache()
    cache.put("Service", obj("kept"))
    cache.put("Service", obj("ghost"))  # deleted while the watch was down: no DELETED event came
    cache.put("Service", obj("elsewhere", namespace="other"))
    since = cache.mark()
    cache.put("Service", obj("new"))  # created after the list was sent: not in it, but real
    dropped = cache.replace("Service", [obj("kept"), obj("listed-only")], since, namespaces={"ns"})
    assert dropped == 1
    assert cache.names("Service") == [("ns", "kept"), ("ns", "listed-only"), ("ns", "new"), ("other", "elsewhere")]


def test_replace_across_all_namespaces() -> None:
    cache = ObjectCache()
    cache.put("Service", obj("a", namespace="x"))
    cache.put("Service", obj("b", namespace="y"))
    assert cache.replace("Service", [obj("a", namespace="x")], cache.mark(), namespaces=None) == 1
    assert cache.names("Service") == [("x", "a")]
