"""Collection: engine parametrization, --check selection, capability skips, known findings."""

from __future__ import annotations

import pytest

from kvconform import checkids, findings
from kvconform.contract import Capability, supported
from kvconform.plugin.session import kv_session, selected_engines


def engine_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return callspec.params.get("engine_name")


def check_id(item: pytest.Item) -> str:
    marker = item.get_closest_marker("check")
    if marker:
        return str(marker.args[0])
    obj = getattr(item, "obj", None)
    module = getattr(obj, "__module__", None) or getattr(getattr(item, "module", None), "__name__", "")
    name = getattr(item, "originalname", item.name)
    callspec = getattr(item, "callspec", None)
    params = []
    if callspec is not None:
        params = [str(value) for key, value in callspec.params.items() if key != "engine_name"]
    return checkids.check_id(module or item.path.stem, name, params)


FROM_PARAM = "param"  # engine_config(block_size="param"): the check's own parameter of that name


ConfigKey = tuple[tuple[str, object], ...]


def starting_config(item: pytest.Item, default_block_size: int | None = None) -> ConfigKey:
    """The engine configuration a check first asks for, from its `engine_config` marker (no
    marker: the default configuration, the empty key)."""
    marker = item.get_closest_marker("engine_config")
    if marker is None:
        return ()
    callspec = getattr(item, "callspec", None)
    fields = {}
    for key, value in marker.kwargs.items():
        if key == "varies":
            continue
        if value == FROM_PARAM:
            value = callspec.params[key] if callspec is not None else None
        if key == "block_size" and value == default_block_size:
            continue  # the default server already runs at that size
        if value not in (None, False):
            fields[key] = value
    return tuple(sorted(fields.items()))


def varies(item: pytest.Item) -> bool:
    """A check that moves its engine through several configurations (`varies=True`) runs last
    in its starting configuration's group: the next group restarts the engine anyway."""
    marker = item.get_closest_marker("engine_config")
    return bool(marker and marker.kwargs.get("varies"))


def order_by_configuration(items: list[pytest.Item], block_size_of: dict[str, int]) -> list[pytest.Item]:
    """Within each engine's run of checks, those that start the engine in the same
    configuration together, the default configuration first: the engine restarts once per
    configuration instead of once per change (a vLLM-CPU start is ~18 s). The order is
    otherwise kept (a stable sort), so a module's checks of one configuration stay together."""
    ordered: list[pytest.Item] = []
    run: list[pytest.Item] = []
    engine: str | None = None

    def flush() -> None:
        size = block_size_of.get(engine or "")

        def key(item: pytest.Item) -> tuple[bool, ConfigKey, bool]:
            config = starting_config(item, size)
            return config != (), config, varies(item)

        run.sort(key=key)
        ordered.extend(run)
        run.clear()

    for item in items:
        name = engine_of(item)
        if name != engine:
            flush()
            engine = name
        run.append(item)
    flush()
    return ordered


def manifest(config: pytest.Config) -> findings.Manifest:
    paths = config.getoption("--known-failures") or config.getini("kvconform_known_failures")
    return findings.load(list(paths), engines=selected_engines(config))


class Collection:
    @staticmethod
    def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
        if "engine_name" in metafunc.fixturenames:
            metafunc.parametrize("engine_name", selected_engines(metafunc.config), scope="session")

    @staticmethod
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        wanted = config.getoption("--check")
        if wanted:
            keep = [i for i in items if checkids.matches_any(check_id(i), wanted)]
            dropped = [i for i in items if i not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = keep
        known = manifest(config)
        session = kv_session(config)
        for item in items:
            name = engine_of(item)
            if name is None:
                continue
            adapter = session.adapter(name)
            gaps, offered = adapter.unsupported(), supported(adapter)
            for marker in item.iter_markers("requires"):
                missing = [Capability(c) for c in marker.args if Capability(c) not in offered]
                if missing:
                    named = ", ".join(f"{c} ({gaps[c]})" if c in gaps else str(c) for c in missing)
                    item.add_marker(pytest.mark.skip(reason=f"engine {name} lacks capability {named}"))
                    break
            entry = known.match(name, adapter.version, check_id(item))
            if entry is not None:
                # Not pytest's xfail marker: that would xfail any exception. Recording judges
                # the report (findings.judge): xfailed only on exactly the finding's measures.
                item.stash[findings.ENTRY_KEY] = entry


class EngineLanes:
    """Under `pytest -n N --dist loadgroup`, each engine's checks are one xdist group: an
    engine's servers live in one worker for the whole session (one server per configuration),
    and engines run side by side. Engine starts are mostly single-threaded imports, so two
    engines on two cores take little more than the slower one."""

    @staticmethod
    @pytest.hookimpl(tryfirst=True)  # before xdist's worker renames items by their group
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            name = engine_of(item)
            if name is not None:
                item.add_marker(pytest.mark.xdist_group(name))


class Ordering:
    @staticmethod
    @pytest.hookimpl(trylast=True)  # after pytest grouped the items by engine (a session param)
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        kv = kv_session(config)
        sizes = {name: kv.adapter(name).deployment.block_size for name in selected_engines(config)}
        items[:] = order_by_configuration(items, sizes)
