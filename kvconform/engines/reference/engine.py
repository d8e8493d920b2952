"""The reference engine: block pool + host offload tier + disk tier + events + transfer.

Small but faithful: requests are served the way a paged-attention server does (match the
prefix, load what lower tiers hold, compute the rest, cache full blocks), and every number it
exports is the result of that work, so a check that compares numbers with an oracle is
exercised for real. Faults (faults.py) are small deviations on the same paths.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvconform.engines.reference.disk import DiskTier
from kvconform.engines.reference.instances import InstanceRegistry
from kvconform.engines.reference.kvpool import BlockPool, chain_hashes
from kvconform.engines.reference.offload import HostTier
from kvconform.engines.reference.publisher import EventPublisher, cleared_event, removed_event, stored_event

VOCAB_LOW, VOCAB_HIGH = 10, 4000
PAGES_PER_CHUNK, ASSUMED_PAGE = 2, 16  # the page-index conversion's chunking


@dataclass
class EngineSettings:
    block_size: int = 16
    num_blocks: int = 256
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    offload_chunks: int = 0  # 0: no host tier
    disk_dir: Path | None = None
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    decode_delay_s: float = 0.0
    store_delay_s: float = 0.01
    load_delay_s: float = 0.01
    faults: frozenset[str] = frozenset()
    device: str = "cpu"
    latent_dim: int = 576  # MLA layouts: kv_lora_rank + rope dim
    state_components: tuple[int, ...] = (4096, 1024)  # per-layer bytes, layouts with a state

    @property
    def width(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.width * 2  # bfloat16


@dataclass
class Counters:
    prefix_queries: int = 0
    prefix_hits: int = 0
    cached_by_source: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    aborted: int = 0
    transfer_bytes_sent: int = 0
    transfer_bytes_received: int = 0
    transfer_pages_sent: int = 0
    released_twice: int = 0


class Request:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.blocks: list[int] = []
        self.new_blocks: list[int] = []  # blocks this request computed and cached
        self.new_hashes: list[str] = []
        self.released = False


class ReferenceEngine:
    def __init__(self, settings: EngineSettings) -> None:
        self.s = settings
        self.faults = settings.faults
        # vLLM before #51875: the hash chain starts from a seed drawn per process
        self.hash_seed = os.urandom(16).hex() if "none_hash_per_process" in self.faults else ""
        self.lock = threading.RLock()
        self.counters = Counters()
        self.pending_events: list[dict[str, Any]] = []
        self.publisher = EventPublisher(
            settings.events_endpoint, settings.replay_endpoint, "kv", settings.faults
        )
        self.pool = BlockPool(
            settings.num_blocks,
            settings.block_size,
            settings.width,
            settings.device,
            self._on_pool_event,
            settings.faults,
        )
        self.host = (
            HostTier(
                settings.offload_chunks,
                settings.block_bytes,
                settings.faults,
                settings.store_delay_s,
                settings.load_delay_s,
            )
            if settings.offload_chunks
            else None
        )
        self.disk = DiskTier(settings.disk_dir, settings.faults) if settings.disk_dir else None
        self.instances = InstanceRegistry(settings.faults)
        self.router_index: set[str] = set()
        self.session_copies: list[torch.Tensor] = []  # only the session_* faults fill it
        self.received: dict[str, dict[str, Any]] = {}
        self.iterations: list[dict[str, Any]] = []  # per-request pool stats (TRT-LLM-shaped)
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.loop_dead = False  # abort_kills_engine_loop: every request after an abort fails

    # ---- events -------------------------------------------------------------------------
    def _on_pool_event(self, kind: str, hashes: list[str], parent: str | None, _tokens: int) -> None:
        if kind == "stored":
            self.pending_events.append(stored_event(hashes, parent, self.s.block_size, "GPU"))
            self.router_index.update(hashes)
        elif kind == "removed":
            self.pending_events.append(removed_event(hashes, "GPU"))
            if "router_index_stale" not in self.faults:
                self.router_index.difference_update(hashes)
        else:
            self.pending_events.append(cleared_event())
            self.router_index.clear()

    def _flush_events(self) -> None:
        events, self.pending_events = self.pending_events, []
        self.publisher.publish(events)

    # ---- KV content ---------------------------------------------------------------------
    def _compute_block(self, block_id: int, key: str, count: int) -> None:
        """Deterministic 'KV' of a block: a function of its hash (i.e. of the whole prefix)."""
        gen = torch.Generator().manual_seed(int(key[:15], 16))
        values = torch.randn((count, self.s.width), generator=gen).to(torch.bfloat16)
        self.pool.kv[block_id, :count] = values.to(self.pool.kv.device)
        self.pool.kv[block_id, count:] = 0

    def _output(self, req: Request, max_tokens: int) -> list[int]:
        """Output tokens as a function of the KV actually used, so a wrong hit shows."""
        used = self.pool.kv[req.blocks].float()
        digest = hashlib.sha256(used.cpu().numpy().tobytes()).digest()
        base = int.from_bytes(digest[:4], "big")
        return [VOCAB_LOW + (base + i * 7919) % (VOCAB_HIGH - VOCAB_LOW) for i in range(max_tokens)]

    # ---- serving ------------------------------------------------------------------------
    def prefill(self, tokens: list[int]) -> tuple[Request, dict[str, int]]:
        """Match, load from lower tiers, compute the rest; returns cached tokens by source."""
        if not tokens:
            raise ValueError("empty prompt")
        bs = self.s.block_size
        with self.lock:
            req = Request(tokens)
            # what a block's KV is computed from: its tokens, never the seed its hash carries
            content = chain_hashes(tokens, bs)
            hashes = content
            if "block_hash_ignores_tokens" in self.faults:
                hashes = chain_hashes([0] * len(tokens), bs, self.hash_seed)  # position only
            elif self.hash_seed:
                hashes = chain_hashes(tokens, bs, self.hash_seed)
            matchable = (len(tokens) - 1) // bs  # the last prompt token is always computed
            if "full_prompt_matched" in self.faults:
                matchable = len(tokens) // bs
            sources: Counter[str] = Counter()
            hashes_for_match = hashes
            if "granularity_loss" in self.faults and not all(
                h in self.pool.index for h in hashes[:matchable]
            ):
                hashes_for_match = []  # all-or-nothing over the prompt's full blocks
            device = self.pool.match(hashes_for_match[:matchable])
            if "hit_blocks_out_of_order" in self.faults and len(device) >= 2:
                device[0], device[1] = device[1], device[0]
            req.blocks.extend(device)
            sources["device"] = len(device) * bs
            if "queries_counted_on_miss_only" in self.faults:
                self.counters.prefix_queries += len(tokens) - len(device) * bs
            elif "queries_counted_on_hit_only" in self.faults:
                self.counters.prefix_queries += len(tokens) if device else 0
            else:
                self.counters.prefix_queries += len(tokens)
            position = len(device)
            # Lower tiers continue the chain where the device cache stops.
            while position < matchable:
                key = hashes[position]
                data, source = self._load_lower(key)
                if data is None:
                    break
                (block_id,) = self.pool.allocate(1)
                self.pool.kv[block_id] = data.to(self.pool.kv.device)
                self.pool.commit(block_id, key, hashes[position - 1] if position else None)
                req.blocks.append(block_id)
                if source == "host" and "host_hits_unreported" in self.faults:
                    source = "computed"
                sources[source] += bs
                position += 1
            total_blocks = -(-len(tokens) // bs)
            fresh = self.pool.allocate(total_blocks - position)
            for offset, block_id in enumerate(fresh):
                index = position + offset
                start = index * bs
                count = min(bs, len(tokens) - start)
                if index < len(hashes):
                    self._compute_block(block_id, content[index], count)
                    self.pool.commit(block_id, hashes[index], hashes[index - 1] if index else None)
                    req.new_blocks.append(block_id)
                    trailing = index == len(hashes) - 1
                    self._persist(
                        block_id,
                        hashes[index],
                        to_disk=not (trailing and "trailing_block_not_persisted" in self.faults),
                    )
                else:  # the partial tail block: computed, never cached
                    tail_key = hashlib.sha256(
                        f"{content[-1] if content else ''}:{tokens[start:]}".encode()
                    ).hexdigest()
                    self._compute_block(block_id, tail_key, count)
                req.blocks.append(block_id)
            if self.disk is not None and req.new_blocks and "l2_submitted_per_request" in self.faults:
                self.disk.submit_request()
            hits = sum(v for k, v in sources.items() if k != "computed")
            self.counters.prefix_hits += hits
            if "hit_counter_drift" in self.faults and hashes and len(hashes) > matchable:
                self.counters.prefix_hits += bs
            for source, count in sources.items():
                if source != "computed":
                    self.counters.cached_by_source[source] += count
            self.counters.requests += 1
            self._record_iteration(len(req.blocks) - len(fresh), len(fresh))
            if "session_growth" in self.faults:
                # a snapshot of the whole pool per turn: the scale RSS resolves (a copy of one
                # conversation's blocks is below its noise; session_turn_leak is that scale)
                self.session_copies.append(self.pool.kv.clone())
            if "session_turn_leak" in self.faults and fresh:
                self.session_copies.append(self.pool.kv[fresh].clone())  # this turn's new KV
            self._flush_events()
            return req, {"cached": hits, **{k: v for k, v in sources.items() if v}}

    def _record_iteration(self, reused: int, missed: int) -> None:
        """Pool stats as a scheduler iteration would report them, while the request holds
        its blocks: cumulative reuse counters, hit rate = reused / (reused + missed)."""
        self.reused_blocks += reused
        self.missed_blocks += missed
        stats = self.pool.stats()
        free = stats.total - stats.in_use
        if "pool_stats_inconsistent" in self.faults:
            free = stats.free  # forgets cached-but-free blocks
        looked_up = self.reused_blocks + self.missed_blocks
        rate = self.reused_blocks / looked_up if looked_up else 0.0
        published = (self.reused_blocks, self.missed_blocks)
        if "pool_counters_per_iteration" in self.faults:
            published = (reused, missed)  # this iteration's counts, still said to be running totals
        if {"hit_rate_over_iteration", "pool_counters_per_iteration"} & self.faults:
            rate = reused / (reused + missed) if reused + missed else 0.0  # this iteration only
        self.iterations.append(
            {
                "iter": len(self.iterations),
                "maxNumBlocks": stats.total,
                "freeNumBlocks": free,
                "usedNumBlocks": stats.in_use,
                "reusedBlocks": published[0],
                "missedBlocks": published[1],
                "tokensPerBlock": self.s.block_size,
                "cacheHitRate": rate,
            }
        )

    def _load_lower(self, key: str) -> tuple[torch.Tensor | None, str]:
        if self.host is not None and self.host.contains(key):
            data = self.host.load(key)
            if data is not None:
                return data, "host"
        if self.disk is not None and self.disk.contains(key):
            payload = self.disk.read(key)
            if payload is not None:
                expected = self.s.block_bytes
                if len(payload) != expected and "corrupt_hit_served" in self.faults:
                    payload = payload[:expected].ljust(expected, b"\0")  # served padded
                if len(payload) == expected:
                    raw = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16)
                    return raw.view(self.s.block_size, self.s.width), "disk"
        return None, "none"

    def _persist(self, block_id: int, key: str, to_disk: bool = True) -> None:
        data = self.pool.kv[block_id].cpu()
        if self.host is not None:
            self.host.store_async(key, data)
        if self.disk is not None and to_disk:
            self.disk.write(key, data.view(torch.uint8).numpy().tobytes())

    def finish(self, req: Request, abort: bool = False) -> bool:
        """Release a request's blocks; False if the release guard refused a second one."""
        with self.lock:
            if abort:
                done = self._release_aborted(req)
            elif req.released:
                self.counters.released_twice += 1
                done = False
            else:
                self.pool.release(req.blocks)
                done = True
            req.released = True
            self._flush_events()
            return done

    def _release_aborted(self, req: Request) -> bool:
        """An aborted request's freshly computed blocks are not trusted: drop them from the
        cache; shared (matched) blocks are only unreferenced. Exactly once per request: the
        guard refuses a second release (returns False). Without the guard
        (double_release_on_abort) the second release runs the same pool path again, from the
        request's own record: its blocks go back to the free list a second time and shared
        blocks lose a reference they no longer hold, as an unguarded allocator would do."""
        if req.released and "release_guard_asserts" in self.faults:
            raise AssertionError("request already released")
        if req.released and "double_release_on_abort" not in self.faults:
            self.counters.released_twice += 1
            return False
        fresh = set(req.new_blocks)
        dropped = [b for b in req.blocks if b in fresh]
        if "abort_keeps_tail_block" in self.faults and not req.released:
            dropped = dropped[:-1]  # the partial last block stays referenced
        if "abort_announces_uncached_blocks" in self.faults and not req.released:
            uncached = [b for b in req.blocks if self.pool.blocks[b].hash is None]
            for b in uncached:  # a removal per block held, cached or not
                key = hashlib.sha256(f"uncached:{b}:{req.tokens}".encode()).hexdigest()[:32]
                self._on_pool_event("removed", [key], None, 0)
        self.pool.discard(dropped)
        self.pool.release([b for b in req.blocks if b not in fresh])
        if not req.released:
            self.counters.aborted += 1
        return True

    def complete(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        req, sources = self.prefill(tokens)
        try:
            output = self._output(req, max_tokens)
        finally:
            self.finish(req)
        return {
            "prompt_tokens": len(tokens),
            "cached": sources.pop("cached"),
            "sources": sources,
            "output": output,
        }

    def reset_prefix_cache(self, lower_tiers: bool = False) -> bool:
        """Reset the device prefix cache (and, if asked, the host tier), as vLLM does."""
        with self.lock:
            ok = self.pool.reset()
            if ok and lower_tiers and self.host is not None and "reset_keeps_prefix" not in self.faults:
                self.host.reset()
            self._flush_events()
            return ok

    def router_predict(self, tokens: list[int]) -> int:
        """The router's view: longest chain of the prompt's full blocks its index holds (cached
        blocks, as Dynamo's router counts them: no engine's last-token rule)."""
        bs = self.s.block_size
        with self.lock:
            matched = 0
            for h in chain_hashes(tokens, bs, self.hash_seed)[: len(tokens) // bs]:
                if h not in self.router_index:
                    break
                matched += 1
            return matched * bs

    # ---- transfer (prefill side) ----------------------------------------------------------
    def kv_indices(self, req: Request) -> list[int]:
        bs = self.s.block_size
        return [req.blocks[pos // bs] * bs + pos % bs for pos in range(len(req.tokens))]

    def page_indices(self, kv_indices: list[int], page_size: int) -> list[int]:
        """The page of every page-start slot. The conversion runs in fixed chunks of
        PAGES_PER_CHUNK pages; page_indices_truncated sizes the loop in tokens as if every page
        held ASSUMED_PAGE tokens (SGLang #11985), so smaller pages lose the tail of the list."""
        starts = kv_indices[::page_size]
        if "page_indices_truncated" in self.faults:
            chunk_tokens = PAGES_PER_CHUNK * ASSUMED_PAGE
            loops = -(-len(kv_indices) // chunk_tokens)
            starts = starts[: loops * PAGES_PER_CHUNK]
        pages: list[int] = []
        for index, slot in enumerate(starts):
            page = slot // page_size
            if "virtual_page_indices" in self.faults:
                page = index  # the request's own numbering, not the pool's
            pages.append(page)
        return pages

    def transfer_plan(self, layout: str, page_size: int, destinations: int) -> dict[str, Any]:
        """Bytes per page and per state, and how many copies each destination rank needs."""
        s = self.s
        if layout == "mha":
            page_bytes = s.layers * 2 * s.kv_heads * s.head_dim * 2 * page_size
            return {"page_bytes": page_bytes, "states": [], "copies": 1, "shards": destinations}
        states = [s.layers * item for item in s.state_components] if layout == "mla_state" else []
        page_bytes = s.layers * s.latent_dim * 2 * page_size
        return {"page_bytes": page_bytes, "states": states, "copies": destinations, "shards": 1}

    def page_payload(self, page: int, page_size: int, page_bytes: int) -> bytes:
        flat = self.pool.kv.view(-1, self.s.width)
        start = page * page_size
        rows = flat[start : start + page_size].float().cpu().numpy().tobytes()
        return (rows * (page_bytes // max(len(rows), 1) + 1))[:page_bytes]

    # ---- transfer (decode side) -----------------------------------------------------------
    def receive(
        self,
        transfer_id: str,
        replica: int,
        payload: bytes,
        state: bool = False,
        page_size: int = 1,
        prompt_tokens: int = 0,
        prefill_cached: int = 0,
    ) -> None:
        """The decode side's own accounting of a hand-off: bytes it received, the prompt
        tokens it will serve (what the prefill side announced) and the cached tokens its answer
        reports (what the prefill side reused: the decode side keeps received pages apart from
        its own cache)."""
        with self.lock:
            entry = self.received.setdefault(
                transfer_id,
                {"bytes": 0, "replicas": set(), "digest": {}, "pages": {}, "prompt_tokens": 0},
            )
            counted = 0 if state and "receiver_drops_state_bytes" in self.faults else len(payload)
            entry["bytes"] += counted
            entry["replicas"].add(replica)
            entry["digest"][replica] = hashlib.sha256(payload).hexdigest()
            if not state:
                entry["pages"][replica] = entry["pages"].get(replica, 0) + 1
            entry["prompt_tokens"] = prompt_tokens
            entry["cached_tokens"] = 0 if "decode_usage_reports_own_cache" in self.faults else prefill_cached
            if "disagg_prompt_tokens_from_pages" in self.faults:
                entry["prompt_tokens"] = max(entry["pages"].values(), default=0) * page_size
            self.counters.transfer_bytes_received += counted

    def close(self) -> None:
        self.instances.close()
        if self.host is not None:
            self.host.close()
        self.publisher.close()
