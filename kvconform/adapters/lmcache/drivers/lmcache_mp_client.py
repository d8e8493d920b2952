"""Driver: a serving-engine worker talking to a running LMCache multiprocess server.

Run with the LMCache environment's interpreter:

    <lmcache-venv>/bin/python lmcache_mp_client.py --rpc-url tcp://127.0.0.1:P [--http-url URL]

It plays the role of one (or several) engine workers in the CPU "lmcache_driven" transfer
mode: each instance allocates paged KV tensors (layer -> (2, num_blocks, block_size, heads,
head_size)), LMCache's own CPU wrapper migrates them into POSIX shared memory
(/dev/shm/lmcache_kv_<pid>_<n>) and the server maps the same pages. STORE makes the server
copy blocks out of that memory, RETRIEVE makes it write blocks back into it.

Bytes written for a chunk are a pure function of the token prefix that ends the chunk (the
same identity LMCache hashes), so any driver process - also a fresh one after a server
restart - can check that retrieved bytes are the bytes that were stored.

Ops (JSON lines, see jsonl_loop.py): connect, info, register, ping, heartbeat, store, lookup,
retrieve, unregister, instances, shm, clear. stdout carries protocol lines only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import sys
import threading
import time
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry from a test rig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jsonl_loop import serve
from kv_content import chunk_seed

ENGINE = "lmcache-mp"
SHM_DIR = "/dev/shm"
SHM_PREFIX = "lmcache_kv_"
RPC_TIMEOUT_S = 10.0

_args: argparse.Namespace | None = None
_state: dict[str, Any] = {"client": None, "zmq": None, "rpc_url": None, "http_url": None}
_instances: dict[int, _Instance] = {}
_released: dict[int, dict[str, Any]] = {}
_seq = {"n": 0}
# The KV-event subscription: a reader thread buffers the server's pushed batches until taken.
_events: dict[str, Any] = {"stream": None, "thread": None, "batches": [], "error": None}
_events_lock = threading.Lock()


def _lm():
    """Import LMCache lazily so the ready line is printed quickly and import errors surface
    as op errors (with traceback) instead of a dead driver."""
    import torch  # noqa: F401
    import zmq  # noqa: F401
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import create_transfer_context

    try:
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
    except ModuleNotFoundError:  # LMCache <= 0.5.3: requests go over its MessageQueueClient
        RequestClientFactory = _MessageQueueClientFactory

    return {
        "EngineType": EngineType,
        "IPCCacheServerKey": IPCCacheServerKey,
        "EngineGroupInfo": EngineGroupInfo,
        "create_transfer_context": create_transfer_context,
        "RequestClientFactory": RequestClientFactory,
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:
        return "unknown"


def _result(future: Any, timeout: float = RPC_TIMEOUT_S) -> Any:
    return future.result(timeout=timeout)


def _client():
    if _state["client"] is None:
        url = _state["rpc_url"] or (_args.rpc_url if _args else None)
        if not url:
            raise RuntimeError("no rpc url: start with --rpc-url or call connect(rpc_url=...)")
        _connect(url, _state["http_url"] or (_args.http_url if _args else None))
    return _state["client"]


def _connect(rpc_url: str, http_url: str | None) -> None:
    import zmq

    lm = _lm()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    _state["zmq"] = ctx
    _state["client"] = lm["RequestClientFactory"].create(rpc_url, context=ctx)
    _state["rpc_url"] = rpc_url
    _state["http_url"] = http_url
    _state["chunk_size"] = int(_result(_state["client"].get_chunk_size()))


def _chunk_size() -> int:
    _client()
    return int(_state["chunk_size"])


# ----------------------------------------------------------------------------------------
# deterministic chunk contents
# ----------------------------------------------------------------------------------------


class _Instance:
    # What register() resolved for the instance (passed as keywords).
    instance_id: int
    model_name: str
    world_size: int
    worker_id: int
    num_blocks: int
    block_size: int
    num_layers: int
    num_heads: int
    head_size: int
    dtype: Any  # a torch dtype
    chunk_size: int
    blocks_in_chunk: int
    layer_names: list[str]
    kv: dict[str, Any]  # layer name -> torch tensor
    tctx: Any  # LMCache's transfer context; None once unregistered
    shm_names: list[str]
    shm_bytes: int
    tensor_bytes: int
    heartbeat_s: float
    data_salt: str

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)
        self.next_block = 1  # block 0 is the server's null block id (default 0)
        self.hb_stop: threading.Event | None = None
        self.hb_thread: threading.Thread | None = None
        self.hb_pings = 0
        self.hb_failures = 0

    # blocks -------------------------------------------------------------------------
    def take_blocks(self, n: int) -> list[int]:
        usable = self.num_blocks - 1
        if n > usable:
            raise ValueError(f"need {n} blocks, instance has {usable} usable (block 0 reserved)")
        out = []
        for _ in range(n):
            if self.next_block >= self.num_blocks:
                self.next_block = 1
            out.append(self.next_block)
            self.next_block += 1
        return out

    def chunk_tensors(self, token_ids: list[int], chunk_index: int) -> list[Any]:
        """Expected per-layer tensors (2, blocks_per_chunk, BS, NH, HS) of one chunk."""
        import torch

        end = (chunk_index + 1) * self.chunk_size
        gen = torch.Generator().manual_seed(chunk_seed(token_ids, end, self.data_salt))
        shape = (2, self.blocks_in_chunk, self.block_size, self.num_heads, self.head_size)
        return [
            torch.randn(shape, generator=gen, dtype=torch.float32).to(self.dtype)
            for _ in range(self.num_layers)
        ]

    def write_chunk(self, token_ids: list[int], chunk_index: int, blocks: list[int]) -> str:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        h = hashlib.md5()
        for layer, data in zip(self.layer_names, self.chunk_tensors(token_ids, chunk_index), strict=True):
            self.kv[layer][:, idx] = data
            h.update(data.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def read_chunk_digest(self, blocks: list[int]) -> str:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        h = hashlib.md5()
        for layer in self.layer_names:
            h.update(self.kv[layer][:, idx].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def zero_blocks(self, blocks: list[int]) -> None:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        for layer in self.layer_names:
            self.kv[layer][:, idx] = 0

    def expected_digest(self, token_ids: list[int], chunk_index: int) -> str:
        import torch

        h = hashlib.md5()
        for data in self.chunk_tensors(token_ids, chunk_index):
            h.update(data.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "chunk_size": self.chunk_size,
            "blocks_in_chunk": self.blocks_in_chunk,
            "shm_names": self.shm_names,
            "shm_bytes": self.shm_bytes,
            "tensor_bytes": self.tensor_bytes,
            "heartbeat_s": self.heartbeat_s,
            "heartbeat_pings": self.hb_pings,
            "heartbeat_failures": self.hb_failures,
        }


def _key(
    inst_or_model: Any,
    token_ids: list[int],
    start: int,
    end: int,
    request_id: str,
    worker_id: int | None,
    world_size: int = 1,
    cache_salt: str = "",
) -> Any:
    """The IPC key of a request's token range, as LMCache's vLLM connector builds it; the
    request's cache salt is part of the cache identity (IPCCacheServerKey.cache_salt)."""
    lm = _lm()
    model = inst_or_model.model_name if isinstance(inst_or_model, _Instance) else inst_or_model
    key_type = lm["IPCCacheServerKey"]
    # read locks per key: one reader here (LMCache <= 0.5.3 has no such field)
    optional: dict[str, Any] = {}
    if "num_kv_readers" in key_type.__dataclass_fields__:
        optional["num_kv_readers"] = 1
    if cache_salt:  # releases without salts have no such field: a salted call there is an error
        optional["cache_salt"] = cache_salt
    return key_type(
        model_name=model,
        world_size=world_size,
        worker_id=worker_id,
        token_ids=tuple(int(t) for t in token_ids),
        start=start,
        end=end,
        request_id=request_id,
        **optional,
    )


def _request_id(prefix: str) -> str:
    _seq["n"] += 1
    return f"kvc-{prefix}-{os.getpid()}-{_seq['n']}"


def _shm_listing() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for name in sorted(os.listdir(SHM_DIR)):
            if name.startswith("lmcache"):
                with contextlib.suppress(FileNotFoundError):
                    out[name] = os.stat(os.path.join(SHM_DIR, name)).st_size
    except FileNotFoundError:
        pass
    return out


def _get_instance(instance_id: int) -> _Instance:
    inst = _instances.get(int(instance_id))
    if inst is None:
        raise KeyError(f"instance {instance_id} is not registered in this driver")
    return inst


# ----------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------


def op_connect(rpc_url: str, http_url: str | None = None) -> dict[str, Any]:
    if _state["client"] is not None:
        raise RuntimeError(f"already connected to {_state['rpc_url']}")
    _connect(rpc_url, http_url)
    return {"rpc_url": rpc_url, "chunk_size": _state["chunk_size"]}


def op_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "engine": ENGINE,
        "lmcache_version": _version(),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "rpc_url": _state["rpc_url"] or (_args.rpc_url if _args else None),
        "connected": _state["client"] is not None,
        "instances": {str(i): inst.describe() for i, inst in _instances.items()},
        "released": {str(i): r for i, r in _released.items()},
    }
    if info["rpc_url"]:
        info["chunk_size"] = _chunk_size()
    return info


def op_register(
    instance_id: int,
    num_blocks: int = 64,
    block_size: int = 16,
    num_layers: int = 2,
    num_heads: int = 2,
    head_size: int = 64,
    dtype: str = "float16",
    model_name: str = "kvc-model",
    world_size: int = 1,
    worker_id: int = 0,
    heartbeat_s: float = 5.0,
    data_salt: str = "",
) -> dict[str, Any]:
    """Allocate paged KV tensors, let LMCache move them into POSIX shm, REGISTER_KV_CACHE.

    heartbeat_s > 0 starts a thread that PINGs with this instance id (what the vLLM
    adapter does; the server only reaps "ping-proven" instances after
    --worker-reap-timeout-seconds, never-pinged ones after the registration grace).
    """
    import torch

    instance_id = int(instance_id)
    if instance_id in _instances:
        raise ValueError(f"instance {instance_id} already registered in this driver")
    lm = _lm()
    client = _client()
    chunk = _chunk_size()
    if chunk % block_size:
        raise ValueError(f"server chunk_size {chunk} is not a multiple of block_size {block_size}")
    tdtype = getattr(torch, dtype)
    shape = (2, num_blocks, block_size, num_heads, head_size)
    layer_names = [f"layer.{i}" for i in range(num_layers)]
    kv = {name: torch.zeros(shape, dtype=tdtype) for name in layer_names}
    before = set(_shm_listing())
    tctx = _bound_context(
        lm["create_transfer_context"](kv, mode="lmcache_driven", instance_id=instance_id, req_client=client),
        instance_id,
        client,
    )
    t0 = time.monotonic()
    tctx.register(
        kv,
        model_name,
        world_size,
        chunk // block_size,
        RPC_TIMEOUT_S,
        layout_hints={"kv_layout": "NHD"},
        engine_group_infos=[
            lm["EngineGroupInfo"](
                engine_group_id=0,
                layer_indices=tuple(range(num_layers)),
                tokens_per_block=block_size,
            )
        ],
        engine_type=lm["EngineType"].VLLM,
    )
    latency_ms = (time.monotonic() - t0) * 1000
    after = _shm_listing()
    own_prefix = f"{SHM_PREFIX}{os.getpid()}_"
    new_shm = sorted(n for n in after if n not in before and n.startswith(own_prefix))
    tensor_bytes = sum(t.numel() * t.element_size() for t in kv.values())
    inst = _Instance(
        instance_id=instance_id,
        model_name=model_name,
        world_size=world_size,
        worker_id=worker_id,
        num_blocks=num_blocks,
        block_size=block_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_size=head_size,
        dtype=tdtype,
        chunk_size=chunk,
        blocks_in_chunk=chunk // block_size,
        layer_names=layer_names,
        kv=kv,
        tctx=tctx,
        shm_names=new_shm,
        shm_bytes=sum(after[n] for n in new_shm),
        tensor_bytes=tensor_bytes,
        heartbeat_s=float(heartbeat_s),
        data_salt=data_salt,
    )
    _instances[instance_id] = inst
    _released.pop(instance_id, None)
    if heartbeat_s and heartbeat_s > 0:
        _start_heartbeat(inst)
    out = inst.describe()
    out["latency_ms"] = round(latency_ms, 3)
    return out


class _MessageQueueRequests:
    """LMCache <= 0.5.3's MessageQueueClient in the typed request client's shape: each method
    is `submit_request(RequestType.<NAME>, [args], get_response_class(...))`, as that release's
    own vLLM adapter sends it (send_lmcache_request); the payloads match 0.5.6's RPCs."""

    def __init__(self, mq: Any) -> None:
        self.mq = mq

    def send(self, mq: Any, request_type: Any, payloads: list[Any]) -> Any:
        from lmcache.v1.multiprocess.protocol import get_response_class

        return mq.submit_request(request_type, payloads, get_response_class(request_type))

    def __getattr__(self, name: str) -> Any:
        from lmcache.v1.multiprocess.protocols.base import RequestType

        request_type = RequestType.__members__.get(name.upper())
        if request_type is None:
            return getattr(self.mq, name)
        return lambda *args: self.send(self.mq, request_type, list(args))


class _MessageQueueClientFactory:
    @staticmethod
    def create(url: str, context: Any) -> _MessageQueueRequests:
        from lmcache.v1.multiprocess.mq import MessageQueueClient

        return _MessageQueueRequests(MessageQueueClient(url, context))


class _PerCallContext:
    """LMCache <= 0.5.5's transfer context in 0.5.6's shape. 0.5.5 binds no worker to a
    context: register() takes the instance id and request client, submit_store/submit_retrieve
    the instance id, per call, and there is no unregister() (the client's UNREGISTER_KV_CACHE
    RPC is what 0.5.5's own vLLM adapter sends)."""

    def __init__(self, tctx: Any, instance_id: int, client: Any) -> None:
        self._tctx, self._id, self._client = tctx, instance_id, client

    def register(self, kv: Any, model: str, world_size: int, bic: int, timeout: float, **kw: Any) -> Any:
        return self._tctx.register(self._id, kv, model, world_size, bic, self._client, timeout, **kw)

    def submit_store(self, rid: str, key: Any, kv: Any, block_ids: Any, event: Any, bic: int) -> Any:
        return self._tctx.submit_store(rid, key, self._id, kv, block_ids, event, bic)

    def submit_retrieve(self, rid: str, key: Any, kv: Any, block_ids: Any, event: Any, bic: int) -> Any:
        return self._tctx.submit_retrieve(rid, key, self._id, kv, block_ids, event, bic)

    def unregister(self) -> Any:
        return self._client.unregister_kv_cache(self._id)

    def __getattr__(self, name: str) -> Any:  # create_recorded_event, close, ...
        return getattr(self._tctx, name)


class _MessageQueueContext(_PerCallContext):
    """LMCache <= 0.5.3's transfer context: as 0.5.5's, but register() also takes the raw
    message-queue client and a request sender and knows no engine type, and events are made by
    the caller."""

    def register(self, kv: Any, model: str, world_size: int, bic: int, timeout: float, **kw: Any) -> Any:
        kw.pop("engine_type", None)
        client = self._client
        return self._tctx.register(
            self._id, kv, model, world_size, bic, client.mq, timeout, send_request=client.send, **kw
        )

    def create_recorded_event(self) -> Any:
        """What that release's connector hands to a store or retrieve (lmcache_mp_connector.py)."""
        from lmcache import torch_dev

        event = torch_dev.Event(interprocess=True)
        event.record()
        return event


def _bound_context(tctx: Any, instance_id: int, client: Any) -> Any:
    """0.5.6+ contexts are bound at creation; wrap a 0.5.5 one (register takes instance_id) or
    a <= 0.5.3 one (register also takes the message-queue client and a request sender)."""
    import inspect

    parameters = inspect.signature(tctx.register).parameters
    if "send_request" in parameters:
        return _MessageQueueContext(tctx, instance_id, client)
    if "instance_id" in parameters:
        return _PerCallContext(tctx, instance_id, client)
    return tctx


def _start_heartbeat(inst: _Instance) -> None:
    stop = threading.Event()
    client = _client()

    def run() -> None:
        while True:
            try:
                fut = client.ping(inst.instance_id)
                ok = bool(_result(fut, timeout=max(inst.heartbeat_s, 1.0)))
                inst.hb_pings += 1
                if not ok:
                    inst.hb_failures += 1
            except Exception:
                inst.hb_failures += 1
            if stop.wait(inst.heartbeat_s):
                return

    inst.hb_stop = stop
    inst.hb_thread = threading.Thread(target=run, name=f"kvc-heartbeat-{inst.instance_id}", daemon=True)
    inst.hb_thread.start()


def _stop_heartbeat(inst: _Instance) -> None:
    if inst.hb_stop is not None:
        inst.hb_stop.set()
    if inst.hb_thread is not None:
        inst.hb_thread.join(timeout=RPC_TIMEOUT_S)
    inst.hb_stop = None
    inst.hb_thread = None


def op_ping(instance_id: int | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    ok = bool(_result(_client().ping(None if instance_id is None else int(instance_id))))
    return {"ok": ok, "latency_ms": round((time.monotonic() - t0) * 1000, 3)}


def op_heartbeat(instance_id: int, interval_s: float) -> dict[str, Any]:
    """Change (interval_s > 0) or stop (interval_s == 0) an instance's heartbeat."""
    inst = _get_instance(instance_id)
    _stop_heartbeat(inst)
    inst.heartbeat_s = float(interval_s)
    if interval_s > 0:
        _start_heartbeat(inst)
    return {
        "instance_id": inst.instance_id,
        "heartbeat_s": inst.heartbeat_s,
        "pings": inst.hb_pings,
    }


def _lookup_hit_chunks(client: Any, key: Any, poll_timeout_s: float) -> tuple[int, float]:
    """LOOKUP, then poll its prefetch status. A lookup the server never answers is an error
    naming the request, never 0 hits: "expect 0 hits" checks would pass on a hung L2 read."""
    t0 = time.monotonic()
    _result(client.lookup(key, 1))
    deadline = t0 + poll_timeout_s
    while True:
        hit = _result(client.query_prefetch_status(key.request_id))
        if hit is not None:
            return int(hit), (time.monotonic() - t0) * 1000
        if time.monotonic() > deadline:
            tokens = getattr(key, "token_ids", ())
            raise TimeoutError(
                f"LMCache lookup of request {key.request_id} (model {getattr(key, 'model_name', '?')}, "
                f"tokens {getattr(key, 'start', '?')}..{getattr(key, 'end', '?')} of {len(tokens)}, "
                f"first ids {list(tokens[:8])}) had no prefetch status after {poll_timeout_s:.1f} s: "
                "the server did not answer it"
            )
        time.sleep(0.01)


def _release_locks(client: Any, key: Any, hit: int | None) -> bool | str:
    """FREE_LOOKUP_LOCKS for a lookup no RETRIEVE will consume. Skipped on 0 hits: nothing
    was locked, and for a model no instance registered the server's handler raises and
    never answers (the RPC would hang until the client timeout)."""
    if not hit:
        return False
    try:
        _result(client.free_lookup_locks(key, 1))
        return True
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def op_lookup(
    token_ids: list[int],
    model_name: str = "kvc-model",
    world_size: int = 1,
    poll_timeout_s: float = 5.0,
) -> dict[str, Any]:
    """LOOKUP as the scheduler does (worker_id None), then release its read locks and end the
    session. A model must be registered by some instance or the server answers 0 hits."""
    client = _client()
    chunk = _chunk_size()
    n_full = (len(token_ids) // chunk) * chunk
    rid = _request_id("lookup")
    if n_full == 0:
        return {
            "hit_tokens": 0,
            "hit_chunks": 0,
            "total_chunks": 0,
            "chunk_size": chunk,
            "requested_tokens": len(token_ids),
            "request_id": rid,
            "latency_ms": 0.0,
        }
    key = _key(model_name, token_ids, 0, n_full, rid, None, world_size)
    hit, latency = _lookup_hit_chunks(client, key, poll_timeout_s)
    released = _release_locks(client, key, hit)
    _result(client.end_session(rid))
    return {
        "hit_tokens": hit * chunk,
        "hit_chunks": hit,
        "total_chunks": n_full // chunk,
        "chunk_size": chunk,
        "requested_tokens": len(token_ids),
        "locks_released": released,
        "request_id": rid,
        "latency_ms": round(latency, 3),
    }


def _submit(inst: _Instance, kind: str, key: Any, block_ids: list[int]) -> Any:
    event = inst.tctx.create_recorded_event()
    submit = inst.tctx.submit_store if kind == "store" else inst.tctx.submit_retrieve
    fut = submit(key.request_id, key, inst.kv, [block_ids], event, inst.blocks_in_chunk)
    raw = getattr(fut, "raw_future_", fut)
    if hasattr(raw, "retain_reference") and event is not None:
        raw.retain_reference(event)
    return fut.result(timeout=RPC_TIMEOUT_S)


def _reply_ok(reply: Any) -> bool:
    if isinstance(reply, (tuple, list)):
        return bool(reply[1]) if len(reply) > 1 else bool(reply[0])
    return bool(reply)


def op_store(
    instance_id: int,
    token_ids: list[int],
    start: int = 0,
    skip_cached: bool = False,
    wait_committed_s: float = 2.0,
    cache_salt: str = "",
) -> dict[str, Any]:
    """STORE the full chunks of token_ids[start:] from this instance's shm KV blocks.

    Fills fresh blocks with the chunk's deterministic bytes first. With skip_cached=True it
    first LOOKs UP and stores only the missing tail (what an engine does).

    The STORE reply arrives before the server commits the chunks (its L1 write locks are
    released a few ms later by a callback thread; a LOOKUP in that window misses). With an
    HTTP url and wait_committed_s > 0, this polls GET /status until the L1
    write_locked_count is 0 (no LOOKUP, so lookup metrics are untouched) and reports
    committed_after_ms."""
    inst = _get_instance(instance_id)
    client = _client()
    chunk = inst.chunk_size
    n_full = (len(token_ids) // chunk) * chunk
    rid = _request_id("store")
    looked_up_hit = None
    if skip_cached and n_full:
        key = _key(inst, token_ids, 0, n_full, rid, None, inst.world_size, cache_salt)
        hit, _ = _lookup_hit_chunks(client, key, 5.0)
        looked_up_hit = hit * chunk
        _release_locks(client, key, hit)
        start = max(start, looked_up_hit)
    if start % chunk:
        raise ValueError(f"start {start} is not a multiple of chunk_size {chunk}")
    count = max(n_full - start, 0)
    out: dict[str, Any] = {
        "instance_id": inst.instance_id,
        "requested_tokens": len(token_ids),
        "chunk_size": chunk,
        "start": start,
        "stored_tokens": 0,
        "ok": True,
        "chunk_digests": [],
        "block_ids": [],
        "request_id": rid,
        "latency_ms": 0.0,
    }
    if looked_up_hit is not None:
        out["lookup_hit_tokens"] = looked_up_hit
    if count == 0:
        if skip_cached:
            _result(client.end_session(rid))
        return out
    blocks = inst.take_blocks(count // inst.block_size)
    digests = []
    for c in range(count // chunk):
        chunk_blocks = blocks[c * inst.blocks_in_chunk : (c + 1) * inst.blocks_in_chunk]
        digests.append(inst.write_chunk(token_ids, start // chunk + c, chunk_blocks))
    key = _key(inst, token_ids, start, start + count, rid, inst.worker_id, inst.world_size, cache_salt)
    t0 = time.monotonic()
    try:
        reply = _submit(inst, "store", key, blocks)
    finally:
        with contextlib.suppress(Exception):
            _result(client.end_session(rid))
    ok = _reply_ok(reply)
    store_ms = (time.monotonic() - t0) * 1000
    if wait_committed_s and wait_committed_s > 0 and _http_url():
        out["committed_after_ms"] = _wait_write_unlocked(wait_committed_s)
    out.update(
        stored_tokens=count if ok else 0,
        ok=ok,
        chunk_digests=digests,
        block_ids=blocks,
        latency_ms=round(store_ms, 3),
    )
    return out


def _http_url() -> str | None:
    return _state["http_url"] or (_args.http_url if _args else None)


def _http_json(path: str, method: str = "GET") -> Any:
    import json
    import urllib.request

    base = _http_url()
    if base is None:
        raise RuntimeError(f"LMCache server's HTTP URL unknown: cannot GET {path}")
    req = urllib.request.Request(
        base.rstrip("/") + path, method=method, data=b"" if method == "POST" else None
    )
    with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as resp:
        return json.loads(resp.read().decode())


def _wait_write_unlocked(timeout_s: float) -> float | None:
    """ms until every L1 manager reports write_locked_count == 0; None on timeout."""
    t0 = time.monotonic()
    while True:
        status = _http_json("/status")
        sm = status.get("storage_manager", {})
        # 0.5.6: {"l1_managers": {tag: status}}; LMCache <= 0.5.5: one {"l1_manager": status}
        managers = sm.get("l1_managers") or ({"l1": sm["l1_manager"]} if "l1_manager" in sm else {})
        if not managers:
            raise RuntimeError(f"GET /status has no L1 manager status: {sorted(sm)}")
        if all(m.get("write_locked_count", 0) == 0 for m in managers.values()):
            return round((time.monotonic() - t0) * 1000, 3)
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.002)


def op_retrieve(
    instance_id: int,
    token_ids: list[int],
    poll_timeout_s: float = 5.0,
    cache_salt: str = "",
) -> dict[str, Any]:
    """LOOKUP, then RETRIEVE the hit prefix into freshly zeroed blocks and compare every
    chunk's bytes with the bytes that chunk's token prefix was stored with."""
    inst = _get_instance(instance_id)
    client = _client()
    chunk = inst.chunk_size
    n_full = (len(token_ids) // chunk) * chunk
    rid = _request_id("retrieve")
    out: dict[str, Any] = {
        "instance_id": inst.instance_id,
        "requested_tokens": len(token_ids),
        "chunk_size": chunk,
        "hit_tokens": 0,
        "retrieved_tokens": 0,
        "ok": True,
        "bytes_match": None,
        "chunks_checked": 0,
        "chunks_matched": 0,
        "mismatched_chunks": [],
        "request_id": rid,
    }
    if n_full == 0:
        return out
    lkey = _key(inst, token_ids, 0, n_full, rid, None, inst.world_size, cache_salt)
    try:
        hit, lookup_ms = _lookup_hit_chunks(client, lkey, poll_timeout_s)
        hit_tokens = hit * chunk
        out["hit_tokens"] = hit_tokens
        out["lookup_latency_ms"] = round(lookup_ms, 3)
        if hit_tokens == 0:
            return out
        blocks = inst.take_blocks(hit_tokens // inst.block_size)
        inst.zero_blocks(blocks)
        rkey = _key(inst, token_ids, 0, hit_tokens, rid, inst.worker_id, inst.world_size, cache_salt)
        t0 = time.monotonic()
        reply = _submit(inst, "retrieve", rkey, blocks)
        out["retrieve_latency_ms"] = round((time.monotonic() - t0) * 1000, 3)
        ok = _reply_ok(reply)
        out["ok"] = ok
        out["retrieved_tokens"] = hit_tokens if ok else 0
        matched, bad = 0, []
        for c in range(hit_tokens // chunk):
            cb = blocks[c * inst.blocks_in_chunk : (c + 1) * inst.blocks_in_chunk]
            if inst.read_chunk_digest(cb) == inst.expected_digest(token_ids, c):
                matched += 1
            else:
                bad.append(c)
        out.update(
            chunks_checked=hit_tokens // chunk,
            chunks_matched=matched,
            mismatched_chunks=bad,
            bytes_match=(not bad),
            block_ids=blocks,
        )
        return out
    finally:
        with contextlib.suppress(Exception):
            _result(client.end_session(rid))


def op_unregister(instance_id: int, release_memory: bool = True) -> dict[str, Any]:
    """UNREGISTER_KV_CACHE, then drop the tensors (LMCache's finalizer unlinks the shm).

    A second call for the same id is reported (was_registered False, previous release
    record) and still sent to the server, whose handler logs a warning and returns."""
    instance_id = int(instance_id)
    client = _client()
    inst = _instances.pop(instance_id, None)
    if inst is None:
        t0 = time.monotonic()
        err = None
        try:
            reply = _result(client.unregister_kv_cache(instance_id))
        except Exception as exc:
            reply, err = None, f"{type(exc).__name__}: {exc}"
        return {
            "instance_id": instance_id,
            "was_registered": False,
            "duplicate": instance_id in _released,
            "previous": _released.get(instance_id),
            "server_reply": reply,
            "server_error": err,
            "latency_ms": round((time.monotonic() - t0) * 1000, 3),
            "shm_present": sorted(_shm_listing()),
        }
    _stop_heartbeat(inst)
    t0 = time.monotonic()
    err = None
    try:
        fut = inst.tctx.unregister()
        reply = _result(fut) if fut is not None else None
    except Exception as exc:
        reply, err = None, f"{type(exc).__name__}: {exc}"
    latency = (time.monotonic() - t0) * 1000
    shm_names = list(inst.shm_names)
    shm_after_unregister = {n: (n in _shm_listing()) for n in shm_names}
    if release_memory:
        with contextlib.suppress(Exception):
            inst.tctx.close()
        inst.kv.clear()
        inst.tctx = None
        del inst
        gc.collect()
    listing = _shm_listing()
    record = {
        "instance_id": instance_id,
        "was_registered": True,
        "duplicate": False,
        "server_reply": reply,
        "server_error": err,
        "latency_ms": round(latency, 3),
        "shm_names": shm_names,
        "shm_present_after_unregister": shm_after_unregister,
        "memory_released": release_memory,
        "shm_present_after_release": {n: (n in listing) for n in shm_names},
        "at": time.time(),
    }
    _released[instance_id] = record
    return record


def op_unregister_engine_driven(instance_id: int) -> dict[str, Any]:
    """The UNREGISTER an engine-driven worker sends on exit (worker_transfer.py unregister:
    unregister_kv_cache_engine_driven_context), for an instance registered by another process
    (a vLLM worker); the server's answer or error is reported, never raised."""
    client = _client()
    t0 = time.monotonic()
    err = None
    try:
        reply = _result(client.unregister_kv_cache_engine_driven_context(int(instance_id)))
    except Exception as exc:
        reply, err = None, f"{type(exc).__name__}: {exc}"
    return {
        "instance_id": int(instance_id),
        "server_reply": reply,
        "server_error": err,
        "latency_ms": round((time.monotonic() - t0) * 1000, 3),
    }


def _batch_dict(batch: Any) -> dict[str, Any]:
    return {
        "enabled": bool(batch.enabled),
        "incarnation": int(batch.incarnation),
        "next_cursor": int(batch.next_cursor),
        "lost": bool(batch.lost),
        "events": [
            {
                "seq": int(r.seq),
                "kind": str(r.kind),
                "medium": str(r.medium),
                "model_name": str(r.model_name),
                "block_hashes": [bytes(h).hex() for h in r.block_hashes],
                "parent": bytes(r.parent_block_hash).hex() if r.parent_block_hash is not None else None,
                "token_count": len(r.token_ids),
            }
            for r in batch.events
        ],
    }


def op_subscribe_events(instance_id: int, max_events: int = 1024) -> dict[str, Any]:
    """SUBSCRIBE_KV_EVENTS for the instance's model from cursor 0, as LMCache's vLLM adapter
    does (vllm_multi_process_adapter.py _receive_kv_events); a reader thread buffers batches."""
    inst = _get_instance(instance_id)
    with _events_lock:
        if _events["thread"] is not None and _events["thread"].is_alive():
            return {"subscribed": True, "already": True}
        _events.update(batches=[], error=None)
    stream = _client().subscribe_kv_events(inst.instance_id, inst.model_name, 0, int(max_events))

    def read() -> None:
        try:
            for batch in stream:
                with _events_lock:
                    _events["batches"].append(_batch_dict(batch))
        except Exception as exc:  # reported by take_events, never swallowed
            with _events_lock:
                _events["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=read, name="kvc-kv-events", daemon=True)
    with _events_lock:
        _events.update(stream=stream, thread=thread)
    thread.start()
    return {"subscribed": True, "model_name": inst.model_name}


def op_take_events() -> dict[str, Any]:
    """The batches pushed since the last call, and whether the subscription still reads."""
    with _events_lock:
        batches, _events["batches"] = _events["batches"], []
        thread = _events["thread"]
        return {
            "batches": batches,
            "error": _events["error"],
            "reading": thread is not None and thread.is_alive(),
        }


def op_instances() -> dict[str, Any]:
    return {str(i): inst.describe() for i, inst in _instances.items()}


def op_shm() -> dict[str, Any]:
    """/dev/shm entries whose name starts with 'lmcache' (name -> bytes)."""
    return _shm_listing()


def op_clear(force: bool = False) -> dict[str, Any]:
    """The server's CLEAR RPC (drops its cache); the HTTP twin is POST /cache/clear."""
    client = _client()
    import inspect

    if "force" in inspect.signature(client.clear).parameters:
        return {"reply": _result(client.clear(force))}
    return {"reply": _result(client.clear()), "force_supported": False}  # LMCache <= 0.5.5


def main() -> None:
    global _args
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rpc-url", default=os.environ.get("KVC_LMCACHE_RPC_URL"))
    parser.add_argument("--http-url", default=os.environ.get("KVC_LMCACHE_HTTP_URL"))
    _args = parser.parse_args()
    serve(
        ENGINE,
        _version(),
        {
            "connect": op_connect,
            "info": op_info,
            "register": op_register,
            "ping": op_ping,
            "heartbeat": op_heartbeat,
            "store": op_store,
            "lookup": op_lookup,
            "retrieve": op_retrieve,
            "unregister": op_unregister,
            "unregister_engine_driven": op_unregister_engine_driven,
            "subscribe_events": op_subscribe_events,
            "take_events": op_take_events,
            "instances": op_instances,
            "shm": op_shm,
            "clear": op_clear,
        },
    )
    for inst in list(_instances.values()):
        _stop_heartbeat(inst)


if __name__ == "__main__":
    main()
