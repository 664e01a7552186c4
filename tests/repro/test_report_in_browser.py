"""The reproduction report opened in a real headless Chromium (Debian's /usr/bin/chromium via playwright),
offline: every plotly figure renders from the inlined plotly.js, the claims table is complete, no page
errors, no network requests."""

from __future__ import annotations

import json

import pytest

from elasticlab.__main__ import main

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
QUICK_SUBSET = "P4-T1,P4-T4,P5-T2"  # fast claims with line and bar figures


@pytest.mark.browser
def test_report_renders_offline_in_chromium(tmp_path):
    from playwright.sync_api import sync_playwright

    out = tmp_path / "report"
    assert main(["reproduce", "--quick", "--only", QUICK_SUBSET, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    ids = [r["id"] for r in results]
    assert ids == QUICK_SUBSET.split(",")

    requests, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            def no_network(route):
                requests.append(route.request.url)
                route.abort()

            page.route("http*://**", no_network)
            page.goto((out / "report.html").as_uri())
            page.wait_for_function(
                f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {len(ids)}", timeout=30_000
            )
            rows = page.locator("#claims tbody tr")
            assert rows.count() == len(ids)
            assert [rows.nth(i).get_attribute("data-id") for i in range(len(ids))] == ids
            for r in results:
                status = page.locator(f"#claims tr[data-id='{r['id']}'] td .verdict").inner_text()
                assert status == {"reproduced": "reproduced", "reread": "reproduced only as re-read",
                                  "not_reproduced": "not reproduced"}[r["status"]]
            assert f"of {len(ids)} claims reproduced" in page.locator("#counts").inner_text()
            # each figure drew its data: plotly title text and at least one trace
            for rid in ids:
                fig = page.locator(f"#fig-{rid}")
                assert rid in fig.locator(".gtitle").first.text_content()
                assert fig.locator(".trace").count() >= 1
            page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
        finally:
            browser.close()
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert not requests, f"the report tried to reach the network: {requests}"
    assert not errors, errors
