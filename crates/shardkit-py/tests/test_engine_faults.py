"""A fault inside a loader's threads reaches Python as an exception, for each of the three
loaders: a panicking gather or prefetch thread, a thread that cannot start, a failing read.
Never a StopIteration that would end an epoch early."""

import json

import numpy as np
import pytest

from shardkit import _shardkit as _core
from shardkit import eagle3, flat_tokens, saev


@pytest.fixture(autouse=True)
def disarm():
    _core._clear_faults()
    yield
    _core._clear_faults()


def saev_loader(tmp_path):
    md = {
        "family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 16,
        "cls_token": False, "d_model": 64, "n_examples": 48, "max_tokens_per_shard": 128,
        "data": "gASV", "dataset": "t", "protocol": "2.1",
    }
    with saev.Writer(tmp_path / "saev", md, progress=False) as w:
        w.write(np.repeat(np.arange(48, dtype=np.float32), 16 * 64).reshape(48, 1, 16, 64))
    return saev.ShuffledLoader(w.path, layer=0, batch_size=32, memory_budget=64 << 10, num_threads=2,
                               rank=0, world_size=1)


def tokens_loader(tmp_path):
    with flat_tokens.Writer(tmp_path / "ds.zarr", "train", progress=False) as w:
        w.append([list(range(i + 1, i + 2 + (i * 37) % 300)) for i in range(64)])
    return flat_tokens.Loader(tmp_path / "ds.zarr", seq_len=16, batch_size=4,
                              sequences_per_read_block=4, read_blocks_per_shuffle_buffer=2,
                              num_threads=2)


def eagle3_loader(tmp_path):
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
    return eagle3.Loader(tmp_path / "c", 3, num_threads=2, rank=0, world_size=1)


LOADERS = {"saev": saev_loader, "flat_tokens": tokens_loader, "eagle3": eagle3_loader}


def run(loader):
    """(batches before the exception, the exception)."""
    n = 0
    it = iter(loader)
    try:
        for _ in it:
            n += 1
    except Exception as e:  # noqa: BLE001 - the test inspects whatever comes out
        return n, e
    return n, None


@pytest.mark.parametrize("which", list(LOADERS))
@pytest.mark.parametrize("fault,after,text,kind", [
    ("panic_in_gather", 3, "a gather thread panicked", ValueError),
    ("panic_in_prepare", 2, "the prefetch thread panicked", ValueError),
    ("spawn_fails", 0, "cannot start", ValueError),
    ("read_fails", 2, "Input/output error", OSError),
])
def test_a_fault_is_an_exception(tmp_path, which, fault, after, text, kind):
    loader = LOADERS[which](tmp_path)
    full = len(loader)
    assert run(loader) == (full, None)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    if hasattr(loader, "step"):
        loader.step = 0
    if fault == "spawn_fails":
        after = 1  # the loader's gather pool runs already: its next pass's threads fail
    _core._inject_fault(fault, after)
    n, e = run(loader)
    assert isinstance(e, kind), f"{which}: {e!r}"
    assert text in str(e), f"{which}: {e}"
    assert n < full
