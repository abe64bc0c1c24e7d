"""The baseline of `shardkit bench tokens`: the same packed batches read with zarr-python + numpy.

Usage: python scripts/bench_tokens_zarr.py DATASET SPLIT ROWS.npy SEQ_LEN

ROWS.npy holds int64 (steps, batch) packed-row indices (the steps shardkit timed). Each step is
read the way a Python loader over zarr would: one slice of ``encoded_tokens`` per row, stacked,
then decoded with numpy into the arrays shardkit's loader returns (inputs, targets, segment_ids,
is_seq_start). Two ways of reading are timed and both reported; the faster is the baseline:
``per_row`` (a slice per row) and ``coords`` (one orthogonal selection of every position).
Prints one JSON object on stdout; each way reports ``targets_sha256``, the SHA-256 of every
step's targets (int32, little-endian, step after step), which shardkit compares with its own
loader's (hashing time is left out of ``seconds``).
"""

import hashlib
import json
import sys
import time

import numpy as np
import zarr


def decode(enc):
    targets = (enc >> 1).astype(np.int32)
    is_seq_start = (enc & 1).astype(bool)
    inputs = np.zeros_like(targets)
    inputs[:, 1:] = targets[:, :-1]
    inputs[is_seq_start] = 0
    segment_ids = np.cumsum(is_seq_start, axis=1, dtype=np.int32)
    return inputs, targets, segment_ids, is_seq_start


def per_row(tokens, rows, seq_len):
    return np.stack([tokens[r * seq_len : (r + 1) * seq_len] for r in rows])


def coords(tokens, rows, seq_len):
    idx = (rows[:, None] * seq_len + np.arange(seq_len)[None, :]).ravel()
    return tokens.oindex[idx].reshape(len(rows), seq_len)


def main():
    path, split, rows_path, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    steps = np.load(rows_path)
    out = {"zarr_version": zarr.__version__, "steps": int(steps.shape[0]),
           "batch": int(steps.shape[1]), "seq_len": seq_len}
    for name, read in [("per_row", per_row), ("coords", coords)]:
        t0 = time.perf_counter()
        tokens = zarr.open_group(path, mode="r")[split]["encoded_tokens"]
        digest, hashing = hashlib.sha256(), 0.0
        for rows in steps:
            inputs, targets, segment_ids, is_seq_start = decode(read(tokens, rows, seq_len))
            h0 = time.perf_counter()
            digest.update(np.ascontiguousarray(targets, dtype="<i4").tobytes())
            hashing += time.perf_counter() - h0
        secs = time.perf_counter() - t0 - hashing
        out[name] = {"seconds": secs, "tokens_per_s": steps.size * seq_len / secs,
                     "hash_seconds": hashing, "targets_sha256": digest.hexdigest()}
    best = max(("per_row", "coords"), key=lambda k: out[k]["tokens_per_s"])
    out["best"] = best
    out["tokens_per_s"] = out[best]["tokens_per_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
