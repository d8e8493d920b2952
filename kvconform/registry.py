"""Adapters by engine name: the built-ins, the `kvconform.adapters` entry-point group, and
`register()` (SQLAlchemy's dialect registry). Targets are "module:Class" strings, imported only
when their engine is selected, so the harness never imports an adapter itself.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING

from kvconform.errors import UsageError

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

ENTRY_POINT_GROUP = "kvconform.adapters"

BUILTIN: dict[str, str] = {
    "reference": "kvconform.adapters.reference.adapter:ReferenceAdapter",
    "vllm": "kvconform.adapters.vllm.adapter:VllmAdapter",
    "vllm-lmcache": "kvconform.adapters.vllm_lmcache.adapter:VllmLmcacheAdapter",
    "vllm-obj": "kvconform.adapters.vllm_obj.adapter:VllmObjAdapter",
    "lmcache": "kvconform.adapters.lmcache.adapter:LmcacheAdapter",
    "lmcache-redis": "kvconform.adapters.lmcache.adapter:LmcacheRedisAdapter",
    "sglang": "kvconform.adapters.sglang.adapter:SglangAdapter",
    "sglang-server": "kvconform.adapters.sglang_server.adapter:SglangServerAdapter",
    "dynamo": "kvconform.adapters.dynamo.adapter:DynamoAdapter",
    "dynamo-vllm": "kvconform.adapters.dynamo_vllm.adapter:DynamoVllmAdapter",
    "trtllm": "kvconform.adapters.trtllm.adapter:TrtllmAdapter",
    "omlx": "kvconform.adapters.omlx.adapter:OmlxAdapter",
}

_registered: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Make `name` an engine served by the adapter class at `target` ("module:Class")."""
    _check_target(name, target)
    _registered[name] = target


def unregister(name: str) -> None:
    _registered.pop(name, None)


def adapters() -> dict[str, str]:
    """Every known engine name -> target; later sources override earlier ones
    (built-ins < entry points < register())."""
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    found.update(_registered)
    return found


def names() -> list[str]:
    return list(adapters())


def target_of(name: str) -> str:
    target = adapters().get(name)
    if target is None:
        raise UsageError(
            f"unknown engine {name!r} (known: {', '.join(adapters())}; "
            "add one with --adapter module:Class or the kvconform.adapters entry point)"
        )
    return target


def adapter_class(name: str) -> type[EngineAdapter]:
    return load_target(name, target_of(name))


def load_target(name: str, target: str) -> type[EngineAdapter]:
    module_name, class_name = _check_target(name, target)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"engine {name!r}: adapter module {module_name} is missing ({exc})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UsageError(f"engine {name!r}: {module_name} has no adapter class {class_name}")
    from kvconform.contract.requirements import describe_missing  # with the adapter: the contract

    refused = describe_missing(name, cls)
    if refused:
        raise UsageError(refused)
    return cls


def package_resources(name: str) -> Traversable | None:
    """The folder of an engine's adapter package (its envs/, drivers/, known-failures.toml),
    found without importing the adapter module itself."""
    module_name = target_of(name).partition(":")[0]
    package = module_name.rpartition(".")[0] or module_name
    try:
        return files(package)
    except ModuleNotFoundError:
        return None


def _check_target(name: str, target: str) -> tuple[str, str]:
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise UsageError(f"engine {name!r}: adapter target {target!r} is not 'module:Class'")
    return module_name, class_name
