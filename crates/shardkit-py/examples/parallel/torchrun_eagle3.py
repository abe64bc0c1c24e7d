"""Recipe: one EAGLE-3 offline cache precomputed by every rank of a ``torchrun`` job, as NeMo
Automodel's distributed producer does, but into one cache with one commit and an elastic resume.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:29500 \\
        torchrun_eagle3.py --cache /shared/eagle3-cache --n-samples 200000

Each rank writes the shards ``shardkit.part_of(n_shards, rank)`` (a contiguous, shard-aligned
block of samples) with ``eagle3.PartWriter``, which reads ``RANK``/``WORLD_SIZE``. Rank 0 writes
the target model's embedding table once. The rank that completes the set writes
``manifest.json``, last: until then no reader (NeMo's included) takes the directory for a
cache, and ``shardkit eagle3 status DIR`` shows what is done, claimed and missing. The result is
byte for byte what one process writes. After a failure, start the job again with any number of
ranks: each writes only the shards still missing from its new part.

The teacher outputs here are a stand-in computed from the sample index (any rank can compute any
sample, and the test compares with one process): put your target model's forward pass, with its
auxiliary hidden states, in ``teacher``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from shardkit import eagle3

SEQ, VOCAB, HIDDEN, AUX_LAYERS, SHARD = 16, 32, 8, (1, 3, 5), 10


def config(n_samples: int) -> Dict[str, Any]:
    """The run configuration every rank passes (and a restart must repeat)."""
    return {
        "target_model": "recipe", "target_vocab_size": VOCAB, "draft_vocab_size": VOCAB, "seq_length": SEQ,
        "dtype": "fp32", "num_samples": n_samples, "shard_size": SHARD, "aux_hidden_dim": len(AUX_LAYERS) * HIDDEN,
        "aux_layer_ids": list(AUX_LAYERS), "selected_token_ids": list(range(VOCAB)), "input_data": "recipe",
        "split": None, "shuffle_seed": 0,
    }


def embeddings() -> np.ndarray:
    """The target model's input embedding table (vocab, hidden)."""
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(-1 % 2**31)).numpy()


def teacher(first: int, end: int) -> Dict[str, np.ndarray]:
    """Samples ``first..end``: token ids, masks, the auxiliary hidden states and the target
    distribution. Your target model's forward pass goes here."""
    rows = []
    for i in range(first, end):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        aux = torch.randn(SEQ, len(AUX_LAYERS) * HIDDEN, generator=g)
        probs = torch.softmax(torch.randn(SEQ, VOCAB, generator=g), dim=-1)
        rows.append((ids, aux, probs))
    n = end - first
    return {
        "input_ids": torch.stack([r[0] for r in rows]).numpy().astype(np.int64),
        "attention_mask": np.ones((n, SEQ), dtype=np.int64),
        "loss_mask": np.ones((n, SEQ), dtype=np.int64),
        "aux_hidden_states": torch.stack([r[1] for r in rows]).numpy(),
        "position_mask": np.ones((n, SEQ, 1), dtype=bool),
        "target_probs": torch.stack([r[2] for r in rows]).numpy(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--n-samples", type=int, default=100)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    with eagle3.PartWriter(a.cache, config(a.n_samples), a.n_samples, target_embeddings=True,
                           progress=False) as w:
        if w.rank == 0:
            w.write_target_embeddings(embeddings())
        for first, end in w.pending:
            for at in range(first, end, a.batch):
                w.add_batch(teacher(at, min(at + a.batch, end)))
    status = w.close()
    if distributed:
        dist.barrier()  # every part durable, and the last rank has committed
        if dist.get_rank() == 0:
            print(json.dumps({"path": w.path, **eagle3.status(w.path)}))
        dist.destroy_process_group()
    else:
        print(json.dumps({"path": w.path, **status}))


if __name__ == "__main__":
    main()
