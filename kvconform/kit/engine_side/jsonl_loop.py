"""JSON-lines request loop shared by every driver.

Drivers run inside an engine's own environment (its interpreter, its torch), so this module
uses the standard library only and never imports kvconform.

Protocol (one JSON object per line):
  driver -> adapter, once at start:  {"ready": true, "engine": NAME, "version": VERSION}
  adapter -> driver:                 {"id": N, "op": NAME, "args": {...}}
  driver -> adapter:                 {"id": N, "ok": true, "result": ...}
                                  or {"id": N, "ok": false, "error": MSG, "traceback": TEXT}
Engine logs go to stderr; stdout carries protocol lines only.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

Handler = Callable[..., Any]


def serve(engine: str, version: str, handlers: dict[str, Handler]) -> None:
    # Engines print to stdout (banners, warnings); keep the protocol channel clean.
    protocol_out = sys.stdout
    sys.stdout = sys.stderr
    _emit(protocol_out, {"ready": True, "engine": engine, "version": version})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        req_id = request.get("id")
        op = request.get("op", "")
        if op == "shutdown":
            _emit(protocol_out, {"id": req_id, "ok": True, "result": None})
            return
        handler = handlers.get(op)
        try:
            if handler is None:
                raise KeyError(f"unknown op {op!r}; known: {sorted(handlers)}")
            result = handler(**request.get("args", {}))
            _emit(protocol_out, {"id": req_id, "ok": True, "result": result})
        except Exception as exc:
            _emit(
                protocol_out,
                {
                    "id": req_id,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                },
            )


def _emit(stream: Any, obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj, default=_jsonable) + "\n")
    stream.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
