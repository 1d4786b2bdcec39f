"""coserve's vLLM general plugin: makes ``"kv_connector": "CoServeConnector"`` resolvable by name.

vLLM calls ``register`` in every process it starts (API server, engine core,
workers) when the plugin is allowed (``VLLM_PLUGINS=coserve``, set in the
serving image; unset means every installed plugin). It is found through the
``vllm.general_plugins`` entry point in ``pyproject.toml``. The scheduler,
worker and middleware are named by their module paths on the command line and
need no registration.
"""

from __future__ import annotations

__all__ = ["register"]

CONNECTOR = "CoServeConnector"


def register() -> None:
    """Register the KV connector with vLLM's factory; safe to call more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:  # vLLM offers no public lookup
        KVConnectorFactory.register_connector(CONNECTOR, "coserve.engine.connector", CONNECTOR)
