"""shardkit.eagle3: the Python API (writer, mapped reader, loader, validation) over the Rust core."""

import json
import multiprocessing
import pickle

import numpy as np
import pytest

import shardkit
from shardkit import CorruptDataError, IncompleteDatasetError, _offline, eagle3

import ml_dtypes  # noqa: E402 - a required test dependency


def config(n=5, s=2, seq=4, hidden=2, vd=6, dtype="bf16", topk=None):
    m = {
        "target_model": "t", "target_vocab_size": 100, "draft_vocab_size": vd, "seq_length": seq,
        "dtype": dtype, "num_samples": n, "shard_size": s, "aux_hidden_dim": 3 * hidden,
        "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(vd))[::-1],
    }
    if topk is not None:
        m["target_probs_topk"] = topk
    return m


def sample(i, seq=4, hidden=2, vd=6):
    return {
        "input_ids": np.arange(seq) + i,
        "attention_mask": np.ones(seq, dtype=np.int64),
        "loss_mask": np.array([0, 1] * (seq // 2)),
        "aux_hidden_states": np.full((seq, 3 * hidden), i / 4, dtype=np.float32),
        "position_mask": np.array([[False], [True]] * (seq // 2)),
        "target_probs": np.full((seq, vd), 1 / vd, dtype=np.float64),
    }


def write(path, n=5, **kw):
    with eagle3.Writer(path, config(n=n, **kw)) as w:
        for i in range(n):
            w.add(sample(i))
    return path


def test_write_read_and_coercions(tmp_path):
    path = write(tmp_path / "c")
    cache = eagle3.open(path)
    assert len(cache) == 5 and cache.manifest["format_version"] == 1
    item = cache[3]
    assert list(item) == list(eagle3.ITEM_FIELDS)
    assert item["input_ids"].dtype == np.int64 and item["input_ids"].tolist() == [3, 4, 5, 6]
    assert item["aux_hidden_states"].dtype == ml_dtypes.bfloat16
    assert float(item["aux_hidden_states"][0, 0]) == 0.75
    assert item["target_probs"].shape == (4, 6)
    assert item["position_mask"].dtype == np.bool_ and item["position_mask"].shape == (4, 1)
    assert not item["aux_hidden_states"].flags.writeable, "a view of the shard's read-only map"
    assert cache[-1]["input_ids"][0] == 4
    assert [it["input_ids"][0] for it in cache[1:4]] == [1, 2, 3]
    for bad, words in ((5, "sample 5 is past the end: there are 5 samples"),
                       (-6, "sample -6 is before the start: there are 5 samples")):
        with pytest.raises(shardkit.OutOfRangeError, match=words):
            cache[bad]
    batch = eagle3.collate([cache[0], cache[1]])
    assert batch["aux_hidden_states"].shape == (2, 4, 6)


def test_writer_refusals(tmp_path):
    w = eagle3.Writer(tmp_path / "c", config(n=3))
    with pytest.raises(shardkit.InvalidArgumentError, match="missing"):
        w.add({"input_ids": np.zeros(4)})
    with pytest.raises(shardkit.InvalidArgumentError, match="not tensors of this cache"):
        w.add({**sample(0), "extra": np.zeros(1)})
    with pytest.raises(shardkit.InvalidArgumentError, match="shape"):
        w.add({**sample(0), "input_ids": np.zeros(5, dtype=np.int64)})
    with pytest.raises(shardkit.InvalidArgumentTypeError, match="`aux_hidden_states` must hold floats"):
        w.add({**sample(0), "aux_hidden_states": np.zeros((4, 6), dtype=np.int64)})
    with pytest.raises(shardkit.InvalidArgumentError, match=r"refused `position_mask` at sample 0, position 0: 2 "):
        w.add({**sample(0), "position_mask": np.full((4, 1), 2)})
    w.add(sample(0))
    with pytest.raises(IncompleteDatasetError, match="continues at sample 0"):
        w.close()
    with pytest.raises(shardkit.InvalidArgumentError, match="top-k"):
        eagle3.Writer(tmp_path / "k", config(topk=2), format_version=1)


def test_resume_after_an_exception(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(RuntimeError, match="^the job died$"):
        with eagle3.Writer(path, config(n=5)) as w:
            for i in range(3):
                w.add(sample(i))
            raise RuntimeError("the job died")
    with pytest.raises(IncompleteDatasetError, match="samples 2 to 4 are missing"):
        eagle3.open(path)
    with pytest.raises(shardkit.AlreadyExistsError, match="already has shards"):
        eagle3.Writer(path, config(n=5))
    with pytest.raises(shardkit.AlreadyExistsError, match="seq_length"):
        eagle3.Writer(path, config(n=5, seq=6), resume=True)
    with eagle3.Writer(path, config(n=5), resume=True) as w:
        assert w.next_sample == 2 and w.resumed_from == 2
        for i in range(w.next_sample, 5):
            w.add(sample(i))
    assert [it["input_ids"][0] for it in eagle3.open(path)] == [0, 1, 2, 3, 4]


def test_bf16_without_ml_dtypes_is_uint16_bits(tmp_path, monkeypatch):
    path = write(tmp_path / "c")
    want = eagle3.open(path)[2]["aux_hidden_states"].view(np.uint16)
    monkeypatch.setattr(_offline, "_BF16", None)  # where EAGLE-3 and DSpark decode bf16
    got = eagle3.open(path)[2]["aux_hidden_states"]
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    # The writer's own rounding equals ml_dtypes' (round to nearest even).
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-8, np.inf, 3.4e38], dtype=np.float32)
    assert np.array_equal(_offline._bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def _read_in_worker(cache):
    return cache[1]["input_ids"].tolist()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_cache_pickles_into_worker_processes(tmp_path, method):
    cache = eagle3.open(write(tmp_path / "c"))
    cache[0]  # the parent maps a shard first, as NeMo's reader would have
    clone = pickle.loads(pickle.dumps(cache))
    assert clone[4]["input_ids"][0] == 4
    with multiprocessing.get_context(method).Pool(1) as pool:
        assert pool.apply(_read_in_worker, (cache,)) == [1, 2, 3, 4]


def test_loader_ranks_epochs_and_state(tmp_path):
    path = write(tmp_path / "c", n=5)
    seen = []
    for rank in range(2):
        loader = eagle3.Loader(path, batch_size=2, seed=3, rank=rank, world_size=2)
        assert len(loader) == 2 and len(loader.indices()) == 3
        batches = list(loader)
        assert [b["input_ids"].shape[0] for b in batches] == [2, 1]
        assert batches[0]["aux_hidden_states"].flags.writeable, "batches belong to the caller"
        seen += [int(x) for b in batches for x in b["input_ids"][:, 0]]
    assert len(set(seen)) == 5 and len(seen) == 6, "padded by wrapping around"
    loader = eagle3.Loader(path, batch_size=2, seed=3, rank=0, world_size=1)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    assert state["batch"] == 1
    rest = [b["input_ids"][:, 0].tolist() for b in it]
    with pytest.raises(shardkit.InvalidArgumentError, match="seed: state 3, this loader 0"):
        eagle3.Loader(path, batch_size=2, seed=0, rank=0, world_size=1).load_state_dict(state)
    again = eagle3.Loader(path, batch_size=2, seed=3, rank=0, world_size=1)
    again.load_state_dict(state)
    assert [b["input_ids"][:, 0].tolist() for b in again] == rest
    assert len(list(loader)) == 3, "a finished epoch starts over"
    loader.set_epoch(1)
    assert loader.indices() != eagle3.Loader(path, batch_size=2, seed=3, rank=0, world_size=1).indices()
    assert first["target_probs"].shape == (2, 4, 6)
    dropped = eagle3.Loader(path, batch_size=2, rank=1, world_size=2, drop_last=True)
    assert len(dropped.indices()) == 2 and len(dropped) == 1


def test_validate_inspect_and_versions(tmp_path):
    path = write(tmp_path / "c", dtype="fp16")
    assert eagle3.validate(path, deep=True)["valid"]
    info = eagle3.inspect(path)
    assert info["complete"] and info["dtype"] == "fp16" and info["target_probs"] == "lossless"
    shard = (path / "shard-000000.safetensors").read_bytes()
    m = eagle3.set_version(path, 2)
    assert m["format_version"] == 2 and m["target_probs_topk"] == 0
    assert (path / "shard-000000.safetensors").read_bytes() == shard
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 2
    with pytest.raises(shardkit.InvalidArgumentError, match="format_version 3"):
        eagle3.set_version(path, 3)
    (path / "shard-000001.safetensors").write_bytes(b"\x00" * 7)
    report = eagle3.validate(path)
    assert not report["valid"] and "truncated: 7 of at least 8 bytes" in report["errors"][0]["message"]
    assert report["errors"][0]["file"] == str(path / "shard-000001.safetensors")
    with pytest.raises(CorruptDataError, match="truncated: 7 of at least 8 bytes"):
        eagle3.open(path)[2]
