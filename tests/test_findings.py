"""The known-failures manifest: loading, and matching engine + version glob + check pattern."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform import findings
from kvconform.errors import UsageError
from kvconform.findings import Finding, Manifest

MANIFEST = """
[[finding]]
engine = "lmcache"
version = "0.5.*"
check = "transfer::test_bytes[mla-4-*]"
measured = "sent 1.0x, expected 4.0x"
summary = "fan-out not counted"
link = "https://example.invalid/issue/1"

[[finding]]
engine = "vllm"
version = "0.11.0"
check = "memory_reclaim::test_churn_returns_to_baseline[?estart]"
measured = "+2 processes"
summary = "orphans"
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
        "finding on lmcache 0.5.*: fan-out not counted (measured: sent 1.0x, expected 4.0x) "
        "[https://example.invalid/issue/1]"
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
    path.write_text('[[finding]]\nengine = "x"\nversion = "1"\ncheck = "c"\nsummary = "s"\n')
    with pytest.raises(KeyError, match="measured"):
        findings.load(str(path))


def test_shipped_manifests_load() -> None:
    manifest = findings.load(None, engines=["vllm", "lmcache", "sglang", "dynamo"])
    assert {f.engine for f in manifest.entries} == {"lmcache", "sglang", "dynamo"}
    assert all(isinstance(f, Finding) and f.engine and f.version and f.check for f in manifest.entries)
    assert all("::" in f.check for f in manifest.entries), "check patterns are suite::test ids"
