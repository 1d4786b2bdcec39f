"""``coserve up`` runs each engine from the operator's own rendering, so a local pool and a cluster pool cannot drift.

No engine is started here (``coserve up --once`` in ``make demo`` starts them): what is checked is the command
line and environment ``RenderedServer`` would start, against the container the operator renders for the same
role on nodes without GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coserve.api import parse_pool
from coserve.engine.launch import EngineSettings
from coserve.engine.rendered import connector_names, engine_container, flag_values, without_gpus
from coserve.local import RenderedServer, _cpu_rendering
from coserve.operator.resources import build_children
from coserve.provisioning import plan_for

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"handoff_backend": "shm", "handoff_path": "/dev/shm/coserve-test"}  # noqa: S108 - a path, not opened


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_coserve_up_launches_the_operators_cpu_rendering_of_each_engine(role: str, tmp_path: Path) -> None:
    document = yaml.safe_load((ROOT / "examples" / "pool.yaml").read_text())
    pool = parse_pool(document)
    plan = plan_for(pool.spec)
    rendered = engine_container(build_children(parse_pool(without_gpus(document)), plan), role)  # type: ignore[arg-type]
    server = RenderedServer(
        EngineSettings(model=tmp_path / "model", workdir=tmp_path),
        engine_container(_cpu_rendering(pool, plan), role),  # type: ignore[arg-type]
        tmp_path / "etc-coserve",
        LOCAL,
    )
    launched = dict(flag_values(server.command()[3:]))
    for flag, value in flag_values(rendered["args"]):
        if flag in ("--model", "--port", "--kv-transfer-config"):
            continue
        assert flag in launched and launched[flag] == value, (flag, value, launched.get(flag))
    assert launched["--model"] == str(tmp_path / "model")
    transfer = json.loads(launched["--kv-transfer-config"])
    expected = json.loads(dict(flag_values(rendered["args"]))["--kv-transfer-config"] or "{}")
    assert connector_names(transfer) == connector_names(expected) == ["CoServeConnector"]
    settings = transfer["kv_connector_extra_config"]
    assert settings == {**expected["kv_connector_extra_config"], **LOCAL, "coserve_config": settings["coserve_config"]}
    assert settings["coserve_config"] == str(tmp_path / "etc-coserve" / "engine.json")
    assert transfer["kv_role"] == expected["kv_role"]
    env = server.environment(tmp_path / "unused.json")
    for entry in rendered["env"]:
        if entry["name"] not in ("COSERVE_ROUTER_TOKEN_FILE", "COSERVE_CONFIG") and "value" in entry:
            assert env[entry["name"]] == entry["value"], entry
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
