"""Reports and exports: the self-contained HTML report, the Perfetto trace of the profiling timeline, the
Model Explorer node-data overlay and JUnit XML (``docs/report.md``)."""

from ivq_debug.report.exports import (
    junit_xml,
    model_explorer_overlay,
    perfetto_trace,
    write_junit,
    write_model_explorer,
    write_perfetto,
)
from ivq_debug.report.html import render_report, write_report

__all__ = [
    "junit_xml",
    "model_explorer_overlay",
    "perfetto_trace",
    "render_report",
    "write_junit",
    "write_model_explorer",
    "write_perfetto",
    "write_report",
]
