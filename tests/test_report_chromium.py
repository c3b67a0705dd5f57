"""The HTML lineage report rendered by a real browser: Debian's headless `chromium`,
driven over the DevTools protocol (a small client on `websockets`, which web3 already
brings in).

What a person would see is checked in the rendered page, not in the HTML source: the
checkpoint graph draws a box for the genesis and for every committed step, the loss
curve draws a point per step at the recorded value, so do the inner-loss (per inner
step), bytes-sent and compression-error plots and the two-run comparison page, the page
logs no error and fetches nothing but itself. The harness is itself tested against a page that does go
wrong, so a silent browser cannot make the report test pass.

    .venv/bin/pytest -q tests/test_report_chromium.py
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from conftest import DLX

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (./scripts/setup installs it)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--window-size=1200,900",
         "--remote-debugging-port=0"]


class Browser:
    """One headless chromium process and a DevTools session on a single page."""

    def __init__(self, tmp: Path) -> None:
        from websockets.sync.client import connect

        profile = tmp / "profile"
        self.log = (tmp / "chromium.log").open("wb")
        # Its own session, so closing it reaches the zygote and renderers it forks too.
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = profile / "DevToolsActivePort"  # chromium writes "PORT\n/devtools/browser/ID"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().splitlines()) == 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not open its DevTools port: {(tmp / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.05)
        port, path = port_file.read_text().splitlines()
        self.stack = ExitStack()
        self.ws = self.stack.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=30))
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer, keeping the events that arrive meanwhile."""
        msg_id = next(self.ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            self.events.append(event)
            if event.get("method") == method:
                return event

    def open(self, url: str) -> None:
        """Load `url` and let it settle; the events from before it are dropped."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", session=True, expression=expression,
                        returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluating in the page failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def errors(self) -> list[str]:
        """Everything the page reported as going wrong: uncaught exceptions, console
        errors and assertions, and browser log entries at error level (failed loads,
        blocked requests, parse errors)."""
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"Uncaught {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description")))
                                                                 for a in p["args"]))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"{p['entry']['source']}: {p['entry']['text']} {p['entry'].get('url', '')}")
            elif method == "Network.loadingFailed":
                out.append(f"load failed: {p.get('errorText')}")
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path) -> tuple[int, int]:
        """A PNG of the whole page; returns its (width, height) in pixels."""
        png = base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png",
                                         captureBeyondViewport=True)["data"])
        path.write_bytes(png)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        return struct.unpack(">II", png[16:24])

    def close(self) -> None:
        if hasattr(self, "stack"):
            self.stack.close()  # the DevTools connection
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # the renderers and zygote of our own process group, should any outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


# What the page draws, read from the rendered DOM with each element's on-screen box.
_READ_PAGE = """(() => {
  const box = el => { const r = el.getBoundingClientRect(); return [r.width, r.height]; };
  const graph = document.querySelector('svg[aria-label="checkpoint chain"]');
  const curve = document.querySelector('svg[aria-label="loss curve"]');
  return {
    graph: graph && {box: box(graph), nodes: [...graph.querySelectorAll('g')]
      .filter(g => g.querySelector(':scope > rect'))
      .map(g => ({label: g.querySelector('text').textContent, title: g.querySelector('title').textContent,
                  box: box(g.querySelector(':scope > rect'))}))},
    curve: curve && {box: box(curve),
      lines: [...curve.querySelectorAll('polyline')].map(p => ({points: p.points.length, box: box(p)})),
      points: [...curve.querySelectorAll('circle > title')].map(t => t.textContent)},
    headings: [...document.querySelectorAll('h2')].map(h => h.textContent),
    scripts: document.scripts.length,
  };
})()"""


@pytest.mark.slow
def test_report_renders_the_checkpoint_graph_and_loss_curve_without_errors(trained_run, browser, tmp_path):
    run_dir, _ = trained_run
    page = tmp_path / "report.html"
    res = subprocess.run([DLX, "lineage", "--run-dir", str(run_dir), "--html", str(page), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    steps = doc["steps"]
    assert len(steps) == 3

    browser.open(page.as_uri())
    assert browser.errors() == []
    assert set(browser.requests()) == {page.as_uri()}  # self-contained: nothing else fetched
    seen = browser.evaluate(_READ_PAGE)
    assert seen["scripts"] == 0
    assert {"Checkpoint chain", "Loss"} <= set(seen["headings"])

    # The graph: one drawn box for the genesis and one per step, each naming its checkpoint.
    nodes = seen["graph"]["nodes"]
    expected = [("genesis", doc["genesis"])] + [(f"step {s['step']}", s["checkpoint"]) for s in steps]
    assert [n["label"].split()[:2] for n in nodes] == [label.split() for label, _ in expected]
    for node, (_, cid) in zip(nodes, expected, strict=True):
        assert node["title"].split()[0] == cid
        assert node["box"][0] > 50 and node["box"][1] > 20, node

    # The loss curve: a line through one point per step for the eval loss (and train loss).
    curve = seen["curve"]
    assert curve["box"][0] > 200 and curve["box"][1] > 100
    assert len(curve["lines"]) == 2
    assert all(line["points"] == len(steps) and line["box"][0] > 100 for line in curve["lines"])
    drawn = [p for p in curve["points"] if p.startswith("eval loss")]
    assert drawn == [f"eval loss {s['loss']:.4f} at step {s['step']}" for s in steps]
    assert len(set(drawn)) == len(steps)

    width, height = browser.screenshot(tmp_path / "report.png")
    assert width >= 800 and height >= 1000
    assert browser.errors() == []


# Every line chart of a page by its aria-label: its box, polylines and point titles.
_READ_PLOTS = """(() => Object.fromEntries([...document.querySelectorAll('svg[aria-label]')]
  .filter(svg => svg.getAttribute('aria-label') !== 'checkpoint chain')
  .map(svg => { const r = svg.getBoundingClientRect(); return [svg.getAttribute('aria-label'), {
    box: [r.width, r.height],
    lines: [...svg.querySelectorAll('polyline')].map(p => { const b = p.getBoundingClientRect();
      return {points: p.points.length, box: [b.width, b.height]}; }),
    points: [...svg.querySelectorAll('circle > title')].map(t => t.textContent)}]; })))()"""


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_report_plots_inner_loss_bytes_sent_and_compression_error_per_step(trained_run, browser, tmp_path):
    """The inner loss at every inner step (the run's metrics.jsonl), and the bytes sent and
    compression error at every outer step, each drawn as a line through the recorded values."""
    run_dir, _ = trained_run
    page = tmp_path / "report.html"
    res = subprocess.run([DLX, "lineage", "--run-dir", str(run_dir), "--html", str(page)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    browser.open(page.as_uri())
    assert browser.errors() == []
    assert set(browser.requests()) == {page.as_uri()}
    plots = browser.evaluate(_READ_PLOTS)
    inner = [r for r in _records(run_dir) if r["kind"] == "inner"]
    outer = [r for r in _records(run_dir) if r["kind"] == "outer"]
    assert len(inner) == 12 and len(outer) == 3
    expected = {
        "inner loss": [f"inner loss (replica 0) {r['loss']:.4f} at step {r['global_step']}" for r in inner],
        "bytes sent": [f"bytes sent (all ranks) {r['bytes_sent'] / 1e6:.2f} MB at step {r['step']}" for r in outer],
        "compression error": [f"relative error {r['rel_error']:.4g} at step {r['step']}" for r in outer],
    }
    for label, points in expected.items():
        plot = plots[label]
        assert plot["box"][0] > 200 and plot["box"][1] > 100, (label, plot)
        assert [line["points"] for line in plot["lines"]] == [len(points)], (label, plot)
        assert plot["points"] == points, label
    assert plots["inner loss"]["lines"][0]["box"][0] > 300  # spread over the inner steps, not a dot
    assert plots["bytes sent"]["lines"][0]["box"][1] > 50  # cumulative: it climbs
    assert browser.errors() == []


@pytest.mark.slow
def test_compare_page_draws_both_runs_on_shared_axes(trained_run, browser, tmp_path):
    run_dir, _ = trained_run
    other = tmp_path / "copy"
    shutil.copytree(run_dir, other)
    page = tmp_path / "compare.html"
    res = subprocess.run([DLX, "lineage", "compare", str(run_dir), str(other), "--html", str(page), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["config"] == [] and [r["step"] for r in doc["steps"]] == [1, 2, 3]
    assert all(r["eval_loss_a"] == r["eval_loss_b"] is not None for r in doc["steps"])
    browser.open(page.as_uri())
    assert browser.errors() == []
    plots = browser.evaluate(_READ_PLOTS)
    assert set(plots) == {"eval loss", "inner loss", "bytes sent", "compression error"}
    assert [line["points"] for line in plots["eval loss"]["lines"]] == [3, 3]
    assert [line["points"] for line in plots["inner loss"]["lines"]] == [12, 12]
    assert browser.evaluate("document.body.innerText").count("the two configurations are identical") == 1


def test_the_harness_sees_script_errors_console_errors_and_outside_fetches(browser, tmp_path):
    """The checks above can fail: a page that throws, logs an error and reaches for an
    outside asset is caught on all three counts."""
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><title>bad</title><p>bad page</p>"
                    "<img src='http://127.0.0.1:9/missing.png'>"
                    "<script>console.error('drawn wrong'); throw new Error('boom')</script>")
    browser.open(page.as_uri())
    errors = browser.errors()
    assert any(e.startswith("Uncaught Error: boom") for e in errors), errors
    assert any("console.error: drawn wrong" in e for e in errors), errors
    assert "http://127.0.0.1:9/missing.png" in browser.requests()
    assert any(e.startswith("load failed") for e in errors), errors
    assert browser.evaluate(_READ_PAGE)["graph"] is None
