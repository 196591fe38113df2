"""The HTML report as text: escaping, self-containment, atomic writes, bounded size, sections."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from ivq_debug.errors import printable
from tests.report.conftest import EDGE_NAMES
from tests.report.pipeline import XSS

JSON_BLOCK = re.compile(r'<script type="application/json" id="([^"]+)">(.*?)</script>', re.S)


def _render(comparisons: dict[str, Any], **kw: Any) -> str:
    from ivq_debug.report import render_report

    return render_report(comparisons["main"], replay=comparisons["replay"], extra_comparisons=comparisons["extras"], **kw)


def test_names_are_escaped_never_markup(comparisons: dict[str, Any]) -> None:
    page = _render(comparisons)
    assert XSS not in page  # never raw, anywhere (text, attributes, JSON, SVG titles)
    assert "<img" not in page
    assert html.escape(XSS) in page
    assert page.count("<script") == page.count("</script>") == 1 + len(JSON_BLOCK.findall(page))


def test_edge_names_escaped_and_json_blocks_parse(edge_cmp: Any) -> None:
    from ivq_debug.report import render_report

    page = render_report(edge_cmp)
    for name in (EDGE_NAMES["ctrl"], EDGE_NAMES["quote"]):  # controls shown as visible escapes, then HTML-escaped
        assert name not in page and html.escape(printable(name, multiline=True)) in page
    assert EDGE_NAMES["uni"] in page  # nothing to escape: UTF-8 text as is
    assert "<b>bold</b>" not in page and "<!--" not in page
    blocks = JSON_BLOCK.findall(page)
    assert blocks, "the decode heatmap carries its readout data as JSON"
    for _id, text in blocks:
        assert "<" not in text and ">" not in text and "&" not in text
        doc = json.loads(text)
        if "col_labels" in doc:  # the original names survive the JSON escaping
            assert EDGE_NAMES["ctrl"] in doc["col_labels"]
    for status in ("non_finite", "zero_norm", "shape_mismatch", "identical"):
        assert f'pill {status}"' in page


def test_self_contained_with_script_pinned_by_csp(comparisons: dict[str, Any]) -> None:
    page = _render(comparisons)
    csp = html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1))
    assert "default-src 'none'" in csp and "connect-src" not in csp
    script = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(script) == 1
    digest = base64.b64encode(hashlib.sha256(script[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp
    for pat in (r'\b(?:src|href)="(?:https?:)?//', r"@import", r"url\(\s*['\"]?https?:", r"<link\b", r"<iframe\b"):
        assert not re.search(pat, page), pat
    assert re.findall(r'href="(?!#|data:image/png;base64,)([^"]*)"', page) == []  # in-page anchors only


def test_sections_and_joined_columns(comparisons: dict[str, Any], pipeline: dict[str, Path]) -> None:
    page = _render(comparisons)
    for sid in ("findings", "summary", "depth", "heatmap", "layers", "drilldown", "unmatched", "provenance"):
        assert f'id="{sid}"' in page, sid
    for label in comparisons["extras"]:  # a short head ("SQNR quantization"), the full label in its title
        assert f'title="SQNR of the same tensor in {html.escape(label)}">SQNR {label.split(" (")[0]}<' in page
    assert "introduced SQNR" in page and "inherited" in page
    assert "Comparisons side by side" in page
    if "htp" in pipeline:
        assert 'id="timeline"' in page and "latency cycles" in page
        assert "EMULATED" in page and "x86_64 emulation" in page
        assert ">60<" in page and ">73<" in page  # soc_model, htp_arch in the provenance table
    # every in-page link points at an element that exists
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    for target in re.findall(r'href="#([^"]+)"', page):
        assert target in ids, target


def test_rows_points_and_drilldowns_are_capped(comparisons: dict[str, Any]) -> None:
    full = _render(comparisons)
    small = _render(comparisons, max_rows=5, drilldowns=1, max_points=20)
    n = len(comparisons["main"].table)
    assert full.count('<tr id="L') == n
    shown = small.count('<tr id="L')
    assert 5 <= shown < n and f"Showing {shown} of {n} rows" in small
    # the rows the findings point at are kept past the cap, and every such finding links to its row
    cards = re.findall(r'<article class="finding.*?</article>', small, re.S)
    named = [c for c in cards if '<p class="where">' in c and "tensor " in c.split('<p class="where">')[1]]
    assert named and all('class="goto" href="#L' in c for c in named)
    targets = {m for c in named for m in re.findall(r'class="goto" href="#(L\d+)"', c)}
    assert len(targets) <= shown
    assert small.count('class="drill"') == 1 and full.count('class="drill"') == 6
    assert len(small) < len(full)
    ids = set(re.findall(r'\bid="([^"]+)"', small))
    assert all(t in ids for t in re.findall(r'href="#([^"]+)"', small))  # no link to a row left out


def test_write_is_atomic_and_never_overwrites(comparisons: dict[str, Any], tmp_path: Path) -> None:
    from ivq_debug.errors import UsageError
    from ivq_debug.report import write_report

    out = tmp_path / "r.html"
    write_report(comparisons["main"], out)
    first = out.read_bytes()
    assert first.startswith(b"<!DOCTYPE html>")
    with pytest.raises(UsageError, match="exists"):
        write_report(comparisons["main"], out, title="other")
    assert out.read_bytes() == first
    write_report(comparisons["main"], out, title="other title", overwrite=True)
    assert b"other title" in out.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temp file left behind
    assert out.stat().st_mode & 0o044  # shareable like any file the user writes


def test_no_aligned_pairs_still_renders(tmp_path: Path) -> None:
    import numpy as np

    from ivq_debug.api import compare
    from ivq_debug.dump import DumpWriter
    from ivq_debug.report import junit_xml, model_explorer_overlay, render_report

    for side in ("a", "b"):
        with DumpWriter(tmp_path / f"{side}.h5", backend=side) as w:
            w.begin_record()
            w.add_tensor(f"only_{side}", np.ones(4, np.float32))
    cmp = compare(tmp_path / "a.h5", tmp_path / "b.h5", progress=False)
    assert len(cmp.table) == 0
    page = render_report(cmp)
    assert 'id="unmatched"' in page and "only_a" in page and "only_b" in page
    assert page.count('<tr id="L') == 0
    assert model_explorer_overlay(cmp)["main_graph"]["results"] == {}
    assert 'tests="0"' in junit_xml(cmp)
