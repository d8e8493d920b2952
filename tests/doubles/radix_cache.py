"""Test double for RADIX_CACHE_MODEL: a page-granular radix prefix cache over a slot allocator.

Not an engine. The contract it implements is the one adapters/sglang.py drives through SGLang's
RadixCache (the driver ops its SglangRadixCache client reads):

  insert(token_ids)  one request on the scheduler's path: match, lock the match, allocate the
                     uncached page-aligned suffix (evicting LRU leaves on shortage), cache it,
                     unlock; the partial last page is not cached. -> prefix_len (cached before),
                     cached_len, handle.
  match(token_ids)   longest cached page-aligned prefix -> prefix_len, handle (its last page).
  lock / unlock      lock_ref on the handle's page and its ancestors; unlocking an unlocked
                     page is refused (ValueError).
  evict(num_tokens)  frees least-recently-used unlocked leaves until num_tokens are freed.
  stats              available/total/evictable/protected sizes and capacity, in tokens.
  take_events        BlockStored / BlockRemoved / AllBlocksCleared, SGLang's plain form.

Each tree node holds one page, so a page's hash (chained over its ancestors) never changes.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvconform.adapters.sglang.radix_client import Call, SglangRadixCacheModel
from kvconform.contract import Capability, RadixCacheModel, provides
from kvconform.engines.reference.faults import Fault
from tests.doubles.base import DoubleAdapter

_CHECK = "prefix_reuse::test_radix_cache_state_machine"

FAULTS: dict[str, Fault] = {
    # Each state-machine fault breaks one assertion, the same line at every page size; one page
    # size per fault proves that assertion can fail, every page size is killed by some fault,
    # and Hypothesis' shrinking stays inside the time budget of tests/system/test_engine_only_checks.py.
    # (The three eviction faults fail every page size; a partial page needs page size > 1.)
    "evict_ignores_lock": Fault(
        "eviction picks least-recently-used leaves without looking at lock_ref",
        (f"{_CHECK}[4]",),
        "use-after-free of a running request's KV: a lock not consulted on the eviction path",
        ("invariant_violations",),
    ),
    "evict_leaks_slots": Fault(
        "evicted pages leave the tree but their slots never return to the allocator",
        (f"{_CHECK}[1]",),
        "SGLang's idle check 'token_to_kv_pool_allocator memory leak detected'",
        ("invariant_violations",),
    ),
    "evict_without_event": Fault(
        "eviction publishes no BlockRemoved event",
        (f"{_CHECK}[16]",),
        "KV events missing for evicted blocks: routers keep predicting hits on freed KV",
        ("invariant_violations",),
    ),
    "match_counts_partial_page": Fault(
        "match counts the tokens of a partially matching page into prefix_len (not page-aligned)",
        (f"{_CHECK}[4]", f"{_CHECK}[16]"),
        "paged prefix matching that reports token-level overlap the engine cannot reuse",
        ("invariant_violations",),
    ),
}


@dataclass(eq=False)
class _Page:
    id: int
    tokens: tuple[int, ...]
    parent: _Page | None
    hash: int | str
    children: dict[tuple[int, ...], _Page] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    alive: bool = True


class RadixCache:
    def __init__(self, page_size: int, capacity_tokens: int, fault: str | None) -> None:
        self.page = page_size
        self.capacity = capacity_tokens // page_size * page_size
        self.available = self.capacity
        self.fault = fault
        self.ids = itertools.count()
        self.clock = itertools.count(1)
        self.root = _Page(next(self.ids), (), None, "root")
        self.handles: dict[int, _Page] = {self.root.id: self.root}
        self.events: list[dict[str, Any]] = [{"type": "AllBlocksCleared"}]

    # -- helpers ------------------------------------------------------------------------
    def pages_of(self, tokens: list[int]) -> list[tuple[int, ...]]:
        whole = len(tokens) // self.page * self.page
        return [tuple(tokens[i : i + self.page]) for i in range(0, whole, self.page)]

    def live(self) -> list[_Page]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def walk(self, tokens: list[int]) -> list[_Page]:
        path, node = [], self.root
        for page in self.pages_of(tokens):
            child = node.children.get(page)
            if child is None:
                break
            path.append(child)
            node = child
        now = next(self.clock)
        for n in path:
            n.last_access = now
        return path

    def node(self, handle: int) -> _Page:
        try:
            return self.handles[int(handle)]
        except KeyError:
            raise KeyError(f"unknown handle {handle!r}; handles come from match/insert") from None

    # -- ops ------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> dict[str, Any]:
        path = self.walk(token_ids)
        last = path[-1] if path else self.root
        prefix_len = len(path) * self.page
        if self.fault == "match_counts_partial_page":
            rest = token_ids[prefix_len : prefix_len + self.page]
            overlaps = [0]
            for child in last.children.values():
                n = 0
                while n < len(rest) and child.tokens[n] == rest[n]:
                    n += 1
                overlaps.append(n % self.page)  # a whole page would have been walked
            prefix_len += max(overlaps)
        return {"prefix_len": prefix_len, "handle": last.id, "lock_ref": last.lock_ref}

    def insert(self, token_ids: list[int]) -> dict[str, Any]:
        path = self.walk(token_ids)
        prefix_len = len(path) * self.page
        last = path[-1] if path else self.root
        pages = self.pages_of(token_ids)[len(path) :]
        need = len(pages) * self.page
        self.lock(last.id)  # the running request holds its matched prefix
        try:
            if self.available < need:
                self.evict(need - self.available)
            if self.available < need:
                raise RuntimeError(f"out of KV slots: need {need}, {self.available} free")
            self.available -= need
            now = next(self.clock)
            new = []
            for page in pages:
                # a signed 64-bit block hash chained over the parent, as SGLang publishes them
                digest = int.from_bytes(
                    hashlib.sha256(f"{last.hash}|{page}".encode()).digest()[:8], "big", signed=True
                )
                child = _Page(next(self.ids), page, last, digest, last_access=now)
                last.children[page] = child
                self.handles[child.id] = child
                new.append(child)
                last = child
            if new:
                parent = new[0].parent
                self.events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [p.hash for p in new],
                        "parent_block_hash": None if parent is self.root else parent.hash,
                        "token_ids": [t for p in new for t in p.tokens],
                        "block_size": self.page,
                        "medium": "GPU",
                    }
                )
        finally:
            self.unlock((path[-1] if path else self.root).id)
        return {
            "prefix_len": prefix_len,
            "cached_len": (len(path) + len(pages)) * self.page,
            "handle": last.id,
            "newly_cached_tokens": need,
        }

    def lock(self, handle: int) -> dict[str, Any]:
        node = self.node(handle)
        n: _Page | None = node
        while n is not None and n is not self.root:
            n.lock_ref += 1
            n = n.parent
        return {"lock_ref": node.lock_ref, **self.sizes()}

    def unlock(self, handle: int) -> dict[str, Any]:
        node = self.node(handle)
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of page {node.id}, which nobody locked (lock_ref {node.lock_ref})")
        n: _Page | None = node
        while n is not None and n is not self.root:
            n.lock_ref -= 1
            n = n.parent
        return {"lock_ref": node.lock_ref, **self.sizes()}

    def evict(self, num_tokens: int) -> dict[str, Any]:
        before, freed = self.available, 0
        while freed < num_tokens:
            leaves = [
                n
                for n in self.live()
                if not n.children and (n.lock_ref <= 0 or self.fault == "evict_ignores_lock")
            ]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            assert victim.parent is not None
            del victim.parent.children[victim.tokens]
            victim.alive = False
            freed += self.page
            if self.fault != "evict_leaks_slots":
                self.available += self.page
            if self.fault != "evict_without_event":
                self.events.append({"type": "BlockRemoved", "block_hashes": [victim.hash], "medium": "GPU"})
        return {"num_tokens_evicted": freed, "available_before": before, "available_after": self.available}

    def sizes(self) -> dict[str, int]:
        live = self.live()
        protected = sum(self.page for n in live if n.lock_ref > 0)
        return {"evictable_size": len(live) * self.page - protected, "protected_size": protected}

    def stats(self) -> dict[str, Any]:
        return {
            "available_size": self.available,
            "total_size": len(self.live()) * self.page,
            **self.sizes(),
            "capacity": self.capacity,
            "page_size": self.page,
        }

    def take_events(self, dynamo_format: bool = False) -> list[dict[str, Any]]:
        # Without tenant namespaces (extra_key / cache_salt), SGLang's two event formats are
        # identical, so the double serves both from one record.
        events, self.events = self.events, []
        return events


class RadixCacheDouble(DoubleAdapter):
    """Test double (not an engine) for RADIX_CACHE_MODEL."""

    name = "testdouble_radix_cache"
    capabilities = frozenset({Capability.RADIX_CACHE_MODEL})
    faults: ClassVar[dict[str, Fault]] = FAULTS

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.cache: RadixCache | None = None

    @provides(RadixCacheModel)
    def radix_cache_model(self) -> RadixCacheModel:
        # the double answers the SGLang driver's ops: read through SGLang's client
        return SglangRadixCacheModel(self.build_radix_cache)

    def build_radix_cache(self, page_size: int, capacity_tokens: int) -> Call:
        self.cache = RadixCache(int(page_size), int(capacity_tokens), self.fault)
        return self.call

    def call(self, op: str, **args: Any) -> Any:
        if self.cache is None:
            raise RuntimeError("radix op before build_radix_cache")
        ops = {
            "insert": self.cache.insert,
            "match": self.cache.match,
            "lock": self.cache.lock,
            "unlock": self.cache.unlock,
            "evict": self.cache.evict,
            "stats": self.cache.stats,
            "take_events": self.cache.take_events,
        }
        if op not in ops:
            raise ValueError(f"unknown radix op {op!r} (known: {', '.join(ops)})")
        return ops[op](**args)
