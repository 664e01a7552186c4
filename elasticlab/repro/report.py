"""The reproduction report: ``results.json`` (one record per claim: id, paper, claim, target, measured,
passed, status, reread, summary, seconds) and ``report.html`` (the claims table and every claim's plotly
figure, with plotly.js embedded once so the page reads offline). Both are written atomically.

Every claim run gets one of three verdicts (:data:`~.registry.STATUSES`): reproduced (as the target is
written), reproduced only as re-read (with the claim's reason), not reproduced. Claims a quick run left out
are listed with why (``skipped``), so a count never reads as more than was run."""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
import textwrap
from pathlib import Path

from .registry import NOT_REPRODUCED, STATUSES, Result, status_of

__all__ = ["write_report", "write_json", "render_html", "summary_table", "counts_line", "load_results"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;
color:#222}
h1{margin-bottom:4px} .meta{color:#666;margin-bottom:16px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border:1px solid #ddd;padding:6px;vertical-align:top}
th{background:#f4f4f4;text-align:left} tr.fail td{background:#fdecea} .pass{color:#1b7f3b;font-weight:600}
tr.reread td{background:#fff6e0} .rereadtxt{color:#8a5a00;font-weight:600} .why{font-size:12px;color:#555}
.failtxt{color:#b3261e;font-weight:600} .counts{font-size:18px;margin:8px 0 16px}
.claim{border-top:2px solid #eee;margin-top:28px;padding-top:8px} .claim h3{margin:4px 0}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px} a{color:#1d5fa8}
"""


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _status(r) -> str:
    d = r.to_json() if isinstance(r, Result) else r
    return d.get("status") or status_of(bool(d["passed"]), d.get("reread"))


def _skipped(skipped) -> list[dict]:
    """``skipped`` (Reproductions, or dicts with id / claim / why) as dicts with id, claim and why."""
    out = []
    for s in skipped or ():
        if isinstance(s, dict):
            out.append({"id": s["id"], "claim": s.get("claim", ""), "why": s.get("why", "")})
        else:
            why = ("slow and without a quick version" if getattr(s, "slow", False)
                   else "not selected for this run")
            out.append({"id": s.id, "claim": s.claim,
                        "why": f"{why}; run it with: elasticlab reproduce --only {s.id} --out DIR"})
    return out


def _meta(results, quick, skipped=()) -> dict:
    import elasticlab

    states = [_status(r) for r in results]
    return {
        "elasticlab": elasticlab.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "claims": len(results),
        "passed": sum(r.passed for r in results),
        **{k: states.count(k) for k in STATUSES},
        "skipped": [s["id"] for s in _skipped(skipped)],
        "seconds": round(sum(r.seconds for r in results), 2),
    }


def counts_line(results, skipped=()) -> str:
    """'27/29 claims reproduced as written, 2 only as re-read, 0 not reproduced' (plain text)."""
    states = [_status(r) for r in results]
    n = len(states)
    text = (f"{states.count('reproduced')}/{n} claims reproduced as written, {states.count('reread')} only "
            f"as re-read, {states.count('not_reproduced')} not reproduced")
    left = [s["id"] for s in _skipped(skipped)]
    if left:
        text += f"; {len(left)} left out of this run: {', '.join(left)}"
    return text


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


def summary_table(results, width: int = 70, skipped=()) -> str:
    """A plain-text table, one row per claim: id, verdict, seconds and the measured summary (wrapped at
    ``width`` characters, never cut), a re-read claim's reason under it, then the counts and the claims left
    out of the run (``skipped``)."""
    label_w = max(len(v) for v in STATUSES.values())
    indent = " " * (8 + 1 + label_w + 1 + 8 + 2)
    rows = [f"{'id':8s} {'result':{label_w}s} {'seconds':>8s}  measured"]
    for r in results:
        d = r.to_json() if isinstance(r, Result) else r
        status = _status(d)
        lines = textwrap.wrap(d.get("summary") or "", width) or [""]
        rows.append(f"{d['id']:8s} {STATUSES[status]:{label_w}s} {d['seconds']:8.1f}  {lines[0]}")
        rows += [indent + line for line in lines[1:]]
        if status == "reread":
            rows += [indent + line for line in textwrap.wrap(f"re-read: {d.get('reread')}", width)]
        if status == "not_reproduced" and d.get("gap"):
            rows += [indent + line for line in textwrap.wrap(f"why: {d['gap']}", width)]
    rows.append(counts_line(results))
    for s in _skipped(skipped):
        head = f"left out: {s['id']:8s} "
        rows += textwrap.wrap(f"{s['claim']} ({s['why']})", width + len(indent) - len(head),
                              initial_indent=head, subsequent_indent=" " * len(head))
    return "\n".join(rows)


def render_html(
    results: list[Result], quick: bool = False, title: str = "elasticlab: paper reproductions", skipped=()
) -> str:
    """The report page: counts, the claims table (linked to each claim's section), the claims left out of
    the run, and the figures. The first figure carries plotly.js inline; later ones reuse it."""
    esc = html.escape
    meta = _meta(results, quick, skipped)
    left = _skipped(skipped)
    css = {"reproduced": ("ok", "pass"), "reread": ("reread", "rereadtxt"),
           "not_reproduced": ("fail", "failtxt")}
    counts = f"<span class='pass'>{meta['reproduced']}</span> of {meta['claims']} claims reproduced"
    if meta["reread"]:
        counts += f", <span class='rereadtxt'>{meta['reread']} only as re-read</span>"
    if meta["not_reproduced"]:
        counts += f", <span class='failtxt'>{meta['not_reproduced']} not reproduced</span>"
    if left:
        counts += (f"; <a href='#skipped'>{len(left)} left out of this {'quick ' if quick else ''}run</a>: "
                   f"{esc(', '.join(s['id'] for s in left))}")
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<div class='meta'>{'quick' if quick else 'full'} run, {esc(meta['created'])}, elasticlab "
        f"{esc(meta['elasticlab'])}, Python {esc(meta['python'])}, {meta['seconds']:.1f} s of claims"
        "</div>",
        f"<div class='counts' id='counts'>{counts}</div>",
        "<p class='why'><b>reproduced</b>: passed the target as papers.md writes it; <b>reproduced only as "
        "re-read</b>: passed, but under a reading of the target or a setup that differs from it or was "
        "chosen after seeing results (the reason is given); <b>not reproduced</b>: did not pass.</p>",
        "<table id='claims'><thead><tr><th>id</th><th>paper</th><th>claim</th><th>target</th>"
        "<th>measured</th><th>result</th><th>s</th></tr></thead><tbody>",
    ]
    for r in results:
        st = r.status
        row_cls, txt_cls = css[st]
        why = f"<div class='why'>re-read: {esc(r.reread)}</div>" if st == "reread" else ""
        if st == "not_reproduced" and r.gap:
            why = f"<div class='why'>why: {esc(r.gap)}</div>"
        parts.append(
            f"<tr class='{row_cls}' data-id='{esc(r.id)}' data-status='{st}'>"
            f"<td><a href='#claim-{esc(r.id)}'>{esc(r.id)}</a></td><td>{esc(r.paper)}</td>"
            f"<td>{esc(r.claim)}</td><td>{esc(r.target)}</td><td>{esc(r.summary)}</td>"
            f"<td><span class='{txt_cls} verdict'>{esc(STATUSES[st])}</span>{why}</td>"
            f"<td>{r.seconds:.1f}</td></tr>"
        )
    parts.append("</tbody></table>")
    if left:
        parts.append(f"<p><b>Left out of this {'quick ' if quick else ''}run</b> (not counted above):</p>"
                     "<ul id='skipped'>")
        parts += [f"<li data-id='{esc(s['id'])}'>{esc(s['id'])}: {esc(s['claim'])} <span class='why'>"
                  f"({esc(s['why'])})</span></li>" for s in left]
        parts.append("</ul>")
    gaps = {k: v for k, v in NOT_REPRODUCED.items() if k not in {r.id for r in results}}
    if gaps:
        parts.append("<p><b>Targets of papers.md not measured yet:</b></p><ul id='not-reproduced'>")
        parts += [f"<li>{esc(k)}: {esc(v)}</li>" for k, v in sorted(gaps.items())]
        parts.append("</ul>")
    first = True
    for r in results:
        parts.append(
            f"<div class='claim' id='claim-{esc(r.id)}'><h3>{esc(r.id)}: "
            f"{esc(STATUSES[r.status])}</h3><div>{esc(r.claim)}</div>"
            f"<div><b>Target:</b> {esc(r.target)}</div><div><b>Measured:</b> {esc(r.summary)}</div>"
        )
        if r.status == "reread":
            parts.append(f"<div><b>Re-read:</b> {esc(r.reread)}</div>")
        if r.status == "not_reproduced" and r.gap:
            parts.append(f"<div><b>Why not reproduced:</b> {esc(r.gap)}</div>")
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


def write_report(results: list[Result], out_dir, quick: bool | None = None, skipped=()) -> dict[str, Path]:
    """Write ``report.html`` and ``results.json`` into ``out_dir`` (created); returns their paths.
    ``skipped``: the claims left out of this run (Reproductions, or dicts with id / claim / why), listed
    in the report apart from the counts."""
    if not results:
        raise ValueError("no results to report")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out must be a folder, but {str(out)!r} is a file")
    if quick is None:
        quick = all(r.quick for r in results)
    paths = {"json": write_json(results, out / "results.json"), "html": out / "report.html"}
    _atomic_write(paths["html"], render_html(results, quick=quick, skipped=skipped))
    return paths
