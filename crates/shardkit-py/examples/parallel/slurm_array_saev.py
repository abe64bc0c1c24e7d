"""Recipe: one saev dataset written by the tasks of a Slurm job array (or any batch of
independent processes: Ray tasks, a shell loop).

    sbatch --array=0-63 --wrap "python slurm_array_saev.py --root /shared/acts --n-examples 1000000"

Each task is one part: ``saev.PartWriter`` reads ``SLURM_ARRAY_TASK_ID`` and
``SLURM_ARRAY_TASK_COUNT`` (or ``RANK``/``WORLD_SIZE``; pass ``rank=``/``world_size=`` under
Ray). Tasks run whenever the scheduler starts them, in any order and any number at once; the
task that completes the set commits it. Resubmit failed tasks (or the whole array, with any
size): they write only what is still missing. ``shardkit saev status DIR`` shows what is done,
claimed and missing at any time.

The activations are a stand-in computed from the example index, as in torchrun_saev.py.
"""

from __future__ import annotations

import argparse
import json

from torchrun_saev import activations, metadata  # the same stand-in data and metadata

from shardkit import saev


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--n-examples", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    with saev.PartWriter(a.root, metadata(a.n_examples), progress=False) as w:
        for first, end in w.pending:
            for at in range(first, end, a.batch):
                w.write(activations(at, min(at + a.batch, end)))
    print(json.dumps({"path": w.path, "rank": w.rank, **w.close()}))


if __name__ == "__main__":
    main()
