"""Check ids and patterns over them.

A check id is `suite::test_name[params]`. Patterns use `*` and `?` as wildcards only;
brackets are literal, so `transfer::test_x[mla-4-*]` means what it says (fnmatch would read
`[mla-4-*]` as a character class).
"""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=512)
def _compile(pattern: str) -> re.Pattern[str]:
    parts = (".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.compile("".join(parts) + r"\Z")


def matches(check_id: str, pattern: str) -> bool:
    return _compile(pattern).match(check_id) is not None


def matches_any(check_id: str, patterns: list[str] | tuple[str, ...]) -> bool:
    return any(matches(check_id, p) for p in patterns)


def from_nodeid(nodeid: str, engines: list[str]) -> tuple[str, str]:
    """(check id, engine) from a node id alone, for records of tests whose worker died before
    reporting them (the item itself is gone). Mirrors plugin.check_id for our suites' ids."""
    path, _, rest = nodeid.partition("::")
    parts = path.split("/")
    suite = parts[parts.index("suites") + 1] if "suites" in parts else parts[-1].removesuffix(".py")
    name, _, params = rest.partition("[")
    tokens = params.rstrip("]").split("-") if params else []
    engine = next((t for t in tokens if t in engines), "-")
    kept = [t for t in tokens if t != engine]
    return f"{suite}::{name}" + (f"[{'-'.join(kept)}]" if kept else ""), engine
