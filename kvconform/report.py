"""Allure attachments: measurements, curves (matplotlib PNG), log tails; environment, categories.

Attachments are no-ops when allure-pytest is not active (no --alluredir).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import allure

if TYPE_CHECKING:
    import pytest

    from kvconform.contract import EngineAdapter
    from kvconform.results import Verdict

_environment: dict[str, str] = {}

CATEGORIES = [
    {
        "name": "Known finding on an engine (strict xfail)",
        "matchedStatuses": ["skipped"],
        "messageRegex": ".*finding on .*",
    },
    {
        "name": "Engine broke a promise (check failed)",
        "matchedStatuses": ["failed"],
        "messageRegex": r"(?s).*\[[a-z0-9_-]+\] [a-z_]+::.*",
    },
    {
        "name": "Engine crashed, hung or answered garbage",
        "matchedStatuses": ["broken", "failed"],
        "messageRegex": r"(?s).*engine [a-z0-9_-]+: .*",
    },
    {"name": "Suite error", "matchedStatuses": ["broken"]},
]


def environment_property(key: str, value: str) -> None:
    _environment[key] = str(value)


def attach_verdict(verdict: Verdict) -> None:
    if verdict.measures:
        allure.attach(
            json.dumps(verdict.as_dict(), indent=1),
            name="measurements.json",
            attachment_type=allure.attachment_type.JSON,
        )
        allure.attach(verdict.summary(), name="measurements", attachment_type=allure.attachment_type.TEXT)
    for name, points in verdict.series.items():
        if points:
            allure.attach(
                plot_series(name, points), name=f"{name}.png", attachment_type=allure.attachment_type.PNG
            )
            allure.attach(
                "t,value\n" + "\n".join(f"{t:.4f},{v}" for t, v in points),
                name=f"{name}.csv",
                attachment_type=allure.attachment_type.CSV,
            )


def attach_failure_context(item: pytest.Item, adapter: EngineAdapter | None) -> None:
    if adapter is None:
        return
    try:
        logs = adapter.describe_logs()
    except Exception as exc:  # context is best effort; the failure itself is already reported
        logs = {"adapter": f"could not read logs: {exc}"}
    for name, tail in logs.items():
        if tail:
            allure.attach(tail, name=f"log tail: {name}", attachment_type=allure.attachment_type.TEXT)
    events = adapter.ledger.events()[-200:]
    if events:
        allure.attach(
            "\n".join(json.dumps(e.as_dict()) for e in events),
            name="KV event ledger (last 200)",
            attachment_type=allure.attachment_type.TEXT,
        )


def plot_series(title: str, points: list[tuple[float, float]], ylabel: str = "") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, marker="." if len(points) < 60 else None, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel("t (s)" if xs and xs[-1] > len(xs) else "")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_allure_environment(config: pytest.Config, meta: dict[str, Any]) -> None:
    alluredir = config.getoption("--alluredir", default=None)
    if not alluredir:
        return
    out = Path(alluredir)
    out.mkdir(parents=True, exist_ok=True)
    props = dict(_environment)
    props["platform"] = meta.get("platform", "host")
    for engine, version in meta.get("engines", {}).items():
        props[f"engine.{engine}.version"] = version
    for engine, options in meta.get("engine_options", {}).items():
        for key, value in options.items():
            if value:
                shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
                props[f"engine.{engine}.{key}"] = shown
    (out / "environment.properties").write_text(
        "\n".join(f"{k}={v}" for k, v in sorted(props.items())) + "\n"
    )
    (out / "categories.json").write_text(json.dumps(CATEGORIES, indent=1))


def attach_png(name: str, png: bytes) -> None:
    allure.attach(png, name=f"{name}.png", attachment_type=allure.attachment_type.PNG)


def plot_sweep(curves: dict[int, list[tuple[float, float, float]]]) -> bytes:
    """Hit ratio of the shared prefix vs shared fraction, one line per block size; the
    oracle dashed beside each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for block, curve in sorted(curves.items()):
        xs = [c[0] for c in curve]
        (line,) = ax.plot(xs, [c[1] for c in curve], marker="o", label=f"block {block} measured")
        ax.plot(xs, [c[2] for c in curve], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("shared prefix fraction of the prompt")
    ax.set_ylabel("cached tokens / shared tokens")
    ax.set_title("Prefix hits vs block size (dashed: oracle)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
