"""coserve: co-serving LLM pools on Kubernetes (operator, router and vLLM plugin).

Layout (see README): ``api`` (CoServePool types), pure policy packages
(``provisioning`` and, later, ``scheduling``, ``routing``, ``autoscaling``,
``kv``), and adapters (``operator``, ``router``, ``engine``, ``cli``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("coserve")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
