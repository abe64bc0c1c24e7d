"""The baseline of `shardkit bench eagle3`: a reader built the way NeMo Automodel's
CachedEagle3Dataset is (safe_open handles kept per shard, one get_slice(key)[row] per field per
item, the batch stacked with numpy), reading the same samples in the same order as shardkit.

Usage: python scripts/bench_eagle3_nemo.py CACHE_DIR ORDER.npy BATCH_SIZE
ORDER.npy: int64 sample indices. Prints one JSON object on stdout, with ``batches_sha256``: the
SHA-256 of every batch's stacked fields in FIELDS order, batch after batch, which shardkit
compares with its own loader's (hashing time is left out of ``seconds``).
"""

import hashlib
import json
import sys
import time

import ml_dtypes  # noqa: F401  (safe_open needs it for bf16)
import numpy as np
from safetensors import safe_open

FIELDS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs")


def main():
    cache_dir, order_path, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    order = np.load(order_path)
    t0 = time.perf_counter()
    with open(f"{cache_dir}/manifest.json") as f:
        manifest = json.load(f)
    s = manifest["shard_size"]
    handles = {}
    nbytes = 0
    digest, hashing = hashlib.sha256(), 0.0
    for b in range(0, len(order), batch_size):
        items = []
        for i in order[b : b + batch_size]:
            k = int(i) // s
            if k not in handles:
                handles[k] = safe_open(f"{cache_dir}/shard-{k:06d}.safetensors", framework="np")
            h = handles[k]
            items.append({key: h.get_slice(key)[int(i) % s] for key in FIELDS})
        batch = {key: np.stack([it[key] for it in items]) for key in FIELDS}
        nbytes += sum(a.nbytes for a in batch.values())
        h0 = time.perf_counter()
        for key in FIELDS:
            digest.update(np.ascontiguousarray(batch[key]).tobytes())
        hashing += time.perf_counter() - h0
    secs = time.perf_counter() - t0 - hashing
    print(json.dumps({"samples": int(len(order)), "seconds": secs, "samples_per_s": len(order) / secs,
                      "bytes_per_s": nbytes / secs, "hash_seconds": hashing,
                      "batches_sha256": digest.hexdigest()}))


if __name__ == "__main__":
    main()
