#!/usr/bin/env python3
"""Python vs Rust on the same ShuffledLoader (block order, batch 16384, data in page cache, so
the binding's overhead is what shows): epochs alternate between a Python ``for batch in loader``
loop and the same loader drained inside Rust, in one process. Prints JSON.

    .venv/bin/python scripts/bench_python.py [--dir bench-data] [--size-gib 2] [--rounds 4]

It runs `target/release/shardkit bench saev-read` (`--bin`) to write the dataset: build it with
`cargo build --release -p shardkit-cli -p shardkit-bench`.
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench_common import BenchError, ratio
from shardkit import saev

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(ROOT / "bench-data"))
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bin", default=str(ROOT / "target/release/shardkit"))
    a = ap.parse_args()

    # Writes (or reuses) the synthetic ViT-L-shaped dataset and fills the page cache.
    out = subprocess.run(
        [a.bin, "bench", "saev-read", "--dir", a.dir, "--size-gib", str(a.size_gib), "--only", "warm"],
        check=True, capture_output=True, text=True,
    ).stdout
    ds_dir = json.loads(out)["dir"]

    loader = saev.ShuffledLoader(ds_dir, layer=-1, batch_size=16384, seed=1, order="block")
    for e in range(2):  # unmeasured: buffer pools reach their steady size
        loader.set_epoch(100 + e)
        loader._l._drain()

    def python_epoch() -> tuple:
        loader.set_epoch(0)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += batch["act"].nbytes
        return n, n / (time.perf_counter() - t0)

    def rust_epoch() -> tuple:
        loader.set_epoch(0)
        t0 = time.perf_counter()
        n = loader._l._drain()
        return n, n / (time.perf_counter() - t0)

    py_runs, rust_runs, served = [], [], set()
    for _ in range(a.rounds):
        for runs, epoch in ((rust_runs, rust_epoch), (py_runs, python_epoch)):
            n, rate = epoch()
            served.add(n)
            runs.append(rate)
    # Both drain epoch 0 of the same loader (the Rust drain reports only a byte count): the same
    # bytes every time, or the two rates measure different work.
    if len(served) != 1:
        raise BenchError(f"the epochs served different byte counts: {sorted(served)}")
    r, p = max(rust_runs), max(py_runs)
    print(json.dumps({
        "bench": "python-vs-rust ShuffledLoader (block, batch 16384, page cache, same process)",
        "dataset": ds_dir,
        "cores": os.cpu_count(),
        "rust_bytes_per_s": round(r),
        "python_bytes_per_s": round(p),
        "ratio": round(ratio("Python loop vs Rust drain", p, r), 3),
        "rust_runs": [round(x) for x in rust_runs],
        "python_runs": [round(x) for x in py_runs],
    }, indent=2))


if __name__ == "__main__":
    main()
