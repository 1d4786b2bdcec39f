"""Entry point for ``kopf run operator/main.py``: coserve's handlers in kopf's default registry.

The control-plane image runs ``coserve operator`` instead (the same handlers, with
leader election and namespaces from its flags); this file is for developing against a
cluster with kopf's own command line, e.g.::

    kopf run --standalone --all-namespaces operator/main.py
"""

from __future__ import annotations

import kopf

from coserve.operator.handlers import build_registry
from coserve.operator.kube import load_cluster

# A single replica: kopf's command line has no flag for the Lease (`coserve operator` does).
build_registry(load_cluster, registry=kopf.get_default_registry())
