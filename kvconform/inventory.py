"""The engine x capability inventory: what each engine has at its pinned release, cited.

Each adapter package may ship an `inventory.toml` with one table per engine name it registers
and one cell per capability (kvconform.contract.capabilities). A cell's status says why a check
requiring that capability runs or not on that engine, so an empty dashboard cell says which of
three things it is:

- has: the adapter declares the capability; the checks that require it judge it;
- lacks: the engine has no such feature at that release (the source says where);
- needs_gpu: the engine has it only in a GPU build, so it cannot run on a CPU machine;
- elsewhere: this configuration of the engine does not run the feature, another one of the
  same release (for a stack, of the part that has it) does and judges it (`judged_by` names
  it: SGLang's scheduler counters are judged on its server, not on the in-process RadixCache;
  the LMCache server's L2 on lmcache, not inside vllm-lmcache);
- not_implemented: the engine has it and the adapter does not reach it yet.

    kvconform inventory [--out docs/inventory.md]

writes the table (engines x capabilities, and the checks that judge each capability).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvconform import registry
from kvconform.contract.capabilities import Capability
from kvconform.errors import UsageError
from kvconform.formatting import md_cell

FILE_NAME = "inventory.toml"
HAS, LACKS, NEEDS_GPU, NOT_IMPLEMENTED = "has", "lacks", "needs_gpu", "not_implemented"
ELSEWHERE = "elsewhere"
STATUSES = (HAS, LACKS, NEEDS_GPU, ELSEWHERE, NOT_IMPLEMENTED)
SUITES = Path(__file__).parent / "suites"


@dataclass(frozen=True)
class Cell:
    capability: Capability
    status: str
    source: str
    note: str = ""
    judged_by: str = ""  # ELSEWHERE: the engine (configuration) whose checks judge it


@dataclass(frozen=True)
class EngineInventory:
    engine: str
    release: str
    machine: str  # "cpu": runs here; "gpu": only on a GPU machine
    cells: dict[Capability, Cell]

    def status(self, capability: Capability) -> str:
        cell = self.cells.get(capability)
        return cell.status if cell else NOT_IMPLEMENTED


def load(engine: str) -> EngineInventory | None:
    """The engine's inventory from its adapter package (None where the package ships none)."""
    folder = registry.package_resources(engine)
    if folder is None or not folder.joinpath(FILE_NAME).is_file():
        return None
    table = tomllib.loads(folder.joinpath(FILE_NAME).read_text()).get(engine)
    if table is None:
        return None
    return parse(engine, table)


def parse(engine: str, table: dict) -> EngineInventory:
    cells: dict[Capability, Cell] = {}
    for key, value in table.items():
        if not isinstance(value, dict):
            continue
        try:
            capability = Capability(key)
        except ValueError:
            raise UsageError(f"inventory of {engine}: {key!r} is no capability") from None
        status = value.get("status")
        if status not in STATUSES:
            raise UsageError(f"inventory of {engine}: {key} has status {status!r}, want one of {STATUSES}")
        if not value.get("source"):
            raise UsageError(f"inventory of {engine}: {key} cites no source")
        if status != HAS and not value.get("note"):
            raise UsageError(f"inventory of {engine}: {key} ({status}) says nothing in its note")
        judged_by = value.get("judged_by", "")
        if (status == ELSEWHERE) != bool(judged_by):
            raise UsageError(f"inventory of {engine}: {key} names judged_by if and only if it is {ELSEWHERE}")
        cells[capability] = Cell(capability, status, value["source"], value.get("note", ""), judged_by)
    return EngineInventory(engine, table.get("release", "?"), table.get("machine", "cpu"), cells)


def skip_kind(inventory: EngineInventory | None, missing: Iterable[Capability]) -> str:
    """Which kind of empty cell a skip for these missing capabilities is: the engine lacks one
    (nothing to judge), one needs a GPU, or one is not implemented yet."""
    statuses = {inventory.status(c) if inventory else NOT_IMPLEMENTED for c in missing}
    for kind in (LACKS, NEEDS_GPU, NOT_IMPLEMENTED, ELSEWHERE):
        if kind in statuses:
            return kind
    return HAS  # every missing capability is declared: missing in this mode only (attach)


def judging_checks(suites: Path = SUITES) -> dict[Capability, list[str]]:
    """Per capability, the check ids whose `requires` marker (on the check or its module) names
    it, or that ask `has()` for it (an optional measure judged where the engine has it)."""
    out: dict[Capability, list[str]] = {c: [] for c in Capability}
    helpers = {  # suite helpers that ask has() on a check's behalf (e.g. answers.judge_same_answer)
        fn.name: _asked(fn.body)
        for path in sorted(suites.rglob("*.py"))
        if not path.name.startswith("test_")
        for fn in ast.parse(path.read_text()).body
        if isinstance(fn, ast.FunctionDef)
    }
    for path in sorted(suites.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_caps = _required(n for n in tree.body if isinstance(n, ast.Assign))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                check = f"{path.parent.name}::{node.name}"
                used = module_caps | _required(node.decorator_list) | _asked(node.body)
                for call in ast.walk(node):
                    if isinstance(call, ast.Call):
                        used |= helpers.get(getattr(call.func, "id", getattr(call.func, "attr", "")), set())
                for capability in sorted(used):
                    out[capability].append(check)
    return out


def _named_in_calls(nodes: Iterable[ast.AST], function: str) -> set[Capability]:
    """Capabilities passed as `C.X` to calls of `function` (a marker's `.requires`, `has`)."""
    found: set[Capability] = set()
    for node in nodes:
        for call in ast.walk(node):
            func = getattr(call, "func", None)
            if isinstance(call, ast.Call) and function in (
                getattr(func, "attr", ""),
                getattr(func, "id", ""),
            ):
                found |= {
                    Capability[a.attr]
                    for a in call.args
                    if isinstance(a, ast.Attribute) and a.attr in Capability.__members__
                }
    return found


def _required(nodes: Iterable[ast.AST]) -> set[Capability]:
    return _named_in_calls(nodes, "requires")


def _asked(nodes: Iterable[ast.AST]) -> set[Capability]:
    return _named_in_calls(nodes, "has")


_MARK = {
    HAS: "✅ has",
    LACKS: "— lacks",
    NEEDS_GPU: "GPU",
    ELSEWHERE: "↪ elsewhere",
    NOT_IMPLEMENTED: "❗ not implemented",
}


def _mark(cell: Cell | None) -> str:
    if cell is None:
        return _MARK[NOT_IMPLEMENTED]
    return f"↪ {cell.judged_by}" if cell.status == ELSEWHERE else _MARK[cell.status]


def markdown(engines: list[str]) -> str:
    inventories = [inv for inv in (load(e) for e in engines) if inv is not None]
    checks = judging_checks()
    lines = [
        "# Engine x capability inventory",
        "",
        "Written by `kvconform inventory` from each adapter's `inventory.toml` "
        "(tests/harness/test_inventory.py keeps it in agreement with the adapters' declared capabilities). "
        "A cell says whether the engine has the feature a check needs at the release named: "
        "**has** (the checks below judge it), **lacks** (the engine has no such feature; cited), "
        "**GPU** (only in a GPU build: cannot run on a CPU machine), "
        "**↪ elsewhere** (this configuration does not run the feature; the engine named, another "
        "configuration of the same release (for a stack, of its part that has the feature), judges it), "
        "**not implemented** (the engine has it, the adapter does not reach it yet).",
        "",
        "## Counts",
        "",
        "| engine | release | " + " | ".join(_MARK[s] for s in STATUSES) + " |",
        "|---|---|" + "---|" * len(STATUSES),
    ]
    for inv in inventories:
        n = {s: sum(1 for c in inv.cells.values() if c.status == s) for s in STATUSES}
        machine = " (GPU only)" if inv.machine == "gpu" else ""
        lines.append(
            f"| {inv.engine}{machine} | {inv.release} | " + " | ".join(str(n[s]) for s in STATUSES) + " |"
        )
    lines += [
        "",
        "## Table",
        "",
        "| capability | checks | " + " | ".join(i.engine for i in inventories) + " |",
    ]
    lines.append("|---|---|" + "---|" * len(inventories))
    for capability in Capability:
        judged = len(checks[capability])
        row = [_mark(i.cells.get(capability)) for i in inventories]
        lines.append(f"| `{capability}` | {judged} | " + " | ".join(row) + " |")
    lines += ["", "## Cells, cited", ""]
    for inv in inventories:
        lines += [f"### {inv.engine} ({inv.release})", ""]
        lines += ["| capability | status | source | note |", "|---|---|---|---|"]
        for capability in Capability:
            cell = inv.cells.get(capability)
            if cell is None:
                lines.append(f"| `{capability}` | {_MARK[NOT_IMPLEMENTED]} | (no cell) | |")
                continue
            lines.append(
                f"| `{capability}` | {_mark(cell)} | {md_cell(cell.source)} | {md_cell(cell.note)} |"
            )
        lines.append("")
    lines += ["## Checks per capability", ""]
    for capability in Capability:
        names = ", ".join(f"`{c}`" for c in checks[capability]) or "(none)"
        lines.append(f"- `{capability}`: {names}")
    return "\n".join(lines) + "\n"


def write(out: Path, engines: list[str] | None = None) -> Path:
    names = engines or [n for n in registry.names() if n != "reference"]
    out.write_text(markdown(names))
    return out
