"""Shuffle quality of a follow-mode saev loader against how much is written when it starts.

A dataset of 64 shards (8 examples of 4 content tokens each: 32 rows a shard) is written by one
PartWriter in this process. The loader (block order, default memory budget, batch 64) starts when
`k` shards are durable; afterwards the writer adds one shard whenever the loader has served
everything durable (a consumer faster than its producer: every later round is one shard). Printed
per `k`: the rounds of epoch 0, and the mean distinct examples and shards per batch in epoch 0
and in epoch 1 (after the commit: the finished dataset's order).

    python scripts/follow_quality.py
"""

import sys
import tempfile

import numpy as np

from shardkit import saev

SHARDS, EPS, TOKENS, D = 64, 8, 4, 8
META = {
    "family": "clip", "ckpt": "q", "layers": [0], "content_tokens_per_example": TOKENS, "cls_token": True,
    "d_model": D, "n_examples": SHARDS * EPS, "max_tokens_per_shard": EPS * (TOKENS + 1),
    "data": "q", "dataset": "q", "protocol": "2.1",
}
BATCH = 64


def mixing(batches):
    ex = [len(set(b.tolist())) for b in batches]
    sh = [len(set((b // EPS).tolist())) for b in batches]
    return float(np.mean(ex)), float(np.mean(sh))


def run(k, root):
    w = saev.PartWriter(root, META, rank=0, world_size=1, progress=False)
    written = 0

    def write_shard():
        nonlocal written
        first = written * EPS
        w.write(np.zeros((EPS, 1, TOKENS + 1, D), dtype=np.float32) + first)
        written += 1

    for _ in range(k):
        write_shard()
    loader = saev.Loader(w.path, layer=0, batch_size=BATCH, seed=1, follow=True)
    it = iter(loader)
    epoch0 = []
    while True:
        if loader.state_dict()["cursor"] == written * EPS * TOKENS and written < SHARDS:
            write_shard()  # the loader has served all that is durable: one more shard lands
        try:
            epoch0.append(next(it)["example_idx"])
        except StopIteration:
            break
    rounds = loader.state_dict()["follow_rounds"]
    n_rounds, i = 0, 0
    while i < len(rounds):
        i, n_rounds = i + 1 + 2 * rounds[i], n_rounds + 1
    w.close()
    loader.set_epoch(1)
    epoch1 = [b["example_idx"] for b in loader]
    return n_rounds, mixing(epoch0), mixing(epoch1)


def main():
    print("| shards durable at start | rounds in epoch 0 | epoch 0: examples / shards per batch | epoch 1: examples / shards per batch |")
    print("|---|---|---|---|")
    for k in [1, 8, 32, 64]:
        with tempfile.TemporaryDirectory() as root:
            n, (e0, s0), (e1, s1) = run(k, root)
        print(f"| {k} of {SHARDS} | {n} | {e0:.1f} / {s0:.1f} | {e1:.1f} / {s1:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
