"""PyTorch capture: forward hooks on selected modules, streaming into a golden dump.

Outputs are flattened from tensors, tuples, lists, dicts and ``ModelOutput`` objects with per-index keys
(``name[0]``, ``name.logits``); caches and the ``hidden_states`` / ``attentions`` fields of ModelOutputs (copies
of other modules' outputs) are skipped; a module called several times in one record is keyed
``name#k`` from its second call. Pass-through modules (Dropout, Identity, …) are skipped by default, and so is
an output that is the very tensor object of an output already captured in the record (``docs/dump-format.md``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from ivq_debug.capture.base import Selection

#: module classes skipped by default: they return their input (or a copy of it) at inference time
PASS_THROUGH = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten")
#: ModelOutput fields skipped by default: copies of tensors other modules already produced
AUX_KEYS = ("hidden_states", "attentions", "cross_attentions", "past_key_values", "cache")


def default_selection(include: Sequence[str] = ("*",), exclude: Sequence[str] = ()) -> Selection:
    """Selection that captures every module except pass-through ones."""
    return Selection(include=include, exclude=exclude, exclude_op_types=PASS_THROUGH)


def flatten_outputs(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """Yield ``(key, tensor)`` pairs from a module output of any nesting (tensors only)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield name, value
        return
    if value is None or isinstance(value, (int, float, bool, str)):
        return
    cls = type(value).__name__
    if "Cache" in cls:  # DynamicCache & co: KV tensors are captured where they are produced
        return
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # transformers ModelOutput
        for k in value.keys():
            if k not in AUX_KEYS:  # per-layer copies (hidden_states[i] is layer i-1's output)
                yield from flatten_outputs(f"{name}.{k}", value[k])
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten_outputs(f"{name}.{k}", v)
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from flatten_outputs(f"{name}[{i}]", v)


class TorchCapture:
    """Capture module outputs of a ``torch.nn.Module`` into a :class:`~ivq_debug.dump.DumpWriter`.

    Use as a context manager around the forward calls; tensors go into the writer's current record::

        with DumpWriter(path, backend="torch") as w, TorchCapture(model, w) as cap:
            w.begin_record(sample=0, part="prefill", step=0)
            model(**inputs)

    Args:
        model: the module to hook (names are ``named_modules()`` paths relative to it; ``prefix`` is
            prepended, e.g. when hooking a submodule but naming from the full model).
        writer: the dump writer.
        selection: module filter (default: every module except pass-through ones). Patterns match the
            module path; ``op_types`` match the class name.
        leaves_only: hook only modules without children.
        dedupe: skip an output that is the very same tensor object as an output already captured in the record:
            a pass-through container (an ``mlp`` returning its ``down_proj`` output) or a ``ModelOutput`` field
            aliasing a child's output (Qwen3-VL's ``visual.last_hidden_state`` *is* the last block's output, produced
            before the merger: kept, it would be aligned with the merger's own same-shaped tensor).
    """

    backend = "torch"

    def __init__(
        self,
        model: Any,
        writer: Any,
        selection: Selection | None = None,
        *,
        prefix: str = "",
        leaves_only: bool = False,
        dedupe: bool = True,
    ) -> None:
        self.model = model
        self.writer = writer
        self.selection = selection or default_selection()
        self.prefix = prefix
        self.leaves_only = leaves_only
        self.dedupe = dedupe
        self._handles: list[Any] = []
        self._calls: dict[tuple[str | None, str], int] = {}
        self._seen: dict[int, weakref.ref] = {}  # id -> the tensor captured in the current record
        self._seen_record: Any = None
        self.aliases = 0
        self.captured = 0

    def modules(self) -> list[tuple[str, Any]]:
        """The ``(name, module)`` pairs that will be hooked."""
        out = []
        for name, mod in self.model.named_modules():
            if not name and not self.prefix:
                continue  # the root: its output is the model output, recorded by the caller
            full = f"{self.prefix}.{name}" if self.prefix and name else (self.prefix or name)
            if self.leaves_only and any(True for _ in mod.children()):
                continue
            if self.selection.accepts(full, type(mod).__name__):
                out.append((full, mod))
        return out

    def __enter__(self) -> TorchCapture:
        for name, mod in self.modules():
            self._handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove all hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        mtype = None

        def hook(module: Any, args: Any, output: Any) -> None:
            nonlocal mtype
            mtype = mtype or type(module).__name__
            rid = self.writer.current_record
            k = self._calls.get((rid, name), 0)
            self._calls[(rid, name)] = k + 1
            base = name if k == 0 else f"{name}#{k}"
            if rid != self._seen_record:
                self._seen, self._seen_record = {}, rid
            for key, t in flatten_outputs(base, output):
                if self.dedupe:
                    ref = self._seen.get(id(t))
                    if ref is not None and ref() is t:
                        self.aliases += 1
                        continue
                    self._seen[id(t)] = weakref.ref(t)
                self.writer.add_tensor(key, t, op_type=mtype, scope=name)
                self.captured += 1

        return hook
