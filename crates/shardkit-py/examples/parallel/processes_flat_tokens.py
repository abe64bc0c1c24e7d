"""Recipe: one flat-tokens split written by several plain processes.

    python processes_flat_tokens.py --root /shared/tokens.zarr --n-docs 1000000 --world-size 8

Run without a launcher, the script starts ``--world-size`` copies of itself, each with ``RANK``
and ``WORLD_SIZE`` set (as torchrun, Slurm or MPI would: ``flat_tokens.PartWriter`` reads them
from the environment), and waits for them. Each rank tokenizes and writes only its own block of
documents, the units ``shardkit.part_of(n_units, rank)`` of ``--sequences-per-unit`` documents;
whichever rank finishes last commits the split, and the result is byte for byte what one
``flat_tokens.Writer`` writes from the same documents. The ranks coordinate through the
directory only, so ``--root`` must be one file system every rank sees. A killed job is started
again the same way, with any number of ranks: each writes only what is still missing.

The documents here are a stand-in computed from their index (so that any rank can make any
document, and the test can compare with one process): put your corpus reader and tokenizer in
``document``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List

import numpy as np

from shardkit import flat_tokens


def document(i: int) -> np.ndarray:
    """Document ``i``'s token ids: your tokenizer goes here."""
    n = (i * 7919) % 97
    return ((np.arange(n, dtype=np.uint64) * 17 + i * 31) % 50_000 + 1).astype(np.uint32)


def write_part(a: argparse.Namespace) -> None:
    with flat_tokens.PartWriter(
        a.root, a.split, a.n_docs, a.layout, sequences_per_unit=a.sequences_per_unit
    ) as w:
        for first, end in w.pending:
            for at in range(first, end, a.batch):
                w.append([document(i) for i in range(at, min(at + a.batch, end))])
    print(json.dumps(w.close()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--split", default="train")
    p.add_argument("--n-docs", type=int, default=1000)
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--sequences-per-unit", type=int, default=65536)
    p.add_argument("--layout", default="v3")
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    if "RANK" in os.environ:
        write_part(a)
        return
    procs: List[subprocess.Popen[bytes]] = []
    for r in range(a.world_size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.world_size))
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    failed = [r for r, proc in enumerate(procs) if proc.wait() != 0]
    if failed:
        sys.exit(f"ranks {failed} failed; start the job again (with any world size) to finish it")
    print(json.dumps(flat_tokens.status(a.root, a.split)))


if __name__ == "__main__":
    main()
