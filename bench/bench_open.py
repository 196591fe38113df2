"""Open time of a dump with many tensors (the reader's checks at open: root attributes, records, manifest).

Writes a dump of ``--records`` records × ``--tensors`` small tensors (each a different name, shape and
statistics, as a real capture has) once, then opens it ``--repeat`` times in this process and prints the best
wall time of ``open_dump`` and the best CPU time of the manifest's column check alone
(:func:`ivq_debug.dump.validate.check_columns`).

    python bench/bench_open.py [--records 20] [--tensors 1000] [--repeat 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.validate import check_columns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-open-"))
    p = work / f"many-{a.records}x{a.tensors}.h5"
    if not p.exists():
        rng = np.random.default_rng(0)
        with DumpWriter(p, backend="bench", command="bench_open") as w:
            for r in range(a.records):
                w.begin_record(sample=0, part="prefill" if r == 0 else "decode", step=r)
                for i in range(a.tensors):
                    w.add_tensor(f"layer{i}/out", rng.standard_normal((1 + i % 7, 3)).astype(np.float32),
                                 op_type="MatMul")
    best = float("inf")
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        with open_dump(p) as d:
            n = len(d.entries)
        best = min(best, time.perf_counter() - t0)
    import h5py

    with h5py.File(p, "r") as f:
        doc = json.loads(f["manifest"][()])
    check = float("inf")
    for _ in range(a.repeat):
        t0 = time.process_time()
        check_columns(doc["columns"], doc["rows"], p)
        check = min(check, time.process_time() - t0)
    print(f"{p.name}: {n} entries, open_dump best of {a.repeat}: {best * 1e3:.1f} ms "
          f"({best / max(n, 1) * 1e6:.2f} µs per entry); manifest column check: {check * 1e3:.1f} ms CPU")


if __name__ == "__main__":
    main()
