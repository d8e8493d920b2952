"""Allure attachments: measurements, curves (matplotlib PNG), log tails; environment, categories.

Attachments are no-ops when allure-pytest is not active (no --alluredir).
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import allure

from kvconform.checkids import base_check
from kvconform.errors import UsageError

if TYPE_CHECKING:
    import pytest

    from kvconform.contract import EngineAdapter
    from kvconform.records import CheckResult, Run
    from kvconform.results import Verdict

_environment: dict[str, str] = {}

# organise_results() turns a strict xfail into a failure whose message starts "Known finding
# (<class>) on";
# pytest's own xfail message starts "XFAIL <class> on" (findings.Finding.reason). Findings come
# first, by class: a reviewer reads the defects before anything else.
FINDING_CATEGORIES = {
    "defect": "Finding: defect (the engine breaks its own contract; standalone repro)",
    "known-upstream": "Finding: known upstream (an open issue or PR)",
    "unconfirmed": "Finding: unconfirmed (not yet shown to be the engine's)",
    "limitation": "Finding: limitation (the engine does not promise it; the option that closes it)",
    "unclassified": "Finding: unclassified (a manifest entry from before classes)",
}
CATEGORIES = [
    *(
        {
            "name": name,
            "matchedStatuses": ["failed", "broken", "skipped"],
            "messageRegex": rf"(?s)(Known finding \({klass}\) on |XFAIL {klass} on ).*",
        }
        for klass, name in FINDING_CATEGORIES.items()
    ),
    {
        "name": "Engine broke a promise (check failed)",
        "matchedStatuses": ["failed"],
        "messageRegex": r"(?s).*\[[a-z0-9_-]+\] [a-z_]+::.*",
    },
    {
        "name": "Engine crashed, hung or answered garbage",
        "matchedStatuses": ["broken", "failed"],
        "messageRegex": r"(?s).*engine [a-z0-9_-]+: .*",
    },
    {"name": "Suite error", "matchedStatuses": ["broken"]},
]


def environment_property(key: str, value: str) -> None:
    _environment[key] = str(value)


def attach_verdict(verdict: Verdict) -> None:
    if verdict.measures:
        allure.attach(
            json.dumps(verdict.as_dict(), indent=1),
            name="measurements.json",
            attachment_type=allure.attachment_type.JSON,
        )
        allure.attach(verdict.summary(), name="measurements", attachment_type=allure.attachment_type.TEXT)
    for name, points in verdict.series.items():
        if points:
            allure.attach(
                plot_series(name, points), name=f"{name}.png", attachment_type=allure.attachment_type.PNG
            )
            allure.attach(
                "t,value\n" + "\n".join(f"{t:.4f},{v}" for t, v in points),
                name=f"{name}.csv",
                attachment_type=allure.attachment_type.CSV,
            )


def attach_failure_context(item: pytest.Item, adapter: EngineAdapter | None) -> None:
    if adapter is None:
        return
    try:
        logs = adapter.logs()
    except Exception as exc:  # context is best effort; the failure itself is already reported
        logs = {"adapter": f"could not read logs: {exc}"}
    for name, tail in logs.items():
        if tail:
            allure.attach(tail, name=f"log tail: {name}", attachment_type=allure.attachment_type.TEXT)
    events = adapter.ledger.events()[-200:]
    if events:
        allure.attach(
            "\n".join(json.dumps(e.as_dict()) for e in events),
            name="KV event ledger (last 200)",
            attachment_type=allure.attachment_type.TEXT,
        )


def plot_series(title: str, points: list[tuple[float, float]], ylabel: str = "") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, marker="." if len(points) < 60 else None, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel("t (s)" if xs and xs[-1] > len(xs) else "")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_allure_environment(config: pytest.Config, meta: dict[str, Any]) -> None:
    alluredir = config.getoption("--alluredir", default=None)
    if not alluredir:
        return
    out = Path(alluredir)
    out.mkdir(parents=True, exist_ok=True)
    props = dict(_environment)
    props["platform"] = meta.get("platform", "host")
    props["platform.gpu"] = _gpu_description()
    props["platform.python"] = sys.version.split()[0]
    props["platform.os"] = f"{platform.system()} {platform.release()} ({platform.machine()})"
    if meta.get("host"):
        props["platform.host"] = str(meta["host"])
    for engine, version in meta.get("engines", {}).items():
        props[f"engine.{engine}.version"] = version
    for engine, options in meta.get("engine_options", {}).items():
        for key, value in options.items():
            if value:
                shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
                props[f"engine.{engine}.{key}"] = shown
    (out / "environment.properties").write_text(
        "\n".join(f"{k}={v}" for k, v in sorted(props.items())) + "\n"
    )
    (out / "categories.json").write_text(json.dumps(CATEGORIES, indent=1))


def attach_png(name: str, png: bytes) -> None:
    allure.attach(png, name=f"{name}.png", attachment_type=allure.attachment_type.PNG)


def plot_sweep(curves: dict[int, list[tuple[float, float, float]]]) -> bytes:
    """Hit ratio of the shared prefix vs shared fraction, one line per block size; the
    oracle dashed beside each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for block, curve in sorted(curves.items()):
        xs = [c[0] for c in curve]
        (line,) = ax.plot(xs, [c[1] for c in curve], marker="o", label=f"block {block} measured")
        ax.plot(xs, [c[2] for c in curve], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("shared prefix fraction of the prompt")
    ax.set_ylabel("cached tokens / shared tokens")
    ax.set_title("Prefix hits vs block size (dashed: oracle)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _gpu_description() -> str:
    """GPU name(s) and driver from NVML, or why there is none."""
    from kvconform.memory import nvml

    probe = nvml()
    return probe.describe() if probe.available else f"none ({probe.reason})"


# ------------------------------------------------------------------ organising Allure results
#
# allure-pytest labels a result by python package (parentSuite = suites.prefix_reuse, suite =
# test_block_reuse) and writes a strict xfail as "skipped". Before the HTML report is generated,
# a copy of the results is organised for a reviewer from results.json (the records are the
# truth: outcome, measures, finding):
#   labels      epic = the promise, feature = suite, story = check, parentSuite = engine
#   findings    status failed, name "known finding: CHECK — MEASURE = value (expected ...)",
#               label/tag `known finding`, a link to the manifest's upstream URL, description
#               with the finding's summary and numbers
#   new failure tag `new failure`
#   skips       one result per (engine, reason): "engine X lacks Y: K checks"
#   fixtures    named setup/teardown steps instead of `verdict::<lambda>` / `engine::1`
#   dashboard   a global attachment "Conformance dashboard" (the engine x check page)

GROUP_BY = ["epic", "parentSuite"]  # the report tree: promise > engine > check
SKIPS_EPIC = "Capability skips"
FINDING_TAG = "known finding"
NEW_FAILURE_TAG = "new failure"
_ORGANISED_LABELS = {"parentSuite", "suite", "subSuite", "epic", "feature", "story"}

# fixture name -> (setup step, teardown step)
FIXTURE_STEPS = {
    "kvconform_session": ("open the kvconform session", "close the kvconform session"),
    "engine": ("start the engine (once per session)", "stop the engine and its processes"),
    "engine_name": ("select the engine", "-"),
    "other_engines": ("start the other engines of the stack", "-"),
    "verdict": ("open the check's verdict", "verify the verdict was concluded"),
    "prompts": ("make prompts unique to this check", "-"),
    "has": ("read the engine's capabilities", "-"),
}


def _fixture_step(name: str, when: str) -> str:
    fixture = name.split("::", 1)[0]
    setup, teardown = FIXTURE_STEPS.get(fixture, (f"set up {fixture}", f"tear down {fixture}"))
    if when == "before":
        return f"setup: {setup}"
    return f"teardown: {teardown if teardown != '-' else f'release {fixture}'}"


def result_key(nodeid: str) -> tuple[str, str]:
    """(fullName, name) allure-pytest gives the test of `nodeid` (no @allure.title in our suites)."""
    parts = nodeid.split("::")
    if len(parts) < 2:
        parts.append("")
    path, *classes, function = parts
    segments = path.split("/")
    module = segments[-1].rsplit(".", 1)[0]
    package = ".".join(filter(None, [".".join(segments[:-1]), module]))
    cls = ("." + ".".join(classes)) if classes else ""
    return f"{package}{cls}#{function.split('[', 1)[0]}", function


def _label(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


def _md5(*parts: str) -> str:
    return hashlib.md5("\x1f".join(parts).encode()).hexdigest()


def finding_title(record: CheckResult) -> str:
    from kvconform import dashboard

    measures = "; ".join(dashboard.describe_measure(m) for m in record.violated_measures)
    title = f"known finding ({dashboard.finding_class(record)}): {record.check}"
    title += f" — {measures}" if measures else ""
    return title if len(title) <= 240 else title[:237] + "..."


def _finding_description(record: CheckResult, link: str) -> str:
    from kvconform import dashboard

    klass = dashboard.finding_class(record)
    lines = [f"**Known finding ({klass})** on **{record.engine} {record.engine_version}**", ""]
    lines.append(record.finding)
    lines.append("")
    bad = record.violated_measures
    if bad:
        lines.append("Violated now (the finding's measures, with this run's numbers):")
        lines.append("")
        lines += [f"- `{dashboard.describe_measure(m)}`" for m in bad]
        lines.append("")
    if link:
        lines.append(f"Upstream: [{link}]({link})")
    return "\n".join(lines)


def _skip_name(engine: str, reason: str, count: int) -> str:
    from kvconform import dashboard

    match = dashboard._LACKS.match(reason)
    what = f"engine {engine} lacks {match.group('cap')}" if match else reason
    return f"{what}: {count} check{'s' if count != 1 else ''}"


Kills = dict[str, list[tuple[str, list[str]]]]  # check -> [(measure, what violated it)]


def load_kills(path: str | Path) -> Kills:
    """The mutation matrix (tests/system/test_mutation_matrix.py's mutation-matrix.json) by check:
    [(measure, the faults and test doubles seen to violate it)]."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["measures"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"mutation matrix {path}: not readable as mutation-matrix.json ({exc})") from exc
    kills: Kills = {}
    for row in rows:
        kills.setdefault(row["check"], []).append((row["measure"], list(row["killed_by"])))
    return kills


def kills_description(check: str, kills: Kills, title: str | None = None) -> str:
    """What a check's page says about what its measures were seen to fail on, measure by
    measure: the mutation matrix's faults, or `title` over one engine's proof (proof_description)."""
    rows = kills.get(base_check(check))
    if not rows:
        return ""
    title = title or "**Seen to fail** (mutation matrix: each measure and the faults that violated it):"
    lines = [title, ""]
    lines += [f"- `{measure}`: {', '.join(faults) or 'NOT KILLED'}" for measure, faults in rows]
    return "\n".join(lines)


EngineProofs = dict[str, Kills]


def load_engine_proofs(path: str | Path) -> EngineProofs:
    """The per-engine proof table (`kvconform mutants`' mutants.json) as
    {engine: {check: [(measure, what violated it on that engine, or why it is unproven)]}}."""
    from kvconform.mutants.proof import EngineProof

    try:
        data = json.loads(Path(path).read_text())
        proofs: EngineProofs = {}
        for row in data:
            proof = EngineProof(row["engine"], reasons=row.get("unproven_reasons") or {})
            for key, killers in row["measures"].items():
                check, _, measure = key.partition(" :: ")
                shown = list(killers) or [f"unproven on {proof.engine}: {proof.why_unproven(key)}"]
                proofs.setdefault(proof.engine, {}).setdefault(check, []).append((measure, shown))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"proof table {path}: not readable as mutants.json ({exc})") from exc
    return proofs


def proof_description(check: str, engine: str, proofs: EngineProofs) -> str:
    """What a check's page on a real engine says: each measure and what violated it there."""
    title = f"**Seen to fail on {engine}** (`make mutants`: each measure and what violated it there):"
    return kills_description(check, proofs.get(engine, {}), title)


def organise_results(
    src: str | Path,
    dst: str | Path,
    run: Run | None,
    dashboard_html: str | None = None,
    kills: Kills | None = None,
    proofs: EngineProofs | None = None,
) -> dict[str, Any]:
    """Copy the Allure results `src` into `dst`, organised from results.json's `data`, each
    check's page saying which faults its measures were seen to kill (`kills`: load_kills), on
    an engine of the proof table what violated them on that engine (`proofs`: load_engine_proofs).

    Returns {"counts", "headline", "ids": {(engine, check): result uuid}}. Without `data` the
    results are copied as they are (fixture steps still get their names)."""
    from kvconform import dashboard

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    records = run.records if run is not None else ()
    by_key = {result_key(r.nodeid): r for r in records if r.nodeid}
    dropped: set[str] = set()
    ids: dict[tuple[str, str], str] = {}
    skips: dict[tuple[str, str], list[tuple[CheckResult, dict[str, Any]]]] = {}
    for path in sorted(src.iterdir()):
        if not path.is_file():
            continue
        if path.name.endswith("-result.json") or path.name.endswith("-container.json"):
            continue
        shutil.copy2(path, dst / path.name)
    for path in sorted(src.glob("*-result.json")):
        result = json.loads(path.read_text())
        record = by_key.get((result.get("fullName", ""), result.get("name", "")))
        if record is not None:
            if record.outcome == "skipped":
                skips.setdefault((record.engine, dashboard.skip_reason(record)), []).append((record, result))
                dropped.add(result.get("uuid", ""))
                continue
            _organise_one(result, record)
            if proofs and record.engine in proofs:
                seen = proof_description(record.check, record.engine, proofs)
            else:
                seen = kills_description(record.check, kills or {})
            if seen:
                result["description"] = "\n\n".join(p for p in (result.get("description"), seen) if p)
                result.pop("descriptionHtml", None)
            ids[record.key] = result.get("uuid", "")
        (dst / path.name).write_text(json.dumps(result))
    for (engine, reason), members in sorted(skips.items()):
        (dst / f"{uuid.uuid4()}-result.json").write_text(json.dumps(_skip_group(engine, reason, members)))
    for path in sorted(src.glob("*-container.json")):
        container = json.loads(path.read_text())
        children = [c for c in container.get("children", []) if c not in dropped]
        if container.get("children") and not children:
            continue
        container["children"] = children
        for when in ("befores", "afters"):
            kept = []
            for fixture in container.get(when, []):
                if when == "afters" and "stop" not in fixture and "status" not in fixture:
                    continue  # a pytest-internal finalizer allure-pytest wrapped but never ran
                fixture["name"] = _fixture_step(fixture.get("name", "?"), when[:-1])
                kept.append(fixture)
            container[when] = kept
        (dst / path.name).write_text(json.dumps(container))
    c = dashboard.counts(records)
    if dashboard_html is not None:
        attachment = f"{uuid.uuid4()}-attachment.html"
        (dst / attachment).write_text(dashboard_html, encoding="utf-8")
        globals_ = {
            "attachments": [{"name": "Conformance dashboard", "source": attachment, "type": "text/html"}],
            "errors": [],
        }
        (dst / f"{uuid.uuid4()}-globals.json").write_text(json.dumps(globals_))
    _environment_props(dst, c)
    (dst / "categories.json").write_text(json.dumps(CATEGORIES, indent=1))
    return {"counts": c, "headline": dashboard.headline(c), "ids": ids}


def _organise_one(result: dict[str, Any], record: CheckResult) -> None:
    from kvconform import dashboard

    engine, check = record.engine, record.check
    labels = [lab for lab in result.get("labels", []) if lab.get("name") not in _ORGANISED_LABELS]
    labels += [
        _label("epic", dashboard.promise_of(check)),
        _label("feature", dashboard.suite_of(check)),
        _label("story", base_check(check)),
        _label("parentSuite", engine),
        _label("suite", dashboard.suite_of(check)),
        _label("subSuite", base_check(check)),
        _label("engine", engine),
        _label("engine_version", record.engine_version),
    ]
    result["name"] = check
    if dashboard.is_finding(record):
        link = dashboard.finding_link(record.finding)
        result["status"] = "failed"
        result["name"] = finding_title(record)
        details = result.get("statusDetails") or {}
        original = (details.get("message") or "").removeprefix("XFAIL ")
        klass = dashboard.finding_class(record)
        reason = record.finding
        if reason.startswith((f"{klass} on ", "finding on ")):  # findings.Finding.reason's prefix
            reason = reason.split(": ", 1)[1]
        head = f"Known finding ({klass}) on {engine} {record.engine_version}: {reason}"
        details["message"] = head + ("\n\n" + original if original else "")
        result["statusDetails"] = details
        result["description"] = _finding_description(record, link)
        result.pop("descriptionHtml", None)
        labels += [_label("tag", FINDING_TAG), _label("finding", FINDING_TAG), _label("tag", klass)]
        if link:
            result.setdefault("links", []).append({"type": "issue", "name": f"upstream: {link}", "url": link})
    elif dashboard.is_new_failure(record):
        labels.append(_label("tag", NEW_FAILURE_TAG))
        if record.finding:
            labels.append(_label("tag", "finding did not hold"))
    result["labels"] = labels


def _skip_group(
    engine: str, reason: str, members: list[tuple[CheckResult, dict[str, Any]]]
) -> dict[str, Any]:
    checks = sorted(r.check for r, _ in members)
    starts = [res.get("start", 0) for _, res in members]
    stops = [res.get("stop", 0) for _, res in members]
    version = members[0][0].engine_version
    history = _md5("kvconform-skips", engine, reason)
    return {
        "uuid": str(uuid.uuid4()),
        "historyId": history,
        "testCaseId": history,
        "fullName": f"kvconform.capability_skips.{engine}#{reason}",
        "name": _skip_name(engine, reason, len(checks)),
        "status": "skipped",
        "statusDetails": {"message": reason},
        "description": f"Skipped on **{engine} {version}**: {reason}\n\n"
        + "\n".join(f"- `{c}`" for c in checks),
        "start": min(starts or [0]),
        "stop": max(stops or [0]),
        "labels": [
            _label("epic", SKIPS_EPIC),
            _label("feature", "capability skips"),
            _label("story", reason),
            _label("parentSuite", engine),
            _label("engine", engine),
            _label("engine_version", version),
            _label("tag", "capability skip"),
        ],
        "parameters": [{"name": "checks", "value": str(len(checks))}],
        "steps": [],
        "attachments": [],
    }


def _environment_props(dst: Path, c: dict[str, int]) -> None:
    path = dst / "environment.properties"
    props: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                props[key.strip()] = value.strip()
    props["kvconform.findings"] = str(c.get("findings", 0))
    props["kvconform.new_failures"] = str(c.get("new_failures", 0))
    props["kvconform.dashboard"] = "dashboard.html (beside this report; also under Global attachments)"
    path.write_text("\n".join(f"{k}={v}" for k, v in sorted(props.items())) + "\n")


def quality_gate_results(gate: Any, ids: dict[tuple[str, str], str]) -> list[dict[str, Any]]:
    """The kvconform gate's verdict (a gate.GateResult) as Allure 3 quality-gate results."""
    from kvconform.gate import summary

    blocking = gate.blocking
    results = [
        {
            "rule": "kvconform gate",
            "success": gate.passed,
            "message": re.sub(r"\s+", " ", summary(gate)),
            "expected": "no blocking row (new failure, missing, no longer run, regression)",
            "actual": f"{len(blocking)} blocking row(s)",
            "testResults": [ids[(r.engine, r.check)] for r in blocking if (r.engine, r.check) in ids],
        }
    ]
    for row in blocking:
        results.append(
            {
                "rule": f"{row.verdict}: {row.engine} {row.check}",
                "success": False,
                "message": f"{row.verdict}: [{row.engine}] {row.check}: {row.detail}",
                "expected": "as in the baseline",
                "actual": row.detail,
                "testResults": [ids[(row.engine, row.check)]] if (row.engine, row.check) in ids else [],
            }
        )
    return results
