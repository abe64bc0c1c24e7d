"""A typed tour of the Python API: every format written, validated, read and streamed with the
same loader keywords, batches typed as ``shardkit.types`` TypedDicts.

Run it (``python tour.py``); CI also checks it with ``mypy --strict`` and runs it under pytest.
"""

import tempfile
from pathlib import Path
from typing import Dict, List

import numpy as np

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb
from shardkit.types import Eagle3Batch, LoaderState, SaevBatch, TokensBatch, Validation


def saev_tour(root: Path) -> None:
    metadata: Dict[str, object] = {
        "family": "clip", "ckpt": "tour", "layers": [0], "content_tokens_per_example": 8,
        "cls_token": False, "d_model": 16, "n_examples": 20, "max_tokens_per_shard": 64,
        "data": "gASV", "dataset": "tour", "protocol": "2.1",
    }
    with saev.Writer(root / "acts", metadata, progress=False) as w:
        w.write(np.random.default_rng(0).standard_normal((20, 1, 8, 16), dtype=np.float32))
    report: Validation = saev.validate(w.path)
    assert report["valid"], report["errors"]
    loader = saev.Loader(w.path, layer=0, batch_size=32, seed=1, rank=0, world_size=1)
    first: SaevBatch = next(iter(loader))
    state: LoaderState = loader.state_dict()
    print(f"saev: {len(loader)} batches of {first['act'].shape}, state {state['epoch']}/{state['batch']}")


def tokens_tour(root: Path) -> None:
    path = root / "tokens.zarr"
    with flat_tokens.Writer(path, "train", progress=False) as w:
        w.append([list(range(1, 2 + i % 50)) for i in range(200)])
    loader = flat_tokens.Loader(path, "train", seq_len=32, batch_size=8, seed=0, rank=0, world_size=1,
                                sequences_per_read_block=8, read_blocks_per_shuffle_buffer=4)
    batch: TokensBatch = loader.load(0)
    loader.set_epoch(0)
    print(f"flat-tokens: {len(loader)} steps, inputs {batch['inputs'].shape}")


def eagle3_tour(root: Path) -> None:
    seq, vocab = 4, 6
    manifest: Dict[str, object] = {
        "target_model": "tour", "target_vocab_size": 100, "draft_vocab_size": vocab, "seq_length": seq,
        "dtype": "bf16", "num_samples": 8, "shard_size": 4, "aux_hidden_dim": 6,
        "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(vocab)),
    }
    with eagle3.Writer(root / "cache", manifest) as w:
        for i in range(8):
            w.add({"input_ids": np.arange(seq) + i, "attention_mask": np.ones(seq, dtype=np.int64),
                   "loss_mask": np.ones(seq, dtype=np.int64),
                   "aux_hidden_states": np.full((seq, 6), i, dtype=np.float32),
                   "position_mask": np.ones((seq, 1), dtype=bool),
                   "target_probs": np.full((seq, vocab), 1 / vocab)})
    loader = eagle3.Loader(root / "cache", batch_size=4, shuffle=True, seed=0, rank=0, world_size=1)
    batch: Eagle3Batch = next(iter(loader))
    print(f"eagle3: {len(loader)} batches, input_ids {batch['input_ids'].shape}")


def sdnb_tour(root: Path) -> None:
    files: List[str] = sdnb.save(root / "model.sdnb", {"w": np.eye(4, dtype=np.float32)}, progress=False)
    with sdnb.open(files[0]) as model:
        print(f"sdnb: {sorted(model)}, w[0] = {model['w'][0]}")
    assert sdnb.validate(files[0], deep=True)["valid"]


def errors_tour(root: Path) -> None:
    try:
        saev.open(root / "absent")
    except shardkit.NotFoundError as e:  # also a FileNotFoundError and a ShardkitError
        print(f"errors: {type(e).__name__}: {e}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        saev_tour(root)
        tokens_tour(root)
        eagle3_tour(root)
        sdnb_tour(root)
        errors_tour(root)


if __name__ == "__main__":
    main()
