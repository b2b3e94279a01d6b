"""The HTML report in a real browser (headless Chromium).

For each trace (the two examples and one recorded here on the simulated
device, with phases, marks, a checkpoint save and an OOM), and for all three
together as the ranks of one job (one page, a section per rank), the test
writes the report, then has Chromium:
- load it with ``#selftest``: the page zooms, pans, hovers and clicks its own
  charts and writes the outcome into ``#selftest-result``, which
  ``--dump-dom`` returns; the test fails on any failed check, on any error
  the page caught (``#js-errors``) and on any uncaught error in the console;
- save a screenshot of the page as a user first sees it, and one after the
  self-test (zoomed, a layout picked), under ``$BROWSER_TEST_OUT`` (default
  ``target/browser``).

Without Chromium the test prints SKIPPED and exits 0 (set
``BROWSER_TEST_REQUIRED=1`` to fail instead). Environment: ``GPUALLOC_CLI``
(the gpualloc binary), ``GPUALLOC_LIBRARY`` (libgpualloc.so, for the
recorded trace), ``CHROMIUM`` (the browser).

Usage: python3 tests/browser/test_report.py
"""

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Console lines that mean a script failed.
CONSOLE_ERROR = re.compile(r"Uncaught|TypeError|ReferenceError|SyntaxError|RangeError")


def skip(why: str) -> None:
    banner = "#" * 72
    print(f"{banner}\n# SKIPPED: browser test of the HTML report: {why}\n{banner}", flush=True)
    if os.environ.get("BROWSER_TEST_REQUIRED") == "1":
        sys.exit(1)
    sys.exit(0)


def find_browser() -> str:
    given = os.environ.get("CHROMIUM")
    if given:
        return given
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    skip("no Chromium found (apt-get install -y chromium)")
    raise AssertionError("unreachable")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kw)


class Browser:
    def __init__(self, exe: str, profile: str):
        self.exe = exe
        self.profile = profile

    def _cmd(self, *args) -> list:
        return [self.exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={self.profile}",
                "--virtual-time-budget=10000", "--enable-logging=stderr", "--v=0", *args]

    def dump(self, url: str) -> tuple:
        p = run(self._cmd("--window-size=1280,2000", "--dump-dom", url))
        return p.returncode, p.stdout, p.stderr

    def screenshot(self, url: str, png: str, height: int) -> None:
        p = run(self._cmd(f"--window-size=1280,{height}", f"--screenshot={png}", url))
        if p.returncode != 0 or not os.path.exists(png):
            raise AssertionError(f"screenshot of {url} failed: {p.stderr[-2000:]}")


def element_text(dom: str, ident: str) -> str:
    m = re.search(r'<(\w+)[^>]*\bid="' + re.escape(ident) + r'"[^>]*>(.*?)</\1>', dom, re.S)
    return html.unescape(m.group(2)) if m else ""


def check_report(browser: Browser, cli: str, trace, out: str, want: dict) -> list:
    """Returns the failures for one trace, or for a list of traces shown as
    the ranks of one job (empty when it passes)."""
    traces = trace if isinstance(trace, list) else [trace]
    name = want.get("_name") or os.path.splitext(os.path.basename(traces[0]))[0]
    page = os.path.join(out, name + ".html")
    if os.path.exists(page):
        os.remove(page)
    p = run([cli, "report", *traces, "-o", page])
    if p.returncode != 0:
        return [f"{name}: gpualloc report failed: {p.stderr}"]
    text = open(page, encoding="utf-8").read()
    fails = []
    for banned in ("http://", "https://", "src=", "<link"):
        if banned in text:
            fails.append(f"{name}: the page refers to something outside it ({banned})")
    url = "file://" + page
    rc, dom, err = browser.dump(url + "#selftest")
    result = element_text(dom, "selftest-result")
    errors = element_text(dom, "js-errors").strip()
    console = [line for line in err.splitlines() if "CONSOLE" in line and CONSOLE_ERROR.search(line)]
    if rc != 0:
        fails.append(f"{name}: chromium exited {rc}: {err[-1000:]}")
    if errors:
        fails.append(f"{name}: the page caught script errors: {errors}")
    if console:
        fails.append(f"{name}: console errors: {console}")
    if not result.startswith("SELFTEST "):
        fails.append(f"{name}: the self-test wrote nothing (did the script run?)")
    else:
        verdict = json.loads(result.split(" ", 2)[2])
        print(f"{name}: {result[:9 + 4]} {json.dumps(verdict['devices'])[:600]}")
        if not verdict.get("pass"):
            fails.append(f"{name}: self-test failed: {result}")
        prefixes = sorted({d.get("prefix") for d in verdict["devices"]})
        if "_prefixes" in want and prefixes != want["_prefixes"]:
            fails.append(f"{name}: charts drawn for {prefixes}, expected {want['_prefixes']}")
        dev = verdict["devices"][0] if verdict["devices"] else {}
        for key, value in want.items():
            if not key.startswith("_") and dev.get(key) != value:
                fails.append(f"{name}: expected {key} = {value!r}, got {dev.get(key)!r}")
    for needle in want.get("_text", []):
        if needle not in dom:
            fails.append(f"{name}: the rendered page lacks {needle!r}")
    browser.screenshot(url, os.path.join(out, name + ".png"), 4400)
    browser.screenshot(url + "#selftest", os.path.join(out, name + "-selftest.png"), 1400)
    return fails


def main() -> None:
    exe = find_browser()
    try:
        started = run([exe, "--version"]).returncode == 0
    except OSError:
        started = False
    if not started:
        skip(f"{exe} does not start")
    cli = os.environ.get("GPUALLOC_CLI") or os.path.join(TARGET, "release", "gpualloc")
    if not os.path.exists(cli):
        cli = os.path.join(TARGET, "debug", "gpualloc")
    out = os.path.abspath(os.environ.get("BROWSER_TEST_OUT", os.path.join(TARGET, "browser")))
    os.makedirs(out, exist_ok=True)
    traces = [
        (os.path.join(ROOT, "examples", "gpt2-varlen.gtrace"), {"frag_hover": True}),
        (os.path.join(ROOT, "examples", "detector-multiscale.gtrace"), {"frag_hover": True}),
    ]
    lib = os.environ.get("GPUALLOC_LIBRARY") or os.path.join(TARGET, "release", "libgpualloc.so")
    recorded = os.path.join(out, "training-oom.gtrace")
    if os.path.exists(recorded):
        os.remove(recorded)
    env = dict(os.environ, GPUALLOC_LIBRARY=lib, PYTHONPATH=os.path.join(ROOT, "python-shim"))
    p = run([sys.executable, os.path.join(os.path.dirname(__file__), "make_trace.py"), recorded], env=env)
    if p.returncode != 0:
        raise SystemExit(f"could not record the OOM trace: {p.stdout}{p.stderr}")
    traces.append((recorded, {
        "steps_chart_drawn": True,
        "step_click_zooms": True,
        "_text": ["fragmentation.", "Checkpoint save", "GPUALLOC_CONF=policy:gpualloc", "live blocks, largest first."],
    }))
    ranks = [t for t, _ in traces]
    traces.append((ranks, {
        "_name": "ranks",
        "_prefixes": ["r0-", "r1-", "r2-"],
        "_text": ["Ranks", "ran out of memory", "highest peak allocated"],
    }))
    fails = []
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(exe, profile)
        for trace, want in traces:
            fails += check_report(browser, cli, trace, out, want)
    print(f"screenshots in {out}")
    if fails:
        print("FAILED:\n  " + "\n  ".join(fails))
        sys.exit(1)
    print(f"browser test passed ({len(traces)} reports)")


if __name__ == "__main__":
    main()
