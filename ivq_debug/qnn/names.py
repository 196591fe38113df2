"""QNN tensor / node names: sanitizing and the reverse map back to ONNX names.

QNN's converters and generated ``model.cpp`` replace every character outside ``[A-Za-z0-9_]`` by ``_``
(per character: ``onnx::Conv_497`` → ``onnx__Conv_497``) and prefix ``_`` when the name does not start
with a letter or ``_`` (``7`` → ``_7``, ``/conv1/Conv_output_0`` → ``_conv1_Conv_output_0``). Older
SDKs collapsed runs of such characters (``\\W+``); DLC / ORT-QNN graphs keep the original names. A
reader therefore tries several *forms* of every ONNX name, in this order of trust:

``identity``
    the name as is;
``per_char``
    the current rule (:func:`qnn_sanitize`);
``collapsed``
    the legacy rule (``qnn_sanitize(name, legacy=True)``);
``ascii`` / ``alpha_prefix``
    variants seen in older tools (ASCII-only ``\\W`` as C++ ``std::regex`` does; the old Python
    backend's prefix rule ``name if name[0].isalpha() else "_" + name``).

Sanitizing is not injective (``a/b`` and ``a_b`` both give ``a_b``), so :class:`NameMap` keeps every
candidate and reports collisions instead of picking one silently.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.onnxgraph.load import load_model

_PER_CHAR = re.compile(r"\W")
_RUNS = re.compile(r"\W+")
_ASCII_PER_CHAR = re.compile(r"[^A-Za-z0-9_]")

#: name forms in the order they are trusted
FORMS = ("identity", "per_char", "collapsed", "ascii", "alpha_prefix")


def _prefix(s: str) -> str:
    if not (s[:1].isalpha() or s[:1] == "_"):
        return "_" + s
    return s


def qnn_sanitize(name: str, legacy: bool = False) -> str:
    """The QNN name of an ONNX tensor or node name.

    Args:
        name: the framework name, e.g. ``/model/layers.0/mlp/Gelu_output_0``.
        legacy: collapse runs of non-word characters into one ``_`` (SDKs before ~2.20) instead of
            replacing each character.

    Returns:
        ``_model_layers_0_mlp_Gelu_output_0``; a ``_`` is prefixed when the result would not start
        with a letter or ``_``.
    """
    return _prefix((_RUNS if legacy else _PER_CHAR).sub("_", name))


def name_forms(name: str) -> dict[str, str]:
    """Every QNN form of ``name``, keyed by form (see :data:`FORMS`)."""
    per_char = qnn_sanitize(name)
    collapsed = qnn_sanitize(name, legacy=True)
    raw = _RUNS.sub("_", name)
    return {
        "identity": name,
        "per_char": per_char,
        "collapsed": collapsed,
        "ascii": _prefix(_ASCII_PER_CHAR.sub("_", name)),
        "alpha_prefix": raw if raw[:1].isalpha() else "_" + raw,
    }


@dataclass(frozen=True)
class NameMatch:
    """How one QNN name resolved.

    Attributes:
        qnn_name: the name looked up.
        onnx_name: the unique ONNX name it maps to, or ``None`` (unknown or ambiguous).
        kind: ``"tensor"`` or ``"node"`` (of ``onnx_name``).
        form: which :data:`FORMS` entry matched.
        candidates: every ONNX name that matched in the winning form (more than one = ambiguous).
    """

    qnn_name: str
    onnx_name: str | None
    kind: str | None = None
    form: str | None = None
    candidates: tuple[str, ...] = ()

    @property
    def ambiguous(self) -> bool:
        """True when several ONNX names give this QNN name in the same form."""
        return len(self.candidates) > 1


@dataclass(frozen=True)
class NameCollision:
    """Several ONNX names that give the same QNN name."""

    qnn_name: str
    onnx_names: tuple[str, ...]
    forms: tuple[str, ...]


@dataclass
class NameMap:
    """Reverse map from QNN names (any form) to ONNX tensor and node names.

    Build it with :meth:`from_onnx` (a model path or ``ModelProto``) or :meth:`from_names`. Lookups try
    tensors before nodes and forms in :data:`FORMS` order; the first form with a hit decides. A hit
    with several candidates is ambiguous and resolves to ``None`` (see :attr:`collisions`).
    """

    tensors: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    node_outputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _index: dict[tuple[str, str], dict[str, list[str]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for kind, names in (("tensor", self.tensors), ("node", self.nodes)):
            for form in FORMS:
                self._index[(kind, form)] = {}
            for n in dict.fromkeys(names):
                for form, q in name_forms(n).items():
                    bucket = self._index[(kind, form)].setdefault(q, [])
                    if n not in bucket:
                        bucket.append(n)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_names(
        cls,
        tensors: Iterable[str],
        nodes: Iterable[str] = (),
        node_outputs: dict[str, Iterable[str]] | None = None,
    ) -> NameMap:
        """A map over explicit tensor and node names."""
        return cls(
            tensors=tuple(t for t in tensors if t),
            nodes=tuple(n for n in nodes if n),
            node_outputs={k: tuple(v) for k, v in (node_outputs or {}).items()},
        )

    @classmethod
    def from_onnx(cls, model: Any) -> NameMap:
        """A map over every tensor (inputs, outputs, initializers, node outputs) and node of a model.

        Args:
            model: a path to an ``.onnx`` file or an ``onnx.ModelProto``.
        """
        m = load_model(model)
        g = m.graph
        tensors: list[str] = [i.name for i in g.input]
        tensors += [i.name for i in g.initializer]
        nodes: list[str] = []
        outs: dict[str, tuple[str, ...]] = {}
        for n in g.node:
            tensors += [o for o in n.output if o]
            if n.name:
                nodes.append(n.name)
                outs[n.name] = tuple(o for o in n.output if o)
        tensors += [o.name for o in g.output]
        tensors += [v.name for v in g.value_info]
        return cls.from_names(tensors, nodes, outs)

    # ------------------------------------------------------------------ lookups
    def resolve(self, qnn_name: str, kinds: tuple[str, ...] = ("tensor", "node")) -> NameMatch:
        """Resolve a QNN name to an ONNX name (see the class docstring for the order)."""
        for kind in kinds:
            for form in FORMS:
                hits = self._index.get((kind, form), {}).get(qnn_name)
                if hits:
                    unique = hits[0] if len(hits) == 1 else None
                    return NameMatch(qnn_name, unique, kind, form, tuple(hits))
        return NameMatch(qnn_name, None)

    def lookup(self, qnn_name: str) -> str | None:
        """The unique ONNX *tensor* name for a QNN name, or ``None`` (unknown or ambiguous)."""
        return self.resolve(qnn_name, kinds=("tensor",)).onnx_name

    def lookup_node(self, qnn_name: str) -> str | None:
        """The unique ONNX *node* name for a QNN name, or ``None``."""
        return self.resolve(qnn_name, kinds=("node",)).onnx_name

    def __contains__(self, qnn_name: object) -> bool:
        return isinstance(qnn_name, str) and self.resolve(qnn_name).onnx_name is not None

    def __len__(self) -> int:
        return len(self.tensors) + len(self.nodes)

    @property
    def collisions(self) -> list[NameCollision]:
        """QNN names that several distinct ONNX names produce (within one kind, across forms).

        Only the ``identity`` / ``per_char`` / ``collapsed`` forms are checked (the fallback forms
        collide by construction with the others and are never preferred over them).
        """
        out: list[NameCollision] = []
        for kind in ("tensor", "node"):
            merged: dict[str, dict[str, set[str]]] = {}
            for form in ("identity", "per_char", "collapsed"):
                for q, names in self._index[(kind, form)].items():
                    slot = merged.setdefault(q, {})
                    for n in names:
                        slot.setdefault(n, set()).add(form)
            for q, names in merged.items():
                if len(names) > 1:
                    forms = sorted({f for fs in names.values() for f in fs}, key=FORMS.index)
                    out.append(NameCollision(q, tuple(sorted(names)), tuple(forms)))
        return sorted(out, key=lambda c: c.qnn_name)
