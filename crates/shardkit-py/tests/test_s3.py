"""s3:// URLs against a real S3-protocol server on loopback (moto), with injected faults.

Round trips (written locally, uploaded, read remotely: equal items and batches; written
remotely, downloaded: byte-identical), kill-and-resume of a remote write after every PUT, and
each fault an object store produces: 503 SlowDown, 500 InternalError, a connection dropped
mid-body, a response slower than the timeout; retried within the budget, an error naming the
object and the byte range past it.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _cli import shardkit_cli
from _s3 import HOLD_GUARD_S, S3, environment, free_port, range_bytes, slot_quarters

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


def saev_labels(first: int, n: int) -> np.ndarray:
    return ((np.arange(n * 6).reshape(n, 6) + 6 * first) % 5).astype(np.uint8)


def write_saev(root: Any, n: int = 40, labels: bool = True, resume: bool = False) -> str:
    with saev.Writer(root, saev_metadata(n), progress=False, resume=resume) as w:
        for e in range(w.next_example, n, 8):
            b = min(8, n - e)
            w.write(saev_acts(e, b), saev_labels(e, b) if labels else None)
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
    for x, y in zip(a, b, strict=True):
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


def damaged_upload(s3: S3, bucket: str, good: Path, local: Path, key: str, damage: Any) -> str:
    """A copy of dataset `good` at `local` (its checksums and lock left out), damaged by
    `damage(local)`, then put object by object (no validation on the way) under `key`; its URL."""
    local.mkdir(parents=True)
    for p in good.iterdir():
        if not p.name.startswith(".shardkit-") and p.name != "shardkit.checksums.json":
            (local / p.name).write_bytes(p.read_bytes())
    damage(local)
    c = s3.client()
    for p in local.iterdir():
        c.put_object(Bucket=bucket, Key=f"{key}/{p.name}", Body=p.read_bytes())
    return f"s3://{bucket}/{key}"


def same_report(validate: Any, local: Path, url: str) -> Dict[str, Any]:
    """`validate` of the store's copy reports what it reports of the local one, paths aside."""
    here, there = validate(local), validate(url)
    swap = lambda r: json.loads(json.dumps(r).replace(str(local), "DATASET").replace(url, "DATASET"))  # noqa: E731
    assert swap(there) == swap(here), (there, here)
    return there


def test_saev_validated_in_a_store_reports_what_a_local_check_reports(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """`validate` of an s3:// URL makes every check a local `validate` makes (metadata and
    what saev itself would refuse, the directory's name, shards.json, each shard's size, gaps,
    labels.bin, leftovers of a write) from one listing, and lists every problem it finds, not
    the first."""
    bucket = s3.bucket()
    good = Path(write_saev(tmp_path / "good"))

    def damaged(name: str, damage: Any) -> Tuple[Any, Path, str]:
        local = tmp_path / name / good.name
        return saev.validate, local, damaged_upload(s3, bucket, good, local, f"{name}/{good.name}", damage)

    def several(d: Path) -> None:
        (d / "acts000002.bin").write_bytes((d / "acts000002.bin").read_bytes()[:100])
        (d / "acts000003.bin").unlink()
        (d / "labels.bin").write_bytes(b"\0" * 7)
        (d / ".acts000005.bin.tmp").write_bytes(b"x")

    report = same_report(*damaged("several", several))
    errors = {Path(e["file"]).name: e["message"] for e in report["errors"]}
    assert set(errors) == {"acts000002.bin", "acts000003.bin", "labels.bin"}, report
    assert "100 bytes; every shard must be" in errors["acts000002.bin"] and errors["acts000003.bin"] == "missing"
    assert any("leftovers of an interrupted shardkit write: .acts000005.bin.tmp" in n["message"] for n in report["notes"])
    report = same_report(*damaged("uncommitted", lambda d: (d / "shards.json").unlink()))
    assert [Path(e["file"]).name for e in report["errors"]] == ["shards.json"], report
    assert "missing: the dataset is incomplete" in report["errors"][0]["message"]
    report = same_report(*damaged("bad-metadata", lambda d: (d / "metadata.json").write_text("{")))
    assert [Path(e["file"]).name for e in report["errors"]] == ["metadata.json"], report
    report = same_report(*damaged("no-metadata", lambda d: (d / "metadata.json").unlink()))
    message = report["errors"][0]["message"]
    assert "no such file" in message and "not a saev dataset directory" in message, report
    shardkit.upload(good, f"s3://{bucket}/good/{good.name}")
    assert same_report(saev.validate, good, f"s3://{bucket}/good/{good.name}")["valid"]


def without_credentials(tmp_path: Path, **extra: str) -> Dict[str, Optional[str]]:
    """The environment of a machine with no AWS credentials anywhere (no keys, no ~/.aws
    files), reaching the server at ``extra``'s endpoint."""
    env: Dict[str, Optional[str]] = {
        k: None for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    }
    env.update(
        AWS_REGION="us-east-1",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
        **extra,
    )
    return env


def test_the_s3_endpoint_is_taken_before_the_general_one(tmp_path: Path, s3: S3) -> None:
    """AWS_ENDPOINT_URL_S3 names the server (plain HTTP allowed, as for AWS_ENDPOINT_URL) and
    wins over AWS_ENDPOINT_URL, as in AWS's own tools."""
    local = write_saev(tmp_path)
    url = f"s3://{s3.bucket()}/{Path(local).name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    # Nothing listens on the general endpoint: a read sent there would fail.
    env = s3.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_ENDPOINT_URL_S3=s3.endpoint,
                 SHARDKIT_S3_RETRIES="0")
    with environment(env):
        np.testing.assert_array_equal(saev.Dataset(url).get(7, 5, 3), saev.Dataset(local).get(7, 5, 3))


def test_a_public_bucket_is_read_unsigned_without_credentials(tmp_path: Path, s3: S3) -> None:
    """With AWS_SKIP_SIGNATURE=true a machine with no credentials reads a public bucket: every
    request goes unsigned, and the batches are exact (a private bucket refuses them, naming the
    object)."""
    local = write_saev(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/{Path(local).name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    expected = batches(saev.ShuffledLoader(local, layer=11, batch_size=40, seed=5))
    s3.proxy.signed_log.clear()
    with environment(without_credentials(tmp_path, AWS_ENDPOINT_URL=s3.proxy.url, AWS_SKIP_SIGNATURE="true")):
        with pytest.raises(shardkit.RemoteError, match=f"{url}/metadata.json: .*403"):
            saev.Dataset(url)
        public = {
            "Version": "2012-10-17",
            "Statement": [{
                "Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            }],
        }
        s3.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(public))
        np.testing.assert_array_equal(saev.Dataset(url).get(7, 5, 3), saev.Dataset(local).get(7, 5, 3))
        same_batches(batches(saev.ShuffledLoader(url, layer=11, batch_size=40, seed=5)), expected)
    assert s3.proxy.signed_log and not any(s3.proxy.signed_log), s3.proxy.signed_log


def test_without_credentials_the_error_says_what_to_set(tmp_path: Path, s3: S3) -> None:
    """With no credentials set, object_store asks the instance metadata service (here a closed
    port) as its last resort; the error names the dataset and says what to set."""
    bucket = s3.bucket()
    env = without_credentials(
        tmp_path, AWS_ENDPOINT_URL=s3.endpoint, AWS_METADATA_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        SHARDKIT_S3_RETRIES="0",
    )
    with environment(env):
        with pytest.raises(shardkit.RemoteError) as e:
            saev.Dataset(f"s3://{bucket}/acts")
    message = str(e.value)
    assert f"s3://{bucket}/acts" in message, message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SKIP_SIGNATURE=true" in message, message


@pytest.mark.parametrize("name,value", [
    ("SHARDKIT_S3_INFLIGHT", "many"), ("SHARDKIT_S3_TIMEOUT", "-1"), ("SHARDKIT_S3_RETRY_TIMEOUT", "1e999"),
    ("SHARDKIT_CACHE_GIB", "50GB"), ("SHARDKIT_S3_LOCK", "maybe"),
])
def test_a_setting_that_does_not_parse_is_refused_naming_it(tmp_path: Path, s3: S3, name: str, value: str) -> None:
    """A typo in a setting is an error naming the variable when the store is first used, not a
    silent fall back to the default."""
    bucket = s3.bucket()
    with environment(s3.env(**{name: value})):
        with pytest.raises(shardkit.InvalidArgumentError, match=f"{name}=\"{value}\" is not"):
            saev.Dataset(f"s3://{bucket}/acts")
        with pytest.raises(shardkit.InvalidArgumentError, match=name):
            saev.Writer(f"s3://{bucket}/new", saev_metadata(), progress=False)


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
write_saev(sys.argv[1], labels=sys.argv[2] == "labels")
"""


def killed_after_puts(puts: int, staging: Path, script: str, *args: str) -> "subprocess.CompletedProcess[bytes]":
    """Runs `script` (a writer, in a child process staging in `staging`) with `args`, the child
    aborting right after its `puts`-th PUT, as a killed job would."""
    child_env = dict(os.environ, SHARDKIT_STAGING_DIR=str(staging), SHARDKIT_TEST_ABORT_AFTER_PUTS=str(puts))
    return subprocess.run([sys.executable, "-c", script, *args], env=child_env, capture_output=True)


def puts_of_a_whole_saev_write(tmp_path: Path, s3: S3, labels: bool) -> int:
    """The PUTs an uninterrupted remote write of `write_saev`'s dataset makes."""
    before = shardkit.storage_counters()["puts"]
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging-count")}):
        write_saev(f"s3://{s3.bucket()}/root", labels=labels)
    return shardkit.storage_counters()["puts"] - before


def test_saev_remote_write_killed_after_every_object_resumes_identically(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    # Shards are uploaded as they are finished, each followed by the upload journal; the kill
    # comes after every one of those PUTs in turn.
    local = Path(write_saev(tmp_path / "local"))
    n_puts = puts_of_a_whole_saev_write(tmp_path, s3, labels=True)
    n_shards = len(list(local.glob("acts*.bin")))
    # metadata.json; per shard its labels, a journal, the shard, a journal; labels.bin, the
    # sidecar and shards.json.
    assert n_shards >= 3 and n_puts == 4 * n_shards + 4, (n_shards, n_puts)
    script = KILLED_WRITER.format(here=str(HERE))
    for k in range(1, n_puts + 1):
        bucket = s3.bucket()
        root = f"s3://{bucket}/root"
        staging = tmp_path / f"staging{k}"
        r = killed_after_puts(k, staging, script, root, "labels")
        assert r.returncode != 0, (k, r.stderr[-2000:])
        url = f"{root}/{local.name}"
        if k < n_puts:
            # The commit record goes last: until then readers refuse the dataset.
            with pytest.raises(shardkit.IncompleteDatasetError, match=r"shards.json is missing \(it is written last\)"):
                saev.Dataset(url)
        with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
            assert write_saev(root, resume=True) == url
        down = tmp_path / f"down{k}"
        shardkit.download(url, down)
        assert tree(down) == tree(local), k
        # The journal goes with the commit; the staging directory with the write.
        assert not [o for o in s3.objects(bucket, "root/") if ".shardkit-" in o], k
        assert not staging.exists() or not [p for p in staging.rglob("*") if p.is_file()], k


@pytest.mark.parametrize("labels", [False, True])
def test_saev_remote_write_resumes_on_another_machine(
    tmp_path: Path, s3: S3, env: Dict[str, str], labels: bool
) -> None:
    """A killed remote write resumed without its staging directory (a new machine) keeps the
    shards its journal names, and with labels the shards whose labels it names too (labels.bin
    is rebuilt from them)."""
    local = Path(write_saev(tmp_path / "local", labels=labels))
    n_shards = len(list(local.glob("acts*.bin")))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    url = f"{root}/{local.name}"
    # metadata.json, then (labels and) shards and journals, two uploading at a time: killed
    # after two shards' worth of PUTs.
    abort_after = 9 if labels else 5
    script = KILLED_WRITER.format(here=str(HERE))
    r = killed_after_puts(abort_after, tmp_path / "lost", script, root, "labels" if labels else "none")
    assert r.returncode != 0, r.stderr[-2000:]
    objects = s3.objects(bucket, "root/")
    journal = json.loads(objects[f"root/{local.name}/.shardkit-upload.json"])
    assert journal["labels"] is labels
    # The journal names only shards in the store; the resumed write keeps its longest prefix.
    assert journal["files"] and all(f"root/{local.name}/{n}" in objects for n in journal["files"])

    def journaled(k: int) -> bool:
        names = [f"acts{k:06d}.bin"] + ([f".shardkit-labels/acts{k:06d}.bin"] if labels else [])
        return all(n in journal["files"] for n in names)

    kept = next(k for k in range(n_shards + 1) if not journaled(k))
    assert kept >= 1

    staging = tmp_path / "new-machine"
    with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
        # An interrupted write is not overwritten without resume=True.
        with pytest.raises(shardkit.AlreadyExistsError, match="interrupted write"):
            saev.Writer(root, saev_metadata(), progress=False)
        if labels:
            # Labels fetched back are checked against the journal's checksums.
            key = f"root/{local.name}/.shardkit-labels/acts000000.bin"
            good = objects[key]
            s3.client().put_object(Bucket=bucket, Key=key, Body=bytes([good[0] ^ 1]) + good[1:])
            with pytest.raises(shardkit.ShardkitError, match="shardkit-labels/acts000000.bin.*does not match the checksums"):
                saev.Writer(root, saev_metadata(), progress=False, resume=True)
            s3.client().put_object(Bucket=bucket, Key=key, Body=good)
        w = saev.Writer(root, saev_metadata(), progress=False, resume=True)
        per_shard = saev_metadata()["max_tokens_per_shard"] // 7 // 2
        assert w.next_example == kept * per_shard
        w.abort()
        before = shardkit.storage_counters()["puts"]
        assert write_saev(root, labels=labels, resume=True) == url
        puts = shardkit.storage_counters()["puts"] - before
    # Kept shards are not uploaded again: per shard written, (its labels and a journal,) the
    # shard and a journal; then labels.bin (with labels), the sidecar and shards.json.
    written = n_shards - kept
    # (The journal, less what lay past the kept shards, was rewritten by the writer opened
    # above.)
    assert puts == (4 if labels else 2) * written + 2 + int(labels), puts
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)
    assert not [o for o in s3.objects(bucket, "root/") if ".shardkit-" in o]
    # The sidecar covers the kept shards too (their checksums came from the journal).
    assert shardkit.verify(url)["intact"]


def lock_of(s3: S3, bucket: str, prefix: str) -> Any:
    objects = s3.objects(bucket, prefix)
    key = f"{prefix}.shardkit-lock.json"
    return json.loads(objects[key]) if key in objects else None


def test_two_writers_of_one_dataset_in_a_store_exclude_each_other(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Two writers of one dataset on two machines (two staging directories): the second is
    refused while the first runs, naming it; once the first ends, the second resumes."""
    local = Path(write_saev(tmp_path / "local"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    prefix = f"root/{local.name}/"
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "a")}):
        a = saev.Writer(root, saev_metadata(), progress=False)
        a.write(saev_acts(0, 8), saev_labels(0, 8))
    lock = lock_of(s3, bucket, prefix)
    assert lock["host"] == socket.gethostname() and lock["pid"] == os.getpid(), lock
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "b")}):
        for resume in (False, True):
            with pytest.raises(shardkit.LockedError, match=rf"\.shardkit-lock\.json: another writer \(.* pid {os.getpid()},"):
                saev.Writer(root, saev_metadata(), progress=False, resume=resume)
        # The refused writer left the lock as it was.
        assert lock_of(s3, bucket, prefix) == lock
        a.abort()
        # A writer that ends releases its lock.
        assert lock_of(s3, bucket, prefix) is None
        assert write_saev(root, resume=True) == f"{root}/{local.name}"
    down = tmp_path / "down"
    shardkit.download(f"{root}/{local.name}", down)
    assert tree(down) == tree(local)
    assert not [o for o in s3.objects(bucket, "root/") if ".shardkit-" in o]


@pytest.mark.parametrize("what", ["tokens", "eagle3"])
def test_flat_tokens_and_eagle3_writers_in_a_store_exclude_each_other(
    tmp_path: Path, s3: S3, env: Dict[str, str], what: str
) -> None:
    """The same lock guards flat-tokens and EAGLE-3 writes to a store."""
    from test_eagle3 import config

    bucket = s3.bucket()
    url = f"s3://{bucket}/ds"

    def open_writer() -> Any:
        if what == "tokens":
            return flat_tokens.Writer(
                url, "train", progress=False, resume=True,
                checkpoint_tokens=1000, tokens_per_shard=1024, tokens_per_chunk=256,
            )
        return eagle3.Writer(url, config(n=6, s=2), resume=True)

    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "a")}):
        a = open_writer()
    assert lock_of(s3, bucket, "ds/")["pid"] == os.getpid()
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "b")}):
        with pytest.raises(shardkit.LockedError, match=r"ds/\.shardkit-lock\.json: another writer"):
            open_writer()
        a.abort()
        assert lock_of(s3, bucket, "ds/") is None
        write_tokens_and_eagle3(what, url, resume=True)
    assert not [o for o in s3.objects(bucket) if ".shardkit-" in o]
    local = tmp_path / "local"
    write_tokens_and_eagle3(what, str(local))
    shardkit.download(url, tmp_path / "down")
    assert tree(tmp_path / "down") == tree(local)


def test_a_store_lock_is_taken_over_only_when_its_holder_is_gone(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Another machine's lock stands until its lease runs out; then it is taken over. A lock
    object that is not shardkit's is refused, naming it."""
    local = Path(write_saev(tmp_path / "local"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    key = f"root/{local.name}/.shardkit-lock.json"

    def plant(body: bytes) -> None:
        s3.client().put_object(Bucket=bucket, Key=key, Body=body)

    def other(renewed: int) -> bytes:
        return json.dumps({
            "shardkit_lock": 1, "host": "other-node", "boot_id": "elsewhere", "pid": 1,
            "token": "t", "renewed_unix": renewed, "lease_s": 120,
        }).encode()

    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging")}):
        plant(other(int(time.time()) - 60))
        with pytest.raises(shardkit.LockedError, match=r"another writer \(other-node pid 1, lock renewed \d+ s ago, lease 120 s\)"):
            saev.Writer(root, saev_metadata(), progress=False)
        plant(b"{}")
        with pytest.raises(shardkit.CorruptDataError, match=r"\.shardkit-lock\.json.*not a shardkit writer's lock"):
            saev.Writer(root, saev_metadata(), progress=False)
        plant(other(int(time.time()) - 121))
        assert write_saev(root) == f"{root}/{local.name}"
    assert not [o for o in s3.objects(bucket, "root/") if ".shardkit-" in o]
    down = tmp_path / "down"
    shardkit.download(f"{root}/{local.name}", down)
    assert tree(down) == tree(local)


def test_a_writer_whose_store_lock_was_taken_over_does_not_commit(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """The lock is renewed every quarter lease; a writer that finds it taken over writes
    nothing more, commits nothing and leaves the new holder's lock in place."""
    local = Path(write_saev(tmp_path / "local"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    prefix = f"root/{local.name}/"
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging"), "SHARDKIT_S3_LOCK_LEASE_S": "2"}):
        w = saev.Writer(root, saev_metadata(), progress=False)
        w.write(saev_acts(0, 8), saev_labels(0, 8))
        first = lock_of(s3, bucket, prefix)
        assert first["lease_s"] == 2
        deadline = time.time() + 10
        while lock_of(s3, bucket, prefix)["renewed_unix"] == first["renewed_unix"]:
            assert time.time() < deadline, "the lock was not renewed"
            time.sleep(0.2)
        theirs = dict(first, host="other-node", boot_id="elsewhere", pid=1, token="theirs")
        s3.client().put_object(Bucket=bucket, Key=f"{prefix}.shardkit-lock.json", Body=json.dumps(theirs).encode())
        with pytest.raises(shardkit.LockedError, match="taken over by another writer"):
            for e in range(8, 40, 8):
                w.write(saev_acts(e, 8), saev_labels(e, 8))
            w.close()
        w.abort()
    objects = s3.objects(bucket, prefix)
    assert f"{prefix}shards.json" not in objects
    assert json.loads(objects[f"{prefix}.shardkit-lock.json"])["token"] == "theirs"


def test_a_writer_dropped_unclosed_ends_without_the_gil(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """A writer garbage-collected without close() or abort() ends as abort() does (its
    finished shards uploaded, its lock deleted), with the GIL released: the server here runs in
    this process (its proxy, a Python thread, answers each request), so the requests of a
    writer ending with the GIL held could only be answered once it had given up on them."""
    local = Path(write_saev(tmp_path / "local"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    prefix = f"root/{local.name}/"
    for what in ("saev", "tokens"):
        with environment({**s3.env(proxy=True), "SHARDKIT_STAGING_DIR": str(tmp_path / what)}):
            if what == "saev":
                w: Any = saev.Writer(root, saev_metadata(), progress=False)
                w.write(saev_acts(0, 32), saev_labels(0, 32))
            else:
                prefix = "ds/"
                w = flat_tokens.Writer(f"s3://{bucket}/ds", "train", progress=False, checkpoint_tokens=1000)
                w.append(tokens_docs(60))
                w.flush()  # a commit: its checkpoint goes to the journal
            assert lock_of(s3, bucket, prefix) is not None
            start = len(s3.proxy.request_log)
            del w
            gc.collect()
            during = s3.proxy.request_log[start:]
        # The proxy took the writer's requests (the lock's removal among them) while it was
        # ending, inside gc.collect: with the GIL held, none could have arrived.
        assert during, what
        assert lock_of(s3, bucket, prefix) is None, what
        # What it had finished is in the store, journaled.
        journal = json.loads(s3.objects(bucket, prefix)[f"{prefix}.shardkit-upload.json"])
        assert journal["files"] if what == "saev" else journal["flat_tokens_checkpoint"]["seqs"] == 61, what  # seq_starts: 60 + 1


def test_store_writes_without_the_lock_when_it_is_turned_off(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """SHARDKIT_S3_LOCK=0 (for stores without conditional writes): no lock object is made."""
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging"), "SHARDKIT_S3_LOCK": "0"}):
        with saev.Writer(root, saev_metadata(), progress=False) as w:
            w.write(saev_acts(0, 8), saev_labels(0, 8))
            assert not [o for o in s3.objects(bucket, "root/") if o.endswith(".shardkit-lock.json")]
            for e in range(8, 40, 8):
                w.write(saev_acts(e, 8), saev_labels(e, 8))
    assert saev.Dataset(w.path).n_examples == 40


def test_saev_remote_write_stages_a_few_shards_not_the_dataset(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    n = 9 * 30  # 30 shards of 9 examples
    staging = tmp_path / "staging"
    most = 0
    # 16 requests in flight: 2 upload threads.
    with environment({"SHARDKIT_STAGING_DIR": str(staging), "SHARDKIT_S3_INFLIGHT": "16"}):
        with saev.Writer(f"s3://{s3.bucket()}/root", saev_metadata(n), progress=False) as w:
            for e in range(0, n, 6):
                w.write(saev_acts(e, 6), saev_labels(e, 6))
                most = max(most, len(list(staging.rglob("acts*.bin"))))
    local = Path(write_saev(tmp_path / "local", n=n))
    assert len(list(local.glob("acts*.bin"))) == 30
    # Two being uploaded, two queued, one being written (which the bound counts too).
    assert 1 <= most <= 5, most
    down = tmp_path / "down"
    shardkit.download(w.path, down)
    assert tree(down) == tree(local)


def tokens_docs(n: int = 300) -> List[Any]:
    return [np.arange(1 + i % 37, dtype=np.uint32) + i + 1 for i in range(n)]


def write_tokens(root: str, resume: bool = False, n: int = 300) -> None:
    """Writes the small flat-tokens dataset of the kill tests (`n` sequences, 1 Ki-token
    shards, a commit every 1,000 tokens) to `root`; resumed, it appends what the split lacks."""
    docs = tokens_docs(n)
    with flat_tokens.Writer(
        root,
        "train",
        progress=False,
        resume=resume,
        checkpoint_tokens=1000,
        tokens_per_shard=1024,
        tokens_per_chunk=256,
    ) as w:
        for i in range(w.resumed_from or 0, n, 25):
            w.append(docs[i : i + 25])


KILLED_TOKENS_AND_EAGLE3 = """
import sys
sys.path.insert(0, {here!r})
from test_s3 import write_tokens_and_eagle3
write_tokens_and_eagle3(sys.argv[1], sys.argv[2])
"""


def write_tokens_and_eagle3(what: str, root: str, resume: bool = False, n: int = 6) -> None:
    """Writes the small flat-tokens dataset or EAGLE-3 cache (`n` samples, 2 per shard) of the
    kill test to `root` (`resume`: continue a killed write, as locally)."""
    from test_eagle3 import config, sample

    if what == "tokens":
        write_tokens(root, resume=resume)
    else:
        with eagle3.Writer(root, config(n=n, s=2), resume=resume) as w:
            for i in range(w.next_sample, n):
                w.add(sample(i))


@pytest.mark.parametrize("what", ["tokens", "eagle3"])
def test_tokens_and_eagle3_remote_writes_killed_after_every_object_resume_identically(
    tmp_path: Path, s3: S3, env: Dict[str, str], what: str
) -> None:
    local = tmp_path / "local"
    write_tokens_and_eagle3(what, str(local))
    before = shardkit.storage_counters()["puts"]
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging-count")}):
        write_tokens_and_eagle3(what, f"s3://{s3.bucket()}/ds")
    n_puts = shardkit.storage_counters()["puts"] - before
    if what == "eagle3":
        # 3 shards streamed, each with the journal; then the sidecar and manifest.json.
        assert n_puts == 3 * 2 + 2, n_puts
    script = KILLED_TOKENS_AND_EAGLE3.format(here=str(HERE))
    opener = (lambda u: flat_tokens.open(u)["train"]) if what == "tokens" else eagle3.open
    commit_record = "ds/zarr.json" if what == "tokens" else "ds/manifest.json"
    for k in range(1, n_puts + 1):
        bucket = s3.bucket()
        url = f"s3://{bucket}/ds"
        staging = tmp_path / f"staging{k}"
        r = killed_after_puts(k, staging, script, what, url)
        committed = commit_record in s3.objects(bucket)
        # flat-tokens records a checkpoint in the journal with whichever PUT completes it, so
        # a write's PUT count varies by one or two between runs: a child may finish at k.
        assert r.returncode != 0 or committed, (k, r.stderr[-2000:])
        if not committed:
            # The commit record goes last: until then readers refuse the dataset, as missing
            # (or, for flat-tokens before its first chunk, as a prefix that is no zarr group).
            with pytest.raises(shardkit.ShardkitError) as e:
                opener(url)
            refusal = (type(e.value), str(e.value))
            if what == "eagle3":
                assert refusal == (shardkit.NotFoundError, f"{url}/manifest.json: no manifest.json: not an EAGLE-3 or DSpark cache, or one not uploaded yet"), refusal
            else:
                assert refusal in [
                    (shardkit.NotFoundError, f"{url}: holds neither a train nor a validation split (a zarr group with either)"),
                    (shardkit.CorruptDataError, f"{url}: not a zarr group (no zarr.json or .zgroup); expected a flat-tokens dataset"),
                ], refusal
        if r.returncode != 0:
            with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
                # A killed write is continued with resume=True, as locally (killed after the
                # commit, the rerun finds the dataset complete and writes nothing).
                write_tokens_and_eagle3(what, url, resume=True)
        down = tmp_path / f"down{k}"
        shardkit.download(url, down)
        assert tree(down) == tree(local), k
        assert not [o for o in s3.objects(bucket) if ".shardkit-" in o], k
        assert not staging.exists() or not [p for p in staging.rglob("*") if p.is_file()], k


KILLED_V2_TOKENS = """
import sys
sys.path.insert(0, {here!r})
from test_s3 import write_v2_tokens
write_v2_tokens(sys.argv[1])
"""


def write_v2_tokens(root: str, resume: bool = False) -> None:
    """About 12 M tokens in seqax's v2 layout (4 Mi-token blosc chunks), a commit every 2 M."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 50000, size=int(n), dtype=np.uint32) for n in rng.integers(1, 4000, size=6000)]
    with flat_tokens.Writer(
        root, "train", None if resume else "v2", progress=False, resume=resume, checkpoint_tokens=2_000_000
    ) as w:
        for i in range(w.resumed_from or 0, len(docs), 200):
            w.append(docs[i : i + 200])


def test_tokens_v2_remote_write_resumes_on_another_machine(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """seqax's own layout streams and resumes the same way: killed once full chunks are in the
    store, resumed without the staging directory, byte-identical to a local write."""
    local = tmp_path / "local"
    write_v2_tokens(str(local))
    assert (local / "train" / "encoded_tokens" / ".zarray").exists()
    bucket = s3.bucket()
    url = f"s3://{bucket}/ds"
    r = killed_after_puts(14, tmp_path / "lost", KILLED_V2_TOKENS.format(here=str(HERE)), url)
    assert r.returncode != 0, r.stderr[-2000:]
    journal = json.loads(s3.objects(bucket)["ds/.shardkit-upload.json"])
    # v2 chunk keys; uploads run beside the writer, so how many are in varies from run to run.
    assert journal["files"] and all(
        n in {f"train/encoded_tokens/{i}" for i in range(3)} for n in journal["files"]
    ), journal["files"]
    assert journal["flat_tokens_checkpoint"]["seqs"] > 1
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "new-machine")}):
        write_v2_tokens(url, resume=True)
    shardkit.download(url, tmp_path / "down")
    assert tree(tmp_path / "down") == tree(local)
    assert not [o for o in s3.objects(bucket) if ".shardkit-" in o]


def test_tokens_remote_write_commits_chunks_that_hold_only_the_fill_value(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    """Empty sequences first: seq_starts' trailing chunk is all zeros, which zarr does not
    store; a commit streams without it and the dataset comes out as a local write's."""
    docs = [np.array([], dtype=np.uint32)] * 5 + tokens_docs(60)

    def write(root: str) -> None:
        with flat_tokens.Writer(
            root, "train", progress=False, checkpoint_tokens=1, tokens_per_shard=1024, tokens_per_chunk=256
        ) as w:
            w.append(docs[:5])
            w.flush()
            w.append(docs[5:])

    write(str(tmp_path / "local"))
    url = f"s3://{s3.bucket()}/ds"
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging")}):
        write(url)
    shardkit.download(url, tmp_path / "down")
    assert tree(tmp_path / "down") == tree(tmp_path / "local")
    assert len(flat_tokens.open(url)["train"]) == 65


def test_tokens_remote_write_resumes_on_another_machine(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """A killed remote flat-tokens write resumed without its staging directory continues from
    the last checkpoint in the store: the chunks below it are not uploaded again."""
    n = 1200  # about 22,000 tokens: 22 shards, a commit every 1,000 tokens
    local = tmp_path / "local"
    write_tokens(str(local), n=n)
    bucket = s3.bucket()
    url = f"s3://{bucket}/ds"
    script = KILLED_TOKENS_AND_EAGLE3.format(here=str(HERE)).replace(
        "write_tokens_and_eagle3(sys.argv[1], sys.argv[2])", "write_tokens(sys.argv[2], n=1200)"
    ).replace("import write_tokens_and_eagle3", "import write_tokens")
    r = killed_after_puts(40, tmp_path / "lost", script, "tokens", url)
    assert r.returncode != 0, r.stderr[-2000:]
    objects = s3.objects(bucket)
    journal = json.loads(objects["ds/.shardkit-upload.json"])
    cp = journal["flat_tokens_checkpoint"]
    assert cp["split"] == "train" and cp["seqs"] > 1
    # The checkpoint's trailing chunks are in the store under private names; every chunk the
    # journal names is there.
    assert all(f"ds/.shardkit-tail-{cp['slot']}/{k}" in objects for k in cp["tails"])
    assert journal["files"] and all(f"ds/{name}" in objects for name in journal["files"])
    # Nothing of the dataset itself is visible yet.
    with pytest.raises(shardkit.NotFoundError, match=r"holds neither a train nor a validation split"):
        flat_tokens.open(url)

    # A chunk a killed run uploaded past where the resumed write will end is deleted at the end.
    client = s3.client()
    client.put_object(Bucket=bucket, Key="ds/train/encoded_tokens/c/999", Body=b"stray")
    staging = tmp_path / "new-machine"
    with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
        with pytest.raises(shardkit.AlreadyExistsError, match="interrupted write"):
            flat_tokens.Writer(url, "train", progress=False)
        # A checkpoint chunk that is not what the checkpoint recorded is refused, naming it;
        # nothing is staged.
        tail = f"ds/.shardkit-tail-{cp['slot']}/{next(iter(cp['tails']))}"
        client.put_object(Bucket=bucket, Key=tail, Body=objects[tail][:-1] + b"!")
        with pytest.raises(shardkit.ShardkitError, match=f"{tail}.*does not match the checksums"):
            flat_tokens.Writer(url, "train", progress=False, resume=True)
        assert not staging.exists() or not [p for p in staging.rglob("*") if p.is_file()]
        client.put_object(Bucket=bucket, Key=tail, Body=objects[tail])
        with pytest.raises(shardkit.AlreadyExistsError, match="interrupted write of split \"train\""):
            flat_tokens.Writer(url, "validation", progress=False, resume=True)
        before = shardkit.storage_counters()["puts"]
        most = 0
        docs = tokens_docs(n)
        with flat_tokens.Writer(
            url, "train", progress=False, resume=True, checkpoint_tokens=1000, tokens_per_shard=1024, tokens_per_chunk=256
        ) as w:
            assert w.resumed_from == cp["seqs"] - 1
            for i in range(w.resumed_from, n, 25):
                w.append(docs[i : i + 25])
                most = max(most, len([p for p in staging.rglob("*") if p.is_file() and "/c/" in str(p)]))
        puts = shardkit.storage_counters()["puts"] - before
    # The kept chunks were not uploaded again (each would have cost its PUT and a journal's).
    kept = len(journal["files"])
    before = shardkit.storage_counters()["puts"]
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "whole")}):
        write_tokens(f"s3://{s3.bucket()}/ds", n=n)
    whole = shardkit.storage_counters()["puts"] - before
    assert kept >= 5 and puts <= whole - 2 * kept, (kept, puts, whole)
    # The staging directory held about one commit's chunks (1,000 tokens: one or two shards),
    # the trailing ones and those uploading; never the dataset.
    assert 1 <= most <= 8, most
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)
    assert shardkit.verify(url)["intact"]
    # The checkpoints' chunks and the journal went with the commit.
    assert not [o for o in s3.objects(bucket) if ".shardkit-" in o]
    assert not staging.exists() or not [p for p in staging.rglob("*") if p.is_file()]


def test_eagle3_remote_write_resumes_on_another_machine(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """A killed remote EAGLE-3 write resumed without its staging directory keeps the shards its
    journal names (the journal carries the manifest, which the store gets last)."""
    n = 40  # 20 shards
    local = tmp_path / "local"
    write_tokens_and_eagle3("eagle3", str(local), n=n)
    bucket = s3.bucket()
    url = f"s3://{bucket}/ds"
    script = KILLED_TOKENS_AND_EAGLE3.format(here=str(HERE)).replace(
        "sys.argv[2])", "sys.argv[2], n=40)"
    )
    r = killed_after_puts(8, tmp_path / "lost", script, "eagle3", url)
    assert r.returncode != 0, r.stderr[-2000:]
    objects = s3.objects(bucket)
    journal = json.loads(objects["ds/.shardkit-upload.json"])
    assert json.loads(journal["manifest"])["num_samples"] == n
    # The journal names only shards in the store (4 of the 8 PUTs were shards, the others
    # journals; uploads run two at a time); the resumed write keeps its longest prefix.
    assert 3 <= len(journal["files"]) <= 4
    assert all(f"ds/{name}" in objects for name in journal["files"])
    kept = next(k for k in range(21) if f"shard-{k:06d}.safetensors" not in journal["files"])
    assert kept >= 2
    from test_eagle3 import config

    staging = tmp_path / "new-machine"
    # 16 requests in flight: 2 upload threads.
    with environment({"SHARDKIT_STAGING_DIR": str(staging), "SHARDKIT_S3_INFLIGHT": "16"}):
        with pytest.raises(shardkit.AlreadyExistsError, match="interrupted write"):
            eagle3.Writer(url, config(n=n, s=2))
        # Another configuration is refused, naming the keys.
        with pytest.raises(shardkit.AlreadyExistsError, match="seq_length"):
            eagle3.Writer(url, config(n=n, s=2, seq=6), resume=True)
        before = shardkit.storage_counters()["puts"]
        most = 0
        with eagle3.Writer(url, config(n=n, s=2), resume=True) as w:
            assert w.next_sample == 2 * kept and w.resumed_from == 2 * kept
            from test_eagle3 import sample

            for i in range(2 * kept, n):
                w.add(sample(i))
                most = max(most, len(list(staging.rglob("shard-*.safetensors"))))
        puts = shardkit.storage_counters()["puts"] - before
    # The shards left, each with the journal; then the sidecar and manifest.json. A journal
    # naming a shard past the first missing one (two uploads ran at once when the write was
    # killed) is first rewritten without it: the resumed write uploads that shard again.
    past_gap = int(len(journal["files"]) > kept)
    assert puts == (20 - kept) * 2 + 2 + past_gap, (puts, kept, sorted(journal["files"]))
    # The staging directory held a few shards at a time, never the cache (two uploading, two
    # queued, one being written).
    assert 1 <= most <= 5, most
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)
    assert shardkit.verify(url)["intact"]
    # Resuming the complete cache writes nothing.
    with environment({"SHARDKIT_STAGING_DIR": str(staging)}):
        with pytest.raises(shardkit.AlreadyExistsError, match="complete"):
            eagle3.Writer(url, config(n=n, s=2))
        with eagle3.Writer(url, config(n=n, s=2), resume=True) as w:
            assert w.next_sample == n


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


def test_reads_in_flight_together_share_the_request_limit(tmp_path: Path, s3: S3) -> None:
    """A saev loader starts its next window's requests before the current window is in, and an
    EAGLE-3 loader keeps several batches' requests in flight: those reads share the process's
    SHARDKIT_S3_INFLIGHT slots (a full-size GET takes a slot, a smaller one a share by its size,
    down to a quarter: the store never holds more than the slots allow), every slot is used, and
    the batches are exact."""
    local, _, url = uploaded_big_saev(tmp_path, s3, n=64)
    cache = write_eagle3_cache(tmp_path / "eagle3", 9)
    e3_url = f"s3://{s3.bucket()}/eagle3"
    with environment(s3.env()):
        shardkit.upload(cache, e3_url)
    # Windows of 18 examples (2 MiB of one layer); each window is several 1 MiB requests.
    make = lambda p: saev.ShuffledLoader(p, layer=11, batch_size=64, seed=4, memory_budget=8 << 20)  # noqa: E731
    want = batches(make(local))
    e3 = lambda p: eagle3.Loader(p, batch_size=2, seed=3)  # noqa: E731
    want_e3 = batches(e3(cache))
    s3.proxy.wait_idle()
    q = slot_quarters(1 << 20)
    s3.proxy.get_delay_s = 0.05
    try:
        for limit in (2, 3):
            with environment(s3.env(proxy=True, SHARDKIT_S3_INFLIGHT=str(limit), SHARDKIT_S3_REQUEST_MIB="1")):
                # The store holds the data GETs unanswered from the first on, until the loader
                # has sent all its slots allow: saev's requests are 100 KiB to 1 MiB (a quarter to
                # a whole slot), taken first come first served, so they fill the slots but for
                # less than the next request's share (at most three quarters), and are more
                # GETs than slots. EAGLE-3's samples here are a few hundred bytes, a quarter
                # each: more GETs than slots (one a slot, they would stop at `limit`); its
                # shards' headers, fetched before their samples, are answered. Once
                # released, the reads run to the end (each GET 50 ms), the proxy counting what
                # it is answering at every arrival: never more than the slots allow.
                for name, read, data, enough in (
                    ("saev", lambda: same_batches(batches(make(url)), want), "/acts",
                     lambda p: sum(map(q, p.held.values())) >= 4 * limit - 3 and len(p.held) > limit),
                    ("eagle3", lambda: same_batches(batches(e3(e3_url)), want_e3), "/shard",
                     lambda p: len(p.held) > limit),  # headers (bytes=0-...) are not held
                ):
                    failed: List[BaseException] = []

                    def run(read: Callable[[], None] = read) -> None:
                        try:
                            read()
                        except BaseException as e:  # re-raised below, on the test's thread
                            failed.append(e)

                    s3.proxy.reset_peaks(q)
                    s3.proxy.hold(lambda path, rng, data=data: data in path and not rng.startswith("bytes=0-"))
                    reader = threading.Thread(target=run)
                    reader.start()
                    filled = s3.proxy.wait_until(enough)
                    with s3.proxy.lock:
                        held = sorted(map(q, s3.proxy.held.values()))
                    s3.proxy.release()
                    reader.join()
                    if failed:
                        raise failed[0]
                    assert filled and not s3.proxy.hold_expired, (name, limit, held)
                    assert s3.proxy.peak_weight <= 4 * limit, (name, limit, s3.proxy.peak_weight)
                    assert s3.proxy.peak_bytes <= limit << 20, (name, limit, s3.proxy.peak_bytes)
    finally:
        s3.proxy.release()
        s3.proxy.get_delay_s = 0.0


def test_a_read_started_later_waits_for_the_earlier_ones_requests(tmp_path: Path, s3: S3) -> None:
    """Two reads at once share the request slots first come first served, read by read: every
    request of the read started first takes a slot before any of the later one's (which then
    takes each slot the first frees). So a loader's next window never slows the window it
    waits for."""
    local, _, url = uploaded_big_saev(tmp_path, s3, n=96)

    def coords(shards: List[int]) -> tuple:
        """Every token of layer 11 of the shards' examples (32 each): 1 MiB requests."""
        examples = [e for s in shards for e in range(32 * s, 32 * s + 32) for _ in range(7)]
        return examples, [11] * len(examples), [t for _ in range(32 * len(shards)) for t in range(7)]

    reads = {"first": [0, 1], "second": [2]}
    want = {k: np.array(saev.Dataset(str(local)).take(*coords(v))) for k, v in reads.items()}
    s3.proxy.get_delay_s = 0.05
    try:
        with environment(s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="2", SHARDKIT_S3_REQUEST_MIB="1")):
            ds = saev.Dataset(url)
            got: Dict[str, np.ndarray] = {}
            mark = len(s3.proxy.get_log)

            def read(name: str) -> None:
                got[name] = np.array(ds.take(*coords(reads[name])))

            first = threading.Thread(target=read, args=("first",))
            first.start()
            deadline = time.monotonic() + 30
            while len(s3.proxy.get_log) == mark and time.monotonic() < deadline:
                time.sleep(0.005)
            second = threading.Thread(target=read, args=("second",))
            second.start()
            first.join()
            second.join()
        shards = [int(p.rsplit("acts", 1)[1].split(".")[0]) for p, _, _ in s3.proxy.get_log[mark:]]
        assert shards.count(2) > 2 and len(shards) > shards.count(2) + 4, shards
        # The first read's last request may reach the server just after the second read's
        # first (it took its slot first, but was sent a moment later); shared slots without
        # turns would interleave the two reads all along.
        late = [s for s in shards[shards.index(2):] if s != 2]
        assert len(late) <= 1, str(shards)
        for name in reads:
            np.testing.assert_array_equal(got[name], want[name])
    finally:
        s3.proxy.get_delay_s = 0.0


def test_a_dropped_loader_stops_its_requests(tmp_path: Path, s3: S3) -> None:
    """A saev loader dropped mid-epoch stops the requests of the window it had started ahead:
    the store sees no new GET once it is gone (before, the next window's requests ran to their
    end, holding the process's request slots from the loaders that come after)."""
    local, _, url = uploaded_big_saev(tmp_path, s3, n=128)
    s3.proxy.wait_idle()
    # Windows of 36 examples (4 MiB of one layer, over a dozen requests), one request at a
    # time: window 1's requests start early, queued behind window 0's. Batches of 8 rows: the
    # batches prepared ahead of the first all lie in window 0, so no worker waits for window 1
    # when the loader is dropped. The store holds every GET that starts outside window 0 (an
    # example is 2 layers x 7 tokens x 4096 floats, 32 a shard): window 1's are all still to
    # answer when the first batch comes.
    make = lambda p: saev.ShuffledLoader(p, layer=11, batch_size=8, seed=4, memory_budget=16 << 20)  # noqa: E731
    rows = [int(e) for b in batches(make(str(local)))[:31] for e in np.asarray(b["example_idx"])]
    window0 = set(rows[:252])
    example = 2 * 7 * 4096 * 4

    def outside_window0(path: str, rng: str) -> bool:
        shard = int(path.rsplit("acts", 1)[1].split(".")[0])
        return 32 * shard + int(rng.split("=")[1].split("-")[0]) // example not in window0

    try:
        with environment(s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="1", SHARDKIT_S3_REQUEST_MIB="1")):
            loader = make(url)
            s3.proxy.reset_peaks(slot_quarters(1 << 20))
            s3.proxy.hold(outside_window0)
            it = iter(loader)
            first = {k: np.array(v) for k, v in next(it).items() if v is not None}
            assert len(first["act"]) == 8
            assert s3.proxy.wait_until(lambda p: len(p.held) > 0), "the loader fetched nothing ahead"
            # Dropped while the store holds window 1's requests: it does not wait for them, and
            # sends no request after (before, window 1's requests ran to their end).
            dropped = [it, loader]
            del it, loader

            def drop() -> None:
                dropped.clear()
                gc.collect()

            stops_without_waiting_and_sends_nothing_after(drop, s3, tmp_path)
            # The slot is free: a new loader reads exact batches.
            again = next(iter(make(url)))
            same_batches([{k: np.array(v) for k, v in again.items() if v is not None}], [first])
    finally:
        s3.proxy.release()


def hold_requests(s3: S3, weigh: Callable[[int], int], fill: int = 4) -> None:
    """Holds the ranged GETs that reach the store from now on, unanswered, until those held
    weigh ``fill`` quarters of the one request slot (SHARDKIT_S3_INFLIGHT=1), each GET
    weighing ``weigh(its bytes)``. With all four held, none of the loader's requests can be on
    its way; requests of mixed sizes may leave a part of the slot too small for the next, so
    for them ``fill`` is less. Fails if they never do (the loader fetched nothing ahead)."""
    s3.proxy.reset_peaks(weigh)
    s3.proxy.hold()
    filled = s3.proxy.wait_until(lambda p: sum(map(p.weigh, p.held.values())) >= fill)
    assert filled, f"the loader fetched nothing ahead: {len(s3.proxy.held)} GET(s) held"


def stop_while_held(stop: Callable[[], None], s3: S3) -> Tuple[int, int]:
    """Runs ``stop`` (a loader's close, or its drop) while the store holds the requests the
    loader has in flight (`hold_requests`), unanswered: it must return without them. Then
    answers them. Returns a mark (a length of get_log) taken when ``stop`` returned, and the
    weight of the GETs held then."""
    stopper = threading.Thread(target=stop)
    stopper.start()
    stopper.join(2 * HOLD_GUARD_S)  # a hang guard: a stop that waits for the store never ends
    assert not stopper.is_alive(), "it waits for requests the store never answers"
    with s3.proxy.lock:
        held = sum(map(s3.proxy.weigh, s3.proxy.held.values()))
        expired, mark = s3.proxy.hold_expired, len(s3.proxy.get_log)
    # It returned while its requests were still unanswered: it did not wait for them.
    assert held > 0 and not expired, (held, expired)
    s3.proxy.release()
    return mark, held


def stops_without_waiting_and_sends_nothing_after(stop: Callable[[], None], s3: S3, tmp_path: Path) -> None:
    """`stop_while_held`, then `gets_after`: what reached the store after ``stop`` returned
    fits in the slot beside what was held then (requests it had sent, on their way), never a
    request that waited for the slot to free (sent after it)."""
    mark, held = stop_while_held(stop, s3)
    late = gets_after(mark, s3, tmp_path)
    assert held + sum(s3.proxy.weigh(range_bytes(r)) for _, r in late) <= 4, (held, late)


def gets_after(mark: int, s3: S3, tmp_path: Path) -> List[Tuple[str, str]]:
    """The ranged GETs that reached the store since ``mark`` (a length of get_log), once no
    read that was running then can send any more: a read made now takes the process's request
    slots after every read already waiting for them (first come first served, read by read),
    so once it is in, any read of a stopped loader still fetching has sent its requests. The
    GETs of that read are not counted (they are of another bucket)."""
    s3.proxy.get_delay_s = 0.0
    bucket = s3.bucket()
    local = write_saev(tmp_path / "barrier")
    shardkit.upload(local, f"s3://{bucket}/barrier")
    np.testing.assert_array_equal(saev.Dataset(f"s3://{bucket}/barrier").get(7, 5, 3), saev.Dataset(local).get(7, 5, 3))
    s3.proxy.wait_idle()
    return [(p, r) for p, r, _ in s3.proxy.get_log[mark:] if not p.startswith(f"/{bucket}/")]


def test_a_loader_closed_while_it_waits_for_a_window_goes_at_once(tmp_path: Path, s3: S3) -> None:
    """A saev loader closed while it waits for a window from the store stops that window's
    requests and returns, instead of waiting for the window to come in."""
    local, _, url = uploaded_big_saev(tmp_path, s3, n=256)
    s3.proxy.wait_idle()
    # Windows of 36 examples (252 rows, a dozen 1 MiB requests), one request at a time, 0.1 s
    # each. Batches of 512 rows: the first needs windows 0 to 2; while it is consumed, the
    # loader prepares the next and waits for windows 3 and 4 (two seconds of requests).
    s3.proxy.get_delay_s = 0.1
    try:
        with environment(s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="1", SHARDKIT_S3_REQUEST_MIB="1")):
            loader = saev.ShuffledLoader(url, layer=11, batch_size=512, seed=4, memory_budget=40 << 20)
            it = iter(loader)
            first = next(it)
            assert len(first["act"]) == 512
            hold_requests(s3, slot_quarters(1 << 20), fill=1)
            # close returns while the store holds the window's requests, and sends no request
            # after (before, the windows' requests all ran, close waiting for them).
            stops_without_waiting_and_sends_nothing_after(it.close, s3, tmp_path)
    finally:
        s3.proxy.release()
        s3.proxy.get_delay_s = 0.0


def uploaded_eagle3(tmp_path: Path, s3: S3) -> Tuple[Path, str]:
    """An EAGLE-3 cache of 64 samples in 32 shards of 2, written under ``tmp_path`` and uploaded
    to a new bucket (the proxy then idle): (local path, url)."""
    local = write_eagle3_cache(tmp_path / "e3", 64)
    url = f"s3://{s3.bucket()}/e3"
    with environment(s3.env()):
        shardkit.upload(local, url)
    s3.proxy.wait_idle()
    return local, url


def test_an_eagle3_loader_closed_while_a_batch_is_in_flight_goes_at_once(tmp_path: Path, s3: S3) -> None:
    """An EAGLE-3 loader from a store keeps the next batches' requests in flight; closed, it
    stops them, those of the batch it is waiting for included, and does not wait for them."""
    local, url = uploaded_eagle3(tmp_path, s3)
    kw = dict(batch_size=16, seed=3)
    want = batches(eagle3.Loader(local, **kw))
    # A batch touches a dozen shards: a dozen requests, 0.1 s each, four at a time (one
    # request slot; a request this small takes a quarter of it).
    s3.proxy.get_delay_s = 0.1
    try:
        with environment(s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="1")):
            it = iter(eagle3.Loader(url, **kw))
            same_batches([{k: np.array(v) for k, v in next(it).items() if v is not None}], want[:1])
            hold_requests(s3, slot_quarters(8 << 20))
            # close returns while the store holds the four requests in flight, and none is
            # sent once the stream stops. Before, the batch's requests all ran, close waiting for them;
            # and until each read saw the stop (polled every 50 ms), a request that ended let
            # the next one out.
            stops_without_waiting_and_sends_nothing_after(it.close, s3, tmp_path)
    finally:
        s3.proxy.release()
        s3.proxy.get_delay_s = 0.0


def test_eagle3_shard_headers_come_a_batch_at_a_time_and_are_kept(tmp_path: Path, s3: S3) -> None:
    """From a store, the headers of the shards a batch is the first to touch are fetched
    together (parallel GETs, one round trip for the batch, not one per shard), and a shard's
    header is fetched once: it is kept whatever max_open says (that bounds maps, which a shard
    in a store does not hold), so later epochs fetch no header."""
    local, url = uploaded_eagle3(tmp_path, s3)
    kw = dict(batch_size=16, seed=3)
    want = batches(eagle3.Loader(local, **kw))

    def header(path: str, rng: str) -> bool:
        # A shard's header is its first bytes (a data row never starts at 0).
        return rng.startswith("bytes=0-") and "shard" in path

    # The first batch's sixteen samples lie in about a dozen shards, whose headers are all
    # fetched at once: the store holds them unanswered until eight are waiting together (one
    # after another, one would wait alone, never answered, until the hold's guard ran out).
    together: List[bool] = []
    releaser = threading.Thread(target=lambda: together.append(s3.proxy.wait_until(lambda p: len(p.held) >= 8)) or s3.proxy.release())
    try:
        start = len(s3.proxy.get_log)
        with environment(s3.env(proxy=True)):
            loader = eagle3.Loader(url, **kw)
            s3.proxy.hold(header)
            releaser.start()
            same_batches(batches(loader), want)
            releaser.join()
            assert together == [True] and not s3.proxy.hold_expired, (together, s3.proxy.hold_expired)
            loader.set_epoch(0)
            same_batches(batches(loader), want)
            middle = len(s3.proxy.get_log)
            # Items, each shard's twice, from a cache of its own that keeps 2 shards mapped.
            items, here = eagle3.open(url, max_open=2), eagle3.open(local)
            for i in [*range(64), *range(64)]:
                np.testing.assert_array_equal(items[i]["aux_hidden_states"], here[i]["aux_hidden_states"])
        gets = list(s3.proxy.get_log)
    finally:
        s3.proxy.release()
        if releaser.is_alive():
            releaser.join()

    for part in [gets[start:middle], gets[middle:]]:
        per_shard: Dict[str, int] = {}
        for p, r, _ in part:
            if header(p, r):
                per_shard[p] = per_shard.get(p, 0) + 1
        assert len(per_shard) == 32 and set(per_shard.values()) == {1}, per_shard


def small_tokens_in_store(tmp_path: Path, s3: S3, seed: int) -> Tuple[Path, str, int]:
    """1000 random documents of 1-199 tokens written locally (v3, 256-token chunks, 4096-token
    shards) and uploaded to a new bucket, the proxy then idle: (local path, URL, tokens)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 1000, size=int(n), dtype=np.uint32) for n in rng.integers(1, 200, size=1000)]
    local = tmp_path / "tokens"
    with flat_tokens.Writer(local, "train", "v3", progress=False, tokens_per_chunk=256, tokens_per_shard=4096) as w:
        w.append(docs)
    url = f"s3://{s3.bucket()}/tok"
    with environment(s3.env()):
        shardkit.upload(local, url)
    s3.proxy.wait_idle()
    return local, url, sum(map(len, docs))


def test_a_tokens_loader_closed_stops_the_buffer_it_reads_ahead(tmp_path: Path, s3: S3) -> None:
    """A flat-tokens loader from a store reads the next minipoch's shuffle buffer in the
    background; closed, it stops that read, the requests of the groups being fetched included,
    instead of fetching the buffer for nobody, and close does not wait for it."""
    local, url, _ = small_tokens_in_store(tmp_path, s3, seed=5)
    # Two minipochs of about 50 k tokens each, read in groups of one 512-token block (a data
    # range, and the first time a shard is met its index: at most 2 GETs a group). The groups
    # are small, so the loader fetches 16 at a time, each waiting for the one request slot;
    # 20 ms a request: the second buffer's read takes seconds.
    kw = dict(seq_len=64, batch_size=8, sequences_per_read_block=8, read_blocks_per_shuffle_buffer=100)
    want = batches(flat_tokens.Loader(local, "train", **kw))
    s3.proxy.get_delay_s = 0.02
    try:
        env = s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="1", SHARDKIT_S3_REQUEST_MIB="1",
                     SHARDKIT_TEST_TOKEN_GROUP="512")
        with environment(env):
            loader = flat_tokens.Loader(url, "train", buffer_in_memory=True, **kw)
            assert loader.buffers_in_memory and len(want) > 150
            it = iter(loader)
            same_batches([{k: np.array(v) for k, v in next(it).items() if v is not None}], want[:1])
            hold_requests(s3, slot_quarters(1 << 20))
            # close returns while the store holds the four requests of the groups being
            # fetched, and the read sends no more. Before the fetches were cut, the 16 groups being fetched all finished: up to
            # 32 GETs.
            stops_without_waiting_and_sends_nothing_after(it.close, s3, tmp_path)
        # The loader is whole: iterated again, it resumes after the batch it gave, exactly,
        # reading the second buffer anew.
        s3.proxy.get_delay_s = 0.0
        with environment(env):
            before = s3.proxy.ranged_gets
            same_batches(batches(loader), want[1:])
            assert s3.proxy.ranged_gets > before
    finally:
        s3.proxy.release()
        s3.proxy.get_delay_s = 0.0


def buffer_threads() -> set:
    """The threads of this process named shardkit-buffer: one for each shuffle-buffer read
    ahead (the first read runs on the thread that asks for it). A thread such a read starts
    (its fetch lanes) bears that name until it names itself (shardkit-fetch), at once."""
    out = set()
    for task in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{task}/comm").read_text().strip() == "shardkit-buffer":
                out.add(task)
        except OSError:  # the thread ended meanwhile
            pass
    return out


def wait_for(what: Callable[[], bool], why: str) -> None:
    """Waits until ``what()``; the bound only turns a hang into a failure."""
    deadline = time.monotonic() + HOLD_GUARD_S
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(why)
        time.sleep(0.01)


@pytest.mark.parametrize("epochs", [False, True])
def test_a_tokens_loader_reads_the_next_buffers_without_a_gap(tmp_path: Path, s3: S3, epochs: bool) -> None:
    """A flat-tokens loader's buffer reads follow one another without a gap: once a minipoch's
    buffer is served and the next one's read is still under way, the read of the one after
    starts, its requests queued behind; with epochs, the next epoch's first buffer is read
    ahead too. Never more than two reads at once: memory holds two minipochs' buffers.
    The store holds every request of the reads ahead unanswered, so that the second read is
    under way for as long as the test needs: the read of the third starts meanwhile."""
    local, url, tokens = small_tokens_in_store(tmp_path, s3, seed=6)
    # Read in groups of one 512-token block. Without epochs: five minipochs of 40 blocks. With
    # epochs: one minipoch of every block an epoch, three epochs.
    blocks = tokens // 512
    assert blocks > 3 * 40  # at least four minipochs
    kw = dict(seq_len=64, batch_size=8, sequences_per_read_block=8,
              read_blocks_per_shuffle_buffer=blocks if epochs else 40, epochs=epochs)
    reference = flat_tokens.Loader(local, "train", **kw)
    steps = len(reference) * (3 if epochs else 1)
    want = [{k: np.array(v) for k, v in reference.load(i).items() if v is not None} for i in range(steps)]
    got: List[Dict[str, np.ndarray]] = []
    failed: List[BaseException] = []

    def consume(it: Iterator[Any]) -> None:
        try:
            for b in it:
                got.append({k: np.array(v) for k, v in b.items() if v is not None})
                if len(got) == steps:
                    break
        except BaseException as e:  # re-raised below, on the test's thread
            failed.append(e)

    consumer = None
    try:
        env = s3.env(proxy=True, SHARDKIT_S3_INFLIGHT="1", SHARDKIT_S3_REQUEST_MIB="1",
                     SHARDKIT_TEST_TOKEN_GROUP="512")
        with environment(env):
            loader = flat_tokens.Loader(url, "train", buffer_in_memory=True, **kw)
            assert loader.buffers_in_memory
            # Held: every GET sent while a read ahead runs (the first buffer's read is over
            # before the second's starts).
            s3.proxy.hold(lambda path, rng: bool(buffer_threads()))
            it = loader.iter(0)
            consume(iter([next(it)]))
            # The first buffer served, the second's read under way (its requests held), alone.
            wait_for(lambda: len(buffer_threads()) == 1 and len(s3.proxy.held) > 0, "the second buffer is not read ahead")
            second = buffer_threads()
            consumer = threading.Thread(target=consume, args=(it,))
            consumer.start()
            # The first minipoch's steps served, the second buffer is asked for while its read
            # is under way: the third's read starts, beside it; no other.
            wait_for(lambda: buffer_threads() > second, "the third buffer's read did not start")
            wait_for(lambda: len(buffer_threads()) == 2, f"{len(buffer_threads())} buffer reads at once")
            assert second < buffer_threads() and s3.proxy.held and not s3.proxy.hold_expired
            s3.proxy.release()
            consumer.join(2 * HOLD_GUARD_S)  # a hang guard
            assert not consumer.is_alive(), "the loader did not go on once the store answered"
    finally:
        s3.proxy.release()
        if consumer is not None and consumer.is_alive():
            consumer.join()
    if failed:
        raise failed[0]
    same_batches(got, want)


@pytest.mark.parametrize("packed", [True, False])
def test_a_tokens_loader_fetches_each_shard_index_once(tmp_path: Path, s3: S3, packed: bool) -> None:
    """A shuffle buffer from a store is fetched in groups, each located in its shards through
    their indexes. The indexes are kept across groups, buffers and passes: the store serves
    each shard's index once, however often the groups come back to the shard."""
    local, url, _ = small_tokens_in_store(tmp_path, s3, seed=9)
    bucket = url.split("/")[2]
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix="tok/")["Contents"]
    sizes = {o["Key"]: o["Size"] for o in listing}
    kw = dict(seq_len=64, batch_size=8, sequences_per_read_block=8, read_blocks_per_shuffle_buffer=40,
              packed=packed, seed=4)
    # Groups of one 512-token block: several groups per shard in every buffer.
    want = batches(flat_tokens.Loader(local, "train", **kw))
    s3.proxy.wait_idle()
    # Counted from before the loader is made: it may start reading its first buffer at once.
    start = len(s3.proxy.get_log)
    with environment(s3.env(proxy=True, SHARDKIT_TEST_TOKEN_GROUP="512")):
        loader = flat_tokens.Loader(url, "train", buffer_in_memory=True, **kw)
        assert loader.buffers_in_memory
        for _ in range(2):  # the epoch twice
            loader.set_epoch(0)
            same_batches(batches(loader), want)
        gets = s3.proxy.get_log[start:]
    index_gets: Dict[str, int] = {}
    data_gets = 0
    for path, byte_range, _ in gets:
        key = path.split("?")[0].removeprefix(f"/{bucket}/")
        last = int(byte_range.removeprefix("bytes=").split("-")[1])
        if "/c/" in key and key in sizes and last == sizes[key] - 1:  # a shard's index ends it
            index_gets[key] = index_gets.get(key, 0) + 1
        else:
            data_gets += 1
    shards = [k for k in sizes if "/c/" in k and ("seq_starts" in k or "encoded_tokens" in k)]
    assert index_gets and set(index_gets) <= set(shards), index_gets
    tokens = {k: n for k, n in index_gets.items() if "encoded_tokens" in k}
    assert len(tokens) > 10 and max(tokens.values()) == 1, index_gets
    # seq_starts's too, though the split's opening checks read it first.
    assert max(index_gets.values()) == 1, index_gets
    # The groups did come back to the shards: many more data requests than shards.
    assert data_gets > 4 * len(index_gets), (data_gets, len(index_gets))
    if not packed:
        assert any("seq_starts" in k for k in index_gets), index_gets


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_faults_through_the_cache_never_reach_a_page(tmp_path: Path, s3: S3, kind: str) -> None:
    """Through the local cache, faults are retried as without it and the pages kept are the
    objects' bytes; when the budget runs out, the read fails naming the object and range, and
    nothing is kept for it."""
    local = write_saev(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/{Path(local).name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    cache = tmp_path / "cache"
    expected = batches(saev.ShuffledLoader(local, layer=11, batch_size=40, seed=5))
    with environment(s3.env(proxy=True, SHARDKIT_CACHE_DIR=str(cache), SHARDKIT_S3_RETRIES="2")):
        ds = saev.Dataset(url)
        s3.proxy.arm(kind, 1000)
        with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/.*/acts00000\d\.bin \(bytes \d+ to \d+\)"):
            ds.get(7, 5, 3)
        s3.proxy.arm(None)
        shardkit.wait_for_cache()
        assert page_files(cache) == []
    with environment(s3.env(proxy=True, SHARDKIT_CACHE_DIR=str(cache))):
        s3.proxy.arm(kind, 3)
        same_batches(batches(saev.ShuffledLoader(url, layer=11, batch_size=40, seed=5)), expected)
        assert s3.proxy.injected == 3
        s3.proxy.arm(None)
        shardkit.wait_for_cache()
    pages = page_files(cache)
    assert pages
    for p in pages:
        shard = Path(local) / p.parent.parent.name.removesuffix(".pages")
        assert p.read_bytes() == shard.read_bytes()[int(p.name) << 22:][: 4 << 20], p


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
        with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/.*/acts00000\d\.bin \(bytes \d+ to \d+\)"):
            ds.get(7, 5, 3)
        # The loader reads labels.bin when it starts, then the shards: whichever fails first.
        with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/\S+\.bin \(bytes \d+ to \d+\)"):
            for _ in saev.ShuffledLoader(url, layer=11, batch_size=40, seed=5):
                pass
        assert s3.proxy.injected >= 3
        s3.proxy.arm(None)


@pytest.mark.parametrize("kind", ["503", "500", "drop"])
def test_streamed_uploads_retry_faults_and_report_a_spent_budget(tmp_path: Path, s3: S3, kind: str) -> None:
    """Shards go up on a background thread: its faults are retried, and once the budget is
    spent the writer's caller gets the error naming the object; the write then resumes."""
    local = Path(write_saev(tmp_path / "local"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    staging = tmp_path / "staging"
    with environment(s3.env(proxy=True, SHARDKIT_STAGING_DIR=str(staging))):
        s3.proxy.arm(kind, 3, on="PUT")
        assert write_saev(root) == f"{root}/{local.name}"
        assert s3.proxy.injected == 3
        shardkit.download(f"{root}/{local.name}", tmp_path / "down")
        assert tree(tmp_path / "down") == tree(local)

        bucket = s3.bucket()
        root = f"s3://{bucket}/root"
        with environment({"SHARDKIT_S3_RETRIES": "2"}):
            s3.proxy.arm(kind, 1000, on="PUT")
            # The writer's lock is taken first, on the caller's thread; then metadata.json and
            # the shards, behind it.
            with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/root/{local.name}/\.shardkit-lock\.json"):
                write_saev(root)
            s3.proxy.arm(None)
            w = saev.Writer(root, saev_metadata(), progress=False, resume=True)
            s3.proxy.arm(kind, 1000, on="PUT")
            # Shards (each after its labels) upload two at a time: the error names whichever
            # failed first.
            with pytest.raises(
                shardkit.RemoteError,
                match=rf"s3://{bucket}/root/{local.name}/(\.shardkit-labels/)?acts00000\d\.bin",
            ):
                for e in range(0, 40, 8):
                    w.write(saev_acts(e, 8), saev_labels(e, 8))
                w.close()
            w.abort()
        s3.proxy.arm(None)
        assert write_saev(root, resume=True) == f"{root}/{local.name}"
        shardkit.download(f"{root}/{local.name}", tmp_path / "down2")
    assert tree(tmp_path / "down2") == tree(local)


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_streamed_tokens_uploads_retry_faults_and_report_a_spent_budget(tmp_path: Path, s3: S3, kind: str) -> None:
    """A flat-tokens write streams each commit's chunks on background threads and its
    checkpoint on the caller's: faults in either are retried, a spent budget reaches the
    caller naming the object, and the write then resumes from what it staged."""
    local = tmp_path / "local"
    write_tokens(str(local))
    bucket = s3.bucket()
    url = f"s3://{bucket}/ds"
    with environment(s3.env(proxy=True, SHARDKIT_STAGING_DIR=str(tmp_path / "staging"))):
        s3.proxy.arm(kind, 3, on="PUT")
        write_tokens(url)
        assert s3.proxy.injected == 3
        shardkit.download(url, tmp_path / "down")
        assert tree(tmp_path / "down") == tree(local)

        bucket = s3.bucket()
        url = f"s3://{bucket}/ds"
        with environment({"SHARDKIT_S3_RETRIES": "2"}):
            s3.proxy.arm(kind, 1000, on="PUT")
            with pytest.raises(shardkit.RemoteError, match=rf"s3://{bucket}/ds/\S+"):
                write_tokens(url)
        s3.proxy.arm(None)
        with pytest.raises(shardkit.NotFoundError, match=r"holds neither a train nor a validation split"):
            flat_tokens.open(url)
        write_tokens(url, resume=True)
        shardkit.download(url, tmp_path / "down2")
    assert tree(tmp_path / "down2") == tree(local)
    assert not [o for o in s3.objects(bucket) if ".shardkit-" in o]


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
        # From the store each shuffle buffer is read whole into memory (few large GETs); row by
        # row on request. Both serve the local batches exactly.
        buffered = flat_tokens.Loader(url, "train", **kw)
        assert buffered.buffers_in_memory
        rows = flat_tokens.Loader(url, "train", buffer_in_memory=False, **kw)
        assert not rows.buffers_in_memory
        want = batches(flat_tokens.Loader(local, "train", **kw))
        same_batches(batches(buffered), want)
        same_batches(batches(rows), want)
    # A cap below the buffer's size falls back to row-by-row reads; a bad cap is refused.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDKIT_TOKEN_BUFFER_GIB", "0")
        assert not flat_tokens.Loader(url, "train", seq_len=32, batch_size=8, **small).buffers_in_memory
        mp.setenv("SHARDKIT_TOKEN_BUFFER_GIB", "lots")
        with pytest.raises(shardkit.InvalidArgumentError, match="SHARDKIT_TOKEN_BUFFER_GIB"):
            flat_tokens.Loader(url, "train", seq_len=32, batch_size=8, **small)
    assert flat_tokens.validate(url)["valid"]
    down = tmp_path / "down"
    shardkit.download(url, down)
    assert tree(down) == tree(local)


def test_flat_tokens_missing_remote_dataset_names_the_url(s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    with pytest.raises(shardkit.ShardkitError, match=f"s3://{bucket}/none"):
        flat_tokens.open(f"s3://{bucket}/none")["train"]


# --- EAGLE-3 ----------------------------------------------------------------------------------------


def items_equal(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def write_eagle3_cache(path: Path, n: int, topk: Any = None) -> Path:
    from test_eagle3 import config, sample

    rng = np.random.default_rng(n)
    with eagle3.Writer(path, config(n=n, topk=topk), format_version=1 if topk is None else 2) as w:
        for i in range(n):
            s = sample(i)
            p = rng.random(s["target_probs"].shape)
            p /= p.sum(axis=-1, keepdims=True)
            if topk is None:
                s["target_probs"] = p
            else:
                del s["target_probs"]
                idx = np.argsort(-p, axis=-1)[:, :topk].astype(np.int32)
                s["target_probs_indices"] = idx
                s["target_probs_values"] = np.take_along_axis(p, idx, axis=-1)
            w.add(s)
    return path


@pytest.mark.parametrize("topk", [None, 2])
def test_eagle3_uploaded_reads_like_local(tmp_path: Path, s3: S3, env: Dict[str, str], topk: Any) -> None:
    cache = write_eagle3_cache(tmp_path / "eagle3", 9, topk)
    bucket = s3.bucket()
    url = f"s3://{bucket}/cache"
    shardkit.upload(cache, url)
    remote, here = eagle3.open(url), eagle3.open(cache)
    assert len(remote) == len(here) == 9 and remote.manifest == here.manifest
    before = shardkit.storage_counters()
    for i in [0, 4, 8, -1]:
        items_equal(remote[i], here[i])
    # Items read their rows only: a few small GETs each, never whole shards.
    after = shardkit.storage_counters()
    shard_bytes = sum(p.stat().st_size for p in Path(cache).glob("shard-*.safetensors"))
    assert after["get_bytes"] - before["get_bytes"] < shard_bytes
    for kw in [dict(batch_size=4, seed=3), dict(batch_size=3, shuffle=False), dict(batch_size=2, rank=1, world_size=2)]:
        same_batches(batches(eagle3.Loader(url, **kw)), batches(eagle3.Loader(cache, **kw)))
    assert eagle3.validate(url)["valid"]
    # Deep validation checks every byte in the store against the checksums sidecar.
    deep = eagle3.validate(url, deep=True)
    assert deep["valid"] and "every block matches" in json.dumps(deep), deep
    info, local_info = eagle3.inspect(url), eagle3.inspect(cache)
    assert info["complete"] and info["bytes_on_disk"] == local_info["bytes_on_disk"]
    with pytest.raises(shardkit.InvalidArgumentError, match="verify needs local files"):
        eagle3.Loader(url, batch_size=2, verify=True)


def test_eagle3_validated_in_a_store_reports_what_a_local_check_reports(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """`validate` of a cache in a store makes the local checks from one listing: manifest,
    shard set, every present shard's header, the embedding table's header (fetched, not the
    table), temporaries; and lists every problem, not the first."""
    from test_eagle3 import config, sample

    bucket = s3.bucket()
    good = tmp_path / "good"
    with eagle3.Writer(good, config(n=7, s=2)) as w:
        for i in range(7):
            w.add(sample(i))
        w.write_target_embeddings(np.arange(40 * 2, dtype=np.float32).reshape(40, 2))

    def damaged(name: str, damage: Any) -> Tuple[Any, Path, str]:
        local = tmp_path / name
        return eagle3.validate, local, damaged_upload(s3, bucket, good, local, name, damage)

    def f64_table(d: Path) -> None:
        header = json.dumps({"weight": {"dtype": "F64", "shape": [2, 2], "data_offsets": [0, 32]}}).encode()
        (d / "target_embeddings.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(32))

    def several(d: Path) -> None:
        shard = d / "shard-000001.safetensors"
        assert shard.exists(), sorted(p.name for p in d.iterdir())
        shard.write_bytes(shard.read_bytes()[:-10])
        (d / "shard-000002.safetensors").write_bytes(b"\x05" + bytes(20))
        (d / "shard-000003.safetensors").unlink()
        f64_table(d)
        (d / ".tmpab12cd").write_bytes(b"x")

    report = same_report(*damaged("several", several))
    errors = sorted(Path(e["file"]).name for e in report["errors"])
    assert errors == ["several", "shard-000001.safetensors", "shard-000002.safetensors", "target_embeddings.safetensors"], report
    assert any(".tmpab12cd" in n["message"] for n in report["notes"]), report
    report = same_report(*damaged("no-table", lambda d: (d / "target_embeddings.safetensors").unlink()))
    assert report["valid"] and "NeMo's training recipe needs it" in report["notes"][0]["message"], report
    # Without a manifest: one error naming it (a store's says "not uploaded yet").
    _, local, url = damaged("no-manifest", lambda d: (d / "manifest.json").unlink())
    for report, where in [(eagle3.validate(local), "written"), (eagle3.validate(url), "uploaded")]:
        assert [Path(e["file"]).name for e in report["errors"]] == ["manifest.json"], report
        assert f"not an EAGLE-3 or DSpark cache, or one not {where} yet" in report["errors"][0]["message"]
    shardkit.upload(good, f"s3://{bucket}/good")
    assert same_report(eagle3.validate, good, f"s3://{bucket}/good")["valid"]


def test_eagle3_remote_refusals(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    from test_eagle3 import write as write_eagle3

    cache = Path(write_eagle3(tmp_path / "eagle3", n=9))
    bucket = s3.bucket()
    with pytest.raises(shardkit.NotFoundError, match=f"s3://{bucket}/none/manifest.json"):
        eagle3.open(f"s3://{bucket}/none")
    c = s3.client()
    shards = sorted(cache.glob("shard-*.safetensors"))
    c.put_object(Bucket=bucket, Key="part/manifest.json", Body=(cache / "manifest.json").read_bytes())
    c.put_object(Bucket=bucket, Key=f"part/{shards[0].name}", Body=shards[0].read_bytes())
    with pytest.raises(shardkit.IncompleteDatasetError, match=r"2 of 9 examples are present \(samples 2 to 8 are missing"):
        eagle3.open(f"s3://{bucket}/part")
    # A shard cut short: its header promises more bytes than the object has.
    for sh in shards[1:]:
        c.put_object(Bucket=bucket, Key=f"part/{sh.name}", Body=sh.read_bytes())
    c.put_object(Bucket=bucket, Key=f"part/{shards[1].name}", Body=shards[1].read_bytes()[:-7])
    with pytest.raises(shardkit.CorruptDataError, match=f"s3://{bucket}/part/{shards[1].name}"):
        eagle3.open(f"s3://{bucket}/part")[2]
    assert not eagle3.validate(f"s3://{bucket}/part")["valid"]
    # A flipped byte inside a shard: the structure holds; deep validation's checksums find it.
    assert (cache / "shardkit.checksums.json").is_file(), "the writer records checksums"
    shardkit.upload(cache, f"s3://{bucket}/whole")
    body = bytearray(shards[1].read_bytes())
    body[-3] ^= 0xFF
    c.put_object(Bucket=bucket, Key=f"whole/{shards[1].name}", Body=bytes(body))
    assert eagle3.validate(f"s3://{bucket}/whole")["valid"]
    deep = eagle3.validate(f"s3://{bucket}/whole", deep=True)
    assert not deep["valid"], deep
    assert [e["file"] for e in deep["errors"]] == [f"s3://{bucket}/whole/{shards[1].name}"], deep
    assert "does not match its checksum" in deep["errors"][0]["message"]


# --- writers to a store -------------------------------------------------------------------------------


def test_flat_tokens_and_eagle3_written_to_a_store(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    from test_eagle3 import config, sample

    bucket = s3.bucket()
    docs = [np.arange(1 + i % 37, dtype=np.uint32) + i + 1 for i in range(200)]
    with environment({"SHARDKIT_STAGING_DIR": str(tmp_path / "staging")}):
        with flat_tokens.Writer(tmp_path / "tok", "train", progress=False) as w:
            w.append(docs)
        with flat_tokens.Writer(f"s3://{bucket}/tok", "train", progress=False) as w:
            w.append(docs)
        with eagle3.Writer(tmp_path / "e3", config(n=5)) as w:
            for i in range(5):
                w.add(sample(i))
        with eagle3.Writer(f"s3://{bucket}/e3", config(n=5)) as w:
            for i in range(5):
                w.add(sample(i))
        # Nothing is left staged.
        assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]
        # A prefix that already holds a dataset is refused.
        with pytest.raises(shardkit.AlreadyExistsError, match=f"s3://{bucket}/tok"):
            flat_tokens.Writer(f"s3://{bucket}/tok", "validation", progress=False)
        with pytest.raises(shardkit.AlreadyExistsError, match="manifest.json"):
            eagle3.Writer(f"s3://{bucket}/e3", config(n=5))
    for name in ["tok", "e3"]:
        down = tmp_path / f"down-{name}"
        shardkit.download(f"s3://{bucket}/{name}", down)
        assert tree(down) == tree(tmp_path / name), name
    np.testing.assert_array_equal(flat_tokens.open(f"s3://{bucket}/tok")["train"][199], docs[199])


# --- SDNB by range, SDZ through the local cache, and upload/download of any format ---------------------


def test_sdnb_tensors_are_read_by_range(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.arange(3_000_000, dtype=np.float32)  # 12 MB: a blob, past the fetched-whole size
    other = np.full(2_000_000, 7, dtype=np.int32)
    model = tmp_path / "m.sdnb"
    sdnb.save(model, {"w": w, "big": big, "other": other})
    url = f"s3://{bucket}/models/m.sdnb"
    shardkit.upload(model, url)
    size = model.stat().st_size
    before = shardkit.storage_counters()
    c = sdnb.open(url)
    opened = shardkit.storage_counters()
    # Opening reads header, graph region and manifest only, the header once (it also tells
    # SDNB from SDZ): three GETs.
    assert opened["get_bytes"] - before["get_bytes"] < 1 << 20 < size
    assert opened["gets"] - before["gets"] == 3, opened["gets"] - before["gets"]
    np.testing.assert_array_equal(c["w"], w)
    np.testing.assert_array_equal(c["big"], big)
    got_big = shardkit.storage_counters()
    assert got_big["get_bytes"] - opened["get_bytes"] == big.nbytes, "exactly the blob's bytes"
    np.testing.assert_array_equal(c["big"], big)
    assert shardkit.storage_counters()["gets"] == got_big["gets"], "a fetched blob is kept"
    np.testing.assert_array_equal(c["other"], other)
    # prefetch fetches every blob in one batch; indexing then makes no request.
    c2 = sdnb.open(url)
    before = shardkit.storage_counters()
    c2.prefetch()
    fetched = shardkit.storage_counters()
    assert fetched["get_bytes"] - before["get_bytes"] == big.nbytes + other.nbytes
    np.testing.assert_array_equal(c2["big"], big)
    np.testing.assert_array_equal(c2["other"], other)
    c2.prefetch(["big"])
    assert shardkit.storage_counters()["gets"] == fetched["gets"]
    with pytest.raises(KeyError, match="nope"):
        c2.prefetch(["nope"])
    local = sdnb.open(model)
    assert sorted(c) == sorted(local) and c.metadata == local.metadata
    assert sdnb.validate(url)["valid"]
    # Deep validation checks the object against its sidecar in the store, block by block.
    deep = sdnb.validate(url, deep=True)
    assert deep["valid"] and "no checksums sidecar" in json.dumps(deep), deep
    sidecar = tmp_path / "m.sdnb.checksums.json"
    assert sidecar.is_file(), "sdnb.save records checksums"
    shardkit.upload(sidecar, f"s3://{bucket}/models/m.sdnb.checksums.json")
    deep = sdnb.validate(url, deep=True)
    assert deep["valid"] and "every block matches" in json.dumps(deep), deep
    damaged = bytearray(model.read_bytes())
    damaged[size - 1000] ^= 0xFF  # in the last blob
    s3.client().put_object(Bucket=bucket, Key="models/m.sdnb", Body=bytes(damaged))
    deep = sdnb.validate(url, deep=True)
    assert not deep["valid"] and "does not match its checksum" in json.dumps(deep), deep
    assert url in json.dumps(deep)
    s3.client().put_object(Bucket=bucket, Key="models/m.sdnb", Body=model.read_bytes())

    # A shard set, opened by its base name or any shard.
    (tmp_path / "set").mkdir()
    sdnb.save(tmp_path / "set" / "s.sdnb", {"w": w, "big": big}, shard_size=4_000_000)
    for f in sorted((tmp_path / "set").iterdir()):
        shardkit.upload(f, f"s3://{bucket}/models/{f.name}")
    shards = sorted(p.name for p in (tmp_path / "set").iterdir() if p.name.endswith(".sdnb"))
    assert len(shards) >= 2
    for name in ["s.sdnb", shards[-1]]:
        s = sdnb.open(f"s3://{bucket}/models/{name}")
        assert s.kind == "sharded"
        np.testing.assert_array_equal(s["big"], big)
        np.testing.assert_array_equal(s["w"], w)
    assert sdnb.validate(f"s3://{bucket}/models/s.sdnb")["valid"]
    # The set's own sidecar (s.shard-set.checksums.json) is found from its base name, in place.
    deep = sdnb.validate(f"s3://{bucket}/models/s.sdnb", deep=True)
    assert deep["valid"] and not deep["errors"], deep
    assert any(n["message"].startswith(f"checksums: {len(shards)} file(s)") for n in deep["notes"]), deep
    assert shardkit.verify(f"s3://{bucket}/models/s.sdnb") == {"sidecar": True, "intact": True, "damage": []}

    # Refusals name the object: a missing shard, a missing object, a non-container, an edit.
    s3.client().delete_object(Bucket=bucket, Key=f"models/{shards[0]}")
    with pytest.raises(shardkit.CorruptDataError, match="missing"):
        sdnb.open(f"s3://{bucket}/models/s.sdnb")
    with pytest.raises(shardkit.NotFoundError, match=f"s3://{bucket}/models/none.sdnb"):
        sdnb.open(f"s3://{bucket}/models/none.sdnb")
    s3.client().put_object(Bucket=bucket, Key="models/junk.sdnb", Body=b"not a model at all")
    with pytest.raises(shardkit.CorruptDataError, match=f"s3://{bucket}/models/junk.sdnb.*not a SameDiff"):
        sdnb.open(f"s3://{bucket}/models/junk.sdnb")
    with pytest.raises(shardkit.InvalidArgumentError, match="in place, in a local file"):
        sdnb.set_metadata(url, {"k": "v"})


def test_sdz_archives_are_read_by_range(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    import zipfile

    bucket = s3.bucket()
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.arange(3_000_000, dtype=np.float32)
    # STORED (shardkit's own archives), single and sharded: only the central directory, local
    # headers and each model entry's header, graph and manifest are read on open.
    for name, kw in [("m.sdz", {}), ("s.sdz", {"shard_size": 4_000_000})]:
        local = tmp_path / name
        sdnb.save(local, {"w": w, "big": big}, **kw)
        url = f"s3://{bucket}/models/{name}"
        shardkit.upload(local, url)
        before = shardkit.storage_counters()
        c = sdnb.open(url)
        opened = shardkit.storage_counters()
        assert c.kind == "sdz"
        assert opened["get_bytes"] - before["get_bytes"] < 1 << 20 < local.stat().st_size
        np.testing.assert_array_equal(c["big"], big)
        assert shardkit.storage_counters()["get_bytes"] - opened["get_bytes"] == big.nbytes
        np.testing.assert_array_equal(c["w"], w)
        assert sorted(c) == sorted(sdnb.open(local))
        assert sdnb.validate(url)["valid"]
        # Prefetching every tensor of a fresh open fetches exactly the blobs.
        fresh = sdnb.open(url)
        before = shardkit.storage_counters()
        fresh.prefetch()
        assert shardkit.storage_counters()["get_bytes"] - before["get_bytes"] == big.nbytes
        np.testing.assert_array_equal(fresh["big"], big)
        sdnb.open(local).prefetch()  # local: nothing to do
    # A DEFLATE archive written by Python's zipfile, with an extra entry: the model entry is
    # fetched and inflated; the extra entry is fetched when asked for.
    plain = tmp_path / "plain.sdnb"
    # Random values, so the entry compresses within the archive limit's 100:1 ratio.
    noise = np.random.default_rng(0).random(60_000).astype(np.float32)
    sdnb.save(plain, {"w": w, "noise": noise})
    deflated = tmp_path / "d.sdz"
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("model.sdnb", plain.read_bytes())
        z.writestr("notes.txt", b"trained on shards 0-7\n" * 100)
    shardkit.upload(deflated, f"s3://{bucket}/models/d.sdz")
    d = sdnb.open(f"s3://{bucket}/models/d.sdz")
    np.testing.assert_array_equal(d["w"], w)
    np.testing.assert_array_equal(d["noise"], noise)
    assert d.extra_entry("notes.txt") == b"trained on shards 0-7\n" * 100
    # Not an archive after all: a truncated one is refused naming the object.
    s3.client().put_object(Bucket=bucket, Key="models/cut.sdz", Body=deflated.read_bytes()[:-30])
    with pytest.raises(shardkit.CorruptDataError, match=f"s3://{bucket}/models/cut.sdz"):
        sdnb.open(f"s3://{bucket}/models/cut.sdz")


def test_damaged_remote_containers_are_refused_never_crash(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    # Bytes flipped where opening by range reads (headers, manifests, graphs, the archive's end
    # records, central directory and local headers): every open either succeeds (a harmless
    # byte) or raises a shardkit error; a Rust panic would surface as PanicException instead.
    # An open that succeeds must serve the original tensors: same names, dtypes and shapes, and
    # the same bytes except, where the flip fell in a tensor's data (which opening does not
    # checksum), exactly that byte, flipped as written; or, where it fell in a blob's offset in
    # the manifest (the file's end) and the offset still lies inside the file, the bytes the
    # damaged manifest locates (nothing but a checksum sidecar could tell).
    bucket = s3.bucket()
    big = np.arange(2_500_000, dtype=np.float32)
    want = {"w": np.ones((3, 4), np.float32), "big": big}
    sources = {}
    for name in ["m.sdnb", "m.sdz"]:
        sdnb.save(tmp_path / name, want)
        sources[name] = (tmp_path / name).read_bytes()
    rng = np.random.default_rng(7)
    refused = served = 0
    for i in range(40):
        name = ["m.sdnb", "m.sdz"][i % 2]
        data = bytearray(sources[name])
        # In the SDNB header and graph's start, or the last bytes (manifest, ZIP end records
        # and central directory); STORED archives start with a local header.
        at = int(rng.integers(0, 160)) if rng.random() < 0.5 else len(data) - 1 - int(rng.integers(0, 400))
        flip = int(rng.integers(1, 256))
        data[at] ^= flip
        key = f"damaged/{i}-{name}"
        s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
        try:
            c = sdnb.open(f"s3://{bucket}/{key}")
            got = {v: np.array(c[v]) for v in c}
        except shardkit.ShardkitError as e:
            assert f"s3://{bucket}/{key}" in str(e), e
            refused += 1
            continue
        served += 1
        assert sorted(got) == sorted(want), (key, at, sorted(got))
        changed = []
        for k, a in want.items():
            assert (got[k].dtype, got[k].shape) == (a.dtype, a.shape), (key, at, k, got[k].dtype, got[k].shape)
            ga, wa = got[k].view(np.uint8).ravel(), a.view(np.uint8).ravel()
            differ = np.flatnonzero(ga != wa)
            if len(differ) > 1:  # read from elsewhere: exactly the bytes the damaged manifest points at
                assert at >= len(data) - 400 and ga.tobytes() in bytes(data), (key, at, k, len(differ))
                continue
            changed += [(k, int(j), int(ga[j]) ^ int(wa[j])) for j in differ]
        assert len(changed) <= 1, (key, at, changed[:5])
        if changed:  # the flipped byte lay in a tensor's data: served as it is stored
            k, j, x = changed[0]
            assert x == flip and sources[name][at] == want[k].view(np.uint8).ravel()[j], (key, at, changed)
    assert refused >= 10 and refused + served == 40, (refused, served)


def test_containers_through_the_opt_in_cache(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    model = tmp_path / "m.sdz"
    sdnb.save(model, {"w": w})
    shardkit.upload(model, f"s3://{bucket}/models/m.sdz")
    cache_dir = tmp_path / "cache"
    with environment({"SHARDKIT_CACHE_DIR": str(cache_dir)}):
        c = sdnb.open(f"s3://{bucket}/models/m.sdz")
        assert c.kind == "sdz"
        np.testing.assert_array_equal(c["w"], w)
        gets = shardkit.storage_counters()["gets"]
        np.testing.assert_array_equal(sdnb.open(f"s3://{bucket}/models/m.sdz")["w"], w)
        # Listing the prefix and reading the first bytes; the archive itself from the cache.
        assert shardkit.storage_counters()["gets"] - gets <= 1, "an unchanged object is served from the cache"
        assert sdnb.validate(f"s3://{bucket}/models/m.sdz")["valid"]
        # A changed object is fetched again.
        sdnb.save(model, {"w": w * 2})
        shardkit.upload(model, f"s3://{bucket}/models/m.sdz")
        np.testing.assert_array_equal(sdnb.open(f"s3://{bucket}/models/m.sdz")["w"], w * 2)
    # The cache is bounded: a new object makes room by evicting the least recently used.
    def held() -> Dict[str, int]:
        return {p.name: p.stat().st_size for p in page_files(cache_dir)}

    before = held()
    limit = sum(before.values()) + 1000
    other = tmp_path / "n.sdz"
    sdnb.save(other, {"x": np.ones(12, dtype=np.float32)})
    assert other.stat().st_size < limit
    shardkit.upload(other, f"s3://{bucket}/models/n.sdz")
    with environment({"SHARDKIT_CACHE_DIR": str(cache_dir), "SHARDKIT_CACHE_GIB": str(limit / 2**30)}):
        np.testing.assert_array_equal(sdnb.open(f"s3://{bucket}/models/n.sdz")["x"], np.ones(12))
    after = held()
    assert sum(after.values()) <= limit and "n.sdz" in after
    assert set(before) - set(after), "something was evicted"


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


# --- torch DataLoader workers (forked after the parent used the store) --------------------------------


def test_torch_workers_read_from_a_store_after_fork(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    import torch

    from shardkit.torch import Eagle3Dataset, SaevDataset, TokensDataset

    bucket = s3.bucket()
    local = write_saev(tmp_path / "saev")
    saev_url = f"s3://{bucket}/saev/{Path(local).name}"
    shardkit.upload(local, saev_url)
    docs = [np.arange(1, 2 + i % 50, dtype=np.uint32) for i in range(400)]
    with flat_tokens.Writer(tmp_path / "tok", "train", progress=False) as w:
        w.append(docs)
    shardkit.upload(tmp_path / "tok", f"s3://{bucket}/tok")
    cache = write_eagle3_cache(tmp_path / "e3", 8)
    shardkit.upload(cache, f"s3://{bucket}/e3")
    # The parent reads first, so its runtime and connections exist when the workers fork.
    saev.Dataset(saev_url).get(0, 5, 0)

    small = dict(sequences_per_read_block=8, read_blocks_per_shuffle_buffer=4)
    cases = [
        (SaevDataset(saev_url, layer=11, batch_size=16, seed=1), SaevDataset(local, layer=11, batch_size=16, seed=1),
         lambda b: list(zip(b["example_idx"].tolist(), b["token_idx"].tolist(), strict=True))),
        (TokensDataset(f"s3://{bucket}/tok", seq_len=16, batch_size=4, **small),
         TokensDataset(tmp_path / "tok", seq_len=16, batch_size=4, **small),
         lambda b: [tuple(r) for r in b["inputs"].tolist()]),
        (Eagle3Dataset(f"s3://{bucket}/e3", batch_size=2), Eagle3Dataset(cache, batch_size=2),
         lambda b: [tuple(r) for r in b["input_ids"].tolist()]),
    ]
    for remote, here, ids in cases:
        got = sorted(r for b in torch.utils.data.DataLoader(remote, batch_size=None, num_workers=2) for r in ids(b))
        want = sorted(r for b in torch.utils.data.DataLoader(here, batch_size=None, num_workers=2) for r in ids(b))
        assert got == want and got


def test_transfers_are_windowed_and_parallel_and_exact(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """upload puts several files at once; download reads in windows of inflight x request size
    (here 2 x 1 MiB): objects larger than a window span several, small ones share one, empty
    ones are kept, and every file arrives whole under its name."""
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    files = {
        "big.bin": rng.integers(0, 256, size=5 * 2**20 + 123, dtype=np.uint8).tobytes(),
        "exact.bin": rng.integers(0, 256, size=2**20, dtype=np.uint8).tobytes(),
        "empty.bin": b"",
        "deep/small.bin": b"0123456789",
        **{f"many/{i:03d}.bin": bytes([i]) * (1000 + i) for i in range(40)},
        "shards.json": b"[]",  # a commit record: goes last
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    url = f"s3://{s3.bucket()}/t"
    seen: list = []
    with environment({"SHARDKIT_S3_INFLIGHT": "2", "SHARDKIT_S3_REQUEST_MIB": "1"}):
        assert shardkit.upload(src, url, progress=lambda d, t: seen.append((d, t)))["copied"] == len(files)
        assert seen[-1][0] == seen[-1][1] == sum(map(len, files.values()))
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        # A rerun skips every object (same size and ETag).
        assert shardkit.upload(src, url) == {"copied": 1, "skipped": len(files) - 1, "bytes": 2}
        seen.clear()
        gets = shardkit.storage_counters()["gets"]
        got = shardkit.download(url, tmp_path / "down", progress=lambda d, t: seen.append((d, t)))
        assert got["copied"] == len(files)
        # One ranged GET per MiB of an object (6 for big.bin, its tail included; 1 for
        # exact.bin), one per small object (42), none for the empty one, and one more per
        # object a window boundary splits (4 windows).
        assert shardkit.storage_counters()["gets"] - gets <= 7 + 42 + 4
        assert seen[-1][0] == seen[-1][1]
        assert len(seen) > 3  # one report per 2 MiB window
        shardkit.download(f"{url}/big.bin", tmp_path / "one.bin")
    assert (tmp_path / "one.bin").read_bytes() == files["big.bin"]
    down = tmp_path / "down"
    assert {str(p.relative_to(down)): p.read_bytes() for p in down.rglob("*") if p.is_file()} == files


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    local = write_saev(tmp_path / "saev")
    url = f"file://{local}"
    np.testing.assert_array_equal(saev.Dataset(url).get(3, 5, 1), saev.Dataset(local).get(3, 5, 1))
    same_batches(batches(saev.ShuffledLoader(url, layer=5, batch_size=32)), batches(saev.ShuffledLoader(local, layer=5, batch_size=32)))
    assert saev.validate(url)["valid"] and saev.inspect(url)["complete"]
    with flat_tokens.Writer(f"file://{tmp_path}/tok", "train", progress=False) as w:
        w.append([np.arange(1, 9, dtype=np.uint32)] * 10)
    assert len(flat_tokens.open(f"file://{tmp_path}/tok")["train"]) == 10
    assert flat_tokens.validate(f"file://{tmp_path}/tok")["valid"]
    cache = write_eagle3_cache(tmp_path / "e3", 4)
    assert len(eagle3.open(f"file://{cache}")) == 4 and eagle3.validate(f"file://{cache}")["valid"]
    sdnb.save(tmp_path / "m.sdnb", {"w": np.ones(3, dtype=np.float32)})
    np.testing.assert_array_equal(sdnb.open(f"file://{tmp_path}/m.sdnb")["w"], np.ones(3))
    assert shardkit.verify(url)["intact"]


# --- checksums verified in the store ------------------------------------------------------------------


def test_checksums_are_verified_in_the_store_without_a_local_copy(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    bucket = s3.bucket()
    local = Path(write_saev(tmp_path / "saev"))
    assert (local / "shardkit.checksums.json").is_file(), "the writer records checksums"
    url = f"s3://{bucket}/saev/{local.name}"
    shardkit.upload(local, url)
    before = shardkit.storage_counters()
    v = shardkit.verify(url)
    assert v["sidecar"] and v["intact"] and not v["damage"], v
    read = shardkit.storage_counters()["get_bytes"] - before["get_bytes"]
    total = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    assert total - (1 << 20) < read <= total + (1 << 20), (read, total)
    # A flipped byte, a missing object and an object the sidecar does not cover: each named.
    c = s3.client()
    key = f"saev/{local.name}/acts000001.bin"
    body = bytearray((local / "acts000001.bin").read_bytes())
    body[len(body) // 2] ^= 1
    c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    c.delete_object(Bucket=bucket, Key=f"saev/{local.name}/acts000002.bin")
    c.put_object(Bucket=bucket, Key=f"saev/{local.name}/stray.bin", Body=b"x" * 10)
    v = shardkit.verify(url)
    assert v["sidecar"] and not v["intact"]
    by_file = {Path(d["file"]).name: d for d in v["damage"]}
    assert set(by_file) == {"acts000001.bin", "acts000002.bin", "stray.bin"}, v
    half = len(body) // 2
    assert by_file["acts000001.bin"]["start"] <= half < by_file["acts000001.bin"]["end"]
    assert by_file["acts000001.bin"]["what"] == "does not match its checksum"
    assert "no such object" in by_file["acts000002.bin"]["what"]
    assert "not covered" in by_file["stray.bin"]["what"]
    assert all(d["file"].startswith(f"s3://{bucket}/saev/") for d in v["damage"])
    # Without a sidecar there is nothing to check, and it says so.
    c.delete_object(Bucket=bucket, Key=f"saev/{local.name}/shardkit.checksums.json")
    assert shardkit.verify(url) == {"sidecar": False, "intact": False, "damage": []}


# --- datasets through the opt-in local cache ------------------------------------------------------------


def test_dataset_readers_go_through_the_opt_in_cache(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """With SHARDKIT_CACHE_DIR, the pages of each object a loader reads are kept in the cache;
    later epochs (and later loaders) read the pages, with the same batches. A cache smaller
    than a page holds nothing: everything is read from the store."""
    bucket = s3.bucket()
    sv = Path(write_saev(tmp_path / "saev"))
    saev_url = f"s3://{bucket}/saev/{sv.name}"
    shardkit.upload(sv, saev_url)
    docs = [np.arange(1, 2 + i % 50, dtype=np.uint32) for i in range(400)]
    with flat_tokens.Writer(tmp_path / "tok", "train", progress=False, tokens_per_chunk=512) as w:
        w.append(docs)
    shardkit.upload(tmp_path / "tok", f"s3://{bucket}/tok")
    e3 = write_eagle3_cache(tmp_path / "e3", 8)
    shardkit.upload(e3, f"s3://{bucket}/e3")
    small = dict(sequences_per_read_block=8, read_blocks_per_shuffle_buffer=4)
    cases = [
        (lambda p: saev.ShuffledLoader(p, layer=5, batch_size=32, seed=1), saev_url, sv,
         [p for p in sv.iterdir() if p.name.startswith("acts")]),
        (lambda p: flat_tokens.Loader(p, "train", seq_len=16, batch_size=4, **small), f"s3://{bucket}/tok",
         tmp_path / "tok", [p for p in (tmp_path / "tok").rglob("*") if p.is_file() and "/c/" in str(p)]),
        (lambda p: eagle3.Loader(p, batch_size=2, seed=3), f"s3://{bucket}/e3", e3,
         list(Path(e3).glob("shard-*.safetensors"))),
    ]
    for make, url, local, data in cases:
        cache = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
        want = batches(make(local))
        before = shardkit.storage_counters()
        same_batches(batches(make(url)), want)
        uncached = shardkit.storage_counters()["get_bytes"] - before["get_bytes"]
        with environment({"SHARDKIT_CACHE_DIR": str(cache)}):
            before = shardkit.storage_counters()
            same_batches(batches(make(url)), want)
            shardkit.wait_for_cache()  # pages are written after the reads return
            first = shardkit.storage_counters()
            same_batches(batches(make(url)), want)
            second = shardkit.storage_counters()
        # Pages sit at CACHE/bucket/key.pages/<version>/<index>: one version, every page held.
        copies = cache / bucket / url.split("/", 3)[3]
        for p in data:
            versions = list((copies / f"{p.relative_to(local)}.pages").iterdir())
            assert len(versions) == 1, (url, versions)
            pages = [q for q in versions[0].iterdir() if not q.name.startswith(".")]
            assert sum(q.stat().st_size for q in pages) == p.stat().st_size, (url, p)
            assert sorted(int(q.name) for q in pages) == list(range(len(pages))), (url, p)
        data_bytes = sum(p.stat().st_size for p in data)
        assert first["get_bytes"] - before["get_bytes"] >= data_bytes, url
        # The second pass reads only what is not data (listings, commit records).
        assert second["get_bytes"] - first["get_bytes"] < min(data_bytes, 1 << 16), (url, second, first)
        # A cache of 1 KiB, smaller than a page: everything from the store, batches unchanged.
        tiny = tmp_path / f"tiny-{len(list(tmp_path.iterdir()))}"
        with environment({"SHARDKIT_CACHE_DIR": str(tiny), "SHARDKIT_CACHE_GIB": str(1024 / 2**30)}):
            before = shardkit.storage_counters()
            same_batches(batches(make(url)), want)
            assert shardkit.storage_counters()["get_bytes"] - before["get_bytes"] == uncached
        held = page_files(tiny) if tiny.exists() else []
        assert held == [], held


def big_saev(root: Path, n: int = 96) -> str:
    """A saev dataset of 7.3 MB shards (32 examples of 2 layers x 7 tokens x 4096 floats)."""
    meta = dict(saev_metadata(n), d_model=4096, max_tokens_per_shard=7 * 2 * 32)
    with saev.Writer(root, meta, progress=False) as w:
        for e in range(0, n, 8):
            acts = np.random.default_rng(e).standard_normal((8, 2, 7, 4096), dtype=np.float32)
            w.write(acts, None)
    return w.path


def uploaded_big_saev(tmp_path: Path, s3: S3, n: int = 96) -> Tuple[Path, str, str]:
    """``big_saev`` written under ``tmp_path`` and uploaded to a new bucket: (local path, bucket,
    url)."""
    local = Path(big_saev(tmp_path / "saev", n=n))
    bucket = s3.bucket()
    url = f"s3://{bucket}/acts/{local.name}"
    with environment(s3.env()):
        shardkit.upload(local, url)
    return local, bucket, url


def page_files(cache: Path) -> List[Path]:
    """The pages and whole copies held: not stamps, temporaries or the cache's mark."""
    return [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".") and p.name != "CACHEDIR.TAG"]


def test_a_cache_is_made_only_where_it_may_evict_and_is_listed_and_cleared(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    """SHARDKIT_CACHE_DIR pointed at a directory of other files (a home, a dataset disk) is
    refused before anything is written there: the cache evicts its files. A cache shardkit
    made (marked by a CACHEDIR.TAG naming shardkit) is listed by object and cleared, whole
    or by URL, from Python and from the CLI; what is cleared is fetched again when read."""
    local, bucket, url = uploaded_big_saev(tmp_path, s3)
    shards = sorted(p for p in local.iterdir() if p.name.startswith("acts"))
    assert len(shards) == 3
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.bin").write_bytes(b"x" * 1000)
    with environment({"SHARDKIT_CACHE_DIR": str(mine)}):
        with pytest.raises(shardkit.InvalidArgumentError, match=rf"SHARDKIT_CACHE_DIR={mine}: not a shardkit cache"):
            saev.Dataset(url).get(3, 11, 2)
        with pytest.raises(shardkit.InvalidArgumentError, match="not a shardkit cache"):
            shardkit.clear_cache()
        with pytest.raises(shardkit.InvalidArgumentError, match="not a shardkit cache"):
            shardkit.cache_info()
    assert [p.name for p in mine.rglob("*")] == ["keep.bin"]

    cache = tmp_path / "cache"
    kw = dict(layer=11, batch_size=64, seed=2)
    want = batches(saev.ShuffledLoader(local, **kw))
    cli = shardkit_cli()
    with environment({"SHARDKIT_CACHE_DIR": str(cache)}):
        same_batches(batches(saev.ShuffledLoader(url, **kw)), want)
        shardkit.wait_for_cache()
        assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
        info = shardkit.cache_info()
        assert info["dir"] == str(cache) and info["limit_bytes"] == 32 << 30
        held = {o["url"]: (o["bytes"], o["pages"]) for o in info["objects"]}
        pages = lambda p: -(-p.stat().st_size // (4 << 20))  # noqa: E731
        assert held == {f"{url}/{p.name}": (p.stat().st_size, pages(p)) for p in shards}
        assert info["bytes"] == sum(p.stat().st_size for p in shards)
        assert all(time.time() - 600 < o["last_used"] <= time.time() + 1 for o in info["objects"])
        # The CLI sees the same.
        out = subprocess.run([cli, "cache", "info", "--json"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert {o["url"]: (o["bytes"], o["pages"]) for o in listed["objects"]} == held
        assert listed["bytes"] == info["bytes"]
        used = {o["url"]: o["last_used"] for o in info["objects"]}
        assert all(abs(o["last_used"] - used[o["url"]]) < 0.01 for o in listed["objects"])
        out = subprocess.run([cli, "cache", "info"], capture_output=True, text=True)
        head, *rows = out.stdout.splitlines()
        assert head.startswith(f"{cache}: ") and head.endswith(f"in {len(shards)} object(s), limit 32.00 GiB"), head
        assert sorted(r.split()[-1] for r in rows) == sorted(held) and all("page(s)" in r for r in rows), rows
        # One object, then the rest of the dataset (by its URL, through the CLI).
        one = f"{url}/{shards[0].name}"
        assert shardkit.clear_cache(one) == {"files": pages(shards[0]), "bytes": shards[0].stat().st_size}
        assert one not in {o["url"] for o in shardkit.cache_info()["objects"]}
        out = subprocess.run([cli, "cache", "clear", url], capture_output=True, text=True)
        rest = sum(p.stat().st_size for p in shards[1:])
        assert out.returncode == 0 and out.stdout.startswith(f"removed {sum(map(pages, shards[1:]))} file(s)"), out.stdout
        assert shardkit.cache_info()["bytes"] == 0 and rest > 0
        assert shardkit.cache_info()["objects"] == [] and page_files(cache) == []
        assert (cache / "CACHEDIR.TAG").exists()
        # Read again: fetched from the store again, the same batches.
        before = shardkit.storage_counters()["get_bytes"]
        same_batches(batches(saev.ShuffledLoader(url, **kw)), want)
        assert shardkit.storage_counters()["get_bytes"] - before >= info["bytes"]
        bad = subprocess.run([cli, "cache", "clear", "acts"], capture_output=True, text=True)
        assert bad.returncode == 1 and "not an s3://bucket/prefix URL" in bad.stderr, bad.stderr


def test_the_cache_keeps_pages_not_whole_objects(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """A read through the cache fetches and keeps the pages it touches, not the objects: one row
    of a 7 MB shard costs one page; a cache smaller than the dataset keeps the most recent
    pages within its limit, and the batches are still exact."""
    local, _, url = uploaded_big_saev(tmp_path, s3)
    shard = min(p for p in local.iterdir() if p.name.startswith("acts"))
    assert shard.stat().st_size == 7 << 20
    page = 1 << 20
    cache = tmp_path / "cache"
    with environment({"SHARDKIT_CACHE_DIR": str(cache), "SHARDKIT_CACHE_PAGE_MIB": "1"}):
        want = saev.Dataset(local).get(40, 11, 3)
        ds = saev.Dataset(url)
        before = shardkit.storage_counters()
        np.testing.assert_array_equal(ds.get(40, 11, 3), want)
        spent = shardkit.storage_counters()["get_bytes"] - before["get_bytes"]
        assert spent == page, spent
        shardkit.wait_for_cache()
        [kept] = page_files(cache)
        assert kept.stat().st_size == page and kept.parent.parent.name == "acts000001.bin.pages", kept
        # The same page again: no request.
        before = shardkit.storage_counters()
        np.testing.assert_array_equal(ds.get(40, 11, 4), saev.Dataset(local).get(40, 11, 4))
        assert shardkit.storage_counters()["gets"] == before["gets"]

    # A cache of 5 pages for a 22 MB dataset: every epoch exact, the cache never over its limit
    # by more than the slack (an eighth of it), and no shard ever copied whole.
    data_bytes = sum(p.stat().st_size for p in local.iterdir() if p.name.startswith("acts"))
    limit = 5 * page
    small = tmp_path / "small"
    make = lambda p: saev.ShuffledLoader(p, layer=11, batch_size=64, seed=4)  # noqa: E731
    want_batches = batches(make(local))
    with environment({"SHARDKIT_CACHE_DIR": str(small), "SHARDKIT_CACHE_PAGE_MIB": "1",
                      "SHARDKIT_CACHE_GIB": str(limit / 2**30)}):
        for epoch in range(2):
            before = shardkit.storage_counters()
            same_batches(batches(make(url)), want_batches)
            spent = shardkit.storage_counters()["get_bytes"] - before["get_bytes"]
            shardkit.wait_for_cache()
            held = page_files(small)
            assert sum(p.stat().st_size for p in held) <= limit + limit // 8, held
            assert all(p.stat().st_size <= page for p in held), held
            print(f"epoch {epoch}: {spent} bytes fetched for {data_bytes} of data")
            assert 0 < spent <= 2 * data_bytes, (epoch, spent, data_bytes)


def test_a_warm_window_is_copied_straight_out_of_the_cached_pages(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Once the cache holds every page of a saev window, the window is not read into a buffer:
    its pages are mapped and each row copied once, straight out of them, also where a row
    spans two pages. Batches stay exact for every order and layer selection; a window with a
    page missing is read (and the page fetched) as before."""
    # Rows of 4,000 bytes in 1 MiB pages: many rows span two pages.
    meta = dict(saev_metadata(64), d_model=1000, max_tokens_per_shard=7 * 2 * 32)
    with saev.Writer(tmp_path / "saev", meta, progress=False) as w:
        for e in range(0, 64, 8):
            w.write(np.random.default_rng(e).standard_normal((8, 2, 7, 1000), dtype=np.float32), None)
    local = Path(w.path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/acts/{local.name}"
    shardkit.upload(local, url)
    configs = [
        dict(layer=11, batch_size=40, seed=3),
        dict(layer="all", batch_size=64, seed=1, memory_budget=1 << 20),
        dict(layer=5, batch_size=33, seed=9, rank=1, world_size=2),
    ]
    with environment({"SHARDKIT_CACHE_DIR": str(tmp_path / "cache"), "SHARDKIT_CACHE_PAGE_MIB": "1"}):
        same_batches(batches(saev.ShuffledLoader(url, layer="all", batch_size=64)), batches(saev.ShuffledLoader(local, layer="all", batch_size=64)))
        shardkit.wait_for_cache()
        for kw in configs:
            loader = saev.ShuffledLoader(url, **kw)  # opening fetches the two documents
            before = shardkit.storage_counters()
            same_batches(batches(loader), batches(saev.ShuffledLoader(local, **kw)))
            after = shardkit.storage_counters()
            assert after["gets"] == before["gets"], kw
            assert after["cache_mapped_bytes"] > before["cache_mapped_bytes"], kw
            assert after["cache_read_bytes"] == before["cache_read_bytes"], kw
        same_batches(batches(saev.OrderedLoader(url, layer=5, batch_size=50)), batches(saev.OrderedLoader(local, layer=5, batch_size=50)))
        # A page gone: that window is read, the missing page fetched again, the batches exact.
        victim = sorted(page_files(tmp_path / "cache"))[1]
        victim.unlink()
        before = shardkit.storage_counters()
        same_batches(batches(saev.ShuffledLoader(url, **configs[0])), batches(saev.ShuffledLoader(local, **configs[0])))
        after = shardkit.storage_counters()
        assert after["gets"] > before["gets"] and after["cache_read_bytes"] > before["cache_read_bytes"]


def test_the_cache_does_not_mix_versions_of_an_object(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Pages are kept per object version (its ETag): when an object is replaced, a new process
    reads the new bytes, and the old version's pages are removed."""
    local, bucket, url = uploaded_big_saev(tmp_path, s3, n=32)
    cache = tmp_path / "cache"
    with environment({"SHARDKIT_CACHE_DIR": str(cache), "SHARDKIT_CACHE_PAGE_MIB": "1"}):
        np.testing.assert_array_equal(saev.Dataset(url).get(3, 11, 2), saev.Dataset(local).get(3, 11, 2))
        shardkit.wait_for_cache()
    [old] = page_files(cache)
    # Replace the shard with other bytes of the same size (the checks at open still pass).
    shard = local / "acts000000.bin"
    x = np.fromfile(shard, dtype=np.float32)
    (x + 1).tofile(shard)
    s3.client().put_object(Bucket=bucket, Key=f"acts/{local.name}/acts000000.bin", Body=shard.read_bytes())
    script = f"""
import numpy as np
from shardkit import saev
a = saev.Dataset({url!r}).get(3, 11, 2)
b = saev.Dataset({str(local)!r}).get(3, 11, 2)
np.testing.assert_array_equal(a, b)
"""
    with environment({"SHARDKIT_CACHE_DIR": str(cache), "SHARDKIT_CACHE_PAGE_MIB": "1"}):
        subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ))
    # Kept by then: the interpreter waits for the cache's writes at exit.
    [new] = page_files(cache)
    assert new.parent != old.parent and not old.parent.exists(), (old, new)
    assert new.name == old.name


def test_a_failure_to_keep_pages_is_reported_and_the_read_is_whole(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    """Pages are written after the read returns. When that fails (here a file stands where the
    pages' directory goes), the read is still whole and exact, and the failure is raised, naming
    the path, by wait_for_cache (or the next read through the cache), once."""
    local, bucket, url = uploaded_big_saev(tmp_path, s3, n=32)
    cache = tmp_path / "cache"
    blocker = cache / bucket / "acts" / local.name / "acts000000.bin.pages"
    blocker.parent.mkdir(parents=True)
    # Marked as a shardkit cache, which it is but for the blocker (an unmarked directory that
    # holds anything is refused).
    (cache / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n# a shardkit cache\n")
    blocker.write_bytes(b"not a directory")
    with environment({"SHARDKIT_CACHE_DIR": str(cache), "SHARDKIT_CACHE_PAGE_MIB": "1"}):
        ds = saev.Dataset(url)
        np.testing.assert_array_equal(ds.get(3, 11, 2), saev.Dataset(local).get(3, 11, 2))
        with pytest.raises(shardkit.ShardkitOSError) as e:
            shardkit.wait_for_cache()
        assert "acts000000.bin.pages" in str(e.value), e.value
        shardkit.wait_for_cache()  # reported once
        # Without wait_for_cache, a later read through the cache raises it (once the write
        # has failed: until then, reads go on and succeed).
        np.testing.assert_array_equal(ds.get(4, 11, 2), saev.Dataset(local).get(4, 11, 2))
        deadline = time.monotonic() + 60
        while True:
            try:
                np.testing.assert_array_equal(ds.get(5, 11, 2), saev.Dataset(local).get(5, 11, 2))
            except shardkit.ShardkitOSError as e:
                assert "acts000000.bin.pages" in str(e), e
                break
            assert time.monotonic() < deadline, "the failure was never reported"
            time.sleep(0.05)
    assert blocker.read_bytes() == b"not a directory"


def test_ranks_of_a_node_share_one_cache(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Two processes (two ranks of a node) read the same dataset at once through one cache
    smaller than the data: each gets its exact batches, every page left is whole, no
    temporary is left behind, and the cache ends within its limit plus each one's overrun."""
    local, _, url = uploaded_big_saev(tmp_path, s3)
    cache = tmp_path / "cache"
    limit = 6 << 20
    script = f"""
import sys, numpy as np, shardkit
from shardkit import saev
rank = int(sys.argv[1])
def rows(p):
    return [np.array(b["act"]) for b in saev.ShuffledLoader(p, layer=11, batch_size=64, seed=2, rank=rank, world_size=2)]
want = rows({str(local)!r})
for epoch in range(2):
    got = rows({url!r})
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
shardkit.wait_for_cache()
"""
    with environment({"SHARDKIT_CACHE_DIR": str(cache), "SHARDKIT_CACHE_PAGE_MIB": "1",
                      "SHARDKIT_CACHE_GIB": str(limit / 2**30)}):
        ranks = [subprocess.Popen([sys.executable, "-c", script, str(r)], env=dict(os.environ),
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        for p in ranks:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith(".tmp")], files
    pages = page_files(cache)
    assert pages and all(p.stat().st_size == 1 << 20 for p in pages), pages
    # Each process may overrun the limit by its slack plus the pages it is writing (one per core).
    overrun = limit // 8 + (os.cpu_count() or 1) * (1 << 20)
    assert sum(p.stat().st_size for p in pages) <= limit + 2 * overrun, len(pages)
    # Every page held is the object's bytes at its place.
    for p in pages:
        shard = local / p.parent.parent.name.removesuffix(".pages")
        with open(shard, "rb") as f:
            f.seek(int(p.name) << 20)
            assert f.read(1 << 20) == p.read_bytes(), p


# --- the CLI ------------------------------------------------------------------------------------



def test_the_cli_takes_store_urls_for_every_format(tmp_path: Path, s3: S3, env: Dict[str, str]) -> None:
    """Every command that reads a dataset takes its s3:// URL and prints what it prints for the
    local copy (the path aside); `upload` and `download` round-trip it byte for byte."""
    cli = shardkit_cli()

    def run(*args: Any, ok: bool = True) -> "subprocess.CompletedProcess[str]":
        out = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
        assert (out.returncode == 0) == ok, (args, out.returncode, out.stderr)
        return out

    def same_output(*args: Any, url: str, local: Path) -> str:
        there = run(*args, url).stdout
        here = run(*args, local).stdout
        assert there.replace(url, "DATASET") == here.replace(str(local), "DATASET"), (there, here)
        return there

    def same_npz(a: Path, b: Path) -> None:
        with np.load(a) as x, np.load(b) as y:
            assert sorted(x.files) == sorted(y.files) and x.files
            for k in x.files:
                np.testing.assert_array_equal(x[k], y[k], err_msg=k)

    bucket = s3.bucket()
    datasets = {}

    local = Path(write_saev(tmp_path / "saev"))
    url = f"s3://{bucket}/acts/{local.name}"
    run("upload", local, url)
    datasets["saev"] = (local, url)
    assert '"complete": true' in same_output("saev", "inspect", "--json", url=url, local=local)
    same_output("saev", "inspect", url=url, local=local)
    same_output("saev", "validate", url=url, local=local)
    same_output("saev", "get", "--example", 3, "--layer", 11, "--token", 2, url=url, local=local)
    stream = ["saev", "stream", "--layer", 11, "--batch-size", 24, "--seed", 3, "--with-acts"]
    run(*stream, "--out", tmp_path / "there.npz", url)
    run(*stream, "--out", tmp_path / "here.npz", local)
    same_npz(tmp_path / "there.npz", tmp_path / "here.npz")

    local = tmp_path / "tokens"
    write_tokens(str(local))
    url = f"s3://{bucket}/tok"
    run("upload", local, url)
    datasets["tokens"] = (local, url)
    same_output("tokens", "inspect", url=url, local=local)
    same_output("tokens", "inspect", "--json", url=url, local=local)
    same_output("tokens", "validate", url=url, local=local)
    step = ["tokens", "batch", "--len", 16, "--batch", 4, "--read-blocks", 4, "--block", 8, "--step", 3]
    assert '"targets"' in same_output(*step, url=url, local=local)
    run(*step, "--unpacked", "--out", tmp_path / "there.npz", url)
    run(*step, "--unpacked", "--out", tmp_path / "here.npz", local)
    same_npz(tmp_path / "there.npz", tmp_path / "here.npz")
    # Converted out of the store, and from store to store: what a local conversion writes.
    run("tokens", "convert", "--layout", "v2", local, tmp_path / "v2-here")
    run("tokens", "convert", "--layout", "v2", url, tmp_path / "v2-there")
    assert tree(tmp_path / "v2-there") == tree(tmp_path / "v2-here")
    run("tokens", "convert", tmp_path / "v2-here", tmp_path / "v3-here")
    run("tokens", "convert", tmp_path / "v2-here", f"{url}-v2")
    run("tokens", "convert", f"{url}-v2", f"{url}-v3")
    run("download", f"{url}-v3", tmp_path / "v3-there")
    assert tree(tmp_path / "v3-there") == tree(tmp_path / "v3-here")
    refused = run("tokens", "convert", url, f"{url}-v3", ok=False).stderr
    assert f"{url}-v3" in refused and "must not exist" in refused, refused

    local = write_eagle3_cache(tmp_path / "eagle3", 5)
    url = f"s3://{bucket}/cache"
    run("upload", local, url)
    datasets["eagle3"] = (local, url)
    assert '"complete": true' in same_output("eagle3", "inspect", "--json", url=url, local=local)
    same_output("eagle3", "inspect", url=url, local=local)
    same_output("eagle3", "validate", url=url, local=local)
    assert "every block matches" in run("eagle3", "validate", "--deep", url).stdout
    refused = run("eagle3", "set-version", url, 2, ok=False).stderr
    assert url in refused and "download the cache, switch it and upload it" in refused, refused

    local = tmp_path / "m.sdnb"
    sdnb.save(local, {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.int64)})
    url = f"s3://{bucket}/models/m.sdnb"
    run("upload", local, url)
    datasets["sdnb"] = (local, url)
    same_output("sdnb", "inspect", url=url, local=local)
    same_output("sdnb", "validate", url=url, local=local)
    run("sdnb", "unpack", "--npy", "--out", tmp_path / "unpacked", url)
    # Containers are written locally, then uploaded: a URL as the destination is refused.
    (tmp_path / "npys").mkdir()
    np.save(tmp_path / "npys" / "w.npy", np.ones((2, 3), np.float32))
    for cmd in [["sdnb", "pack", "--from", tmp_path / "npys", "--out", f"{url}2"], ["sdnb", "convert", local, f"{url}2"]]:
        refused = run(*cmd, ok=False).stderr
        assert f"{url}2: containers are written to local files" in refused, refused
    with pytest.raises(shardkit.InvalidArgumentError, match="shardkit upload FILE URL"):
        sdnb.save(f"{url}2", {"w": np.ones(3, np.float32)})
    assert sdnb.validate(url)["valid"] and not s3.objects(bucket, "models/m.sdnb2")
    np.testing.assert_array_equal(np.load(tmp_path / "unpacked" / "w.npy"), np.arange(12, dtype=np.float32).reshape(3, 4))

    for name, (local, url) in datasets.items():
        down = tmp_path / f"down-{name}"
        run("download", url, down)
        if local.is_dir():
            assert tree(down) == tree(local), name
        else:
            assert down.read_bytes() == local.read_bytes(), name

    # A URL with nothing there fails, naming it (a report on stdout, an error on stderr).
    missing = f"s3://{bucket}/nothing-here"
    for fmt in ["saev", "tokens", "eagle3", "sdnb"]:
        for cmd in ["inspect", "validate"]:
            out = run(fmt, cmd, missing, ok=False)
            said = out.stdout + out.stderr
            assert missing in said and "panicked" not in said, (fmt, cmd, said)
