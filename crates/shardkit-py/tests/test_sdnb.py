"""shardkit.sdnb: SameDiff containers from Python (mapped reader, writer, conversion, edits)."""

import collections.abc
import dataclasses
import gc
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import sdnb

import ml_dtypes  # noqa: E402 - a required test dependency

MIB = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# numpy dtype -> the SameDiff name it is stored as
DTYPES = [
    (np.dtype(np.float32), "FLOAT"),
    (np.dtype(np.float16), "HALF"),
    (BF16, "BFLOAT16"),
    (FP8, "FLOAT8"),
    (np.dtype(np.float64), "DOUBLE"),
    (np.dtype(np.int8), "INT8"),
    (np.dtype(np.int16), "INT16"),
    (np.dtype(np.int32), "INT32"),
    (np.dtype(np.int64), "INT64"),
    (np.dtype(np.uint8), "UINT8"),
    (np.dtype(np.uint16), "UINT16"),
    (np.dtype(np.uint32), "UINT32"),
    (np.dtype(np.uint64), "UINT64"),
    (np.dtype(np.bool_), "BOOL"),
]


def random_array(dtype, shape, seed):
    """Arbitrary bit patterns of `dtype` (NaNs with payloads included); bools are 0/1."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # logical (C-order) bytes, layout-independent


def read_all(path):
    with sdnb.open(path) as c:
        return {k: np.array(v) for k, v in c.items()}


@pytest.mark.parametrize("dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype, name):
    big = (MIB // dtype.itemsize + 3,)  # appended as a blob (>= 1 MiB)
    arrays = {
        "scalar": random_array(dtype, (), 1),
        "empty": random_array(dtype, (0, 3), 2),
        "small": random_array(dtype, (5, 7), 3),
        "big": random_array(dtype, big, 4),
        "wide": random_array(dtype, (3, MIB // dtype.itemsize // 2), 5),
    }
    files = sdnb.save(tmp_path / "m.sdnb", arrays)
    assert files == [str(tmp_path / "m.sdnb")]
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert list(c) == list(arrays) and len(c) == 5
        storage = {v.name: v.storage for v in c.variables}
        assert storage == {"scalar": "inline", "empty": "empty", "small": "inline", "big": "appended", "wide": "appended"}
        for v in c.variables:
            assert v.dtype == name and v.var_type == "VARIABLE" and v.order == "c"
            assert v.shape == arrays[v.name].shape and v.nbytes == arrays[v.name].nbytes
        for k, want in arrays.items():
            same_bits(c[k], want)


def test_float_nan_payloads_and_specials_are_kept(tmp_path):
    f32 = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x7F800000, 0x80000000, 1], np.uint32).view(np.float32)
    f16 = np.array([0x7C01, 0xFE01, 0x7C00, 0x8000], np.uint16).view(np.float16)
    bf16 = np.array([0x7F81, 0xFFC1, 0x7F80, 0x8000], np.uint16).view(BF16)
    fp8 = np.array([0x7F, 0xFF, 0x80, 0x01], np.uint8).view(FP8)  # e4m3fn NaNs, -0, subnormal
    f64 = np.array([0x7FF0000000000001, 0xFFF8000000000001], np.uint64).view(np.float64)
    arrays = {"f32": f32, "f16": f16, "bf16": bf16, "fp8": fp8, "f64": f64}
    sdnb.save(tmp_path / "nan.sdnb", arrays)
    got = read_all(tmp_path / "nan.sdnb")
    for k, want in arrays.items():
        same_bits(got[k], want)
    assert got["f32"].view(np.uint32)[0] == 0x7F800001


def test_fortran_order_arrays_are_written_and_read_without_transposing(tmp_path):
    rng = np.random.default_rng(0)
    small = np.asfortranarray(rng.standard_normal((4, 6)).astype(np.float32))
    big = np.asfortranarray(rng.standard_normal((512, 600)))  # 2.4 MB: appended
    cube = np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4))
    strided = np.arange(40, dtype=np.int32).reshape(4, 10)[:, ::3]  # neither order: copied
    sdnb.save(tmp_path / "f.sdnb", {"small": small, "big": big, "cube": cube, "strided": strided})
    with sdnb.open(tmp_path / "f.sdnb") as c:
        orders = {v.name: v.order for v in c.variables}
        assert orders == {"small": "f", "big": "f", "cube": "f", "strided": "c"}
        for k, want in [("small", small), ("big", big), ("cube", cube), ("strided", strided)]:
            got = c[k]
            np.testing.assert_array_equal(got, want)
            same_bits(got, want)
            assert got.flags.f_contiguous == (orders[k] == "f")
        assert not c["cube"].flags.c_contiguous
        assert c["cube"][1, 2, 3] == 23 and c["cube"][1, 0, 2] == cube[1, 0, 2]
        # Writing an F-order array read back keeps its order (no copy on the way out either).
        sdnb.save(tmp_path / "g.sdnb", {"cube": c["cube"]})
    with sdnb.open(tmp_path / "g.sdnb") as g:
        assert g.variables[0].order == "f"
        np.testing.assert_array_equal(g["cube"], cube)


def test_arrays_are_read_only_views_of_the_map(tmp_path):
    big = np.arange(MIB, dtype=np.float32)
    small = np.arange(10, dtype=np.int64)
    sdnb.save(tmp_path / "m.sdnb", {"big": big, "small": small, "bf": big[:8].astype(BF16)})
    with sdnb.open(tmp_path / "m.sdnb") as c:
        for k in ("big", "small", "bf"):
            a, b = c[k], c[k]
            assert np.shares_memory(a, b), "two reads view the same mapped bytes"
            assert not a.flags.owndata and not a.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                a[0] = 1
            base = a
            while isinstance(base, np.ndarray):
                base = base.base
            assert isinstance(base, memoryview) and base.readonly
            assert type(base.obj).__name__ == "RustBuffer"
        assert not np.shares_memory(c["big"], c["small"])


def test_closing_keeps_returned_arrays_valid(tmp_path):
    big = np.arange(MIB // 2, dtype=np.float64)
    sdnb.save(tmp_path / "m.sdnb", {"big": big, "small": big[:5].copy()})
    with sdnb.open(tmp_path / "m.sdnb") as c:
        kept = c["big"], c["small"]
        assert not c.closed
    assert c.closed and "closed" in repr(c)
    with pytest.raises(shardkit.InvalidArgumentError, match="closed"):
        c["big"]
    assert "big" in c and len(c) == 2 and c.metadata  # the listing stays
    del c
    gc.collect()
    np.testing.assert_array_equal(kept[0], big)
    np.testing.assert_array_equal(kept[1], big[:5])
    c = sdnb.open(tmp_path / "m.sdnb")
    c.close()
    c.close()  # idempotent


def test_mapping_api_metadata_and_repr(tmp_path):
    p = tmp_path / "m.sdnb"
    sdnb.save(
        p,
        {"w": np.ones((2, 2), np.float32), "c": np.int32(7)},
        metadata={"model.name": "tiny", "author": "ünï"},
        var_types={"c": "constant"},
    )
    c = sdnb.open(p)
    assert isinstance(c, collections.abc.Mapping)
    assert c.kind == "sdnb" and c.path == str(p) and c.op_count == 0
    assert c.parts == [str(p)] and c.extra_entries == []
    assert c.metadata["model.name"] == "tiny" and c.metadata["author"] == "ünï"
    assert c.metadata["nd4j.format.type"] == "APPENDED_BLOB" and "creation.time" in c.metadata
    assert {v.name: v.var_type for v in c.variables} == {"w": "VARIABLE", "c": "CONSTANT"}
    assert dict(c.items()).keys() == {"w", "c"} and c.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        c["nope"]
    with pytest.raises(KeyError, match=r"no extra entry 'tokenizer.json' \(has \[\]\)"):
        c.extra_entry("tokenizer.json")
    assert int(c["c"]) == 7 and c["c"].shape == ()
    r = repr(c)
    assert "sdnb.Container(" in r and "arrays=2" in r and "kind='sdnb'" in r
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'name'"):
        c.variables[0].name = "x"
    assert shardkit.sdnb is sdnb


def test_only_variables_with_arrays_are_keys(monkeypatch):
    """Placeholders and op outputs are listed in `variables` but are not mapping keys."""

    class Core:
        path, kind, metadata, op_count, parts, extra_entries, closed = "x.sdnb", "sdnb", [], 2, ["x.sdnb"], [], False
        variables = [
            dict(zip(("name", "var_type", "dtype", "shape", "storage", "nbytes", "order"), v, strict=True))
            for v in [
                ("in", "PLACEHOLDER", "FLOAT", [-1, 4], "none", 0, "c"),
                ("w", "VARIABLE", "FLOAT", [4, 2], "inline", 32, "c"),
                ("out", "ARRAY", "FLOAT", None, "none", 0, "c"),
                ("e", "CONSTANT", "INT64", [0], "empty", 0, "c"),
            ]
        ]

        def __init__(self, path):
            pass

        def array(self, name):
            return {"dtype": "FLOAT", "array": np.zeros((4, 2), np.float32)}

    monkeypatch.setattr(sdnb._core, "SdnbContainer", Core)
    c = sdnb.open("x.sdnb")
    assert list(c) == ["w", "e"] and len(c) == 2
    assert "in" not in c and "out" not in c
    with pytest.raises(KeyError, match="'in'"):
        c["in"]
    assert [v.shape for v in c.variables] == [(-1, 4), (4, 2), None, (0,)]


def test_without_ml_dtypes_bf16_and_fp8_read_as_bit_patterns(tmp_path, monkeypatch):
    bf = np.array([1.0, -2.5, np.nan], np.float32).astype(BF16)
    fp = np.array([0.5, -1.0, 448.0], np.float32).astype(FP8)
    sdnb.save(tmp_path / "m.sdnb", {"bf": bf, "fp": fp})
    monkeypatch.setattr(sdnb, "_BF16", None)
    monkeypatch.setattr(sdnb, "_FP8", None)
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert c["bf"].dtype == np.uint16 and c["bf"].tolist() == bf.view(np.uint16).tolist()
        assert c["fp"].dtype == np.uint8 and c["fp"].tolist() == fp.view(np.uint8).tolist()
        assert [v.dtype for v in c.variables] == ["BFLOAT16", "FLOAT8"]


def test_shard_sets_open_from_any_shard_or_the_base_name(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {f"w{i}": rng.standard_normal((300, 1000)).astype(np.float32) for i in range(4)}  # 1.2 MB each
    arrays["bias"] = np.arange(7, dtype=np.float32)
    files = sdnb.save(tmp_path / "model.sdnb", arrays, metadata={"k": "v"}, shard_size=3 * MIB)
    assert len(files) >= 3
    for f in files:
        assert re.fullmatch(r"model\.shard\d+-of-%d\.sdnb" % len(files), Path(f).name), f
        assert Path(f).is_file()
    assert not (tmp_path / "model.sdnb").exists()
    for target in [*files, tmp_path / "model.sdnb"]:
        with sdnb.open(target) as c:
            assert c.kind == "sharded" and len(c.parts) == len(files) and c.metadata["k"] == "v"
            assert sorted(c) == sorted(arrays)
            for k, want in arrays.items():
                same_bits(c[k], want)


def test_sdz_archives_are_stored_zips_with_extra_entries(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {"emb": rng.standard_normal((600, 512)).astype(np.float32), "b": np.arange(3, dtype=np.int64)}
    tok = b'{"version": "1.0"}'
    for name, shard_size in [("single.sdz", None), ("sharded.sdz", MIB)]:
        p = tmp_path / name
        files = sdnb.save(p, arrays, extra_entries={"tokenizer.json": tok}, shard_size=shard_size)
        assert files == [str(p)]
        with zipfile.ZipFile(p) as z:
            assert z.testzip() is None
            infos = z.infolist()
            assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
            names = [i.filename for i in infos]
            assert "tokenizer.json" in names and z.read("tokenizer.json") == tok
            models = [n for n in names if n != "tokenizer.json"]
            if shard_size is None:
                assert models == ["model.sdnb"]
            else:
                assert len(models) >= 2 and all(re.fullmatch(r"model\.shard\d+-of-\d+\.sdnb", n) for n in models)
        with sdnb.open(p) as c:
            assert c.kind == "sdz" and c.extra_entries == ["tokenizer.json"]
            assert c.extra_entry("tokenizer.json") == tok
            for k, want in arrays.items():
                same_bits(c[k], want)
                assert not c[k].flags.writeable


def test_convert_between_formats_keeps_every_byte(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        "a": rng.standard_normal((700, 500)).astype(np.float32),
        "f": np.asfortranarray(rng.standard_normal((400, 400))),
        "h": random_array(BF16, (9, 9), 4),
        "i": np.arange(5, dtype=np.uint8),
    }
    src = tmp_path / "src.sdnb"
    sdnb.save(src, arrays, metadata={"keep": "1", "over": "old"})
    sharded = sdnb.convert(src, tmp_path / "set.sdnb", shard_size=MIB)
    assert len(sharded) >= 2
    z = sdnb.convert(tmp_path / "set.sdnb", tmp_path / "z.sdz", metadata={"over": "new"})
    assert z == [str(tmp_path / "z.sdz")]
    with sdnb.open(tmp_path / "z.sdz") as c:
        back = sdnb.convert(c, tmp_path / "back.sdnb", format="sdnb")  # from an open container
    assert back == [str(tmp_path / "back.sdnb")]
    for p in [tmp_path / "set.sdnb", tmp_path / "z.sdz", tmp_path / "back.sdnb"]:
        with sdnb.open(p) as c:
            assert list(c) == list(arrays)
            assert c.metadata["keep"] == "1"
            assert c.metadata["over"] == ("old" if p.name == "set.sdnb" else "new")
            assert {v.name: v.order for v in c.variables}["f"] == "f"
            for k, want in arrays.items():
                same_bits(c[k], want)


def test_set_metadata_in_place_and_by_rewrite(tmp_path):
    arrays = {"w": np.arange(MIB // 4, dtype=np.float32), "b": np.ones(3, np.float16)}
    p = tmp_path / "m.sdnb"
    sdnb.save(p, arrays, metadata={"a": "1", "gone": "x"}, slack=4096)
    before = p.read_bytes()
    assert sdnb.set_metadata(p, {"a": "2", "gone": None, "new": "v"}) is True
    after = p.read_bytes()
    assert len(after) == len(before)
    with sdnb.open(p) as c:
        assert c.metadata["a"] == "2" and c.metadata["new"] == "v" and "gone" not in c.metadata
        for k, want in arrays.items():
            same_bits(c[k], want)
    huge = {"big": "x" * 20000}
    with pytest.raises(shardkit.CorruptDataError, match=re.escape(str(p))):
        sdnb.set_metadata(p, huge)
    assert p.read_bytes() == after, "a refused edit changes nothing"
    assert sdnb.set_metadata(p, huge, rewrite=True) is False
    with sdnb.open(p) as c:
        assert c.metadata["big"] == huge["big"] and c.metadata["a"] == "2"
        for k, want in arrays.items():
            same_bits(c[k], want)
    with pytest.raises(shardkit.InvalidArgumentError, match="nd4j.format"):
        sdnb.set_metadata(p, {"nd4j.format.version": "2"})
    # Archives and shard sets are edited in place too.
    sdnb.save(tmp_path / "m.sdz", arrays)
    assert sdnb.set_metadata(tmp_path / "m.sdz", {"a": "3"}) is True
    with zipfile.ZipFile(tmp_path / "m.sdz") as z:
        assert z.testzip() is None
    files = sdnb.save(tmp_path / "s.sdnb", arrays, shard_size=MIB // 2)
    assert sdnb.set_metadata(files[-1], {"a": "4"}) is True
    for p2, v in [(tmp_path / "m.sdz", "3"), (tmp_path / "s.sdnb", "4")]:
        with sdnb.open(p2) as c:
            assert c.metadata["a"] == v
            same_bits(c["w"], arrays["w"])


def test_errors_name_the_path_or_the_tensor(tmp_path):
    missing = tmp_path / "nope.sdnb"
    with pytest.raises(shardkit.NotFoundError, match=re.escape(str(missing))):
        sdnb.open(missing)
    junk = tmp_path / "junk.sdnb"
    junk.write_bytes(b"this is not a SameDiff container at all")
    with pytest.raises(shardkit.CorruptDataError, match=re.escape(str(junk))):
        sdnb.open(junk)
    trunc = tmp_path / "trunc.sdnb"
    sdnb.save(trunc, {"w": np.arange(MIB, dtype=np.float32)})
    trunc.write_bytes(trunc.read_bytes()[: 2 * MIB])
    with pytest.raises(shardkit.CorruptDataError, match=re.escape(str(trunc))):
        sdnb.open(trunc)
    out = tmp_path / "out.sdnb"
    for bad in [
        np.zeros(3, np.complex64),
        np.array(["a", "b"]),
        np.array([object()], dtype=object),
        np.zeros(3, ml_dtypes.float8_e5m2),
        np.zeros(3, np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.zeros(3, np.complex128),
    ]:
        with pytest.raises(shardkit.InvalidArgumentError, match=r"tensor 'bad'.*cannot be stored"):
            sdnb.save(out, {"ok": np.zeros(2), "bad": bad})
    assert not out.exists()
    with pytest.raises(shardkit.InvalidArgumentError, match="VARIABLE or CONSTANT"):
        sdnb.save(out, {"w": np.zeros(2)}, var_types={"w": "PLACEHOLDER"})
    with pytest.raises(shardkit.InvalidArgumentError, match="not among the tensors"):
        sdnb.save(out, {"w": np.zeros(2)}, var_types={"v": "CONSTANT"})
    with pytest.raises(shardkit.InvalidArgumentError, match="SDZ"):
        sdnb.save(out, {"w": np.zeros(2)}, extra_entries={"x": b"1"})
    with pytest.raises(shardkit.InvalidArgumentError, match="unknown container format"):
        sdnb.save(out, {"w": np.zeros(2)}, format="npz")
    with pytest.raises(shardkit.InvalidArgumentError, match="shard_size"):
        sdnb.save(out, {"w": np.zeros(2)}, format="sdnb", shard_size=MIB)
    with pytest.raises(shardkit.InvalidArgumentError, match="shard_size"):
        sdnb.save(out, {"w": np.zeros(2)}, shard_size=0)
    with pytest.raises(shardkit.InvalidArgumentError, match="alignment"):
        sdnb.save(out, {"w": np.zeros(2)}, align=3)
    with pytest.raises(shardkit.InvalidArgumentError, match="empty name"):
        sdnb.save(out, {"": np.zeros(2)})
    with pytest.raises(shardkit.InvalidArgumentTypeError, match="metadata"):
        sdnb.save(out, {"w": np.zeros(2)}, metadata={"k": 1})
    assert not out.exists()
    with pytest.raises(shardkit.NotFoundError, match=re.escape(str(missing))):
        sdnb.set_metadata(missing, {"a": "b"})
    with pytest.raises(shardkit.NotFoundError, match=re.escape(str(missing))):
        sdnb.convert(missing, out)


def test_array_likes_and_byte_order(tmp_path):
    arrays = {
        "list": [[1.5, 2.5], [3.5, 4.5]],  # float64
        "int": 3,
        "be": np.arange(6, dtype=">i4").reshape(2, 3),  # stored little-endian
        "bool": np.array([True, False, True]),
    }
    sdnb.save(tmp_path / "m.sdnb", arrays)
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert c["list"].dtype == np.float64 and c["list"].tolist() == [[1.5, 2.5], [3.5, 4.5]]
        assert c["int"].shape == () and int(c["int"]) == 3
        assert c["be"].dtype == np.dtype("<i4") and c["be"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert c["bool"].dtype == np.bool_ and c["bool"].tolist() == [True, False, True]
        assert [v.dtype for v in c.variables] == ["DOUBLE", "INT64", "INT32", "BOOL"]


def test_torch_tensors(tmp_path):
    import torch
    t = {
        "f": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf": torch.arange(6, dtype=torch.bfloat16),
        "t": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # F-contiguous view
    }
    sdnb.save(tmp_path / "t.sdnb", t)
    with sdnb.open(tmp_path / "t.sdnb") as c:
        assert c["f"].tolist() == t["f"].tolist()
        assert c["bf"].dtype == BF16 and c["bf"].astype(np.float32).tolist() == list(range(6))
        assert c["t"].tolist() == t["t"].tolist()


def test_save_and_convert_report_byte_progress(tmp_path):
    seen = []
    arrays = {"w": np.ones((512, 1024), dtype=np.float32), "b": np.zeros(7, dtype=np.int8)}
    files = sdnb.save(tmp_path / "p.sdnb", arrays, progress=lambda d, t: seen.append((d, t)))
    size = os.path.getsize(files[0])
    assert seen and seen[-1] == (size, size)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    seen.clear()
    out = sdnb.convert(files[0], tmp_path / "p.sdz", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] > 0
    assert os.path.getsize(out[0]) > seen[-1][1]  # the archive adds headers around the entry
    # A callback that raises does not abort the write.
    sdnb.save(tmp_path / "q.sdnb", arrays, progress=lambda d, t: 1 / 0)
    assert np.array_equal(sdnb.open(tmp_path / "q.sdnb")["w"], arrays["w"])
