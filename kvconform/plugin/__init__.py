"""The pytest plugin (pytest11 entry point `kvconform`). Inert unless asked: it adds its options
and does nothing else until an engine is asked for (--engine, --adapter, --engine-url,
--engine-env) or kvconform's suites are collected. Then it registers the collection, fixture
and recording hooks (pytest-xdist's pattern: a small module, a configure that activates)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform import envs
from kvconform.errors import KvconformError
from kvconform.plugin import options
from kvconform.plugin.collection import Collection, EngineLanes, Ordering
from kvconform.plugin.fixtures import Fixtures
from kvconform.plugin.recording import Recording, is_worker
from kvconform.plugin.session import (
    check_results_dir_writable,
    kv_session,
    selected_engines,
    set_selected_engines,
    start_session,
)

SUITES_DIR = Path(__file__).resolve().parent.parent / "suites"
_active_key = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def collects_our_suites(config: pytest.Config) -> bool:
    """Whether the run's arguments name kvconform's suites (or a folder holding them)."""
    for raw in config.args:
        arg = raw.split("::", 1)[0]
        if config.getoption("pyargs", False) and (arg == "kvconform" or arg.startswith("kvconform.suites")):
            return True
        path = (Path(config.invocation_params.dir) / arg).resolve()
        if path == SUITES_DIR or SUITES_DIR in path.parents or path in SUITES_DIR.parents:
            return True
    return False


def is_active(config: pytest.Config) -> bool:
    return config.stash.get(_active_key, False)


@pytest.hookimpl(tryfirst=False)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(*capabilities): engine capabilities a check needs")
    config.addinivalue_line("markers", "check(id): stable check id")
    config.addinivalue_line(
        "markers",
        "engine_config(**fields, varies=False): the EngineConfig a check starts its engine in, for "
        'ordering (a field given as "param" is the check\'s parameter of that name; varies: the '
        "check moves through several)",
    )
    if not (options.asked_for_engine(config) or collects_our_suites(config)):
        return
    config.stash[_active_key] = True
    try:
        selected = options.register_adapters(config)
        set_selected_engines(config, [*config.getoption("--engine"), *selected] or ["reference"])
        for folder in config.getini("kvconform_env_specs"):
            envs.add_spec_dir(folder)
        _validate(config)
    except KvconformError as exc:
        raise pytest.UsageError(f"kvconform: {exc}") from None
    start_session(config)
    from kvconform.processes import sigterm_as_interrupt  # only once active: the plugin stays inert

    sigterm_as_interrupt()
    plugins = {
        "collection": Collection,
        "lanes": EngineLanes,
        "ordering": Ordering,
        "fixtures": Fixtures,
        "recording": Recording,
    }
    for name, hooks in plugins.items():
        config.pluginmanager.register(hooks(), f"kvconform-{name}")


def _validate(config: pytest.Config) -> None:
    from kvconform import registry

    engines = selected_engines(config)
    for name in engines:
        registry.target_of(name)  # the one-line "unknown engine" error, before any import
    if config.getoption("--engine-url") and len(engines) != 1:
        raise KvconformError("--engine-url attaches to one engine; give exactly one --engine")
    if config.getoption("--mutant") and config.getoption("--engine-url"):
        raise KvconformError("--mutant patches an engine that kvconform launches, not an attached one")
    for name in engines:
        registry.adapter_class(name)
    if is_worker(config):
        return  # the controller already probed engines, URLs and the results dir
    check_results_dir_writable(config)
    probe = start_session(config)
    for name in engines:
        probe.preflight(name)
    if config.getoption("--mutant"):
        probe.activate_mutant(engines[0], config.getoption("--mutant"))


__all__ = ["is_active", "kv_session", "selected_engines"]
