"""kvconform's command-line and ini options, and the checks of their values that fail fast."""

from __future__ import annotations

import pytest

from kvconform import registry


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform", "KV-cache conformance")
    group.addoption(
        "--engine",
        action="append",
        default=[],
        metavar="NAME",
        help="engine to check, repeatable (built-ins: "
        f"{', '.join(registry.BUILTIN)}; more through --adapter or entry points); default: reference",
    )
    group.addoption(
        "--adapter",
        action="append",
        default=[],
        metavar="[NAME=]MODULE:CLASS",
        help="register an adapter class for this run (NAME defaults to the class's `name`) and select it",
    )
    group.addoption(
        "--engine-url",
        default=None,
        metavar="URL",
        help="attach to a server someone else started instead of launching one",
    )
    group.addoption(
        "--engine-env",
        action="append",
        default=[],
        metavar="ENGINE=SPEC",
        help="use another environment spec for an engine (e.g. lmcache=lmcache-0.5.5)",
    )
    group.addoption(
        "--engine-profile",
        action="append",
        default=[],
        metavar="[ENGINE=]FILE",
        help="launch profile (TOML: model, flags, block size, KV memory, TP, offload, connector, "
        "event ports) for launch mode; ENGINE= when several engines run (default: the profile's "
        "`engine` field, else every selected engine)",
    )
    group.addoption(
        "--churn-cycles",
        type=int,
        default=4,
        metavar="N",
        help="instance churn cycles per memory_reclaim check (default 4)",
    )
    group.addoption(
        "--session-turns",
        type=int,
        default=24,
        metavar="M",
        help="turns of the long-session memory check (default 24)",
    )
    group.addoption(
        "--leak-slope-bytes",
        type=float,
        default=None,
        metavar="B",
        help="leak slope bound in bytes per cycle (default: one KV block of the engine)",
    )
    group.addoption(
        "--memory-tolerance-bytes",
        type=float,
        default=None,
        metavar="B",
        help="final-delta bound vs baseline (default: per measure, see docs/memory-bounds.md)",
    )
    group.addoption(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="where check records (results.json) go (default: ini kvconform_results_dir, else results/)",
    )
    group.addoption(
        "--known-failures",
        action="append",
        default=[],
        metavar="FILE",
        help="known-failures manifest, repeatable (default: ini kvconform_known_failures, else the "
        "manifests shipped with the selected engines' adapters)",
    )
    group.addoption(
        "--check",
        action="append",
        default=[],
        metavar="GLOB",
        help="run only checks whose id (as in results.json) matches, repeatable",
    )
    group.addoption(
        "--engine-start-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds an engine may take to become healthy (default 300)",
    )
    group.addoption(
        "--request-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds one request to an engine may take before the check fails naming it (default 60)",
    )
    group.addoption(
        "--mutant",
        default=None,
        metavar="NAME",
        help="run the first --engine with one of its mutants (its adapter's mutants.toml) patched "
        "into its own code; other engines run beside it (a cross-stack check's index) and load none "
        "of its modules. `kvconform mutants` runs them all with the clean engine",
    )
    parser.addini("kvconform_results_dir", "where check records are written", default="results")
    parser.addini(
        "kvconform_known_failures",
        "known-failures manifests (default: those shipped with the adapters)",
        type="paths",
        default=[],
    )
    parser.addini(
        "kvconform_env_specs",
        "extra folders of engine environment specs, searched before the adapters' own",
        type="paths",
        default=[],
    )
    parser.addini("kvconform_adapters", "NAME=MODULE:CLASS lines registered for every run", type="linelist")


ACTIVATING_OPTIONS = ("--engine", "--adapter", "--engine-url", "--engine-env", "--engine-profile")


def asked_for_engine(config: pytest.Config) -> bool:
    return any(config.getoption(opt) for opt in ACTIVATING_OPTIONS)


def register_adapters(config: pytest.Config) -> list[str]:
    """Register --adapter / ini kvconform_adapters; returns the names --adapter selects."""
    selected = []
    for raw in [*config.getini("kvconform_adapters"), *config.getoption("--adapter")]:
        name, sep, target = raw.rpartition("=")
        if not sep:
            target = raw
            name = str(getattr(registry.load_target(raw, target), "name", "") or "")
            if not name:
                raise pytest.UsageError(f"kvconform: --adapter {raw}: its class has no `name` (NAME={raw})")
        registry.register(name, target)
        if raw in config.getoption("--adapter"):
            selected.append(name)
    return selected
