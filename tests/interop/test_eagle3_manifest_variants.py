"""EAGLE-3 version-2 manifests with and without the run's input identity (``input_data``,
``split``, ``shuffle_seed``): NeMo versions differ in whether they record it. shardkit reads a
cache written either way, writes either byte for byte as NeMo does (the manifest dict given
decides), and ``eagle3.inspect`` says which it is."""

import json

import numpy as np
import pytest

from shardkit import eagle3
from shardkit.errors import AlreadyExistsError

from test_eagle3_interop import config, nemo_manifest, samples, write_like_nemo

IDENTITY = ("input_data", "split", "shuffle_seed")


def variant(m, with_identity):
    """`m` with the identity keys (as config() has them) or without any of them."""
    return dict(m) if with_identity else {k: v for k, v in m.items() if k not in IDENTITY}


def input_identity(info):
    """Whether inspect() reports the input identity: its ``input_identity`` holds the three keys
    with their values, or is None; ``manifest_variant`` says it in words."""
    ident = info["input_identity"]
    if ident is None:
        assert "without the input identity" in info["manifest_variant"], info["manifest_variant"]
        return False
    assert sorted(ident) == sorted(IDENTITY), ident
    assert "with the input identity" in info["manifest_variant"], info["manifest_variant"]
    return True


@pytest.mark.parametrize("with_identity", [True, False], ids=["with-identity", "without-identity"])
@pytest.mark.parametrize("dtype,topk", [("bf16", None), ("fp16", 2), ("fp32", None)])
def test_a_v2_cache_nemo_wrote_either_way_is_read(tmp_path, with_identity, dtype, topk):
    m = variant(config(7, 3, seq=5, hidden=2, vd=6, dtype=dtype, topk=topk), with_identity)
    items = samples(m, np.random.default_rng(21))
    path = tmp_path / "nemo"
    write_like_nemo(path, m, items, 2)
    on_disk = json.loads((path / "manifest.json").read_text())
    assert all((k in on_disk) == with_identity for k in IDENTITY)
    cache = eagle3.open(path)
    assert len(cache) == 7
    for i in range(7):
        got, want = cache[i], items[i]
        for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask"):
            assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), (i, k)
    assert eagle3.validate(path, deep=True)["valid"]
    assert input_identity(eagle3.inspect(path)) is with_identity


@pytest.mark.parametrize("with_identity", [True, False], ids=["with-identity", "without-identity"])
@pytest.mark.parametrize("dtype,topk", [("bf16", None), ("bf16", 3), ("fp32", 2)])
def test_our_writer_writes_either_variant_as_nemo_does(tmp_path, with_identity, dtype, topk):
    m = variant(config(5, 2, dtype=dtype, topk=topk), with_identity)
    items = samples(m, np.random.default_rng(22))
    ref = tmp_path / "nemo"
    write_like_nemo(ref, m, items, 2)
    ours = tmp_path / "ours"
    with eagle3.Writer(ours, m, format_version=2) as w:
        for it in items:
            w.add(it)
    shards = sorted(p.name for p in ref.glob("shard-*"))
    assert shards == [f"shard-{k:06d}.safetensors" for k in range(3)]
    for name in shards:
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name
    # NeMo's v2 manifest (target_probs_topk recorded, 0 when lossless), byte for byte.
    assert (ours / "manifest.json").read_text() == nemo_manifest(m, 2)
    text = (ours / "manifest.json").read_text()
    assert all((f'"{k}"' in text) == with_identity for k in IDENTITY), text
    assert input_identity(eagle3.inspect(ours)) is with_identity
    # The same through a resume: the identity (or its absence) is part of the configuration.
    other = variant(config(5, 2, dtype=dtype, topk=topk), not with_identity)
    before = {p.name: p.read_bytes() for p in ours.iterdir()}
    with pytest.raises(AlreadyExistsError, match="input_data") as e:
        eagle3.Writer(ours, other, resume=True, format_version=2)
    assert "shuffle_seed" in str(e.value)
    assert {p.name: p.read_bytes() for p in ours.iterdir()} == before
