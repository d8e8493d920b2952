"""Metric snapshots: Prometheus parsing, labels, counter names, deltas, garbage."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconform.errors import EngineError
from kvconform.metrics import MetricSnapshot, parse_prometheus, snapshot_from_values

EXPOSITION = """\
# HELP kv_hits_total Prefix-cache hit tokens.
# TYPE kv_hits_total counter
kv_hits_total{model="m",tier="gpu"} 120
kv_hits_total{model="m",tier="cpu"} 30
kv_hits_created{model="m",tier="gpu"} 1.7e9
# HELP kv_usage Fraction of the KV pool in use.
# TYPE kv_usage gauge
kv_usage{model="m"} 0.25
# HELP kv_latency Step latency.
# TYPE kv_latency histogram
kv_latency_bucket{le="0.1"} 3
kv_latency_bucket{le="+Inf"} 5
kv_latency_count 5
kv_latency_sum 0.9
"""


def test_parse_labels_and_types() -> None:
    snap = parse_prometheus(EXPOSITION, engine="fake")
    assert snap.has("kv_hits_total") and snap.has("kv_usage")
    assert snap.value("kv_hits_total") == 150  # sum over every label set
    assert snap.value("kv_hits_total", tier="gpu") == 120
    assert snap.value("kv_hits_total", model="m", tier="cpu") == 30
    assert snap.value("kv_hits_total", tier="disk") == 0  # exported, no such series
    assert snap.value("kv_usage") == 0.25
    assert snap.value("kv_latency_bucket", le="+Inf") == 5
    assert snap.value("kv_latency_count") == 5
    assert sorted(s.labels["tier"] for s in snap.series("kv_hits_total")) == ["cpu", "gpu"]
    assert {"model": "m", "tier": "gpu"} in snap.labels_of("kv_hits_total")
    assert snap.as_dict(["kv_usage"]) == {'kv_usage{model="m"}': 0.25}


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("# TYPE kv_stores counter\nkv_stores_total 7\n", "kv_stores_total"),  # modern exposition
        ("# TYPE kv_stores counter\nkv_stores 7\n", "kv_stores"),  # Rust's prometheus crate
        ("kv_stores_total 7\n", "kv_stores_total"),  # untyped
    ],
    ids=["typed-with-total", "typed-without-total", "untyped"],
)
def test_counters_are_read_under_the_name_the_engine_exposed(text: str, name: str) -> None:
    """prometheus_client's parser renames every counter sample to `<family>_total`; the
    snapshot keeps the engine's own name, so a name the engine lacks is never read."""
    snap = parse_prometheus(text)
    assert snap.value(name) == 7
    other = "kv_stores" if name.endswith("_total") else "kv_stores_total"
    assert not snap.has(other)


def test_missing_metric() -> None:
    snap = parse_prometheus(EXPOSITION)
    with pytest.raises(KeyError, match="kv_nope"):
        snap.value("kv_nope")
    assert snap.value("kv_nope", default=0.0) == 0.0
    assert snap.value("kv_nope", default=3.0) == 3.0


def test_delta_between_snapshots() -> None:
    before = parse_prometheus(EXPOSITION)
    after = parse_prometheus(
        EXPOSITION.replace('tier="gpu"} 120', 'tier="gpu"} 200').replace('tier="cpu"} 30', 'tier="cpu"} 31')
    )
    assert after.delta(before, "kv_hits_total") == 81
    assert after.delta(before, "kv_hits_total", tier="gpu") == 80
    assert after.delta(before, "kv_usage") == 0
    # A counter the engine creates on first use: absent before means 0 before.
    later = parse_prometheus(EXPOSITION + "# TYPE kv_new counter\nkv_new_total 4\n")
    assert later.delta(before, "kv_new_total") == 4


@pytest.mark.parametrize(
    "garbage",
    [
        "<html><body>502 Bad Gateway</body></html>\n<p>nginx</p>\n",
        '{"num_running_reqs": 0}\nsecond line\nthird line\nfourth line\n',
        "kv_hits_total{model=m} 1\n",
        "kv_hits_total twelve\n",
    ],
)
def test_garbage_is_an_engine_error_with_the_first_lines(garbage: str) -> None:
    with pytest.raises(EngineError) as err:
        parse_prometheus(garbage, engine="fakeeng", source="http://x/metrics")
    message = str(err.value)
    assert message.startswith("engine fakeeng: http://x/metrics ")
    first = garbage.strip().splitlines()[0]
    assert first[:40] in message
    assert "fourth line" not in message


def test_empty_exposition_is_an_empty_snapshot() -> None:
    assert parse_prometheus("").names() == []


def test_snapshot_from_json_values() -> None:
    snap = snapshot_from_values({"used": 3, "ratio": 0.5, "flag": True, "name": "x", "nan": math.nan})
    assert snap.names() == ["ratio", "used"]
    assert snap.value("used") == 3.0


label_values = st.sampled_from(["gpu", "cpu", "disk"])
increments = st.lists(st.tuples(label_values, st.integers(0, 10**9)), max_size=20)


def render(values: dict[str, int]) -> str:
    lines = ["# TYPE up gauge", "up 1", "# TYPE kv_bytes counter"]
    lines += [f'kv_bytes_total{{tier="{tier}"}} {value}' for tier, value in sorted(values.items())]
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None)
@given(start=st.dictionaries(label_values, st.integers(0, 10**12)), steps=increments)
def test_delta_equals_the_sum_of_increments(start: dict[str, int], steps: list[tuple[str, int]]) -> None:
    """Scrape, apply increments, scrape again: the delta is exactly what was added (per label
    and in total), whatever the counters started at."""
    current = dict(start)
    for tier, amount in steps:
        current[tier] = current.get(tier, 0) + amount
    before, after = parse_prometheus(render(start)), parse_prometheus(render(current))
    assert after.delta(before, "kv_bytes_total") == sum(a for _, a in steps)
    for tier in ("gpu", "cpu", "disk"):
        assert after.delta(before, "kv_bytes_total", tier=tier) == sum(a for t, a in steps if t == tier)


def test_snapshot_value_with_no_labels_asked_sums_all() -> None:
    snap = MetricSnapshot(taken_at=0.0)
    snap.samples["x"] = {frozenset({("a", "1")}): 2.0, frozenset({("a", "2"), ("b", "3")}): 5.0}
    assert snap.value("x") == 7.0
    assert snap.value("x", a="2") == 5.0
    assert snap.value("x", a="2", b="4") == 0.0


def test_only_names_parses_just_the_metrics_a_sampler_reads() -> None:
    from kvconform.metrics import only_names

    text = (
        "# HELP a:hist h\n# TYPE a:hist histogram\n"
        'a:hist_bucket{le="1.0"} 1.0\na:hist_bucket{le="+Inf"} 2.0\na:hist_count 2.0\na:hist_sum 3.0\n'
        "# HELP a:usage u\n# TYPE a:usage gauge\na:usage 0.25\n"
        "# HELP a:bytes b\n# TYPE a:bytes counter\na:bytes_total 4096.0\n"
    )
    with only_names(["a:usage", "a:bytes_total{kind=x}"]):
        kept = parse_prometheus(text)
    assert kept.names() == ["a:bytes_total", "a:usage"]
    assert kept.value("a:bytes_total") == 4096.0 and kept.value("a:usage") == 0.25
    assert "a:hist_count" in parse_prometheus(text).names()  # outside the context: everything
