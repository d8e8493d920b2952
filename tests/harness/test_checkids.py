"""Check-id patterns: `*` and `?` are the only wildcards; brackets and the rest are literal."""

from __future__ import annotations

import pytest

from kvconform.checkids import matches, matches_any


@pytest.mark.parametrize(
    ("check", "pattern", "expected"),
    [
        ("transfer::test_x[mla-4-2]", "transfer::test_x[mla-4-*]", True),
        ("transfer::test_x[m]", "transfer::test_x[mla-4-*]", False),  # not a character class
        ("transfer::test_x[a]", "transfer::test_x[abc]", False),
        ("transfer::test_x[abc]", "transfer::test_x[abc]", True),
        ("transfer::test_x[mla-4-2]", "transfer::*", True),
        ("transfer::test_x", "*::test_x", True),
        ("prefix_reuse::test_x", "*::test_x[*]", False),
        ("a::test_x[16]", "a::test_x[1?]", True),
        ("a::test_x[160]", "a::test_x[1?]", False),  # anchored at the end
        ("xa::test", "a::test", False),  # anchored at the start
        ("a::test", "a::test*", True),  # * matches nothing too
        ("a::test.x+(1)", "a::test.x+(1)", True),  # regex characters are literal
        ("a::testXx+(1)", "a::test.x+(1)", False),
    ],
)
def test_matches(check: str, pattern: str, expected: bool) -> None:
    assert matches(check, pattern) is expected


def test_matches_any() -> None:
    assert matches_any("t::a[1]", ["t::b", "t::a[?]"])
    assert not matches_any("t::a[1]", ("t::b", "u::*"))
    assert not matches_any("t::a[1]", [])
