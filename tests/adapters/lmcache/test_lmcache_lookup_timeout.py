"""A lookup LMCache never answers is an error naming the request and its tokens, never 0 hits:
every "expect 0 hits" measure (after a reset, an eviction, damage) would pass on a hung L2
read. The driver's lookup, driven against a client whose prefetch status never comes."""

from __future__ import annotations

import importlib.util
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import ModuleType

import pytest

from kvconform.adapters.lmcache.adapter import DRIVERS
from kvconform.kit.drivers import ENGINE_SIDE_DIR


def driver(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ENGINE_SIDE_DIR))  # as on the driver's PYTHONPATH
    spec = importlib.util.spec_from_file_location("lmcache_mp_client", DRIVERS / "lmcache_mp_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # LMCache itself is imported lazily, by the ops
    return module


def done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass
class Key:
    request_id: str = "req-7"
    model_name: str = "kvc-model"
    token_ids: tuple[int, ...] = field(default_factory=lambda: tuple(range(10, 266)))
    start: int = 0
    end: int = 256


class HungLookups:
    """LOOKUP is accepted; its prefetch status never arrives (None: still pending)."""

    def lookup(self, key: Key, _n: int) -> Future:
        return done(None)

    def query_prefetch_status(self, _request_id: str) -> Future:
        return done(None)


class AnsweredLookups(HungLookups):
    def query_prefetch_status(self, _request_id: str) -> Future:
        return done(0)


def test_hung_lookup_is_an_error_naming_request_and_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TimeoutError, match=r"request req-7 \(model kvc-model, tokens 0\.\.256 of 256"):
        driver(monkeypatch)._lookup_hit_chunks(HungLookups(), Key(), poll_timeout_s=0.2)


def test_answered_miss_reads_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    hit, _ms = driver(monkeypatch)._lookup_hit_chunks(AnsweredLookups(), Key(), poll_timeout_s=0.2)
    assert hit == 0
