"""Engine environments: one virtual environment per engine, built from a spec.

Specs are TOML files found in each registered adapter's `envs/` folder, and in the folders
named by the `kvconform_env_specs` ini option or $KVCONFORM_ENV_SPECS (os.pathsep-separated),
which come first.

Engines pin conflicting torch/numpy versions, so none is ever installed into the suite's own
environment. Each is built once per spec content and cached outside the checkout:
    $KVCONFORM_ENV_ROOT (default ~/.cache/kvconform/envs)/<spec name>-<spec hash>/
A build writes its marker file last; a directory without one is a broken build and is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconform.errors import UsageError

SPEC_DIRS_ENV = "KVCONFORM_ENV_SPECS"
MARKER = "kvconform-env.json"
BUILDER_VERSION = "1"  # bump when the build procedure itself changes


def env_root() -> Path:
    return Path(os.environ.get("KVCONFORM_ENV_ROOT", Path.home() / ".cache" / "kvconform" / "envs"))


@dataclass(frozen=True)
class EnvSpec:
    name: str
    path: Path
    data: dict[str, Any]

    @property
    def digest(self) -> str:
        h = hashlib.sha256(BUILDER_VERSION.encode())
        h.update(self.path.read_bytes())
        for extra in self.data.get("hash_files", []):
            h.update((self.path.parent / extra).read_bytes())
        return h.hexdigest()[:12]

    @property
    def directory(self) -> Path:
        return env_root() / f"{self.name}-{self.digest}"

    @property
    def python(self) -> Path:
        return self.directory / "venv" / "bin" / "python"

    def bin(self, program: str) -> Path:
        return self.directory / "venv" / "bin" / program


@dataclass(frozen=True)
class BuiltEnv:
    spec: EnvSpec
    info: dict[str, Any]

    @property
    def python(self) -> Path:
        return self.spec.python

    @property
    def version(self) -> str:
        return str(self.info.get("version", "unknown"))

    def bin(self, program: str) -> Path:
        return self.spec.bin(program)


_extra_dirs: list[Path] = []


def add_spec_dir(path: str | Path) -> None:
    """Search `path` for specs before the adapters' own (a team's pins, candidate releases)."""
    resolved = Path(path).resolve()
    if resolved not in _extra_dirs:
        _extra_dirs.append(resolved)


def spec_dirs() -> list[Path]:
    from kvconform import registry

    dirs = [*_extra_dirs]
    dirs += [Path(p).resolve() for p in os.environ.get(SPEC_DIRS_ENV, "").split(os.pathsep) if p]
    for name in registry.names():
        folder = registry.package_resources(name)
        if folder is not None and (folder / "envs").is_dir():
            dirs.append(Path(str(folder / "envs")))
    return list(dict.fromkeys(dirs))


def _spec_paths() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in spec_dirs():
        for path in sorted(folder.glob("*.toml")):
            found.setdefault(path.stem, path)
    return found


def known_specs() -> list[str]:
    return sorted(_spec_paths())


def load_spec(name: str) -> EnvSpec:
    path = _spec_paths().get(name)
    if path is None:
        raise UsageError(f"no environment spec {name!r} (known: {', '.join(known_specs())})")
    with path.open("rb") as fh:
        return EnvSpec(name, path, tomllib.load(fh))


def find(name: str) -> BuiltEnv:
    """The built environment for `name`, or a UsageError telling how to build it."""
    spec = load_spec(name)
    marker = spec.directory / MARKER
    if not marker.exists():
        raise UsageError(
            f"environment {name!r} is not built (looked in {spec.directory}); "
            f"build it with: kvconform env build {name}"
        )
    return BuiltEnv(spec, json.loads(marker.read_text()))


def build(name: str, force: bool = False, log: Callable[[str], None] | None = None) -> BuiltEnv:
    say = log or _print
    spec = load_spec(name)
    root = env_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        target = spec.directory
        if (target / MARKER).exists() and not force:
            say(f"[env {name}] cached at {target}")
            return BuiltEnv(spec, json.loads((target / MARKER).read_text()))
        if target.exists():
            shutil.rmtree(target)
        t0 = time.monotonic()
        python = shutil.which(spec.data.get("python", "python3.11")) or sys.executable
        say(f"[env {name}] building {target} with {python}")
        _run([python, "-m", "venv", str(target / "venv")], name, "venv", say)
        for index, step in enumerate(spec.data.get("steps", []), 1):
            label = step.get("name", f"step {index}")
            say(f"[env {name}] step {index}: {label}  (+{time.monotonic() - t0:.0f}s)")
            _run_step(spec, step, name, label, say)
        version = _probe_version(spec, name, say)
        info = {
            "engine": spec.data.get("engine", name),
            "spec": name,
            "digest": spec.digest,
            "version": version,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - t0, 1),
            "size_bytes": _du(target),
        }
        (target / MARKER).write_text(json.dumps(info, indent=1))
        size_gib = info["size_bytes"] / 2**30
        say(f"[env {name}] ready: version {version}, {info['build_seconds']}s, {size_gib:.2f} GiB")
        return BuiltEnv(spec, info)


def prune(name: str, say: Callable[[str], None] | None = None) -> list[Path]:
    """Remove cached builds of `name` whose spec hash is no longer current."""
    spec = load_spec(name)
    removed = []
    for path in env_root().glob(f"{name}-*"):
        if path.is_dir() and path != spec.directory and path.name[len(name) + 1 :].isalnum():
            shutil.rmtree(path)
            removed.append(path)
            (say or _print)(f"[env {name}] removed stale {path}")
    return removed


def _run_step(spec: EnvSpec, step: dict[str, Any], name: str, label: str, say: Callable[[str], None]) -> None:
    env = dict(os.environ)
    if step.get("lift_torch_cap"):
        env["PIP_CONSTRAINT"] = ""
    pip = [str(spec.python), "-m", "pip"]
    if "pip" in step:
        args = [*pip, "install", "--progress-bar", "off", *step.get("pip_options", []), *step["pip"]]
        _run(args, name, label, say, env)
    elif "uninstall" in step:
        _run([*pip, "uninstall", "-y", *step["uninstall"]], name, label, say, env)
    elif "dist_info" in step:
        _write_dist_info(spec, step["dist_info"])
    elif "run" in step:
        _run([str(spec.python), "-c", step["run"]], name, label, say, env)
    else:
        raise UsageError(f"environment spec {name}: step {label!r} has no pip/uninstall/dist_info/run")


def _write_dist_info(spec: EnvSpec, info: dict[str, str]) -> None:
    out = subprocess.run(
        [str(spec.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    dist = Path(out.stdout.strip()) / f"{info['name']}-{info['version'].split('+')[0]}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {info['name']}\nVersion: {info['version']}\n"
    )
    (dist / "INSTALLER").write_text("kvconform\n")


def _probe_version(spec: EnvSpec, name: str, say: Callable[[str], None]) -> str:
    code = spec.data.get("version_probe")
    if not code:
        return "unknown"
    out = subprocess.run([str(spec.python), "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise UsageError(
            f"environment {name!r} built but its check failed: {out.stderr.strip().splitlines()[-1:]}"
        )
    return out.stdout.strip().splitlines()[-1]


_NOISE = ("WARNING: Location", "Requirement already satisfied")


def _run(
    argv: list[str], name: str, label: str, say: Callable[[str], None], env: dict[str, str] | None = None
) -> None:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-30:], line]
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully", "ERROR")):
            say(f"[env {name}]   {line[:160]}")
    if proc.wait() != 0:
        raise UsageError(
            f"environment {name!r}: {label} failed (exit {proc.returncode}):\n" + "\n".join(tail)
        )


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _print(message: str) -> None:
    print(message, flush=True)
