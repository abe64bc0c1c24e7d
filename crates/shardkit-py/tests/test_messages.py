"""Messages that say what to do (issue 32, class 5), from Python: a path that is not a dataset
says what it is instead and what to open, a file cut short says "truncated: X of Y bytes", an
index out of range says so in words, and an unreachable object store names its endpoint and
the variable that sets it. Each test checks the exception class and the message's key words."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _cli import shardkit_cli

FIXTURES = Path(__file__).resolve().parents[4] / "shared" / "fixtures" / "saev"
A21 = FIXTURES / "v2.1" / "aa57b80c"
C21 = FIXTURES / "v2.1" / "e64e5d2c"


def copy_fixture(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)


def test_saev_open_of_a_writers_root_names_the_dataset(tmp_path):
    root = tmp_path / "acts"
    copy_fixture(A21, root / A21.name)
    with pytest.raises(shardkit.NotFoundError) as e:
        saev.open(root)
    msg = str(e.value)
    assert "is a writer's root, not a dataset" in msg and f"the dataset is {root / A21.name}" in msg
    copy_fixture(C21, root / C21.name)
    with pytest.raises(shardkit.NotFoundError, match="writer's root holding 2 datasets") as e:
        saev.open(root)
    assert str(root / A21.name) in str(e.value) and str(root / C21.name) in str(e.value)


def test_saev_open_of_a_missing_path_says_no_such_directory(tmp_path):
    with pytest.raises(shardkit.NotFoundError, match=r": no such directory$"):
        saev.open(tmp_path / "nope")
    report = saev.validate(tmp_path / "nope")
    assert not report["valid"] and report["errors"][0]["message"] == "no such directory"


def test_saev_out_of_range_index_is_in_words():
    ds = saev.open(A21)
    with pytest.raises(shardkit.OutOfRangeError) as e:
        ds.get(9, -1, 0)
    assert isinstance(e.value, IndexError)
    assert str(e.value) == "example 9 is past the end: there are 7 examples (valid indices: 0 to 6)"


def test_tokens_validate_of_a_missing_path_says_no_such_directory(tmp_path):
    nope = tmp_path / "nope"
    report = flat_tokens.validate(nope)
    assert not report["valid"]
    assert report["errors"][0] == {"file": str(nope), "message": "no such directory"}
    with pytest.raises(shardkit.NotFoundError, match=r": no such directory$"):
        flat_tokens.Dataset(nope)
    with pytest.raises(shardkit.NotFoundError, match=r": no such directory$"):
        flat_tokens.inspect(nope)


def test_tokens_dataset_of_a_split_or_a_parent_names_the_dataset(tmp_path):
    path = tmp_path / "ds.zarr"
    with flat_tokens.Writer(path, "train") as w:
        w.append([[5, 6, 7], [8, 9]])
    with pytest.raises(shardkit.NotFoundError) as e:
        flat_tokens.Dataset(path / "train")
    assert f"it is itself the train split; the dataset is its parent, {path}" in str(e.value)
    with pytest.raises(shardkit.NotFoundError) as e:
        flat_tokens.Dataset(tmp_path)
    assert "holds neither a train nor a validation split" in str(e.value)
    assert f"the flat-tokens dataset is inside it: {path}" in str(e.value)


def test_truncated_sdnb_and_eagle3_files_say_truncated_x_of_y_bytes(tmp_path):
    path = tmp_path / "m.sdnb"
    sdnb.save(path, {"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(shardkit.CorruptDataError) as e:
        sdnb.open(path)
    assert str(e.value).startswith(f"{path}: truncated: {len(good) - 1} of {len(good)} bytes")
    assert "copy or write it again" in str(e.value)
    with pytest.raises(shardkit.NotFoundError, match=r": no such directory$"):
        eagle3.open(tmp_path / "nope")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_s3_endpoint_names_it_and_the_variable():
    port = closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    # A child process: the store's settings are read from its environment when first used.
    code = (
        "import shardkit\n"
        "from shardkit import saev\n"
        "try:\n"
        "    saev.open('s3://bucket/acts')\n"
        "except shardkit.RemoteError as e:\n"
        "    print('RemoteError', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1", "SHARDKIT_S3_RETRIES": "0", "SHARDKIT_S3_CONNECT_TIMEOUT": "5",
    })
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("RemoteError s3://bucket/acts"), out.stdout
    assert f"cannot reach the endpoint {endpoint} (set by AWS_ENDPOINT_URL)" in out.stdout
    assert "set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) to its URL" in out.stdout


cli = shardkit_cli


@pytest.mark.parametrize("kind", ["tokens", "saev", "eagle3"])
def test_cli_validate_of_a_missing_path_says_no_such_directory(tmp_path, kind):
    nope = tmp_path / "nope"
    out = subprocess.run([cli(), kind, "validate", str(nope)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"{nope}: no such directory" in out.stderr + out.stdout
    assert "neither a train nor a validation split" not in out.stderr + out.stdout


def test_cli_saev_validate_of_a_writers_root_names_the_dataset(tmp_path):
    root = tmp_path / "acts"
    copy_fixture(A21, root / A21.name)
    out = subprocess.run([cli(), "saev", "validate", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"the dataset is {root / A21.name}" in out.stderr + out.stdout
