"""The release-history corpus: it parses, names real checks and measures, and is judged right."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from kvconform import bisect, registry
from kvconform.checkids import base_check
from kvconform.errors import UsageError
from kvconform.gate import Results
from kvconform.history import corpus, table
from kvconform.history.runner import judge_side
from kvconform.history.verdict import Verdict
from kvconform.records import CheckResult
from tests.paths import REPO

SUITES = REPO / "kvconform" / "suites"


def _suite_names() -> tuple[set[str], set[str]]:
    """(suite::test function, every string literal) of the suites' sources."""
    tests, strings = set(), set()
    for path in SUITES.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                tests.add(f"{path.parent.name}::{node.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return tests, strings


def test_corpus_names_engines_checks_and_measures_that_exist() -> None:
    defects = corpus.load()
    assert defects
    tests, strings = _suite_names()
    for d in defects:
        assert d.engine in registry.names(), d.id
        if d.runnable:
            assert base_check(d.check) in tests, (d.id, d.check)
            assert d.measure in strings, (d.id, d.measure)
            assert bisect._vkey(d.bad) < bisect._vkey(d.fixed), d.id


def test_corpus_refuses_an_entry_without_what_it_needs(tmp_path: Path) -> None:
    path = tmp_path / "defects.toml"
    path.write_text('[[defect]]\nid = "x"\nengine = "vllm"\nupstream = "u"\ntitle = "t"\nevidence = "e"\n')
    with pytest.raises(UsageError, match="missing bad, fixed, check, measure, config"):
        corpus.load(path)
    path.write_text(path.read_text() + 'unreachable = "needs a GPU"\n')
    assert not corpus.load(path)[0].runnable


DEFECT = corpus.Defect(
    "e-1", "fake", "https://x", "bug", "diff", "1.0", "1.1", "suite::test_x[*]", "leaked", "c"
)


def _step(version: str, value: int | None, ok: bool | None) -> bisect.Step:
    measures = [] if value is None else [{"name": "leaked", "value": value, "op": "==", "bound": 0, "ok": ok}]
    rec = {"check": "suite::test_x[a]", "engine": "fake", "outcome": "passed" if ok else "failed"}
    rec["measures"] = measures
    return bisect.Step(
        version, results=Results(Path("."), {}, {("fake", "suite::test_x[a]"): CheckResult.from_dict(rec)})
    )


@pytest.mark.parametrize(
    ("bad", "fixed", "status"),
    [
        ((3, False), (0, True), "caught"),
        ((0, True), (0, True), "missed"),
        ((3, False), (3, False), "fixed fails"),
        ((None, None), (0, True), "not judged"),
    ],
)
def test_verdict_needs_the_bad_release_violated_and_the_fixed_one_held(bad, fixed, status) -> None:
    verdict = Verdict(
        DEFECT, judge_side(DEFECT, _step("1.0", *bad)), judge_side(DEFECT, _step("1.1", *fixed))
    )
    assert verdict.status == status


def test_a_release_that_did_not_build_is_not_judged() -> None:
    side = judge_side(DEFECT, bisect.Step("1.0", error="environment vllm-1.0 did not build: no wheel"))
    assert side.held is None and "did not build" in side.why


def test_table_counts_caught_of_tried_and_lists_the_unreachable(tmp_path: Path) -> None:
    unreachable = corpus.Defect("u-1", "fake", "https://u", "gpu bug", "diff", unreachable="CUDA only")
    verdict = Verdict(
        DEFECT, judge_side(DEFECT, _step("1.0", 3, False)), judge_side(DEFECT, _step("1.1", 0, True))
    )
    rows = table.rows([verdict], [DEFECT, unreachable], previous={})
    assert table.recall_line(rows).startswith("caught 1 of 1 shipped bugs tried (1 engines: fake)")
    out = tmp_path / "history.md"
    table.write(rows, out)
    text = out.read_text()
    assert "**caught**" in text and "1.0: 3 (VIOLATED)" in text and "CUDA only" in text
    assert table.read(out)["e-1"]["status"] == "caught"


def test_bisect_takes_engine_check_and_releases_from_a_defect() -> None:
    d = next(d for d in corpus.load() if d.runnable)
    args = argparse.Namespace(defect=d.id, engine=None, check=[], versions=None)
    bisect._apply_defect(args)
    assert (args.engine, args.check, args.versions) == (d.engine, [d.check], f"{d.bad}..{d.fixed}")
