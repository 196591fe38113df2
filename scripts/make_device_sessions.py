#!/usr/bin/env python
"""Write the device-session fixtures (``tests/support/device_sessions.py``) into a folder, for people to look at.

Each session is a real ORT run of split ONNX parts of a shipped reference model (HF-style dynamic-cache
export, or the embedded reference's fixed-cache export) with a position fault, written as ``qnn-net-run``
lays its runs out: ``<out>/sessions/<model>-<cache>-<fault>/{vision,prefill,decode}/`` with
``input_list.txt``, ``inputs/<i>/*.raw`` and ``output/Result_<i>/*.raw``; the parts the "device" ran are
under ``<out>/parts/``. The tests build the same sessions into tmp (nothing is committed).

Run: ``python scripts/make_device_sessions.py OUT [--force] [--only NAME ...]`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.device_sessions import (  # noqa: E402
    SESSIONS,
    build_sessions,
    fixture_folder_args,
    parts_exporter,
)


def main(argv: list[str] | None = None) -> int:
    parsed = fixture_folder_args(__doc__, argv, lambda ap: ap.add_argument(
        "--only", nargs="+", metavar="NAME", help="sessions to write (default: all), e.g. internvl-tiny-dynamic-restart"))
    if parsed is None:
        return 2
    a, out = parsed
    names = {f"{m}-{c}-{f}": (m, c, f) for m, c, f in SESSIONS}
    chosen = tuple(names.values()) if not a.only else tuple(names[n] for n in a.only if n in names)
    unknown = sorted(set(a.only or ()) - set(names))
    if unknown:
        print(f"unknown session(s) {unknown}; known: {', '.join(names)}", file=sys.stderr)
        return 2
    from ivq_debug.vlm.load import load_vlm

    models: dict = {}

    def load(name: str):
        if name not in models:
            models[name] = load_vlm(name).model
        return models[name]

    sessions = build_sessions(out / "sessions", parts_exporter(out / "parts", load), chosen)
    for folder in sorted((out / "parts").iterdir()):
        checks = json.loads((folder / "export.json").read_text())["checks"]
        if checks:
            print(f"parts {folder.name}: ORT vs torch max_abs " + ", ".join(
                f"{c['part']} {max(c['max_abs'].values()):.1e}" for c in checks))
    for s in sessions.values():
        steps = len(s.tokens) - 1
        print(f"{s.name}: {steps} decode steps, expected offset {s.expected_offset} from step "
              f"{s.first_wrong_step}, decode position_ids {'present' if s.decode_has_positions else 'absent'}: {s.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
