"""What the operator last saw of each pool and child, so a reconcile reads memory instead of the API server.

Who calls it: ``coserve.operator.handlers`` and ``coserve.operator.reconciler``.
kopf's watch events put every pool and every managed child
(``app.kubernetes.io/managed-by: coserve-operator``) here; the reconciler puts
the API server's answer to each of its own creates and patches here too
(write-through), and reads the pool and its children from here.
Every ``resync_s`` the handlers list all pools and managed children and call
``replace`` so an event lost across a watch reconnect (a deletion above all)
cannot leave a ghost behind for longer than one resync.

Why: a reconcile that reads from the API server costs eight GETs, and every
child it creates comes back as a watch event that triggers another reconcile.
With the cache a reconcile of a pool in its desired state costs no request, and
a watch event that only echoes the operator's own write (``observe`` returns
``False``) triggers nothing. A stale entry costs at most one wasted request: a
create answered 409 (the reconciler then reads the object and decides again) or
a patch that changes nothing.

Pure Python (no kopf, no HTTP): tested on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ObjectCache", "ObjectKey"]

ObjectKey = tuple[str, str, str]  # (kind, namespace, name)


@dataclass
class _Entry:
    body: Mapping[str, Any]
    stamp: int  # when it was last put (a counter, not a clock)


def _resource_version(body: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number when it is one (etcd's are); ``None`` when absent or opaque."""
    value = (body.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


def key_of(kind: str, body: Mapping[str, Any]) -> ObjectKey:
    metadata = body.get("metadata") or {}
    return kind, str(metadata.get("namespace") or ""), str(metadata.get("name") or "")


class ObjectCache:
    """The latest body of each object by (kind, namespace, name); one per operator, one event loop."""

    def __init__(self) -> None:
        self._entries: dict[ObjectKey, _Entry] = {}
        self._stamps = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        entry = self._entries.get((kind, namespace, name))
        return None if entry is None else entry.body

    def names(self, kind: str) -> list[tuple[str, str]]:
        """(namespace, name) of every cached object of ``kind``, sorted."""
        return sorted((namespace, name) for k, namespace, name in self._entries if k == kind)

    def put(self, kind: str, body: Mapping[str, Any]) -> bool:
        """Remember ``body``; ``False`` when it changes nothing (the same body, or an older resourceVersion).

        An older numeric resourceVersion than the cached one is a watch event that
        arrived after the operator's own, later write: it is ignored.
        """
        key = key_of(kind, body)
        entry = self._entries.get(key)
        if entry is not None:
            old, new = _resource_version(entry.body), _resource_version(body)
            if old is not None and new is not None and new < old:
                return False
            if entry.body == body:
                entry.stamp = next(self._stamps)
                return False
        self._entries[key] = _Entry(body, next(self._stamps))
        return True

    def forget(self, kind: str, namespace: str, name: str) -> bool:
        """Drop an object (it was deleted); ``False`` when it was not cached."""
        return self._entries.pop((kind, namespace, name), None) is not None

    def observe(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Apply one watch event; ``True`` when the cache changed, i.e. the event is news to the operator."""
        if event_type == "DELETED":
            _, namespace, name = key_of(kind, body)
            return self.forget(kind, namespace, name)
        return self.put(kind, body)

    def mark(self) -> int:
        """A point in time for ``replace``: take it just before sending the list request."""
        return next(self._stamps)

    def replace(
        self, kind: str, listed: Iterable[Mapping[str, Any]], since: int, namespaces: Collection[str] | None
    ) -> int:
        """Make ``kind`` match a fresh list; returns how many ghosts were dropped.

        ``listed`` is every object of ``kind`` in ``namespaces`` (``None``: all)
        the API server returned for a list sent after ``mark()`` gave ``since``.
        Cached objects missing from it are dropped unless a watch event or a
        write put them after ``since`` (they are newer than the list).
        """
        seen = set()
        for body in listed:
            self.put(kind, body)
            seen.add(key_of(kind, body))
        ghosts = [
            key
            for key, entry in self._entries.items()
            if key[0] == kind
            and (namespaces is None or key[1] in namespaces)
            and key not in seen
            and entry.stamp < since
        ]
        for key in ghosts:
            del self._entries[key]
        return len(ghosts)
