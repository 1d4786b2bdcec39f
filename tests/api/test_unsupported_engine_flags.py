"""extraArgs may not turn on what coserve's layer-safepoint preemption does not support: speculative decoding, and
data parallelism over 1. Refused by the spec in every spelling vLLM 0.32 reads, with the item's field path and why
(``tests/operator/test_engine_args_vllm.py`` checks the spellings against vLLM's own parser).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from coserve.api import parse_pool
from coserve.api.crd import openapi_schema
from coserve.api.problems import InvalidInput, Problem
from coserve.api.spec import UNSUPPORTED_ENGINE_COUNTS, UNSUPPORTED_ENGINE_FLAG_ALIASES, UNSUPPORTED_ENGINE_FLAGS

SPECULATIVE_WHY = "speculative decoding drafts tokens inside the sampling step with the KV connector bound"
DATA_PARALLEL_WHY = "run more decoder replicas instead"
WHERE = ["engine", "prefiller", "decoder"]


def document(extra_args: list[str], where: str = "engine") -> dict[str, Any]:
    engine: dict[str, Any] = {}
    (engine if where == "engine" else engine.setdefault(where, {}))["extraArgs"] = copy.deepcopy(extra_args)
    return {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"name": "Qwen/Qwen3-8B"},
            "workload": {"arrivalRatePerS": 1, "inputTokens": 1000, "outputTokens": 100, "lifetimeS": 10},
            "profile": {"prefillLatency": {"perTokenS": 1e-4}, "decodeThroughputTokensPerS": 1000,
                        "kvCapacityTokens": 10**6},
            "engine": engine,
        },
    }  # fmt: skip


def refusal(extra_args: list[str], where: str = "engine") -> list[Problem]:
    with pytest.raises(InvalidInput) as raised:
        parse_pool(document(extra_args, where))
    return raised.value.problems


def field(where: str, index: int) -> str:
    return f"spec.engine.extraArgs[{index}]" if where == "engine" else f"spec.engine.{where}.extraArgs[{index}]"


SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
# (extraArgs, the index at fault, the flag named): each spelling vLLM reads as turning speculative decoding on
SPECULATIVE = [
    (["--speculative-config", SPEC_CONFIG], 0, "--speculative-config"),
    ([f"--speculative-config={SPEC_CONFIG}"], 0, "--speculative-config"),
    (["--max-model-len", "8192", "--speculative_config", SPEC_CONFIG], 2, "--speculative-config"),  # _ for -
    (["-sc", SPEC_CONFIG], 0, "--speculative-config"),
    ([f"-sc={SPEC_CONFIG}"], 0, "--speculative-config"),
    (["--speculative-config.method", "ngram"], 0, "--speculative-config"),  # a key of the JSON flag
    (["-sc.num_speculative_tokens", "3"], 0, "--speculative-config"),
    (["--speculative", SPEC_CONFIG], 0, "--speculative-config"),  # an unambiguous abbreviation
    (["--spec-method", "ngram"], 0, "--spec-method"),  # vLLM's shorthands for the config's keys
    (["--spec_model=org/draft"], 0, "--spec-model"),
    (["--spec-tokens", "3"], 0, "--spec-tokens"),
]  # fmt: skip
# (extraArgs, the index at fault, the flag named, the value named): data parallelism over 1
DATA_PARALLEL = [
    (["--data-parallel-size", "2"], 0, "--data-parallel-size", "not 2"),
    (["--data-parallel-size=4"], 0, "--data-parallel-size", "not 4"),
    (["--data_parallel_size", "2"], 0, "--data-parallel-size", "not 2"),
    (["--enforce-eager", "-dp", "8"], 1, "--data-parallel-size", "not 8"),
    (["-dp=2"], 0, "--data-parallel-size", "not 2"),
    (["--data-parallel-size-local", "2"], 0, "--data-parallel-size-local", "not 2"),
    (["-dpl=2"], 0, "--data-parallel-size-local", "not 2"),
    (["-dp", "$(DP_SIZE)"], 0, "--data-parallel-size", "not '$(DP_SIZE)'"),  # the kubelet expands it in the pod
    (["--max-num-seqs", "64", "-dp"], 2, "--data-parallel-size", "its value must follow it"),
]  # fmt: skip


@pytest.mark.parametrize(("extra_args", "index", "flag"), SPECULATIVE, ids=lambda value: str(value)[:40])
@pytest.mark.parametrize("where", WHERE)
def test_speculative_decoding_is_refused_with_the_field_path_and_why(
    extra_args: list[str], index: int, flag: str, where: str
) -> None:
    (problem,) = refusal(extra_args, where)
    assert problem.path == field(where, index)
    assert problem.reason.startswith(f"'{flag}' is not supported by coserve (")
    assert SPECULATIVE_WHY in problem.reason
    assert UNSUPPORTED_ENGINE_FLAGS[flag] in problem.reason


@pytest.mark.parametrize(("extra_args", "index", "flag", "value"), DATA_PARALLEL, ids=lambda value: str(value)[:40])
@pytest.mark.parametrize("where", WHERE)
def test_data_parallelism_over_one_is_refused_with_the_field_path_and_why(
    extra_args: list[str], index: int, flag: str, value: str, where: str
) -> None:
    (problem,) = refusal(extra_args, where)
    assert problem.path == field(where, index)
    assert problem.reason.startswith(f"'{flag}' is supported by coserve only at 1, ")
    assert value in problem.reason
    assert DATA_PARALLEL_WHY in problem.reason
    assert UNSUPPORTED_ENGINE_COUNTS[flag] in problem.reason


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--data-parallel-size", "1"],
        ["--data-parallel-size=1"],
        ["-dp", "1"],
        ["-dp=1"],
        ["--data_parallel_size", "1", "--max-model-len", "8192"],
        ["--data-parallel-size-local", "1"],
        ["--data-parallel-backend", "mp"],  # another flag of vLLM's data-parallel group: not a count
        ["--max-model-len", "8192", "--enable-prefix-caching"],
    ],
    ids=lambda args: " ".join(args),
)
@pytest.mark.parametrize("where", WHERE)
def test_one_data_parallel_rank_and_other_flags_are_accepted(extra_args: list[str], where: str) -> None:
    engine = parse_pool(document(extra_args, where)).spec.engine
    assert (engine.extra_args if where == "engine" else getattr(engine, where).extra_args) == extra_args


def test_every_refused_item_is_named() -> None:
    spec = document(["--speculative-config", SPEC_CONFIG, "--max-model-len", "8192", "-dp", "2"])
    spec["spec"]["engine"]["decoder"] = {"extraArgs": ["--port", "9000", "--data-parallel-size=1", "-sc", "{}"]}
    with pytest.raises(InvalidInput) as raised:
        parse_pool(spec)
    assert [(p.path, p.reason.split(" (")[0]) for p in raised.value.problems] == [
        ("spec.engine.extraArgs[0]", "'--speculative-config' is not supported by coserve"),
        ("spec.engine.extraArgs[4]", "'--data-parallel-size' is supported by coserve only at 1, not 2"),
        ("spec.engine.decoder.extraArgs[0]", "'--port' is set by coserve"),
        ("spec.engine.decoder.extraArgs[3]", "'--speculative-config' is not supported by coserve"),
    ]


def test_the_crds_extra_args_descriptions_name_every_refused_option() -> None:
    engine = openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    descriptions = [engine["extraArgs"]["description"]]
    descriptions += [engine[role]["properties"]["extraArgs"]["description"] for role in ("prefiller", "decoder")]
    for description in descriptions:
        for option in (*UNSUPPORTED_ENGINE_FLAGS, *UNSUPPORTED_ENGINE_COUNTS, *UNSUPPORTED_ENGINE_FLAG_ALIASES):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", description), option
