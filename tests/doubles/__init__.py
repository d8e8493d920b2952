"""Test doubles: small, in-process Python implementations of capability contracts that only
real engines offer today (RADIX_CACHE_MODEL, RADIX_INDEX, TRACE_REPLAY, BLOCK_TRACKER, a
router that says how many KV events it applied, and REMOTE_TIER: a prefix cache with a remote
L2 store the suite can read, damage and stop).

They exist to prove the checks for those capabilities can fail and pass, without a real
engine (tests/system/test_engine_only_checks.py). A run against a double is never a run of any
engine: the engines are named `testdouble_*` and report the version "test double (...)".

They are registered as engines only inside a test run that loads `-p tests.doubles.plugin`;
normal runs never see them. The fault (at most one per run) is chosen by the environment
variable KVCONFORM_DOUBLE_FAULT; each fault belongs to one double and is modelled on a real bug.
"""

from __future__ import annotations

import importlib

from kvconform.engines.reference.faults import Fault

FAULT_ENV = "KVCONFORM_DOUBLE_FAULT"

# engine name -> "module:class", registered by tests/doubles/plugin.py only.
DOUBLES: dict[str, str] = {
    "testdouble_radix_cache": "tests.doubles.radix_cache:RadixCacheDouble",
    "testdouble_radix_index": "tests.doubles.radix_index:RadixIndexDouble",
    "testdouble_replay": "tests.doubles.replay:ReplayDouble",
    "testdouble_block_tracker": "tests.doubles.block_tracker:BlockTrackerDouble",
    "testdouble_router": "tests.doubles.router:RouterDouble",
    "testdouble_remote_tier": "tests.doubles.remote_tier:RemoteTierDouble",
}


def double_class(name: str) -> type:
    module_name, class_name = DOUBLES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def faults_by_double() -> dict[str, dict[str, Fault]]:
    return {name: dict(double_class(name).faults) for name in DOUBLES}
