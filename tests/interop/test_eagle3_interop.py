"""EAGLE-3 interop with Python safetensors 0.8.0 (the reference writer's library), numpy and
ml_dtypes: shard bytes identical to ``safetensors.numpy.save_file``, caches written the way
NeMo's producer writes them read correctly, and ours read back the way NeMo's reader does."""

import json
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from shardkit import eagle3

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}


def config(n, s, seq=4, hidden=2, vd=6, dtype="bf16", topk=None):
    m = {
        "target_model": "org/Modèl-1B", "target_vocab_size": 50, "draft_vocab_size": vd,
        "seq_length": seq, "dtype": dtype, "num_samples": n, "shard_size": s,
        "aux_hidden_dim": 3 * hidden, "aux_layer_ids": [1, 3, 4],
        "selected_token_ids": [(j * 7 + 3) % 50 for j in range(vd)][::-1],
        "input_data": "data.jsonl", "split": None, "shuffle_seed": 42,
    }
    if topk is not None:
        m["target_probs_topk"] = topk
    return m


def samples(m, rng):
    """One dict of arrays per sample, in the cache dtype, valid values."""
    n, S, A, vd = m["num_samples"], m["seq_length"], m["aux_hidden_dim"], m["draft_vocab_size"]
    dt = DTYPES[m["dtype"]]
    k = m.get("target_probs_topk") or 0
    out = []
    for _ in range(n):
        loss = rng.integers(0, 2, S).astype(np.int64)
        probs = rng.random((S, vd)).astype(np.float32)
        probs /= probs.sum(-1, keepdims=True)
        s = {
            "input_ids": rng.integers(0, 50, S).astype(np.int64),
            "attention_mask": np.ones(S, dtype=np.int64),
            "loss_mask": loss,
            "aux_hidden_states": rng.standard_normal((S, A)).astype(np.float32).astype(dt),
            "position_mask": ((rng.random(S) < 0.5) & (loss == 1))[:, None],
        }
        if 0 < k < vd:
            idx = np.argsort(-probs, axis=-1)[:, :k].astype(np.int32)
            s["target_probs_values"] = np.take_along_axis(probs, idx, -1).astype(dt)
            s["target_probs_indices"] = idx
        else:
            s["target_probs"] = probs.astype(dt)
        out.append(s)
    return out


def write_like_nemo(path, m, items, version):
    """NeMo's producer: manifest via json.dump(indent=2, sort_keys=True) first, then each shard
    with safetensors.numpy.save_file, the last one partial."""
    path.mkdir()
    with open(path / "manifest.json", "w") as f:
        json.dump({"format_version": version, **m}, f, indent=2, sort_keys=True)
    s = m["shard_size"]
    for k in range(0, len(items), s):
        chunk = items[k : k + s]
        save_file({key: np.stack([it[key] for it in chunk]) for key in chunk[0]},
                  str(path / f"shard-{k // s:06d}.safetensors"))


def nemo_manifest(m, version):
    m = {kk: v for kk, v in m.items() if kk != "format_version"}
    if version == 2:
        m.setdefault("target_probs_topk", 0)
    else:
        m.pop("target_probs_topk", None)
    return json.dumps({"format_version": version, **m}, indent=2, sort_keys=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("topk", [None, 2])
def test_our_shards_equal_python_save_file_byte_for_byte(tmp_path, dtype, topk):
    version = 2 if topk else 1
    m = config(5, 2, dtype=dtype, topk=topk)
    items = samples(m, np.random.default_rng(1))
    ref = tmp_path / "python"
    write_like_nemo(ref, m, items, version)
    ours = tmp_path / "ours"
    with eagle3.Writer(ours, m, format_version=version) as w:
        w.add_batch({k: np.stack([it[k] for it in items[:3]]) for k in items[0]})
        for it in items[3:]:
            w.add(it)
    shards = sorted(p.name for p in ref.glob("shard-*"))
    assert shards == ["shard-000000.safetensors", "shard-000001.safetensors", "shard-000002.safetensors"]
    for name in shards:
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name
    # The manifest: Python's json.dump bytes (sorted, 2-space, ASCII-escaped, no newline).
    assert (ours / "manifest.json").read_text() == nemo_manifest(m, version)
    assert "Mod\\u00e8l" in (ours / "manifest.json").read_text()
    assert not (ours / "manifest.json").read_bytes().endswith(b"\n")


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("topk", [None, 3])
def test_python_written_caches_read_correctly(tmp_path, dtype, topk):
    m = config(7, 3, seq=5, hidden=3, vd=8, dtype=dtype, topk=topk)
    items = samples(m, np.random.default_rng(2))
    path = tmp_path / "nemo"
    write_like_nemo(path, m, items, 2)
    cache = eagle3.open(path)
    assert len(cache) == 7
    for i in [0, 3, 6, -1]:
        got, want = cache[i], items[i]
        assert list(got) == list(eagle3.ITEM_FIELDS)
        for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask"):
            assert got[k].dtype == want[k].dtype, k
            assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k
        if topk:
            full = np.zeros((5, 8), dtype=DTYPES[dtype])
            np.put_along_axis(full, want["target_probs_indices"].astype(np.int64), want["target_probs_values"], -1)
        else:
            full = want["target_probs"]
        assert got["target_probs"].dtype == full.dtype
        assert np.array_equal(got["target_probs"].view(np.uint8), full.view(np.uint8))
    # The last shard holds one sample; batches of the loader equal collated items.
    assert cache[6]["input_ids"].shape == (5,)
    loader = eagle3.Loader(path, batch_size=3, shuffle=True, seed=5, rank=0, world_size=1)
    parts = np.array_split(loader.indices(), [3, 6])
    assert [len(p) for p in parts] == [3, 3, 1] and len(loader) == 3
    for batch, idx in zip(loader, parts, strict=True):
        want = eagle3.collate([cache[int(i)] for i in idx])
        for k in want:
            assert np.array_equal(batch[k].view(np.uint8), want[k].view(np.uint8)), k
    assert eagle3.validate(path, deep=True)["valid"], eagle3.validate(path, deep=True)


def test_nemo_style_reader_reads_our_cache(tmp_path, shardkit_bin):
    m = config(5, 2, seq=6, hidden=4, vd=10, dtype="bf16")
    items = samples(m, np.random.default_rng(3))
    path = tmp_path / "ours"
    with eagle3.Writer(path, m, format_version=2) as w:
        for it in items:
            w.add(it)
        w.write_target_embeddings(np.arange(20, dtype=np.float32).reshape(5, 4))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["target_probs_topk"] == 0
    s = manifest["shard_size"]
    for i, it in enumerate(items):
        with safe_open(str(path / f"shard-{i // s:06d}.safetensors"), framework="np") as f:
            assert list(f.keys()) == sorted(it)
            assert f.metadata() is None
            for k, v in it.items():
                got = f.get_slice(k)[i % s]
                assert got.dtype == v.dtype and np.array_equal(got.view(np.uint8), v.view(np.uint8)), k
    with safe_open(str(path / "target_embeddings.safetensors"), framework="np") as f:
        assert f.get_tensor("weight").tolist() == np.arange(20).reshape(5, 4).tolist()
    # The CLI agrees, and the cache validates in depth.
    out = subprocess.run([shardkit_bin, "eagle3", "validate", "--deep", "--json", path], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["valid"], out.stdout + out.stderr
    info = json.loads(subprocess.run([shardkit_bin, "eagle3", "inspect", "--json", path], capture_output=True, text=True).stdout)
    assert info["complete"] and info["samples_present"] == 5 and info["target_embeddings"]


def test_cli_write_from_python_batches(tmp_path, shardkit_bin):
    m = config(6, 4, seq=3, hidden=2, vd=4, dtype="fp16")
    items = samples(m, np.random.default_rng(4))
    (tmp_path / "m.json").write_text(json.dumps(m))
    batches = []
    for k in range(0, 6, 3):
        p = tmp_path / f"batch{k}.safetensors"
        save_file({key: np.stack([it[key] for it in items[k:k + 3]]) for key in items[0]}, str(p))
        batches.append(str(p))
    save_file({"weight": np.ones((3, 2), dtype=np.float32)}, str(tmp_path / "emb.safetensors"))
    out = tmp_path / "cache"
    r = subprocess.run([shardkit_bin, "eagle3", "write", "--out", out, "--manifest", tmp_path / "m.json",
                        "--embeddings", tmp_path / "emb.safetensors", *batches], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ref = tmp_path / "python"
    write_like_nemo(ref, m, items, 1)
    for name in ["shard-000000.safetensors", "shard-000001.safetensors", "manifest.json"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    # Resuming a finished cache from the same input is a no-op that keeps every byte.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = subprocess.run([shardkit_bin, "eagle3", "write", "--resume", "--out", out, "--manifest", tmp_path / "m.json", *batches],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
