"""A round-robin TCP front on loopback: the simplest balancer in front of router replicas (tests only).

Each new connection goes to the next backend in turn; a backend that refuses the connection is skipped (a
killed replica), as a Service's kube-proxy stops sending to a pod that is gone. ``backends`` may be replaced
while it runs (a replica restarted on another port).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from router_served import free_port


class RoundRobinFront:
    def __init__(self, backends: list[int]) -> None:
        self.backends = list(backends)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections: list[int] = []  # the backend port each accepted connection went to
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the front did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._started.set()
        with contextlib.suppress(RuntimeError):
            self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        for _ in range(len(self.backends)):
            port = self.backends[self._next % len(self.backends)]
            self._next += 1
            try:
                upstream = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue  # a dead replica: the next one
            self.connections.append(port)
            break
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        deadline = time.monotonic() + 5
        while self._loop.is_running() and time.monotonic() < deadline:
            time.sleep(0.01)
