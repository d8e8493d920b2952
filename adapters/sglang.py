"""SGLang: in-process on hosts (its radix cache, allocators, disaggregation accounting, driven
step by step through adapters/drivers/sglang_driver.py), a real server on GPU runners.

On CPU the SGLang server cannot start (sgl_kernel ships CUDA builds only), but the code under
test here is SGLang's own: RadixCache + (Paged)TokenToKVPoolAllocator + release_kv_cache on
the scheduler's path, kv_to_page_indices and CommonKVSender.get_transfer_metric. Server mode
(`--engine-url`, or launch where `python -m sglang.launch_server` works) speaks the HTTP API.
"""

from __future__ import annotations

from typing import Any, ClassVar

from adapters.base import (
    AdapterContext,
    Capability,
    EngineAdapter,
    EngineConfig,
    ModelShape,
    ServedPrompt,
    TransferResult,
)
from kvconform.drivers import DriverProcess
from kvconform.errors import EngineError
from kvconform.events import EventLedger, KvEvent, hash_text
from kvconform.metrics import MetricSnapshot, snapshot_from_values
from kvconform.processes import TeardownReport

C = Capability
CAPACITY_TOKENS = 4096
STATE_COMPONENT_INDICES = 1


class SglangAdapter(EngineAdapter):
    name = "sglang"
    env_spec = "sglang"
    default_block_size = 16  # SGLang's page size
    model: ClassVar[ModelShape] = ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.RESET_PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.KV_EVENTS,
            C.PAGE_INDEX,
            C.TRANSFER_ACCOUNTING,
            C.RELEASE_GUARD,
            C.RADIX_CACHE_MODEL,
        }
    )
    transfer_layouts: ClassVar[tuple[str, ...]] = ("mha", "mla", "mla_state")
    transfer_page_sizes: ClassVar[tuple[int, ...]] = (1, 4, 16)

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.driver: DriverProcess | None = None
        self.seq = 0

    @property
    def version(self) -> str:
        if self.driver is not None:
            return self.driver.version
        return super().version

    # ---- lifecycle ----------------------------------------------------------------------
    def ensure(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        if config.offload or config.persistent:
            raise NotImplementedError("SGLang in-process has no offload or persistent tier here")
        if self.config == config and self.running():
            return
        self.start(config)

    def start(self, config: EngineConfig) -> None:
        if self.driver is None or not self.driver.process.alive():
            self.driver = DriverProcess(
                self.name,
                self.env().python,
                "sglang_driver.py",
                self.ctx.workdir / "logs" / "sglang-driver.log",
            )
        self.new_cache(config.block_size or self.default_block_size)
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
            head_num=self.model.kv_heads,
            head_dim=self.model.head_dim,
            layer_num=self.model.layers,
            max_requests=64,
        )
        self.ledger = EventLedger()
        self.seq = 0
        self.drain_events()
        return info

    def stop(self) -> list[TeardownReport]:
        reports = [self.driver.close()] if self.driver is not None else []
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
        """One request on the scheduler's path: match, lock, allocate, release_kv_cache."""
        result = self.call("insert", token_ids=tokens)
        return ServedPrompt(len(tokens), int(result["prefix_len"]), [])

    def metrics(self) -> MetricSnapshot:
        """The radix cache's own sizes (the in-process cache exports no Prometheus metrics)."""
        stats = self.call("stats")
        return snapshot_from_values({f"sglang_radix_{k}": v for k, v in stats.items()})

    def reset_prefix_cache(self) -> None:
        self.call("reset", mode="flush")  # the scheduler's flush_cache order

    def cache_capacity_tokens(self) -> int:
        return CAPACITY_TOKENS

    def kv_pool_bytes(self) -> int:
        return CAPACITY_TOKENS * self.model.kv_bytes_per_token()

    def engine_pids(self) -> list[int]:
        return self.driver.pids() if self.driver else []

    # ---- events -------------------------------------------------------------------------
    def drain_events(self) -> int:
        """Take SGLang's recorded KV events into the ledger (in-process: no transport gaps)."""
        events = self.call("take_events", dynamo_format=False)
        batch = []
        for raw in events:
            kind = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}[
                raw["type"]
            ]
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
    def radix_new(self, page_size: int, capacity_tokens: int) -> dict[str, Any]:
        if self.driver is None or not self.driver.process.alive():
            self.start(EngineConfig())
        self.config = None  # the next ensure() builds the suite's default cache again
        return self.new_cache(page_size, capacity_tokens)

    def radix(self, op: str, **args: Any) -> Any:
        return self.call(op, **args)

    # ---- transfer -------------------------------------------------------------------------
    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """KV indices from a real allocation at `page_size`; bytes from SGLang's own sender
        bookkeeping and get_transfer_metric (the network hand-off is stubbed in the driver)."""
        if abort_after_pages is not None:
            raise NotImplementedError("SGLang in-process has no transfer to abort")
        previous = self.config or EngineConfig()
        self.new_cache(page_size)
        try:
            kv_indices = self.call("insert", token_ids=tokens)["kv_indices"]
            m = self.model
            pool = {
                "kind": "mha" if layout == "mha" else "mla",
                "page_size": page_size,
                "layer_num": m.layers,
                "head_num": m.kv_heads,
                "head_dim": m.head_dim,
                "kv_lora_rank": m.latent_dim - 64,
                "qk_rope_head_dim": 64,
                "dtype": "bfloat16",
            }
            state = layout == "mla_state"
            result = self.call(
                "transfer_bytes",
                kv_indices=kv_indices,
                page_size=page_size,
                pool=pool,
                state_indices=[[0] * STATE_COMPONENT_INDICES] if state else None,
                state_item_lens=[[m.state_item_bytes] * m.layers] if state else None,
                is_mla=layout != "mha",
                required_dst_info_num=destinations,
            )
        finally:
            self.new_cache(previous.block_size or self.default_block_size)
        return TransferResult(
            kv_indices=kv_indices,
            page_indices=result["page_indices"],
            bytes_sent=int(result["transfer_total_bytes"]),
            bytes_received=None,
            state_indices=STATE_COMPONENT_INDICES if state else 0,
            detail={
                "replica_factor": result["replica_factor"],
                "kv_item_lens_sum": result["kv_item_lens_sum"],
            },
        )

    def release_twice(self, tokens: list[int]) -> dict[str, Any]:
        result = self.call("double_release", token_ids=tokens, checkpoint=False)
        second = result["second"]
        return {
            "second_refused": bool(result["guard_fired"]),
            "free_delta_on_second": int(second["free_delta"]),
            "detail": str(second.get("message") or ""),
        }

    def log_tail(self, lines: int = 40) -> str:
        return self.driver.log_tail(lines) if self.driver else ""

    def describe_logs(self) -> dict[str, str]:
        return {"sglang driver": self.log_tail(80)}
