"""LMCache's MP coordinator as a RouterIndex: the directory a KV-aware router asks which
instance holds which chunk (lmcache/v1/mp_coordinator, `lmcache coordinator`).

Fed as LMCache's MP servers feed it: cache-event batches POSTed to /events in the wire form
their HttpCacheEventSink publishes (mp_coordinator/cache_events.py:116-137), one emitter per
(worker, data-parallel rank) with its own incarnation and sequence numbers; a `cleared` worker is
a restarted emitter, whose first batch (its config declaration, at a higher incarnation) fences
its earlier L1 placements (ingest/event_gate.py:98-137). Read through /directory/lookup (keys
form) and /directory/keys, whose pages are the dump.

What the coordinator does not do, this side does and says so: it keeps no parent links (a key is
a chunk hash chained over the prefix, multiprocess/token_hasher.py), so a stored block's key is
the coordinator's own hash of its whole prefix (a tokens-form lookup) and a block whose parent is
unknown here cannot be keyed; it answers placements per chunk, so the longest leading run each
instance holds is folded here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from kvconform.contract.facets import Applied, IndexBlock, IndexEvent, RouterIndex
from kvconform.errors import EngineError
from kvconform.kit.server import LaunchedServer
from kvconform.memory import sample_processes
from kvconform.processes import TeardownReport, free_port

# ObjectKey.kv_rank of a one-rank deployment: ComputeKVRank(world_size=1, rank=0, ...)
# (lmcache/v1/distributed/api.py:183-245), the rank the tokens-form lookup fans out to.
KV_RANK = (1 << 24) | (1 << 8)
WORLD_SIZE = 1
TIER, BACKEND = "l1", "dram"  # an MP server's L1 placements: what a restart fences
HASH_MODEL = "kvc-hash"  # the model named in tokens-form lookups (a chunk hash ignores it)
PAGE = 10_000  # /directory/keys' largest page


def key_hex(content_hash: int) -> str:
    return format(content_hash, "064x")  # the width of the coordinator's own (blake3) chunk hashes


@dataclass
class _Emitter:
    """One MP server as the coordinator sees it: an instance id, its incarnation, its sequence."""

    instance: str
    incarnation: int = 1
    seq: int = 0

    def batch(self, event_type: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        self.seq += 1
        return {
            "instance_id": self.instance,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "event_type": event_type,
            "tier": TIER,
            "backend": BACKEND,
            "entries": entries,
            "shared": False,
        }


@dataclass
class _Tree:
    model: str  # the keys' model_name: what keeps trees apart in one directory
    emitters: dict[tuple[int, int], _Emitter] = field(default_factory=dict)
    keys: dict[int, str] = field(default_factory=dict)  # engine block hash -> chunk hash (hex)
    prefix_tokens: dict[int, list[int]] = field(default_factory=dict)  # engine hash -> its whole prefix
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)  # instance id -> (worker, rank)

    def emitter(self, worker: int, dp_rank: int) -> _Emitter:
        if (worker, dp_rank) not in self.emitters:
            emitter = _Emitter(f"{self.model}/w{worker}/dp{dp_rank}")
            self.emitters[(worker, dp_rank)] = emitter
            self.owners[emitter.instance] = (worker, dp_rank)
        return self.emitters[(worker, dp_rank)]

    def empty(self) -> None:
        """What a new directory holds of this tree: nothing, and no emitter yet."""
        self.emitters.clear()
        self.keys.clear()
        self.prefix_tokens.clear()
        self.owners.clear()

    def object_key(self, chunk_hex: str) -> dict[str, Any]:
        return {
            "chunk_hash_hex": chunk_hex,
            "model_name": self.model,
            "kv_rank": KV_RANK,
            "object_group_id": 0,
            "cache_salt": "",
        }


class LmcacheCoordinatorIndex(RouterIndex):
    """One `lmcache coordinator` process, started at first use with the chunk size the blocks
    need (relaunched, its trees emptied, if a later call needs another)."""

    def __init__(
        self, engine: str, program: Callable[[], Path], workdir: Path, env: dict[str, str], timeout_s: float
    ) -> None:
        self.engine = engine
        self.program = program
        self.workdir = workdir
        self.env = env
        self.timeout_s = timeout_s
        self.http = requests.Session()
        self.server: LaunchedServer | None = None
        self.url = ""
        self.chunk_size = 0
        self.trees: dict[str, _Tree] = {}
        self.generation = 0

    # ---- the coordinator process ----------------------------------------------------------
    def _ensure(self, chunk_size: int | None = None) -> None:
        if self.server is not None and chunk_size not in (None, self.chunk_size):
            self.close()  # another chunk size: a new directory, every tree empty again
            for state in self.trees.values():
                state.empty()
        if self.server is None:
            self.chunk_size = chunk_size or 256
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            argv = [
                str(self.program()),
                "coordinator",
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--chunk-size", str(self.chunk_size)),
                # no background work of its own beside what the suite sends
                *("--health-check-interval", "0", "--eviction-check-interval", "0", "--disable-metrics"),
            ]
            self.server = LaunchedServer(
                self.engine,
                "lmcache-coordinator",
                argv,
                self.workdir,
                f"{self.url}/healthz",
                env=self.env,
                timeout_s=self.timeout_s,
                session=self.http,
            )

    def close(self) -> TeardownReport | None:
        server, self.server = self.server, None
        return server.stop() if server is not None else None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        answer = self.http.post(f"{self.url}{path}", json=body, timeout=self.timeout_s)
        if answer.status_code != 200:
            raise EngineError(
                self.engine,
                f"lmcache coordinator POST {path}: HTTP {answer.status_code} {answer.text[:300]}",
                self.server.log_tail() if self.server else "",
            )
        return answer.json()

    def _chunk_hashes(self, tokens: list[int]) -> list[str]:
        """The coordinator's own keys of the whole chunks of `tokens` (from position 0)."""
        answer = self._post(
            "/directory/lookup", {"token_ids": tokens, "model_name": HASH_MODEL, "world_size": WORLD_SIZE}
        )
        return [str(r["key"]["chunk_hash_hex"]) for r in answer["results"]]

    # ---- RouterIndex ------------------------------------------------------------------------
    def new_tree(self, tree: str) -> None:
        self.generation += 1
        self.trees[tree] = _Tree(f"{tree}#{self.generation}")

    def apply(self, tree: str, events: list[IndexEvent]) -> Applied:
        state = self.trees[tree]
        sizes = {len(b.tokens) for e in events for b in e.blocks if b.tokens}
        self._ensure(sizes.pop() if len(sizes) == 1 else None)  # before any emitter is read
        batches: list[dict[str, Any]] = []
        errors: list[str] = []
        for index, event in enumerate(events):
            try:
                batches.append(self._batch(state, event))
            except ValueError as exc:
                errors.append(f"event {index}: {exc}")
        applied = 0
        if batches:
            answer = self._post("/events", {"batches": batches})
            applied = int(answer["applied"])
            dropped = len(batches) - applied
            if dropped:
                errors.append(
                    f"{dropped} of {len(batches)} batches dropped: {answer.get('duplicates')} "
                    f"duplicates, {answer.get('stale')} stale"
                )
        return Applied(applied, len(events) - applied, tuple(errors))

    def _batch(self, state: _Tree, event: IndexEvent) -> dict[str, Any]:
        emitter = state.emitter(event.worker, event.dp_rank)
        if event.kind == "cleared":  # a restarted MP server: its first batch, a new incarnation
            emitter.incarnation += 1
            emitter.seq = 0
            return emitter.batch("config", [])
        if event.kind == "removed":
            unknown = [h for h in event.hashes if h not in state.keys]
            if unknown:
                raise ValueError(f"removal of blocks never stored: {unknown[:3]}")
            entries = [{"key": state.object_key(state.keys[h]), "size_bytes": 0} for h in event.hashes]
            return emitter.batch("delete", entries)
        keys = self._keys_of(state, event.parent, event.blocks)
        entries = [{"key": state.object_key(k), "size_bytes": self.chunk_size} for k in keys]
        return emitter.batch("store", entries)

    def _keys_of(self, state: _Tree, parent: int | None, blocks: tuple[IndexBlock, ...]) -> list[str]:
        if all(b.tokens_hash is not None for b in blocks):  # content hashes given: keys as they are
            keys = [key_hex(b.tokens_hash or 0) for b in blocks]
            state.keys.update((b.hash, k) for b, k in zip(blocks, keys, strict=True))
            return keys
        if parent is not None and parent not in state.prefix_tokens:
            raise ValueError(f"parent {parent} is not a stored block of this tree (its prefix is unknown)")
        if any(len(b.tokens) != self.chunk_size for b in blocks):
            raise ValueError(f"blocks must carry {self.chunk_size} tokens, the chunk size of this directory")
        prefix = list(state.prefix_tokens.get(parent, [])) if parent is not None else []
        paths = []
        for b in blocks:
            prefix = prefix + list(b.tokens)
            paths.append(prefix)
        keys = self._chunk_hashes(paths[-1])[-len(blocks) :]
        for b, path, k in zip(blocks, paths, keys, strict=True):
            state.keys[b.hash] = k
            state.prefix_tokens[b.hash] = path
        return keys

    def match(self, tree: str, content_hashes: list[int]) -> dict[int, int]:
        state = self.trees[tree]
        self._ensure()
        if not content_hashes:
            return {}
        keys = [state.object_key(key_hex(h)) for h in content_hashes]
        results = self._post("/directory/lookup", {"keys": keys})["results"]
        run: dict[str, int] = {}  # instance -> the leading run of the query it holds
        holding: set[str] | None = None
        for result in results:  # one per key, in query order
            here = {p["instance_id"] for p in result["placements"] if p["tier"] == TIER}
            holding = here if holding is None else holding & here
            for instance in holding:
                run[instance] = run.get(instance, 0) + 1
        by_worker: dict[int, int] = {}  # the longest over each worker's ranks
        for instance, blocks in run.items():
            if instance in state.owners:
                worker = state.owners[instance][0]
                by_worker[worker] = max(by_worker.get(worker, 0), blocks)
        return by_worker

    def dump(self, tree: str) -> list[IndexEvent]:
        state = self.trees[tree]
        self._ensure()
        held: dict[tuple[int, int], list[int]] = {}
        for row in self._rows():
            if row["key"]["model_name"] != state.model:
                continue
            for placement in row["placements"]:
                owner = state.owners.get(placement["instance_id"])
                if owner is not None and placement["tier"] == TIER:
                    held.setdefault(owner, []).append(int(row["key"]["chunk_hash_hex"], 16))
        return [
            IndexEvent(
                "stored",
                worker,
                0,
                blocks=tuple(IndexBlock(h, tokens_hash=h) for h in hashes),
                dp_rank=dp_rank,
            )
            for (worker, dp_rank), hashes in sorted(held.items())
        ]

    def _rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        while True:
            answer = self.http.get(
                f"{self.url}/directory/keys",
                params={"offset": len(rows), "limit": PAGE},
                timeout=self.timeout_s,
            )
            answer.raise_for_status()
            page = answer.json()
            rows += page["keys"]
            if not page["keys"] or len(rows) >= int(page["total"]):
                return rows

    def content_hashes(self, tokens: list[int], block_size: int) -> list[int]:
        self._ensure(block_size)
        return [int(k, 16) for k in self._chunk_hashes(tokens)]

    def resident_bytes(self) -> int:
        self._ensure()
        assert self.server is not None
        return int(sample_processes(self.server.pids(), with_pss=False).rss)
