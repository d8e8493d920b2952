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


def base_check(check_id: str) -> str:
    """The check id without its parameters: `suite::test_name`."""
    return check_id.split("[", 1)[0]


SUITES_PACKAGE = "kvconform.suites"


def suite_name(module_name: str) -> str:
    """`kvconform.suites.<suite>.<module>` -> <suite>; any other module: its last part."""
    parts = module_name.split(".")
    prefix = SUITES_PACKAGE.split(".")
    if parts[: len(prefix)] == prefix and len(parts) > len(prefix) + 1:
        return parts[len(prefix)]
    return parts[-1]


def check_id(module_name: str, test_name: str, params: list[str]) -> str:
    """The one place check ids are made: suite + test name + its non-engine parameters, stable
    across engines, runs, and where the suite is run from (a checkout, site-packages, a
    vendor's module that imports the suite)."""
    return f"{suite_name(module_name)}::{test_name}" + (f"[{'-'.join(params)}]" if params else "")


def _module_of_path(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if "suites" in parts:
        parts = ["kvconform", *parts[parts.index("suites") :]]
    return ".".join(parts)


def from_nodeid(nodeid: str, engines: list[str]) -> tuple[str, str]:
    """(check id, engine) from a node id alone, for records of tests whose worker died before
    reporting them (the item itself is gone)."""
    path, _, rest = nodeid.partition("::")
    name, _, params = rest.partition("[")
    params = params.rstrip("]")
    engine = "-"
    for candidate in sorted(engines, key=len, reverse=True):  # names may hold dashes
        for pattern in (rf"^{re.escape(candidate)}(-|$)", rf"-{re.escape(candidate)}(?=-|$)"):
            if re.search(pattern, params):
                engine, params = candidate, re.sub(pattern, "", params, count=1)
                break
        if engine != "-":
            break
    kept = params.split("-") if params else []
    return check_id(_module_of_path(path), name, kept), engine
