"""Engine adapters. A new engine = one module here + its capability set; no suite edits."""

from __future__ import annotations

import importlib

from kvconform.errors import UsageError

# name -> "module:class"; modules are imported only when their engine is selected.
ADAPTERS: dict[str, str] = {
    "reference": "adapters.reference:ReferenceAdapter",
    "vllm": "adapters.vllm:VllmAdapter",
    "lmcache": "adapters.lmcache:LmcacheAdapter",
    "sglang": "adapters.sglang:SglangAdapter",
    "dynamo": "adapters.dynamo:DynamoAdapter",
    "trtllm": "adapters.trtllm:TrtllmAdapter",
    "omlx": "adapters.omlx:OmlxAdapter",
}


def adapter_class(name: str) -> type:
    target = ADAPTERS.get(name)
    if target is None:
        raise UsageError(f"unknown engine {name!r} (known: {', '.join(ADAPTERS)})")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"engine {name!r}: adapter module {module_name} is missing ({exc})") from None
    return getattr(module, class_name)
