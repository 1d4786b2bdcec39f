"""A local prefiller/decoder pool of coserve engines and the coserve router in front of it.

Who calls what: ``ttfet.py``, ``harvest_pool.py`` and ``simulator_fidelity.py``'s pool rung start the
pool with ``pd_pool`` (engines wired by a /dev/shm KV handoff, as ``coserve up`` runs them), empty it
between arms with ``PDPool.clear`` and front it with the coserve router, in this process
(``router_in_thread``) or in its own (``router_process``), configured by ``PDPool.router_config``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coserve.engine.launch import EngineServer, shared_machine_threads
from coserve.kv.handoff import Handoff, router_sends_transfer_params
from coserve.router.app import build_app
from coserve.router.config import parse_router_config

from .client import reset_prefix_caches
from .engines import coserve_settings
from .peers import free_port, launched, wait_ready
from .stats import say

# The router served on a real port in a thread: the tests' helper, one copy for both.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from router_served import Served


@dataclass
class PDPool:
    """A local prefiller/decoder pool's engines (their URLs) and the /dev/shm handoff between them."""

    prefillers: list[str]
    decoders: list[str]
    handoff: Path

    @property
    def engines(self) -> list[str]:
        return [*self.prefillers, *self.decoders]

    def clear(self) -> None:
        """Between arms: every engine's prefix cache emptied and no KV left in the handoff."""
        reset_prefix_caches(self.engines)
        for child in self.handoff.iterdir():
            child.unlink()

    def router_config(self, classes: Sequence[Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
        """The coserve router's configuration over this pool: turn 1 prefilled and handed over by /dev/shm."""
        return {
            "model": "tiny",
            "prefillers": self.prefillers,
            "decoders": self.decoders,
            "priorityClasses": list(classes),
            "pollS": 0.5,
            "kvTransferParams": router_sends_transfer_params(Handoff.SHM),
            **extra,
        }


@dataclass
class PoolShape:
    """How ``pd_pool`` starts each engine: counts, the decoders' host KV pool, and any other settings."""

    prefillers: int = 1
    decoders: int = 1
    decoder_host_pool_bytes: int = 1 << 30
    options: dict[str, Any] = field(default_factory=lambda: {"max_model_len": 8192, "dev_mode": True})
    # called with (role, index) before each engine starts: per-engine environment, core affinity
    before_start: Callable[[str, int], None] | None = None
    # each engine gets its share of this machine's cores, as ``coserve up`` gives them (``shared_machine_threads``);
    # off: every engine binds its threads to every core, as vLLM does by default
    share_cores: bool = False


@contextmanager
def pd_pool(model: Path, workdir: Path, config: Mapping[str, Any], shape: PoolShape | None = None) -> Iterator[PDPool]:
    """Start a local P/D pool of coserve engines wired by a /dev/shm handoff; stop it when the block ends."""
    shape = shape or PoolShape()
    handoff = Path("/dev/shm") / f"coserve-bench-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff's directory
    handoff.mkdir()
    pool = PDPool([], [], handoff)
    with ExitStack() as stack:
        stack.callback(handoff.rmdir)
        stack.callback(lambda: [child.unlink() for child in handoff.iterdir()] and None)
        roles = [("prefiller", i) for i in range(shape.prefillers)] + [("decoder", i) for i in range(shape.decoders)]
        cores = list(os.sched_getaffinity(0))  # shared_machine_threads orders them
        for started, (role, index) in enumerate(roles):
            threads = shared_machine_threads(started, len(roles), cores) if shape.share_cores else {}
            kv: dict[str, Any] = {"handoff_backend": "shm", "handoff_path": str(handoff)}
            if role == "decoder" and shape.decoder_host_pool_bytes:
                kv["host_memory_bytes"] = shape.decoder_host_pool_bytes
            if shape.before_start is not None:
                shape.before_start(role, index)
            say(f"starting {role} {index}")
            settings = coserve_settings(
                model, workdir / f"{role}-{index}", config, kv=kv,
                kv_role="kv_producer" if role == "prefiller" else "kv_consumer", env=threads, **shape.options,
            )  # fmt: skip
            url = stack.enter_context(EngineServer(settings)).base
            (pool.prefillers if role == "prefiller" else pool.decoders).append(url)
        yield pool


@contextmanager
def router_in_thread(config: Mapping[str, Any]) -> Iterator[str]:
    """The coserve router app for ``config``, served on a real port in this process; its URL."""
    router = Served(build_app(parse_router_config(dict(config))))
    try:
        yield router.url
    finally:
        router.stop()


@contextmanager
def router_process(config: Mapping[str, Any], workdir: Path, startup_s: float = 60.0) -> Iterator[str]:
    """``coserve router`` for ``config`` in its own process (it inherits this process's cores); its URL once
    /health answers."""
    path = workdir / "router.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    port = free_port()
    command = [sys.executable, "-m", "coserve", "router", "--config", str(path),
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with launched(command) as router:
        wait_ready(router, f"{base}/health", startup_s, "the router")
        yield base
