"""Real-browser tests: JupyterLab on 127.0.0.1 driven by Debian Chromium through playwright.

* 04_elastic_control_panel: Run All, press start, move the worker slider 2 → 3 with the arrow key, and
  check that the job really resized (its status, written by the panel to a file, and the status label in
  the DOM) and that the world-size chart shows 3; stop it with the panel's stop button; no worker process
  is left.
* 03_allocation_and_simulation: the AllocationExplorer and SimulationDashboard render their charts.

Screenshots go to out/screenshots/ (git-ignored).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from browser_util import JupyterLab, chromium_page, dismiss_toasts, open_and_run_all, pid_alive

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "out" / "screenshots"


def _read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_status(path: Path, pred, timeout: float) -> dict:
    end = time.monotonic() + timeout
    st = None
    while time.monotonic() < end:
        st = _read_status(path)
        if st is not None and pred(st):
            return st
        time.sleep(0.25)
    raise AssertionError(f"job status never satisfied the condition in {timeout} s; last: "
                         f"{ {k: st.get(k) for k in ('state', 'world_size', 'step', 'error')} if st else st}")


def _shoot_output(page, css: str, path: Path) -> None:
    """Screenshot the output area of the cell that holds ``css`` (a panel's controls, charts and log)."""
    area = page.locator(".jp-Cell-outputArea", has=page.locator(css)).first
    area.evaluate("e => e.scrollIntoView({block: \"start\"})")
    area.screenshot(path=str(path), timeout=120_000, animations="disabled")


def _serve(tmp_path: Path, names: list[str]) -> Path:
    """A copy of the notebooks to serve, so the browser session never writes into the checkout."""
    root = tmp_path / "nb"
    root.mkdir()
    for n in names:
        shutil.copy(ROOT / "notebooks" / n, root / n)
    return root


def test_control_panel_resizes_job_from_browser(tmp_path):
    status_file = tmp_path / "job_status.json"
    root = _serve(tmp_path, ["04_elastic_control_panel.ipynb"])
    SHOTS.mkdir(parents=True, exist_ok=True)
    env = {"ELASTICLAB_QUICK": "1", "ELASTICLAB_LIVE": "1", "ELASTICLAB_STATUS_FILE": str(status_file),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    pids: set[int] = set()
    with JupyterLab(root, env=env) as lab, chromium_page() as page:
        try:
            open_and_run_all(page, lab, "04_elastic_control_panel.ipynb")
            panel = page.locator(".elasticlab-job-panel")
            panel.wait_for(state="attached", timeout=120_000)
            # live, Run All leaves the job new (the LR rule can still be chosen): start it as a user would
            page.locator(".elasticlab-job-panel button:has-text('start')").click()
            # the job is up at 2 workers
            st = _wait_status(status_file, lambda s: s["state"] == "running" and s["world_size"] == 2
                              and s["step"] >= 3, timeout=240)
            pids |= {w["pid"] for w in st["workers"].values() if w.get("pid")}
            # Run All leaves the view at the last cell
            panel.evaluate("e => e.scrollIntoView({block: \"start\"})")
            page.locator(".elasticlab-job-status [data-world-size='2']").wait_for(state="attached",
                                                                                 timeout=90_000)
            dismiss_toasts(page)

            # move the slider 2 -> 3 with the keyboard, as a user would
            slider = page.locator(".elasticlab-workers")
            handle = slider.locator(".noUi-handle")
            assert slider.locator(".widget-readout").inner_text().strip() == "2"
            handle.focus()
            handle.press("ArrowRight")
            assert slider.locator(".widget-readout").inner_text().strip() == "3"

            # the job itself resized: its status (from the controller, via the panel's status file) ...
            st = _wait_status(status_file, lambda s: s["world_size"] == 3 and s["state"] == "running"
                              and s["generation"] >= 2, timeout=120)
            pids |= {w["pid"] for w in st["workers"].values() if w.get("pid")}
            active = [w for w in st["workers"].values() if w["state"] == "active"]
            assert len(active) == 3 and sorted(w["rank"] for w in active) == [0, 1, 2]
            # ... the status label in the page, and the world-size chart (its title and its data)
            page.locator(".elasticlab-job-status [data-world-size='3']").wait_for(state="attached",
                                                                                 timeout=90_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('.js-plotly-plot .annotation-text')]"
                ".some(t => t.textContent.startsWith('World size (now 3)'))", timeout=90_000)
            ys = page.evaluate(
                "() => { for (const p of document.querySelectorAll('.js-plotly-plot')) {"
                " const tr = (p.data || []).find(d => d.name === 'world_size');"
                " if (tr) return Array.from(tr.y); } return null; }")
            assert ys is not None and 2 in ys and ys[-1] == 3, ys
            # resize events are marked on the charts and listed in the event log
            assert "resize" in page.locator(".elasticlab-job-log").inner_text()
            time.sleep(1.5)  # one more refresh so the charts show some steps at 3 workers
            _shoot_output(page, ".elasticlab-job-panel", SHOTS / "job_panel.png")
            page.screenshot(path=str(SHOTS / "04_elastic_control_panel.png"), full_page=True, timeout=120_000)

            # stop from the panel's button; the workers end
            page.locator(".elasticlab-job-panel button:has-text('stop')").click()
            st = _wait_status(status_file, lambda s: s["state"] == "stopped", timeout=120)
            page.locator(".elasticlab-job-status [data-state='stopped']").wait_for(state="attached",
                                                                                  timeout=90_000)
        except Exception:
            page.screenshot(path=str(SHOTS / "failure_04_elastic_control_panel.png"), timeout=60_000)
            raise
        finally:
            last = _read_status(status_file)
            if last:
                pids |= {w["pid"] for w in last.get("workers", {}).values() if w.get("pid")}
    # JupyterLab and its kernel are gone; so are the job's worker processes
    end = time.monotonic() + 20
    while time.monotonic() < end and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if pid_alive(p)]
    assert pids and not left, f"worker processes left behind: {left}"


def test_allocation_and_simulation_panels_render(tmp_path):
    root = _serve(tmp_path, ["03_allocation_and_simulation.ipynb"])
    SHOTS.mkdir(parents=True, exist_ok=True)
    env = {"ELASTICLAB_QUICK": "1"}
    with JupyterLab(root, env=env) as lab, chromium_page() as page:
        open_and_run_all(page, lab, "03_allocation_and_simulation.ipynb")
        for cls, name, n_plots in ((".elasticlab-allocation-explorer", "allocation_explorer", 2),
                                   (".elasticlab-simulation-dashboard", "simulation_dashboard", 2)):
            box = page.locator(cls)
            box.wait_for(state="attached", timeout=240_000)
            box.evaluate("e => e.scrollIntoView({block: \"start\"})")
            page.wait_for_function(
                f"() => {{ const b = document.querySelector('{cls}');"
                f" return b && b.querySelectorAll('.js-plotly-plot .main-svg').length >= {n_plots}; }}",
                timeout=240_000)
            if name == "simulation_dashboard":  # its results table appears when the policies have run
                box.locator(".elasticlab-sim-table table").wait_for(state="attached", timeout=240_000)
            box.evaluate("e => e.scrollIntoView({block: \"start\"})")
            time.sleep(1.0)  # let plotly finish its transitions
            box.screenshot(path=str(SHOTS / f"{name}.png"), timeout=120_000, animations="disabled")
        # the explorer reacts to its capacity slider: totals change when the cluster shrinks
        box = page.locator(".elasticlab-allocation-explorer")
        box.evaluate("e => e.scrollIntoView({block: \"start\"})")
        before = box.locator(".elasticlab-alloc-totals").inner_text()
        handle = box.locator(".elasticlab-capacity .noUi-handle")
        handle.focus()
        for _ in range(4):
            handle.press("ArrowLeft")
        page.wait_for_function(
            "(b) => document.querySelector('.elasticlab-allocation-explorer .elasticlab-alloc-totals')"
            ".innerText !== b", arg=before, timeout=60_000)
        # capacity 6 (the slider's minimum, one GPU per job; not a multiple of the 4-GPU node): no method
        # may use more GPUs than that (the baselines used to round up to whole nodes: 8 GPUs)
        handle.press("Home")
        page.wait_for_function(
            "() => document.querySelector('.elasticlab-allocation-explorer .elasticlab-capacity')"
            ".innerText.trim().endsWith('6')", timeout=60_000)
        page.wait_for_function(
            "() => document.querySelector('.elasticlab-allocation-explorer').textContent.includes('(6 GPUs')",
            timeout=120_000)
        rows = box.locator(".elasticlab-alloc-totals table tr")
        head = [c.strip() for c in rows.nth(0).locator("th").all_inner_texts()]
        gpus = {}
        for i in range(1, rows.count()):
            cells = [c.strip() for c in rows.nth(i).locator("td").all_inner_texts()]
            gpus[cells[head.index("method")]] = int(cells[head.index("gpus")])
        assert {"dp", "gpu-elastic", "optimus"} <= set(gpus), gpus
        assert all(g <= 6 for g in gpus.values()), f"methods over the capacity of 6 GPUs: {gpus}"
        box.screenshot(path=str(SHOTS / "allocation_explorer_capacity6.png"), timeout=120_000,
                       animations="disabled")
