"""The coserve command line on valid input: plan, render, crd, --version, --help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES
from coserve import __version__
from coserve.cli.main import main

POOL = str(EXAMPLES / "pool.yaml")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


ROWS = ("shape", "prefillers", "engines", "decoders", "bottleneck")


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", POOL)
    assert (code, err) == (0, "")
    assert "CoServePool llm/agents" in out
    lines = {
        line.split()[0]: line.split()[1]
        for line in out.splitlines()
        if line.startswith("  ")
        and line.split()
        and line.split()[0] in ("prefillers", "decoders", "engines", "bottleneck")
    }
    # first the two shapes side by side (P/D first), then the chosen one's rows, which overwrite them here
    assert lines == {"prefillers": "3", "decoders": "3", "engines": "6", "bottleneck": "DecoderThroughput"}
    assert "Shape: Disaggregated: P/D needs fewer engines (6 against 21)" in out
    assert "P/D (chosen)" in out and "aggregated" in out
    assert "Why:" in out and "R* = T_p / L_in" in out and "alternative (aggregated, not taken)" in out


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_plan_machine_readable(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    code, out, _ = run(capsys, "plan", POOL, "-o", fmt)
    document = json.loads(out) if fmt == "json" else yaml.safe_load(out)
    assert code == 0
    assert document["name"] == "agents" and document["namespace"] == "llm"
    plan = document["plan"]
    assert (plan["prefillers"], plan["decoders"], plan["bindingConstraint"]) == (3, 3, "DecoderThroughput")
    assert plan["shapes"]["shape"] == "Disaggregated" and plan["shapes"]["disaggregated"]["engines"] == 6
    assert plan["saturationRatePerS"] == pytest.approx(15_000 / (0.02 + 3.6e-5 * 15_000 + 2e-10 * 15_000**2) / 15_000)


def test_plan_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(Path(POOL).read_bytes())))
    code, out, _ = run(capsys, "plan", "-", "-o", "json")
    assert code == 0 and json.loads(out)["plan"]["decoders"] == 3


def test_plan_with_measured_profile(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "plan",
        str(EXAMPLES / "pool-autoscaling.yaml"),
        "--profile",
        str(EXAMPLES / "profile.yaml"),
        "-o",
        "json",
    )
    assert (code, err) == (0, "")
    plan = json.loads(out)["plan"]
    assert plan["kvSlotsPerDecoder"] == 280_000 // (4_000 + 600)  # inline kvCapacityTokens wins
    assert "from ConfigMap qwen3-8b-h100-profile" in plan["explanation"][0]


def test_render_prints_the_operator_objects(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "render", POOL)
    assert (code, err) == (0, "")
    objects = list(yaml.safe_load_all(out))
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert ("Deployment", "agents-prefiller") in kinds and ("Deployment", "agents-decoder") in kinds
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects if o["kind"] == "Deployment"}
    assert replicas["agents-prefiller"] == 3 and replicas["agents-decoder"] == 3  # P/D (test_plan_table)


def test_render_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "render", POOL, "-o", "json")
    document = json.loads(out)
    assert code == 0 and document["kind"] == "List" and len(document["items"]) >= 6


def test_crd_command_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "crd")
    assert code == 0
    assert yaml.safe_load(out) == yaml.safe_load(
        (EXAMPLES.parent / "crds" / "coserve.dev_coservepools.yaml").read_text()
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"coserve {__version__}"


@pytest.mark.parametrize("argv", [[], ["plan"], ["render"], ["crd"], ["profile"]])
def test_help_on_every_command(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: coserve") and "--help" in out


def test_no_command_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "usage: coserve" in err


def test_console_script_entry_point_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "coserve", "plan", POOL, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["prefillers"] == 3  # P/D (test_plan_table)
