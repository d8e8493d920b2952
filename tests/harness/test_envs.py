"""Engine environments: spec hashing, finding a missing one, building and reusing one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvconform import envs
from kvconform.errors import UsageError

TRIVIAL = f"""
engine = "trivial"
python = "{sys.executable}"
version_probe = "import pathlib, sys; print(pathlib.Path(sys.prefix, 'stamp').read_text())"

[[steps]]
name = "stamp"
run = "import pathlib, sys; pathlib.Path(sys.prefix, 'stamp').write_text('1.2.3')"
"""


@pytest.fixture
def env_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "envs"
    monkeypatch.setenv("KVCONFORM_ENV_ROOT", str(root))
    return root


@pytest.fixture
def spec_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    specs = tmp_path / "specs"
    specs.mkdir()
    monkeypatch.setattr(envs, "spec_dirs", lambda: [specs])
    return specs


def test_digest_follows_the_spec_and_its_hashed_files(tmp_path: Path, env_root: Path) -> None:
    spec_path = tmp_path / "e.toml"
    extra = tmp_path / "constraints.txt"
    spec_path.write_text('hash_files = ["constraints.txt"]\n')
    extra.write_text("torch==2.4.0\n")
    data = {"hash_files": ["constraints.txt"]}

    first = envs.EnvSpec("e", spec_path, data).digest
    assert envs.EnvSpec("e", spec_path, data).digest == first, "stable"
    assert len(first) == 12

    extra.write_text("torch==2.5.0\n")
    second = envs.EnvSpec("e", spec_path, data).digest
    assert second != first, "a hashed file is part of the spec"

    spec_path.write_text('hash_files = ["constraints.txt"]\n# comment\n')
    third = envs.EnvSpec("e", spec_path, data).digest
    assert third not in (first, second)

    spec = envs.EnvSpec("e", spec_path, data)
    assert spec.directory == env_root / f"e-{third}"
    assert spec.python == env_root / f"e-{third}" / "venv" / "bin" / "python"


def test_find_missing_env_says_how_to_build_it(env_root: Path) -> None:
    with pytest.raises(UsageError) as err:
        envs.find("vllm")
    message = str(err.value)
    assert "build it with: kvconform env build vllm" in message
    assert str(env_root) in message
    assert "\n" not in message


def test_unknown_spec(spec_dir: Path) -> None:
    (spec_dir / "known.toml").write_text("")
    with pytest.raises(UsageError, match=r"no environment spec 'nosuch' \(known: known\)"):
        envs.find("nosuch")


def test_half_built_env_is_not_found(spec_dir: Path, env_root: Path) -> None:
    (spec_dir / "trivial.toml").write_text(TRIVIAL)
    directory = envs.load_spec("trivial").directory
    (directory / "venv" / "bin").mkdir(parents=True)  # a build that died before its marker
    with pytest.raises(UsageError, match="not built"):
        envs.find("trivial")


def test_build_writes_the_marker_and_is_reused(
    spec_dir: Path, env_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (spec_dir / "trivial.toml").write_text(TRIVIAL)
    real_run = envs._run

    def run_without_pip(argv: list[str], *args: object, **kwargs: object) -> None:
        venv = argv[1:3] == ["-m", "venv"]  # a real venv, minus the seconds ensurepip takes
        real_run([*argv, "--without-pip"] if venv else argv, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(envs, "_run", run_without_pip)
    said: list[str] = []
    built = envs.build("trivial", log=said.append)

    marker = built.spec.directory / envs.MARKER
    info = json.loads(marker.read_text())
    assert info["engine"] == "trivial" and info["version"] == "1.2.3"
    assert info["digest"] == built.spec.digest
    assert built.version == "1.2.3"
    assert built.python.exists()
    assert (built.spec.directory / "venv" / "stamp").read_text() == "1.2.3"
    assert any("step 1: stamp" in line for line in said)

    said.clear()
    again = envs.build("trivial", log=said.append)
    assert again.info == built.info
    assert said == [f"[env trivial] cached at {built.spec.directory}"]
    assert envs.find("trivial").version == "1.2.3"

    stale = env_root / "trivial-0123456789ab"
    stale.mkdir()
    assert envs.prune("trivial", say=said.append) == [stale]
    assert built.spec.directory.exists()


def test_failing_step_is_a_usage_error_with_its_output(
    spec_dir: Path, env_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = '[[steps]]\nname = "boom"\nrun = "raise SystemExit(\'no wheel for cu999\')"\n'
    (spec_dir / "broken.toml").write_text(f'python = "{sys.executable}"\n{step}')
    # Skip the venv creation (tested above); the step runs with this interpreter instead.
    monkeypatch.setattr(envs.EnvSpec, "python", property(lambda self: Path(sys.executable)))
    real_run = envs._run
    monkeypatch.setattr(
        envs, "_run", lambda argv, *a, **kw: None if argv[1:3] == ["-m", "venv"] else real_run(argv, *a, **kw)
    )
    with pytest.raises(UsageError) as err:
        envs.build("broken", log=lambda _: None)
    assert "environment 'broken': boom failed (exit 1)" in str(err.value)
    assert "no wheel for cu999" in str(err.value)
    assert not (envs.load_spec("broken").directory / envs.MARKER).exists()


def test_specs_are_found_in_the_adapters_and_in_extra_folders(tmp_path: Path, monkeypatch) -> None:
    assert {"vllm", "lmcache", "sglang", "sglang-server", "dynamo", "trtllm"} <= set(envs.known_specs())
    assert envs.load_spec("vllm").path.parent.parent.name == "vllm", "the vLLM adapter owns its spec"
    team = tmp_path / "team-specs"
    team.mkdir()
    (team / "vllm.toml").write_text('engine = "vllm"\n')
    monkeypatch.setenv(envs.SPEC_DIRS_ENV, str(team))
    assert envs.load_spec("vllm").path == team / "vllm.toml", "a team's folder comes first"


def test_env_build_takes_engine_names() -> None:
    assert envs.specs_to_build("lmcache-redis") == ["lmcache"], "the Redis tier runs in lmcache's env"
    assert envs.specs_to_build("vllm-lmcache") == ["vllm-lmcache", "lmcache"], "its LMCache server's env too"
    assert envs.specs_to_build("reference") == [], "the reference engine runs in the suite's own"
    assert envs.specs_to_build("dynamo-1.6.0") == ["dynamo-1.6.0"], "a spec name stands for itself"
