"""Which node of a QNN EP session ran where: the partition ONNX Runtime records (``Partition``, from
``get_provider_graph_assignment_info``) and the QNN framework op trace (``qnn_op_trace.json``: the ONNX -> QNN op
mapping, unsupported nodes with QNN's reason, the compiled target). Sessions: :mod:`ivq_debug.capture.qnn_ep.session`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.errors import CaptureError, one_line

EP_NAME = defaults.QNN_EP_NAME
#: file the QNN EP writes into ``framework_op_trace_dir``
OP_TRACE_FILE = "qnn_op_trace.json"


# ---------------------------------------------------------------------------------------- partition
@dataclass(frozen=True)
class PartitionNode:
    """One ONNX node and the EP it was assigned to."""

    name: str
    op_type: str
    domain: str
    ep: str
    reason: str | None = None
    io_offload: bool = False  # a graph-input Q / graph-output DQ the EP left to the CPU by design


@dataclass
class Partition:
    """Which nodes ran on which execution provider (from ``get_provider_graph_assignment_info``)."""

    subgraphs: list[tuple[str, list[PartitionNode]]]
    fallback_allowed: bool
    #: node names of the ONNX model, when known: the assignment is made on ORT's rewritten graph (DQ
    #: nodes duplicated per consumer, transposes moved by the layout pass), so names can differ
    model_nodes: tuple[str, ...] | None = None

    @property
    def added_nodes(self) -> list[str]:
        """Assigned nodes that are not in the model (created by ORT's graph rewrites)."""
        if self.model_nodes is None:
            return []
        known = set(self.model_nodes)
        return [n.name for n in self.nodes if n.name not in known]

    @property
    def removed_nodes(self) -> list[str]:
        """Model nodes absent from the assignment (rewritten away by ORT before partitioning)."""
        if self.model_nodes is None:
            return []
        assigned = {n.name for n in self.nodes}
        return [n for n in self.model_nodes if n not in assigned]

    @property
    def nodes(self) -> list[PartitionNode]:
        """All assigned nodes."""
        return [n for _, nodes in self.subgraphs for n in nodes]

    @property
    def counts(self) -> dict[str, int]:
        """Number of nodes per EP."""
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.ep] = out.get(n.ep, 0) + 1
        return out

    @property
    def cpu_nodes(self) -> list[PartitionNode]:
        """Nodes not on the QNN EP."""
        return [n for n in self.nodes if n.ep != EP_NAME]

    @property
    def all_on_qnn(self) -> bool:
        """True when every node of the graph ran on the QNN EP."""
        return bool(self.nodes) and not self.cpu_nodes

    def to_dict(self, with_nodes: bool = True) -> dict[str, Any]:
        """Plain-JSON form: counts, CPU nodes with reasons and (optionally) every subgraph's nodes."""
        d: dict[str, Any] = {
            "all_on_qnn": self.all_on_qnn,
            "fallback_allowed": self.fallback_allowed,
            "counts": self.counts,
            "n_subgraphs": {ep: sum(1 for e, _ in self.subgraphs if e == ep) for ep, _ in self.subgraphs},
            "cpu_nodes": [
                {"name": n.name, "op_type": n.op_type, "domain": n.domain, "ep": n.ep, "reason": n.reason,
                 "io_offload": n.io_offload} for n in self.cpu_nodes
            ],
        }
        if self.model_nodes is not None:
            d["rewritten"] = {"added": self.added_nodes, "removed": self.removed_nodes}
        if with_nodes:
            d["subgraphs"] = [
                {"ep": ep, "nodes": [[n.name, n.op_type, n.domain] for n in nodes]} for ep, nodes in self.subgraphs
            ]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Partition:
        """The partition :meth:`to_dict` (``with_nodes=True``) wrote (a cached context's compile-time one)."""
        cpu = {n["name"]: n for n in d.get("cpu_nodes", [])}
        subgraphs = []
        for sg in d["subgraphs"]:
            ep = sg["ep"]
            nodes = [PartitionNode(str(name), str(op), str(dom), ep, cpu.get(name, {}).get("reason") if ep != EP_NAME
                                   else None, bool(cpu.get(name, {}).get("io_offload")) if ep != EP_NAME else False)
                     for name, op, dom in sg["nodes"]]
            subgraphs.append((ep, nodes))
        rewritten = d.get("rewritten")
        model_nodes = None
        if rewritten is not None:  # the model's node names: assigned minus added, plus removed
            added = set(rewritten.get("added", []))
            model_nodes = tuple([n.name for _, ns in subgraphs for n in ns if n.name not in added]
                                + list(rewritten.get("removed", [])))
        return cls(subgraphs, bool(d["fallback_allowed"]), model_nodes)


def io_offload_names(model: Any) -> set[str]:
    """Graph-input QuantizeLinear and graph-output DequantizeLinear node names."""
    if model is None:
        return set()
    ins = {i.name for i in model.graph.input}
    outs = {o.name for o in model.graph.output}
    names = set()
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input and n.input[0] in ins:
            names.add(n.name)
        elif n.op_type == "DequantizeLinear" and any(o in outs for o in n.output):
            names.add(n.name)
    return names


def partition_of(session: Any, *, fallback_allowed: bool, model: Any = None,
                 reasons: dict[str, str] | None = None) -> Partition:
    """Read the partition of a session created with ``session.record_ep_graph_assignment_info=1``.

    ``model`` (an ``onnx.ModelProto``) lets graph-I/O Q/DQ nodes on the CPU be flagged ``io_offload`` and
    the nodes ORT's rewrites added or removed be listed; ``reasons`` maps node names to QNN's reason for
    not taking them.
    """
    try:
        info = session.get_provider_graph_assignment_info()
    except Exception as e:
        raise CaptureError(f"cannot read the EP graph assignment: {one_line(e)}") from None
    io = io_offload_names(model)
    reasons = reasons or {}
    subgraphs = []
    for sg in info:
        ep = sg.ep_name
        nodes = [PartitionNode(n.name, n.op_type, n.domain, ep,
                               reasons.get(n.name) if ep != EP_NAME else None,
                               ep != EP_NAME and n.name in io) for n in sg.get_nodes()]
        subgraphs.append((ep, nodes))
    model_nodes = tuple(n.name for n in model.graph.node) if model is not None else None
    return Partition(subgraphs, fallback_allowed, model_nodes)


# ---------------------------------------------------------------------------------------- op trace
def read_op_trace(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``qnn_op_trace.json`` the EP wrote into ``directory`` (None when absent or unreadable)."""
    p = Path(directory) / OP_TRACE_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def unsupported_from_trace(trace: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``[{"name", "op_type", "reason"}]`` of the nodes QNN refused, from an op trace."""
    if not trace or not isinstance(trace.get("unsupported_nodes"), list):
        return []
    return [{"name": u.get("node_name"), "op_type": u.get("op_type"), "reason": u.get("reason")}
            for u in trace["unsupported_nodes"]]


def source_ops(trace: dict[str, Any] | None) -> dict[str, list[str]]:
    """QNN op name -> the ONNX nodes of its QDQ node unit, from an op trace: exactly what the profile CSV's
    ``ONNX Source Ops`` column holds after a compile (188 / 188 op rows on the svtr bench model); a session
    loaded from a cached context writes that column empty, so the runner fills it from the stored trace."""
    out: dict[str, list[str]] = {}
    for st in (trace or {}).get("subgraph_traces") or []:
        for om in st.get("op_mappings") or []:
            if isinstance(om, dict) and om.get("dst_name"):
                out[str(om["dst_name"])] = [str(x.get("name")) for x in om.get("sources") or []
                                            if isinstance(x, dict) and x.get("type") == "OP"]
    return out


def compiled_target(trace: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The compilation targets (soc_model, htp_arch, device_id) the EP reports in its op trace."""
    if not trace:
        return []
    out = []
    for s in trace.get("soc_traces") or []:
        if isinstance(s, dict) and isinstance(s.get("compilation_target"), dict):
            out.append(dict(s["compilation_target"]))
    return out
