"""KV offload settings (coserve.kv.config): defaults, and a clear error naming each bad setting."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.kv.config import parse_kv_settings

P = "kv_connector_extra_config"


def test_defaults_are_off() -> None:
    settings = parse_kv_settings({"safepoints": True})
    assert not settings.offload and not settings.handoff


def test_a_full_setting() -> None:
    settings = parse_kv_settings(
        {
            "host_memory_bytes": 1 << 30,
            "class_shares": {"offline": 0.25},
            "handoff_backend": "shm",
            "handoff_path": "/dev/shm/pool-a",  # noqa: S108 - a path string, nothing is written
        }
    )
    assert settings.offload and settings.handoff and settings.class_shares == {"offline": 0.25}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"host_memory_bytes": -1}, f"{P}.host_memory_bytes: must not be negative"),
        ({"host_memory_bytes": "8Gi"}, f"{P}.host_memory_bytes: must be a whole number of bytes"),
        ({"kv_offload_backend": "ssd"}, f"{P}.kv_offload_backend: unknown backend 'ssd'"),
        ({"handoff_backend": "rdma"}, f"{P}.handoff_backend: unknown backend 'rdma'"),
        ({"handoff_path": "relative/dir"}, f"{P}.handoff_path: must be an absolute directory path"),
        ({"class_shares": {"offline": 2}}, f"{P}.class_shares.offline: must be a fraction in [0, 1]"),
        ({"copy_budget_fraction": 0}, f"{P}.copy_budget_fraction: must be in (0, 1]"),
        ({"copy_bandwidth_bytes_per_s": -5}, f"{P}.copy_bandwidth_bytes_per_s: must be positive"),
        ({"host_memroy_bytes": 5}, f"{P}.host_memroy_bytes: unknown setting"),
    ],
)
def test_a_bad_setting_is_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_kv_settings(extra)
    assert str(error.value).startswith(message)
