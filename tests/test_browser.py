"""The tool debugger in a real JupyterLab, driven by headless Chromium through Playwright.

A JupyterLab server runs on 127.0.0.1 with a token and fresh config/data/runtime directories;
Chromium (Debian's ``chromium``; Playwright cannot download its own browser here) opens the
example notebook, runs it, fills a field of the debugger, clicks Run and checks what renders.
Chromium is kept off the network: a dead proxy for everything but loopback, and no DNS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from kernelexec._tempdirs import remove_tree
from tests.support.procs import mentioning

CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TOKEN = "kx-browser-test-token"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (make test installs it as root)",
    ),
]
playwright_sync = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")
pytest.importorskip("jupyterlab", reason="needs jupyterlab (dev extra)")


@dataclass
class Lab:
    url: str
    root: Path
    short: Path  # a short private dir: unix socket paths must fit in 108 bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, method: str = "GET") -> int:
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    root = tmp_path / "root"
    shutil.copytree(NOTEBOOKS, root)
    dirs = {
        name: tmp_path / name.lower()
        for name in (
            "JUPYTER_CONFIG_DIR",
            "JUPYTER_DATA_DIR",
            "JUPYTER_RUNTIME_DIR",
            "JUPYTERLAB_SETTINGS_DIR",
            "JUPYTERLAB_WORKSPACES_DIR",
            "IPYTHONDIR",
        )
    }
    short = Path(tempfile.mkdtemp(prefix="kxb-", dir="/tmp"))
    dirs["TMPDIR"] = short / "tmp"  # the debugger's sandbox kernels put their sockets here
    for d in dirs.values():
        d.mkdir()
    # No "get notified about Jupyter news?" toast over the page.
    notify = dirs["JUPYTERLAB_SETTINGS_DIR"] / "@jupyterlab" / "apputils-extension"
    notify.mkdir(parents=True)
    (notify / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()}}
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed after the server exits
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True",
            "--ServerApp.terminals_enabled=False",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _request(f"{url}/api/status") != 200:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "JupyterLab did not answer within 60 s"
            time.sleep(0.1)  # polling a server that is starting: nothing to wait on
        yield Lab(url, root, short)
    finally:
        # The server stops its kernels (each in its own session) on /api/shutdown; a kernel's
        # exit closes the debugger's executor, whose sandbox kernels live under our TMPDIR.
        _request(f"{url}/api/shutdown", "POST")
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        # Kernels exiting on their own: wait for them (psutil polls their exit), then kill
        # whatever is left.
        _, left = psutil.wait_procs(mentioning(str(short)), timeout=30)
        log.close()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        # The debugger's sandbox kernels' capped directories are still mounted in there when
        # the server's kernels have gone (a plain rmtree left one /tmp/kxb-* per run).
        remove_tree(str(short))
        assert not short.exists(), f"{short} was not removed"
        assert not left, f"processes left running after the server stopped: {left}"


def test_debugger_in_jupyterlab(lab: Lab, tmp_path: Path) -> None:
    sync_playwright = playwright_sync.sync_playwright
    expect = playwright_sync.expect
    browser_dirs = lab.short / "chromium"
    browser_dirs.mkdir()
    os.environ["TMPDIR"] = str(browser_dirs)  # the browser profile goes here
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM),
                headless=True,
                chromium_sandbox=False,
                args=[
                    "--proxy-server=http://127.0.0.1:9",
                    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                ],
                env={
                    **os.environ,
                    "XDG_CONFIG_HOME": str(browser_dirs / "config"),
                    "XDG_CACHE_HOME": str(browser_dirs / "cache"),
                },
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1500})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
                page.on(
                    "console",
                    lambda msg: errors.append(msg.text) if msg.type == "error" else None,
                )
                # The notebook's own file at the debugger's default export name.
                users = lab.root / "debug.ipynb"
                users.write_text("the user's notebook")
                _run_notebook(page, lab)
                debugger = page.locator(".jp-OutputArea-output .kx-debugger")
                expect(debugger.or_(page.get_by_text("Error displaying widget"))).to_be_visible(
                    timeout=60_000
                )
                expect(debugger).to_be_visible()
                # The notebook's own calls already rendered their result.
                expect(debugger.locator(".kx-summary")).to_contain_text("invalid_args")
                field = debugger.get_by_label("text *", exact=True)
                field.fill("a rose is a rose is a rose")
                field.press("Tab")
                debugger.get_by_role("button", name="Run", exact=True).click()
                summary = debugger.locator(".kx-summary")
                expect(summary).to_contain_text("success", timeout=60_000)
                expect(summary).to_contain_text('"words": 8')
                expect(debugger.locator(".kx-output")).to_contain_text("8 words")
                expect(debugger.locator(".kx-history")).to_contain_text("a rose is")
                debugger.get_by_role("tab", name="Variables").click()
                expect(debugger.locator(".kx-variables")).to_contain_text("word_stats")
                debugger.get_by_role("tab", name="History").click()
                # Export: the user's file at the default name is left alone.
                debugger.get_by_role("button", name="Export notebook", exact=True).click()
                expect(debugger).to_contain_text("wrote debug-1.ipynb")
                assert users.read_text() == "the user's notebook"
                assert (lab.root / "debug-1.ipynb").exists()
                # No render threw (a CSS class with a space makes classList.add throw).
                assert [e for e in errors if "kx-" in e or "token" in e.lower()] == [], errors
                shot = tmp_path / "tool-debugger.png"
                debugger.screenshot(path=str(shot))
                assert shot.stat().st_size > 10_000
                target = os.environ.get("KERNELEXEC_SCREENSHOT")
                if target:  # to refresh the README's picture
                    shutil.copyfile(shot, target)
            finally:
                browser.close()
    finally:
        os.environ.pop("TMPDIR", None)


def _run_notebook(page: Any, lab: Lab) -> None:
    """Open the example notebook, wait for its kernel, run every cell."""
    page.goto(f"{lab.url}/lab/tree/debugging_a_tool.ipynb?token={TOKEN}&reset")
    page.wait_for_selector(".jp-Notebook", timeout=60_000)
    page.wait_for_function(
        """() => {
            const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const ctx = w && w.sessionContext;
            const k = ctx && ctx.session && ctx.session.kernel;
            return !!(ctx && ctx.isReady && k && k.status === 'idle'
                      && k.connectionStatus === 'connected');
        }""",
        timeout=60_000,
    )
    # run-all hangs while a dialog is open: race it against a timer so the test fails instead.
    ran = page.evaluate(
        """() => Promise.race([
            window.jupyterapp.commands.execute('notebook:run-all-cells'),
            new Promise(resolve => setTimeout(() => resolve('timed out'), 90000)),
        ])"""
    )
    assert ran is True, f"running the notebook's cells gave {ran!r}"
