"""Small datasets of each format, and the arguments of a loader over each, shared by the loader
tests. Each ``*_data`` writes its dataset under ``tmp_path`` and returns ``(args, kwargs)`` of
its loader (the host loader and the shardkit.torch one take the same)."""

import numpy as np

from shardkit import eagle3, flat_tokens, saev


def saev_data(tmp_path):
    md = {
        "family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 16,
        "cls_token": False, "d_model": 64, "n_examples": 48, "max_tokens_per_shard": 128,
        "data": "gASV", "dataset": "t", "protocol": "2.1",
    }
    with saev.Writer(tmp_path / "saev", md, progress=False) as w:
        w.write(np.repeat(np.arange(48, dtype=np.float32), 16 * 64).reshape(48, 1, 16, 64))
    return (w.path,), dict(layer=0, batch_size=32, memory_budget=64 << 10, num_threads=2,
                           rank=0, world_size=1)


def tokens_data(tmp_path):
    with flat_tokens.Writer(tmp_path / "ds.zarr", "train", progress=False) as w:
        w.append([list(range(i + 1, i + 2 + (i * 37) % 300)) for i in range(64)])
    return (tmp_path / "ds.zarr",), dict(seq_len=16, batch_size=4, sequences_per_read_block=4,
                                         read_blocks_per_shuffle_buffer=2, num_threads=2)


def eagle3_data(tmp_path):
    vd, seq = 6, 4
    m = {"target_model": "t", "target_vocab_size": 100, "draft_vocab_size": vd, "seq_length": seq,
         "dtype": "bf16", "num_samples": 24, "shard_size": 4, "aux_hidden_dim": 6,
         "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(vd))}
    with eagle3.Writer(tmp_path / "c", m) as w:
        for i in range(24):
            w.add({"input_ids": np.arange(seq) + i, "attention_mask": np.ones(seq, dtype=np.int64),
                   "loss_mask": np.array([0, 1] * (seq // 2)),
                   "aux_hidden_states": np.full((seq, 6), i / 4, dtype=np.float32),
                   "position_mask": np.array([[False], [True]] * (seq // 2)),
                   "target_probs": np.full((seq, vd), 1 / vd, dtype=np.float64)})
    return (tmp_path / "c",), dict(batch_size=3, num_threads=2, rank=0, world_size=1)


DATA = {"saev": saev_data, "flat_tokens": tokens_data, "eagle3": eagle3_data}
HOST = {"saev": saev.Loader, "flat_tokens": flat_tokens.Loader, "eagle3": eagle3.Loader}


def host_loader(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    return HOST[which](*args, **kw)


LOADERS = {which: (lambda tmp_path, which=which: host_loader(which, tmp_path)) for which in DATA}
