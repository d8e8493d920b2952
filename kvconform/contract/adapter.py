"""The abstract adapter: what a suite may ask of an engine.

Suites never name an engine. They mark each check with the capabilities it needs
(`@pytest.mark.requires(Capability.X)`); an engine lacking one is skipped with
"engine E lacks capability X". Every method below that an engine cannot support raises
NotImplementedError, and its capability stays out of the set (fsspec's abstract-test
pattern): declaring a capability is a promise the method works.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import asdict
from functools import cache
from typing import Any, ClassVar, TypeVar

import pytest

from kvconform import envs, timing
from kvconform.contract.capabilities import NEEDS_LAUNCH, Capability
from kvconform.contract.types import (
    AdapterContext,
    BlockPoolStats,
    EngineConfig,
    EngineTraits,
    LaunchProfile,
    ModelShape,
    ReleaseTwice,
    ServedPrompt,
)
from kvconform.envs import BuiltEnv
from kvconform.errors import UsageError
from kvconform.events import EventLedger
from kvconform.memory import MemoryMeasure, MemorySample, sample_processes
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport
from kvconform.results import Measure

FacetT = TypeVar("FacetT")
MakerT = TypeVar("MakerT", bound=Callable[..., Any])
FACET_MARK = "__kvconform_facet__"


def provides(kind: type) -> Callable[[MakerT], MakerT]:
    """Mark an adapter method (no arguments but self) as the maker of facet `kind`:
    `engine.facet(kind)` calls it. A subclass that overrides the method keeps the mark."""

    def mark(make: MakerT) -> MakerT:
        setattr(make, FACET_MARK, kind)
        return make

    return mark


@cache
def facet_makers(cls: type) -> dict[type, str]:
    """Facet kind -> the name of the method of `cls` that makes it (marked @provides)."""
    makers: dict[type, str] = {}
    for klass in reversed(cls.__mro__):
        for name, member in vars(klass).items():
            kind = getattr(member, FACET_MARK, None)
            if isinstance(kind, type):
                makers[kind] = name
    return makers


class EngineAdapter(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    # The granularity of prefix reuse, in tokens; 1 for an engine that reuses any common prefix
    # token by token (no blocks). A launch profile may set an instance's own.
    default_block_size: int = 16
    traits: ClassVar[EngineTraits] = EngineTraits()  # where oracles and waits follow the engine's design
    # Logical metric -> this engine's metric name (Prometheus sample name).
    metric_names: ClassVar[dict[str, str]] = {}
    # Logical counters the engine exports only after their first event (absent reads 0).
    lazy_counters: ClassVar[frozenset[str]] = frozenset()
    model: ModelShape = ModelShape()  # a launch profile may set an instance's own
    # Environment spec, in the adapter package's envs/ (None: runs in the suite's own environment).
    env_spec: ClassVar[str | None] = None
    # Specs of the other processes of the engine's stack, built with it (`kvconform env build`).
    stack_env_specs: ClassVar[tuple[str, ...]] = ()
    # pytest option dests this adapter reads (added by its own pytest plugin), in ctx.options.
    pytest_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: AdapterContext) -> None:
        self.ctx = ctx
        self.config: EngineConfig | None = None
        self.base_url: str | None = ctx.url
        self.ledger = EventLedger()
        self._env: BuiltEnv | None = None

    def launch_profile(self, *engines: str) -> LaunchProfile:
        """The context's launch profile (the default one without a file), refused unless it is
        for this engine (or one of `engines`); its model shape and block size become the
        adapter's, so the oracles compute from the deployment."""
        profile = self.ctx.profile or LaunchProfile()
        if profile.engine not in (None, self.name, *engines):
            raise UsageError(f"launch profile {profile.name} is for {profile.engine}, not {self.name}")
        if profile.model_shape is not None:
            self.model = profile.model_shape
        if profile.block_size is not None:
            self.default_block_size = profile.block_size
        return profile

    # ---- identity -----------------------------------------------------------------------
    @property
    def version(self) -> str:
        if self.attached:
            return self.attached_version()
        if self.env_spec is None:
            return "unknown"
        try:
            return self.env().version
        except UsageError:
            return "not built"

    def attached_version(self) -> str:
        return "unknown (attached)"

    def env(self) -> BuiltEnv:
        if self._env is None:
            self._env = envs.find(self.ctx.env_name or self.env_spec or self.name)
        return self._env

    def preflight(self) -> None:
        """Fail fast, with one line, on what would make every check of this engine fail."""
        if self.attached:
            self.check_reachable()
        elif self.env_spec is not None:
            self.env()

    @property
    def attached(self) -> bool:
        return self.ctx.url is not None

    def unsupported(self) -> dict[Capability, str]:
        """What this instance cannot offer, each with why (the skip reason quotes it): the one
        place an adapter narrows `capabilities` for a mode or a release, or says why its engine
        lacks a capability it never declares. Attached, whatever needs a launched engine."""
        if not self.attached:
            return {}
        why = "attached: needs an engine the suite launched"
        return {capability: why for capability in self.capabilities & NEEDS_LAUNCH}

    def supported(self) -> frozenset[Capability]:
        """What checks may require of this instance: the capabilities it declares, less those
        it cannot offer (unsupported())."""
        gaps = self.unsupported()
        return frozenset(c for c in self.capabilities if c not in gaps)

    def block_size(self) -> int:
        if self.attached:
            return self.attached_block_size()
        if self.config is not None and self.config.block_size is not None:
            return self.config.block_size
        return self.default_block_size

    def resolved_block_size(self) -> int | None:
        """The block size the running engine says it uses (None: it cannot say). Judged against
        what the suite asked for, never used as an oracle's block."""
        return None

    def attached_block_size(self) -> int:
        """Attach mode: the block size the running server reports (default: the adapter's)."""
        return self.default_block_size

    # ---- lifecycle ----------------------------------------------------------------------
    # Why the last request failed at the transport (timed out, connection refused): the next
    # ensure() makes sure the engine still answers before a check relies on it.
    _suspect: str | None = None
    _lost: str | None = None  # attach mode: the engine went away; the rest is skipped

    def ensure(self, config: EngineConfig | None = None) -> None:
        """Have the engine running in `config` (default config if None); restart if needed.

        Launch mode: an engine of the same config that died, or stopped answering after a
        request timed out, is stopped (teardown audited) and relaunched; the check's record
        says so (`take_notes`). Attach mode: an engine that went away cannot be relaunched, so
        this and every later check is skipped with the reason."""
        config = config or EngineConfig()
        if config.block_size == self.default_block_size:
            config = config.with_(block_size=None)  # the same server as the default config
        if self.attached:
            self._ensure_attached(config)
            return
        lost = None
        if self.config == config:
            if self.running() and (self._suspect is None or self.healthy()):
                self._suspect = None
                return
            lost = "its process died" if not self.running() else f"it stopped answering ({self._suspect})"
        reports = self.timed_stop() if self.config is not None else []
        self._suspect = None
        self.timed_start(config)
        self.config = config
        if lost is not None:
            teardown = "; ".join(r.describe() for r in reports) or "nothing to tear down"
            self._notes().append(
                f"engine {self.name} relaunched before this check: {lost}; teardown: {teardown}"
            )

    def _ensure_attached(self, config: EngineConfig) -> None:
        if self._lost is None and (self.config is None or self._suspect is not None):
            try:
                self.check_reachable()
            except UsageError as exc:
                if self.config is None:
                    raise
                self._lost = f"{exc} after {self._suspect}"
            self._suspect = None
            self.config = config
        if self._lost is not None:
            pytest.skip(
                f"engine {self.name} went away during the session ({self._lost}); attach mode "
                "cannot relaunch it, so the rest of the session is skipped"
            )

    def _notes(self) -> list[str]:
        return self.__dict__.setdefault("_relaunch_notes", [])

    def take_notes(self) -> list[dict[str, Any]]:
        """What happened to the engine for the running check (a relaunch), as record measures."""
        notes, self.__dict__["_relaunch_notes"] = self._notes(), []
        return [asdict(Measure("engine_relaunched", note)) for note in notes]

    def start(self, config: EngineConfig) -> None:
        raise NotImplementedError

    def stop(self) -> list[TeardownReport]:
        """Stop every process this adapter started; reports say what teardown found."""
        self.config = None
        return []

    def restart(self) -> list[TeardownReport]:
        config = self.config or EngineConfig()
        reports = self.timed_stop()
        self.timed_start(config)
        self.config = config
        return reports

    def timed_start(self, config: EngineConfig) -> None:
        with timing.starting(self.name):
            self.start(config)

    def timed_stop(self) -> list[TeardownReport]:
        with timing.stopping(self.name):
            return self.stop()

    def running(self) -> bool:
        return self.config is not None

    def check_reachable(self) -> None:
        """Attach mode: one quick request to the engine at ctx.url; a UsageError names both.
        An engine without a server API (kvconform.kit.http_api adds one) cannot be attached."""
        raise UsageError(f"engine {self.name} has no server API to attach to at {self.ctx.url}")

    def close(self) -> None:
        if not self.attached:
            self.timed_stop()

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Serve one prompt as a serving engine would: look up its prefix, compute the rest,
        keep the result cached. Reports the cached tokens the engine itself claims.

        `tokens` are token ids (kvconform.prompts: ids 10..3999, so a model needs a vocabulary
        of at least 4000), sent as given (no BOS added). With ANSWERS_FROM_KV the answer is
        greedy (temperature 0), `max_tokens` long (EOS ignored), its token ids in
        ServedPrompt.output."""
        raise NotImplementedError

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """serve_prompt under a cache salt (CACHE_SALT): the engine's documented per-request
        salt, which keeps the prompt's cached prefix apart from every other salt's."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def queried_tokens(self, prompt_tokens: int) -> int:
        """Tokens the engine's query counter should move by for one prompt."""
        return prompt_tokens

    def metrics(self) -> MetricSnapshot:
        raise NotImplementedError

    def metric(self, logical: str, snapshot: MetricSnapshot, **labels: str) -> float:
        """A logical metric, through this engine's name for it ('name{label=value,...}')."""
        spec = self.metric_names.get(logical)
        if spec is None:
            raise NotImplementedError(f"engine {self.name} maps no metric for {logical!r}")
        name, _, label_text = spec.partition("{")
        for pair in filter(None, label_text.rstrip("}").split(",")):
            key, _, value = pair.partition("=")
            labels.setdefault(key.strip(), value.strip().strip('"'))
        if logical in self.lazy_counters and not snapshot.has(name):
            return 0.0  # a counter the engine creates on first use: absent means 0
        return snapshot.value(name, None, **labels)

    def metric_delta(self, logical: str, before: MetricSnapshot, after: MetricSnapshot) -> float:
        return self.metric(logical, after) - self.metric(logical, before)

    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        """(tokens the router predicted cached, what the worker then reported)."""
        raise NotImplementedError

    def router_event_status(self, before: MetricSnapshot, after: MetricSnapshot) -> dict[str, float] | None:
        """KV events the router applied between two snapshots, by status ("ok" and each way of
        failing); None: the engine does not say. An engine that says must export the metric:
        absent after routed traffic is an EngineError naming it, never zero events."""
        return None

    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Serve a prompt through the prefill -> decode deployment (EngineConfig(disaggregated)):
        prompt_tokens as the decode side counted them, cached_tokens the prefix reuse the
        prefill side had, output the decode side's answer (`max_tokens` greedy ids, where
        ANSWERS_FROM_KV), and source["handoff"] the prompt tokens the decode side received
        from the prefill rather than computed, where the engine says (absent: not judged)."""
        raise NotImplementedError

    def stream_and_disconnect(self, tokens: list[int], after_chunks: int, max_tokens: int = 256) -> int:
        """Start a streaming completion and drop the connection after `after_chunks` token
        chunks. Returns the token chunks received before the drop, 0 when the stream finished
        first (then no request was aborted)."""
        raise NotImplementedError

    def stream_outlives(self, tokens: list[int], max_tokens: int, seconds: float) -> bool:
        """Whether a streaming completion of `max_tokens` is still running `seconds` after it
        started (then the connection is dropped); False when it finished first."""
        raise NotImplementedError

    def requests_in_flight(self) -> int | None:
        """Requests the engine runs or queues now, by its live count (not a gauge refreshed
        later); None where the engine has no live count (nothing is judged)."""
        return None

    def healthy(self) -> bool:
        """Whether the engine answers now (after a request failed: the next check relaunches
        it if not)."""
        return self.running()

    def kv_pool_bytes(self) -> int:
        """Bytes of the device KV pool the suite configured."""
        raise NotImplementedError

    def l1_capacity_bytes(self) -> int:
        """Bytes of the first cache tier (TIERED_STORE_METRICS) the suite configured."""
        raise NotImplementedError

    def cache_capacity_tokens(self) -> int:
        """Device prefix-cache capacity, from the configuration the suite gave the engine."""
        raise NotImplementedError

    def resident_blocks_reported(self) -> int | None:
        """Cached blocks the engine says it holds (None: it does not say)."""
        return None

    def block_pool_stats(self) -> list[BlockPoolStats]:
        """Every iteration's block-pool stats reported by this engine instance, oldest first."""
        raise NotImplementedError

    def drain_events(self) -> int:
        """Make sure every event emitted so far is in the ledger (KV_EVENTS); fill transport
        gaps from the engine's replay where it has one. Returns how many batches replay
        filled. kvconform.kit.event_feed is the ZMQ publisher's side of it."""
        return 0

    # ---- features: typed facets (kvconform.contract.facets) ------------------------------
    def facet(self, kind: type[FacetT]) -> FacetT:
        """This engine's `kind` facet (persistent tier, offload tier, instance churn, ...),
        made by the adapter's method marked @provides(kind); NotImplementedError naming both
        where the adapter has none (registration refuses a capability without its facet)."""
        maker = facet_makers(type(self)).get(kind)
        if maker is None:
            raise NotImplementedError(f"engine {self.name} provides no {kind.__name__} facet")
        made: FacetT = getattr(self, maker)()
        return made

    # ---- transfer (RELEASE_GUARD) -------------------------------------------------------
    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        """Release one request's KV (a fresh prompt, nothing cached) twice through the engine's
        own abort/failure release path, and say what each release did."""
        raise NotImplementedError

    # ---- memory churn (INSTANCE_CHURN) ---------------------------------------------------
    def reclaim_probe(self) -> dict[str, MemoryMeasure]:
        """Memory that must come back after a release (and stay flat over a long session), by
        measure."""
        raise NotImplementedError

    # ---- memory -------------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        """Every live process of the engine (its whole tree)."""
        raise NotImplementedError

    def memory_sample(self) -> MemorySample:
        return sample_processes(self.engine_pids())

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def self_check_alarms(self, *, settle: bool = True) -> list[str] | None:
        """The alarms the engine's own built-in invariant checks raised since the last call (its
        lines), each check judging that none fired during it; None where the engine has no
        such check wired (nothing is judged). settle=False reads without waiting for the
        engine's next audit (a check's start only drains what came before it)."""
        return None

    def describe_logs(self) -> dict[str, str]:
        """Log tails by process name, attached to the report on failure."""
        return {}
