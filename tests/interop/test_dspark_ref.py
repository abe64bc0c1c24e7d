"""The DSpark restatement (dspark_ref.py) against what NeMo's sources state, without shardkit:
the shard partition, the manifest bytes and identity rules, the completeness marker, the
reader's refusals, and the distributed producer (interrupted, rerun, and refusing another
configuration). If these fail, the interop tests compare shardkit with the wrong thing."""

import json
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspark_data as D  # noqa: E402
import dspark_ref as ref  # noqa: E402


def snapshot(root):
    return {p.name: p.read_bytes() for p in sorted(Path(root).iterdir())}


def test_partition_examples_from_nemos_docstring():
    # 10 samples in shards of 3: 4 shards; 3 ranks get 2, 1, 1 shards; the last is short.
    assert [ref.partition_cache_shards(10, 3, 3, r) for r in range(3)] == [(0, 0, 6), (2, 6, 3), (3, 9, 1)]
    # Fewer shards than ranks: the ranks past them get nothing, starting at the end.
    assert [ref.partition_cache_shards(5, 2, 5, r) for r in range(5)] == [
        (0, 0, 2), (1, 2, 2), (2, 4, 1), (3, 6, 0), (3, 6, 0)]
    assert [ref.partition_cache_shards(0, 4, 2, r) for r in range(2)] == [(0, 0, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        ref.partition_cache_shards(4, 2, 0, 0)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, 2\)"):
        ref.partition_cache_shards(4, 2, 2, 2)


def test_partition_blocks_tile_the_shards_in_order():
    for n in range(0, 40, 3):
        for s in (1, 2, 5, 8):
            total = -(-n // s)
            for w in range(1, 7):
                parts = [ref.partition_cache_shards(n, s, w, r) for r in range(w)]
                covered = []
                for start, first, count in parts:
                    assert first == start * s
                    covered += list(range(first, first + count))
                    assert count == 0 or first + count == n or count % s == 0
                assert covered == list(range(n)), (n, s, w)
                sizes = [-(-c // s) for _, _, c in parts]
                assert sum(sizes) == total and sizes == sorted(sizes, reverse=True)
                assert max(sizes) - min(sizes) <= 1


def test_manifest_bytes_and_identity():
    m = D.manifest(5, 2)
    text = ref.manifest_text({**m, "complete": True})
    assert text.startswith('{\n  "chat_template_sha256": ') and not text.endswith("\n")
    assert '"format_version": 1' in text and "Mod\\u00e8l-1B" in text
    assert list(json.loads(text)) == sorted(json.loads(text))
    assert m["target_hidden_dim"] == 6 and m["target_last_hidden_dim"] == 3 and m["train_split"] is None
    # format_version and complete never count; a key on one side only does (as None elsewhere).
    assert ref.manifest_mismatch_fields({**m, "format_version": 1, "complete": False}, {**m, "complete": True}) == []
    other = {**m, "train_split": "train", "shuffle_seed": 7, "extra": None}
    assert ref.manifest_mismatch_fields(m, other) == ["shuffle_seed", "train_split"]
    assert ref.manifest_mismatch_fields(m, {k: v for k, v in m.items() if k != "dtype"}) == ["dtype"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_producer_writes_what_the_reader_reads(tmp_path, dtype):
    m = D.manifest(7, 3, dtype=dtype)
    x, w = D.samples(m, 1), D.weights(m)
    out = ref.precompute_distributed(tmp_path / "c", m, x, 2, w, batch_size=3)
    assert out == {"complete": True, "written": {0: [0, 1], 1: [2]}}
    assert sorted(os.listdir(tmp_path / "c")) == [
        "manifest.json", "shard-000000.safetensors", "shard-000001.safetensors", "shard-000002.safetensors",
        "target_weights.safetensors"]
    assert (tmp_path / "c" / "manifest.json").read_text() == ref.manifest_text({**m, "complete": True})
    ds = ref.CachedDSparkDataset(str(tmp_path / "c"))
    want = D.cast(m, x)
    assert len(ds) == 7
    for i in [0, 3, 6, -1]:
        got = ds[i]
        assert list(got) == list(ref.CACHE_KEYS)
        for k in ref.CACHE_KEYS:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k].view(np.uint8), want[k][i].view(np.uint8)), k
    with pytest.raises(IndexError):
        ds[7]
    with safe_open(str(tmp_path / "c" / "shard-000002.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == sorted(ref.CACHE_KEYS) and f.metadata() is None
        assert f.get_slice("input_ids").get_shape() == [1, 4]
    e, h = ref.read_target_weights(str(tmp_path / "c"))
    assert e.dtype == ref.DTYPES[dtype] and e.shape == (50, 3)
    assert np.array_equal(e.view(np.uint8), w[0].astype(ref.DTYPES[dtype]).view(np.uint8))
    assert np.array_equal(h.view(np.uint8), w[1].astype(ref.DTYPES[dtype]).view(np.uint8))
    b = ref.collate([ds[0], ds[1]])
    assert b["target_hidden_states"].shape == (2, 4, 6)


def test_bf16_casts_round_to_nearest_even_as_torch_does():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-8, 3.3895e38], dtype=np.float32)
    bits = ref.compute_batch_cache({"input_ids": [0], "loss_mask": [1], "target_hidden_states": x,
                                    "target_last_hidden_states": x}, "bf16")["target_hidden_states"].view(np.uint16)
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0xB2D7, 0x7F7F]
    assert ml_dtypes.bfloat16 is ref.DTYPES["bf16"]


def test_an_interrupted_run_is_refused_and_a_rerun_finishes_it_byte_identically(tmp_path):
    m = D.manifest(10, 2, dtype="fp16")
    x, w = D.samples(m, 2), D.weights(m)
    whole = tmp_path / "whole"
    ref.precompute_distributed(whole, m, x, 3, w)
    cut = tmp_path / "cut"
    out = ref.precompute_distributed(cut, m, x, 3, w, stop_after={0: 1, 2: 0}, torn=True)
    assert out == {"complete": False, "written": {0: [0], 1: [2, 3], 2: []}}
    assert sorted(os.listdir(cut)) == ["manifest.json", "shard-000000.safetensors", "shard-000001.safetensors.tmp",
                                       "shard-000002.safetensors", "shard-000003.safetensors",
                                       "shard-000004.safetensors.tmp", "target_weights.safetensors"]
    assert json.loads((cut / "manifest.json").read_text())["complete"] is False
    # The reader checks the shard set first, then the marker.
    with pytest.raises(ValueError, match=r"declares 10 samples \(5 shards\) but found shard indices \[0, 2, 3\]"):
        ref.CachedDSparkDataset(str(cut))
    for k in (1, 4):
        (cut / f"shard-{k:06d}.safetensors").write_bytes((whole / f"shard-{k:06d}.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is marked incomplete"):
        ref.CachedDSparkDataset(str(cut))
    assert ref.read_manifest(str(cut), allow_incomplete=True)["complete"] is False
    # NeMo's rerun (same configuration, another world size) recomputes every shard; the torn
    # temporaries are overwritten by the shards' own writes.
    ref.precompute_distributed(cut, m, x, 2, w)
    assert snapshot(cut) == snapshot(whole)
    assert len(ref.CachedDSparkDataset(str(cut))) == 10


def test_rerun_with_another_configuration_is_refused_before_anything_is_written(tmp_path):
    m = D.manifest(4, 2)
    x, w = D.samples(m), D.weights(m)
    ref.precompute_distributed(tmp_path, m, x, 1, w, stop_after=1)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    other = {**m, "shuffle_seed": 1, "chat_template_sha256": ref.chat_template_sha256("x")}
    with pytest.raises(ValueError, match=r"mismatched fields: \['chat_template_sha256', 'shuffle_seed'\]"):
        ref.precompute_distributed(tmp_path, other, x, 1, w)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == before


def test_reader_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="DSpark cache manifest not found at .*Was the cache fully written"):
        ref.CachedDSparkDataset(str(tmp_path))
    m = D.manifest(2, 2)
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format_version": 2}))
    with pytest.raises(ValueError, match="has format_version=2, expected 1. Regenerate the cache with the current precompute_dspark"):
        ref.CachedDSparkDataset(str(tmp_path))
    # Older NeMo: no marker, accepted; anything but true refused.
    ref.write_manifest(str(tmp_path), m)
    ref.write_shard(str(tmp_path), 0, D.cast(m, D.samples(m)))
    assert len(ref.CachedDSparkDataset(str(tmp_path))) == 2
    for marker in (False, 1, "true", None):
        ref.write_manifest(str(tmp_path), {**m, "complete": marker})
        with pytest.raises(ValueError, match="marked incomplete"):
            ref.CachedDSparkDataset(str(tmp_path))
    with pytest.raises(ValueError, match=r"missing required DSpark cache fields: \['loss_mask'\]"):
        ref.write_shard(str(tmp_path), 1, {k: v for k, v in D.cast(m, D.samples(m)).items() if k != "loss_mask"})
    with pytest.raises(FileNotFoundError, match="target_weights.safetensors not found"):
        ref.read_target_weights(str(tmp_path))
