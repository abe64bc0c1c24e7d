"""The conventions every format shares (docs/api.md): exceptions, validation reports, loader
keywords and states."""

import errno
import os

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, errors, flat_tokens, saev, sdnb

from _faults import call_denied, world_dir  # noqa: F401 - world_dir: a fixture
from _loaders import DATA, HOST


def test_every_exception_is_a_shardkit_error_and_its_builtin():
    pairs = [
        (shardkit.CorruptDataError, ValueError), (shardkit.IncompleteDatasetError, ValueError),
        (shardkit.InvalidArgumentError, ValueError), (shardkit.ShardkitOSError, OSError),
        (shardkit.NotFoundError, FileNotFoundError), (shardkit.AlreadyExistsError, FileExistsError),
        (shardkit.LockedError, BlockingIOError), (shardkit.PermissionDeniedError, PermissionError),
        (shardkit.OutOfRangeError, IndexError), (shardkit.InternalError, RuntimeError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, shardkit.ShardkitError) and issubclass(cls, builtin), cls
    assert sorted(errors.__all__) == sorted(set(errors.__all__))


def test_errors_raised_by_the_core_have_the_documented_classes(tmp_path, world_dir):
    with pytest.raises(shardkit.NotFoundError, match="absent"):
        saev.open(tmp_path / "absent")
    (tmp_path / "junk.sdnb").write_bytes(b"SDNB" + b"\0" * 60)
    with pytest.raises(shardkit.CorruptDataError, match="junk.sdnb"):
        sdnb.open(tmp_path / "junk.sdnb")
    with pytest.raises(shardkit.InvalidArgumentError, match="shard_size must be a positive number of bytes, got 0"):
        sdnb.save(tmp_path / "m.sdnb", {"w": np.zeros(3, np.float32)}, shard_size=0)
    sdnb.save(tmp_path / "m.sdnb", {"w": np.zeros(3, np.float32)}, progress=False)
    with pytest.raises(shardkit.AlreadyExistsError, match="the split already holds 1 sequences"):
        with flat_tokens.Writer(tmp_path / "t.zarr", "train", progress=False) as w:
            w.append([[1, 2]])
        flat_tokens.Writer(tmp_path / "t.zarr", "train", progress=False)
    # A file chmod 000, opened by a child that the mode binds (as root, one dropped to nobody).
    denied = os.fspath(sdnb.save(os.path.join(world_dir, "m.sdnb"), {"w": np.zeros(3, np.float32)}, progress=False)[0])
    with open(denied, "rb") as f:
        content = f.read()
    os.chmod(denied, 0)
    r = call_denied(f"sdnb.open({denied!r})", imports="from shardkit import sdnb")
    assert not r["ok"] and r["mro"][:2] == ["PermissionDeniedError", "ShardkitOSError"], r
    assert "PermissionError" in r["mro"] and r["errno"] == errno.EACCES, r
    assert denied in r["message"] and "Permission denied" in r["message"], r
    os.chmod(denied, 0o644)
    with open(denied, "rb") as f:
        assert f.read() == content


def test_sdnb_validate_has_the_common_shape(tmp_path):
    files = sdnb.save(tmp_path / "m.sdnb", {"w": np.arange(1 << 18, dtype=np.float32)}, progress=False)
    ok = sdnb.validate(files[0], deep=True)
    assert ok["valid"] and ok["errors"] == [] and ok["path"] == os.fspath(files[0])
    assert any("every block matches" in n["message"] for n in ok["notes"]), ok
    with open(files[0], "r+b") as f:
        f.seek(os.path.getsize(files[0]) - 4096)
        f.write(b"\xff" * 8)
    shallow, deep = sdnb.validate(files[0]), sdnb.validate(files[0], deep=True)
    assert shallow["valid"]
    assert not deep["valid"] and deep["errors"][0]["file"] == os.fspath(files[0]), deep
    assert "bytes" in deep["errors"][0]["message"]
    (tmp_path / "bad.sdnb").write_bytes(b"nope")
    bad = sdnb.validate(tmp_path / "bad.sdnb")
    assert not bad["valid"] and bad["errors"][0]["file"] == os.fspath(tmp_path / "bad.sdnb")


@pytest.mark.parametrize("which", list(DATA))
def test_every_validate_returns_the_same_keys(tmp_path, which):
    args, _ = DATA[which](tmp_path)
    report = {"saev": saev.validate, "flat_tokens": flat_tokens.validate, "eagle3": eagle3.validate}[which](args[0])
    assert set(report) == {"path", "valid", "errors", "notes"} and report["valid"], report
    for f in report["notes"]:
        assert set(f) == {"file", "message"}


@pytest.mark.parametrize("which", list(DATA))
def test_loaders_share_keywords_and_state_shape(tmp_path, which):
    args, kw = DATA[which](tmp_path)
    loader = HOST[which](*args, **{**kw, "seed": 5, "epoch": 0})
    assert len(loader) > 1
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert {"format", "seed", "epoch", "batch", "batch_size", "world_size"} <= set(state), state
    assert state["format"] == which and state["seed"] == 5 and state["batch"] == 1
    other = {"saev": "eagle3", "flat_tokens": "saev", "eagle3": "flat_tokens"}[which]
    with pytest.raises(shardkit.InvalidArgumentError, match=f"saved by a {other} loader"):
        HOST[which](*args, **kw).load_state_dict({**state, "format": other})
    loader.set_epoch(0)


def test_eagle3_positional_arguments_still_work_with_a_warning(tmp_path):
    args, kw = DATA["eagle3"](tmp_path)
    kw.pop("batch_size")
    with pytest.warns(DeprecationWarning, match="by keyword"):
        old = eagle3.Loader(args[0], 3, False, **kw)
    new = eagle3.Loader(args[0], batch_size=3, shuffle=False, **kw)
    assert old.indices() == new.indices() and len(old) == len(new)


def test_flat_tokens_common_names_are_seqax_hosts(tmp_path):
    args, kw = DATA["flat_tokens"](tmp_path)
    a = flat_tokens.Loader(*args, **{**kw, "rank": 1, "world_size": 2})
    b = flat_tokens.Loader(*args, **{**kw, "host_index": 1, "host_count": 2})
    assert np.array_equal(a.rows(0), b.rows(0))
    with pytest.raises(shardkit.InvalidArgumentError, match="disagree"):
        flat_tokens.Loader(*args, **{**kw, "rank": 0, "host_index": 1})
    with pytest.raises(shardkit.InvalidArgumentError, match="shuffle=False"):
        flat_tokens.Loader(*args, **{**kw, "shuffle": False})
    with pytest.raises(shardkit.InvalidArgumentError, match="drop_last=False"):
        flat_tokens.Loader(*args, **{**kw, "drop_last": False})


def test_saev_loader_names(tmp_path):
    args, kw = DATA["saev"](tmp_path)
    assert issubclass(saev.ShuffledLoader, saev.Loader) and issubclass(saev.OrderedLoader, saev.Loader)
    ordered = [b["example_idx"].copy() for b in saev.Loader(*args, **{**kw, "shuffle": False})]
    same = [b["example_idx"].copy() for b in saev.OrderedLoader(*args, **kw)]
    assert len(ordered) == len(saev.OrderedLoader(*args, **kw)) > 1
    assert all(np.array_equal(x, y) for x, y in zip(ordered, same, strict=True))
    with pytest.raises(shardkit.InvalidArgumentError, match="contradicts"):
        saev.Loader(*args, **{**kw, "shuffle": False, "order": "block"})
