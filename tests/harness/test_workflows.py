"""The CI workflows under ci/: valid GitHub Actions, lint-clean, and every `kvconform ...` /
`pytest ...` command in them parses against our CLI and our pytest options.

Commands are taken from each step's `run:` script after substituting `${{ ... }}` expressions
(matrix values, dispatch inputs) and shell variables from the workflow's `env:` blocks. A
`kvconform run ... -- ARGS` is checked twice: by the CLI, and as the pytest command line the
main job builds, parsed by pytest with our plugin (parse only: no engine is started).
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvconform import cli
from kvconform.mainjob import pytest_command
from kvconform.registry import BUILTIN as ADAPTERS
from tests.paths import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the dev tools: pip install -e '.[dev]'")

ROOT = REPO
WORKFLOWS = [ROOT / "ci" / "nightly.yml", ROOT / "ci" / "gate.yml"]
YAMLLINT_CONFIG = ROOT / "ci" / "yamllint.yml"
# dispatch inputs worth exercising with a value other than their (empty) default
SAMPLE_INPUTS = {"pytest_args": "-k prefix_reuse -x", "candidate_env": "lmcache-candidate"}
PARSE_ONLY_PLUGIN = """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    print("kvconform-parse-only: ok")
    return 0
"""


@dataclass
class Command:
    workflow: str
    where: str  # job / step
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.workflow} {self.where}: {shlex.join(self.argv)}"


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the bare key `on` as True
    if True in data:
        data["on"] = data.pop(True)
    return data


def _inputs(workflow: dict[str, Any]) -> dict[str, str]:
    on = workflow.get("on") or {}
    spec = (on.get("workflow_dispatch") or {}).get("inputs") or {} if isinstance(on, dict) else {}
    values = {}
    for name, meta in spec.items():
        meta = meta or {}
        options = meta.get("options") or []
        if name in SAMPLE_INPUTS:
            values[name] = SAMPLE_INPUTS[name]
        elif "default" in meta:
            values[name] = str(meta["default"])  # may be empty: `inputs.x || fallback` then falls back
        else:
            values[name] = str(options[0]) if options else f"sample-{name}"
    return values


def _evaluate(expr: str, ctx: dict[str, dict[str, str]]) -> str:
    """A small subset of GitHub expressions: `a.b`, `a || b`, string literals."""
    for alternative in expr.split("||"):
        term = alternative.strip()
        if term.startswith("'") and term.endswith("'"):
            value = term[1:-1]
        else:
            scope, _, name = term.partition(".")
            value = ctx.get(scope, {}).get(name, f"sample-{name or scope}")
        if value:
            return value
    return ""


def _substitute_expressions(text: str, ctx: dict[str, dict[str, str]]) -> str:
    return re.sub(r"\$\{\{(.*?)\}\}", lambda m: _evaluate(m.group(1), ctx), text)


def _substitute_shell(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, f"sample-{name.lower()}")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}|\$([A-Za-z_][A-Za-z0-9_]*)", value, text)


def _segments(script: str) -> list[list[str]]:
    """Simple commands of a shell script: lines joined at backslashes, split at | && || ; ( )."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and all(c in "|&;()<>" for c in token):
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
        if current:
            out.append(current)
    return out


def _is_kvconform(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "kvconform"


def _pytest_args(argv: list[str]) -> list[str] | None:
    """The arguments of a pytest invocation (pytest ... / python -m pytest ...), else None."""
    if argv and Path(argv[0]).name in ("pytest", "py.test"):
        return argv[1:]
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "pytest"]:
        return argv[3:]
    return None


def commands(path: Path) -> list[Command]:
    workflow = _load(path)
    inputs = _inputs(workflow)
    found: list[Command] = []
    for job_name, job in (workflow.get("jobs") or {}).items():
        matrix = {
            k: v for k, v in ((job.get("strategy") or {}).get("matrix") or {}).items() if isinstance(v, list)
        }
        combos = [dict(zip(matrix, values, strict=True)) for values in itertools.product(*matrix.values())]
        for combo in combos or [{}]:
            ctx: dict[str, dict[str, str]] = {
                "inputs": inputs,
                "matrix": {k: str(v) for k, v in combo.items()},
            }
            env: dict[str, str] = {}
            for block in (workflow.get("env"), job.get("env")):
                for k, v in (block or {}).items():
                    env[k] = _substitute_expressions(str(v), {**ctx, "env": env})
            for i, step in enumerate(job.get("steps") or []):
                if "run" not in step:
                    continue
                step_env = dict(env)
                for k, v in (step.get("env") or {}).items():
                    step_env[k] = _substitute_expressions(str(v), {**ctx, "env": step_env})
                script = _substitute_expressions(step["run"], {**ctx, "env": step_env})
                script = _substitute_shell(script, step_env)
                where = f"{job_name}{combo or ''} / {step.get('name', f'step {i + 1}')}"
                for argv in _segments(script):
                    if _is_kvconform(argv) or _pytest_args(argv) is not None:
                        found.append(Command(path.name, where, argv))
    return found


def parse_kvconform(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse with the real CLI, dispatching nowhere; raise AssertionError with argparse's message."""
    seen: list[Any] = []
    monkeypatch.setattr(cli, "_dispatch", lambda args: seen.append(args) or 0)
    try:
        cli.main(argv)
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(argv)}` does not parse (exit {exc.code})") from None
    return seen[0]


def parse_pytest(args: list[str], plugin_dir: Path) -> None:
    """Parse pytest arguments with our plugin loaded, then stop before anything runs."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "kvconform_parse_only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), "PYTHONPATH": str(plugin_dir)},
        check=False,
    )
    if proc.returncode != 0 or "kvconform-parse-only: ok" not in proc.stdout:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise AssertionError(f"pytest rejects `{shlex.join(args)}`: {' | '.join(message[-3:])}")


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parse-only")
    (path / "kvconform_parse_only.py").write_text(PARSE_ONLY_PLUGIN)
    return path


def check_command(cmd: Command, monkeypatch: pytest.MonkeyPatch, plugin_dir: Path) -> None:
    if _is_kvconform(cmd.argv):
        args = parse_kvconform(cmd.argv[1:], monkeypatch)
        if args.command == "run":
            extra = [a for a in args.pytest_args if a != "--"]
            full = pytest_command(args.engine or ["reference"], Path(args.results_dir), extra)
            parse_pytest(full[2:], plugin_dir)  # without "-m pytest"
    else:
        parse_pytest(_pytest_args(cmd.argv) or [], plugin_dir)


# ------------------------------------------------------------------------------------------ tests


def _tool(module: str) -> list[str]:
    pytest.importorskip(module, reason=f"{module} is a dev dependency: pip install -e '.[dev]'")
    return [sys.executable, "-m", module]


def test_workflows_match_the_github_schema() -> None:
    cmd = [*_tool("check_jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workflows_are_lint_clean() -> None:
    cmd = [
        *_tool("yamllint"),
        "--strict",
        "-c",
        str(YAMLLINT_CONFIG),
        *map(str, WORKFLOWS),
        str(YAMLLINT_CONFIG),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_every_command_parses(workflow: Path, monkeypatch: pytest.MonkeyPatch, plugin_dir: Path) -> None:
    found = commands(workflow)
    assert any(_is_kvconform(c.argv) and c.argv[1] == "run" for c in found), "no `kvconform run` found"
    assert any(_is_kvconform(c.argv) and c.argv[1] == "gate" for c in found), "no `kvconform gate` found"
    # The matrix repeats most commands word for word (163 in nightly.yml, 43 distinct): each
    # distinct one is parsed once, and a failure names every place it appears.
    places: dict[tuple[str, ...], list[Command]] = {}
    for cmd in found:
        places.setdefault(tuple(cmd.argv), []).append(cmd)
    problems = []
    for same in places.values():
        try:
            check_command(same[0], monkeypatch, plugin_dir)
        except AssertionError as exc:
            problems.append("\n".join(map(str, same)) + f"\n    {exc}")
    assert not problems, "\n".join(problems)


def test_nightly_covers_the_engines_and_gates_its_own_artifacts() -> None:
    nightly = _load(WORKFLOWS[0])
    job = nightly["jobs"]["conformance"]
    engines = job["strategy"]["matrix"]["engine"]
    assert set(engines) == {
        "vllm",
        "vllm-lmcache",
        "lmcache",
        "lmcache-redis",
        "sglang",
        "sglang-server",
        "dynamo",
        "omlx",
        "trtllm",
        "reference",
    }
    profiles = {i["engine"]: i["profile"] for i in job["strategy"]["matrix"]["include"]}
    assert all((ROOT / path).is_file() for path in profiles.values()), "every nightly profile ships"
    shipped = {
        p.parent.parent.name.replace("_", "-") for p in ROOT.glob("kvconform/adapters/*/profiles/*.toml")
    }
    assert shipped <= set(profiles), "each engine with a shipped profile runs it in the nightly"
    assert set(engines) <= set(ADAPTERS)
    steps = {s.get("name", s.get("uses")): s for s in job["steps"]}
    uploaded = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    downloaded = next(
        s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/download-artifact")
    )
    assert uploaded["with"]["name"] == downloaded["with"]["name"]
    assert '"nightly.yml"' in steps["Find the previous nightly"]["with"]["script"]
    assert WORKFLOWS[0].name == "nightly.yml"
    builds = [
        c
        for c in commands(WORKFLOWS[0])
        if c.argv[1:3] == ["env", "build"] and c.where.startswith("conformance")
    ]
    assert {c.argv[3] for c in builds} == set(engines)  # `kvconform env build <engine>` in every job...
    build_step = next(s for s in job["steps"] if "env build" in s.get("run", ""))
    assert build_step["if"] == "matrix.engine != 'reference'"  # ...but the reference engine needs none


def test_gate_workflow_engines_are_known() -> None:
    gate = _load(WORKFLOWS[1])
    options = gate["on"]["workflow_dispatch"]["inputs"]["engine"]["options"]
    assert set(options) <= set(ADAPTERS)
    runs = [c for c in commands(WORKFLOWS[1]) if c.argv[1] == "run"]
    assert len(runs) == 2 and all("--engine-env" in c.argv for c in runs)


def test_the_checker_catches_bad_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin_dir: Path
) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(
        """
on: workflow_dispatch
jobs:
  j:
    runs-on: ubuntu-latest
    env:
      ENGINE: vllm
    steps:
      - run: kvconform run --engine "$ENGINE" --reportdir x
      - run: |
          kvconform run --engine "$ENGINE" -- --engine-envx "$ENGINE=vllm" \\
            -q
      - run: echo hi && .venv/bin/pytest suites --churn-cycle 3 | tee log
      - run: kvconform gate a
"""
    )
    found = commands(bad)
    assert [c.argv[0] for c in found] == ["kvconform", "kvconform", ".venv/bin/pytest", "kvconform"]
    assert found[1].argv[-1] == "-q"  # the continuation line was joined
    assert "vllm=vllm" in found[1].argv  # the shell variable was substituted
    for cmd in found:
        with pytest.raises(AssertionError):
            check_command(cmd, monkeypatch, plugin_dir)
