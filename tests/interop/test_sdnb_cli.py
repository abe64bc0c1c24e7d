"""`shardkit sdnb` as a user drives it: pack from safetensors and .npy directories, inspect,
unpack, metadata edits, conversions, and the refusals that protect files already on disk."""

import json
import subprocess

import numpy as np
import pytest

import safetensors.numpy as safetensors_numpy  # noqa: E402 - a required test dependency


def run(bin_, *args, ok=True):
    p = subprocess.run([bin_, "sdnb", *map(str, args)], capture_output=True, text=True)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def arrays():
    rng = np.random.default_rng(7)
    big = rng.standard_normal((600, 512)).astype(np.float32)  # 1.2 MB: appended
    big.view(np.uint32)[0, 0] = 0x7F800001  # a signalling NaN payload survives
    return {
        "encoder/w": big,
        "encoder/b": rng.standard_normal(512).astype(np.float16),
        "ids": np.arange(-5, 5, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


@pytest.fixture
def packed(tmp_path, shardkit_bin):
    src = tmp_path / "in.safetensors"
    safetensors_numpy.save_file(arrays(), str(src), metadata={"author": "ada"})
    out = tmp_path / "m.sdnb"
    run(shardkit_bin, "pack", "--from", src, "--out", out, "--meta", "model.name=tiny",
        "--constant", "ids")
    return out


def test_pack_inspect_unpack_round_trip(tmp_path, shardkit_bin, packed):
    info = json.loads(run(shardkit_bin, "inspect", packed, "--json").stdout)
    assert info["kind"] == "sdnb" and info["ops"] == 0
    assert info["metadata"]["author"] == "ada"
    assert info["metadata"]["model.name"] == "tiny"
    assert info["metadata"]["nd4j.format.type"] == "APPENDED_BLOB"
    by_name = {v["name"]: v for v in info["variables"]}
    assert by_name["encoder/w"]["storage"] == "appended"
    assert by_name["encoder/b"]["storage"] == "inline"
    assert by_name["empty"]["storage"] == "empty" and by_name["empty"]["shape"] == [0, 3]
    assert by_name["ids"]["var_type"] == "CONSTANT"
    assert by_name["encoder/w"]["bytes"] == 600 * 512 * 4
    part = info["parts"][0]
    assert part["blob_start"] % 64 == 0
    assert part["manifest_offset"] + part["manifest_bytes"] == packed.stat().st_size

    text = run(shardkit_bin, "inspect", packed).stdout
    assert "encoder/w" in text and "appended" in text

    out = tmp_path / "un"
    run(shardkit_bin, "unpack", packed, "--out", out)
    back = safetensors_numpy.load_file(str(out / "model.safetensors"))
    for k, v in arrays().items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert back[k].tobytes() == v.tobytes(), k

    # unpack -> pack keeps variable types and metadata.
    again = tmp_path / "again.sdnb"
    run(shardkit_bin, "pack", "--from", out / "model.safetensors", "--out", again)
    info2 = json.loads(run(shardkit_bin, "inspect", again, "--json").stdout)
    assert {v["name"]: v["var_type"] for v in info2["variables"]}["ids"] == "CONSTANT"
    assert info2["metadata"]["model.name"] == "tiny"


def test_npy_directory_round_trip_keeps_names_dtypes_and_order(tmp_path, shardkit_bin, packed):
    d = tmp_path / "npy"
    run(shardkit_bin, "unpack", packed, "--out", d, "--npy")
    index = json.loads((d / "sdnb-index.json").read_text())
    files = {a["name"]: a["file"] for a in index["arrays"]}
    assert files["encoder/w"] == "encoder%2Fw.npy"
    w = np.load(d / files["encoder/w"])
    assert w.tobytes() == arrays()["encoder/w"].tobytes()
    # Fortran-ordered .npy input is stored as 'f' and read back with the same values.
    plain = tmp_path / "plain"
    plain.mkdir()
    f = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    np.save(plain / "f.npy", f)
    np.save(plain / "c.npy", np.arange(4, dtype=np.uint16))
    out = tmp_path / "p.sdz"
    run(shardkit_bin, "pack", "--from", plain, "--out", out)
    info = json.loads(run(shardkit_bin, "inspect", out, "--json").stdout)
    assert info["kind"] == "sdz"
    v = {x["name"]: x for x in info["variables"]}
    assert v["f"]["order"] == "f" and v["c"]["dtype"] == "UINT16"
    un = tmp_path / "un2"
    run(shardkit_bin, "unpack", out, "--out", un)
    back = safetensors_numpy.load_file(str(un / "model.safetensors"))
    assert np.array_equal(back["f"], f)
    # Back from the index directory: same arrays.
    re = tmp_path / "re.sdnb"
    run(shardkit_bin, "pack", "--from", d, "--out", re)
    assert json.loads(run(shardkit_bin, "inspect", re, "--json").stdout)["variables"] == \
        json.loads(run(shardkit_bin, "inspect", packed, "--json").stdout)["variables"]


def test_meta_set_in_place_then_refuses_then_rewrites(tmp_path, shardkit_bin, packed):
    before = packed.read_bytes()
    info = json.loads(run(shardkit_bin, "inspect", packed, "--json").stdout)
    b = info["parts"][0]["blob_start"]
    run(shardkit_bin, "meta", "set", packed, "license=MIT", "--unset", "author")
    after = packed.read_bytes()
    assert after[:32] == before[:32] and after[b:] == before[b:]
    assert run(shardkit_bin, "meta", "get", packed, "license").stdout.strip() == "MIT"
    assert run(shardkit_bin, "meta", "get", packed, "author", ok=False).returncode == 1

    huge = "x" * 100_000
    p = run(shardkit_bin, "meta", "set", packed, f"notes={huge}", ok=False)
    assert p.returncode != 0 and "rewrite" in p.stderr
    assert packed.read_bytes() == after
    run(shardkit_bin, "meta", "set", packed, f"notes={huge}", "--rewrite")
    meta = json.loads(run(shardkit_bin, "meta", "get", packed).stdout)
    assert meta["notes"] == huge and meta["license"] == "MIT"

    p = run(shardkit_bin, "meta", "set", packed, "nd4j.format.version=2", ok=False)
    assert p.returncode != 0 and "cannot be edited" in p.stderr


def test_convert_between_layouts_keeps_bytes(tmp_path, shardkit_bin, packed):
    sharded = tmp_path / "s.sdnb"
    run(shardkit_bin, "convert", packed, sharded, "--shard-size", "1M")
    shards = sorted(tmp_path.glob("s.shard*-of-*.sdnb"))
    assert len(shards) >= 2
    sdz = tmp_path / "z.sdz"
    run(shardkit_bin, "convert", shards[-1], sdz, "--align", "4096")
    single = tmp_path / "back.sdnb"
    run(shardkit_bin, "convert", sdz, single)
    for p in (sharded, sdz, single):
        out = tmp_path / f"u-{p.name}"
        run(shardkit_bin, "unpack", p, "--out", out)
        back = safetensors_numpy.load_file(str(out / "model.safetensors"))
        for k, v in arrays().items():
            assert back[k].tobytes() == v.tobytes(), (p, k)
    info = json.loads(run(shardkit_bin, "inspect", sdz, "--json").stdout)
    assert info["parts"][0]["blob_start"] % 4096 == 0


def test_refusals_leave_files_alone(tmp_path, shardkit_bin, packed):
    src = tmp_path / "in.safetensors"
    before = packed.read_bytes()
    p = run(shardkit_bin, "pack", "--from", src, "--out", packed, ok=False)
    assert p.returncode != 0 and "--force" in p.stderr
    assert packed.read_bytes() == before
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model at all")
    p = run(shardkit_bin, "inspect", junk, ok=False)
    assert p.returncode != 0 and "junk.bin" in p.stderr and "not a SameDiff container" in p.stderr
    trunc = tmp_path / "trunc.sdnb"
    trunc.write_bytes(before[: len(before) // 2])
    p = run(shardkit_bin, "inspect", trunc, ok=False)
    assert p.returncode != 0 and "trunc.sdnb" in p.stderr
    p = run(shardkit_bin, "pack", "--from", src, "--out", tmp_path / "x.sdnb", "--align", "3",
            ok=False)
    assert p.returncode != 0 and "power of two" in p.stderr
    assert not (tmp_path / "x.sdnb").exists()
