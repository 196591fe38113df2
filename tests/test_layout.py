"""The package layout rules (docs/architecture.md), checked on the source: imports between stages, one ONNX loader."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ivq_debug"
#: the leaf modules every stage may import (util.py split by concept, issue 27)
BASE = tuple(f"ivq_debug.{m}" for m in ("inputfiles", "jsonio", "schema", "outputs", "arrays", "logs"))


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module top) of every import of ivq_debug's own modules in a file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ivq_debug"):
            out.append((node.module, node.lineno, id(node) in top))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names if a.name.startswith("ivq_debug")]
    return out


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def test_no_import_from_qnn_to_capture() -> None:
    bad = [(p.name, m) for p in _files("qnn") for m, _, _ in _imports(p) if m.startswith("ivq_debug.capture")]
    assert bad == []


def test_comparator_and_diagnose_do_not_import_each_other() -> None:
    bad = [(p.name, m) for p in _files("comparator") for m, _, _ in _imports(p) if m.startswith("ivq_debug.diagnose")]
    bad += [(p.name, m) for p in _files("diagnose") for m, _, _ in _imports(p) if m.startswith("ivq_debug.comparator")]
    assert bad == []


def test_onnxgraph_is_below_every_runtime() -> None:
    bad = [(p.name, m) for p in _files("onnxgraph") for m, _, _ in _imports(p)
           if not m.startswith(("ivq_debug.onnxgraph", "ivq_debug.errors", "ivq_debug.defaults", *BASE))]
    assert bad == []


def test_one_onnx_loader() -> None:
    hits = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "onnx.load(" in p.read_text()]
    assert sorted(hits) == ["onnxgraph/load.py", "vlm/export.py", "vlm/export_dynamic.py"]  # + the exporters


def test_own_modules_imported_at_the_top() -> None:
    """Function-local imports of the package's own modules are allowed only for modules that load torch."""
    heavy = {"ivq_debug.vlm.parts"}
    allowed = {("capture/__init__.py", "ivq_debug.api")}  # the callable package: the API imports it
    local = [(str(p.relative_to(PKG)), m, ln) for p in PKG.rglob("*.py") for m, ln, top in _imports(p)
             if not top and m not in heavy and (str(p.relative_to(PKG)), m) not in allowed]
    assert local == []


#: issue 27's size limits, where they are met (capture/qnn_net_run/ and the rest of capture/ follow)
SIZED = ("diagnose", "capture/qnn_ep", "capture/onnxrt", "capture/base.py")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 700, 100


def test_no_module_over_700_lines_and_no_function_over_100() -> None:
    paths = [p for s in SIZED for p in ([PKG / s] if s.endswith(".py") else _files(s))]
    big = [(str(p.relative_to(PKG)), n) for p in paths if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    long = [(str(p.relative_to(PKG)), f.name, f.end_lineno - f.lineno + 1) for p in paths
            for f in ast.walk(ast.parse(p.read_text()))
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert len(paths) > 20 and big == [] and long == []
