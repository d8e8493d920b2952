"""kvconform driver for SGLang, in-process, on CPU.

Run with the SGLang environment's interpreter (never the suite's):

    <sglang-venv>/bin/python adapters/drivers/sglang_driver.py

It speaks the JSON-lines protocol of jsonl_loop.py on stdio. What it drives is SGLang's own
code, imported from the installed package: the radix prefix cache (RadixCache), the token
allocators (TokenToKVPoolAllocator / PagedTokenToKVPoolAllocator), the KV pools
(MHATokenToKVPool / MLATokenToKVPool), the request-to-token pool, the scheduler's allocation and
release helpers (mem_cache/allocation.py, mem_cache/common.py), the KV event recorder
(mem_cache/events.py), the PD-disaggregation byte accounting (disaggregation/common/conn.py)
and Mooncake's KV send into a decode pool (sglang_receiver.py).

The glue here is ours and kept thin: it builds the objects, plays the scheduler's part for one
request at a time (match -> lock -> allocate -> write the request's row -> release), and turns
results into JSON. Where the glue replaces something SGLang would normally have (a server
config, process-group ranks, the bootstrap HTTP registration, the transfer engine), the op's
docstring says so.

Environment set before SGLang is imported (only when not already set):
  TORCH_EXTENSIONS_DIR  <venv>/torch_extensions — SGLang JIT-builds a small C++ extension
                        (hicache_hash_cpp, SHA-256 page hashes) on first use (~8 s, g++ and
                        OpenSSL headers needed); keeping it in the venv keeps the venv whole.
  SGLANG_HOST_IP        127.0.0.1 — the disaggregation KV manager binds one ZMQ PULL socket on
                        this address; nothing is sent on it.
"""

from __future__ import annotations

import enum
import importlib.util
import inspect
import os
import socket
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
warnings.filterwarnings("ignore")

import jsonl_loop  # noqa: E402  (engine_side/, on the driver's PYTHONPATH)
from jsonl_loop import serve  # noqa: E402

# sglang.srt.configs imports image-preprocessing helpers that import torchvision at module
# level; PyPI torchvision cannot sit beside the CPU torch. Our stand-in (engine_side/standins,
# beside jsonl_loop) goes at the END of sys.path and only when no torchvision is installed.
# See its docstring.
_STUBS = os.path.join(os.path.dirname(jsonl_loop.__file__), "standins")
TORCHVISION_STANDIN = importlib.util.find_spec("torchvision") is None
if TORCHVISION_STANDIN and _STUBS not in sys.path:
    sys.path.append(_STUBS)

_t_import = time.perf_counter()
from array import array  # noqa: E402
from importlib.metadata import version as _dist_version  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel, get_server_args  # noqa: E402

# SGLang reads its process-wide config through runtime_context; a server publishes it at start.
# In-process we publish SGLang's own test-style dummy config (ServerArgs(model_path="dummy"),
# resolved) with device=cpu. Defaults that matter here: no speculative decoding,
# strip_thinking_cache False, page_size from our ops, tp/cp/pp/dp sizes 1.
if hasattr(get_context(), "override_server_args"):  # 0.5.16 and later
    _SERVER_ARGS_OVERRIDE = get_context().override_server_args(device="cpu")
    _SERVER_ARGS_OVERRIDE.install()
else:  # 0.5.15.post1: the same dummy config, published whole
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="dummy", device="cpu"))

from sglang.srt.disaggregation.base.conn import KVArgs  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, is_mla_backend  # noqa: E402
from sglang.srt.mem_cache.common import kv_to_page_indices  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)

# The cache ops speak the scheduler API of 0.5.22+ (mem_cache/allocation.py, the event
# recorder); the release-history corpus runs the transfer ops on releases without them
# (0.5.15.post1, 0.5.16), where a cache op fails naming the missing module instead.
try:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.allocation import (
        alloc_paged_token_slots_extend,
        alloc_req_slots,
        alloc_token_slots,
    )
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
    from sglang.srt.sampling.sampling_params import SamplingParams

    CACHE_API_MISSING: ImportError | None = None
except ImportError as exc:
    CACHE_API_MISSING = exc

IMPORT_SECONDS = time.perf_counter() - _t_import
ENGINE = "sglang"
VERSION = _dist_version("sglang")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

# Ranks a launcher would publish before a KV manager is built. CommonKVManager.__init__ reads
# these; with every size 1 they are all rank 0 (pp_group is a process-group handle, unused
# at pp_size 1).
_PARALLEL_RANKS = dict(attn_tp_rank=0, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0)


# --------------------------------------------------------------------------------------------
# Event fan-out: one SGLang recorder per format, fed the same calls.
# --------------------------------------------------------------------------------------------


class _TwoFormatRecorder:
    """Feeds every record_* call to two real KVCacheEventRecorder instances — SGLang's own
    format and dynamo_kv_event_format=True — so one cache can be read in either format.
    The format only changes how a block hash is namespaced (extra_key / cache_salt) and how a
    LoRA name is resolved; both are computed by SGLang's recorder at record time."""

    def __init__(self, enabled: bool, page_size: int, lora_names: Any) -> None:
        self.sglang = KVCacheEventRecorder(
            enabled=enabled, page_size=page_size, dynamo_format=False, lora_names=lora_names
        )
        self.dynamo = KVCacheEventRecorder(
            enabled=enabled, page_size=page_size, dynamo_format=True, lora_names=lora_names
        )
        self.enabled = enabled
        self.page_size = page_size
        self.lora_names = lora_names

    def record_store(self, node: Any, medium: Any = None, **kwargs: Any) -> None:
        self.sglang.record_store(node, medium, **kwargs)
        self.dynamo.record_store(node, medium, **kwargs)

    def record_remove(self, node: Any, medium: Any = None) -> None:
        self.sglang.record_remove(node, medium)
        self.dynamo.record_remove(node, medium)

    def record_all_cleared(self) -> None:
        self.sglang.record_all_cleared()
        self.dynamo.record_all_cleared()

    def enqueue(self, event: Any) -> None:  # not used by RadixCache; kept for completeness
        raise NotImplementedError("direct enqueue is not fanned out")

    def take(self) -> list:
        # RadixCache.take_events() lands here: SGLang's own format.
        return self.sglang.take()


def _event_to_json(event: Any) -> dict:
    out: dict[str, Any] = {"type": type(event).__name__}
    for field in type(event).__struct_fields__:
        value = getattr(event, field)
        if isinstance(value, enum.Enum):
            value = value.value  # StorageMedium.GPU -> "GPU"
        if field == "token_ids" and value is not None:
            value = [list(t) if isinstance(t, tuple) else int(t) for t in value]
        out[field] = value
    return out


# --------------------------------------------------------------------------------------------
# The cache under test.
# --------------------------------------------------------------------------------------------


class _CacheSession:
    def __init__(
        self,
        *,
        page_size: int,
        capacity_tokens: int,
        allocator: str,
        enable_kv_events: bool,
        eviction_policy: str,
        kv_pool: str,
        head_num: int,
        head_dim: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        dtype: str,
        max_requests: int,
        max_context_len: int,
        need_sort: bool,
    ) -> None:
        if allocator not in ("token", "paged"):
            raise ValueError("allocator must be 'token' or 'paged'")
        if allocator == "token" and page_size != 1:
            raise ValueError("TokenToKVPoolAllocator is page_size 1 only; use allocator='paged'")
        torch_dtype = _DTYPES[dtype]
        self.page_size = page_size
        self.allocator_kind = allocator
        if kv_pool == "mha":
            self.kv_pool = MHATokenToKVPool(
                size=capacity_tokens,
                page_size=page_size,
                dtype=torch_dtype,
                head_num=head_num,
                head_dim=head_dim,
                layer_num=layer_num,
                device="cpu",
                enable_memory_saver=False,
                enable_alt_stream=False,
            )
        elif kv_pool == "mla":
            self.kv_pool = MLATokenToKVPool(
                size=capacity_tokens,
                page_size=page_size,
                dtype=torch_dtype,
                kv_lora_rank=kv_lora_rank,
                qk_rope_head_dim=qk_rope_head_dim,
                layer_num=layer_num,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            raise ValueError("kv_pool must be 'mha' or 'mla'")
        if allocator == "token":
            self.allocator = TokenToKVPoolAllocator(
                capacity_tokens, torch_dtype, "cpu", self.kv_pool, need_sort=need_sort
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                capacity_tokens, page_size, torch_dtype, "cpu", self.kv_pool, need_sort=need_sort
            )
        self.req_to_token_pool = ReqToTokenPool(
            size=max_requests,
            max_context_len=max_context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            eviction_policy=eviction_policy,
            enable_kv_cache_events=enable_kv_events,
            dynamo_kv_event_format=False,
        )
        self.cache = RadixCache(params)
        # Swap in the two-format fan-out (same SGLang recorder class, both formats).
        self.events = _TwoFormatRecorder(
            enabled=enable_kv_events, page_size=page_size, lora_names=params.kv_event_lora_names
        )
        self.cache.kv_events = self.events
        # RadixCache.__init__ -> reset() already recorded one AllBlocksCleared in the recorder
        # we replaced; record it in ours too so the stream starts the same way.
        self.events.record_all_cleared()
        self.capacity = self.allocator.available_size()
        self.nodes: dict[int, TreeNode] = {}
        self.next_rid = 0

    # -- helpers ------------------------------------------------------------------------

    def handle(self, node: TreeNode) -> int:
        self.nodes[node.id] = node
        return node.id

    def node(self, handle: int) -> TreeNode:
        try:
            return self.nodes[int(handle)]
        except KeyError:
            raise KeyError(f"unknown handle {handle!r}; handles come from match/insert") from None

    def stats(self) -> dict:
        c, a = self.cache, self.allocator
        available = int(a.available_size())
        total = int(c.total_size())
        evictable = int(c.evictable_size())
        protected = int(c.protected_size())
        return {
            "available_size": available,
            "total_size": total,
            "evictable_size": evictable,
            "protected_size": protected,
            "capacity": self.capacity,
            "page_size": self.page_size,
            "allocator": self.allocator_kind,
            "req_rows_available": int(self.req_to_token_pool.available_size()),
            "available_plus_cached": available + total,
            "evictable_plus_protected": evictable + protected,
        }

    def new_req(self, token_ids: list[int], extra_key: str | None, cache_salt: str | None) -> Req:
        self.next_rid += 1
        return Req(
            f"kvc-{self.next_rid}",
            "",
            array("q", token_ids),
            SamplingParams(max_new_tokens=1),
            extra_key=extra_key,
            cache_salt=cache_salt,
        )

    def admit(self, req: Req) -> dict:
        """The scheduler's part for one prefill: match (Req.init_next_round_input ->
        mem_cache.common.match_kv_cache), lock the matched node (BasePrefixCache.lock), take a
        request row (allocation.alloc_req_slots), allocate the uncached suffix
        (allocation.alloc_token_slots, or alloc_paged_token_slots_extend with last_loc as the
        scheduler builds it; both evict from the tree on shortage), write the row (the
        non-Triton branch of allocation.write_cache_indices, done here with
        ReqToTokenPool.write) and record kv_allocated_len / kv_committed_len as
        alloc_for_extend does."""
        c = self.cache
        n = len(req.origin_input_ids)
        req.init_next_round_input(c)
        prefix_len = int(req.prefix_len)
        prefix = c.prefix_device_indices(req) if prefix_len else torch.empty((0,), dtype=torch.int64)
        req.lock = c.lock(req.last_node)
        available_before_alloc = int(self.allocator.available_size())
        alloc_req_slots(self.req_to_token_pool, [req], c)
        extend = n - prefix_len
        if self.allocator_kind == "token":
            out = alloc_token_slots(c, extend)
        else:
            last_loc = prefix[-1:] if len(prefix) else torch.full((1,), -1, dtype=torch.int64)
            out = alloc_paged_token_slots_extend(
                tree_cache=c,
                prefix_lens=torch.tensor([prefix_len], dtype=torch.int64),
                prefix_lens_cpu=torch.tensor([prefix_len], dtype=torch.int64),
                seq_lens=torch.tensor([n], dtype=torch.int64),
                seq_lens_cpu=torch.tensor([n], dtype=torch.int64),
                last_loc=last_loc,
                extend_num_tokens=extend,
            )
        row = req.kv.req_pool_idx
        self.req_to_token_pool.write((row, slice(0, prefix_len)), prefix)
        self.req_to_token_pool.write((row, slice(prefix_len, n)), out)
        req.kv.kv_allocated_len = n
        req.kv.kv_committed_len = n
        return {
            "prefix_len": prefix_len,
            "allocated_tokens": int(extend),
            "allocated_indices": out.tolist(),
            "kv_indices": torch.cat([prefix.to(torch.int64), out.to(torch.int64)]).tolist(),
            "available_before_alloc": available_before_alloc,
            "available_after_alloc": int(self.allocator.available_size()),
        }


_S: _CacheSession | None = None


def _require_cache_api() -> None:
    if CACHE_API_MISSING is not None:
        raise RuntimeError(f"sglang {VERSION} lacks the cache API these ops speak: {CACHE_API_MISSING}")


def _session() -> _CacheSession:
    if _S is None:
        _require_cache_api()
        raise RuntimeError("no cache: call new_cache first")
    return _S


def _key(token_ids: list[int], extra_key: str | None, cache_salt: str | None) -> RadixKey:
    return RadixKey(array("q", [int(t) for t in token_ids]), extra_key, cache_salt=cache_salt)


# --------------------------------------------------------------------------------------------
# Ops: radix cache lifecycle
# --------------------------------------------------------------------------------------------


def op_ping() -> dict:
    return {"pong": True}


def op_info() -> dict:
    return {
        "engine": ENGINE,
        "version": VERSION,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torchvision_standin": TORCHVISION_STANDIN,
        "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
        "import_seconds": round(IMPORT_SECONDS, 3),
        "cache_api": CACHE_API_MISSING is None,
    }


def op_new_cache(
    page_size: int = 1,
    capacity_tokens: int = 256,
    allocator: str = "token",
    enable_kv_events: bool = True,
    eviction_policy: str = "lru",
    kv_pool: str = "mha",
    head_num: int = 1,
    head_dim: int = 8,
    kv_lora_rank: int = 16,
    qk_rope_head_dim: int = 8,
    layer_num: int = 1,
    dtype: str = "bfloat16",
    max_requests: int = 8,
    max_context_len: int | None = None,
    need_sort: bool = False,
) -> dict:
    global _S
    _require_cache_api()
    _S = _CacheSession(
        page_size=int(page_size),
        capacity_tokens=int(capacity_tokens),
        allocator=allocator,
        enable_kv_events=bool(enable_kv_events),
        eviction_policy=eviction_policy,
        kv_pool=kv_pool,
        head_num=int(head_num),
        head_dim=int(head_dim),
        kv_lora_rank=int(kv_lora_rank),
        qk_rope_head_dim=int(qk_rope_head_dim),
        layer_num=int(layer_num),
        dtype=dtype,
        max_requests=int(max_requests),
        max_context_len=int(max_context_len or capacity_tokens + page_size),
        need_sort=bool(need_sort),
    )
    out = _S.stats()
    _, _, item_lens = _S.kv_pool.get_contiguous_buf_infos()
    out["kv_item_lens"] = [int(x) for x in item_lens]
    out["kv_pool"] = type(_S.kv_pool).__name__
    out["allocator_class"] = type(_S.allocator).__name__
    return out


def op_insert(
    token_ids: list[int],
    extra_key: str | None = None,
    cache_salt: str | None = None,
    path: str = "request",
) -> dict:
    """Cache one token sequence.

    path="request" (default): one request's life as the scheduler runs it — admit (match,
    lock, allocate the uncached suffix, write the row), finish, then
    mem_cache.common.release_kv_cache(req, tree, checkpoint=True), which inserts the
    page-aligned key (RadixCache.checkpoint -> _insert_cache), frees duplicate and
    partial-page slots and unlocks.
    path="direct": match; allocate the uncached page-aligned suffix with allocator.alloc;
    RadixCache.insert(InsertParams(key, value)). No request row involved.
    """
    s = _session()
    c = s.cache
    before = s.stats()
    if path == "request":
        req = s.new_req(token_ids, extra_key, cache_salt)
        admitted = s.admit(req)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, c, checkpoint=True)
        last = req.last_node
        prefix_len = admitted["prefix_len"]
        extra = {"allocated_tokens": admitted["allocated_tokens"], "kv_indices": admitted["kv_indices"]}
    elif path == "direct":
        key = _key(token_ids, extra_key, cache_salt)
        m = c.match_prefix(MatchPrefixParams(key=key))
        prefix_len = int(m.device_prefix_len)
        prefix = c.path_device_indices(m.last_device_node)[:prefix_len]
        aligned = len(key) // s.page_size * s.page_size
        need = aligned - prefix_len
        lock = c.lock(m.last_device_node)
        try:
            if need > 0 and s.allocator.available_size() < need:
                c.evict(EvictParams(num_tokens=need - s.allocator.available_size()))
            new = s.allocator.alloc(need) if need > 0 else torch.empty((0,), dtype=torch.int64)
            if new is None:
                raise RuntimeError(f"allocator out of space for {need} tokens")
            res = c.insert(InsertParams(key=key, value=torch.cat([prefix, new])))
        finally:
            c.unlock(lock)
        last = res.last_device_node
        extra = {"allocated_tokens": int(need), "insert_prefix_len": int(res.prefix_len)}
    else:
        raise ValueError("path must be 'request' or 'direct'")
    after = s.stats()
    cached = c.match_prefix(MatchPrefixParams(key=_key(token_ids, extra_key, cache_salt)))
    return {
        "prefix_len": prefix_len,
        "newly_cached_tokens": after["total_size"] - before["total_size"],
        "cached_len": int(cached.device_prefix_len),
        "handle": s.handle(last),
        "available_before": before["available_size"],
        "available_after": after["available_size"],
        **extra,
    }


def op_match(token_ids: list[int], extra_key: str | None = None, cache_salt: str | None = None) -> dict:
    """RadixCache.match_prefix. May split a node (SGLang does that to expose the boundary);
    a split records no KV event."""
    s = _session()
    m = s.cache.match_prefix(MatchPrefixParams(key=_key(token_ids, extra_key, cache_salt)))
    node = m.last_device_node
    return {
        "prefix_len": int(m.device_prefix_len),
        "handle": s.handle(node),
        "is_root": node is s.cache.root_node,
        "lock_ref": int(node.lock_ref),
    }


def op_lock(handle: int) -> dict:
    """RadixCache.inc_lock_ref on the node (and its ancestors)."""
    s = _session()
    node = s.node(handle)
    r = s.cache.inc_lock_ref(node)
    return {"delta": int(r.delta or 0), "lock_ref": int(node.lock_ref), **_sizes(s)}


def op_unlock(handle: int) -> dict:
    """RadixCache.dec_lock_ref on the node (and its ancestors). SGLang has no guard against
    unlocking an unlocked node; lock_ref is reported as SGLang leaves it."""
    s = _session()
    node = s.node(handle)
    r = s.cache.dec_lock_ref(node)
    return {"delta": int(r.delta or 0), "lock_ref": int(node.lock_ref), **_sizes(s)}


def _sizes(s: _CacheSession) -> dict:
    return {
        "evictable_size": int(s.cache.evictable_size()),
        "protected_size": int(s.cache.protected_size()),
    }


def op_evict(num_tokens: int) -> dict:
    s = _session()
    before = int(s.allocator.available_size())
    r = s.cache.evict(EvictParams(num_tokens=int(num_tokens)))
    return {
        "num_tokens_evicted": int(r.num_tokens_evicted),
        "available_before": before,
        "available_after": int(s.allocator.available_size()),
    }


def op_stats() -> dict:
    return _session().stats()


def op_take_events(dynamo_format: bool = False, both: bool = False) -> Any:
    """Drain the cache's KV events. Both formats are recorded side by side and drained
    together; returns the asked-for one, or {"sglang": [...], "dynamo": [...]} with both."""
    s = _session()
    own = [_event_to_json(e) for e in s.events.sglang.take()]
    dyn = [_event_to_json(e) for e in s.events.dynamo.take()]
    if both:
        return {"sglang": own, "dynamo": dyn}
    return dyn if dynamo_format else own


def op_reset(mode: str = "flush") -> dict:
    """mode="flush": what Scheduler.flush_cache does on an idle server — tree_cache.reset(),
    req_to_token_pool.clear(), token_to_kv_pool_allocator.clear().
    mode="tree_only": RadixCache.reset() alone (the allocator keeps the tree's slots)."""
    s = _session()
    s.cache.reset()
    if mode == "flush":
        s.req_to_token_pool.clear()
        s.allocator.clear()
    elif mode != "tree_only":
        raise ValueError("mode must be 'flush' or 'tree_only'")
    s.nodes.clear()
    return s.stats()


# --------------------------------------------------------------------------------------------
# Ops: disaggregation accounting
# --------------------------------------------------------------------------------------------


class _NoBootstrapKVManager(CommonKVManager):
    """CommonKVManager whose register_to_bootstrap (an HTTP PUT to the bootstrap server) does
    nothing. Everything else in __init__ is SGLang's, run in PREFILL mode."""

    def register_to_bootstrap(self) -> None:  # stub: no bootstrap server here
        return None


_MANAGERS: dict[int, CommonKVManager] = {}
_SENDERS: dict[int, CommonKVSender] = {}
_IDS = {"next": 0}


def _next_id() -> int:
    _IDS["next"] += 1
    return _IDS["next"]


def _state_single_rank_topology() -> None:
    """Rank 0 of size 1 everywhere, as a one-GPU launcher would have it before a KV manager is
    built. From 0.5.20 the runtime context takes it as overrides; earlier releases read the
    process groups and the DP-attention slots, which a launcher sets up with SGLang's own
    initializers (ModelRunner.init_torch_distributed on CPU: gloo, one rank), run here once."""
    par = get_parallel()
    if hasattr(par, "override_permanently"):
        for name, value in _PARALLEL_RANKS.items():
            par.override_permanently(**{name: value})
        par.override_permanently(pp_group=None)
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    if parallel_state.model_parallel_is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    parallel_state.initialize_model_parallel()
    # What initialize_dp_attention reads of the model config: hf_config's hybrid_override_pattern
    # and (0.5.16) the hidden size and dtype of the DP gather buffers, which one DP rank never
    # allocates (so no model's hidden size is needed: the transfer ops know only the KV pool).
    model = SimpleNamespace(hf_config=SimpleNamespace(), hidden_size=1, dtype=torch.bfloat16)
    dp_attention.initialize_dp_attention(get_server_args(), model)


def _build_pool(pool_spec: dict, size: int | None = None) -> Any:
    kind = pool_spec.get("kind", "mha")
    page_size = int(pool_spec.get("page_size", 1))
    dtype = _DTYPES[pool_spec.get("dtype", "bfloat16")]
    size = size or int(pool_spec.get("size", 16 * page_size))
    layers = int(pool_spec.get("layer_num", 1))
    if kind == "mha":
        pool = MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            head_num=int(pool_spec.get("head_num", 1)),
            head_dim=int(pool_spec.get("head_dim", 8)),
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
    elif kind == "mla":
        pool = MLATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            kv_lora_rank=int(pool_spec.get("kv_lora_rank", 16)),
            qk_rope_head_dim=int(pool_spec.get("qk_rope_head_dim", 8)),
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
        )
    else:
        raise ValueError("pool.kind must be 'mha' or 'mla'")
    return pool


def _pool_item_lens(pool_spec: dict) -> tuple[list[int], bool]:
    pool = _build_pool(pool_spec)
    _, _, item_lens = pool.get_contiguous_buf_infos()
    return [int(x) for x in item_lens], is_mla_backend(pool)


def op_alloc_kv(num_tokens: int, pool: dict) -> dict:
    """KV indices for one request of `num_tokens` without a cached prefix, from SGLang's token
    allocator (TokenToKVPoolAllocator, or PagedTokenToKVPoolAllocator.alloc of whole pages, the
    request using the first num_tokens slots) over a pool of the transfer's shape: what the
    scheduler's allocation helpers return for such a request. For releases whose cache API the
    cache ops do not speak; elsewhere the transfer allocates through the radix cache (insert)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    page_size = int(pool.get("page_size", 1))
    pages = -(-int(num_tokens) // page_size)
    size = (pages + 1) * page_size
    kv = _build_pool(pool, size)
    dtype = _DTYPES[pool.get("dtype", "bfloat16")]
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, dtype, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", kv, need_sort=False)
    out = allocator.alloc(pages * page_size)
    if out is None:
        raise RuntimeError(f"the allocator refused {num_tokens} tokens from a pool of {size}")
    return {"kv_indices": [int(i) for i in out[: int(num_tokens)]]}


def op_transfer_land(pool: dict, page_indices: list[int], receivers: int) -> dict:
    """SGLang's Mooncake send_kvcache (real) from a prefill pool into `receivers` decode pools
    of the same shape; what each receiver holds afterwards (sglang_receiver.py, imported here:
    an older release's Mooncake module must not stop the driver's other ops)."""
    from sglang_receiver import land

    page_size = int(pool.get("page_size", 1))
    src = _build_pool(pool, (max(page_indices) + 1) * page_size)
    is_mla = is_mla_backend(src)
    landed = [
        land(src, _build_pool(pool, (len(page_indices) + 1) * page_size), page_indices, is_mla, seed)
        for seed in range(receivers)
    ]
    return {
        "bytes_received": sum(r["bytes_received"] for r in landed),
        "bytes_outside_receiver": sum(r["bytes_outside_receiver"] for r in landed),
        "send_status": [r["send_status"] for r in landed],
    }


def op_kv_to_page_indices(kv_indices: list[int], page_size: int) -> list[int]:
    """mem_cache.common.kv_to_page_indices, as the PD prefill path calls it."""
    t = torch.tensor([int(i) for i in kv_indices], dtype=torch.int64)
    return [int(p) for p in kv_to_page_indices(t, int(page_size))]


def op_transfer_manager_new(
    kv_item_lens: list[int] | None = None,
    state_item_lens: list[list[int]] | None = None,
    is_mla: bool | None = None,
    pool: dict | None = None,
) -> dict:
    """Build SGLang's CommonKVManager (disaggregation_mode=PREFILL).

    Real: CommonKVManager.__init__ (sums kv_item_lens and the per-component state_item_lens,
    pins the replica factor to 1 for non-MLA and leaves it unresolved for MLA), and — when
    `pool` is given — the KV pool and its get_contiguous_buf_infos() item lengths
    (is_mla then comes from disaggregation.utils.is_mla_backend(pool)).
    Stubbed: KVArgs is filled with only what the accounting reads (no buffer pointers are
    registered anywhere), register_to_bootstrap is a no-op, parallel ranks are stated as 0,
    one ZMQ PULL socket is bound on 127.0.0.1 and never used.
    """
    if pool is not None:
        kv_item_lens, pool_is_mla = _pool_item_lens(pool)
        if is_mla is None:
            is_mla = pool_is_mla
    if kv_item_lens is None:
        raise ValueError("give kv_item_lens or pool")
    _state_single_rank_topology()
    args = KVArgs()
    args.kv_data_ptrs = []
    args.kv_data_lens = []
    args.kv_item_lens = [int(x) for x in kv_item_lens]
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.state_types = []
    args.state_item_lens = [[int(x) for x in comp] for comp in (state_item_lens or [])]
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.aux_data_ptrs = []
    args.system_dp_rank = 0
    args.pp_rank = 0
    args.page_size = 1
    args.num_draft_entries = 0
    args.engine_rank = 0
    mgr = _NoBootstrapKVManager(
        args, DisaggregationMode.PREFILL, get_server_args(), is_mla_backend=bool(is_mla)
    )
    # Nothing is queued to a transfer engine here; send() stops after its own bookkeeping.
    mgr.add_transfer_request = lambda *a, **k: None  # stub: no transfer engine
    # Where the sender is Mooncake's (_sender_class), the one manager field it reads beyond
    # CommonKVManager's, set as MooncakeKVManager.__init__ sets it.
    mgr.enable_trace = bool(getattr(get_server_args(), "enable_trace", False))
    mid = _next_id()
    _MANAGERS[mid] = mgr
    return {
        "manager": mid,
        "kv_item_lens": args.kv_item_lens,
        "kv_item_lens_sum": int(mgr.kv_item_lens_sum),
        "state_item_lens_sum": int(mgr.state_item_lens_sum),
        "is_mla": bool(mgr.is_mla_backend),
        "replica_factor": getattr(mgr, "_kv_replica_factor", None),
    }


def op_transfer_resolve(manager: int, required_dst_info_num: int | None) -> dict:
    """CommonKVManager.resolve_kv_replica_factor with one decode destination's transfer info
    (a stand-in object carrying only required_dst_info_num, as decode would report it)."""
    mgr = _MANAGERS[int(manager)]
    if not hasattr(mgr, "resolve_kv_replica_factor"):
        # SGLang <= 0.5.15.post1 has no fan-out accounting (added by #30351): its bootstrap
        # thread reads required_dst_info_num only to wait for every decode rank
        # (mooncake/conn.py), and get_transfer_metric counts one copy
        return {"replica_factor": None, "effective": 1, "fan_out_accounting": False}
    mgr.resolve_kv_replica_factor({"decode-0": SimpleNamespace(required_dst_info_num=required_dst_info_num)})
    return {"replica_factor": mgr._kv_replica_factor, "effective": int(mgr.get_kv_replica_factor())}


def _sender_class() -> type:
    """The sender whose send() does the bookkeeping the metric reads. Recent releases do it in
    CommonKVSender.send (Mooncake's sender adds tracing and a KV-sharding filter a single rank
    does not use); up to 0.5.16 CommonKVSender.send is a stub (`pass`) and the backend's sender
    does it: MooncakeKVSender, the class the prefill builds for the Mooncake backend."""
    if inspect.getsource(CommonKVSender.send).rstrip().endswith("pass"):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        return MooncakeKVSender
    return CommonKVSender


def op_transfer_sender_new(manager: int, bootstrap_room: int, num_pages: int) -> dict:
    """The sender's __init__ (real) + init(num_pages)."""
    mgr = _MANAGERS[int(manager)]
    sender_class = _sender_class()
    kwargs = {}
    if "dest_tp_ranks" in inspect.signature(sender_class).parameters:
        # 0.5.15.post1: the prefill bootstrap queue passes its own rank (disaggregation/prefill.py)
        kwargs = {"dest_tp_ranks": [0], "pp_rank": 0}
    sender = sender_class(mgr, "127.0.0.1:0", int(bootstrap_room), **kwargs)
    sender.init(int(num_pages))
    sid = _next_id()
    _SENDERS[sid] = sender
    return {"sender": sid}


def op_transfer_send(
    sender: int, page_indices: list[int], state_indices: list[list[int] | None] | None = None
) -> dict:
    """The sender's send (real) up to the transfer engine hand-off, which is stubbed."""
    snd = _SENDERS[int(sender)]
    pages = np.asarray([int(p) for p in page_indices], dtype=np.int32)
    states = None
    if state_indices is not None:
        states = [None if c is None else np.asarray(c, dtype=np.int32) for c in state_indices]
    snd.send(pages, state_indices=states)
    return {
        "num_kv_indices_recorded": int(snd._transfer_num_kv_indices),
        "num_state_indices_recorded": int(snd._transfer_num_state_indices),
    }


def op_transfer_metric(sender: int) -> dict:
    """CommonKVSender.get_transfer_metric (real)."""
    snd = _SENDERS[int(sender)]
    m = snd.get_transfer_metric()
    return {
        "transfer_total_bytes": m.transfer_total_bytes,
        "transfer_total_mb": None
        if m.transfer_total_bytes is None
        else m.transfer_total_bytes / (1024 * 1024),
        "replica_factor": int(getattr(snd.kv_mgr, "get_kv_replica_factor", lambda: 1)()),
    }


def op_transfer_bytes(
    kv_indices: list[int],
    page_size: int,
    kv_item_lens: list[int] | None = None,
    state_indices: list[list[int] | None] | None = None,
    state_item_lens: list[list[int]] | None = None,
    is_mla: bool | None = None,
    required_dst_info_num: int | None = None,
    pool: dict | None = None,
    receivers: int = 0,
) -> dict:
    """One-shot: token KV indices -> kv_to_page_indices -> manager/sender -> one send of all
    pages (+ state indices) -> get_transfer_metric. required_dst_info_num=None skips
    resolve_kv_replica_factor (SGLang then falls back to 1 for MLA, with a warning).
    receivers > 0 (with pool): the pages are also sent into that many decode pools
    (op_transfer_land) and what they received is returned."""
    pages = op_kv_to_page_indices(kv_indices, page_size)
    mgr = op_transfer_manager_new(kv_item_lens, state_item_lens, is_mla, pool)
    resolved = None
    if required_dst_info_num is not None:
        resolved = op_transfer_resolve(mgr["manager"], required_dst_info_num)
    snd = op_transfer_sender_new(mgr["manager"], 1, len(pages))
    sent = op_transfer_send(snd["sender"], pages, state_indices)
    metric = op_transfer_metric(snd["sender"])
    op_transfer_close(mgr["manager"])
    received = op_transfer_land(pool, pages, receivers) if receivers and pool is not None else {}
    return {
        **received,
        "page_indices": pages,
        "num_pages": len(pages),
        "kv_item_lens_sum": mgr["kv_item_lens_sum"],
        "state_item_lens_sum": mgr["state_item_lens_sum"],
        "is_mla": mgr["is_mla"],
        "resolved": resolved,
        **sent,
        **metric,
    }


def op_transfer_close(manager: int) -> dict:
    mgr = _MANAGERS.pop(int(manager), None)
    if mgr is not None:
        for sid in [k for k, v in _SENDERS.items() if v.kv_mgr is mgr]:
            _SENDERS.pop(sid)
        try:
            mgr.server_socket.close(linger=0)
            mgr._zmq_ctx.term()
        except Exception:
            pass
    return {"closed": mgr is not None}


HANDLERS = {
    "ping": op_ping,
    "info": op_info,
    "new_cache": op_new_cache,
    "insert": op_insert,
    "match": op_match,
    "lock": op_lock,
    "unlock": op_unlock,
    "evict": op_evict,
    "stats": op_stats,
    "take_events": op_take_events,
    "reset": op_reset,
    "kv_to_page_indices": op_kv_to_page_indices,
    "alloc_kv": op_alloc_kv,
    "transfer_manager_new": op_transfer_manager_new,
    "transfer_resolve": op_transfer_resolve,
    "transfer_sender_new": op_transfer_sender_new,
    "transfer_send": op_transfer_send,
    "transfer_metric": op_transfer_metric,
    "transfer_bytes": op_transfer_bytes,
    "transfer_land": op_transfer_land,
    "transfer_close": op_transfer_close,
}


if __name__ == "__main__":
    serve(ENGINE, VERSION, HANDLERS)
