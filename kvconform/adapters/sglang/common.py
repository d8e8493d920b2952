"""What the two SGLang adapters share: the model shape both run and strict field reading.

`sglang` (adapter.py, in-process) and `sglang-server` (kvconform.adapters.sglang_server) are two
adapters; neither subclasses the other. Both import this module only.
"""

from __future__ import annotations

from typing import Any

from kvconform.contract import ModelShape

# Llama-shaped: 2 layers, 2 KV heads of 64, bf16 (the server's tiny model has 2 attention heads).
MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)


def int_field(data: Any, key: str, where: str) -> int:
    """data[key] as an int; ValueError naming `where` when it is missing or not an integer."""
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} is {value!r}, not an integer")
    return value
