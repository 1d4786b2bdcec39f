"""Pods' own network namespaces on this machine: each pod gets its own ``localhost`` and an IP on a bridge.

In a cluster every pod has its own network namespace: ``localhost`` in the decoder's pod is the decoder,
not the prefiller, and peers reach each other only at their pod IPs. Engines started side by side on this
machine share one ``localhost``, so a rendering that leaves a service bound to ``localhost`` (NIXL's side
channel, by vLLM's default) would still work here and fail in every cluster. ``PodNetwork`` gives each
"pod" a Linux network namespace with a veth pair on a bridge, as a CNI plugin does:

- pod ``i`` has address ``10.213.<net>.<i + 2>``; the host side (this test process, the router) is ``.1``
  on the bridge and reaches every pod; pods reach each other over the bridge;
- ``wrap(i, argv)`` runs a command in pod ``i`` (``ip netns exec``); the mount namespace is left shared, so
  ``/dev/shm`` (the safepoint board) and the test's folders are the same files, as the tests expect.

It needs root (``CAP_NET_ADMIN``) and the ``ip`` tool; ``PodNetwork.unavailable()`` says why not where
they are missing, for the caller's skip. Used by tests/engine/test_topology_parity.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

__all__ = ["PodNetwork"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class PodNetwork:
    """``pods`` network namespaces on one bridge; a context manager that removes all it made."""

    def __init__(self, pods: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        net = int(self.tag[:2], 16) % 250 + 1
        self.bridge = f"csbr{self.tag}"
        self.gateway = f"10.213.{net}.1"
        self.names = [f"cs{self.tag}p{i}" for i in range(pods)]
        self.ips = [f"10.213.{net}.{i + 2}" for i in range(pods)]

    @staticmethod
    def unavailable() -> str | None:
        """Why pods cannot be made here, or None where they can."""
        if shutil.which("ip") is None:
            return "the ip tool (iproute2) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        return None

    def __enter__(self) -> PodNetwork:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, (name, address) in enumerate(zip(self.names, self.ips, strict=True)):
                host_end, pod_end = f"cs{self.tag}h{index}", f"cs{self.tag}c{index}"
                _ip("netns", "add", name)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
                _ip("link", "set", host_end, "master", self.bridge, "up")
                _ip("link", "set", pod_end, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", pod_end)
                _ip("-n", name, "link", "set", pod_end, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "route", "add", "default", "via", self.gateway)
        except subprocess.CalledProcessError as error:
            self.__exit__()
            raise RuntimeError(f"could not make the pods' network: {error.cmd}: {error.stderr}") from error
        return self

    def wrap(self, pod: int, argv: list[str]) -> list[str]:
        """``argv`` run inside pod ``pod``'s network namespace."""
        return ["ip", "netns", "exec", self.names[pod], *argv]

    def __exit__(self, *exc: object) -> None:
        for name in self.names:  # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
