"""The comparison contract: were the two dumps fed the same inputs? Checked before any metric.

Every record of a dump lists its inputs' SHA-256 and roles (:mod:`ivq_debug.dump.contract`). For each record
both dumps hold, each input both list is compared by role:

- both ``external`` (pixels, prompt tokens, teacher-forced tokens, a user's feeds): the digests must agree,
  else the contract is **broken** (``ivq-diff`` exit 6, :class:`~ivq_debug.errors.ContractError`);
- either side ``recomputed`` (``ivq reference``'s positions and image rows): skipped, and said so with the
  producer's reason;
- either side ``carried`` (KV cache, prompt embeddings holding the vision output, free-running tokens): skipped;
- otherwise (a ``derived`` input: positions, masks, cache lengths, token embeddings): compared, and a difference
  is a note for the diagnostics (a scheduler's position rule), not a failure.

A dump written before input digests existed makes the contract **unknown**: the comparison still runs and says
so. Two dumps with no record in common are not compared at all (:func:`check_common_records`, exit 4: both
sides' records listed, ``--part`` suggested). Session settings the inputs cannot show are checked too
(:func:`session_warnings`: the ORT graph optimization level, ONNX Runtime session config entries and the QNN
session options of each side): a difference is a warning naming both values. The identity of each side (backend, SDK, SoC, platform, model files with their SHA-256 and precision,
preprocessing) is collected for the JSON; it differs by design between fp32 and a quantized backend, so it is
reported, not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.dump.contract import CONTRACT_META, INPUTS_META, PREPROCESS_META
from ivq_debug.dump.reader import Dump
from ivq_debug.errors import AlignmentError, ContractError

OK = "ok"
BROKEN = "broken"
UNKNOWN = "unknown"
#: contract statuses: inputs agree · external inputs differ · no digests to check
STATUSES = (OK, BROKEN, UNKNOWN)

RecordKey = tuple[int, str, int]


def _rec(key: RecordKey) -> str:
    return f"{key[0]}/{key[1]}/{key[2]}"


def _short(h: str | None) -> str:
    return (h or "?")[:12]


@dataclass
class ContractCheck:
    """The result of :func:`check_contract` for one pair of dumps.

    Attributes:
        status: ``ok``, ``broken`` or ``unknown``.
        sides: the two labels (``ref``/``test``, or ``ref``/``expected``).
        records: records compared (both dumps list digests for them).
        inputs_checked: external inputs compared.
        mismatches: the external inputs that differ, in record order (``record``, ``input``, digests, dtypes,
            shapes), at most ``limit``; ``first`` is the first of them.
        derived: derived inputs that differ, per name: first record and count (for the diagnostics).
        skipped: per input name, why it was not compared (``recomputed: <reason>``, ``carried``).
        one_sided: input names only one side stored for a record both hold.
        unknown_records: records both dumps hold where a side lists no digests.
        identity: what ran on each side (:func:`dump_identity`).
        warnings: session settings that differ between the sides (:func:`session_warnings`: the ORT graph
            optimization level, QNN session options): the same inputs, but not the same graph as run.
        allowed: the mismatch was allowed (``--allow-input-mismatch``): the comparison runs and says so.
    """

    status: str
    sides: tuple[str, str] = ("ref", "test")
    records: int = 0
    inputs_checked: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    derived: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    one_sided: list[str] = field(default_factory=list)
    unknown_records: int = 0
    identity: dict[str, Any] = field(default_factory=dict)
    allowed: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def first(self) -> dict[str, Any] | None:
        """The first differing external input (None when none differs)."""
        return self.mismatches[0] if self.mismatches else None

    def line(self) -> str:
        """One line: the status and, when broken, the first differing input and record."""
        a, b = self.sides
        if self.status == UNKNOWN:
            why = ("a side lists no input digests (a dump written before the contract existed)" if self.unknown_records
                   else "the dumps hold no record in common")
            return f"contract unknown ({a} vs {b}): {why}; inputs not checked"
        if self.status == BROKEN:
            m = self.first or {}
            detail = f"sha256 {_short(m.get(a))} vs {_short(m.get(b))}"
            if m.get("shape_" + a) != m.get("shape_" + b) or m.get("dtype_" + a) != m.get("dtype_" + b):
                detail += (f"; {m.get('dtype_' + a)}{m.get('shape_' + a)} vs "
                           f"{m.get('dtype_' + b)}{m.get('shape_' + b)}")
            more = f" (+{len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            return (f"{a} and {b} were not fed the same inputs: input {m.get('input')!r} of record "
                    f"{m.get('record')} differs ({detail}){more}")
        text = f"inputs match ({self.inputs_checked} external input(s) in {self.records} record(s))"
        notes = []
        if self.derived:
            name, d = next(iter(self.derived.items()))
            notes.append(f"derived {name} differs from {d['first']}" + (
                f" (+{len(self.derived) - 1} more)" if len(self.derived) > 1 else ""))
        rec = {k: v for k, v in self.skipped.items() if v.startswith("recomputed")}
        if rec:
            notes.append("not compared: " + ", ".join(f"{k} ({v})" for k, v in rec.items()))
        if self.unknown_records:
            notes.append(f"{self.unknown_records} record(s) without digests")
        return f"contract {text}" + (f"; {'; '.join(notes)}" if notes else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``contract`` block of ``ivq-diff/1``)."""
        return {"status": self.status, "allowed": self.allowed, "line": self.line(), "sides": list(self.sides),
                "records": self.records, "inputs_checked": self.inputs_checked, "first_mismatch": self.first,
                "mismatches": self.mismatches, "derived_differences": self.derived, "skipped": self.skipped,
                "one_sided": self.one_sided, "unknown_records": self.unknown_records, "identity": self.identity,
                "warnings": self.warnings}

    def raise_if_broken(self) -> None:
        """Raise :class:`~ivq_debug.errors.ContractError` (exit 6) when broken and not allowed."""
        if self.status == BROKEN and not self.allowed:
            raise ContractError(f"{self.line()}; pass --allow-input-mismatch to compare anyway")


def dump_identity(d: Dump) -> dict[str, Any]:
    """What ran to make a dump: backend, SDK, SoC, platform, model files (SHA-256, precision), preprocessing."""
    info = d.backend_info or {}
    ident = d.meta(CONTRACT_META) or {}
    models = dict(ident.get("models") or {})
    if not models and d.model.get("sha256"):
        models[d.model.get("part") or "model"] = {k: d.model.get(k) for k in ("path", "sha256")}
    sdk = {k: info[k] for k in ("qnn_sdk_version", "onnxruntime_qnn", "onnxruntime", "torch") if k in info}
    pre = {}
    for r in d._records:
        p = (r.get("meta") or {}).get(PREPROCESS_META)
        if p is not None:
            pre = p
            break
    qnn = info.get("qnn_config")
    if isinstance(qnn, dict):  # where a run wrote its traces and profiles is not how the graph ran
        qnn = {k: v for k, v in qnn.items() if not str(k).endswith(("_path", "_dir"))}
    plat = info.get("platform") if isinstance(info.get("platform"), dict) else {}
    return {"path": str(d.path), "backend": d.backend, "sdk": sdk,
            "ort_optimization": info.get("graph_optimization_level"),
            "session_options": info.get("session_options", plat.get("session_options")), "qnn_options": qnn,
            "soc": {k: info[k] for k in ("soc_model", "htp_arch") if k in info},
            "emulated": info.get("emulated"), "platform": ident.get("platform"), "models": models,
            "precision": sorted({m.get("precision") for m in models.values() if m.get("precision")}),
            "preprocess": pre or None, "contract_recorded": bool(ident) or any(
                INPUTS_META in (r.get("meta") or {}) for r in d._records)}


def check_contract(ref: Dump, test: Dump, *, sides: tuple[str, str] = ("ref", "test"),
                   records: Callable[[RecordKey], bool] | None = None, limit: int = 20) -> ContractCheck:
    """Check that ``ref`` and ``test`` were fed the same inputs (see the module docstring)."""
    a, b = sides
    rmeta = {(r["sample"], r["part"], r["step"]): r.get("meta") or {} for r in ref._records}
    tmeta = {(r["sample"], r["part"], r["step"]): r.get("meta") or {} for r in test._records}
    keys = sorted(set(rmeta) & set(tmeta), key=lambda k: (k[0], k[2], k[1]))
    if records is not None:
        keys = [k for k in keys if records(k)]
    out = ContractCheck(UNKNOWN, sides, identity={a: dump_identity(ref), b: dump_identity(test)})
    one_sided: set[str] = set()
    for key in keys:
        ri, ti = rmeta[key].get(INPUTS_META), tmeta[key].get(INPUTS_META)
        if not isinstance(ri, dict) or not isinstance(ti, dict):
            out.unknown_records += 1
            continue
        out.records += 1
        one_sided.update(set(ri) ^ set(ti))
        for name in [n for n in ri if n in ti]:
            fr, ft = ri[name] or {}, ti[name] or {}
            roles = {fr.get("role", "external"), ft.get("role", "external")}
            if "recomputed" in roles:
                src = fr if fr.get("role") == "recomputed" else ft
                side = a if src is fr else b
                out.skipped.setdefault(name, f"recomputed by the {side} side on purpose: {src.get('reason') or '?'}")
                continue
            if "carried" in roles:
                out.skipped.setdefault(name, "carried (an earlier part's or step's output on each backend)")
                continue
            same = fr.get("sha256") == ft.get("sha256")
            if roles == {"external"}:
                out.inputs_checked += 1
                if not same and len(out.mismatches) < limit:
                    out.mismatches.append({
                        "record": _rec(key), "input": name, a: fr.get("sha256"), b: ft.get("sha256"),
                        "dtype_" + a: fr.get("dtype"), "dtype_" + b: ft.get("dtype"),
                        "shape_" + a: fr.get("shape"), "shape_" + b: ft.get("shape")})
            elif not same:
                d = out.derived.setdefault(name, {"first": _rec(key), "count": 0})
                d["count"] += 1
    out.one_sided = sorted(one_sided)
    out.warnings = session_warnings(out.identity[a], out.identity[b], sides)
    if out.mismatches:
        out.status = BROKEN
    elif out.records:
        out.status = OK
    return out


def session_warnings(ia: dict[str, Any], ib: dict[str, Any], sides: tuple[str, str] = ("ref", "test")) -> list[str]:
    """How two captures' sessions differ where the inputs cannot show it: the ORT graph optimization level (a
    capture at ``disable`` runs every node as written, one at ``all`` runs fused kernels that round differently),
    ONNX Runtime session config entries, and the QNN session options both sides recorded."""
    a, b = sides
    out = []
    la, lb = ia.get("ort_optimization"), ib.get("ort_optimization")
    if la and lb and la != lb:
        out.append(f"ORT optimization level differs: {a} {la}, {b} {lb} (not the same graph as run: fused kernels "
                   "round differently; capture both at one level)")
    sa, sb = ia.get("session_options") or {}, ib.get("session_options") or {}
    if isinstance(sa, dict) and isinstance(sb, dict) and sa != sb:
        keys = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
        out.append("ORT session options differ: " + ", ".join(f"{k} {a} {sa.get(k)!r} vs {b} {sb.get(k)!r}"
                                                                for k in keys))
    qa, qb = ia.get("qnn_options"), ib.get("qnn_options")
    if isinstance(qa, dict) and isinstance(qb, dict) and qa != qb:
        keys = sorted(k for k in set(qa) | set(qb) if qa.get(k) != qb.get(k))
        out.append("QNN session options differ: " + ", ".join(f"{k} {a} {qa.get(k)!r} vs {b} {qb.get(k)!r}"
                                                               for k in keys))
    return out


def backend_pair(ref: Dump, test: Dump) -> dict[str, Any] | None:
    """``{"ref", "test", "models"}`` when ``ref`` is the ORT CPU-QDQ capture of the very QDQ model(s) ``test`` ran
    on another backend (same SHA-256 for every part both recorded), else None: then ``ref`` is what ``test``
    should compute up to a backend's rounding, and a comparison checks that by default (``backend_check``)."""
    if ref.backend != "onnxruntime-cpu-qdq" or test.backend == ref.backend:
        return None
    ma, mb = dump_identity(ref)["models"], dump_identity(test)["models"]
    common = [p for p in ma if p in mb]
    if not common or any(not ma[p].get("sha256") or ma[p].get("sha256") != mb[p].get("sha256") for p in common):
        return None
    return {"ref": ref.backend, "test": test.backend, "models": {p: ma[p].get("sha256") for p in common}}


def describe_records(keys: Iterable[RecordKey]) -> str:
    """The records of a dump per part, e.g. ``vision 0/vision/0, 1/vision/0; decode 0/decode/1 … (14)``."""
    by_part: dict[str, list[RecordKey]] = {}
    for k in sorted(keys, key=lambda k: (k[1], k[0], k[2])):
        by_part.setdefault(k[1], []).append(k)
    out = []
    for part, ks in by_part.items():
        shown = ", ".join(_rec(k) for k in ks[:3]) + (f" … ({len(ks)})" if len(ks) > 3 else "")
        out.append(f"{part}: {shown}")
    return "; ".join(out) or "no record"


def check_common_records(ref: Dump, test: Dump, *, sides: tuple[str, str] = ("ref", "test"),
                         records: Callable[[RecordKey], bool] | None = None) -> None:
    """Raise :class:`~ivq_debug.errors.AlignmentError` (exit 4) when the two dumps hold no record in common
    (records pair by ``(sample, part, step)``): both sides' records listed, and ``--part`` suggested, instead of
    every tensor reported unmatched."""
    rk, tk = set(ref.record_keys()), set(test.record_keys())
    if records is not None:
        rk, tk = {k for k in rk if records(k)}, {k for k in tk if records(k)}
    if rk & tk or not rk or not tk:
        return
    a, b = sides
    rparts, tparts = sorted({k[1] for k in rk}), sorted({k[1] for k in tk})
    if set(rparts) & set(tparts):
        hint = "the parts agree but not the samples or steps: capture the same inputs on both sides"
    else:
        hint = (f"records pair by (sample, part, step): capture {b} with --part {rparts[0]} (or {a} with --part "
                f"{tparts[0]}) so both name the same part")
    raise AlignmentError(f"no record is common to {a} {ref.path} ({describe_records(rk)}) and {b} {test.path} "
                         f"({describe_records(tk)}); {hint}")


def combine(checks: Iterable[ContractCheck]) -> str:
    """The overall status of several checks: broken if any is, unknown if any is, else ok."""
    st = [c.status for c in checks]
    return BROKEN if BROKEN in st else UNKNOWN if UNKNOWN in st or not st else OK
