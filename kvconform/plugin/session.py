"""Per-process state of a kvconform run: the selected engines, their adapters (one live engine
per name), the results directory (resolved once)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvconform import envs, registry
from kvconform.contract import AdapterContext, EngineAdapter
from kvconform.contract.types import LaunchProfile
from kvconform.errors import KvconformError
from kvconform.memory import nvml

DEFAULT_ENGINE = "reference"
_session_key = pytest.StashKey["KvSession"]()
_engines_key = pytest.StashKey[list[str]]()


def selected_engines(config: pytest.Config) -> list[str]:
    return config.stash.get(_engines_key, None) or config.getoption("--engine") or [DEFAULT_ENGINE]


def set_selected_engines(config: pytest.Config, names: list[str]) -> None:
    config.stash[_engines_key] = list(dict.fromkeys(names))


def results_dir(config: pytest.Config) -> Path:
    raw = config.getoption("--results-dir") or config.getini("kvconform_results_dir") or "results"
    path = Path(raw)
    if not path.is_absolute():
        path = Path(config.invocation_params.dir) / path
    return path.resolve()


class KvSession:
    """Adapters by engine name, created on first use and kept for the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results_dir = results_dir(config)
        self.workdir = self.results_dir / "work" / os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.adapters: dict[str, EngineAdapter] = {}
        self.started = time.time()
        self.env_overrides = dict(
            item.split("=", 1) for item in config.getoption("--engine-env") if "=" in item
        )
        self.profiles = load_profiles(config.getoption("--engine-profile") or [], selected_engines(config))

    def env_name(self, name: str, cls: type) -> str | None:
        """--engine-env, else the profile's `env`, else the GPU spec standing for the adapter's
        CPU spec when NVML sees a GPU, else None (the adapter's own spec)."""
        if name in self.env_overrides:
            return self.env_overrides[name]
        profile = self.profiles.get(name)
        if profile is not None and profile.env:
            return profile.env
        default = getattr(cls, "env_spec", None)
        if default and nvml().available:
            return envs.gpu_spec_for(default)
        return None

    def context(self, name: str, cls: type) -> AdapterContext:
        options: dict[str, Any] = {}
        # an adapter with pytest options of its own (its plugin adds them) names their dests
        for dest in getattr(cls, "pytest_options", ()):
            options[dest] = self.config.getoption(dest)
        return AdapterContext(
            workdir=self.workdir / name,
            url=self.config.getoption("--engine-url"),
            start_timeout_s=self.config.getoption("--engine-start-timeout"),
            request_timeout_s=self.config.getoption("--request-timeout"),
            env_name=self.env_name(name, cls),
            options=options,
            profile=self.profiles.get(name),
        )

    def new_adapter(self, name: str) -> EngineAdapter:
        cls = registry.adapter_class(name)
        return cls(self.context(name, cls))

    def preflight(self, name: str) -> None:
        self.new_adapter(name).preflight()

    def adapter(self, name: str) -> EngineAdapter:
        if name not in self.adapters:
            self.adapters[name] = self.new_adapter(name)
        return self.adapters[name]

    def platform(self) -> str:
        return nvml().describe()

    def activate_mutant(self, engine: str, name: str) -> None:
        """Switch the mutant on for the engine processes this run launches (see kvconform.mutants)."""
        from kvconform.mutants import activation, catalog

        activation.activate(catalog.find(engine, name), self.results_dir / "work")

    def mutant_meta(self) -> dict[str, Any] | None:
        """The run's mutant and the modules it was seen patching (none: it never went live)."""
        name = self.config.getoption("--mutant")
        if not name:
            return None
        from kvconform.mutants import activation

        applied = activation.applied_modules(self.results_dir / "work" / f"mutant-{name}-applied.jsonl")
        return {"name": name, "engine": selected_engines(self.config)[0], "applied": applied}


def load_profiles(raw: list[str], engines: list[str]) -> dict[str, LaunchProfile]:
    """--engine-profile [ENGINE=]FILE values, by engine. A bare FILE goes to the engine its
    `engine` field names, else to every selected engine; a profile for another engine than
    the one it is given to is a usage error."""
    profiles: dict[str, LaunchProfile] = {}
    for item in raw:
        engine, sep, path = item.partition("=")
        if not sep or "/" in engine or engine.endswith(".toml"):
            engine, path = "", item
        try:
            profile = LaunchProfile.load(path)
        except ValueError as exc:
            raise pytest.UsageError(f"kvconform: --engine-profile {item}: {exc}") from None
        targets = [engine] if engine else [profile.engine] if profile.engine else engines
        for target in targets:
            if profile.engine and profile.engine != target:
                raise pytest.UsageError(
                    f"kvconform: --engine-profile {item}: the profile is for engine {profile.engine!r}, "
                    f"not {target!r}"
                )
            if target in profiles:
                raise pytest.UsageError(f"kvconform: two launch profiles for engine {target!r}")
            profiles[target] = profile
    return profiles


def check_results_dir_writable(config: pytest.Config) -> None:
    """Fail the session at once, in one line, if its records could not be written."""
    out = results_dir(config)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".kvconform-write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise KvconformError(
            f"results dir {out} is not writable ({reason}): no record could be kept"
        ) from None


def kv_session(config: pytest.Config) -> KvSession:
    return config.stash[_session_key]


def start_session(config: pytest.Config) -> KvSession:
    config.stash[_session_key] = KvSession(config)
    return config.stash[_session_key]
