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
