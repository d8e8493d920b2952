"""What the suite opens and what it writes: nothing it starts listens beyond loopback (every
listening socket of the engine trees, sampled at each check of a real run); no subprocess is
built from a shell string; a canary secret planted in the environment of a run (oMLX API key,
hub tokens) appears in no artifact: results, records, engine logs, the Allure output."""

from __future__ import annotations

import ast
import ipaddress
from pathlib import Path

from tests.system.chaos.harness import ROOT, Row, run_chaos, summarize

BLOCK = "kvconform/suites/prefix_reuse/test_block_reuse.py"
RELEASE = "kvconform/suites/transfer/test_release.py"
CANARY = "kvc-canary-7f3a9e1d5b2c"


def test_loopback_only_and_no_secret_in_artifacts(tmp_path: Path, chaos_table) -> None:
    options = ["--check", "prefix_reuse::test_repeated_prompt_served_from_cache"]
    options += ["--check", "transfer::test_event_ledger_consistent", "--alluredir", str(tmp_path / "allure")]
    secrets = {
        "KVCONFORM_OMLX_API_KEY": CANARY,
        "HF_TOKEN": CANARY + "-hf",
        "HUGGING_FACE_HUB_TOKEN": CANARY + "-hub",
    }
    # the kill makes a failing check, so log tails are attached to the report too
    fault = {"fault": "kill", "check": "test_event_ledger_consistent", "at": 3}
    run = run_chaos(tmp_path, fault, [BLOCK, RELEASE], options, 2, env=secrets)
    sampled = [e for e in run.log if e["event"] == "sockets"]
    binds = [(who, *s) for e in sampled for who in ("engine", "suite") for s in e[who]]
    wide = [b for b in binds if not ipaddress.ip_address(b[3]).is_loopback]
    leaks = []
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "chaos.jsonl" and CANARY.encode() in path.read_bytes():
            leaks.append(str(path.relative_to(tmp_path)))
    files = sum(1 for p in tmp_path.rglob("*") if p.is_file())
    row = Row(
        "listening sockets of the engine trees; canary secrets in env",
        "reference",
        f"{len(binds)} listening sockets in {len(sampled)} samples, {len(wide)} beyond loopback; "
        f"canary found in {len(leaks)} of {files} artifacts",
        "-",
        "-",
        summarize(run.records),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert sampled and any(e["engine"] for e in sampled), run.log
    assert not wide, f"binds beyond 127.0.0.1: {wide}"
    assert any(r["outcome"] == "failed" for r in run.records), "a failure's log tail must be in the artifacts"
    assert (tmp_path / "allure").exists() and any((tmp_path / "allure").iterdir())
    assert not leaks, f"canary secret written to {leaks}"
    assert not run.orphans and not run.shm_left and run.complete == "yes"


def test_no_subprocess_from_a_shell_string() -> None:
    """No shell=True, os.system, os.popen or a string command anywhere in the package."""
    found = []
    for path in sorted((ROOT / "kvconform").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if owner == "os" and (name in ("system", "popen") or name.startswith("spawn")):
                found.append(f"{where} os.{name}")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append(f"{where} shell=...")
            runs = owner == "subprocess" and name in ("run", "Popen", "call", "check_call", "check_output")
            if runs and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                found.append(f"{where} subprocess.{name} with a string command")
    assert not found, found
