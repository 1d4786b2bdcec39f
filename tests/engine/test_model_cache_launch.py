"""The model cache as a pod uses it: the rendered init container fills it, the rendered engine loads from it.

``coserve render examples/pool-production.yaml`` (its CPU variant) gives each engine pod a
``model-download`` init container on the cache claim (read-write) and a vLLM container that mounts
it read-only with ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` and asks for the model by its Hub id.
This test runs both commands as rendered, with these substitutions and no others:

- the model id (a gated Llama) → ``coserve-test/tiny``, also a Hub id, whose files are the tiny
  random-weight Llama;
- the Hub, which cannot be reached from these machines → the cache folder seeded with those files in
  the hub cache's own layout (``models--coserve-test--tiny/refs/main``, ``snapshots/<commit>/``), as
  ``snapshot_download`` leaves it; the init container's real ``snapshot_download`` then finds the Hub
  unreachable and the snapshot complete, as it does on a pod whose cache another pod filled;
- the claim mounted at ``/models`` → that folder. Tests run as root here, so a read-only mount cannot
  be imitated with file modes: the test checks instead that the engine wrote nothing into the cache;
- the engine's own substitutions, as in test_render_parity (port and host, CPU worker, the ConfigMap
  and token mounts as folders).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coserve.engine.tiny_model import build_tiny_model
from coserve.model_cache import marker_path
from engine.test_render_parity import ROOT, RenderedEngine, cpu_variant, render

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "pool-production.yaml"
MODEL_ID = "coserve-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def decoder_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-decoder")]
    return dict(deployment["spec"]["template"]["spec"])


def seed_hub_cache(hub: Path, model: Path) -> None:
    """``model``'s files where ``snapshot_download`` keeps ``MODEL_ID`` at ``COMMIT`` in the hub cache ``hub``."""
    repo = hub / f"models--{MODEL_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model, repo / "snapshots" / COMMIT)


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time: what a write would change."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


class CachedEngine(RenderedEngine):
    """The rendered decoder, its model cache mount standing for the claim."""

    def __init__(self, objects: list[dict[str, Any]], cache: Path, workdir: Path) -> None:
        super().__init__(objects, Path(MODEL_ID), workdir, mounts={"model-cache": cache})
        (mount,) = [m for m in self.container["volumeMounts"] if m["name"] == "model-cache"]
        assert mount.get("readOnly") is True  # every engine mounts the shared cache read-only


def test_the_rendered_init_container_fills_the_cache_and_the_rendered_engine_loads_from_it(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    document = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    document["spec"]["model"]["name"] = MODEL_ID
    objects = render(cpu_variant(document))
    pod = decoder_pod(objects)
    (init,) = pod["initContainers"]
    (engine,) = pod["containers"]
    (cache_mount,) = [m for m in init["volumeMounts"] if m["name"] == "model-cache"]
    assert not cache_mount.get("readOnly")  # the one writer

    cache = tmp_path / "claim"
    models = Path(os.environ.get("COSERVE_TEST_MODELS", tmp_path_factory.mktemp("models")))
    seed_hub_cache(cache / "hub", build_tiny_model(models))

    # the init container, as rendered: python3 -m coserve.model_cache --model ... --cache-dir /models/hub
    command = [sys.executable if part == "python3" else part for part in init["command"]]
    command = [part.replace(cache_mount["mountPath"], str(cache), 1) if part.startswith("/") else part
               for part in command]  # fmt: skip
    env = {**os.environ, **{e["name"]: e["value"] for e in init.get("env", []) if "value" in e}}
    env.pop("HF_HUB_OFFLINE", None)  # the init container downloads: it is not rendered offline
    filled = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert filled.returncode == 0, filled.stderr
    assert marker_path(cache / "hub", MODEL_ID).exists()
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and "already" in again.stderr.lower(), again.stderr  # a later pod: at once

    before = listing(cache)
    with CachedEngine(objects, cache, tmp_path / "engine") as served:
        assert served.env["HF_HUB_CACHE"] == str(cache / "hub") and served.env["HF_HUB_OFFLINE"] == "1"
        assert served.argv[served.argv.index("--model") + 1] == MODEL_ID  # by its Hub id, from the cache
        answer = served.complete([1, 2, 3, 4, 5], "interactive", max_tokens=4)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    assert listing(cache) == before  # the engine wrote nothing: a read-only mount would not have let it
    assert engine["name"] == "vllm"
