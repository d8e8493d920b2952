"""The known-failures manifest: loading, and matching engine + version glob + check pattern."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform import findings
from kvconform.errors import EngineError, UsageError
from kvconform.findings import Finding, Manifest
from kvconform.results import Inconclusive, Verdict

MANIFEST = """
[[finding]]
engine = "lmcache"
version = "0.5.*"
check = "transfer::test_bytes[mla-4-*]"
measures = { "bytes_sent" = "below" }
measured = "sent 1.0x, expected 4.0x"
summary = "fan-out not counted"
class = "known-upstream"
contract = "the metric counts the bytes sent (conn.py)"
link = "https://example.invalid/issue/1"

[[finding]]
engine = "vllm"
version = "0.11.0"
check = "memory_reclaim::test_churn_returns_to_baseline[?estart]"
measures = ["leftover_processes.final_delta"]
measured = "+2 processes"
summary = "orphans"
class = "unconfirmed"
contract = "not yet read in the engine's source"
"""


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    path = tmp_path / "known.toml"
    path.write_text(MANIFEST)
    return findings.load(str(path))


def test_load(manifest: Manifest) -> None:
    assert [(f.engine, f.version) for f in manifest.entries] == [("lmcache", "0.5.*"), ("vllm", "0.11.0")]
    first = manifest.entries[0]
    assert first.reason() == (
        "known-upstream on lmcache 0.5.*: fan-out not counted (measured: sent 1.0x, expected 4.0x); "
        "fails on bytes_sent (below) [https://example.invalid/issue/1]"
    )
    assert manifest.entries[1].link == ""
    assert not manifest.entries[1].reason().endswith("]")


@pytest.mark.parametrize(
    ("engine", "version", "check", "expected"),
    [
        ("lmcache", "0.5.6", "transfer::test_bytes[mla-4-2]", 0),
        ("lmcache", "0.5.10", "transfer::test_bytes[mla-4-page-64]", 0),
        ("lmcache", "0.6.0", "transfer::test_bytes[mla-4-2]", None),  # another release
        ("vllm", "0.5.6", "transfer::test_bytes[mla-4-2]", None),  # another engine
        ("lmcache", "0.5.6", "transfer::test_bytes[m]", None),  # brackets are literal
        ("lmcache", "0.5.6", "transfer::test_bytes[mla-2-4]", None),
        ("lmcache", "0.5.6", "transfer::test_bytes", None),
        ("vllm", "0.11.0", "memory_reclaim::test_churn_returns_to_baseline[restart]", 1),
        ("vllm", "0.11.0", "memory_reclaim::test_churn_returns_to_baseline[rrestart]", None),
        ("vllm", "0.11.0rc1", "memory_reclaim::test_churn_returns_to_baseline[restart]", None),
    ],
)
def test_match(manifest: Manifest, engine: str, version: str, check: str, expected: int | None) -> None:
    found = manifest.match(engine, version, check)
    assert found is (manifest.entries[expected] if expected is not None else None)


def test_missing_manifest_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"nope\.toml does not exist"):
        findings.load(str(tmp_path / "nope.toml"))


def test_missing_field_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[[finding]]\nengine = "x"\nversion = "1"\ncheck = "c"\nsummary = "s"\nmeasures = ["m"]\n'
        'class = "unconfirmed"\ncontract = "c"\n'
    )
    with pytest.raises(KeyError, match="measured"):
        findings.load(str(path))


def test_shipped_manifests_load() -> None:
    manifest = findings.load(None, engines=["vllm", "lmcache", "sglang", "dynamo", "omlx"])
    assert {f.engine for f in manifest.entries} == {
        "vllm",
        "lmcache",
        "lmcache-redis",
        "sglang",
        "dynamo",
        "omlx",
    }
    assert all(isinstance(f, Finding) and f.engine and f.version and f.check for f in manifest.entries)
    assert all(f.klass in findings.CLASSES and f.contract for f in manifest.entries)
    for defect in (f for f in manifest.entries if f.klass == "defect"):
        assert defect.repro is not None and defect.repro.is_file(), defect.check
        assert defect.report is not None and defect.report.is_file(), defect.check
    assert all(f.link for f in manifest.entries if f.klass == "known-upstream")
    assert all(f.measures or f.crash for f in manifest.entries), "every finding names what fails"
    assert all(set(f.numbers) <= set(f.measure_names()) for f in manifest.entries)
    assert all("::" in f.check for f in manifest.entries), "check patterns are suite::test ids"


# ------------------------------------------------------------------ measures of a finding, judged

MEASURED = """
[[finding]]
engine = "lmcache"
version = "0.5.6"
check = "memory_reclaim::test_churn_returns_to_baseline[unregister]"
measures = { "server_shm_mapped_bytes.leak_slope" = "above", "server_shm_mapped_bytes.final_delta" = "above" }
numbers = { "server_shm_mapped_bytes.leak_slope" = 4194304 }
measured = "+4 MiB per cycle"
summary = "kept mapped"
class = "limitation"
contract = "not promised (docs)"

[[finding]]
engine = "dynamo"
version = "1.6.1"
check = "transfer::test_block_tracker_ownership_and_drain"
measures = ["free_*_status"]
measured = "200"
summary = "double free ok"
class = "unconfirmed"
contract = "unread"
"""


@pytest.fixture
def measured(tmp_path: Path) -> Manifest:
    path = tmp_path / "measured.toml"
    path.write_text(MEASURED)
    return findings.load(str(path))


def leak_verdict(shm_slope: float, rss_slope: float = 0.0, shm_delta: float = 16 * 2**20) -> Verdict:
    v = Verdict("memory_reclaim::test_churn_returns_to_baseline[unregister]", "lmcache")
    v.expect("server_shm_mapped_bytes.final_delta", shm_delta, "<=", 8192)
    v.expect("server_shm_mapped_bytes.leak_slope", shm_slope, "<=", 8192)
    v.expect("server_rss_bytes.leak_slope", rss_slope, "<=", 2 * 2**20)
    return v


def concluded(v: Verdict) -> AssertionError | None:
    try:
        v.conclude()
    except AssertionError as exc:
        return exc
    return None


def test_measures_and_numbers_load(measured: Manifest) -> None:
    leak, tracker = measured.entries
    assert [(m.pattern, m.direction) for m in leak.measures] == [
        ("server_shm_mapped_bytes.leak_slope", "above"),
        ("server_shm_mapped_bytes.final_delta", "above"),
    ]
    assert leak.numbers == {"server_shm_mapped_bytes.leak_slope": 4194304.0}
    assert [(m.pattern, m.direction) for m in tracker.measures] == [("free_*_status", "any")]
    assert "fails on server_shm_mapped_bytes.leak_slope (above)" in leak.reason()


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "names no `measures`"),
        ('measures = { "x" = "sideways" }\n', "one of above, below, any"),
        ('measures = "x"\n', "must be a list"),
        ('measures = ["x"]\nnumbers = { "x" = "many" }\n', "`numbers` must be a table"),
    ],
)
def test_bad_measures_are_errors_naming_the_entry(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[[finding]]\nengine = "x"\nversion = "1"\ncheck = "a::b"\nmeasured = "m"\nsummary = "s"\n'
        'class = "unconfirmed"\ncontract = "c"\n' + text
    )
    with pytest.raises(UsageError, match=r"bad\.toml: finding 1 \(a::b\)") as err:
        findings.load(str(path))
    assert complaint in str(err.value)


def test_exactly_the_finding_measures_violated_is_expected(measured: Manifest) -> None:
    v = leak_verdict(4194304.0)
    judged = findings.judge(measured.entries[0], concluded(v), v)
    assert judged.expected, judged.explanation
    assert judged.violated == (
        "server_shm_mapped_bytes.final_delta (above)",
        "server_shm_mapped_bytes.leak_slope (above)",
    )


def test_another_measure_violated_as_well_is_a_failure(measured: Manifest) -> None:
    v = leak_verdict(4194304.0, rss_slope=9e6)
    judged = findings.judge(measured.entries[0], concluded(v), v)
    assert not judged.expected
    assert "violated beyond the finding: server_rss_bytes.leak_slope (above)" in judged.explanation


def test_a_may_also_symptom_keeps_the_xfail_but_is_never_enough(tmp_path: Path) -> None:
    path = tmp_path / "symptom.toml"
    path.write_text(
        "[[finding]]"
        + MEASURED.split("[[finding]]")[1]
        + 'may_also = { "server_rss_bytes.leak_slope" = "above" }\n'
    )
    entry = findings.load(str(path)).entries[0]
    assert [(m.pattern, m.direction) for m in entry.may_also] == [("server_rss_bytes.leak_slope", "above")]
    with_symptom = leak_verdict(4194304.0, rss_slope=9e6)
    assert findings.judge(entry, concluded(with_symptom), with_symptom).expected
    without = leak_verdict(4194304.0)
    assert findings.judge(entry, concluded(without), without).expected
    symptom_alone = leak_verdict(0.0, rss_slope=9e6, shm_delta=0.0)
    judged = findings.judge(entry, concluded(symptom_alone), symptom_alone)
    assert not judged.expected
    assert "not violated so" in judged.explanation


def test_a_finding_measure_no_longer_violated_is_a_failure(measured: Manifest) -> None:
    v = leak_verdict(4194304.0, shm_delta=0.0)
    judged = findings.judge(measured.entries[0], concluded(v), v)
    assert not judged.expected
    assert "not violated so: server_shm_mapped_bytes.final_delta (above)" in judged.explanation


def test_the_wrong_direction_is_a_failure(measured: Manifest) -> None:
    v = leak_verdict(4194304.0)
    v.measures[0].value = -16 * 2**20  # the same measure, broken the other way (as if with ==)
    v.measures[0].op = "=="
    judged = findings.judge(measured.entries[0], concluded(v), v)
    assert not judged.expected
    assert "server_shm_mapped_bytes.final_delta (below)" in judged.explanation


def test_crash_timeout_or_early_assert_is_a_failure(measured: Manifest) -> None:
    v = leak_verdict(4194304.0)  # the numbers would match, but conclude() never raised
    for exc in (RuntimeError("engine lmcache: server died"), AssertionError("a bare assert"), TimeoutError()):
        judged = findings.judge(measured.entries[0], exc, v)
        assert not judged.expected
        assert "failed otherwise (not on its verdict)" in judged.explanation
        assert type(exc).__name__ in judged.explanation
    assert not findings.judge(measured.entries[0], RuntimeError("x"), None).expected


def test_a_pass_is_xpass_strict(measured: Manifest) -> None:
    judged = findings.judge(measured.entries[0], None, leak_verdict(0.0, shm_delta=0.0))
    assert not judged.expected
    assert "XPASS(strict)" in judged.explanation


def test_globs_and_any_direction(measured: Manifest) -> None:
    v = Verdict("transfer::test_block_tracker_ownership_and_drain", "dynamo")
    v.equal("free_unknown_request_status", 200, 404)
    v.equal("register_status", 201, 201)
    assert findings.judge(measured.entries[1], concluded(v), v).expected
    v2 = Verdict("transfer::test_block_tracker_ownership_and_drain", "dynamo")
    v2.equal("register_status", 500, 201)
    assert not findings.judge(measured.entries[1], concluded(v2), v2).expected


def test_inconclusive_is_not_the_finding(measured: Manifest) -> None:
    v = Verdict("memory_reclaim::test_churn_returns_to_baseline[unregister]", "lmcache")
    v.expect_banded("server_rss_bytes.leak_slope", 2.6e6, (4096, 7.6e6), "<=", 2 * 2**20)
    exc = concluded(v)
    assert isinstance(exc, Inconclusive)
    assert not findings.judge(measured.entries[0], exc, v).expected


# ------------------------------------------------------------------ classes


def _one(tmp_path: Path, fields: str) -> Path:
    path = tmp_path / "classed.toml"
    path.write_text(
        '[[finding]]\nengine = "x"\nversion = "1"\ncheck = "a::b"\nmeasured = "m"\nsummary = "s"\n'
        'measures = ["m"]\n' + fields
    )
    return path


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ("", "`class` is None; want one of defect, limitation, known-upstream, unconfirmed"),
        ('class = "bug"\n', "`class` is 'bug'"),
        ('class = "limitation"\n', "a limitation needs `contract`"),
        ('class = "known-upstream"\ncontract = "c"\n', "needs `link`"),
        ('class = "defect"\ncontract = "c"\n', "`repro` (an existing file beside the manifest; got None)"),
        ('class = "defect"\ncontract = "c"\nrepro = "r.py"\nreport = "r.md"\n', "got "),
    ],
)
def test_a_class_needs_what_a_maintainer_needs(tmp_path: Path, fields: str, complaint: str) -> None:
    with pytest.raises(UsageError, match=r"classed\.toml: finding 1 \(a::b\)") as err:
        findings.load(str(_one(tmp_path, fields)))
    assert complaint in str(err.value)


def test_a_defect_names_its_repro_and_report_beside_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "findings").mkdir()
    (tmp_path / "findings" / "leak.py").write_text("raise SystemExit(1)\n")
    (tmp_path / "findings" / "leak.md").write_text("# leak\n")
    path = _one(
        tmp_path,
        'class = "defect"\ncontract = "c"\nrepro = "findings/leak.py"\nreport = "findings/leak.md"\n',
    )
    (entry,) = findings.load(str(path)).entries
    assert (entry.klass, entry.name, entry.repro, entry.report) == (
        "defect",
        "leak",
        tmp_path / "findings" / "leak.py",
        tmp_path / "findings" / "leak.md",
    )
    assert entry.reason().startswith("defect on x 1: s")


CRASH = """
[[finding]]
engine = "x"
version = "1"
check = "a::b"
crash = "died unexpectedly (exit code: -4)"
cpu_flag = "{flag}"
measured = "m"
summary = "s"
class = "unconfirmed"
contract = "c"
"""


def _crash(tmp_path: Path, flag: str) -> Manifest:
    path = tmp_path / "crash.toml"
    path.write_text(CRASH.format(flag=flag))
    return findings.load(str(path))


def test_a_crash_finding_holds_only_for_its_engine_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(findings, "cpu_flags", lambda: frozenset({"amx_tile"}))
    entry = _crash(tmp_path, "amx_tile").match("x", "1", "a::b")
    assert entry is not None and entry.measures == ()
    died = EngineError("x", "HTTP 500", "Worker proc died unexpectedly (exit code: -4), shutting down")
    assert findings.judge(entry, died, None).expected
    other = findings.judge(entry, EngineError("x", "HTTP 500", "out of memory"), None)
    assert not other.expected and "died unexpectedly" in other.explanation
    assert not findings.judge(entry, AssertionError("died unexpectedly (exit code: -4)"), None).expected
    assert "XPASS(strict)" in findings.judge(entry, None, None).explanation


def test_a_cpu_flag_finding_does_not_apply_on_other_hosts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(findings, "cpu_flags", lambda: frozenset({"avx2"}))
    assert _crash(tmp_path, "amx_tile").match("x", "1", "a::b") is None


def test_crash_and_measures_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "crash.toml"
    path.write_text(CRASH.format(flag="") + 'measures = ["m"]\n')
    with pytest.raises(UsageError, match="names both `crash` and `measures`"):
        findings.load(str(path))
