"""Recipe: one saev dataset recorded by every rank of a ``torchrun`` job.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-endpoint HOST:29500 \\
        torchrun_saev.py --root /shared/acts --n-examples 1000000

Each rank writes its own part of the one dataset (``saev.PartWriter`` reads ``RANK`` and
``WORLD_SIZE`` from the environment torchrun sets): the shards
``shardkit.part_of(n_shards, rank)``, a contiguous block of examples. Whichever rank finishes
last commits the dataset, and the result is byte for byte what one process would write. The
ranks coordinate through the directory only, so ``--root`` must be one file system every node
sees. A killed job is started again the same way, with any number of ranks: each rank writes
only what is still missing from its new part.

The process group is joined only to report once at the end (any backend works: gloo here, so
the recipe runs on CPU too); the write itself needs no collective.

The activations here are a stand-in computed from the example index (so that any rank can
compute any example, and the test can compare with one process): put your model's forward
pass in ``activations``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from shardkit import saev

LAYERS, TOKENS, D_MODEL = 2, 5, 16


def metadata(n_examples: int) -> Dict[str, Any]:
    return {
        "family": "clip", "ckpt": "recipe", "layers": [6, 11], "content_tokens_per_example": TOKENS - 1,
        "cls_token": True, "d_model": D_MODEL, "n_examples": n_examples, "max_tokens_per_shard": 7 * TOKENS,
        "data": "recipe", "dataset": "recipe", "protocol": "2.1",
    }


def activations(first: int, end: int) -> np.ndarray:
    """Examples ``first..end`` (b, layers, tokens, d_model): your model's forward pass goes here."""
    out = [torch.randn(LAYERS, TOKENS, D_MODEL, generator=torch.Generator().manual_seed(e)) for e in range(first, end)]
    return torch.stack(out).numpy()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--n-examples", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    distributed = "RANK" in __import__("os").environ
    if distributed:
        dist.init_process_group("gloo")
    with saev.PartWriter(a.root, metadata(a.n_examples), progress=False) as w:
        for first, end in w.pending:
            for at in range(first, end, a.batch):
                w.write(activations(at, min(at + a.batch, end)))
    status = w.close()
    if distributed:
        dist.barrier()  # every part durable, and the last rank has committed
        if dist.get_rank() == 0:
            print(json.dumps({"path": w.path, **saev.status(w.path)}))
        dist.destroy_process_group()
    else:
        print(json.dumps({"path": w.path, **status}))


if __name__ == "__main__":
    main()
