"""Engine environments: one virtual environment per engine, built from a spec.

Specs are TOML files found in each registered adapter's `envs/` folder, and in the folders
named by the `kvconform_env_specs` ini option or $KVCONFORM_ENV_SPECS (os.pathsep-separated),
which come first.

Engines pin conflicting torch/numpy versions, so none is ever installed into the suite's own
environment. Each is built once per spec content and cached outside the checkout:
    $KVCONFORM_ENV_ROOT (default ~/.cache/kvconform/envs)/<spec name>-<spec hash>/
A build writes its marker file last; a directory without one is a broken build and is rebuilt.

GPU specs (`gpu = true`, e.g. vllm-cuda) stand beside the CPU ones: `gpu_for = "<cpu spec>"`
names the spec they replace when NVML sees a device (`gpu_spec_for`), unless --engine-env
names one. On a machine without a GPU, `build_gpu` only resolves their pins on PyPI
(`resolve_pins`), so CI proves every pin exists without installing multi-GB CUDA wheels.
`parser_env` names the CPU spec of the same release whose argument parser validates the
command lines the adapters build for it (`check_argv`).

A spec (see any adapter's envs/*.toml; examples/llamacpp_adapter's builds from source):
    engine = "NAME"            the engine it is for (`kvconform env build NAME` finds it)
    python = "python3.11"      the interpreter the venv is made with
    version_probe = "..."      Python run in the env; the last line it prints is the version
    hash_files = [...]         files (beside the spec) whose content joins the cache key
    [[steps]]                  in order, each with a `name` and one of:
      pip = [...]              pinned requirements (pip_options = [...] before them)
      uninstall = [...]        packages to remove
      dist_info = {...}        a dist-info to write (a package installed without pip)
      run = "..."              Python run by the env's interpreter (sys.prefix is the venv;
                               its parent is the env's own folder, for build trees)
    and per step env = {...} (environment variables), lift_torch_cap = true (no torch cap).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
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

    @property
    def gpu(self) -> bool:
        """A CUDA spec: built on GPU runners only, its pins resolved elsewhere."""
        return bool(self.data.get("gpu", False))

    @property
    def gpu_for(self) -> str | None:
        """The CPU spec this GPU spec replaces when the runner has a GPU."""
        value = self.data.get("gpu_for")
        return str(value) if value else None

    @property
    def parser_env(self) -> str:
        """The spec whose environment holds this engine release's argument parser."""
        return str(self.data.get("parser_env") or self.name)

    def python_version(self) -> str:
        """'3.11' from python = "python3.11" (the interpreter the venv is made with)."""
        found = re.search(r"(\d+\.\d+)", str(self.data.get("python", "python3.11")))
        return found.group(1) if found else f"{sys.version_info.major}.{sys.version_info.minor}"

    def pins(self) -> list[str]:
        """Every requirement the spec's pip steps install, in order."""
        return [req for step in self.data.get("steps", []) for req in step.get("pip", [])]


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


def specs_to_build(name: str) -> list[str]:
    """What `kvconform env build NAME` builds: NAME's spec, or the spec of the engine named NAME
    (lmcache-redis runs in lmcache's environment) and those of the other processes of its stack
    (`stack_env_specs`: vllm-lmcache's LMCache server); where NVML sees a GPU, its GPU spec too
    (the session picks that one; the CPU one still checks command lines against the engine's
    parser)."""
    from kvconform import registry

    known = known_specs()
    spec, stack = name, []
    if name in registry.names():
        adapter = registry.adapter_class(name)
        stack = list(getattr(adapter, "stack_env_specs", ()))
        if name not in known:
            spec = getattr(adapter, "env_spec", None) or ""
            if not spec:
                return []  # runs in the suite's own environment (the reference engine)
    found = [spec, *stack]
    from kvconform.memory import nvml

    gpu = gpu_spec_for(spec) if spec in known and nvml().available else None
    if gpu and gpu != spec:
        found.append(gpu)
    return found


def gpu_specs() -> list[str]:
    return [name for name in known_specs() if load_spec(name).gpu]


def gpu_spec_for(name: str) -> str | None:
    """The GPU spec that replaces CPU spec `name` on a GPU runner (a GPU spec stands for
    itself), or None when there is none."""
    if name in known_specs() and load_spec(name).gpu:
        return name
    for other in gpu_specs():
        if load_spec(other).gpu_for == name:
            return other
    return None


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
    env.update({str(k): str(v) for k, v in step.get("env", {}).items()})
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


# ---- GPU specs on machines without a GPU: resolve their pins -------------------------------

PYPI = "https://pypi.org/simple"
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*$")


@dataclass(frozen=True)
class PinCheck:
    spec: str
    requirement: str
    ok: bool
    detail: str
    seconds: float


def _pip_isolated() -> list[str]:
    """pip against PyPI alone: no local wheel folders, extra indexes or constraints."""
    argv = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
    cert = os.environ.get("PIP_CERT")
    if cert:
        argv += ["--cert", cert]
    return argv


def check_pin(spec: EnvSpec, requirement: str, download: bool = False, timeout_s: float = 600) -> PinCheck:
    """Does PyPI hold `requirement` (NAME==VERSION) as a wheel for the spec's Python?

    Cheap (default): `pip index versions NAME --python-version X --only-binary :all:` (one
    index page, about a second), the exact version must be listed. `download`: `pip download
    --no-deps` of the wheel itself into a temporary folder (proves the file, costs its size).
    """
    t0 = time.monotonic()
    match = _PIN.match(requirement)
    if match is None:
        return PinCheck(spec.name, requirement, False, "not pinned (NAME==VERSION)", 0.0)
    pkg, want = match.group(1), match.group(3)
    target = ["--python-version", spec.python_version(), "--only-binary", ":all:"]
    if download:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvconform-pin-") as tmp:
            argv = [*_pip_isolated(), "download", "--no-deps", "--index-url", PYPI, *target]
            out = _pip_quiet([*argv, "-d", tmp, requirement], timeout_s)
            files = os.listdir(tmp)
        ok = out.returncode == 0 and bool(files)
        detail = ", ".join(files) if ok else _last_error(out.stdout + out.stderr)
        return PinCheck(spec.name, requirement, ok, detail, round(time.monotonic() - t0, 2))
    from packaging.version import InvalidVersion, Version

    argv = [*_pip_isolated(), "index", "versions", pkg, "--index-url", PYPI, *target]
    if _is_pre(want):
        argv.append("--pre")
    out = _pip_quiet(argv, timeout_s)
    versions: list[str] = []
    for line in out.stdout.splitlines():
        if line.startswith("Available versions:"):
            versions = [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    try:
        wanted = Version(want)
        ok = any(_same_version(v, wanted) for v in versions)
    except InvalidVersion:
        ok = want in versions
    if ok:
        detail = f"{pkg} {want} on PyPI for Python {spec.python_version()}"
    elif out.returncode != 0:
        detail = _last_error(out.stdout + out.stderr)
    else:
        detail = f"{pkg} has no {want} for Python {spec.python_version()} (newest: {', '.join(versions[:5])})"
    return PinCheck(spec.name, requirement, ok, detail, round(time.monotonic() - t0, 2))


def _same_version(raw: str, wanted: Any) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(raw) == wanted
    except InvalidVersion:
        return False


def _is_pre(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).is_prerelease
    except InvalidVersion:
        return False


def _pip_quiet(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"ERROR: pip timed out after {timeout_s:.0f}s")


def _last_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("WARNING", "[notice]"))]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["pip gave no output"])[-1][:300]


def resolve_pins(
    names: str | list[str], download: bool = False, say: Callable[[str], None] | None = None, workers: int = 6
) -> list[PinCheck]:
    """Check every pin of the named specs on PyPI, installing nothing (all pins in one pool:
    each check is a pip process waiting on one index page)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for name in [names] if isinstance(names, str) else names:
        spec = load_spec(name)
        pins = list(dict.fromkeys(spec.pins()))
        if not pins:
            raise UsageError(f"environment spec {name}: no pip requirements to resolve")
        jobs += [(spec, req) for req in pins]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
        checks = list(pool.map(lambda job: check_pin(job[0], job[1], download), jobs))
    for check in checks:
        (say or _print)(
            f"[env {check.spec}] {'ok  ' if check.ok else 'FAIL'} {check.requirement}: "
            f"{check.detail} ({check.seconds}s)"
        )
    return checks


def build_gpu(
    names: list[str],
    force: bool = False,
    resolve_only: bool | None = None,
    download: bool | None = None,
    say: Callable[[str], None] | None = None,
) -> int:
    """`kvconform env build --gpu [NAME...]`: GPU specs (all of them without names). Where
    NVML sees a GPU they are built; elsewhere (or with `resolve_only`) their pins are only
    resolved on PyPI (`download`, default $KVCONFORM_PIN_DOWNLOAD=1: fetch each wheel too).
    Returns 0 when every build or pin succeeded, else 1."""
    say = say or _print
    names = names or gpu_specs()
    for name in names:
        if not load_spec(name).gpu:
            raise UsageError(
                f"environment spec {name!r} is not a GPU spec (gpu = true); "
                f"GPU specs: {', '.join(gpu_specs())}"
            )
    if resolve_only is None:
        from kvconform.memory import nvml

        resolve_only = not nvml().available
        if resolve_only:
            say(f"[env] {nvml().reason}: resolving the GPU specs' pins on PyPI, installing nothing")
    if not resolve_only:
        for name in names:
            build(name, force=force, log=say)
        return 0
    if download is None:
        download = os.environ.get("KVCONFORM_PIN_DOWNLOAD", "") == "1"
    t0 = time.monotonic()
    failed = [c for c in resolve_pins(names, download=download, say=say) if not c.ok]
    how = "downloaded" if download else "resolved"
    say(f"[env] {len(names)} GPU spec(s) {how} in {time.monotonic() - t0:.1f}s, {len(failed)} pin(s) failed")
    for check in failed:
        say(f"[env {check.spec}] missing pin {check.requirement}: {check.detail}")
    return 1 if failed else 0


# ---- command lines checked against the engine's own argument parser ---------------------

_ARGV_WRAPPER = r"""
import contextlib, io, json, sys
argvs = json.loads(sys.stdin.read())
ns = {"__name__": "kvconform_argv_check"}
exec(compile(sys.argv[1], "<parser code>", "exec"), ns)
answers = []
for argv in argvs:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns["check"](argv)
        answers.append(None)
    except SystemExit as exc:
        lines = err.getvalue().splitlines()
        msg = [ln for ln in lines if "error:" in ln] or lines[-1:] or ["exit %s" % exc.code]
        answers.append(None if exc.code in (0, None) else msg[-1])
    except Exception as exc:
        answers.append("%s: %s" % (type(exc).__name__, exc))
print("KVCONFORM-ARGV " + json.dumps(answers))
"""


def check_argvs(
    env: BuiltEnv,
    parser_code: str,
    argvs: list[list[str]],
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 300,
) -> list[str | None]:
    """Parse each argv with the engine's real parser inside `env`, in one process: None for
    one that parses, else the parser's error (e.g. "unrecognized arguments: --no-such-flag").

    `parser_code` runs in the engine's interpreter and defines `check(argv)`, which builds the
    parser as the engine's CLI does and parses (argparse exits on an error: caught there)."""
    out = subprocess.run(
        [str(env.python), "-c", _ARGV_WRAPPER, parser_code],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(extra_env or {})},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KVCONFORM-ARGV ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"environment {env.spec.name!r}: its argument parser did not load: {tail}")
    return list(json.loads(lines[-1].split(" ", 1)[1]))


def check_argv(
    env: BuiltEnv, parser_code: str, argv: list[str], extra_env: dict[str, str] | None = None
) -> str | None:
    return check_argvs(env, parser_code, [argv], extra_env)[0]


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _print(message: str) -> None:
    print(message, flush=True)
