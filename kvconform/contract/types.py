"""Values exchanged between suites and adapters, and what oracles are computed from."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from kvconform.metrics import MetricMap
from kvconform.oracles import KvLayout, LastToken


@dataclass(frozen=True)
class ModelShape:
    """What KV sizes are computed from, independently of what the engine reports."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    dtype_bytes: int = 2  # bfloat16
    mla: bool = False  # MLA keeps one latent vector per token instead of K and V
    latent_dim: int = 576  # MLA: kv_lora_rank 512 + rope dim 64 (DeepSeek-V2/V3 shapes)
    # Per-layer bytes of each per-request state component, for layouts with state. Two of
    # different sizes, as a hybrid model has (SSM conv + temporal state, or a draft model's KV):
    # an engine that multiplies summed counts by summed sizes (SGLang #40164) overstates them.
    state_components: tuple[int, ...] = (4096, 1024)

    def kv_bytes_per_token(self) -> int:
        per_layer = self.kv_heads * self.head_dim * self.dtype_bytes
        return self.layers * per_layer * (1 if self.mla else 2)

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token() * block_size

    def page_bytes(self, layout: KvLayout, page_size: int) -> int:
        return layout.page_bytes(
            self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.latent_dim, page_size
        )

    def state_bytes(self, layout: KvLayout) -> int:
        """One request's state, one index per component."""
        return sum(layout.state_bytes(self.layers, item) for item in self.state_components)


@dataclass(frozen=True)
class Deployment:
    """What the oracles compute from: the model's KV shape, and the block size the engine runs
    at unless a check asks for another. A launch profile may set an instance's own."""

    # The granularity of prefix reuse, in tokens; 1 for an engine that reuses any common prefix
    # token by token (no blocks).
    block_size: int = 16
    model: ModelShape = field(default_factory=ModelShape)


@dataclass(frozen=True)
class EngineTraits:
    """How an engine differs by its own design from what the suite assumes: the names it gives
    the suite's metrics, and where an oracle or a wait must follow its behaviour. An adapter
    sets only what differs from the default, and cites where the engine does so."""

    # The suite's logical metrics (prefix_hits, kv_usage, ...) in this engine's names; suites
    # read them through read_metric(engine, logical, snapshot).
    metric_map: MetricMap = field(default_factory=MetricMap)

    # What a fully cached prompt still computes (the last token's logits): LastToken.BLOCK (or
    # True) the whole last block, LastToken.TOKEN only the last token, LastToken.NONE (or False)
    # nothing (a cache store returns every stored block); the hit oracle follows it.
    recomputes_last_token: bool | LastToken = True
    workers: int = 1  # serving workers behind the endpoint (a router spreads requests)
    # Seconds an idle engine may keep publishing a gauge's last busy value before it refreshes
    # it (an engine that publishes gauges only per batch and on an idle timer).
    idle_gauge_refresh_s: float = 0.0
    # Seconds the engine waits between a client's disconnect and the abort of its request.
    abort_delay_s: float = 0.0
    # Period of the loop that evicts from a full cache, for engines that evict in the
    # background rather than when a store needs room (0: evicts on allocation).
    eviction_period_s: float = 0.0
    # The engine publishes its offload read gauge as max(usage - write, 0) itself: judging that
    # identity would prove nothing, so the check records it instead.
    read_gauge_is_usage_minus_write: bool = False
    # Seconds an engine's publisher may take to send what a finished request emitted.
    event_settle_s: float = 1.0
    # The engine numbers its event batches itself (False: the adapter numbers what it reads,
    # so sequence gaps and regressions cannot show and are recorded, not judged).
    event_seq_from_engine: bool = True
    # The engine's prefix-query counter counts whole blocks only (a prompt's shorter tail is
    # never looked up), so one prompt moves it by its whole blocks' tokens.
    queries_whole_blocks: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """How the suite wants the engine to run. Adapters restart only when this changes."""

    block_size: int | None = None  # None: the adapter's default
    offload: bool = False  # enable the host offload tier
    fail_stores: bool = False  # offload stores fail (failed-store path)
    # offload a block only once it has been offered for storing this many times (0: every offer)
    offload_store_threshold: int = 0
    persistent: bool = False  # enable the persistent (disk) tier
    disaggregated: bool = False  # separate prefill and decode instances, KV handed off between
    # disaggregated, with the KV moved by the engine's transfer library (the pair whose byte
    # counters TRANSFER_ACCOUNTING reads) rather than by its default hand-off
    kv_transfer: bool = False

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


@dataclass
class ServedPrompt:
    prompt_tokens: int
    cached_tokens: int
    output: list[int] = field(default_factory=list)
    source: dict[str, int] = field(default_factory=dict)  # cached tokens by tier, if known


@dataclass
class TransferResult:
    kv_indices: list[int]
    page_indices: list[int]
    bytes_sent: int | None  # what the sender counted (None: the engine counts at the receiver only)
    bytes_received: int | None = None  # what the receiver counted (None: no receiver)
    # State indices the engine itself recorded for the hand-off (None: it does not say).
    # Recorded, not judged: the request's states are judged through the bytes they add.
    state_indices: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


ReleaseOutcome = Literal["refused", "ignored", "crashed", "ran_again"]


@dataclass(frozen=True)
class ReleaseTwice:
    """One request's KV released twice through the engine's own release path (RELEASE_GUARD)."""

    first_freed_tokens: int  # slots the first release returned to the pool, in tokens
    # "refused": the guard said no (a return value or an error the caller handles); "ignored":
    # nothing done, nothing said; "crashed": an assertion or the engine died (what ends a
    # production scheduler); "ran_again": the release ran a second time
    second_outcome: ReleaseOutcome
    free_delta_on_second: int  # slots or blocks the second release freed
    detail: str = ""

    @classmethod
    def from_json(cls, answer: dict[str, Any]) -> ReleaseTwice:
        """From a driver's or server's JSON answer (the same field names)."""
        return cls(
            int(answer["first_freed_tokens"]),
            answer["second_outcome"],
            int(answer["free_delta_on_second"]),
            str(answer.get("detail", "")),
        )


@dataclass(frozen=True)
class SecondRelease:
    """One engine instance released, then released again (INSTANCE_REGISTRY)."""

    first_released: bool
    second_refused_cleanly: bool  # refused with an answer the caller handles, no error inside
    detail: str = ""


@dataclass(frozen=True)
class BlockPoolStats:
    """One engine iteration's KV block pool, as the engine reports it (BLOCK_POOL_STATS).

    max/free/used are the pool at that iteration. reused/missed count prefix-reuse lookups in
    blocks; `cumulative` says whether they (and hit_rate) run since engine start (TensorRT-LLM
    kvCacheStats) or cover this iteration only.
    """

    max_blocks: int
    free_blocks: int
    used_blocks: int
    reused_blocks: int
    missed_blocks: int
    hit_rate: float
    tokens_per_block: int
    iteration: int | None = None
    cumulative: bool = True


PROFILE_SECTIONS = ("offload", "connector", "kv_events", "model_shape", "env_vars")


@dataclass(frozen=True)
class LaunchProfile:
    """One deployment to launch (`--engine-profile FILE`, TOML): the team's model, flags and
    memory, instead of the adapter's tiny CPU model. Every field is optional; an adapter reads
    what its engine has and refuses what it cannot honour. The default profile (no file) is
    the adapter's own CPU setup.

        engine = "vllm"                    # which engine it is for (checked)
        env = "vllm-cuda"                  # environment spec to launch from (else GPU auto/CPU)
        model = "/models/llama-3.1-8b"     # directory or hub id
        served_model_name = "llama"
        tokenizer = "..."                  # if not the model's own
        load_format = "auto"               # "dummy": random weights, no download
        dtype = "bfloat16"
        block_size = 16                    # the default block size of the run (checks may vary it)
        kv_cache_bytes = 4294967296        # KV pool in bytes, or
        gpu_memory_fraction = 0.85         # a fraction of GPU memory (vLLM gpu-memory-utilization)
        tensor_parallel_size = 2
        max_model_len = 8192
        extra_args = ["--max-num-seqs", "64"]   # appended to the engine's command line as given
        [env_vars]                         # process environment of the engine
        [offload]  size_bytes = ..., backend = "native"
        [connector]  kv_transfer_config = { ... }  (vLLM), or engine-specific keys
        [kv_events]  port = 5557, replay_port = 5558   (fixed ports; default: free ones)
        [model_shape]  layers, kv_heads, head_dim, dtype_bytes   (what the byte oracles use)
    """

    path: Path | None = None
    engine: str | None = None
    env: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    load_format: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    extra_args: tuple[str, ...] = ()
    env_vars: dict[str, str] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)
    connector: dict[str, Any] = field(default_factory=dict)
    kv_events: dict[str, Any] = field(default_factory=dict)
    model_shape: ModelShape | None = None

    @property
    def name(self) -> str:
        return self.path.stem if self.path else "default"

    @property
    def is_default(self) -> bool:
        return self.model is None

    @classmethod
    def load(cls, path: str | Path) -> LaunchProfile:
        path = Path(path)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"launch profile {path}: {exc}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path | None = None) -> LaunchProfile:
        where = f"launch profile {path or '<dict>'}"
        known = {f.name for f in fields(cls)} - {"path"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values = dict(data)
        if values.get("kv_cache_bytes") is not None and values.get("gpu_memory_fraction") is not None:
            raise ValueError(f"{where}: give kv_cache_bytes or gpu_memory_fraction, not both")
        fraction = values.get("gpu_memory_fraction")
        if fraction is not None and not 0 < float(fraction) <= 1:
            raise ValueError(f"{where}: gpu_memory_fraction {fraction} is not in (0, 1]")
        for key in ("block_size", "kv_cache_bytes", "tensor_parallel_size", "max_model_len"):
            if key in values and (not isinstance(values[key], int) or values[key] <= 0):
                raise ValueError(f"{where}: {key} must be a positive integer, got {values[key]!r}")
        extra = values.get("extra_args", ())
        if not isinstance(extra, list | tuple) or not all(isinstance(a, str) for a in extra):
            raise ValueError(f"{where}: extra_args must be a list of strings")
        values["extra_args"] = tuple(extra)
        for key in PROFILE_SECTIONS:
            if key in values and not isinstance(values[key], dict):
                raise ValueError(f"{where}: [{key}] must be a table")
        values["env_vars"] = {str(k): str(v) for k, v in values.get("env_vars", {}).items()}
        if "model_shape" in values:
            shape_fields = {f.name for f in fields(ModelShape)}
            bad = sorted(set(values["model_shape"]) - shape_fields)
            if bad:
                raise ValueError(f"{where}: [model_shape] unknown field(s) {', '.join(bad)}")
            values["model_shape"] = ModelShape(**values["model_shape"])
        return cls(path=path, **values)


@dataclass
class AdapterContext:
    workdir: Path
    url: str | None = None  # attach mode
    start_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    env_name: str | None = None  # override the environment spec (e.g. another version)
    # The adapter's own pytest options (its class's `pytest_options`), by dest.
    options: dict[str, Any] = field(default_factory=dict)
    # --engine-profile: the deployment to launch (None: the adapter's default CPU setup).
    profile: LaunchProfile | None = None

    @property
    def attached(self) -> bool:
        """Attach mode: the suite judges an engine someone else runs at `url`."""
        return self.url is not None
