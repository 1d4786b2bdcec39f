"""A stock baseline engine carries no coserve code: the benchmarks compare against vLLM itself."""

from __future__ import annotations

from pathlib import Path

from coserve.engine.launch import EngineServer, EngineSettings


def test_stock_engine_loads_no_plugin_and_names_no_coserve_class(tmp_path: Path) -> None:
    server = EngineServer(EngineSettings(model=tmp_path / "model", workdir=tmp_path, coserve=False))
    command = " ".join(server.command())
    env = server.environment(tmp_path / "engine.json")
    assert "coserve" not in command.replace(str(tmp_path), "")
    assert "--kv-transfer-config" not in command and "--middleware" not in command
    assert env["VLLM_PLUGINS"] == ""  # vLLM splits it to [""]: no entry point matches
    assert "COSERVE_CONFIG" not in env


def test_coserve_engine_gets_its_config_and_plugins(tmp_path: Path) -> None:
    server = EngineServer(EngineSettings(model=tmp_path / "model", workdir=tmp_path))
    env = server.environment(tmp_path / "engine.json")
    assert env["COSERVE_CONFIG"] == str(tmp_path / "engine.json")
    assert "VLLM_PLUGINS" not in env or "coserve" in env["VLLM_PLUGINS"].split(",")
    assert "coserve.engine.scheduler.TDGScheduler" in server.command()
