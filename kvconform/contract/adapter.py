"""The abstract adapter: the lifecycle core every engine has, and the one lookup for the rest.

Suites never name an engine. They mark each check with the capabilities it needs
(`@pytest.mark.requires(Capability.X)`); an engine lacking one is skipped with
"engine E lacks capability X". The core below is what every check uses: start, stop, health,
pids, the block size, metrics, logs, serve_prompt; `ensure(engine, config)` relaunches it
between checks where needed (the policy lives in the contract, not in each adapter). Every
feature beyond it is a typed facet (kvconform.contract.facets) that `facet(engine, Kind)`
returns: the adapter itself where it inherits the facet, or what its method marked
@provides(Facet) makes. Declaring a capability is a promise that what it needs
(kvconform.contract.requirements) is there: registration refuses an adapter that declares one
without it (fsspec's abstract-test pattern).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import cache
from typing import Any, ClassVar, TypeVar

import pytest

from kvconform import timing
from kvconform.contract.capabilities import NEEDS_LAUNCH, Capability
from kvconform.contract.facets import AttachedServer
from kvconform.contract.types import (
    AdapterContext,
    Deployment,
    EngineConfig,
    EngineTraits,
    LaunchProfile,
    ServedPrompt,
)
from kvconform.errors import UsageError
from kvconform.events import EventLedger
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport
from kvconform.results import Measure

FacetT = TypeVar("FacetT")
MakerT = TypeVar("MakerT", bound=Callable[..., Any])
FACET_MARK = "__kvconform_facet__"


def provides(kind: type) -> Callable[[MakerT], MakerT]:
    """Mark an adapter method (no arguments but self) as the maker of facet `kind`:
    `facet(engine, kind)` calls it. A subclass that overrides the method keeps the mark."""

    def mark(make: MakerT) -> MakerT:
        setattr(make, FACET_MARK, kind)
        return make

    return mark


@cache
def facet_makers(cls: type) -> dict[type, str]:
    """Facet kind -> the name of the method of `cls` that makes it (marked @provides); a facet
    `cls` inherits is provided by the adapter itself."""
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
    deployment: Deployment = Deployment()  # what the oracles compute from (a profile may set it)
    traits: EngineTraits = EngineTraits()  # its metric names, and where oracles and waits follow its design

    def __init__(self, ctx: AdapterContext) -> None:
        self.ctx = ctx
        self.config: EngineConfig | None = None
        self.base_url: str | None = ctx.url
        self.ledger = EventLedger()
        # Why the last request failed at the transport (timed out, connection refused): the
        # next ensure() makes sure the engine still answers before a check relies on it.
        self._suspect: str | None = None
        self._lost: str | None = None  # attach mode: the engine went away; the rest is skipped
        # Why the running engine must not serve the next check although it is up (a check left
        # it changed, e.g. one worker short): the next ensure() relaunches it and says why.
        self.stale: str | None = None
        self.relaunch_notes: list[str] = []  # what happened to the engine during the check

    # ---- identity -----------------------------------------------------------------------
    @property
    def version(self) -> str:
        """The release judged (an engine in an environment of its own: kit.engine_env.EngineEnv)."""
        return attached_server(self).attached_version() if self.ctx.attached else "unknown"

    def preflight(self) -> None:
        """Fail fast, with one line, on what would make every check of this engine fail."""
        if self.ctx.attached:
            attached_server(self).check_reachable()

    def unsupported(self) -> dict[Capability, str]:
        """What this instance cannot offer, each with why (the skip reason quotes it): the one
        place an adapter narrows `capabilities` for a mode or a release, or says why its engine
        lacks a capability it never declares. Attached, whatever needs a launched engine."""
        if not self.ctx.attached:
            return {}
        why = "attached: needs an engine the suite launched"
        return {capability: why for capability in self.capabilities & NEEDS_LAUNCH}

    def resolved_block_size(self) -> int | None:
        """The block size the running engine says it uses (None: it cannot say). Judged against
        what the suite asked for, never used as an oracle's block."""
        return None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, config: EngineConfig) -> None:
        raise NotImplementedError

    def stop(self) -> list[TeardownReport]:
        """Stop every process this adapter started; reports say what teardown found."""
        self.config = None
        return []

    def running(self) -> bool:
        return self.config is not None

    def close(self) -> None:
        if not self.ctx.attached:
            timed_stop(self)

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Serve one prompt as a serving engine would: look up its prefix, compute the rest,
        keep the result cached. Reports the cached tokens the engine itself claims.

        `tokens` are token ids (kvconform.prompts: ids 10..3999, so a model needs a vocabulary
        of at least 4000), sent as given (no BOS added). With ANSWERS_FROM_KV the answer is
        greedy (temperature 0), `max_tokens` long (EOS ignored), its token ids in
        ServedPrompt.output; a KV store with no model answers [1] where every chunk served
        from cache held its prefix's own bytes, [0] where one did not."""
        raise NotImplementedError

    def metrics(self) -> MetricSnapshot:
        raise NotImplementedError

    def healthy(self) -> bool:
        """Whether the engine answers now (after a request failed: the next check relaunches
        it if not)."""
        return self.running()

    # ---- memory -------------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        """Every live process of the engine (its whole tree)."""
        raise NotImplementedError

    def logs(self, lines: int = 80) -> dict[str, str]:
        """The last `lines` of each of the engine's logs, by process name, its main process
        first (attached to the report on failure; `log_tail` joins them for an error)."""
        return {}


def log_tail(adapter: EngineAdapter, lines: int = 40) -> str:
    """The engine's logs in one text, for an error's message: each process's last `lines`."""
    tails = {name: tail for name, tail in adapter.logs(lines).items() if tail}
    if len(tails) == 1:
        return next(iter(tails.values()))
    return "\n".join(f"--- {name} ---\n{tail}" for name, tail in tails.items())


def deployed_block_size(adapter: EngineAdapter) -> int:
    """The block size the oracles compute from: launched, the one the suite asked for (the
    running config's, else the deployment's); attached, the one the server reports it was
    configured with (the deployment's where it reports none). Never the running engine's own
    account of its pool: that is resolved_block_size(), judged against this."""
    if adapter.ctx.attached:
        reported = attached_server(adapter).attached_block_size()
        return adapter.deployment.block_size if reported is None else reported
    if adapter.config is not None and adapter.config.block_size is not None:
        return adapter.config.block_size
    return adapter.deployment.block_size


def supported(adapter: EngineAdapter) -> frozenset[Capability]:
    """What checks may require of this instance: the capabilities it declares, less those it
    cannot offer (its unsupported())."""
    gaps = adapter.unsupported()
    return frozenset(c for c in adapter.capabilities if c not in gaps)


def ensure(adapter: EngineAdapter, config: EngineConfig | None = None) -> None:
    """Have the engine running in `config` (default config if None); relaunch it if needed.

    Launch mode: an engine of the same config that died, stopped answering after a request
    timed out, or was left changed by a check (`adapter.stale`) is stopped (teardown audited)
    and relaunched; the check's record says so (take_relaunch_notes). Another config stops
    the running one first. Attach mode: an engine that went away cannot be relaunched, so
    this and every later check is skipped with the reason."""
    config = config or EngineConfig()
    if config.block_size == adapter.deployment.block_size:
        config = config.with_(block_size=None)  # the same server as the default config
    if adapter.ctx.attached:
        ensure_attached(adapter, config)
        return
    lost = None
    if adapter.config == config:
        alive = adapter.running()
        if adapter.stale is None and alive and (adapter._suspect is None or adapter.healthy()):
            adapter._suspect = None
            return
        lost = adapter.stale or (
            "its process died" if not alive else f"it stopped answering ({adapter._suspect})"
        )
    reports = timed_stop(adapter) if adapter.config is not None else []
    adapter._suspect = adapter.stale = None
    timed_start(adapter, config)
    adapter.config = config
    if lost is not None:
        teardown = "; ".join(r.describe() for r in reports) or "nothing to tear down"
        adapter.relaunch_notes.append(
            f"engine {adapter.name} relaunched before this check: {lost}; teardown: {teardown}"
        )


def restart(adapter: EngineAdapter) -> list[TeardownReport]:
    """Stop the engine and start it again in the config it ran (persistence checks)."""
    config = adapter.config or EngineConfig()
    reports = timed_stop(adapter)
    timed_start(adapter, config)
    adapter.config = config
    return reports


def read_metric(adapter: EngineAdapter, logical: str, snapshot: MetricSnapshot, **labels: str) -> float:
    """A logical metric, through this engine's name for it (its traits.metric_map)."""
    return adapter.traits.metric_map.read(adapter.name, logical, snapshot, **labels)


def metric_delta(
    adapter: EngineAdapter, logical: str, before: MetricSnapshot, after: MetricSnapshot
) -> float:
    return read_metric(adapter, logical, after) - read_metric(adapter, logical, before)


def ensure_attached(adapter: EngineAdapter, config: EngineConfig) -> None:
    """ensure() in attach mode: an engine that went away cannot be relaunched, so this and
    every later check is skipped with the reason."""
    if adapter._lost is None and (adapter.config is None or adapter._suspect is not None):
        server = attached_server(adapter)
        try:
            server.check_reachable()
        except UsageError as exc:
            if adapter.config is None:
                raise
            adapter._lost = f"{exc} after {adapter._suspect}"
        else:
            server.attach()
        adapter._suspect = None
        adapter.config = config
    if adapter._lost is not None:
        pytest.skip(
            f"engine {adapter.name} went away during the session ({adapter._lost}); attach mode "
            "cannot relaunch it, so the rest of the session is skipped"
        )


def timed_start(adapter: EngineAdapter, config: EngineConfig) -> None:
    with timing.starting(adapter.name):
        adapter.start(config)


def timed_stop(adapter: EngineAdapter) -> list[TeardownReport]:
    with timing.stopping(adapter.name):
        return adapter.stop()


def take_relaunch_notes(adapter: EngineAdapter) -> list[dict[str, Any]]:
    """What happened to the engine during the running check (a relaunch), as record measures;
    the adapter's list starts over."""
    notes, adapter.relaunch_notes = adapter.relaunch_notes, []
    return [asdict(Measure("engine_relaunched", note)) for note in notes]


def apply_launch_profile(adapter: EngineAdapter, *engines: str) -> LaunchProfile:
    """The context's launch profile (the default one without a file), refused unless it is for
    `adapter`'s engine (or one of `engines`); its model shape and block size become the
    adapter's, so the oracles compute from the deployment."""
    profile = adapter.ctx.profile or LaunchProfile()
    if profile.engine not in (None, adapter.name, *engines):
        raise UsageError(f"launch profile {profile.name} is for {profile.engine}, not {adapter.name}")
    if profile.model_shape is not None:
        adapter.deployment = replace(adapter.deployment, model=profile.model_shape)
    if profile.block_size is not None:
        adapter.deployment = replace(adapter.deployment, block_size=profile.block_size)
    return profile


def class_provides(cls: type, kind: type) -> bool:
    """Whether adapters of class `cls` provide facet `kind`: a method marked @provides(kind),
    or `kind` inherited."""
    return kind in facet_makers(cls) or issubclass(cls, kind)


def facet(adapter: EngineAdapter, kind: type[FacetT]) -> FacetT:
    """The engine's `kind` facet (persistent tier, offload tier, instance churn, ...), made by
    the adapter's method marked @provides(kind), or the adapter itself where it inherits
    `kind`; NotImplementedError naming both where it has none (registration refuses a
    capability without its facet)."""
    maker = facet_makers(type(adapter)).get(kind)
    if maker is not None:
        made: FacetT = getattr(adapter, maker)()
        return made
    if isinstance(adapter, kind):
        return adapter
    raise NotImplementedError(f"engine {adapter.name} provides no {kind.__name__} facet")


def has_facet(adapter: EngineAdapter, kind: type) -> bool:
    """Whether `adapter` provides facet `kind` (facet(adapter, kind) would not raise)."""
    return class_provides(type(adapter), kind)


def attached_server(adapter: EngineAdapter) -> AttachedServer:
    """The attached server of `adapter`; a UsageError where the engine has no server API to
    attach to (kvconform.kit.http_api adds one)."""
    if not has_facet(adapter, AttachedServer):
        raise UsageError(f"engine {adapter.name} has no server API to attach to at {adapter.ctx.url}")
    return facet(adapter, AttachedServer)
