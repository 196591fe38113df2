"""The report in a real browser: headless Chromium over the DevTools pipe.

Fails on any console error or warning, uncaught exception, CSP violation, JavaScript dialog (``alert``) or
network request other than the file itself and ``data:`` URIs. Checks the rendered DOM (findings, layer
table, timeline, provenance), that the tensor named ``<img src=x onerror=alert(1)>`` is text, that sorting,
filtering and the heatmap readout work, and leaves ``test-artifacts/report.html`` and ``report.png``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.report.chromium import Chromium, find_chromium
from tests.report.pipeline import XSS

CHROMIUM = find_chromium()
#: CI sets IVQ_REQUIRE_CHROMIUM=1 so that a missing browser fails instead of skipping
REQUIRED = os.environ.get("IVQ_REQUIRE_CHROMIUM") == "1"
MISSING = "Chromium is not installed (Debian package `chromium`): run scripts/install-chromium.sh or set IVQ_CHROMIUM"
pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRED, reason=MISSING)


@pytest.fixture(scope="module")
def report_file(comparisons: dict[str, Any], artifacts_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ivq_debug.report import write_report

    out = tmp_path_factory.mktemp("browser") / "report.html"
    write_report(comparisons["main"], out, replay=comparisons["replay"], extra_comparisons=comparisons["extras"],
                 title="ivq-debug report: tiny block, float → emulated HTP (a8w8)")
    shutil.copyfile(out, artifacts_dir / "report.html")
    return out


@pytest.fixture(scope="module")
def page(report_file: Path):
    if CHROMIUM is None:
        pytest.fail(f"IVQ_REQUIRE_CHROMIUM=1: {MISSING}", pytrace=False)
    with Chromium(CHROMIUM) as browser:
        log = browser.open(report_file.resolve().as_uri(), width=1440, height=1000)
        yield browser, log


def _js(browser: Chromium, body: str) -> Any:
    return browser.evaluate(f"(() => {{ {body} }})()")


def test_loads_without_errors_dialogs_or_network(page: tuple[Chromium, Any], report_file: Path) -> None:
    browser, log = page
    browser.drain(0.2)
    assert log.errors() == []
    assert log.dialogs == []
    others = [u for u in log.requests if not (u == report_file.resolve().as_uri() or u.startswith("data:"))]
    assert others == []


def test_dom_has_findings_table_timeline_provenance(page: tuple[Chromium, Any], pipeline: dict[str, Path],
                                                    comparisons: dict[str, Any]) -> None:
    browser, _ = page
    dom = _js(browser, """
        const q = (s) => document.querySelectorAll(s);
        return {
          findings: q('#findings .finding').length,
          finding_kinds: Array.from(q('#findings .finding .kind')).map(e => e.textContent),
          rows: q('#layer-table tbody tr').length,
          heads: Array.from(q('#layer-table thead th')).map(e => e.textContent),
          timeline_bars: q('#timeline svg rect[fill]').length,
          timeline_links: q('#timeline svg a').length,
          provenance: document.getElementById('provenance').innerText,
          heatmap: q('svg.heatmap').length,
          depth: q('#depth svg.chart').length,
          drill: q('#drilldown .drill').length,
          dead: Array.from(q('a[href^="#"]')).map(a => a.getAttribute('href').slice(1))
                  .filter(id => !document.getElementById(id)),
        };""")
    cmp = comparisons["main"]
    assert dom["findings"] >= 1 and "first_divergence" in dom["finding_kinds"]
    assert dom["rows"] == len(cmp.table)
    assert any(h.startswith("SQNR") for h in dom["heads"]) and "introduced SQNR" in dom["heads"]
    assert dom["heatmap"] == 1 and dom["depth"] >= 2 and dom["drill"] == 6
    assert dom["dead"] == []
    if "htp" in pipeline:
        assert dom["timeline_bars"] > 10 and dom["timeline_links"] > 5
        assert "EMULATED" in dom["provenance"] and "soc_model" in dom["provenance"]
        assert "60" in dom["provenance"] and "73" in dom["provenance"]


def test_xss_name_is_text(page: tuple[Chromium, Any]) -> None:
    browser, log = page
    res = _js(browser, f"""
        const name = {json.dumps(XSS)};
        const cells = Array.from(document.querySelectorAll('#layer-table td.name code'));
        return {{
          as_text: cells.filter(c => c.textContent === name).length,
          imgs: document.getElementsByTagName('img').length,
          x_src: Array.from(document.querySelectorAll('[src]')).filter(e => e.getAttribute('src') === 'x').length,
          handlers: Array.from(document.querySelectorAll('*')).filter(e => e.hasAttribute('onerror')).length,
        }};""")
    assert res["as_text"] >= 4  # one row per record
    assert res["imgs"] == 0 and res["x_src"] == 0 and res["handlers"] == 0
    assert log.dialogs == []


def test_sorting_filtering_and_heatmap_readout(page: tuple[Chromium, Any], comparisons: dict[str, Any]) -> None:
    browser, log = page
    cmp = comparisons["main"]
    res = _js(browser, """
        const table = document.getElementById('layer-table');
        const visible = () => Array.from(table.tBodies[0].rows).filter(r => !r.hidden);
        const th = Array.from(table.tHead.rows[0].cells).find(c => c.textContent.startsWith('SQNR dB'));
        const col = th.cellIndex;
        th.click();
        const asc = visible().map(r => parseFloat(r.cells[col].getAttribute('data-v')));
        th.click();
        const desc = visible().map(r => parseFloat(r.cells[col].getAttribute('data-v')));
        const input = document.getElementById('layer-filter');
        input.value = 'softmax';
        input.dispatchEvent(new Event('input'));
        const filtered = visible().length;
        const count = document.getElementById('layer-count').textContent;
        input.value = '';
        input.dispatchEvent(new Event('input'));
        const st = document.getElementById('layer-status');
        st.value = 'fail';
        st.dispatchEvent(new Event('change'));
        const failing = visible().length;
        st.value = '';
        st.dispatchEvent(new Event('change'));
        const area = document.querySelector('svg.heatmap .hm-area');
        const b = area.getBoundingClientRect();
        area.dispatchEvent(new MouseEvent('mousemove', {clientX: b.left + b.width * 0.5, clientY: b.top + b.height * 0.5,
                                                       bubbles: true}));
        const readout = document.getElementById(area.closest('svg').getAttribute('data-heat') + '-readout').textContent;
        return {asc, desc, filtered, count, failing, readout, all: visible().length};""")
    finite = [v for v in res["asc"] if v == v]
    assert finite == sorted(finite) and res["desc"][: len(finite)] == sorted(finite, reverse=True)
    n_soft = int((cmp.table["op_type"] == "Softmax").sum())
    assert res["filtered"] == n_soft and res["count"].startswith(f"{n_soft} of")
    assert res["failing"] == int((~cmp.table["passed"]).sum())
    assert "SQNR" in res["readout"] and "step" in res["readout"]
    assert res["all"] == len(cmp.table)
    assert log.errors() == []


def test_screenshot_for_people(page: tuple[Chromium, Any], artifacts_dir: Path) -> None:
    browser, log = page
    browser.reload()  # the page as a reader first sees it (earlier tests sorted and filtered the table)
    out = browser.screenshot(artifacts_dir / "report.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    assert log.errors() == []
