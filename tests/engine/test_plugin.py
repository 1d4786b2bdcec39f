"""The vLLM general plugin registers coserve's KV connector by name, and is found by its entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from coserve.engine.connector import CoServeConnector
from coserve.engine.plugin import CONNECTOR, register


def test_the_entry_point_names_the_register_function() -> None:
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "coserve"]
    assert plugin.load() is register


def test_register_makes_the_connector_resolvable_by_name_and_is_idempotent() -> None:
    register()
    register()  # vLLM calls it in every process, sometimes twice in one
    assert KVConnectorFactory._registry[CONNECTOR]() is CoServeConnector
