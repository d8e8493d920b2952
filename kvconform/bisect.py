"""Bisect across releases: the first release of an engine where a check's verdict or measure changed.

    kvconform bisect ENGINE --versions A..B --check GLOB [--check GLOB ...] [--out DIR]
    kvconform bisect --defect ID        # a shipped bug of kvconform/history/defects.toml

For each release in the range, in version order, the engine's environment is built (cached, as
`kvconform env build` does), the selected checks run against it (a pytest subprocess with
`--engine ENGINE --engine-env ENGINE=SPEC --check GLOB`), and each release's results are compared
with the previous release's as the release gate compares them (kvconform/gate.py): a verdict that
changed, a violated measure that came or went, or a numeric measure that moved beyond its
tolerance either way. The first release where anything changed is named, with the measures on
each side.

Which releases: `A..B` is every published release from A to B inclusive, as the package index
lists it (`pip index versions PACKAGE`, PACKAGE being the engine package the default spec pins),
else (no index) the versions the specs on disk name; `A,B,C` is exactly those.

Which environment for a release V: the spec named ENGINE-V if one exists (hand-written, e.g.
kvconform/adapters/lmcache/envs/lmcache-0.5.5.toml); the default spec ENGINE if it pins V; else
a spec generated from the default one by substituting the version pin (every `NAME==D` whose
NAME contains the engine name, and a `dist_info` version D...), written to
$KVCONFORM_ENV_ROOT/../generated-specs/ENGINE-V.toml and said so in the output. A generated
environment that does not build or run is reported as such for that release, and the scan
goes on with the next one (it names the versions it could not judge).

Modes on the reference engine: `--versions` may name fault sets instead (`--fault-sets
none,leak_on_unregister`): each "release" is the reference engine with those faults, for
showing the mechanism where no real range changes.

Exit 0 when a change was found, 1 when none was (every release agrees), 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconform import gate
from kvconform.errors import UsageError
from kvconform.formatting import md_cell, value_text
from kvconform.processes import run_child_session
from kvconform.records import CheckResult

# gate rows that are not a change of verdict: a check failing in both on the same measures
# (failed on a release without a manifest entry, xfailed on one with it).
NOT_A_CHANGE = frozenset({"still failing"})


@dataclass
class Step:
    """One release: what ran and what came out."""

    version: str
    spec: str = ""
    generated: bool = False
    results: gate.Results | None = None
    error: str = ""  # why this release could not be judged (build/run failure)
    wall_s: float = 0.0


@dataclass
class Change:
    before: str
    after: str
    rows: list[gate.Row]
    measures: dict[tuple[str, str], list[tuple[str, Any, Any]]]  # (engine, check) -> (name, before, after)


@dataclass
class BisectResult:
    engine: str
    steps: list[Step]
    changes: list[Change] = field(default_factory=list)

    @property
    def first(self) -> Change | None:
        return self.changes[0] if self.changes else None

    @property
    def unjudged(self) -> list[Step]:
        return [s for s in self.steps if s.results is None]


# ------------------------------------------------------------------------------------- versions


def _vkey(version: str) -> tuple[Any, ...]:
    try:
        from packaging.version import Version

        return (0, Version(version))
    except Exception:
        parts = re.split(r"[.\-+]", version)
        return (1, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts))


def select_versions(spec_text: str, available: Sequence[str]) -> list[str]:
    """`A..B` -> the available versions from A to B inclusive, sorted; `A,B,C` -> as given."""
    text = spec_text.strip()
    if ".." in text:
        low, high = (p.strip() for p in text.split("..", 1))
        if not low or not high:
            raise UsageError(f"--versions {spec_text!r}: want A..B or A,B,C")
        lo, hi = _vkey(low), _vkey(high)
        if lo > hi:
            raise UsageError(f"--versions {spec_text!r}: {low} comes after {high}")
        chosen = sorted({v for v in available if lo <= _vkey(v) <= hi}, key=_vkey)
        for end in (low, high):
            if end not in chosen:
                raise UsageError(
                    f"--versions {spec_text!r}: {end} is not a known release "
                    f"(known: {', '.join(sorted(set(available), key=_vkey)) or 'none'})"
                )
        return chosen
    versions = [v.strip() for v in text.split(",") if v.strip()]
    if len(versions) < 2:
        raise UsageError(f"--versions {spec_text!r}: name at least two releases (A..B or A,B,C)")
    return versions


# ------------------------------------------------------------------------------------ specs


def release_package(spec_data: dict[str, Any], engine: str) -> str:
    """The package whose version names the engine's releases: the spec's `release_package`
    (vllm-lmcache's releases are LMCache's), else the engine's name."""
    return str(spec_data.get("release_package", engine))


def engine_pins(spec_data: dict[str, Any], engine: str) -> list[tuple[str, str]]:
    """(package, version) pins of the engine's own packages in a spec's pip steps."""
    key = release_package(spec_data, engine).replace("_", "-").lower()
    out = []
    for step in spec_data.get("steps", []):
        for req in step.get("pip", []):
            m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^;\s]+)\s*", req)
            if m and key in m.group(1).replace("_", "-").lower() and "+" not in m.group(3):
                out.append((m.group(1), m.group(3)))
    return out


def substitute_version(spec_text: str, engine: str, old: str, new: str, package: str = "") -> str:
    """The default spec's text for release `new`: the pins of the engine's release package
    (default: the engine's name) and dist_info versions moved."""
    key = re.escape((package or engine).replace("_", "-"))
    pin = re.compile(
        rf'(["\'][A-Za-z0-9_.\-]*{key}[A-Za-z0-9_.\-]*(?:\[[^\]]*\])?==){re.escape(old)}(["\'])', re.I
    )
    out, n = pin.subn(rf"\g<1>{new}\g<2>", spec_text)
    if n == 0:
        raise UsageError(f"default spec of {engine} pins no {engine} package at {old}: cannot generate {new}")
    dist = re.compile(rf'(dist_info\s*=\s*\{{[^}}]*version\s*=\s*["\']){re.escape(old)}')
    out = dist.sub(rf"\g<1>{new}", out)
    header = (
        f"# GENERATED by `kvconform bisect` from the {engine} spec: {old} -> {new} in the engine's pins.\n"
        f"# Its other pins are the default spec's; write {engine}-{new}.toml by hand if it needs others.\n"
    )
    return header + out


def generated_spec_dir() -> Path:
    from kvconform import envs

    return envs.env_root().parent / "generated-specs"


def resolve_spec(engine: str, version: str, default_version: str | None) -> tuple[str, bool]:
    """(spec name, generated?) for one release; writes a generated spec when none exists."""
    from kvconform import envs

    name = f"{engine}-{version}"
    folder = generated_spec_dir()
    target = folder / f"{name}.toml"
    if any((d / f"{name}.toml").exists() for d in envs.spec_dirs() if d != folder.resolve()):
        target.unlink(missing_ok=True)  # a hand-written spec now exists: no stale one shadows it
        return name, False
    if version == default_version:
        return engine, False
    if default_version is None:
        raise UsageError(f"no spec {name} and the {engine} spec pins no version to substitute")
    base = envs.load_spec(engine)
    folder.mkdir(parents=True, exist_ok=True)
    text = substitute_version(
        base.path.read_text(), engine, default_version, version, release_package(base.data, engine)
    )
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    envs.add_spec_dir(folder)
    return name, True


def default_version(engine: str) -> tuple[str | None, str | None]:
    """(package, version) the engine's default spec pins, or (None, None)."""
    from kvconform import envs

    if engine not in envs.known_specs():
        return None, None
    pins = engine_pins(envs.load_spec(engine).data, engine)
    return pins[0] if pins else (None, None)


def published_versions(package: str) -> list[str]:
    """Releases of `package` the index lists (pip's own client); [] if it cannot say."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", package],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    m = re.search(r"Available versions:\s*(.+)", out.stdout)
    return [v.strip() for v in m.group(1).split(",")] if m else []


def spec_versions(engine: str) -> list[str]:
    from kvconform import envs

    prefix = f"{engine}-"
    return [
        n[len(prefix) :]
        for n in envs.known_specs()
        if n.startswith(prefix) and n[len(prefix) :][:1].isdigit()
    ]


# ------------------------------------------------------------------------------------- judging


def _measure_values(rec: CheckResult | None) -> dict[str, Any]:
    if rec is None:
        return {}
    return {name: m.value for name, m in rec.measures_by_name().items()}


def compare_steps(before: Step, after: Step) -> Change | None:
    """What changed from one judged release to the next (None: nothing)."""
    assert before.results is not None and after.results is not None
    result = gate.compare(before.results, after.results)
    rows = [r for r in result.rows if r.verdict not in NOT_A_CHANGE]
    if not rows:
        return None
    measures: dict[tuple[str, str], list[tuple[str, Any, Any]]] = {}
    for row in rows:
        check = row.check.split(" :: ", 1)[0]
        key = (row.engine, check)
        if key in measures:
            continue
        b_rec, a_rec = before.results.records.get(key), after.results.records.get(key)
        b, a = _measure_values(b_rec), _measure_values(a_rec)
        measures[key] = [(name, b.get(name), a.get(name)) for name in dict.fromkeys([*b, *a])]
        # a side that failed before measuring anything (a crash, an API the driver cannot call)
        # is a different kind of change from a measure moving: say what stopped it
        for version, rec in ((before.version, b_rec), (after.version, a_rec)):
            why = _unmeasured_failure(rec)
            if why:
                row.detail += f" [{version}: no measures, {why}]"
    return Change(before.version, after.version, rows, measures)


def _unmeasured_failure(rec: CheckResult | None) -> str:
    if rec is None or rec.outcome not in gate.FAILING or rec.measures:
        return ""
    lines = [ln.strip() for ln in rec.message.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "Error" in ln or "error" in ln), lines[0] if lines else "")
    return line if len(line) <= 200 else line[:197] + "..."


def bisect(
    engine: str,
    versions: Sequence[str],
    run: Callable[[str], Step],
    stop_at_first: bool = False,
    say: Callable[[str], None] | None = None,
) -> BisectResult:
    """Run each release in order; compare each judged release with the previous judged one."""
    say = say or (lambda _m: None)
    result = BisectResult(engine, [])
    previous: Step | None = None
    for version in versions:
        step = run(version)
        result.steps.append(step)
        if step.results is None:
            say(f"[bisect {engine}] {version}: not judged ({step.error})")
            continue
        say(f"[bisect {engine}] {version}: {_outcomes(step)}")
        if previous is not None:
            change = compare_steps(previous, step)
            if change is not None:
                result.changes.append(change)
                if stop_at_first:
                    break
        previous = step
    return result


def _outcomes(step: Step) -> str:
    if step.results is None:
        return f"not judged: {step.error}"
    counts: dict[str, int] = {}
    for rec in step.results.records.values():
        counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))


# ------------------------------------------------------------------------------------- running


def pytest_runner(
    engine: str,
    checks: Sequence[str],
    out_dir: Path,
    default: str | None,
    extra: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
) -> Callable[[str], Step]:
    """Build (cached) each release's environment and run the checks against it."""
    from kvconform import envs

    def run(version: str) -> Step:
        step = Step(version)
        t0 = time.monotonic()
        try:
            step.spec, step.generated = resolve_spec(engine, version, default)
            if step.generated and say:
                say(f"[bisect {engine}] {version}: spec generated in {generated_spec_dir()}")
            envs.build(step.spec, log=say)
        except Exception as exc:  # a release that does not build is a result, not a crash
            step.error = f"environment {step.spec or version} did not build: {str(exc).splitlines()[0]}"
            step.wall_s = round(time.monotonic() - t0, 1)
            return step
        env = dict(os.environ)
        dirs = [str(generated_spec_dir()), *filter(None, env.get(envs.SPEC_DIRS_ENV, "").split(os.pathsep))]
        env[envs.SPEC_DIRS_ENV] = os.pathsep.join(dirs)
        argv = _pytest_argv(
            engine, out_dir / version, [*checks], [*extra, "--engine-env", f"{engine}={step.spec}"]
        )
        _run_pytest(step, argv, out_dir, env)
        step.wall_s = round(time.monotonic() - t0, 1)
        return step

    return run


def fault_runner(checks: Sequence[str], out_dir: Path, extra: Sequence[str] = ()) -> Callable[[str], Step]:
    """Each 'release' is the reference engine with a fault set: `none` or `a+b`."""

    def run(fault_set: str) -> Step:
        step = Step(fault_set, spec="reference")
        t0 = time.monotonic()
        argv = _pytest_argv("reference", out_dir / fault_set, checks, extra)
        for fault in fault_set.split("+"):
            if fault and fault != "none":
                argv += ["--fault", fault]
        _run_pytest(step, argv, out_dir, dict(os.environ))
        step.wall_s = round(time.monotonic() - t0, 1)
        return step

    return run


def _pytest_argv(engine: str, results_dir: Path, checks: Sequence[str], extra: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "--pyargs", "kvconform.suites", "-q", "-p", "no:cacheprovider"]
    argv += ["--engine", engine, "--results-dir", str(results_dir)]
    for glob in checks:
        argv += ["--check", glob]
    return argv + list(extra)


def _run_pytest(step: Step, argv: list[str], out_dir: Path, env: dict[str, str]) -> None:
    """Run one release's checks into out_dir/RELEASE (emptied first); its log beside it."""
    results_dir = out_dir / step.version
    if results_dir.exists():
        for old in results_dir.glob("records-*.jsonl"):
            old.unlink()
        (results_dir / "results.json").unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{step.version}.log"
    with open(log_path, "w") as log:
        code = run_child_session(argv, log, env=env)
    try:
        step.results = gate.load(str(results_dir))
    except gate.GateInputError as exc:
        tail = log_path.read_text().strip().splitlines()[-1:]
        step.error = f"pytest exit {code}, {exc}" + (f" ({tail[0]})" if tail else "")


# ------------------------------------------------------------------------------------ printing


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return value_text(value, none="—")


def render(result: BisectResult, markdown: bool = False) -> str:
    lines: list[str] = []
    lines.append(
        f"{'### ' if markdown else ''}kvconform bisect {result.engine}: {len(result.steps)} releases"
    )
    lines.append("")
    if markdown:
        lines += ["| Release | Spec | Checks | Wall |", "|---|---|---|---|"]
    for s in result.steps:
        spec = s.spec + (" (generated)" if s.generated else "")
        if markdown:
            lines.append(f"| {s.version} | `{spec}` | {md_cell(_outcomes(s))} | {s.wall_s:.0f} s |")
        else:
            lines.append(f"  {s.version:12s} {spec:28s} {_outcomes(s)}  ({s.wall_s:.0f} s)")
    lines.append("")
    if not result.changes:
        judged = [s.version for s in result.steps if s.results is not None]
        lines.append(f"no change: every judged release ({', '.join(judged) or 'none'}) agrees")
    for i, change in enumerate(result.changes):
        head = "first change" if i == 0 else "then"
        lines.append(
            f"{'**' if markdown else ''}{head}: {change.before} -> {change.after}{'**' if markdown else ''}"
        )
        lines.append("")
        if markdown:
            lines += ["| Verdict | Check | Detail |", "|---|---|---|"]
            lines += [f"| {r.verdict} | `{md_cell(r.check)}` | {md_cell(r.detail)} |" for r in change.rows]
        else:
            lines += [f"  {r.verdict:16s} {r.check}  {r.detail}" for r in change.rows]
        lines.append("")
        for (engine, check), values in change.measures.items():
            lines.append(f"measures of {check} [{engine}]:" if not markdown else f"Measures of `{check}`:")
            lines.append("")
            if markdown:
                lines += [f"| Measure | {change.before} | {change.after} |", "|---|---|---|"]
                lines += [f"| {md_cell(n)} | {md_cell(_fmt(b))} | {md_cell(_fmt(a))} |" for n, b, a in values]
            else:
                width = max((len(n) for n, _b, _a in values), default=0)
                lines += [f"  {n.ljust(width)}  {_fmt(b):>14s}  ->  {_fmt(a)}" for n, b, a in values]
            lines.append("")
    if result.unjudged:
        lines.append("not judged: " + "; ".join(f"{s.version}: {s.error}" for s in result.unjudged))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvconform bisect", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", metavar="ENGINE", nargs="?")
    parser.add_argument("--versions", help="A..B (published releases in between) or A,B,C")
    parser.add_argument(
        "--defect",
        metavar="ID",
        help="a bug of the release-history corpus: its engine, its check, and (unless --versions) "
        "its last bad..first fixed releases",
    )
    parser.add_argument(
        "--fault-sets", help="reference engine only: none,FAULT[+FAULT],... as the 'releases'"
    )
    parser.add_argument("--check", action="append", default=[], metavar="GLOB")
    parser.add_argument(
        "--out", default="results/bisect", help="results per release (default results/bisect/ENGINE)"
    )
    parser.add_argument("--stop-at-first", action="store_true", help="stop at the first change")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        dest="pytest_args",
        metavar="ARG",
        help="extra pytest argument",
    )


def _apply_defect(args: argparse.Namespace) -> None:
    """Fill engine, checks and versions from a corpus entry (kvconform/history/defects.toml)."""
    from kvconform.history.corpus import find

    defect = find(args.defect)
    if not defect.runnable:
        raise UsageError(f"defect {defect.id} is not reachable here: {defect.unreachable}")
    if args.engine and args.engine != defect.engine:
        raise UsageError(f"defect {defect.id} is a bug of {defect.engine}, not {args.engine}")
    args.engine = defect.engine
    args.check = args.check or [defect.check]
    args.versions = args.versions or f"{defect.bad}..{defect.fixed}"


def run_cli(args: argparse.Namespace) -> int:
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if getattr(args, "defect", None):
        _apply_defect(args)
    if not args.engine or not args.check:
        raise UsageError("name ENGINE and --check GLOB (or --defect ID)")
    out_dir = Path(args.out) / args.engine
    extra = list(args.pytest_args)
    if args.fault_sets:
        if args.engine != "reference":
            raise UsageError("--fault-sets is for the reference engine")
        versions = select_versions(args.fault_sets, [])
        runner = fault_runner(args.check, out_dir, extra)
    else:
        if not args.versions:
            raise UsageError("give --versions A..B (or A,B,C)")
        package, default = default_version(args.engine)
        available: list[str] = []
        if ".." in args.versions:
            available = published_versions(package) if package else []
            if available:
                say(f"[bisect {args.engine}] releases of {package} from the index: {len(available)}")
            else:
                available = [*spec_versions(args.engine), *([default] if default else [])]
                say(f"[bisect {args.engine}] index unavailable: releases with specs: {', '.join(available)}")
        versions = select_versions(args.versions, available)
        runner = pytest_runner(args.engine, args.check, out_dir, default, extra, say)
    say(f"[bisect {args.engine}] releases in order: {', '.join(versions)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = bisect(args.engine, versions, runner, stop_at_first=args.stop_at_first, say=say)
    print(render(result, markdown=args.markdown), end="")
    return 0 if result.changes else 1


if __name__ == "__main__":
    sys.exit(main())
