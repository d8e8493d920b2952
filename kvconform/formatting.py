"""How values and text appear in the tables the suite writes (markdown and terminal): one
place, so a number reads the same in the report, the gate, the dashboard and bisect."""

from __future__ import annotations

from typing import Any


def md_cell(text: Any) -> str:
    """Text safe inside one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def first_line(text: str, limit: int = 160) -> str:
    """A message's first non-blank line, cut to `limit` characters."""
    line = ((text or "").strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def value_text(value: Any, none: str = "None", max_len: int | None = None) -> str:
    """A measured value: floats to 6 significant digits, None as `none`, long text cut."""
    if value is None:
        return none
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if max_len is not None and isinstance(value, str) and len(text) > max_len:
        return text[: max_len - 3] + "..."
    return text
