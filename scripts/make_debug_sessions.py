#!/usr/bin/env python
"""Write the ``qnn-net-run --debug`` device-session fixture (``tests/support/debug_sessions.py``) into a folder.

The parts are a legacy export of the shipped InternVL reference without ``value_info`` and with the exporter's
producer-named output axes (``<out>/parts/``); ``<out>/{vision,prefill,decode}/`` hold ``input_list.txt``,
``inputs/`` and ``output/Result_<i>/`` with every graph output and every float activation, named and typed as
``qnn-net-run --debug`` writes them; decode call 3 ran with one layer-1 MLP weight scaled by 1.5. The tests build
the same session into tmp (nothing is committed).

Run: ``python scripts/make_debug_sessions.py OUT [--force]`` (about 50 s on 2 cores), then, as in
``docs/device-sessions.md``::

    ivq ingest session --vision OUT/vision --prefill OUT/prefill --decode OUT/decode --model-dir OUT/parts -o s.h5
    ivq reference s.h5 --model-dir OUT/parts -o r.h5
    ivq-diff r.h5 s.h5
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.debug_sessions import MODEL, build_debug_session  # noqa: E402
from tests.support.device_sessions import fixture_folder_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parsed = fixture_folder_args(__doc__, argv)
    if parsed is None:
        return 2
    _, out = parsed
    from ivq_debug.vlm.load import load_vlm, reference_path

    s = build_debug_session(load_vlm(MODEL).model, out, reference_path(MODEL) / "config.json")
    for part, names in s.intermediates.items():
        n = len(list((s.folders[part] / "output").glob("Result_*")))
        print(f"{part}: {n} Result folder(s), {len(names)} intermediates each: {s.folders[part]}")
    print(f"fault: decode step {s.fault_step}, first changed tensor {s.fault_tensor}; parts: {s.parts_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
