"""Checksum sidecars from Python: every writer leaves one, shardkit.verify finds a flipped bit
(naming file and byte range), loaders with verify=True raise instead of serving damaged rows,
and shardkit.checksum adds a sidecar to data written by the reference implementations."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _cli import shardkit_cli
from _loaders import DATA, HOST

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "fixtures")


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def biggest_file(root):
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.endswith(".json")]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("which", list(DATA))
def test_every_writer_leaves_a_sidecar_that_finds_a_flipped_bit(tmp_path, which):
    args, kw = DATA[which](tmp_path)
    root = os.fspath(args[0])
    report = shardkit.verify(root)
    assert report == {"sidecar": True, "intact": True, "damage": []}
    victim = biggest_file(root)
    flip(victim, os.path.getsize(victim) // 2)
    report = shardkit.verify(root)
    assert report["sidecar"] and not report["intact"]
    (d,) = report["damage"]
    assert d["file"] == victim and d["start"] <= os.path.getsize(victim) // 2 < d["end"]
    assert "does not match its checksum" in d["what"]


@pytest.mark.parametrize("which", ["saev", "eagle3", "flat_tokens"])
def test_loaders_with_verify_raise_on_damage(tmp_path, which):
    args, kw = DATA[which](tmp_path)
    n = sum(1 for _ in HOST[which](*args, verify=True, **kw))
    assert n > 0
    root = os.fspath(args[0])
    victim = biggest_file(root)
    flip(victim, os.path.getsize(victim) - 3)  # payload bytes, past any header
    with pytest.raises(shardkit.CorruptDataError, match=os.path.relpath(victim, root).replace("/", ".")) as e:
        for _ in HOST[which](*args, verify=True, **kw):
            pass
    assert "checksum" in str(e.value)
    os.remove(os.path.join(root, "shardkit.checksums.json"))
    with pytest.raises(shardkit.NotFoundError, match="no checksums sidecar"):
        HOST[which](*args, verify=True, **kw)


@pytest.mark.parametrize("fmt,name,sidecar", [("sdnb", "m.sdnb", "m.sdnb.checksums.json"),
                                              ("sharded", "m.sdnb", "m.shard-set.checksums.json"),
                                              ("sdz", "m.sdz", "m.sdz.checksums.json")])
def test_containers_get_a_sidecar_beside_them(tmp_path, fmt, name, sidecar):
    files = sdnb.save(tmp_path / name, {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)},
                      format=fmt, shard_size=8192 if fmt == "sharded" else None)
    assert sorted(p.name for p in tmp_path.glob("*.checksums.json")) == [sidecar]
    assert shardkit.verify(files[0])["intact"]
    flip(files[-1], os.path.getsize(files[-1]) - 10)
    report = shardkit.verify(files[0])
    assert not report["intact"] and report["damage"][0]["file"] == os.fspath(files[-1])


def test_checksum_adds_a_sidecar_to_reference_data(tmp_path):
    src = os.path.join(FIXTURES, "saev")
    cand = [os.path.join(d) for d, _, fs in os.walk(src) if "metadata.json" in fs]
    assert cand, f"no saev fixture under {src}"
    ds = tmp_path / "ds"
    shutil.copytree(cand[0], ds)
    assert shardkit.verify(ds) == {"sidecar": False, "intact": False, "damage": []}
    sidecar = shardkit.checksum(ds)
    assert sidecar == os.fspath(ds / "shardkit.checksums.json")
    assert shardkit.verify(ds)["intact"]
    # The CLI agrees: validate --deep passes, then names the damaged file after a flip.
    cli = shardkit_cli()
    ok = subprocess.run([cli, "saev", "validate", "--deep", os.fspath(ds)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shard = sorted(p for p in os.listdir(ds) if p.startswith("acts"))[0]
    flip(ds / shard, 8)
    bad = subprocess.run([cli, "saev", "validate", "--deep", os.fspath(ds)], capture_output=True, text=True)
    assert bad.returncode != 0 and shard in bad.stdout and "does not match its checksum" in bad.stdout, bad.stdout



# --- shardkit's own edits keep the sidecar true (issue 32, class 1) -------------------------------



def cli(*args, ok=True):
    p = subprocess.run([shardkit_cli(), *(os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args)],
                       capture_output=True, text=True)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


def assert_deep_valid(report, files):
    """The whole `validate --deep` report: valid, no errors, and the note that every block of
    `files` files matched."""
    assert report["valid"] and report["errors"] == [], report
    sums = [n["message"] for n in report["notes"] if n["message"].startswith("checksums:")]
    assert len(sums) == 1 and sums[0].startswith(f"checksums: {files} file(s)"), report
    assert sums[0].endswith("every block matches"), report


def cli_deep(fmt, path, files):
    """`shardkit FMT validate --deep --json PATH`: exit 0 and the same full report."""
    p = cli(fmt, "validate", "--deep", "--json", path)
    assert_deep_valid(json.loads(p.stdout), files)


def settled(sidecar):
    """No change left in flight in the sidecar (its `previous` entry is gone)."""
    doc = json.loads(open(sidecar).read())
    assert set(doc) == {"shardkit_checksums", "algorithm", "files"}, doc
    return doc


def test_readme_eagle3_steps_keep_the_cache_valid(tmp_path):
    """README: synth, validate --deep, set-version 1 (and back): the cache stays valid, through
    the CLI and through Python, and verify finds it intact."""
    cache = tmp_path / "cache"
    cli("eagle3", "synth", "--out", cache, "--samples", 40, "--shard-size", 8, "--seq-length", 16, "--hidden", 8,
        "--draft-vocab", 32, "--version", 2)
    files = len(settled(cache / "shardkit.checksums.json")["files"])
    cli_deep("eagle3", cache, files)
    cli("eagle3", "set-version", cache, 1)
    cli_deep("eagle3", cache, files)
    assert_deep_valid(eagle3.validate(cache, deep=True), files)
    assert shardkit.verify(cache) == {"sidecar": True, "intact": True, "damage": []}
    assert eagle3.set_version(cache, 2)["format_version"] == 2
    assert_deep_valid(eagle3.validate(cache, deep=True), files)
    cli_deep("eagle3", cache, files)
    assert shardkit.verify(cache)["intact"]
    doc = settled(cache / "shardkit.checksums.json")
    assert len(doc["files"]) == files


SDNB_CASES = [("sdnb", "m.sdnb", "m.sdnb.checksums.json"),
              ("sharded", "m.sdnb", "m.shard-set.checksums.json"),
              ("sdz", "m.sdz", "m.sdz.checksums.json")]


def model():
    return {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "big": np.arange(1 << 19, dtype=np.float32)}


@pytest.mark.parametrize("fmt,name,sidecar", SDNB_CASES)
def test_sdnb_meta_set_keeps_the_sidecar_true(tmp_path, fmt, name, sidecar):
    """`shardkit sdnb meta set` and sdnb.set_metadata, in place and by rewrite, on a file, a
    shard set (by base name and by a shard) and an archive: verify intact after each."""
    path = tmp_path / name
    files = sdnb.save(path, model(), format=fmt, shard_size=1 << 20 if fmt == "sharded" else None, progress=False)
    n = len(files)
    cli("sdnb", "meta", "set", path, "license=MIT")
    assert sdnb.open(path).metadata["license"] == "MIT"
    cli_deep("sdnb", path, n)
    assert shardkit.verify(path) == {"sidecar": True, "intact": True, "damage": []}
    assert sdnb.set_metadata(files[-1], {"license": "Apache-2.0", "note": "x"}) is True
    assert_deep_valid(sdnb.validate(path, deep=True), n)
    assert shardkit.verify(files[0])["intact"]
    # Too big for the slack: a full rewrite, which records the new files' sidecar.
    assert sdnb.set_metadata(path, {"note": "y" * (100 << 10)}, rewrite=True) is False
    now = 1 if fmt == "sdz" else len(sdnb.open(path).parts)  # a rewrite re-cuts a shard set
    assert_deep_valid(sdnb.validate(path, deep=True), now)
    cli_deep("sdnb", path, now)
    settled(tmp_path / sidecar)
    assert sorted(p.name for p in tmp_path.glob("*.checksums.json")) == [sidecar]


def test_an_edit_refuses_to_record_damaged_bytes_as_good(tmp_path):
    """A flipped bit in the block a metadata edit rewrites refuses the edit (CorruptDataError
    naming the file and range); the file and its sidecar stay as they were."""
    path = tmp_path / "m.sdnb"
    sdnb.save(path, model(), progress=False)
    raw = path.read_bytes()
    blob = raw.find(np.arange(16, dtype=np.float32).tobytes(), 64)
    assert blob > 0 and raw[blob - 16] == 0  # zero slack before the first blob
    flip(path, blob - 16)
    before = (path.read_bytes(), (tmp_path / "m.sdnb.checksums.json").read_bytes())
    with pytest.raises(shardkit.CorruptDataError, match=r"m\.sdnb.*bytes 0 to 1048575 do not match their checksum.*not changed"):
        sdnb.set_metadata(path, {"k": "v"})
    assert (path.read_bytes(), (tmp_path / "m.sdnb.checksums.json").read_bytes()) == before


def test_conversions_into_one_directory_keep_their_own_sidecars(tmp_path):
    """m.sdnb, its conversion to m.sdz (Python) and again (CLI): each keeps its own sidecar; a
    shard set and an archive of one stem in another directory too."""
    sdnb.save(tmp_path / "m.sdnb", model(), progress=False)
    sdnb.convert(tmp_path / "m.sdnb", tmp_path / "m.sdz", progress=False)
    cli("sdnb", "convert", tmp_path / "m.sdnb", tmp_path / "m.sdz", "--force")
    other = tmp_path / "set"
    other.mkdir()
    shards = sdnb.convert(tmp_path / "m.sdnb", other / "m.sdnb", format="sharded", shard_size=1 << 20, progress=False)
    sdnb.convert(other / "m.sdnb", other / "m.sdz", progress=False)
    for path, n in [(tmp_path / "m.sdnb", 1), (tmp_path / "m.sdz", 1), (other / "m.sdnb", len(shards)),
                    (other / "m.sdz", 1)]:
        assert shardkit.verify(path) == {"sidecar": True, "intact": True, "damage": []}, path
        assert_deep_valid(sdnb.validate(path, deep=True), n)
        cli_deep("sdnb", path, n)
    assert sorted(p.name for p in tmp_path.glob("*.checksums.json")) == ["m.sdnb.checksums.json", "m.sdz.checksums.json"]
    assert sorted(p.name for p in other.glob("*.checksums.json")) == ["m.sdz.checksums.json", "m.shard-set.checksums.json"]


def test_verify_and_checksum_take_a_shard_sets_base_name(tmp_path):
    """shardkit.verify / shardkit.checksum / `sdnb checksum` accept every path sdnb.open does."""
    base = tmp_path / "model.sdnb"
    files = sdnb.save(base, model(), shard_size=1 << 20, progress=False)
    assert not base.exists() and len(files) >= 2
    assert shardkit.verify(base) == {"sidecar": True, "intact": True, "damage": []}
    (tmp_path / "model.shard-set.checksums.json").unlink()
    assert shardkit.verify(base) == {"sidecar": False, "intact": False, "damage": []}
    assert shardkit.checksum(base) == os.fspath(tmp_path / "model.shard-set.checksums.json")
    assert shardkit.verify(base)["intact"] and shardkit.verify(files[-1])["intact"]
    (tmp_path / "model.shard-set.checksums.json").unlink()
    cli("sdnb", "checksum", base)
    cli_deep("sdnb", base, len(files))
    flip(files[-1], os.path.getsize(files[-1]) - 10)
    report = shardkit.verify(base)
    assert not report["intact"] and [d["file"] for d in report["damage"]] == [os.fspath(files[-1])]
    with pytest.raises(shardkit.NotFoundError, match="none.sdnb"):
        shardkit.verify(tmp_path / "none.sdnb")


def test_sidecars_of_the_old_shared_name_are_still_read(tmp_path):
    """`BASE.checksums.json`, as earlier versions named every container's sidecar, still counts
    for the container it covers (and no other); `checksum` moves it to the container's name."""
    sdnb.save(tmp_path / "m.sdnb", model(), progress=False)
    sdnb.save(tmp_path / "m.sdz", model(), progress=False)
    (tmp_path / "m.sdnb.checksums.json").rename(tmp_path / "m.checksums.json")
    (tmp_path / "m.sdz.checksums.json").unlink()
    assert shardkit.verify(tmp_path / "m.sdnb")["intact"]
    assert shardkit.verify(tmp_path / "m.sdz")["sidecar"] is False
    assert sdnb.set_metadata(tmp_path / "m.sdnb", {"k": "v"}) is True
    assert_deep_valid(sdnb.validate(tmp_path / "m.sdnb", deep=True), 1)
    shardkit.checksum(tmp_path / "m.sdnb")
    assert not (tmp_path / "m.checksums.json").exists()
    assert shardkit.verify(tmp_path / "m.sdnb")["intact"]


def test_flat_tokens_mark_complete_keeps_the_sidecar_true(tmp_path):
    """Marking seqax data complete writes the root's .zattrs, which the sidecar then covers."""
    src = os.path.join(FIXTURES, "flat_tokens", "seqax_synthetic_dataset.zarr")
    ds = tmp_path / "seqax.zarr"
    shutil.copytree(src, ds)
    for d, _, fs in os.walk(ds):
        os.chmod(d, 0o755)
        for f in fs:
            os.chmod(os.path.join(d, f), 0o644)
    shardkit.checksum(ds)
    n = len(settled(ds / "shardkit.checksums.json")["files"])
    cli("tokens", "validate", "--mark", ds)
    assert flat_tokens.open(ds).train.completion == "complete"
    cli_deep("tokens", ds, n + 1)
    assert shardkit.verify(ds) == {"sidecar": True, "intact": True, "damage": []}
    assert ".zattrs" in settled(ds / "shardkit.checksums.json")["files"]
