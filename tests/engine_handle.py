"""The handle of the shared vLLM test server (tests/engine/conftest.py), importable by tests."""

from __future__ import annotations


class Engine:
    """What the tests need to know about the shared server."""

    def __init__(self, base: str, engine_id: str) -> None:
        self.base = base
        self.engine_id = engine_id
