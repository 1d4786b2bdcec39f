"""``coserve up``: a CoServePool on this machine, without Kubernetes (engines and router as local processes).

Who calls it: the ``coserve up`` command, and the README's main job. It reads a
CoServePool manifest, prints the plan, then starts what the operator would run
in a cluster, scaled to one machine: ``--prefillers`` (default 1) prefiller and
``--decoders`` (default 1) decoder vLLM engines with coserve's plugin, and the
router in front of them. Each engine runs the command line, environment and
ConfigMap files the operator renders for its role on nodes without GPUs (one
function, ``coserve.operator.resources.build_children``, so a local pool and a
cluster pool cannot drift), through ``coserve.engine.rendered.local_launch``
with only what one machine needs changed: the model, the port, the ConfigMap
folder, no router token, and the KV moves below. Engines run the manifest's
model when it is a local folder (or ``--model PATH``); otherwise a tiny
random-weight model, so the pool runs on CPUs with no download. The prefillers
hand turn 1's KV to the decoders through a ``/dev/shm`` directory of the pool's
own (``handoff_backend: shm``); decoders keep a host KV pool
(``spec.kvOffload.hostMemoryBytes`` when enabled, else 512 MiB).

It shows progress while the engines start, prints the OpenAI base URL, and
stops every process on Ctrl-C or SIGTERM. ``--once`` instead sends one
two-turn conversation through the router, prints where each turn ran and what
the decoder reused, and stops (a smoke test of the whole data path).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from coserve.api import parse_pool
from coserve.api.resource import CoServePool
from coserve.api.status import Plan
from coserve.engine.launch import EngineServer, EngineSettings, shared_machine_threads
from coserve.engine.rendered import Substitutions, config_files, engine_container, local_launch, without_gpus
from coserve.kv.handoff import Handoff, router_sends_transfer_params
from coserve.operator.resources import CONFIG_VOLUME, build_children, engine_config

__all__ = ["prefix_hits", "run_local_pool"]

DEFAULT_HOST_POOL_BYTES = 512 << 20


def _say(message: str) -> None:
    print(f"[coserve up {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the pool like Ctrl-C does: every process is shut down, none is left behind."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_local_pool(
    pool: CoServePool,
    plan: Plan,
    *,
    model: Path | None,
    prefillers: int,
    decoders: int,
    port: int,
    once: bool,
    workdir: Path | None = None,
) -> int:
    spec = pool.spec
    name = pool.metadata.name
    shape = "aggregated engines" if plan.aggregated else "P/D"
    engines = (f"{decoders} engine(s) that prefill their own turns" if prefillers == 0
               else f"{prefillers} prefiller(s) and {decoders} decoder(s)")  # fmt: skip
    print(f"\non this machine ({shape}, as planned, scaled to it): {engines}, and the router", flush=True)
    model_path = model or _local_model(spec.model.name)
    served = spec.model.served_model_name or spec.model.name
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"coserve-up-{name}-"))
    handoff = Path("/dev/shm") / f"coserve-{name}-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff's own directory
    handoff.mkdir(parents=True)
    objects = _cpu_rendering(pool, plan)
    config_dir = workdir / "etc-coserve"  # the ConfigMap's files, where the engines' config volume is mounted
    config_dir.mkdir(parents=True, exist_ok=True)
    for file_name, text in config_files(objects).items():
        (config_dir / file_name).write_text(text)
    config = engine_config(spec)
    host_bytes = spec.kv_offload.host_memory_bytes if spec.kv_offload.enabled else DEFAULT_HOST_POOL_BYTES
    host_bytes = _host_pool_here(host_bytes, decoders)
    common: dict[str, Any] = {"handoff_backend": Handoff.SHM.value, "handoff_path": str(handoff)}
    roles = [("prefiller", i, {**common}) for i in range(prefillers)]
    roles += [("decoder", i, {**common, "host_memory_bytes": host_bytes}) for i in range(decoders)]
    urls: dict[str, list[str]] = {"prefiller": [], "decoder": []}
    with _terminate_as_interrupt(), ExitStack() as stack:
        try:
            cores = list(os.sched_getaffinity(0))  # shared_machine_threads orders them
            for started_before, (role, index, kv) in enumerate(roles):
                started = time.monotonic()
                _say(f"starting {role} {index + 1} ({model_path.name}); this takes about 30-60 s on CPUs")
                settings = EngineSettings(
                    model=model_path, workdir=workdir / f"{role}-{index}",
                    env=shared_machine_threads(started_before, len(roles), cores),
                )  # fmt: skip
                server = RenderedServer(settings, engine_container(objects, role), config_dir, kv)
                stack.enter_context(server)
                urls[role].append(server.base)
                _say(f"{role} {index + 1} ready at {server.base} in {time.monotonic() - started:.0f} s")
            router_config = {
                "model": served,
                "prefillers": urls["prefiller"],
                "decoders": urls["decoder"],
                "priorityClasses": config["priorityClasses"],
                "batchDir": str(workdir / "batches"),
                # the engines above hand KV over through shared memory, by vLLM's P/D protocol
                "kvTransferParams": router_sends_transfer_params(Handoff.SHM),
            }
            (workdir / "router.json").write_text(json.dumps(router_config, indent=2))
            return _serve_router(router_config, port, once, served, urls["decoder"])
        except KeyboardInterrupt:
            _say("stopping")
            return 130
        finally:
            _say("shutting the engines down")
            stack.close()
            shutil.rmtree(handoff, ignore_errors=True)


def _host_pool_here(wanted: int, decoders: int) -> int:
    """Each local decoder's host KV pool: the manifest's, but at most a quarter of this machine's free memory shared
    among the decoders (a pool sized for a GPU node's host would not start here), said when it is cut."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not Linux: keep the manifest's
        return wanted
    budget = free // (4 * max(decoders, 1))
    if wanted <= budget:
        return wanted
    _say(f"the manifest's host KV pool is {wanted / 2**30:.3g} GiB per decoder; on this machine each gets "
         f"{budget / 2**30:.3g} GiB (a quarter of the free memory, shared)")  # fmt: skip
    return int(budget)


def _cpu_rendering(pool: CoServePool, plan: Plan) -> list[dict[str, Any]]:
    """What the operator renders for ``pool`` on nodes without GPUs (this machine's platform), sized by ``plan``."""
    document = pool.model_dump(by_alias=True, exclude_none=True, mode="json")
    return build_children(parse_pool(without_gpus(document)), plan)


class RenderedServer(EngineServer):
    """An engine started from its rendered container (``local_launch``), with coserve up's local settings.

    ``kv``: added to coserve's connector settings (the shm handoff, the host pool), since on CPU nodes the
    operator renders no KV transport between engines, and one machine has one.
    """

    def __init__(self, settings: EngineSettings, container: dict[str, Any], config_dir: Path, kv: dict[str, Any]):
        super().__init__(settings)
        substitutions = Substitutions(
            model=str(settings.model),
            port=self.port,
            mounts={CONFIG_VOLUME: config_dir},
            router_token=False,  # the local router sends none: each request's class is trusted, as it says
            coserve_settings=kv,
        )
        self.launch = local_launch(container, substitutions)

    def command(self) -> list[str]:
        return self.launch.argv

    def environment(self, config: Path) -> dict[str, str]:
        return {
            **os.environ,
            **self.launch.env,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_CI_ENV": "1",  # eager: an engine starts in 30-60 s instead of compiling for minutes
            **self.settings.env,  # its share of this machine's cores
        }


def _local_model(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from coserve.engine.tiny_model import build_tiny_model

    cache = Path(os.environ.get("COSERVE_MODELS", Path.home() / ".cache" / "coserve" / "models"))
    _say(f"{name} is not a local folder: serving a tiny random-weight model instead (no download)")
    return build_tiny_model(cache)


def _serve_router(router_config: dict[str, Any], port: int, once: bool, served: str, decoders: list[str]) -> int:
    import uvicorn

    from coserve.router.app import build_app
    from coserve.router.config import parse_router_config

    app = build_app(parse_router_config(router_config))
    port = port or _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    base = f"http://127.0.0.1:{port}/v1"
    if not once:
        print(f"OpenAI base URL: {base}   (model {served!r}; Ctrl-C stops the pool)", flush=True)
        server.run()
        return 0
    import threading

    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        return _one_conversation(base, served, decoders)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def prefix_hits(decoders: list[str]) -> tuple[float, float]:
    """(tokens loaded through the connector, tokens found in the engines' own prefix cache), summed over
    the engines' /metrics; ``coserve up --once`` and the router's real-engine test read it."""
    import httpx

    loaded = cached = 0.0
    for url in decoders:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:external_prefix_cache_hits_total"):
                loaded += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                cached += float(line.rsplit(" ", 1)[1])
    return loaded, cached


def _one_conversation(base: str, model: str, decoders: list[str]) -> int:
    """Two turns of one conversation through the router: the data path, end to end."""
    import httpx

    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent. " * 60},
        {"role": "user", "content": "List the files in the repository."},
    ]
    for turn in (1, 2):
        loaded, cached = prefix_hits(decoders)
        started = time.monotonic()
        response = httpx.post(
            f"{base}/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 16, "temperature": 0},
            timeout=300,
        )
        if response.status_code != 200:
            print(f"turn {turn}: HTTP {response.status_code}: {response.text[:300]}")
            return 1
        elapsed = time.monotonic() - started
        now_loaded, now_cached = prefix_hits(decoders)
        answer = response.json()
        usage = answer.get("usage") or {}
        print(
            f"turn {turn}: {usage.get('prompt_tokens')} prompt tokens, {usage.get('completion_tokens')} answered in "
            f"{elapsed:.2f} s; the decoder loaded {now_loaded - loaded:.0f} tokens of KV from the prefiller and "
            f"reused {now_cached - cached:.0f} from its own cache"
        )
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": "Now open the README."},
        ]
    return 0
