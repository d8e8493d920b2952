"""SGLang in-process (`sglang`): SGLang's own radix cache, allocators and disaggregation
accounting, driven step by step through drivers/sglang_driver.py.

The code under test is SGLang's own: RadixCache + (Paged)TokenToKVPoolAllocator +
release_kv_cache on the scheduler's path, kv_to_page_indices and
CommonKVSender.get_transfer_metric. SGLang's HTTP server is another adapter,
`sglang-server` (kvconform.adapters.sglang_server); the two share only common.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvconform import envs
from kvconform.adapters.sglang.common import MODEL
from kvconform.adapters.sglang.radix_client import Call, SglangRadixCacheModel
from kvconform.adapters.sglang.transfer import SglangTransfer
from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    KvEvents,
    KvPool,
    KvTransfer,
    RadixCacheModel,
    SaltedPrompts,
    ServedPrompt,
    provides,
)
from kvconform.errors import EngineError, UsageError
from kvconform.events import EventLedger, Kind, KvEvent, hash_text
from kvconform.kit.drivers import DriverProcess, live_driver
from kvconform.kit.engine_env import EngineEnv
from kvconform.metrics import MetricSnapshot, snapshot_from_values
from kvconform.processes import TeardownReport

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
CAPACITY_TOKENS = 4096

INPROCESS_CAPABILITIES = frozenset(
    {
        C.PREFIX_CACHE,
        C.RESET_PREFIX_CACHE,
        C.BLOCK_SIZE_CONFIG,
        C.RESTART,  # a new driver process: SGLang's block hashes must not depend on the process
        C.FORCED_EVICTION,
        C.KV_EVENTS,
        C.CACHE_SALT,  # Req(cache_salt=...) through the scheduler's admit/release path
        C.PAGE_INDEX,
        C.TRANSFER_ACCOUNTING,
        C.RADIX_CACHE_MODEL,
    }
)

# Not judged in-process: SGLang reaches release_kv_cache only through callers that guard a second
# release (0.5.23 disaggregation/prefill.py: _retire_aborted_prefill_result,
# release_aborted_prefill_waiting_req, handle_bootstrap_failure); its asserts check that caller
# contract. Calling it twice ourselves is a path SGLang never takes (withdrawn finding, see
# docs/findings.md). The shipped double release (grammar error, fixed by SGLang #30937) lives
# in a disaggregated prefill scheduler, which this in-process driver does not run.
RELEASE_GUARD_GAP = (
    "SGLang calls release_kv_cache only from callers that guard a second release; the in-process "
    "driver has no path of SGLang's own that releases twice"
)


_EVENT_KINDS: dict[str, Kind] = {
    "BlockStored": "stored",
    "BlockRemoved": "removed",
    "AllBlocksCleared": "cleared",
}


class SglangAdapter(EngineEnv, EngineAdapter, KvPool, SaltedPrompts, KvEvents, CacheReset):
    name = "sglang"
    env_spec = "sglang"
    deployment = Deployment(block_size=16, model=MODEL)  # SGLang's page size
    capabilities = INPROCESS_CAPABILITIES

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        if ctx.url is not None:
            raise UsageError("engine sglang is in-process: attach to a server with --engine sglang-server")
        self.driver: DriverProcess | None = None
        self.cache_api = True  # the driver says at start (older releases: transfer ops only)
        self.seq = 0

    def unsupported(self) -> dict[Capability, str]:
        return {**super().unsupported(), C.RELEASE_GUARD: RELEASE_GUARD_GAP}

    @property
    def version(self) -> str:
        if self.driver is not None:
            return self.driver.version
        return super().version

    def preflight(self) -> None:
        # Before the environment is looked for: name the real mistake.
        spec = envs.load_spec(self.ctx.env_name or str(self.env_spec))
        if spec.data.get("adapter_mode") == "server":
            raise UsageError(
                f"engine sglang: environment {spec.name!r} is a server environment; "
                "the SGLang server is the engine sglang-server (--engine sglang-server)"
            )
        super().preflight()

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, config: EngineConfig) -> None:
        if config.offload or config.persistent:
            raise NotImplementedError("SGLang in-process has no offload or persistent tier wired here")
        self.driver = live_driver(
            self.driver,
            lambda: DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "sglang_driver.py",
                self.ctx.workdir / "logs" / "sglang-driver.log",
            ),
        )
        # A release older than the cache API the driver speaks (the release-history corpus runs
        # only the transfer ops there) starts without a cache; a cache op then names what is missing.
        self.cache_api = bool(self.driver.call("info").get("cache_api", True))
        if self.cache_api:
            self.new_cache(config.block_size or self.deployment.block_size)
        self.config = config

    def new_cache(self, page_size: int, capacity_tokens: int = CAPACITY_TOKENS) -> dict[str, Any]:
        """A fresh RadixCache over the model shape; its creation event starts a new ledger."""
        assert self.driver is not None
        allocator = "token" if page_size == 1 else "paged"
        info = self.driver.call(
            "new_cache",
            page_size=page_size,
            capacity_tokens=capacity_tokens,
            allocator=allocator,
            kv_pool="mha",
            head_num=self.deployment.model.kv_heads,
            head_dim=self.deployment.model.head_dim,
            layer_num=self.deployment.model.layers,
            max_requests=64,
        )
        self.ledger = EventLedger()
        self.seq = 0
        self.drain_events()
        return info

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.driver is not None:
            reports.append(self.driver.close())
            self.driver = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.driver is not None and self.driver.process.alive()

    def call(self, op: str, **args: Any) -> Any:
        if self.driver is None:
            raise EngineError(self.name, f"op {op!r} before the driver started")
        return self.driver.call(op, **args)

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        return self._serve(tokens, None)

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        return self._serve(tokens, salt)

    def _serve(self, tokens: list[int], salt: str | None) -> ServedPrompt:
        # match, lock, allocate, release_kv_cache: one request's life, under its salt if any
        result = self.call("insert", token_ids=tokens, cache_salt=salt)
        return ServedPrompt(len(tokens), int(result["prefix_len"]), [])

    def metrics(self) -> MetricSnapshot:
        stats = self.call("stats")  # the radix cache's own sizes (no Prometheus in-process)
        return snapshot_from_values({f"sglang_radix_{k}": v for k, v in stats.items()})

    def reset_prefix_cache(self) -> None:
        self.call("reset", mode="flush")  # the scheduler's flush_cache order

    def cache_capacity_tokens(self) -> int:
        return CAPACITY_TOKENS

    def kv_pool_bytes(self) -> int:
        return CAPACITY_TOKENS * self.deployment.model.kv_bytes_per_token()

    def engine_pids(self) -> list[int]:
        return self.driver.pids() if self.driver else []

    # ---- events -------------------------------------------------------------------------
    traits = EngineTraits(event_seq_from_engine=False)  # the in-process recorder hands over events unnumbered

    def drain_events(self) -> int:
        """Take SGLang's recorded KV events (no transport, so no gaps to fill)."""
        events = self.call("take_events", dynamo_format=False)
        batch = []
        for raw in events:
            kind: Kind = _EVENT_KINDS[raw["type"]]
            parent = raw.get("parent_block_hash")
            batch.append(
                KvEvent(
                    self.seq,
                    kind,
                    tuple(hash_text(h) for h in raw.get("block_hashes", [])),
                    hash_text(parent) if parent is not None else None,
                    str(raw.get("medium") or "gpu").lower(),
                    len(raw.get("token_ids") or []),
                )
            )
            self.seq += 1
        self.ledger.extend(batch)
        return 0

    def resident_blocks_reported(self) -> int | None:
        stats = self.call("stats")
        return int(stats["total_size"]) // int(stats["page_size"])

    # ---- radix cache model (RADIX_CACHE_MODEL) ------------------------------------------
    @provides(RadixCacheModel)
    def radix_cache_model(self) -> RadixCacheModel:
        return SglangRadixCacheModel(self.build_radix_cache)

    def build_radix_cache(self, page_size: int, capacity_tokens: int) -> Call:
        if self.driver is None or not self.driver.process.alive():
            self.start(EngineConfig())
        self.config = None  # the next ensure() builds the suite's default cache again
        self.new_cache(page_size, capacity_tokens)
        return self.call

    # ---- transfer -------------------------------------------------------------------------
    @provides(KvTransfer)
    def kv_transfer(self) -> KvTransfer:
        return SglangTransfer(self)

    def logs(self, lines: int = 80) -> dict[str, str]:
        return {"sglang driver": self.driver.log_tail(lines)} if self.driver else {}
