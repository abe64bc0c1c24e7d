#!/usr/bin/env python3
"""Python vs Rust: iterating ShuffledLoader (block order, batch 16384) from Python against the
Rust loader on the same dataset, in the same run, data in page cache (so the binding's overhead
is what is measured, not the disk). Prints JSON.

    .venv/bin/python scripts/bench_python.py [--dir bench-data] [--size-gib 2]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardkit import saev

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(ROOT / "bench-data"))
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default=str(ROOT / "target/release/shardkit"))
    a = ap.parse_args()

    def rust() -> dict:
        # Writes (or reuses) the dataset, warms the cache, runs the block loader warm.
        out = subprocess.run(
            [a.bin, "bench", "saev-read", "--dir", a.dir, "--size-gib", str(a.size_gib), "--only", "warm"],
            check=True, capture_output=True, text=True,
        ).stdout
        return json.loads(out)

    first = rust()
    ds_dir = first["dir"]

    def python() -> float:
        loader = saev.ShuffledLoader(ds_dir, layer=-1, batch_size=16384, seed=1, order="block")
        for e in range(2):  # unmeasured epochs, as the Rust measurement does
            loader.set_epoch(100 + e)
            for _ in loader:
                pass
        loader.set_epoch(0)
        t0 = time.perf_counter()
        n = 0
        for b in loader:
            n += b["act"].nbytes
        return n / (time.perf_counter() - t0)

    rust_runs, py_runs = [first["block_warm_bytes_per_s"]], []
    for _ in range(a.rounds):
        py_runs.append(python())
        rust_runs.append(rust()["block_warm_bytes_per_s"])
    r, p = max(rust_runs), max(py_runs)
    print(json.dumps({
        "bench": "python-vs-rust ShuffledLoader (block, batch 16384, page cache)",
        "dataset": ds_dir,
        "cores": os.cpu_count(),
        "rust_bytes_per_s": round(r),
        "python_bytes_per_s": round(p),
        "ratio": round(p / r, 3),
        "rust_runs": [round(x) for x in rust_runs],
        "python_runs": [round(x) for x in py_runs],
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
