"""The CoServePool operator: what it creates (``resources``, pure) and, later, the kopf handlers.

Kept import-free so that ``coserve render`` can use ``coserve.operator.resources``
without pulling in kopf or the Kubernetes client.
"""
