"""Malformed CoServePool manifests through the real ``coserve plan`` entry point.

The contract under test: on any invalid manifest ``coserve plan FILE`` exits 2,
prints nothing on stdout, and prints one ``FILE: <field path>: <reason>`` line
per problem on stderr (``FILE: <reason>`` for whole-file problems), never a
traceback.

Every case is data: a mutation of ``examples/pool.yaml`` or raw bytes, what
stderr must name (a field path, or ``~`` and a substring of a whole-file
reason; a tuple accepts any of its members), how many problem lines, and what
the CRD's openAPIV3Schema must say about the same document: ``REJECT`` for
schema-level mistakes (types, bounds, enums, required fields, patterns), so the
pydantic models and the CRD are shown to agree; ``ACCEPT`` for semantic rules
the schema cannot express. Identity and metadata mistakes get no CRD verdict
(the API server, not the CRD schema, checks them), nor do unknown fields (the
API server prunes them) nor YAML-level ones (kubectl fails before the schema).
"""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conftest import CRD_FILE, EXAMPLES, ROOT
from coserve.cli.main import main

Doc = dict[str, Any]
Mutation = Callable[[Doc], None]
Expectation = str | tuple[str, ...]

BASE: Doc = yaml.safe_load((EXAMPLES / "pool.yaml").read_text())
BASE_TEXT = yaml.safe_dump(BASE, sort_keys=False)
CRD_SCHEMA: Doc = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
# NOTE: OpenAPI v3.0 spells exclusiveMinimum as a boolean, as JSON Schema draft 4 does.
CRD_VALIDATOR = jsonschema.Draft4Validator(CRD_SCHEMA)

REJECT, ACCEPT = "reject", "accept"
# A reason longer than this is not a message a person can act on (a 300-digit number, a dump).
MAX_REASON_CHARS = 300
# Refusing bad input is a parse and a few checks (milliseconds); an alias bomb expanded in full would take
# minutes. The bound only tells those apart: it is not a performance claim, and CI's 2 busy cores must not
# trip it (1 s did, at 1.5 s for a 10,000-deep nest while a benchmark ran).
MAX_REFUSAL_S = 10.0


@dataclass(frozen=True)
class Case:
    """One malformed manifest and what ``coserve plan`` and the CRD must say about it."""

    id: str
    data: bytes
    expect: tuple[Expectation, ...]
    lines: int | None = 1  # problem lines on stderr; None when the count is not the point
    document: Doc | None = None  # the mutated document, for the CRD check
    crd: str | None = None  # REJECT, ACCEPT, or None (not the CRD's business)
    cli_bug: str | None = None  # xfail reason of the CLI test: a source bug found by this case
    crd_bug: str | None = None  # xfail reason of the CRD test: the CRD and the models disagree


# --- building cases ----------------------------------------------------------------------------


def _keys(path: str) -> list[str | int]:
    """``spec.priorityClasses[1].name`` -> ``["spec", "priorityClasses", 1, "name"]``."""
    return [int(part[1:-1]) if part.startswith("[") else part for part in re.findall(r"\[\d+\]|[^.\[]+", path)]


def _parent(doc: Doc, path: str | list[str | int], create: bool = False) -> tuple[Any, str | int]:
    keys = _keys(path) if isinstance(path, str) else path
    node: Any = doc
    for key in keys[:-1]:
        node = node.setdefault(key, {}) if create and isinstance(key, str) else node[key]
    return node, keys[-1]


def put(path: str | list[str | int], value: object) -> Mutation:
    """Set ``path`` to ``value``, creating missing objects on the way (``spec.kvOffload`` is not in the example)."""

    def mutate(doc: Doc) -> None:
        node, key = _parent(doc, path, create=True)
        node[key] = value

    return mutate


def drop(path: str) -> Mutation:
    def mutate(doc: Doc) -> None:
        node, key = _parent(doc, path)
        del node[key]

    return mutate


def mutated(
    case_id: str,
    *mutations: Mutation,
    expect: tuple[Expectation, ...],
    lines: int | None = 1,
    crd: str | None = REJECT,
    cli_bug: str | None = None,
    crd_bug: str | None = None,
) -> Case:
    doc = copy.deepcopy(BASE)
    for mutation in mutations:
        mutation(doc)
    data = yaml.safe_dump(doc, sort_keys=False).encode()
    return Case(case_id, data, expect, lines, doc, crd, cli_bug, crd_bug)


def bad(case_id: str, path: str, value: object, **kwargs: Any) -> Case:
    """The example with ``value`` at ``path``; stderr must name ``path``."""
    return mutated(case_id, put(path, value), expect=(path,), **kwargs)


def missing(case_id: str, path: str, **kwargs: Any) -> Case:
    """The example without ``path``; stderr must name ``path``."""
    return mutated(case_id, drop(path), expect=(path,), **kwargs)


def raw(case_id: str, data: bytes, *expect: Expectation, lines: int | None = 1, cli_bug: str | None = None) -> Case:
    return Case(case_id, data, tuple(expect), lines, cli_bug=cli_bug)


def edited(old: str, new: str) -> bytes:
    """The example's YAML with one literal edit, for what safe_dump cannot write (.nan, tags, raw ints)."""
    assert BASE_TEXT.count(old) == 1, old
    return BASE_TEXT.replace(old, new).encode()


def line_of(text: str, needle: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


def classes(*specs: tuple[str, float]) -> list[Doc]:
    """Priority classes from (name, ttftSloMs) pairs."""
    return [{"name": name, "weight": 1.0, "ttftSloMs": ttft, "tpotSloMs": 100.0} for name, ttft in specs]


def billion_laughs() -> bytes:
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        rows.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return ("\n".join(rows) + "\n").encode()


def doubling_bomb(levels: int) -> bytes:
    """Two aliases per level: 2·levels aliases (under the loader's cap of 64) expand to 2**levels leaves."""
    rows = ["bomb:", "- &l0 [lol]"] + [f"- &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, levels + 1)]
    return (BASE_TEXT + "\n".join(rows) + "\n").encode()


_RNG = random.Random(20_261_120)
RANDOM_WITH_NULS = _RNG.randbytes(200) + b"\x00" + _RNG.randbytes(200)
RANDOM_HIGH_BYTES = bytes(_RNG.randrange(0x80, 0x100) for _ in range(400))  # no NUL, never UTF-8
PNG_HEADER = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10\x00\x00\x00\x10\x08\x06\x00\x00\x00"
TAB_INDENTED = b"apiVersion: coserve.dev/v1alpha1\nkind: CoServePool\nmetadata:\n\tname: agents\n"
UNCLOSED_BRACKET = BASE_TEXT.replace("spec:\n", "spec:\n  priorityClasses: [interactive, batch\n", 1)
OVERSIZED = BASE_TEXT.encode() + b"#" * (1 << 20) + b"\n"
DUPLICATE_NESTED = BASE_TEXT.replace("    inputTokens: 15000\n", "    inputTokens: 15000\n    inputTokens: 16000\n")
NO_INLINE_PROFILE = {"configMapRef": {"name": "qwen3-8b-h100"}}
ANOTHER_POOL = {**copy.deepcopy(BASE), "metadata": {"name": "agents-2", "namespace": "llm"}}
CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}


CASES: list[Case] = [
    # --- wrong types ---
    bad("input-tokens-string", "spec.workload.inputTokens", "15000"),
    bad("arrival-rate-string", "spec.workload.arrivalRatePerS", "1.5"),
    bad("input-tokens-float", "spec.workload.inputTokens", 1.5),
    bad("output-tokens-huge-float", "spec.workload.outputTokens", 1e308),
    bad("workload-list", "spec.workload", [1, 2]),
    bad("model-list", "spec.model", ["Qwen/Qwen3-8B"]),
    bad("priority-classes-object", "spec.priorityClasses", {"name": "a"}),
    bad("spec-string", "spec", "big pool please"),
    bad("headroom-bool", "spec.headroom", True),
    bad("tensor-parallel-bool", "spec.engine.tensorParallelSize", True),
    bad("kv-capacity-bool", "spec.profile.kvCapacityTokens", False),
    bad("model-name-number", "spec.model.name", 8),
    bad("engine-image-number", "spec.engine.image", 1.0),
    mutated("offline-enabled-string", put("spec.offline", {"enabled": "yes"}), expect=("spec.offline.enabled",)),
    bad("extra-args-string", "spec.engine.extraArgs", "--enforce-eager"),
    mutated(
        "extra-args-item-number",
        put("spec.engine.extraArgs", ["--max-num-seqs", 256]),
        expect=("spec.engine.extraArgs[1]",),
    ),
    mutated(
        "node-selector-value-bool",
        put("spec.engine.decoder", {"nodeSelector": {"gpu": True}}),
        expect=("spec.engine.decoder.nodeSelector.gpu",),
    ),
    bad("metadata-name-number", "metadata.name", 42, crd=None),
    bad("metadata-string", "metadata", "agents", crd=None),
    # --- negatives ---
    bad("arrival-rate-negative", "spec.workload.arrivalRatePerS", -1.5),
    bad("output-tokens-negative", "spec.workload.outputTokens", -5),
    bad("constant-s-negative", "spec.profile.prefillLatency.constantS", -0.1),
    bad("host-memory-negative", "spec.kvOffload.hostMemoryBytes", -1),
    mutated(
        "weight-negative",
        put("spec.priorityClasses", [{**classes(("a", 100.0))[0], "weight": -1}]),
        expect=("spec.priorityClasses[0].weight",),
    ),
    mutated(
        "min-replicas-zero",
        put("spec.autoscaling", {"decoders": {"minReplicas": 0}}),
        expect=("spec.autoscaling.decoders.minReplicas",),
    ),
    # --- zeros where a division follows ---
    bad("input-tokens-zero", "spec.workload.inputTokens", 0),
    bad("decode-throughput-zero", "spec.profile.decodeThroughputTokensPerS", 0),
    bad("kv-capacity-zero", "spec.profile.kvCapacityTokens", 0),
    bad("lifetime-zero", "spec.workload.lifetimeS", 0),
    mutated(
        "prefill-latency-all-zero",
        put("spec.profile.prefillLatency", {"constantS": 0, "perTokenS": 0, "perTokenSquaredS": 0}),
        expect=("spec.profile.prefillLatency",),
        crd=ACCEPT,
    ),
    # --- missing required fields ---
    missing("missing-spec", "spec"),
    missing("missing-model", "spec.model"),
    missing("missing-model-name", "spec.model.name"),
    missing("missing-workload", "spec.workload"),
    missing("missing-arrival-rate", "spec.workload.arrivalRatePerS"),
    missing("missing-input-tokens", "spec.workload.inputTokens"),
    missing("missing-output-tokens", "spec.workload.outputTokens"),
    missing("missing-lifetime", "spec.workload.lifetimeS"),
    missing("missing-profile", "spec.profile"),
    missing("missing-per-token-s", "spec.profile.prefillLatency.perTokenS"),
    missing("missing-metadata", "metadata", crd=None),
    missing("missing-metadata-name", "metadata.name", crd=None),
    missing("missing-api-version", "apiVersion", crd=None),
    missing("missing-kind", "kind", crd=None),
    # --- unknown fields at several depths (the API server prunes them: no CRD verdict) ---
    bad("unknown-top-level", "specs", {}, crd=None),
    bad("unknown-in-spec", "spec.replicas", 3, crd=None),
    bad("unknown-in-workload", "spec.workload.inputTokenz", 15000, crd=None),
    mutated(
        "unknown-in-priority-class",
        put("spec.priorityClasses", [{**classes(("a", 100.0))[0], "sloMs": 5}]),
        expect=("spec.priorityClasses[0].sloMs",),
        crd=None,
    ),
    bad("unknown-in-prefill-latency", "spec.profile.prefillLatency.cubicS", 1e-15, crd=None),
    # --- absurdly large numbers ---
    bad("arrival-rate-1e308", "spec.workload.arrivalRatePerS", 1e308),
    bad("decode-throughput-1e308", "spec.profile.decodeThroughputTokensPerS", 1e308),
    bad("kv-capacity-10e30", "spec.profile.kvCapacityTokens", 10**30),
    bad("arrival-rate-10e30", "spec.workload.arrivalRatePerS", 10**30),
    bad("input-tokens-10e12", "spec.workload.inputTokens", 10**12),
    bad(
        "rate-needs-over-10000-replicas", "spec.workload.arrivalRatePerS", 100_000, lines=1, crd=ACCEPT
    ),  # too many engines (the example plans aggregated engines: no prefillers)
    bad("decode-throughput-1e-300", "spec.profile.decodeThroughputTokensPerS", 1e-300),
    mutated(
        "per-token-s-subnormal",
        put("spec.profile.prefillLatency", {"constantS": 0, "perTokenS": 1e-310, "perTokenSquaredS": 0}),
        expect=(("spec.profile.prefillLatency", "spec.profile.prefillLatency.perTokenS"),),
        crd=ACCEPT,
    ),
    bad("decode-throughput-subnormal", "spec.profile.decodeThroughputTokensPerS", 1e-320),
    # --- NaN and infinity (JSON cannot carry them: no CRD verdict) ---
    raw("arrival-rate-nan", edited("arrivalRatePerS: 1.5", "arrivalRatePerS: .nan"), "spec.workload.arrivalRatePerS"),
    raw("lifetime-inf", edited("lifetimeS: 12", "lifetimeS: .inf"), "spec.workload.lifetimeS"),
    raw("headroom-minus-inf", edited("headroom: 1.5", "headroom: -.inf"), "spec.headroom"),
    raw(
        "decode-throughput-1e309",
        edited("decodeThroughputTokensPerS: 1000", "decodeThroughputTokensPerS: 1.0e+309"),
        "spec.profile.decodeThroughputTokensPerS",
    ),
    # --- identity: apiVersion and kind (the API server checks them, not the CRD schema) ---
    mutated("api-version-v1", put("apiVersion", "coserve.dev/v1"), expect=("apiVersion", "~only v1alpha1"), crd=None),
    bad("api-version-apps", "apiVersion", "apps/v1", crd=None),
    bad("api-version-number", "apiVersion", 1, crd=None),
    mutated("kind-deployment", put("kind", "Deployment"), expect=("kind", "~another kind of object"), crd=None),
    mutated(
        "missing-api-version-and-kind",
        drop("apiVersion"),
        drop("kind"),
        expect=("apiVersion", "kind"),
        lines=2,
        crd=None,
    ),
    # --- whole-file problems ---
    raw("two-pools", yaml.safe_dump_all([BASE, ANOTHER_POOL]).encode(), "~holds 2 YAML documents"),
    raw("pool-then-configmap", (BASE_TEXT + "---\n" + yaml.safe_dump(CONFIG_MAP)).encode(), "~holds 2 YAML documents"),
    raw("pool-then-scalar", (BASE_TEXT + "---\nhello\n").encode(), "~holds 2 YAML documents"),
    raw("empty-file", b"", "~is empty"),
    raw("whitespace-only", b"  \n\r\n\n   \n", "~is empty"),
    raw("comment-only", b"# a CoServePool, some day\n# TODO\n", "~is empty"),
    raw("separators-only", b"---\n---\n...\n", "~is empty"),
    raw("bare-scalar", b"agents\n", "~expected a CoServePool object (a mapping)"),
    raw("bare-number", b"42\n", "~expected a CoServePool object (a mapping)"),
    raw("top-level-list", yaml.safe_dump([BASE]).encode(), "~expected a CoServePool object (a mapping), got a list"),
    raw("random-bytes-with-nuls", RANDOM_WITH_NULS, "~binary data"),
    raw("png-header", PNG_HEADER, "~binary data"),
    raw("random-high-bytes", RANDOM_HIGH_BYTES, "~not UTF-8"),
    raw("latin-1-name", edited("name: agents", "name: caf\xe9").replace(b"caf\xc3\xa9", b"caf\xe9"), "~not UTF-8"),
    raw("oversized", OVERSIZED, "~larger than the 1048576 bytes a manifest may be"),
    raw("oversized-twice-the-limit", OVERSIZED + b"#" * (1 << 20) + b"\n", "~larger than the 1048576 bytes"),
    raw("tab-indent", TAB_INDENTED, "~is not valid YAML: line 4"),
    raw(
        "unclosed-bracket",
        UNCLOSED_BRACKET.encode(),  # found where the next key's ':' ends the flow sequence
        f"~is not valid YAML: line {line_of(UNCLOSED_BRACKET, '[') + 1}",
    ),
    raw(
        "duplicate-top-level-key",
        BASE_TEXT.encode() + b"kind: CoServePool\n",
        f"~line {len(BASE_TEXT.splitlines()) + 1}, column 1",
        "~duplicate key 'kind'",
    ),
    raw(
        "duplicate-nested-key",
        DUPLICATE_NESTED.encode(),
        f"~line {line_of(DUPLICATE_NESTED, '16000')}",
        "~duplicate key 'inputTokens'",
    ),
    raw("billion-laughs", billion_laughs(), "~alias bomb"),
    raw("doubling-alias-bomb", doubling_bomb(16), "~alias"),
    raw(
        "python-tag",
        edited("inputTokens: 15000", "inputTokens: !!python/object/apply:os.system ['true']"),
        "~is not valid YAML",
    ),
    raw("set-value", edited("inputTokens: 15000", "inputTokens: !!set {a, b}"), "~not JSON data"),
    raw(
        "int-tag-on-word",
        edited("inputTokens: 15000", "inputTokens: !!int many"),
        ("spec.workload.inputTokens", f"~line {line_of(BASE_TEXT, 'inputTokens')}"),
    ),
    raw(
        "float-tag-on-word",
        edited("lifetimeS: 12", "lifetimeS: !!float long"),
        ("spec.workload.lifetimeS", f"~line {line_of(BASE_TEXT, 'lifetimeS')}"),
    ),
    raw(
        "timestamp-tag-on-word",
        edited("name: agents", "name: !!timestamp yesterday"),
        ("metadata.name", f"~line {line_of(BASE_TEXT, 'name: agents')}"),
    ),
    raw(
        "integer-with-5000-digits",
        edited("inputTokens: 15000", "inputTokens: " + "9" * 5000),
        ("spec.workload.inputTokens", f"~line {line_of(BASE_TEXT, 'inputTokens')}"),
    ),
    raw("nested-10000-deep", b"spec: " + b"[" * 5000 + b"]" * 5000 + b"\n", ("~nest", "~deep")),
    # --- metadata.name (the API server checks it, not the CRD schema) ---
    bad("name-uppercase", "metadata.name", "Agents", crd=None),
    bad("name-too-long", "metadata.name", "a" * 51, crd=None),
    bad("name-starts-with-digit", "metadata.name", "1agents", crd=None),
    bad("name-empty", "metadata.name", "", crd=None),
    # --- enums, patterns, quantities ---
    mutated(
        "kv-offload-backend",
        put("spec.kvOffload", {"enabled": True, "backend": "disk"}),
        expect=("spec.kvOffload.backend",),
    ),
    mutated("kv-offload-backend-case", put("spec.kvOffload", {"backend": "Host"}), expect=("spec.kvOffload.backend",)),
    mutated(
        "toleration-operator",
        put("spec.engine.decoder", {"tolerations": [{"key": "gpu", "operator": "Maybe"}]}),
        expect=("spec.engine.decoder.tolerations[0].operator",),
    ),
    bad("image-pull-policy", "spec.engine.imagePullPolicy", "Sometimes"),
    bad("quantity-with-space", "spec.engine.resources.limits.memory", "64 GB"),
    bad("quantity-word", "spec.engine.resources.requests.cpu", "eight"),
    bad("quantity-float", "spec.engine.resources.requests.cpu", 0.5),
    mutated(
        "quantity-in-role-override",
        put("spec.engine.prefiller", {"resources": {"limits": {"memory": "1Gb"}}}),
        expect=("spec.engine.prefiller.resources.limits.memory",),
    ),
    bad("quantity-65-digits", "spec.engine.resources.limits.memory", "1" * 65),
    bad("quantity-negative", "spec.engine.resources.limits.memory", "-1Gi"),
    bad("quantity-negative-integer", "spec.engine.resources.requests.cpu", -2),
    mutated(
        "resource-name-empty",
        put(["spec", "engine", "resources", "limits", ""], 1),
        # The CRD checks map keys with a CEL rule (tests/api/test_crd.py), which jsonschema cannot run.
        expect=('spec.engine.resources.limits[""]',),
        crd=None,
    ),
    mutated(
        "priority-class-name-uppercase",
        put("spec.priorityClasses", classes(("interactive", 1e3), ("Batch", 9e3))),
        expect=("spec.priorityClasses[1].name",),
    ),
    bad("priority-classes-empty", "spec.priorityClasses", []),
    bad("priority-classes-17", "spec.priorityClasses", classes(*[(f"c{i}", 1000) for i in range(17)])),
    mutated(
        "prometheus-url-scheme",
        put("spec.autoscaling", {"prometheusUrl": "prometheus:9090"}),
        expect=("spec.autoscaling.prometheusUrl",),
    ),
    mutated(
        "offline-class-name-pattern", put("spec.offline", {"className": "Offline"}), expect=("spec.offline.className",)
    ),
    bad("model-name-empty", "spec.model.name", ""),
    mutated("offline-share-above-one", put("spec.offline", {"share": 1.5}), expect=("spec.offline.share",)),
    bad("headroom-below-one", "spec.headroom", 0.5),
    # --- semantic errors: the CRD accepts them, coserve's checks do not ---
    mutated(
        "autoscaling-min-above-max",
        put("spec.autoscaling", {"prefillers": {"minReplicas": 5, "maxReplicas": 2}}),
        expect=("spec.autoscaling.prefillers.minReplicas",),
        crd=ACCEPT,
    ),
    mutated(
        "autoscaling-without-prometheus",
        put("spec.autoscaling", {"enabled": True}),
        expect=("spec.autoscaling.prometheusUrl",),
        crd=ACCEPT,
    ),
    mutated(
        "duplicate-priority-class",
        put("spec.priorityClasses", classes(("gold", 1000), ("gold", 2000))),
        expect=("spec.priorityClasses[1].name",),
        crd=ACCEPT,
    ),
    mutated(
        "offline-class-not-declared",
        put("spec.offline", {"enabled": True, "className": "batch"}),
        expect=("spec.offline.className",),
        crd=ACCEPT,
    ),
    mutated(
        "kv-offload-zero-bytes",
        put("spec.kvOffload", {"enabled": True, "hostMemoryBytes": 0}),
        expect=("spec.kvOffload.hostMemoryBytes",),
        crd=ACCEPT,
    ),
    bad("kv-capacity-below-live-context", "spec.profile.kvCapacityTokens", 1000, crd=ACCEPT),
    mutated(
        "ttft-below-constant-cost",
        put("spec.priorityClasses", classes(("fast", 10), ("slow", 5000))),
        expect=("spec.priorityClasses[0].ttftSloMs",),
        crd=ACCEPT,
    ),
    mutated(
        "config-map-ref-without-profile",
        put("spec.profile", NO_INLINE_PROFILE),
        expect=(
            "spec.profile.prefillLatency",
            "spec.profile.decodeThroughputTokensPerS",
            "spec.profile.kvCapacityTokens",
        ),
        lines=3,
        crd=ACCEPT,
    ),
    # --- extraArgs that set a flag the operator renders (vLLM would keep the user's, the last) ---
    mutated(
        "extra-args-set-the-kv-transfer-config",
        put("spec.engine.extraArgs", ["--max-model-len", "8192", "--kv-transfer-config", "{}"]),
        expect=("spec.engine.extraArgs[2]", "~'--kv-transfer-config' is set by coserve (set spec.kvOffload"),
        crd=ACCEPT,
    ),
    mutated(
        "decoder-extra-args-set-the-scheduler",
        put("spec.engine.decoder", {"extraArgs": ["--scheduler_cls=vllm.v1.core.sched.scheduler.Scheduler"]}),
        expect=("spec.engine.decoder.extraArgs[0]", "~'--scheduler-cls' is set by coserve ("),
        crd=ACCEPT,
    ),
    mutated(
        "extra-args-turn-async-scheduling-on",
        put("spec.engine.prefiller", {"extraArgs": ["--enforce-eager", "--async-scheduling"]}),
        expect=("spec.engine.prefiller.extraArgs[1]",),
        crd=ACCEPT,
    ),
    # --- several problems at once: every one reported, one line each ---
    mutated(
        "four-schema-problems",
        put("spec.workload.inputTokens", "12"),
        put("spec.workload.outputTokens", -1),
        put("spec.workload.lifetimeS", True),
        put("metadata.name", "Bad"),
        expect=("spec.workload.inputTokens", "spec.workload.outputTokens", "spec.workload.lifetimeS", "metadata.name"),
        lines=4,
    ),
    mutated(
        "identity-and-schema-problems",
        put("apiVersion", "apps/v1"),
        put("kind", "Deployment"),
        drop("spec.workload"),
        put("spec.headroom", "lots"),
        expect=("apiVersion", "kind", "spec.workload", "spec.headroom"),
        lines=4,
    ),
    mutated(
        "four-semantic-problems",
        put(
            "spec.autoscaling",
            {
                "enabled": True,
                "prefillers": {"minReplicas": 3, "maxReplicas": 2},
                "decoders": {"minReplicas": 9, "maxReplicas": 4},
            },
        ),
        put("spec.priorityClasses", classes(("gold", 1000), ("gold", 2000))),
        expect=(
            "spec.autoscaling.prefillers.minReplicas",
            "spec.autoscaling.decoders.minReplicas",
            "spec.autoscaling.prometheusUrl",
            "spec.priorityClasses[1].name",
        ),
        lines=4,
        crd=ACCEPT,
    ),
]


# --- checking stderr ---------------------------------------------------------------------------


def _mentions(lines: list[str], source: str, expectation: str) -> bool:
    if expectation.startswith("~"):
        return any(expectation[1:] in line for line in lines)
    return any(line.startswith(f"{source}: {expectation}: ") for line in lines)


def assert_problems(stderr: str, source: str, expect: tuple[Expectation, ...], num_lines: int | None) -> None:
    """stderr holds only ``SOURCE: [path: ]reason`` lines, naming every expected path or reason."""
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert lines, "no problem was reported"
    for line in lines:
        assert line.startswith(f"{source}: "), f"not a problem line: {line!r}"
        message = line[len(source) + 2 :]
        head = message.split(": ", 1)[0]
        if " " not in head:  # a field path: a dangling dot means a key was lost
            assert not head.endswith(".") and ".." not in head, f"malformed field path in {line!r}"
        assert len(message) <= MAX_REASON_CHARS, f"{len(message)}-character problem line: {line[:200]}..."
    for expectation in expect:
        options = expectation if isinstance(expectation, tuple) else (expectation,)
        assert any(_mentions(lines, source, option) for option in options), f"none of {options} in:\n{stderr}"
    if num_lines is not None:
        assert len(lines) == num_lines, stderr


def crd_error_paths(document: Doc) -> set[str]:
    """Field paths of the CRD schema's complaints, spelled as the CLI spells them."""
    paths = set()
    for error in CRD_VALIDATOR.iter_errors(document):
        parts = list(error.absolute_path)
        if error.validator == "required":
            parts += [name for name in error.validator_value if name not in error.instance]
        path = ""
        for part in parts:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
        paths.add(path)
    return paths


def _params(cases: list[Case], bug: Callable[[Case], str | None]) -> list[Any]:
    return [
        pytest.param(case, id=case.id, marks=[pytest.mark.xfail(strict=True, reason=r)] if (r := bug(case)) else [])
        for case in cases
    ]


def run_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    code = main(["plan", *argv])
    elapsed_s = time.perf_counter() - start
    captured = capsys.readouterr()
    return code, captured.out, captured.err, elapsed_s


# --- the tests ---------------------------------------------------------------------------------


def test_cases_are_many_and_distinct() -> None:
    assert len(CASES) >= 60
    assert len({case.id for case in CASES}) == len(CASES)
    assert len({case.data for case in CASES}) == len(CASES)


def test_the_unmutated_example_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control: the cases fail because of their mutation, not because the base is broken."""
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(BASE_TEXT + "---\n")  # a trailing separator is not a second document
    code, out, err, _ = run_plan(capsys, str(manifest))
    assert (code, err) == (0, "")
    assert "CoServePool llm/agents" in out
    assert crd_error_paths(BASE) == set()


@pytest.mark.parametrize("case", _params(CASES, lambda case: case.cli_bug))
def test_plan_refuses_malformed_manifest(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "pool.yaml"
    manifest.write_bytes(case.data)
    code, out, err, elapsed_s = run_plan(capsys, str(manifest))
    assert code == 2, err
    assert out == ""
    assert_problems(err, str(manifest), case.expect, case.lines)
    assert elapsed_s < MAX_REFUSAL_S


@pytest.mark.parametrize("case", _params([c for c in CASES if c.crd is not None], lambda case: case.crd_bug))
def test_crd_schema_agrees(case: Case) -> None:
    assert case.document is not None
    paths = crd_error_paths(case.document)
    if case.crd == ACCEPT:
        assert paths == set(), "a semantic rule should be beyond the schema"
        return
    assert paths, "the CRD schema accepts a document the models reject"
    spec_paths = [e for e in case.expect if isinstance(e, str) and e.startswith("spec")]
    for expected in spec_paths:
        assert expected in paths, f"CRD complains about {sorted(paths)}, not {expected}"


@pytest.mark.parametrize(
    ("target", "reason"),
    [("missing.yaml", "cannot be read: No such file or directory"), (".", "is a directory, not a manifest file")],
    ids=["nonexistent", "directory"],
)
def test_plan_refuses_unreadable_path(
    target: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / target)
    code, out, err, _ = run_plan(capsys, path)
    assert (code, out) == (2, "")
    assert err == f"{path}: {reason}\n"


PROFILE_CASES = [
    pytest.param(b"prefillLatency: {perTokenS: 3.1e-5\n", ("~is not valid YAML: line 2",), 1, id="bad-yaml"),
    pytest.param(b"\x00\x01profile", ("~binary data",), 1, id="binary"),
    pytest.param(b"", ("~is empty: expected one CoServeProfile",), 1, id="empty"),
    pytest.param(
        b"decodeThroughputTokensPerS: fast\nkvCapacityTokens: -1\n",
        ("decodeThroughputTokensPerS", "kvCapacityTokens"),
        2,
        id="bad-values",
    ),
    pytest.param(b"prefillLatency: {perTokenS: 3.1e-5}\ngpu: H100\n", ("gpu",), 1, id="unknown-field"),
    pytest.param(b"kind: CoServePool\n", ("kind",), 1, id="wrong-kind"),
    pytest.param(b"- 1\n", ("~should be an object",), 1, id="list"),
]


@pytest.mark.parametrize(("profile", "expect", "num_lines"), PROFILE_CASES)
def test_profile_problems_name_the_profile_file(
    profile: bytes, expect: tuple[str, ...], num_lines: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(yaml.safe_dump({**BASE, "spec": {**BASE["spec"], "profile": NO_INLINE_PROFILE}}))
    profile_file = tmp_path / "profile.yaml"
    profile_file.write_bytes(profile)
    code, out, err, _ = run_plan(capsys, str(manifest), "--profile", str(profile_file))
    assert (code, out) == (2, "")
    assert_problems(err, str(profile_file), expect, num_lines)


def test_missing_profile_file_names_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    code, out, err, _ = run_plan(capsys, str(EXAMPLES / "pool.yaml"), "--profile", missing)
    assert (code, out, err) == (2, "", f"{missing}: cannot be read: No such file or directory\n")


def test_render_refuses_extra_args_that_set_a_rendered_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``coserve render`` prints no object, and the line ``coserve plan`` prints, for what the operator would refuse."""
    manifest = tmp_path / "pool.yaml"
    manifest.write_bytes(next(c for c in CASES if c.id == "extra-args-set-the-kv-transfer-config").data)
    code = main(["render", str(manifest)])
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err.startswith(f"{manifest}: spec.engine.extraArgs[2]: '--kv-transfer-config' is set by coserve (")
    assert captured.err.count("\n") == 1


SUBPROCESS_CASES = ["input-tokens-string", "tab-indent", "random-bytes-with-nuls", "four-semantic-problems"]


@pytest.mark.parametrize("case_id", [*SUBPROCESS_CASES, "nonexistent"])
def test_console_process_exits_2_without_traceback(case_id: str, tmp_path: Path) -> None:
    manifest = tmp_path / "pool.yaml"
    case = next((c for c in CASES if c.id == case_id), None)
    if case is not None:
        manifest.write_bytes(case.data)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("COSERVE_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "coserve", "plan", str(manifest)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    if case is None:
        assert result.stderr == f"{manifest}: cannot be read: No such file or directory\n"
    else:
        assert_problems(result.stderr, str(manifest), case.expect, case.lines)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param(
            "decodeThroughputTokensPerS: 1000",
            "decodeThroughputTokensPerS: 1e3",
            id="1e3",
        ),
        pytest.param(
            "decodeThroughputTokensPerS: 1000",
            "decodeThroughputTokensPerS: 1.0e3",
            id="1.0e3",
        ),
        pytest.param("  workload:\n", "  workload:\n    <<: {lifetimeS: 12}\n", id="merge-key"),
    ],
)
def test_yaml_that_kubectl_accepts_is_accepted(
    old: str, new: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not malformed: spellings the cluster accepts, which the CLI must not reject."""
    text = BASE_TEXT.replace(old, new, 1)
    if "<<" in new:
        text = text.replace("    lifetimeS: 12\n", "", 1)
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(text)
    code, _, err, _ = run_plan(capsys, str(manifest))
    assert (code, err) == (0, "")
