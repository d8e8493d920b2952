"""The HTML report a reviewer opens: generated from a real run, rendered in headless Chromium.

A tiny session of our suites runs against the reference engine with the granularity_loss fault
(`kvconform run`, so the main job is exercised end to end): the partial-block checks and the
block-size sweep fail, the repeated-prompt check passes, the radix-cache checks skip (the
reference lacks radix_cache_model). A known-failures manifest made here records one partial-block
variant as a finding with an upstream link. The report is then regenerated with a baseline in
which the sweep passed (the gate's verdict: FAIL, one new failure).

What the report must show: its name states "1 finding (1 known-upstream), 2 new failures" and
the gate; the tree groups by promise, then engine; the finding is a failed leaf titled "known
finding (known-upstream): CHECK — MEASURE = value (expected ...)" with the `known finding` tag,
its link and named setup steps; the capability skips are one leaf "engine reference lacks
radix_cache_model: K checks"; a failed check shows its measurements and, for the sweep, its plot
as a decoded image; the Quality Gates tab
holds the kvconform gate's verdict, Global Attachments the conformance dashboard; the history
file gained a point per report; dashboard.html (beside the report) has one cell per engine x
check with the finding's measure and the skip's capability. The page requests nothing outside
itself. Screenshots go to the results dir (screenshots/) and to Allure.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no port,
no websocket library. Needs the Debian package `chromium` and Node.js/npm; skipped with the
reason when either is absent, unless KVCONFORM_REQUIRE_REPORT_TOOLS=1 (then it fails).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import allure
import pytest

from kvconform import dashboard
from kvconform.checkids import base_check
from kvconform.mainjob import HISTORY_NAME, build_report, run_main_job
from kvconform.plugin.session import results_dir
from kvconform.records import CheckResult

FAULT = "granularity_loss"
SELECT = "partial_block or repeated_prompt or block_size_sweep or radix_cache"
PASSING_CHECK = "test_repeated_prompt_served_from_cache"
FAILED_CHECK = "prefix_reuse::test_partial_block_prefix_hits_match_oracle[128]"
FINDING_CHECK = "prefix_reuse::test_partial_block_prefix_hits_match_oracle[32]"  # in the manifest below
PLOT_CHECK = "test_block_size_sweep"  # fails under the fault and attaches a PNG plot
LACKED = "radix_cache_model"  # the reference's radix-cache checks skip for it
LINK = "https://example.org/kvconform/reference-granularity-finding"
MANIFEST = f"""
[[finding]]
engine = "reference"
version = "*+faults:{FAULT}"
check = "{FINDING_CHECK}"
measured = "shared prefix 113 tokens at block 32: 0 cached tokens, oracle 96"
summary = "the granularity_loss fault drops partial-block prefix hits"
measures = {{ "cached_tokens_in_response" = "below", "prefix_hits_counter_delta" = "below" }}
class = "known-upstream"
contract = "the engine's prefix cache serves whole blocks of a shared prefix (the fault breaks it)"
link = "{LINK}"
"""
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]
VIEWPORT = (1400, 1800)


def _missing(what: str) -> None:
    message = f"{what} (CI: apt-get install -y chromium; Node.js >= 20 with npm)"
    if os.environ.get("KVCONFORM_REQUIRE_REPORT_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _chromium() -> str:
    for name in (os.environ.get("KVCONFORM_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name) if name else None
        if path:
            return path
    _missing("chromium is not installed")
    raise AssertionError("unreachable")


class Chromium:
    """Headless Chromium driven over the DevTools protocol on fds 3/4 (NUL-separated JSON)."""

    def __init__(self, executable: str, profile: Path, log: Path) -> None:
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()

        def wire_fds() -> None:  # in the child: its end of each pipe at fd 3 (commands) / 4 (replies)
            cmd = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            rep = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(cmd, 3)
            os.dup2(rep, 4)

        args = [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
        args += [f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "about:blank"]
        with log.open("wb") as log_fh:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                preexec_fn=wire_fds,
                pass_fds=(3, 4),
                start_new_session=True,
            )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.log = log
        self._out, self._in = to_chrome_w, from_chrome_r
        self._buf = b""
        self._id = 0
        self.session: str | None = None
        self.requests: list[str] = []  # every URL the page asked for (Network domain)

    def _message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer in time; log: {self._log_tail()}")
            ready, _, _ = select.select([self._in], [], [], left)
            if ready:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the DevTools pipe; log: {self._log_tail()}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, browser: bool = False) -> Any:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not browser:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            reply = self._message(deadline)
            if reply.get("method") == "Network.requestWillBeSent":
                self.requests.append(reply["params"]["request"]["url"])
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open_page(self) -> None:
        targets = self.send("Target.getTargets", browser=True)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = self.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}, True)
        self.session = attached["sessionId"]
        self.send("Page.enable")
        self.send("Network.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": VIEWPORT[0], "height": VIEWPORT[1], "deviceScaleFactor": 1, "mobile": False},
        )

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def js(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        body = self.js("document.body ? document.body.innerText.slice(0, 600) : ''")
        raise AssertionError(f"report: {what} did not appear within {timeout:.0f}s; page text: {body!r}")

    def screenshot(self) -> bytes:
        self.js("window.scrollTo(0, 0)")
        time.sleep(0.3)
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", browser=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what we started
            self.proc.wait(timeout=10)
        os.close(self._out)
        os.close(self._in)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    exe = _chromium()
    profile = tmp_path / "chromium-profile"  # fresh each run
    profile.mkdir()
    chrome = Chromium(exe, profile, tmp_path / "chromium.log")
    try:
        chrome.open_page()
        yield chrome
    finally:
        chrome.close()


@pytest.fixture
def failing_run(tmp_path: Path) -> dict[str, Any]:
    """`kvconform run` on the reference engine with one fault: some checks fail, one passes."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _missing("node/npm are not installed (the Allure 3 report generator is an npm package)")
    base = tmp_path / "report-run"
    results, report = base / "results", base / "report"
    manifest = tmp_path / "known-failures.toml"
    manifest.write_text(MANIFEST)
    started = time.monotonic()
    args = ["--fault", FAULT, "-k", SELECT, "-q", "--known-failures", str(manifest)]
    code = run_main_job(["reference"], str(results), str(report), args)
    data = json.loads((results / "results.json").read_text())
    # regenerate with a baseline in which the sweep passed: the gate's verdict is FAIL
    baseline = json.loads(json.dumps(data))
    for record in baseline["records"]:
        if PLOT_CHECK in record["check"]:
            record["outcome"], record["measures"] = "passed", []
    (base / "baseline").mkdir()
    (base / "baseline" / "results.json").write_text(json.dumps(baseline))
    matrix = base / "mutation-matrix.json"
    killed = {"check": base_check(FINDING_CHECK), "measure": "cached_tokens_in_response"}
    matrix.write_text(json.dumps({"measures": [{**killed, "killed_by": ["granularity_loss"]}]}))
    build_report(
        results / "allure", results, report, str(base / "baseline"), str(results / HISTORY_NAME), str(matrix)
    )
    return {
        "code": code,
        "index": report / "index.html",
        "dashboard": report / dashboard.HTML_NAME,
        "results": results,
        "records": data["records"],
        "seconds": time.monotonic() - started,
    }


def _record(records: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in records if r["check"] == name or ("::" not in name and name in r["check"]))


_EXPAND = (
    "(() => { const closed = [...document.querySelectorAll('[data-testid=tree-section]')]"
    ".filter(s => s.nextElementSibling?.dataset?.testid !== 'tree-content');"
    " closed.forEach(s => s.querySelector('[data-testid=tree-section-title]').click());"
    " return closed.length; })()"
)


def _expand_tree(chrome: Chromium) -> None:
    """Open every section of the report's tree (promise > engine), however deep."""
    for _ in range(6):
        if not chrome.js(_EXPAND):
            return
        time.sleep(0.3)


def _texts(chrome: Chromium, testid: str) -> list[str]:
    return chrome.js(f"[...document.querySelectorAll('[data-testid={testid}]')].map(e => e.innerText)")


def _save(request: pytest.FixtureRequest, name: str, png: bytes) -> Path:
    out = results_dir(request.config) / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_bytes(png)
    allure.attach(png, name=name, attachment_type=allure.attachment_type.PNG)
    return path


def _open_check(chrome: Chromium, name: str) -> None:
    _expand_tree(chrome)
    chrome.js(
        "[...document.querySelectorAll('[data-testid=tree-leaf]')]"
        f".find(e => e.innerText.includes({json.dumps(name)})).click()"
    )
    chrome.wait_for(
        "document.querySelector('[data-testid=test-result-status-failed]') && "
        "document.querySelectorAll('[data-testid=test-result-attachment-header]').length",
        f"the failed check {name} with its attachments",
    )


def _attachment_names(chrome: Chromium) -> list[str]:
    # each header reads "N\nname\nmime type\nsize"
    return chrome.js(
        "[...document.querySelectorAll('[data-testid=test-result-attachment-header]')]"
        ".map(e => e.innerText.split('\\n')[1])"
    )


def _expand(chrome: Chromium, names: list[str]) -> None:
    chrome.js(
        "[...document.querySelectorAll('[data-testid=test-result-attachment-header]')]"
        f".filter(e => {json.dumps(names)}.includes(e.innerText.split('\\n')[1]))"
        ".forEach(e => e.querySelector('button').click())"
    )


def _attachment_text(chrome: Chromium, name: str) -> str:
    return chrome.js(
        "[...document.querySelectorAll('[data-testid=test-result-attachment]')]"
        f".filter(e => e.innerText.split('\\n')[1] === {json.dumps(name)})"
        ".map(e => e.innerText).join('\\n')"
    )


def test_report_of_a_failing_run_renders(
    browser: Chromium, failing_run: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    # the main job: pytest's exit code comes back, and the report exists although checks failed
    records = failing_run["records"]
    assert failing_run["code"] == 1, f"pytest's exit code must come back: {failing_run['code']}"
    assert failing_run["index"].is_file(), "the report must be generated even though checks failed"
    assert _record(records, PASSING_CHECK)["outcome"] == "passed"
    assert _record(records, FAILED_CHECK)["outcome"] == "failed"
    assert _record(records, FINDING_CHECK)["outcome"] == "xfailed"
    assert _record(records, PLOT_CHECK)["outcome"] == "failed"
    skipped = [r for r in records if r["outcome"] == "skipped"]
    assert skipped and all(
        dashboard.lacked_capability(CheckResult.from_dict(r)) == LACKED for r in skipped
    ), skipped
    browser.navigate(failing_run["index"].as_uri())

    # the overview: its name states the findings, the new failures and the gate
    browser.wait_for(
        "document.querySelectorAll('[data-testid=tree-section]').length", "the overview's test tree"
    )
    title = browser.js("document.querySelector('[data-testid=report-title]').innerText")
    headline = "1 finding (1 known-upstream), 2 new failures"
    assert "kvconform" in title and headline in title and "gate FAIL" in title, title

    # the tree: promise > engine > checks; the finding a failed leaf; the skips one leaf
    _expand_tree(browser)
    sections = _texts(browser, "tree-section-title")
    assert {dashboard.PREFIX, "Capability skips", "reference"} <= set(sections), sections
    assert not {"prefix_reuse", "suites.prefix_reuse", "test_block_reuse"} & set(sections), sections
    leaves = _texts(browser, "tree-leaf-title")
    assert len(leaves) == len(records) - len(skipped) + 1, leaves
    skip_leaf = f"engine reference lacks {LACKED}: {len(skipped)} checks"
    assert skip_leaf in leaves, leaves
    title = f"known finding (known-upstream): {FINDING_CHECK} — "
    finding_leaf = next(t for t in leaves if t.startswith(title))
    assert "cached_tokens_in_response = 0 tokens (expected == 96 tokens)" in finding_leaf, finding_leaf
    not_passing = sum(r["outcome"] in ("failed", "xfailed") for r in records)
    assert (
        browser.js("document.querySelectorAll('[data-testid=tree-leaf-status-failed]').length") == not_passing
    )
    assert browser.js("document.querySelectorAll('[data-testid=tree-leaf-status-skipped]').length") == 1
    passed = sum(r["outcome"] == "passed" for r in records)
    assert browser.js("document.querySelectorAll('[data-testid=tree-leaf-status-passed]').length") == passed
    _save(request, "report-overview.png", browser.screenshot())

    # the finding: failed, `known finding` label, its upstream link, named setup steps
    _open_check(browser, f"known finding (known-upstream): {FINDING_CHECK}")
    page = browser.js("document.body.innerText")
    browser.js(
        "[...document.querySelectorAll('button')].filter(b => b.innerText === 'Show more')"
        ".forEach(b => b.click())"
    )
    labels = browser.js(
        "[...document.querySelectorAll('[data-testid=metadata-item]')].map(e => "
        "[e.querySelector('[data-testid=metadata-item-key]')?.innerText, "
        "e.querySelector('[data-testid=metadata-item-value]')?.innerText])"
    )
    assert ["finding", "known finding"] in labels and ["epic", dashboard.PREFIX] in labels, labels
    assert ["parentSuite", "reference"] in labels or ["engine", "reference"] in labels, labels
    assert "Known finding (known-upstream) on reference" in page
    links = browser.js(
        "[...document.querySelectorAll('[data-testid=test-result-meta-link] a, a')].map(a => a.href)"
    )
    assert LINK in links, links
    assert "setup: start the engine (once per session)" in page, "setup steps are named"
    assert "::<lambda>" not in page
    _save(request, "report-finding.png", browser.screenshot())

    # the quality gate: the kvconform gate's verdict and its blocking row
    browser.navigate(failing_run["index"].as_uri())
    browser.wait_for("document.querySelector('[data-testid=nav-tab-qualityGate]')", "the Quality Gates tab")
    browser.js("document.querySelector('[data-testid=nav-tab-qualityGate]').click()")
    rules = browser.wait_for(
        "(() => { const r = [...document.querySelectorAll('[data-testid=quality-gate-result-rule]')]"
        ".map(e => e.innerText); return r.length ? r : null; })()",
        "the Quality Gates tab's results",
    )
    assert "kvconform gate" in rules and any(PLOT_CHECK in r and "new failure" in r for r in rules), rules
    assert "gate: FAIL" in browser.js("document.querySelector('[data-testid=base-layout]').innerText")
    _save(request, "report-quality-gate.png", browser.screenshot())

    # the dashboard inside the report (a global attachment) and beside it (dashboard.html)
    browser.js("document.querySelector('[data-testid=nav-tab-globalAttachments]').click()")
    browser.wait_for(
        "[...document.querySelectorAll('[data-testid=test-result-attachment-header]')]"
        ".some(e => e.innerText.includes('Conformance dashboard'))",
        "the conformance dashboard among the global attachments",
    )
    history = (failing_run["results"] / HISTORY_NAME).read_text().splitlines()
    assert len(history) == 2, "each report appends one point to the Allure history"
    browser.navigate(failing_run["dashboard"].as_uri())
    cells = browser.wait_for(
        "(() => { const c = [...document.querySelectorAll('td.cell')].map(e => "
        "[e.dataset.check, e.dataset.state, e.innerText]); return c.length ? c : null; })()",
        "the dashboard's cells",
    )
    checks = {r["check"] for r in records}
    assert len(cells) == len(checks), cells
    by_check = {c[0]: (c[1], c[2]) for c in cells}
    assert (
        by_check[FINDING_CHECK][0] == "finding"
        and "cached_tokens_in_response = 0" in by_check[FINDING_CHECK][1]
    )
    assert "upstream" in by_check[FINDING_CHECK][1]
    assert by_check[FAILED_CHECK][0] == "failed"
    assert by_check[_record(records, PASSING_CHECK)["check"]] == ("pass", "pass")
    assert all(by_check[r["check"]] == ("skip", f"skip: lacks {LACKED}") for r in skipped)
    head = browser.js("document.getElementById('versions').innerText")
    assert "reference" in head and "kvref" in head, head
    shown = browser.js("document.getElementById('headline').innerText")
    assert "1 finding (1 known-upstream), 2 new failures" in shown
    _save(request, "dashboard.png", browser.screenshot())
    browser.navigate(failing_run["index"].as_uri())
    browser.wait_for("document.querySelectorAll('[data-testid=tree-section]').length", "the overview")

    # a failed check: its measurements, with the violated expectation, render
    record = _record(records, FAILED_CHECK)
    violated = [m["name"] for m in record["measures"] if m.get("ok") is False]
    assert violated, "the failed check recorded no violated expectation"
    _open_check(browser, FAILED_CHECK)
    names = _attachment_names(browser)
    assert {"measurements", "measurements.json"} <= set(names), names
    _expand(browser, ["measurements"])
    browser.wait_for(
        "[...document.querySelectorAll('[data-testid=test-result-attachment]')]"
        f".some(e => e.innerText.includes({json.dumps(violated[0])}))",
        f"measurement {violated[0]} of {FAILED_CHECK}",
    )
    assert "VIOLATED" in _attachment_text(browser, "measurements")

    # the failed sweep: its plot is decoded as an image, beside its measurements
    browser.navigate(failing_run["index"].as_uri())
    browser.wait_for("document.querySelectorAll('[data-testid=tree-section]').length", "the overview")
    _open_check(browser, PLOT_CHECK)
    names = _attachment_names(browser)
    plots = [n for n in names if n.endswith(".png")]
    assert plots and "measurements" in names, names
    _expand(browser, [*plots, "measurements"])
    size = browser.wait_for(
        "(() => { const i = [...document.querySelectorAll('[data-testid=test-result-attachment] img')]"
        ".find(i => i.complete && i.naturalWidth > 0); return i && [i.naturalWidth, i.naturalHeight]; })()",
        f"the plot {plots[0]} as a decoded image",
    )
    assert size[0] >= 300 and size[1] >= 200, f"plot rendered at {size}"
    sweep_violated = [m["name"] for m in _record(records, PLOT_CHECK)["measures"] if m.get("ok") is False]
    assert sweep_violated and sweep_violated[0] in _attachment_text(browser, "measurements")
    path = _save(request, "report-failed-check.png", browser.screenshot())

    # the report is self-contained: nothing but itself and its inline data was requested
    browser.js("1")  # drain pending events
    outside = [u for u in browser.requests if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert not outside, f"the report called out: {outside[:5]}"
    print(f"screenshots in {path.parent}; the report run took {failing_run['seconds']:.1f}s")
