"""s3:// URLs against a real S3-protocol server on loopback (moto), with injected faults.

Round trips (written locally, uploaded, read remotely: equal items and batches; written
remotely, downloaded: byte-identical), kill-and-resume of a remote write at every object, and
each fault an object store produces: 503 SlowDown, 500 InternalError, a connection dropped
mid-body, a response slower than the timeout; retried within the budget, an error naming the
object and the byte range past it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _s3 import S3, environment

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    server = S3()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(s3: S3) -> Iterator[Dict[str, str]]:
    e = s3.env()
    with environment(e):
        yield e


def saev_metadata(n: int = 40) -> Dict[str, Any]:
    return {
        "family": "clip", "ckpt": "s3-test", "layers": [5, 11], "content_tokens_per_example": 6,
        "cls_token": True, "d_model": 16, "n_examples": n, "max_tokens_per_shard": 7 * 2 * 9,
        "data": "demo", "dataset": "demo", "protocol": "2.1",
    }


def saev_acts(first: int, n: int) -> np.ndarray:
    e = np.arange(first, first + n, dtype=np.float32)[:, None, None, None]
    rest = np.arange(2 * 7 * 16, dtype=np.float32).reshape(1, 2, 7, 16)
    return (1000 * e + rest).astype(np.float32)


def write_saev(root: Any, n: int = 40, labels: bool = True) -> str:
    with saev.Writer(root, saev_metadata(n), progress=False) as w:
        for e in range(0, n, 8):
            b = min(8, n - e)
            lab = (np.arange(b * 6, dtype=np.uint8).reshape(b, 6) + e) % 5 if labels else None
            w.write(saev_acts(e, b), lab)
    return w.path


def tree(d: Path) -> Dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and not p.name.startswith(".shardkit-") and p.name != "shardkit.checksums.json"
    }


def batches(loader: Any) -> list:
    out = []
    for b in loader:
        out.append({k: np.array(v) for k, v in b.items() if v is not None})
    return out


def same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --- saev ---------------------------------------------------------------------------------------


def test_saev_uploaded_reads_like_local(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    local = write_saev(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/acts/{Path(local).name}"
    done = shardkit.upload(local, url)
    assert done["copied"] >= 5 and done["skipped"] == 0
    # The commit record is there, and a second upload copies nothing but it.
    again = shardkit.upload(local, url)
    assert again["copied"] == 1 and again["skipped"] == done["copied"] - 1

    remote, here = saev.Dataset(url), saev.Dataset(local)
    assert remote.path == url and remote.n_examples == here.n_examples == 40
    np.testing.assert_array_equal(remote.get(3, 11, 2), here.get(3, 11, 2))
    ex, tok = np.array([39, 0, 17, 17]), np.array([6, 0, 3, 3])
    np.testing.assert_array_equal(remote.take(ex, 5, tok), here.take(ex, 5, tok))
    row_r, row_l = remote.indexed(11)[77], here.indexed(11)[77]
    assert row_r["token_label"] == row_l["token_label"] and "token_label" in row_r
    np.testing.assert_array_equal(row_r["act"], row_l["act"])

    before = shardkit.storage_counters()
    for kw in [
        dict(layer=11, batch_size=24, seed=3),
        dict(layer="all", batch_size=50, seed=1, memory_budget=1 << 20),
        dict(layer=5, batch_size=7, order="exact", seed=9),
    ]:
        same_batches(batches(saev.ShuffledLoader(url, **kw)), batches(saev.ShuffledLoader(local, **kw)))
    same_batches(batches(saev.OrderedLoader(url, layer=5, batch_size=33)), batches(saev.OrderedLoader(local, layer=5, batch_size=33)))
    after = shardkit.storage_counters()
    assert after["gets"] > before["gets"] and after["get_bytes"] > before["get_bytes"]

    # Rank split and resumption behave as locally.
    for rank in range(2):
        kw = dict(layer=11, batch_size=8, seed=4, rank=rank, world_size=2)
        same_batches(batches(saev.ShuffledLoader(url, **kw)), batches(saev.ShuffledLoader(local, **kw)))
    loader = saev.ShuffledLoader(url, layer=11, batch_size=16, seed=2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [np.array(b["act"]) for b in it]
    resumed = saev.ShuffledLoader(url, layer=11, batch_size=16, seed=2)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, np.array(b["act"])) for a, b in zip(rest, resumed, strict=True))

    info = saev.inspect(url)
    assert info["n_examples"] == 40 and info["complete"] is True
    report = saev.validate(url)
    assert report["valid"], report


def test_saev_remote_refusals_name_the_object(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    with pytest.raises(shardkit.NotFoundError, match=f"s3://{bucket}/nothing/metadata.json"):
        saev.Dataset(f"s3://{bucket}/nothing")
    # Everything but the commit record: an incomplete dataset, refused with what is present.
    local = Path(write_saev(tmp_path))
    c = s3.client()
    for name in ["metadata.json", "acts000000.bin", "acts000001.bin"]:
        c.put_object(Bucket=bucket, Key=f"part/{name}", Body=(local / name).read_bytes())
    with pytest.raises(shardkit.IncompleteDatasetError, match="shards.json is missing"):
        saev.Dataset(f"s3://{bucket}/part")
    # A truncated shard behind a commit record.
    c.put_object(Bucket=bucket, Key="part/shards.json", Body=(local / "shards.json").read_bytes())
    c.put_object(Bucket=bucket, Key="part/acts000002.bin", Body=(local / "acts000002.bin").read_bytes()[:100])
    for name in ["acts000003.bin", "acts000004.bin"]:
        c.put_object(Bucket=bucket, Key=f"part/{name}", Body=(local / name).read_bytes())
    with pytest.raises(shardkit.CorruptDataError, match=f"s3://{bucket}/part/acts000002.bin: shard is 100 bytes"):
        saev.Dataset(f"s3://{bucket}/part")
    assert not saev.validate(f"s3://{bucket}/part")["valid"]
    with pytest.raises(shardkit.InvalidArgumentError, match="names no bucket"):
        saev.Dataset("s3:///x")
    with pytest.raises(shardkit.InvalidArgumentError, match="verify needs local files"):
        write_url = f"s3://{bucket}/ok"
        shardkit.upload(local, write_url)
        saev.ShuffledLoader(write_url, layer=5, verify=True)


def test_saev_written_to_a_store_is_byte_identical(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    local = Path(write_saev(tmp_path / "local"))
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging")}):
        url = write_saev(f"s3://{bucket}/root")
    assert url == f"s3://{bucket}/root/{local.name}"
    # The staged copy is gone; the objects are the local write's files.
    assert not any((tmp_path / "staging").rglob("*.bin"))
    objects = s3.objects(bucket, f"root/{local.name}/")
    assert {k.split("/")[-1]: v for k, v in objects.items()} == {
        n: b for n, b in tree(local).items()
    } | {"shardkit.checksums.json": (local / "shardkit.checksums.json").read_bytes()}
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)
    # Writing the same dataset again finds it complete and writes nothing.
    puts = shardkit.storage_counters()["puts"]
    with saev.Writer(f"s3://{bucket}/root", saev_metadata(), progress=False) as w:
        assert w.already_complete
    assert shardkit.storage_counters()["puts"] == puts
    # A different dataset under the same name is refused, never overwritten.
    c = s3.client()
    md_key = f"root/{local.name}/metadata.json"
    c.put_object(Bucket=bucket, Key=md_key, Body=b'{"other": true}')
    with pytest.raises(shardkit.AlreadyExistsError, match="metadata.json"):
        saev.Writer(f"s3://{bucket}/root", saev_metadata(), progress=False)


KILLED_WRITER = """
import sys, numpy as np
sys.path.insert(0, {here!r})
from test_s3 import write_saev
write_saev(sys.argv[1])
"""


def test_saev_remote_write_killed_after_every_object_resumes_identically(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    local = Path(write_saev(tmp_path / "local"))
    n_objects = len(tree(local)) + 1  # the files and the checksums sidecar
    script = KILLED_WRITER.format(here=str(HERE))
    for k in range(1, n_objects + 1):
        bucket = s3.bucket()
        root = f"s3://{bucket}/root"
        staging = tmp_path / f"staging{k}"
        child_env = dict(os.environ, SHARDKIT_STAGING_DIR=str(staging), SHARDKIT_TEST_ABORT_AFTER_PUTS=str(k))
        r = subprocess.run([sys.executable, "-c", script, root], env=child_env, capture_output=True)
        assert r.returncode != 0, (k, r.stderr[-2000:])
        url = f"{root}/{local.name}"
        if k < n_objects:
            # The commit record goes last: until then readers refuse the dataset.
            with pytest.raises(shardkit.IncompleteDatasetError):
                saev.Dataset(url)
        with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
            assert write_saev(root) == url
        down = tmp_path / f"down{k}"
        shardkit.download(url, down)
        assert tree(down) == tree(local), k


# --- faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "500", "drop", "stall"])
def test_faults_are_retried_and_never_served(tmp_path: Path, s3: S3, kind: str) -> None:
    local = write_saev(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/{Path(local).name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    expected = batches(saev.ShuffledLoader(local, layer=11, batch_size=40, seed=5))
    extra = {"SHARDKIT_S3_TIMEOUT": "1"} if kind == "stall" else {}
    with environment(s3.env(proxy=True, **extra)):
        s3.proxy.arm(kind, 3)
        np.testing.assert_array_equal(saev.Dataset(url).get(7, 5, 3), saev.Dataset(local).get(7, 5, 3))
        s3.proxy.arm(kind, 3)
        same_batches(batches(saev.ShuffledLoader(url, layer=11, batch_size=40, seed=5)), expected)
        assert s3.proxy.injected == 3
        s3.proxy.arm(None)


@pytest.mark.parametrize("kind", ["503", "500", "drop"])
def test_a_spent_retry_budget_fails_naming_object_and_range(tmp_path: Path, s3: S3, kind: str) -> None:
    local = write_saev(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/{Path(local).name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    with environment(s3.env(proxy=True, SHARDKIT_S3_RETRIES="2")):
        ds = saev.Dataset(url)
        s3.proxy.arm(kind, 1000)
        with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/.*/acts00000\d\.bin \(bytes \d+\.\.\d+\)"):
            ds.get(7, 5, 3)
        # The loader reads labels.bin when it starts, then the shards: whichever fails first.
        with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/\S+\.bin \(bytes \d+\.\.\d+\)"):
            for _ in saev.ShuffledLoader(url, layer=11, batch_size=40, seed=5):
                pass
        assert s3.proxy.injected >= 3
        s3.proxy.arm(None)


# --- flat-tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["v3", "v2"])
def test_flat_tokens_uploaded_reads_like_local(tmp_path: Path, s3: S3, env: Dict[str, str], layout: str) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, size=int(n), dtype=np.uint32) for n in rng.integers(1, 60, size=300)]
    local = tmp_path / "tokens"
    chunking = dict(tokens_per_chunk=512) if layout == "v3" else {}
    with flat_tokens.Writer(local, "train", layout, progress=False, **chunking) as w:
        w.append(docs)
    bucket = s3.bucket()
    url = f"s3://{bucket}/tok"
    shardkit.upload(local, url)
    remote, here = flat_tokens.open(url)["train"], flat_tokens.open(local)["train"]
    assert len(remote) == len(here) == 300
    np.testing.assert_array_equal(remote[17], here[17])
    np.testing.assert_array_equal(remote.encoded(100, 5000), here.encoded(100, 5000))
    small = dict(sequences_per_read_block=8, read_blocks_per_shuffle_buffer=4)
    for kw in [dict(seq_len=32, batch_size=8, **small), dict(seq_len=16, batch_size=4, packed=False, seed=3, **small)]:
        same_batches(batches(flat_tokens.Loader(url, "train", **kw)), batches(flat_tokens.Loader(local, "train", **kw)))
    assert flat_tokens.validate(url)["valid"]
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)


def test_flat_tokens_missing_remote_dataset_names_the_url(s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    with pytest.raises(shardkit.ShardkitError, match=f"s3://{bucket}/none"):
        flat_tokens.open(f"s3://{bucket}/none")["train"]


# --- EAGLE-3 and SDNB: upload and download round trips --------------------------------------------


def test_eagle3_and_sdnb_round_trip_through_a_store(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    from test_eagle3 import write as write_eagle3

    cache = write_eagle3(tmp_path / "eagle3", n=7)
    bucket = s3.bucket()
    url = f"s3://{bucket}/cache"
    shardkit.upload(cache, url)
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(cache)
    assert eagle3.validate(down)["valid"]

    model = tmp_path / "m.sdnb"
    sdnb.save(model, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    shardkit.upload(model, f"s3://{bucket}/models/m.sdnb")
    shardkit.download(f"s3://{bucket}/models/m.sdnb", tmp_path / "m2.sdnb")
    assert (tmp_path / "m2.sdnb").read_bytes() == model.read_bytes()
