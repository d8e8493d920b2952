"""Metric snapshots: Prometheus text through prometheus_client's parser, and JSON stats.

Counters are compared as deltas between two snapshots taken by the suite, so numbers left
over from earlier requests (or earlier tests on the same server) never leak into a verdict.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvconform.errors import EngineError

LabelSet = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class MetricSnapshot:
    """All samples of one scrape, by the sample name the engine exposed. (prometheus_client's
    parser names every counter sample `<family>_total`; an engine that exposes a counter without
    the suffix, as Rust's prometheus crate does, keeps its own name here, so a check can never
    read a name the engine does not have.)"""

    taken_at: float
    samples: dict[str, dict[LabelSet, float]] = field(default_factory=dict)
    note: str = ""  # what was odd about the scrape (an empty body), for error messages
    source: str = "the scrape"  # where it came from (/metrics), for error messages

    def names(self) -> list[str]:
        return sorted(self.samples)

    def has(self, name: str) -> bool:
        return name in self.samples

    def series(self, name: str) -> list[Sample]:
        return [Sample(name, dict(k), v) for k, v in self.samples.get(name, {}).items()]

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        rows = self.samples.get(name)
        if rows is None:
            if default is not None:
                return default
            why = f": {self.note}" if self.note else ""
            raise KeyError(f"metric {name!r} not exported (have {len(self.samples)} others){why}")
        wanted = set(labels.items())
        return sum(v for k, v in rows.items() if wanted <= k)

    def delta(self, before: MetricSnapshot, name: str, **labels: str) -> float:
        return self.value(name, 0.0, **labels) - before.value(name, 0.0, **labels)

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [dict(k) for k in self.samples.get(name, {})]

    def as_dict(self, prefixes: Iterable[str] = ()) -> dict[str, float]:
        prefixes = tuple(prefixes)
        out = {}
        for name, rows in sorted(self.samples.items()):
            if prefixes and not name.startswith(prefixes):
                continue
            for labels, value in rows.items():
                label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
                out[f"{name}{{{label_text}}}" if label_text else name] = value
        return out


class MetricAbsent(EngineError, KeyError):
    """A metric the engine should export is not in the scrape: an error naming the engine and
    the metric, never a 0 (a KeyError too, for code that looks a name up)."""

    def __str__(self) -> str:
        return EngineError.__str__(self)


LazyWhen = Callable[[str, MetricSnapshot], bool]


@dataclass(frozen=True)
class MetricMap:
    """An engine's names for the suite's logical metrics: logical -> Prometheus sample name,
    with fixed labels as 'name{label=value,...}', or a tuple of such names whose samples the
    logical metric sums (an engine that splits one quantity over two counters).

    `lazy`: the counters the engine exports only after their first event (absent reads 0; any
    other absent metric is an error). `lazy_when(logical, snapshot)`: the same, where whether
    a counter exists yet depends on what the running engine was asked to do (vLLM's offload
    metrics). `unmapped`: logical -> why this engine (release) has no name for it, for the
    error a check that asks gets."""

    names: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    lazy: frozenset[str] = frozenset()
    lazy_when: LazyWhen | None = None
    unmapped: Mapping[str, str] = field(default_factory=dict)

    def __contains__(self, logical: object) -> bool:
        return logical in self.names

    def sample_names(self, logical: str) -> tuple[str, ...]:
        """The Prometheus sample names (labels left off) that `logical` reads."""
        spec = self.names[logical]
        return tuple(s.partition("{")[0] for s in ((spec,) if isinstance(spec, str) else spec))

    def read(self, engine: str, logical: str, snapshot: MetricSnapshot, **labels: str) -> float:
        spec = self.names.get(logical)
        if spec is None:
            why = self.unmapped.get(logical)
            raise NotImplementedError(
                f"engine {engine}: {why}" if why else f"engine {engine} maps no metric for {logical!r}"
            )
        return sum(
            self._read_one(engine, logical, one, snapshot, dict(labels))
            for one in ((spec,) if isinstance(spec, str) else spec)
        )

    def _read_one(
        self, engine: str, logical: str, spec: str, snapshot: MetricSnapshot, labels: dict[str, str]
    ) -> float:
        name, _, label_text = spec.partition("{")
        for pair in filter(None, label_text.rstrip("}").split(",")):
            key, _, value = pair.partition("=")
            labels.setdefault(key.strip(), value.strip().strip('"'))
        if snapshot.has(name):
            return snapshot.value(name, None, **labels)
        if logical in self.lazy or (self.lazy_when is not None and self.lazy_when(logical, snapshot)):
            return 0.0  # a counter the engine creates on first use: absent means 0
        why = f"; {snapshot.note}" if snapshot.note else ""
        raise MetricAbsent(
            engine,
            f"{snapshot.source} lacks {name} (logical {logical!r}; have {len(snapshot.samples)} others){why}",
        )


_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
_only = threading.local()


@contextmanager
def only_names(names: Iterable[str]) -> Iterator[None]:
    """Within this thread, scrapes parse only these metrics (their samples and families): a
    sampler at 40 Hz cannot afford prometheus_client's parser on a whole /metrics body (~1100
    lines of vLLM-like histograms take ~47 ms each; the 2-core CI reached 15 Hz with them)."""
    wanted = {n.split("{", 1)[0] for n in names}
    _only.families = wanted | {n.removesuffix("_total") for n in wanted}
    try:
        yield
    finally:
        _only.families = None


def _kept(text: str, families: set[str]) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if len(parts) > 2 and parts[2] in families:
                out.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].strip()
        base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name)
        if name in families or base in families:
            out.append(line)
    return "".join(out)


def parse_prometheus(text: str, engine: str = "?", source: str = "/metrics") -> MetricSnapshot:
    """One scrape. A body cut off mid-line (Prometheus text ends every line, the last one
    included, with a newline) is an EngineError: a cut `name 12` would otherwise parse as a
    smaller number than the engine sent. An empty body is an empty snapshot (engines create
    some metrics on first use) that says so when a check asks it for a metric."""
    snapshot = MetricSnapshot(taken_at=time.time(), source=source)
    if not text.strip():
        snapshot.note = f"{engine} {source} answered an empty body ({len(text)} bytes)"
        return snapshot
    if not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1]
        raise EngineError(
            engine,
            f"{source} is truncated: the body ({len(text)} bytes) ends mid-line without a newline, "
            f"last line {last[-120:]!r}",
        )
    families = getattr(_only, "families", None)
    if families is not None:
        text = _kept(text, families)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                rows = snapshot.samples.setdefault(sample.name, {})
                rows[frozenset(sample.labels.items())] = float(sample.value)
    except Exception as exc:  # the parser raises ValueError/TypeError/IndexError on garbage
        first = text.strip().splitlines()[:3]
        raise EngineError(
            engine, f"{source} is not Prometheus text ({type(exc).__name__}: {exc}); starts with {first}"
        ) from None
    exposed = _exposed_names(text)
    for name in [n for n in snapshot.samples if n.endswith("_total") and n not in exposed]:
        if name.removesuffix("_total") in exposed:
            snapshot.samples[name.removesuffix("_total")] = snapshot.samples.pop(name)
    has_sample_lines = any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines())
    if has_sample_lines and not snapshot.samples:
        raise EngineError(engine, f"{source} has no samples; starts with {text.strip()[:120]!r}")
    return snapshot


def _exposed_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def snapshot_from_values(values: Mapping[str, float]) -> MetricSnapshot:
    """A snapshot from plain name -> value pairs (JSON stats of engines without Prometheus)."""
    snapshot = MetricSnapshot(taken_at=time.time())
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            continue
        snapshot.samples[name] = {frozenset(): float(value)}
    return snapshot
