"""The Python package: writing, reading, loading, errors, zero-copy, fork, memory."""

import gc
import hashlib
import json
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import saev

FIXTURES = Path(__file__).resolve().parents[4] / "shared" / "fixtures" / "saev"
A21 = FIXTURES / "v2.1" / "aa57b80c"
C21 = FIXTURES / "v2.1" / "e64e5d2c"
A100 = FIXTURES / "v1.0.0" / "bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47"
CRASHED = FIXTURES / "v2.0" / "36f76cd85cfb77f6ae191c8994a7e313994553017475db89e31564e3464623af"


def coded(n, l, t, d, first=0):
    e = np.arange(first, first + n, dtype=np.float32)[:, None, None, None]
    li = np.arange(l, dtype=np.float32)[None, :, None, None]
    ti = np.arange(t, dtype=np.float32)[None, None, :, None]
    di = np.arange(d, dtype=np.float32)[None, None, None, :]
    return (1000 * e + 100 * li + ti + di / 16).astype(np.float32)


def sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def fixture_metadata(d):
    return json.loads((d / "metadata.json").read_text())


@pytest.mark.parametrize("fixture,batch", [(A21, 2), (A100, 3), (C21, 1)])
def test_writing_fixture_cases_reproduces_their_bytes(tmp_path, fixture, batch):
    md = fixture_metadata(fixture)
    scrambled = dict(reversed(list(md.items())))  # key order is canonicalised
    n, layers = md.get("n_examples", md.get("n_imgs")), len(md["layers"])
    p = md.get("content_tokens_per_example", md.get("n_patches_per_img"))
    t, d = p + int(md["cls_token"]), md.get("d_model", md.get("d_vit"))
    labelled = (fixture / "labels.bin").exists()
    with saev.Writer(tmp_path, scrambled, progress=False) as w:
        assert w.next_example == 0
        for e in range(0, n, batch):
            b = min(batch, n - e)
            labels = None
            if labelled:
                labels = np.array([[(10 * x + c) % 7 for c in range(p)] for x in range(e, e + b)], np.uint8)
            w.write(coded(b, layers, t, d, e), labels)
    out = Path(w.path)
    assert out.name == fixture.name
    for f in sorted(os.listdir(fixture)):
        assert sha(out / f) == sha(fixture / f), f


def test_writer_resume_and_no_op(tmp_path):
    md = fixture_metadata(A21)
    with pytest.raises(RuntimeError, match="^killed$"):
        with saev.Writer(tmp_path, md, progress=False) as w:
            w.write(coded(4, 2, 5, 8))
            raise RuntimeError("killed")
    with pytest.raises(shardkit.AlreadyExistsError, match=r"holds an interrupted write of this dataset \(3 of 7 examples present\); resume it"):
        saev.Writer(tmp_path, md)
    calls = []
    with saev.Writer(tmp_path, md, resume=True, progress=lambda done, total: calls.append((done, total))) as w:
        assert w.next_example == 3  # the first complete shard survives
        w.write(coded(7 - w.next_example, 2, 5, 8, w.next_example))
    assert calls == [(7, 7)]
    for f in ["acts000000.bin", "acts000001.bin", "acts000002.bin", "shards.json"]:
        assert sha(Path(w.path) / f) == sha(A21 / f)
    with saev.Writer(tmp_path, md) as again:
        assert again.already_complete and again.next_example == 7


def test_reading_fixtures_matches_numpy(tmp_path):
    ds = saev.open(A21)
    assert (ds.protocol, ds.n_examples, ds.layers, ds.d_model, ds.tokens_per_example) == ("2.1", 7, [-2, -1], 8, 5)
    assert list(ds.metadata) == list(fixture_metadata(A21))
    raw = np.concatenate([np.fromfile(A21 / f"acts00000{s}.bin", "<f4").reshape(3, 2, 5, 8) for s in range(3)])
    assert np.array_equal(ds.get(4, -1, 3), raw[4, 1, 3])
    got = ds.take([0, 6, 3], -2, [0, 4, 2])
    assert np.array_equal(got, raw[[0, 6, 3], 0, [0, 4, 2]])
    view = ds.indexed(-1, "special")
    assert len(view) == 7 and view[3]["act"][0] == 3100.0 and view[3]["token_idx"] == -1
    c = saev.open(C21).indexed(3)
    assert [c[i]["token_label"] for i in range(20)] == [(10 * (i // 4) + i % 4) % 7 for i in range(20)]


def test_exceptions_have_natural_types(tmp_path):
    with pytest.raises(shardkit.NotFoundError, match="absent: no such directory"):
        saev.open(tmp_path / "absent")
    with pytest.raises(saev.IncompleteDatasetError, match="2 of 7 examples are present"):
        saev.open(CRASHED)
    assert issubclass(shardkit.IncompleteDatasetError, ValueError)
    ds = saev.open(A21)
    with pytest.raises(shardkit.InvalidArgumentError, match=r"\[-2, -1\]"):
        ds.get(0, 5, 0)
    with pytest.raises(shardkit.OutOfRangeError, match=r"example 7 is past the end: there are 7 examples \(valid indices: 0 to 6\)"):
        ds.get(7, -1, 0)
    with pytest.raises(shardkit.OutOfRangeError, match="row 28 is out of range for 28 rows"):
        ds.indexed(-1)[28]
    with pytest.raises(shardkit.InvalidArgumentError, match=r"\[-2, -1\]"):
        saev.ShuffledLoader(A21, layer=3)
    with pytest.raises(shardkit.NotFoundError, match="labels.bin: ignore_labels needs labels.bin"):
        saev.ShuffledLoader(A21, layer=-1, ignore_labels=[1])
    bad = tmp_path / "bad"
    shutil.copytree(A21, bad)
    (bad / "metadata.json").write_text("{not json")
    with pytest.raises(shardkit.CorruptDataError, match="metadata.json"):
        saev.open(bad)
    with pytest.raises(KeyError, match='state is missing "epoch"'):
        saev.ShuffledLoader(A21, layer=-1).load_state_dict({"seed": 0})
    with pytest.raises(shardkit.InvalidArgumentError, match='cannot write saev protocol "3.0"'):
        saev.Writer(tmp_path, {**fixture_metadata(A21), "protocol": "3.0"})
    assert saev.validate(CRASHED)["valid"] is False
    assert saev.inspect(A21)["n_examples"] == 7


def keys(batches):
    return [(int(e), int(t)) for b in batches for e, t in zip(b["example_idx"], b["token_idx"], strict=True)]


@pytest.mark.parametrize("order", ["block", "exact"])
def test_shuffled_is_exactly_once_deterministic_and_resumable(order):
    mk = lambda **kw: saev.ShuffledLoader(A21, layer=-1, batch_size=4, seed=3, order=order, rank=0, world_size=1, **kw)
    full = keys(list(mk()))
    assert sorted(full) == [(e, c) for e in range(7) for c in range(4)]
    assert keys(list(mk())) == full
    assert keys(list(mk(epoch=1))) != full
    a = mk()
    it = iter(a)
    head = [next(it) for _ in range(3)]
    state = a.state_dict()
    assert state == {"format": "saev", "seed": 3, "epoch": 0, "batch": 3, "batch_size": 4, "world_size": 1,
                     "cursor": 12, "global_batch_size": 4, "order": order, "layer": -1, "tokens": "content",
                     "ignore_labels": [], "drop_last": False, "memory_budget": 1 << 30,
                     "window_blocks": 7, "rows": 28}
    b = mk()
    b.load_state_dict(state)
    assert keys(head) + keys(list(b)) == full
    # Two ranks of batch 2 (same global batch) continue the same global order.
    parts = []
    for r in range(2):
        l = saev.ShuffledLoader(A21, layer=-1, batch_size=2, seed=3, order=order, rank=r, world_size=2)
        l.load_state_dict(state)
        parts.append(list(l))
    tail = []
    for g in range(len(parts[0])):
        for p in parts:
            if g < len(p):
                tail += keys([p[g]])
    assert keys(head) + tail == full


def test_ordered_loader_and_drop_last():
    l = saev.OrderedLoader(A21, layer=-2, batch_size=5)
    batches = list(l)
    assert len(l) == len(batches) == 6
    assert keys(batches) == [(e, c) for e in range(7) for c in range(4)]
    assert np.array_equal(batches[0]["act"][1], saev.open(A21).get(0, -2, 2))
    l = saev.OrderedLoader(A21, layer=-2, batch_size=5, drop_last=True)
    assert [b["act"].shape[0] for b in l] == [5] * 5
    all_layers = next(iter(saev.OrderedLoader(A21, layer="all", tokens="all", batch_size=100)))
    assert all_layers["act"].shape == (70, 8) and set(all_layers["layer"]) == {-2, -1}
    labelled = next(iter(saev.OrderedLoader(C21, layer=3, batch_size=100)))
    assert labelled["token_label"].tolist() == [(10 * (i // 4) + i % 4) % 7 for i in range(20)]


def test_batches_are_zero_copy_views_of_rust_memory():
    b = next(iter(saev.ShuffledLoader(A21, layer=-1, batch_size=8)))
    act = b["act"]
    assert not act.flags.owndata and act.flags.c_contiguous and act.flags.writeable
    base = act.base
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.obj if isinstance(base, memoryview) else base.base
    assert type(base).__name__ == "RustBuffer"
    assert act.ctypes.data % 4096 == 0  # page-aligned Rust buffer, not a numpy copy


def test_a_forked_child_opens_its_own_loader():
    l = saev.ShuffledLoader(A21, layer=-1, batch_size=4, seed=1)
    parent = keys(list(l))
    it = iter(l)
    next(it)
    pid = os.fork()
    if pid == 0:  # child: a fresh iteration works; the parent's iterator is refused, not hung
        code = 0
        try:
            # Iterating continues from the loader's position (one batch was consumed).
            if keys(list(l)) != parent[4:]:
                code = 1
            l.set_epoch(0)
            if keys(list(l)) != parent:
                code = 4
            try:
                next(it)
                code = 2
            except RuntimeError:
                pass
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert keys([next(it) for _ in range(2)]) == parent[4:12]


def shardkit_threads(prefixes=("shardkit-lane", "shardkit-prefet")):
    """Threads of running iterations (a loader's gather pool lives as long as the loader). The
    object-store runtime (``shardkit-s3``) is the process's, shared by every s3:// dataset, and
    is not counted."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{t}/comm").read_text()
            n += name.startswith(prefixes) and not name.startswith("shardkit-s3")
        except OSError:
            pass
    return n


def threads_after_exit(prefixes):
    """Threads left once those just stopped have left /proc (a moment after they are joined;
    the bound only keeps a thread that stays from hanging the test)."""
    deadline = time.monotonic() + 30
    while shardkit_threads(prefixes) and time.monotonic() < deadline:
        time.sleep(0.001)
    return shardkit_threads(prefixes)


def test_abandoned_iterators_stop_their_threads_and_memory_is_stable(tmp_path):
    md = {**fixture_metadata(A21), "n_examples": 64, "max_tokens_per_shard": 160, "data": "big"}
    with saev.Writer(tmp_path, md, progress=False) as w:
        w.write(coded(64, 2, 5, 8))
    l = saev.ShuffledLoader(w.path, layer=-1, batch_size=2, memory_budget=1 << 16)
    for _ in range(20):
        it = iter(l)
        next(it)
        it.close()
        assert threads_after_exit(("shardkit-lane", "shardkit-prefet")) == 0
    assert shardkit_threads(("shardkit-gather",)) > 0
    for _ in l:  # one epoch first: buffers and pools reach their steady size
        pass
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = 0
    while n < 1000:  # 128 batches per epoch
        for _ in l:
            n += 1
            if n >= 1000:
                break
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start
    assert grown_kib < 64 * 1024, f"peak RSS grew by {grown_kib} KiB over 1000 batches"
    del l, it
    gc.collect()
    assert threads_after_exit(("shardkit-",)) == 0, "the gather pool goes with its loader"


def test_compat_classes_mirror_saev():
    from shardkit.saev.compat import (
        IndexedConfig, IndexedDataset, OrderedConfig, OrderedDataLoader, ShuffledConfig, ShuffledDataLoader,
    )

    dl = ShuffledDataLoader(ShuffledConfig(shards=str(A21), layer=-1, batch_size=8, seed=17))
    first = list(dl)
    assert sorted(k for b in first for k in zip(np.asarray(b["example_idx"]).tolist(), np.asarray(b["token_idx"]).tolist(), strict=True)) == [
        (e, c) for e in range(7) for c in range(4)
    ]
    assert str(np.asarray(first[0]["example_idx"]).dtype) == "int32"
    second = list(dl)  # each iteration is the next epoch: a different order
    assert [np.asarray(b["example_idx"]).tolist() for b in first] != [np.asarray(b["example_idx"]).tolist() for b in second]
    one_x = IndexedDataset(IndexedConfig(shard_root=str(A100), patches="image", layer=-2))
    assert set(one_x[5]) == {"act", "image_i", "patch_i"} and len(one_x) == 28
    ordered = list(OrderedDataLoader(OrderedConfig(shards=str(C21), layer=3, batch_size=8)))
    assert np.asarray(ordered[0]["token_labels"]).tolist() == [0, 1, 2, 3, 3, 4, 5, 6]
    with pytest.raises(NotImplementedError, match=r"cfg.scale_norm=True is not implemented \(as in saev\)"):
        ShuffledDataLoader(ShuffledConfig(shards=str(A21), scale_norm=True))
    with pytest.raises(RuntimeError, match="Activations are not saved"):
        ShuffledDataLoader(ShuffledConfig(shards="/nonexistent"))


def test_torch_iterable_dataset_splits_ranks_and_workers():
    import torch
    from shardkit.torch import SaevIterableDataset

    seen = []
    for rank in range(2):
        ds = SaevIterableDataset(str(A21), layer=-1, batch_size=3, seed=2, rank=rank, world_size=2)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        for b in dl:
            seen += list(zip(b["example_idx"].tolist(), b["token_idx"].tolist(), strict=True))
    assert sorted(seen) == [(e, c) for e in range(7) for c in range(4)]
