"""The load a plan provisions a local pool's engines for, from the engines' own profile as they run here.

Who calls what: ``ttfet.py`` measures how much slower the pool's engines run when all of them work at once
than one alone (``colocation_slowdown``: on this machine they share its cores, which ``coserve profile``,
measuring one engine alone, does not see), scales the cached profile by it (``derated``), and asks the
provisioning model for the highest arrival rate at which it sizes the pool at no more than the engines there
are (``provisioned_rate``). The plan's shape at that rate (P/D or aggregated engines) is the shape
coserve's conversation placement runs in.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from coserve.api.profile import EngineProfile
from coserve.api.spec import PoolShape as ShapeName
from coserve.api.spec import PriorityClassSpec, SpecModel
from coserve.api.status import Plan
from coserve.cli.manifest import load_pool, load_profile, read_file
from coserve.provisioning import plan_for

from .stats import say

EXAMPLE_POOL = Path(__file__).resolve().parents[2] / "examples/pool.yaml"


def derated(profile: EngineProfile, slowdown: float) -> EngineProfile:
    """``profile`` with every time ``slowdown`` times longer: the prefill curve, the step cost model and the
    decode throughput (divided)."""
    curve = profile.prefill_latency
    update: dict[str, Any] = {}
    if curve is not None:
        update["prefill_latency"] = curve.model_copy(
            update={
                "constant_s": curve.constant_s * slowdown,
                "per_token_s": curve.per_token_s * slowdown,
                "per_token_squared_s": curve.per_token_squared_s * slowdown,
            }
        )
    if profile.decode_throughput_tokens_per_s is not None:
        update["decode_throughput_tokens_per_s"] = profile.decode_throughput_tokens_per_s / slowdown
    if profile.cost_model is not None:
        update["cost_model"] = {
            key: value * slowdown if key.startswith("k") else value for key, value in profile.cost_model.items()
        }
    return profile.model_copy(update=update)


def pool_spec(
    workload: Mapping[str, Any], rate: float, classes: Sequence[Mapping[str, Any]], shape: ShapeName = ShapeName.AUTO
) -> SpecModel:
    """The example pool's spec with ``workload`` (the API's snake_case names) at ``rate``, ``classes`` as its
    priority classes, its inline engine numbers removed (the measured profile stands in) and ``shape``."""
    spec = load_pool(read_file(str(EXAMPLE_POOL))).spec
    blank = spec.profile.model_copy(
        update={"prefill_latency": None, "decode_throughput_tokens_per_s": None, "kv_capacity_tokens": None,
                "live_context_tokens": None}
    )  # fmt: skip
    work = spec.workload.model_copy(update={**workload, "arrival_rate_per_s": rate})
    priority = [PriorityClassSpec.model_validate(dict(c)) for c in classes]
    return spec.model_copy(update={"workload": work, "profile": blank, "shape": shape, "priority_classes": priority})


def engines_of(plan: Plan) -> int:
    return int(plan.prefillers + plan.decoders)


def _plan_at(
    workload: Mapping[str, Any], rate: float, classes: Sequence[Mapping[str, Any]], profile: EngineProfile
) -> Plan:
    return plan_for(pool_spec(workload, rate, classes), profile)


def provisioned_rate(
    workload: Mapping[str, Any], classes: Sequence[Mapping[str, Any]], profile: EngineProfile, engines: int
) -> tuple[float, Plan]:
    """The highest arrival rate (conversations/s, to 0.1 %) at which the plan (``spec.shape: Auto``, the example
    pool's headroom) takes at most ``engines`` engines, and that plan."""
    low, high = 0.0, 1e-3
    while engines_of(_plan_at(workload, high, classes, profile)) <= engines:
        low, high = high, high * 2
        if high > 1e5:
            raise ValueError(f"the plan never needs more than {engines} engines for this workload")
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        if engines_of(_plan_at(workload, middle, classes, profile)) <= engines:
            low = middle
        else:
            high = middle
    if low <= 0:
        raise ValueError(f"the plan needs more than {engines} engines at any rate")
    return low, _plan_at(workload, low, classes, profile)


def cached_profile(path: Path) -> EngineProfile:
    return load_profile(read_file(str(path)))


async def _complete(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    async with session.post(f"{base}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{base}: HTTP {response.status}: {(await response.text())[:200]}")
        await response.read()
    return time.perf_counter() - started


async def _slowdown(engines: Sequence[str], prompt_tokens: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    rng = random.Random(11)

    def prompt() -> list[int]:  # a new prompt each time: no prefix-cache hit
        return [rng.randrange(16, 1000) for _ in range(prompt_tokens)]

    alone: list[float] = []
    together: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for base in engines:  # warm each engine up
            await _complete(session, base, prompt(), max_tokens)
        for _ in range(rounds):
            for base in engines:
                alone.append(await _complete(session, base, prompt(), max_tokens))
            together += await asyncio.gather(*(_complete(session, base, prompt(), max_tokens) for base in engines))
    return {
        "alone_s": statistics.mean(alone),
        "together_s": statistics.mean(together),
        "slowdown": max(1.0, statistics.mean(together) / statistics.mean(alone)),
        "rounds": rounds,
        "request": {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens},
    }


def colocation_slowdown(engines: Sequence[str], prompt_tokens: int, max_tokens: int, rounds: int = 5) -> dict[str, Any]:
    """How much longer one request (``prompt_tokens`` in, ``max_tokens`` out) takes on each engine when every
    engine serves one at once than on one engine alone (the others idle), ``rounds`` times each; at least 1."""
    say(f"co-location: {rounds} rounds of one request per engine, alone and all {len(engines)} at once")
    return asyncio.run(_slowdown(engines, prompt_tokens, max_tokens, rounds))
