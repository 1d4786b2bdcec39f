"""Entry point for ``kopf run operator/main.py``: coserve's handlers in kopf's default registry.

The control-plane image runs ``coserve operator`` instead (the same handlers, with
peering and namespaces from its flags); this file is for developing against a
cluster with kopf's own command line, e.g.::

    kopf run --standalone --all-namespaces operator/main.py
"""

from __future__ import annotations

import kopf

from coserve.operator.handlers import build_registry

build_registry(registry=kopf.get_default_registry())
