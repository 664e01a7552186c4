"""The reproduction report: ``results.json`` (one record per claim: id, paper, claim, target, measured,
passed, summary, seconds) and ``report.html`` (the claims table and every claim's plotly figure, with
plotly.js embedded once so the page reads offline). Both are written atomically."""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
from pathlib import Path

from .registry import NOT_REPRODUCED, Result

__all__ = ["write_report", "write_json", "render_html", "summary_table", "load_results"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;
color:#222}
h1{margin-bottom:4px} .meta{color:#666;margin-bottom:16px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border:1px solid #ddd;padding:6px;vertical-align:top}
th{background:#f4f4f4;text-align:left} tr.fail td{background:#fdecea} .pass{color:#1b7f3b;font-weight:600}
.failtxt{color:#b3261e;font-weight:600} .counts{font-size:18px;margin:8px 0 16px}
.claim{border-top:2px solid #eee;margin-top:28px;padding-top:8px} .claim h3{margin:4px 0}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px} a{color:#1d5fa8}
"""


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _meta(results, quick) -> dict:
    import elasticlab

    return {
        "elasticlab": elasticlab.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "claims": len(results),
        "passed": sum(r.passed for r in results),
        "seconds": round(sum(r.seconds for r in results), 2),
    }


def write_json(results: list[Result], path) -> Path:
    """``results.json``: a JSON list of claim records (see :meth:`Result.to_json`)."""
    path = Path(path)
    _atomic_write(path, json.dumps([r.to_json() for r in results], indent=2, allow_nan=False) + "\n")
    return path


def load_results(path) -> list[dict]:
    """Read back a ``results.json`` (a file or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path} does not hold a list of claims")
    return data


def summary_table(results, width: int = 70) -> str:
    """A plain-text table, one row per claim: id, PASS/FAIL, seconds and the measured summary."""
    rows = [f"{'id':8s} {'result':6s} {'seconds':>8s}  measured"]
    for r in results:
        d = r.to_json() if isinstance(r, Result) else r
        text = d.get("summary") or ""
        if len(text) > width:
            text = text[: width - 3] + "..."
        rows.append(f"{d['id']:8s} {'PASS' if d['passed'] else 'FAIL':6s} {d['seconds']:8.1f}  {text}")
    n_pass = sum(1 for r in results if (r.passed if isinstance(r, Result) else r["passed"]))
    rows.append(f"{n_pass}/{len(results)} claims reproduced")
    return "\n".join(rows)


def render_html(
    results: list[Result], quick: bool = False, title: str = "elasticlab: paper reproductions"
) -> str:
    """The report page: counts, the claims table (linked to each claim's section) and the figures.
    The first figure carries plotly.js inline; later ones reuse it."""
    esc = html.escape
    meta = _meta(results, quick)
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<div class='meta'>{'quick' if quick else 'full'} run, {esc(meta['created'])}, elasticlab "
        f"{esc(meta['elasticlab'])}, Python {esc(meta['python'])}, {meta['seconds']:.1f} s of claims"
        "</div>",
        f"<div class='counts' id='counts'><span class='pass'>{meta['passed']}</span> of "
        f"{meta['claims']} "
        f"claims reproduced"
        + (
            f", <span class='failtxt'>{meta['claims'] - meta['passed']} failed</span>"
            if meta["passed"] < meta["claims"]
            else ""
        )
        + "</div>",
        "<table id='claims'><thead><tr><th>id</th><th>paper</th><th>claim</th><th>target</th>"
        "<th>measured</th><th>result</th><th>s</th></tr></thead><tbody>",
    ]
    for r in results:
        status = "<span class='pass'>PASS</span>" if r.passed else "<span class='failtxt'>FAIL</span>"
        parts.append(
            f"<tr class='{'ok' if r.passed else 'fail'}' data-id='{esc(r.id)}'>"
            f"<td><a href='#claim-{esc(r.id)}'>{esc(r.id)}</a></td><td>{esc(r.paper)}</td>"
            f"<td>{esc(r.claim)}</td><td>{esc(r.target)}</td><td>{esc(r.summary)}</td>"
            f"<td>{status}</td><td>{r.seconds:.1f}</td></tr>"
        )
    parts.append("</tbody></table>")
    gaps = {k: v for k, v in NOT_REPRODUCED.items() if k not in {r.id for r in results}}
    if gaps:
        parts.append("<p><b>Targets of papers.md not measured yet:</b></p><ul id='not-reproduced'>")
        parts += [f"<li>{esc(k)}: {esc(v)}</li>" for k, v in sorted(gaps.items())]
        parts.append("</ul>")
    first = True
    for r in results:
        parts.append(
            f"<div class='claim' id='claim-{esc(r.id)}'><h3>{esc(r.id)}: "
            f"{'PASS' if r.passed else 'FAIL'}</h3><div>{esc(r.claim)}</div>"
            f"<div><b>Target:</b> {esc(r.target)}</div><div><b>Measured:</b> {esc(r.summary)}</div>"
        )
        if r.error:
            parts.append(f"<pre>{esc(r.error)}</pre>")
        if r.figure is not None:
            parts.append(
                r.figure.to_html(
                    full_html=False,
                    include_plotlyjs=True if first else False,
                    div_id=f"fig-{r.id}",
                    config={"displaylogo": False},
                )
            )
            first = False
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(results: list[Result], out_dir, quick: bool | None = None) -> dict[str, Path]:
    """Write ``report.html`` and ``results.json`` into ``out_dir`` (created); returns their paths."""
    if not results:
        raise ValueError("no results to report")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out must be a folder, but {str(out)!r} is a file")
    if quick is None:
        quick = all(r.quick for r in results)
    paths = {"json": write_json(results, out / "results.json"), "html": out / "report.html"}
    _atomic_write(paths["html"], render_html(results, quick=quick))
    return paths
