"""A recording process of the producer tests: records a tiny seeded ViT's activations over 23
seeded images into ROOT with the launcher's RANK/WORLD_SIZE, printing `batch K` after each
forward (a kill point) and `status ...` at the end."""

import json
import sys

import torch
from transformers import ViTConfig, ViTModel

from shardkit.record import ActivationRecorder

N = 23


def model() -> ViTModel:
    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
                    image_size=16, patch_size=8)
    return ViTModel(cfg).eval()


def images() -> torch.Tensor:
    return torch.randn(N, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def metadata() -> dict:
    # 3 examples a shard (5 tokens x 2 layers x 3 = 30): 8 shards, the last short.
    return {"family": "clip", "ckpt": "tiny-vit", "max_tokens_per_shard": 30, "data": "seeded", "dataset": "mem"}


def record(root: str, batch: int = 2) -> dict:
    m, x = model(), images()
    with ActivationRecorder(m, root, layers=[2, 0], n_examples=N, metadata=metadata(), buffers=2) as rec:
        k = 0
        for first, end in rec.batches(batch):
            rec(x[first:end])
            k += 1
            print(f"batch {k}", flush=True)
    return rec.close()


if __name__ == "__main__":
    print("status " + json.dumps(record(sys.argv[1])), flush=True)
