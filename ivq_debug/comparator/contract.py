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
so. The identity of each side (backend, SDK, SoC, platform, model files with their SHA-256 and precision,
preprocessing) is collected for the JSON; it differs by design between fp32 and a quantized backend, so it is
reported, not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.dump.contract import CONTRACT_META, INPUTS_META, PREPROCESS_META
from ivq_debug.dump.reader import Dump
from ivq_debug.errors import ContractError

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

    @property
    def first(self) -> dict[str, Any] | None:
        """The first differing external input (None when none differs)."""
        return self.mismatches[0] if self.mismatches else None

    def line(self) -> str:
        """One line: the status and, when broken, the first differing input and record."""
        a, b = self.sides
        if self.status == UNKNOWN:
            why = "a side lists no input digests (a dump written before the contract existed)"
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
                "one_sided": self.one_sided, "unknown_records": self.unknown_records, "identity": self.identity}

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
    return {"path": str(d.path), "backend": d.backend, "sdk": sdk,
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
    if out.mismatches:
        out.status = BROKEN
    elif out.records:
        out.status = OK
    return out


def combine(checks: Iterable[ContractCheck]) -> str:
    """The overall status of several checks: broken if any is, unknown if any is, else ok."""
    st = [c.status for c in checks]
    return BROKEN if BROKEN in st else UNKNOWN if UNKNOWN in st or not st else OK
