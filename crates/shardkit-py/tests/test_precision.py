"""Reduced-precision saev datasets from Python: bfloat16 / float16 writers round as numpy and
ml_dtypes do (NaN, infinities, subnormals, overflow, ties), the error sidecars equal a numpy
float64 computation on the same rows, max_rel_error refuses without storing, readers serve rows
as stored or widened (numpy, torch, DataLoader workers, the device loaders' host-buffer path),
the recorder writes bfloat16, and float32 datasets are what they were."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import ml_dtypes  # noqa: E402 - a required test dependency

from shardkit import saev
from shardkit.errors import InvalidArgumentError

torch = pytest.importorskip("torch")
from shardkit import torch as sktorch  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"bfloat16": BF16, "float16": np.dtype(np.float16)}
N, L, T, D = 6, 2, 4, 8  # two examples a shard: three shards
LAYERS = [3, 7]
MD = {
    "family": "clip", "ckpt": "x", "layers": LAYERS, "content_tokens_per_example": T, "cls_token": False,
    "d_model": D, "n_examples": N, "max_tokens_per_shard": 2 * L * T, "data": "d", "dataset": "t",
    "protocol": "2.1",
}
FIXTURES = Path(__file__).resolve().parents[4] / "shared" / "fixtures" / "saev"
A21 = FIXTURES / "v2.1" / "aa57b80c"


def activations(seed=0):
    """float32 (N, L, T, D) holding every case the rounding must get right."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, L, T, D)) * np.float32(3)).astype(np.float32)
    x[0, 0, 0] = [np.nan, np.inf, -np.inf, 1e-40, -1e-45, 70000.0, -1e6, 3.4028235e38]  # f32 subnormals, f16 overflow
    x[0, 0, 1] = [
        np.float32(1.00390625),  # 0x3F808000: a bfloat16 tie, to even 1.0
        np.float32(1.01171875),  # 0x3F818000: a bfloat16 tie, to even 1.015625
        1 + 2.0 ** -11,  # a float16 tie, to even 1.0
        1 + 3 * 2.0 ** -11,  # a float16 tie, to even 1 + 2**-9
        65520.0,  # float16's tie between 65504 and 2**16: to even, infinity
        65519.0,  # float16: 65504
        2.0 ** -24,  # float16's smallest subnormal
        2.0 ** -26,  # below half of it: flushed to zero in float16
    ]
    x[1, 1, 2] = (rng.standard_normal(D) * 1e-6).astype(np.float32)  # float16 subnormals
    x[2, 0, 0] = 0.0  # an all-zero row: relative error 0
    x[3, 1, 3] = -0.0
    return x


def write(root, x, dtype=None, batch=3, **kw):
    with saev.Writer(root, MD, dtype=dtype, progress=False, **kw) as w:
        for at in range(0, len(x), batch):
            w.write(x[at:at + batch])
    return w


def bits(a):
    """The stored bit patterns of reduced values (NaNs compare by their bits)."""
    return np.ascontiguousarray(a).view(np.uint16)


def shard_rows(x, s):
    """The rows (L·T of them per example, D values each) of shard ``s``."""
    return x[2 * s:2 * s + 2].reshape(-1, D)


def numpy_stats(rows, dtype):
    """The rounding error of ``rows`` (float32, (R, D)) rounded to ``dtype``, computed here in
    float64 with numpy: rows' sums are accumulated value by value, in order."""
    x = rows.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # infinities and NaNs are left out below
        q = rows.astype(NP[dtype]).astype(np.float64)
        diff = np.abs(x - q)
    finite = np.isfinite(x)
    over = finite & np.isinf(q)
    ok = finite & ~over
    e = np.where(ok, diff, 0.0)
    err2 = np.zeros(len(rows))
    norm2 = np.zeros(len(rows))
    for j in range(rows.shape[1]):
        err2 = err2 + e[:, j] * e[:, j]
        norm2 = norm2 + np.where(ok[:, j], x[:, j] * x[:, j], 0.0)
    rel = np.where(norm2 > 0, np.sqrt(err2 / np.where(norm2 > 0, norm2, 1.0)), 0.0)
    return {
        "rows": len(rows), "values": rows.size, "max_abs_error": float(e.max()),
        "max_rel_l2_error": float(rel.max()), "mean_rel_l2_error": float(rel.mean()),
        "overflow": int(over.sum()), "flushed_to_zero": int((ok & (x != 0) & (q == 0)).sum()),
    }


@pytest.mark.parametrize("dtype, alias", [("bfloat16", "bf16"), ("float16", "fp16"), ("bfloat16", "bfloat16"),
                                          ("float16", np.float16), ("bfloat16", torch.bfloat16)])
def test_rows_are_stored_as_numpy_rounds_them_and_read_back_as_stored_or_widened(tmp_path, dtype, alias):
    x = activations()
    w = write(tmp_path, x, dtype=alias)
    with np.errstate(over="ignore"):  # float16's overflows: infinities, as stored
        want = x.astype(NP[dtype])
    assert w.dtype == dtype and f"dtype={dtype!r}" in repr(w) and json.loads((Path(w.path) / "metadata.json").read_text())["dtype"] == dtype
    for s in range(3):  # the shard files hold numpy's bytes
        assert (Path(w.path) / f"acts{s:06d}.bin").read_bytes() == want[2 * s:2 * s + 2].tobytes()
    ds = saev.open(w.path)
    assert ds.dtype == dtype and f"dtype={dtype!r}" in repr(ds)
    # Random access: as stored by default, float32 on request.
    e, t = np.arange(N).repeat(T), np.tile(np.arange(T), N)
    stored = ds.take(e, 7, t)
    assert stored.dtype == NP[dtype] and stored.shape == (N * T, D)
    np.testing.assert_array_equal(bits(stored), bits(want[:, 1].reshape(-1, D)))
    wide = ds.take(e, 7, t, dtype="float32")
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide, want[:, 1].reshape(-1, D).astype(np.float32))
    one = ds.get(0, 3, 0)
    assert one.dtype == NP[dtype] and bits(one).tolist() == bits(want[0, 0, 0]).tolist()
    assert ds.get(0, 3, 1, dtype=np.float32).tolist() == want[0, 0, 1].astype(np.float32).tolist()
    view = ds.indexed(3, "all")
    assert bits(view[9]["act"]).tolist() == bits(want[2, 0, 1]).tolist() and view[9]["example_idx"] == 2
    assert view[9]["act"].dtype == NP[dtype]
    assert ds.indexed(3, "all", dtype="float32")[9]["act"].tolist() == want[2, 0, 1].astype(np.float32).tolist()
    # A reader asked for another reduced type than the stored one refuses.
    other = "float16" if dtype == "bfloat16" else "bfloat16"
    with pytest.raises(InvalidArgumentError, match=f"dtype='{other}', but the dataset stores {dtype}"):
        ds.take([0], 3, [0], dtype=other)


def test_float_widths_of_input_are_taken_exactly_and_rounded_once(tmp_path):
    """float16, ml_dtypes and torch bfloat16 input is widened exactly to float32 first: a
    bfloat16 recording written to a bfloat16 dataset is stored unchanged."""
    x = activations()
    x[0, 0, :2] = 1.0  # finite values only: torch's bfloat16 input
    b = x.astype(BF16)
    w1 = write(tmp_path / "ml", b, dtype="bf16")
    w2 = write(tmp_path / "torch", torch.from_numpy(b.view(np.int16)).view(torch.bfloat16), dtype="bf16")
    assert w1.path.endswith(os.path.basename(w2.path))
    for s in range(3):
        f = f"acts{s:06d}.bin"
        assert (Path(w1.path) / f).read_bytes() == (Path(w2.path) / f).read_bytes() == b[2 * s:2 * s + 2].tobytes()
    assert saev.inspect(w1.path)["precision"]["max_abs_error"] == 0.0  # already bfloat16: nothing lost


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_error_sidecars_equal_numpy_and_inspect_merges_them(tmp_path, dtype):
    x = activations(1)
    w = write(tmp_path, x, dtype=dtype, batch=1)
    merged = {"rows": 0, "values": 0, "max_abs_error": 0.0, "max_rel_l2_error": 0.0, "overflow": 0,
              "flushed_to_zero": 0}
    for s in range(3):
        got = json.loads((Path(w.path) / f"acts{s:06d}.error.json").read_text())
        want = numpy_stats(shard_rows(x, s), dtype)
        assert got["dtype"] == dtype
        for k in ("rows", "values", "overflow", "flushed_to_zero", "max_abs_error", "max_rel_l2_error"):
            assert got[k] == want[k], (s, k)
        assert got["mean_rel_l2_error"] == pytest.approx(want["mean_rel_l2_error"], rel=1e-12)
        for k in merged:
            merged[k] = max(merged[k], want[k]) if k.startswith("max") else merged[k] + want[k]
    if dtype == "float16":  # shard 0 holds the overflows and the flushed values
        assert numpy_stats(shard_rows(x, 0), dtype)["overflow"] == 4  # 70000, -1e6, 3.4e38 and 65520
        assert numpy_stats(shard_rows(x, 0), dtype)["flushed_to_zero"] >= 3
    else:
        assert numpy_stats(shard_rows(x, 0), dtype)["overflow"] == 1  # float32's largest value
    info = saev.inspect(w.path)
    assert info["dtype"] == dtype
    p = info["precision"]
    for k, v in merged.items():
        assert p[k] == v, k
    every = numpy_stats(x.reshape(-1, D), dtype)
    assert p["mean_rel_l2_error"] == pytest.approx(every["mean_rel_l2_error"], rel=1e-12)
    # The sidecars are covered by the checksums a loader verifies.
    assert sum(1 for _ in saev.Loader(w.path, layer=3, batch_size=5, verify=True, dtype="float32")) == 5


def test_max_rel_error_refuses_naming_the_shard_and_row_stores_nothing_and_the_writer_goes_on(tmp_path):
    # Quarters of small numbers: exact in bfloat16 and float16.
    exact = np.round(np.random.default_rng(2).standard_normal((N, L, T, D)) * 4).astype(np.float32) / 4
    bad = exact[2:4].copy()
    bad[1, 1, 2] = np.float32(1 + 2.0 ** -9)  # a quarter ulp of bfloat16 at 1: relative error ~2e-3
    with saev.Writer(tmp_path, MD, dtype="bf16", max_rel_error=1e-3, progress=False) as w:
        w.write(exact[:2])
        with pytest.raises(InvalidArgumentError) as e:
            w.write(bad)
        msg = str(e.value)
        assert "acts000001.bin: example 3 (row 1 of the shard), layer 7, token slot 2" in msg
        assert "above max_rel_error = 0.001" in msg and "nothing of this write was stored" in msg
        assert w.next_example == 2
        w.write(exact[2:])  # the writer goes on
    rows = saev.open(w.path).take(np.arange(N).repeat(T), 7, np.tile(np.arange(T), N), dtype="float32")
    np.testing.assert_array_equal(rows, exact[:, 1].reshape(-1, D))
    assert saev.inspect(w.path)["precision"]["max_abs_error"] == 0.0
    # float16 overflow breaks any bound; a parallel writer refuses alike.
    big = exact.copy()
    big[4, 0, 3, 5] = 1e5
    with saev.PartWriter(tmp_path / "parts", MD, rank=0, world_size=1, dtype="float16", max_rel_error=1.0,
                         progress=False) as pw:
        assert pw.dtype == "float16" and "dtype='float16'" in repr(pw)
        pw.write(exact[:4])
        with pytest.raises(InvalidArgumentError, match=r"acts000002\.bin: example 4 \(row 0 of the shard\), layer 3, "
                                                         r"token slot 3: 1 value\(s\) of the row overflow to infinity"):
            pw.write(big[4:])
        pw.write(exact[4:])
    assert saev.inspect(pw.path)["precision"]["overflow"] == 0


def test_dtype_and_max_rel_error_arguments_are_checked(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"dtype must be 'float32', 'bfloat16'.*got 'bf8'"):
        saev.Writer(tmp_path, MD, dtype="bf8")
    with pytest.raises(InvalidArgumentError, match=r"dtype must be .*got .*float64"):
        saev.Writer(tmp_path, MD, dtype=np.float64)
    with pytest.raises(InvalidArgumentError, match=r"max_rel_error must be a finite number >= 0.*got -0.1"):
        saev.Writer(tmp_path, MD, dtype="bf16", max_rel_error=-0.1)
    with pytest.raises(InvalidArgumentError, match=r"max_rel_error must be a finite number >= 0.*got nan"):
        saev.PartWriter(tmp_path, MD, dtype="bf16", max_rel_error=float("nan"), rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match=r"dtype=\"float16\" contradicts the metadata's \"dtype\": \"bfloat16\""):
        saev.Writer(tmp_path, dict(MD, dtype="bfloat16"), dtype="fp16")
    with pytest.raises(InvalidArgumentError, match=r"protocol 2\.1"):
        saev.Writer(tmp_path, dict(MD, protocol="2.0", data={"name": "d"}), dtype="bf16")
    assert not os.listdir(tmp_path)
    # The metadata's own dtype key is the same dataset as the argument.
    x = activations()
    a = write(tmp_path / "a", x, dtype="bf16")
    with saev.Writer(tmp_path / "b", dict(MD, dtype="bfloat16"), progress=False) as b:
        b.write(x)
    assert os.path.basename(a.path) == os.path.basename(b.path)


def coded(n, l, t, d):
    """The values the saev fixtures were written with (see test_saev.py)."""
    e = np.arange(n, dtype=np.float32)[:, None, None, None]
    li = np.arange(l, dtype=np.float32)[None, :, None, None]
    ti = np.arange(t, dtype=np.float32)[None, None, :, None]
    di = np.arange(d, dtype=np.float32)[None, None, None, :]
    return (1000 * e + 100 * li + ti + di / 16).astype(np.float32)


def test_a_float32_dataset_is_untouched(tmp_path):
    """Written with the default dtype, dtype="float32" or a bound: the fixture's directory
    name and bytes, no error sidecar; read as float32."""
    md = json.loads((A21 / "metadata.json").read_text())
    n, layers, p = md["n_examples"], len(md["layers"]), md["content_tokens_per_example"]
    t, d = p + int(md["cls_token"]), md["d_model"]
    labels = None
    if (A21 / "labels.bin").exists():
        labels = np.array([[(10 * x + c) % 7 for c in range(p)] for x in range(n)], np.uint8)
    for i, kw in enumerate([{}, {"dtype": "float32"}, {"dtype": np.float32, "max_rel_error": 0.0}]):
        with saev.Writer(tmp_path / str(i), md, progress=False, **kw) as w:
            w.write(coded(n, layers, t, d), labels)
        out = Path(w.path)
        assert out.name == A21.name and w.dtype == "float32"
        # The fixture's files (saev's), and shardkit's checksums sidecar: no error sidecar.
        assert sorted(os.listdir(out)) == sorted(os.listdir(A21) + ["shardkit.checksums.json"])
        for f in os.listdir(A21):
            assert (out / f).read_bytes() == (A21 / f).read_bytes(), (kw, f)
        assert (out / "shardkit.checksums.json").read_bytes() == \
            (tmp_path / "0" / A21.name / "shardkit.checksums.json").read_bytes()
    assert saev.inspect(A21)["dtype"] == "float32" and saev.inspect(A21)["precision"] is None
    ds = saev.open(A21)
    assert ds.dtype == "float32" and ds.get(0, md["layers"][0], 0).dtype == np.float32
    assert ds.take([0], md["layers"][0], [0], dtype="float32").dtype == np.float32
    loader = saev.Loader(A21, layer=md["layers"][0], batch_size=4, dtype="float32")
    assert loader.dtype == "float32" and loader._l.batch_bytes == 4 * d * 4 and "dtype" not in repr(loader)
    with pytest.raises(InvalidArgumentError, match="stores float32: readers serve rows as stored"):
        saev.Loader(A21, layer=md["layers"][0], dtype="bf16")


def sequential(path, dtype=None, **kw):
    """Layer 7's rows in storage order, through saev.Loader."""
    out = [b["act"] for b in saev.Loader(path, layer=7, batch_size=5, shuffle=False, dtype=dtype, **kw)]
    return np.concatenate(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loaders_serve_rows_as_stored_or_widened(tmp_path, dtype):
    x = activations()
    w = write(tmp_path, x, dtype=dtype)
    want = x[:, 1].reshape(-1, D).astype(NP[dtype])
    got = sequential(w.path)
    assert got.dtype == NP[dtype]
    np.testing.assert_array_equal(bits(got), bits(want))
    wide = sequential(w.path, "float32")
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide, want.astype(np.float32))
    # Half the bytes a batch; float32 when widened.
    assert saev.Loader(w.path, layer=7, batch_size=5)._l.batch_bytes == 5 * D * 2
    assert saev.Loader(w.path, layer=7, batch_size=5, dtype="float32")._l.batch_bytes == 5 * D * 4
    # Shuffled, verified and resumed: the same rows as one pass.
    kw = dict(layer="all", batch_size=4, seed=5, verify=True)
    full = list(saev.ShuffledLoader(w.path, **kw))
    a = saev.Loader(w.path, **kw)
    it = iter(a)
    head = [next(it), next(it)]
    state = a.state_dict()
    del it
    b = saev.Loader(w.path, dtype="float32", **kw)
    b.load_state_dict(state)
    rest = list(b)
    assert len(head) + len(rest) == len(full)
    for x1, x2 in zip(head, full):
        np.testing.assert_array_equal(bits(x1["act"]), bits(x2["act"]))
    for x1, x2 in zip(rest, full[2:]):
        assert x1["act"].dtype == np.float32
        np.testing.assert_array_equal(x1["act"], x2["act"].astype(np.float32))
        np.testing.assert_array_equal(x1["example_idx"], x2["example_idx"])
    assert "dtype='float32'" in repr(b) and b.stored_dtype == dtype


def test_a_follow_loader_reads_a_bfloat16_dataset_while_its_ranks_write_it(tmp_path):
    import threading
    import time

    x = activations()
    with saev.PartWriter(tmp_path, MD, rank=0, world_size=2, dtype="bf16", progress=False) as first:
        first.write(x[0:4])  # shards 0 and 1 of 3: rank 1 owes shard 2
    assert not saev.status(first.path)["committed"]

    def rank1():
        time.sleep(0.5)
        with saev.PartWriter(tmp_path, MD, rank=1, world_size=2, dtype="bf16", progress=False) as w:
            w.write(x[4:6])

    writer = threading.Thread(target=rank1)
    writer.start()
    loader = saev.Loader(first.path, layer=7, batch_size=5, seed=2, follow=True, follow_timeout=60, rank=0,
                         world_size=1)
    got = {}
    for b in loader:
        assert b["act"].dtype == BF16 and not b["act"].flags.owndata  # a view of the loader's buffer
        for e, t, act in zip(b["example_idx"].tolist(), b["token_idx"].tolist(), bits(b["act"])):
            assert (e, t) not in got
            got[(e, t)] = act
    writer.join()
    assert saev.status(first.path)["committed"] and len(got) == N * T
    for (e, t), act in got.items():
        np.testing.assert_array_equal(act, bits(x[e, 1, t].astype(BF16)))


def test_bfloat16_as_stored_without_ml_dtypes_says_what_to_do(tmp_path, monkeypatch):
    w = write(tmp_path, activations(), dtype="bf16")
    monkeypatch.setattr(saev, "_BF16", None)
    with pytest.raises(InvalidArgumentError, match=r"pip install ml_dtypes.*dtype='float32'"):
        saev.Loader(w.path, layer=7)
    with pytest.raises(InvalidArgumentError, match=r"pip install ml_dtypes"):
        saev.open(w.path).get(0, 7, 0)
    assert saev.open(w.path).get(0, 7, 0, dtype="float32").dtype == np.float32
    assert next(iter(saev.Loader(w.path, layer=7, dtype="float32")))["act"].dtype == np.float32
    # shardkit.torch needs no ml_dtypes for torch.bfloat16.
    t = next(iter(sktorch.SaevLoader(w.path, layer=7, batch_size=5, shuffle=False, device="cpu")))["act"]
    assert t.dtype == torch.bfloat16


def tensor_bits(t):
    """A bfloat16 / float16 tensor's bit patterns."""
    assert t.dtype in (torch.bfloat16, torch.float16)
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("host_buffers", [None, "plain"])
def test_torch_loaders_serve_torch_reduced_types_or_float32(tmp_path, dtype, host_buffers):
    """host_buffers="plain" on the CPU takes the path of a GPU: the engine gathers stored rows
    into torch-allocated host buffers (half a float32 batch), copied from there and widened
    after the copy."""
    x = activations()
    w = write(tmp_path, x, dtype=dtype)
    want = x[:, 1].reshape(-1, D).astype(NP[dtype])
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kw = dict(layer=7, batch_size=5, shuffle=False, device="cpu", host_buffers=host_buffers)
    stored = sktorch.SaevLoader(w.path, **kw)
    got = [b["act"] for b in stored]
    assert stored.dtype == dtype and all(t.dtype == tdt for t in got)
    np.testing.assert_array_equal(np.concatenate([tensor_bits(t) for t in got]), bits(want))
    wide = sktorch.SaevLoader(w.path, dtype="float32", **kw)
    got = [b["act"] for b in wide]
    assert wide.dtype == "float32" and all(t.dtype == torch.float32 for t in got)
    np.testing.assert_array_equal(torch.cat(got).numpy(), want.astype(np.float32))
    if host_buffers == "plain":
        # Widened after the copy: the host loader serves (and its buffers hold) the stored bytes.
        assert wide.loader.dtype == dtype and wide._core.batch_bytes == 5 * D * 2
        assert all(n == 4096 for _, n in wide._buffers.regions)
    else:
        assert wide.loader.dtype == "float32"  # the loader widens as it gathers
    # state_dict / resume on the device loader.
    a = sktorch.SaevLoader(w.path, dtype="float32", **kw)
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = sktorch.SaevLoader(w.path, dtype="float32", **kw)
    b.load_state_dict(state)
    np.testing.assert_array_equal(torch.cat([t["act"] for t in b]).numpy(), want[5:].astype(np.float32))


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_dataloader_workers_serve_every_bfloat16_row_once(tmp_path, dtype):
    x = activations()
    w = write(tmp_path, x, dtype="bf16")
    ds = sktorch.SaevDataset(w.path, layer="all", batch_size=4, seed=1, dtype=dtype, rank=0, world_size=1)
    assert f"dtype={dtype!r}" in repr(ds)
    rows = {}
    for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        assert b["act"].dtype == (torch.bfloat16 if dtype is None else torch.float32)
        for e, t, layer, act in zip(b["example_idx"].tolist(), b["token_idx"].tolist(), b["layer"].tolist(),
                                    b["act"].float().numpy()):
            assert (e, layer, t) not in rows
            rows[(e, layer, t)] = act
    assert len(rows) == N * L * T
    for (e, layer, t), act in rows.items():
        np.testing.assert_array_equal(act, x[e, LAYERS.index(layer), t].astype(BF16).astype(np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none): the pinned "
                    "buffers and the widening on the GPU after the copy are tested on the CPU path above")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_on_cuda_the_host_moves_the_stored_bytes_and_the_gpu_widens(tmp_path, dtype):
    x = activations()
    w = write(tmp_path, x, dtype=dtype)
    want = x[:, 1].reshape(-1, D).astype(NP[dtype]).astype(np.float32)
    ld = sktorch.SaevLoader(w.path, layer=7, batch_size=5, shuffle=False, device="cuda", dtype="float32")
    got = [b["act"] for b in ld]
    assert ld.host_buffers == "pinned" and ld.loader.dtype == dtype and ld._core.batch_bytes == 5 * D * 2
    assert all(t.is_pinned() for t in ld._buffers.tensors)
    assert all(t.device.type == "cuda" and t.dtype == torch.float32 for t in got)
    np.testing.assert_array_equal(torch.cat(got).cpu().numpy(), want)
    stored = [b["act"] for b in sktorch.SaevLoader(w.path, layer=7, batch_size=5, shuffle=False, device="cuda")]
    assert stored[0].dtype == {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    np.testing.assert_array_equal(torch.cat(stored).float().cpu().numpy(), want)


# -- the recorder -------------------------------------------------------------------------

TINY = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            image_size=16, patch_size=4)  # 16 patches


def stored_rows(path, dtype):
    """A dataset's shards as (n, L, T, D) of its stored type."""
    ds = saev.open(path)
    files = sorted(f for f in os.listdir(path) if f.startswith("acts") and f.endswith(".bin"))
    raw = b"".join(Path(path, f).read_bytes() for f in files)
    return np.frombuffer(raw, dtype=dtype).reshape(-1, ds.n_layers, ds.tokens_per_example, ds.d_model)[:ds.n_examples]


def test_the_recorder_writes_bfloat16_rows_equal_to_the_float32_recording_rounded(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardkit.record import ActivationRecorder

    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(**TINY)).eval()
    x = torch.randn(7, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    out = {}
    for name, kw in [("f32", {}), ("bf16", {"dtype": "bfloat16", "max_rel_error": 0.01})]:
        md = {"family": "clip", "ckpt": "tiny", "max_tokens_per_shard": 3 * 2 * 17}
        with ActivationRecorder(model, str(tmp_path / name), layers=[2, 0], n_examples=7, metadata=md,
                                rank=0, world_size=1, **kw) as rec:
            for first, end in rec.batches(2):
                rec(x[first:end])
        assert rec.dtype == ("bfloat16" if kw else "float32")
        out[name] = rec.path
    f32 = stored_rows(out["f32"], np.float32)
    b16 = stored_rows(out["bf16"], BF16)
    assert b16.shape == f32.shape == (7, 2, 17, 16)
    np.testing.assert_array_equal(bits(b16), bits(f32.astype(BF16)))
    info = saev.inspect(out["bf16"])
    assert info["dtype"] == "bfloat16" and 0 < info["precision"]["max_rel_l2_error"] <= 0.01
    assert info["precision"]["rows"] == 7 * 2 * 17
    assert saev.validate(out["bf16"])["valid"]


def test_a_recorder_over_max_rel_error_fails_naming_the_row_and_a_restart_finishes(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardkit.record import ActivationRecorder

    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(**TINY)).eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    md = {"family": "clip", "ckpt": "tiny"}

    def run(**kw):
        with ActivationRecorder(model, str(tmp_path), layers=[0], n_examples=4, metadata=md, rank=0, world_size=1,
                                dtype="fp16", **kw) as rec:
            for first, end in rec.batches(2):
                rec(x[first:end])
        return rec

    # A bound of 0 refuses the first row float16 rounds: the batch fails, nothing of it is stored.
    with pytest.raises(InvalidArgumentError, match=r"acts000000\.bin: example 0 \(row 0 of the shard\), layer 0, "
                                                     r"token slot \d+: its relative L2 error is .* above max_rel_error = 0 "
                                                     r"for float16; nothing of this write was stored"):
        run(max_rel_error=0.0)
    rec = run()  # the same dataset (the bound is no part of it), finished by a restart
    assert saev.status(rec.path)["committed"] and rec.dtype == "float16"
    assert saev.inspect(rec.path)["precision"]["rows"] == 4 * 17


def test_the_text_recorder_writes_bfloat16(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardkit.record import TextRecorder

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (5, 8), generator=torch.Generator().manual_seed(1))
    paths = {}
    for dtype in ("float32", "bf16"):
        with TextRecorder(model, str(tmp_path / dtype), layers=[1], n_examples=5, context=8, dtype=dtype,
                          metadata={"max_tokens_per_shard": 16}, rank=0, world_size=1) as rec:
            for first, end in rec.batches(2):
                rec(ids[first:end])
        paths[dtype] = rec.path
    assert rec.dtype == "bfloat16" and saev.open(paths["bf16"]).dtype == "bfloat16"
    np.testing.assert_array_equal(bits(stored_rows(paths["bf16"], BF16)),
                                  bits(stored_rows(paths["float32"], np.float32).astype(BF16)))


def test_the_command_line_records_with_store_dtype(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from shardkit.record import main

    torch.manual_seed(0)
    transformers.ViTModel(transformers.ViTConfig(**TINY)).eval().save_pretrained(tmp_path / "model")
    px = np.random.default_rng(1).standard_normal((5, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "px.npy", px)
    args = ["--model", str(tmp_path / "model"), "--layers", "1", "--family", "clip", "--batch-size", "2",
            "--device", "cpu", "--pixels", str(tmp_path / "px.npy")]
    paths = []
    for out, extra in [("f32", []), ("bf16", ["--store-dtype", "bf16", "--max-rel-error", "0.05"])]:
        assert main(args + ["--out", str(tmp_path / out)] + extra)["committed"]
        paths.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path"])
    f32 = stored_rows(paths[0], np.float32)
    path = paths[1]
    assert saev.open(path).dtype == "bfloat16" and saev.open(paths[0]).dtype == "float32"
    np.testing.assert_array_equal(bits(stored_rows(path, BF16)), bits(f32.astype(BF16)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def tree(path):
    """Every file under ``path`` with its bytes."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()}


def test_convert_both_ways_equals_writing_in_that_dtype_and_an_interrupted_one_resumes(tmp_path):
    x = activations()
    f32 = write(str(tmp_path / "f32"), x).path
    for dtype in ("bfloat16", "float16"):
        direct = write(str(tmp_path / f"direct-{dtype}"), x, dtype=dtype).path
        seen = []
        out = saev.convert(f32, str(tmp_path / f"conv-{dtype}"), dtype, progress=lambda d, n: seen.append((d, n)))
        assert Path(out).name == Path(direct).name
        assert tree(out) == tree(direct), dtype
        assert seen and seen[-1] == (N, N) and all(n == N for _, n in seen)
        # Back to float32: exact, and the original float32 dataset's name and bytes.
        back = saev.convert(out, str(tmp_path / f"back-{dtype}"), "float32", progress=False)
        assert Path(back).name == Path(f32).name
        with np.errstate(over="ignore"):  # float16 overflows to inf, as stored
            widened = x.astype(NP[dtype]).astype(np.float32)
        got = saev.open(back).take(np.arange(N)[:, None], 3, np.arange(T)[None, :])  # (N, T, D)
        np.testing.assert_array_equal(got.view(np.uint32), widened[:, 0].view(np.uint32))

    # An exception from the progress callback stops the conversion; calling again finishes it,
    # with the bytes of an uninterrupted run.
    def stop(done, total):
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        saev.convert(f32, str(tmp_path / "stopped"), "bf16", progress=stop)
    out = saev.convert(f32, str(tmp_path / "stopped"), "bf16", progress=False)
    assert tree(out) == tree(str(tmp_path / "conv-bfloat16" / Path(out).name))

    with pytest.raises(InvalidArgumentError, match="already"):
        saev.convert(f32, str(tmp_path / "same"), "float32", progress=False)
    with pytest.raises(InvalidArgumentError, match="dtype must name the type"):
        saev.convert(f32, str(tmp_path / "none"), None)
