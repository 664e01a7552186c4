"""Test harness: a throw-away JupyterLab server on 127.0.0.1 and a headless Debian Chromium (playwright).

JupyterLab runs on a free port with a random token, its own config/settings/workspace folders (the
"Jupyter news" announcements off, autosave off so a run never writes back into the notebook), and is
torn down with its kernels (kernels live in their own sessions, so they are shut down through the REST
API first, then the server's process group is terminated). The browser is Debian's ``/usr/bin/chromium``
driven through playwright (never ``playwright install``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class JupyterLab:
    """``with JupyterLab(root_dir, env={...}) as lab:`` → ``lab.url(path)``, ``lab.api(path)``."""

    def __init__(self, root_dir, *, env: dict | None = None, startup_timeout: float = 90.0):
        self.root_dir = Path(root_dir).resolve()
        if not self.root_dir.is_dir():
            raise ValueError(f"root_dir {str(self.root_dir)!r} is not a folder")
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="elasticlab-lab-")
        self.log_path = Path(self._tmp.name) / "jupyterlab.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    # ---- set-up ------------------------------------------------------------------------------
    def _write_config(self) -> dict:
        base = Path(self._tmp.name)
        cfg, settings, workspaces = base / "config", base / "settings", base / "workspaces"
        (cfg / "labconfig").mkdir(parents=True)
        (cfg / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        (settings / "overrides.json").parent.mkdir(parents=True)
        (settings / "overrides.json").write_text(json.dumps({
            "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
        }))
        workspaces.mkdir()
        return {"JUPYTER_CONFIG_DIR": str(cfg), "JUPYTERLAB_SETTINGS_DIR": str(settings),
                "JUPYTERLAB_WORKSPACES_DIR": str(workspaces)}

    def start(self) -> JupyterLab:
        env = {**self.env, **self._write_config()}
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
               "--ServerApp.port_retries=0", "--LabApp.news_url=", "--allow-root"]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.root_dir, start_new_session=True)
        end = time.monotonic() + self.startup_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.api_url("/api/status"), timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"JupyterLab did not answer /api/status in {self.startup_timeout} s:\n"
                           f"{self.log_tail()}")

    # ---- use -----------------------------------------------------------------------------------
    def api_url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}{path}{sep}token={self.token}"

    def url(self, notebook: str) -> str:
        return self.api_url(f"/lab/tree/{notebook}")

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.api_url(path), method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- tear-down -----------------------------------------------------------------------------
    def kernel_pids(self) -> list[int]:
        """PIDs of the server's child processes (its kernels)."""
        pids = []
        with contextlib.suppress(Exception):
            out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
            for row in out.splitlines()[1:]:
                pid, ppid = map(int, row.split())
                if self.proc is not None and ppid == self.proc.pid:
                    pids.append(pid)
        return pids

    def stop(self) -> None:
        if self.proc is None:
            return
        children = self.kernel_pids()
        with contextlib.suppress(Exception):  # shut kernels down cleanly: their jobs stop their workers
            for k in self.api("/api/kernels"):
                self.api(f"/api/kernels/{k['id']}", method="DELETE")
        with contextlib.suppress(Exception):
            self.api("/api/shutdown", method="POST")
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        for pid in children:  # kernels run in their own sessions; make sure none is left
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()
        self.proc = None

    def __enter__(self) -> JupyterLab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._tmp.cleanup()


@contextlib.contextmanager
def chromium_page(viewport=(1500, 1100)):
    """A playwright page in headless Debian Chromium (``executable_path=/usr/bin/chromium``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


def open_and_run_all(page, lab: JupyterLab, notebook: str, timeout_ms: int = 120_000) -> None:
    """Open ``notebook`` in JupyterLab, wait for its kernel, and Run → Run All Cells."""
    page.goto(lab.url(notebook), timeout=timeout_ms)
    page.wait_for_selector(".jp-Notebook", timeout=timeout_ms)
    # the kernel is idle once the status bar / toolbar indicator says so
    page.wait_for_function(
        "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
        " return s && s.getAttribute('data-status') === 'idle'; }", timeout=timeout_ms)
    dismiss_toasts(page)
    with contextlib.suppress(Exception):  # more room for the notebook: hide the file browser
        if page.locator("#jp-left-stack").is_visible():
            page.locator(".jp-Notebook").click(position={"x": 5, "y": 5})
            page.keyboard.press("Control+b")
    for _ in range(3):  # a click that lands while the page is still settling can be lost: check, retry
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=timeout_ms)
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click(timeout=timeout_ms)
        try:
            page.wait_for_function(
                "() => [...document.querySelectorAll('.jp-InputArea-prompt')]"
                ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))", timeout=30_000)
            return
        except Exception:
            page.keyboard.press("Escape")
    raise RuntimeError(f"Run All Cells did not start executing {notebook}")


def dismiss_toasts(page) -> None:
    with contextlib.suppress(Exception):
        for b in page.query_selector_all(".jp-Notification-Toast-Close, .Toastify__close-button"):
            b.click(timeout=1000)


def wait_kernel_idle(page, timeout_ms: int = 120_000) -> None:
    page.wait_for_function(
        "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
        " return s && s.getAttribute('data-status') === 'idle'; }", timeout=timeout_ms)
