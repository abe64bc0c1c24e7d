"""Arguments of every public entry point: a wrong type or a wrong value raises a documented
``ShardkitError`` (``InvalidArgumentError``, a ``ValueError``; ``InvalidArgumentTypeError``,
also a ``TypeError``, for a wrong type or an unknown keyword) naming the argument, never a bare
builtin or PyO3's conversion message; the torch adapters check their arguments when they are
constructed, default to the machine's device, show their parameters and expose them."""

import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb
from shardkit.errors import InvalidArgumentError, InvalidArgumentTypeError, OutOfRangeError, ShardkitError
from shardkit.saev import compat

from _cli import shardkit_cli
from _loaders import DATA

torch = pytest.importorskip("torch")
from shardkit import torch as sktorch  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One small dataset of each format: {format: (args, loader kwargs)}."""
    root = tmp_path_factory.mktemp("args")
    out = {which: make(root / which) for which, make in DATA.items()}
    for which in out:
        (root / which).mkdir(exist_ok=True)
    model = root / "m.sdnb"
    sdnb.save(model, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, progress=False)
    out["sdnb"] = ((os.fspath(model),), {})
    return out


def path_of(data, which):
    return os.fspath(data[which][0][0])


def check(exc_info, cls, *words):
    """The exception is ``cls`` (a ShardkitError and its builtin) and names ``words``."""
    e = exc_info.value
    # Exactly ``cls`` (not a subclass such as InvalidArgumentTypeError where InvalidArgumentError
    # is documented), or saev.compat's class that adds saev's own builtin to it.
    exact = type(e) is cls or (type(e).__module__ == "shardkit.saev.compat" and type(e).__bases__[0] is cls)
    assert isinstance(e, ShardkitError) and exact, (type(e), cls)
    if issubclass(cls, InvalidArgumentError):
        assert isinstance(e, ValueError)
    if cls is InvalidArgumentTypeError:
        assert isinstance(e, TypeError)
    assert not str(e).startswith("argument '"), str(e)  # never PyO3's bare message
    for w in words:
        assert w in str(e), (w, str(e))


def saev_kw(data, **over):
    (path,), kw = data["saev"]
    return (path,), {**kw, **over}


# (name, call(data) raising, expected class, words in the message)
CASES = [
    # saev.Loader and friends
    ("saev layer float", lambda d: saev.Loader(*saev_kw(d, layer=12.0)[0], **saev_kw(d, layer=12.0)[1]),
     InvalidArgumentTypeError, ["layer", "12.0", "float"]),
    ("saev layer str", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, layer="last")[1]),
     InvalidArgumentError, ["layer", "'last'", "'all'"]),
    ("saev layer unknown", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, layer=12)[1]),
     InvalidArgumentError, ["layer 12"]),
    ("saev tokens None", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, tokens=None)[1]),
     InvalidArgumentTypeError, ["tokens", "None", "'content'"]),
    ("saev tokens unknown", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, tokens="contents")[1]),
     InvalidArgumentError, ["tokens", "'contents'", "did you mean 'content'"]),
    ("saev batch_size negative", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, batch_size=-1)[1]),
     InvalidArgumentError, ["batch_size", "-1"]),
    ("saev batch_size bool", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, batch_size=True)[1]),
     InvalidArgumentTypeError, ["batch_size", "True", "bool"]),
    ("saev rank >= world", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, rank=2, world_size=2)[1]),
     InvalidArgumentError, ["rank", "world_size", "rank=2"]),
    ("saev order unknown", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, order="random")[1]),
     InvalidArgumentError, ["order", "'random'", "'block'"]),
    ("saev shuffle int", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, shuffle=1)[1]),
     InvalidArgumentTypeError, ["shuffle", "True or False"]),
    ("saev seed float", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, seed=1.5)[1]),
     InvalidArgumentTypeError, ["seed", "1.5"]),
    ("saev seed past u64", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, seed=1 << 64)[1]),
     InvalidArgumentError, ["seed"]),
    ("saev path None", lambda d: saev.Loader(None, layer=0), InvalidArgumentTypeError, ["path", "None"]),
    ("saev ignore_labels", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, ignore_labels=[300])[1]),
     InvalidArgumentError, ["ignore_labels", "300"]),
    ("saev unknown keyword", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d, batchsize=4)[1]),
     InvalidArgumentTypeError, ["batchsize", "did you mean 'batch_size'"]),
    ("saev OrderedLoader keyword", lambda d: saev.OrderedLoader(path_of(d, "saev"), layer=0, batchsize=4),
     InvalidArgumentTypeError, ["OrderedLoader", "batchsize", "'batch_size'"]),
    ("saev ShuffledLoader value", lambda d: saev.ShuffledLoader(path_of(d, "saev"), layer=0, order="sequentail"),
     InvalidArgumentError, ["order", "'sequentail'"]),
    ("saev set_epoch", lambda d: saev.Loader(*saev_kw(d)[0], **saev_kw(d)[1]).set_epoch(-1),
     InvalidArgumentError, ["epoch", "-1"]),
    ("saev Dataset path", lambda d: saev.Dataset(3), InvalidArgumentTypeError, ["path", "int"]),
    ("saev get float", lambda d: saev.open(path_of(d, "saev")).get(0.5, 0, 0), InvalidArgumentTypeError, ["example", "0.5"]),
    ("saev get layer", lambda d: saev.open(path_of(d, "saev")).get(0, 7, 0), InvalidArgumentError, ["layer 7", "[0]"]),
    ("saev get negative", lambda d: saev.open(path_of(d, "saev")).get(-1, 0, 0), OutOfRangeError, ["example", "-1"]),
    ("saev take floats", lambda d: saev.open(path_of(d, "saev")).take([0.5], 0, 0), InvalidArgumentTypeError, ["examples", "float"]),
    ("saev indexed tokens", lambda d: saev.open(path_of(d, "saev")).indexed(0, "cls_token"), InvalidArgumentError, ["tokens", "'cls_token'"]),
    ("saev indexed layer", lambda d: saev.open(path_of(d, "saev")).indexed(0.0), InvalidArgumentTypeError, ["layer", "0.0"]),
    ("saev indexed item", lambda d: saev.open(path_of(d, "saev")).indexed(0)["1"], InvalidArgumentTypeError, ["i", "'1'"]),
    ("saev validate", lambda d: saev.validate(None), InvalidArgumentTypeError, ["path", "None"]),
    ("saev inspect", lambda d: saev.inspect(""), InvalidArgumentError, ["path", "empty"]),
    ("saev Writer metadata", lambda d: saev.Writer("x", "not a dict"), InvalidArgumentTypeError, ["metadata", "str"]),
    ("saev Writer resume", lambda d: saev.Writer("x", {}, resume="yes"), InvalidArgumentTypeError, ["resume", "'yes'"]),
    # saev.compat
    ("compat layer float", lambda d: compat.IndexedDataset(compat.IndexedConfig(shards=path_of(d, "saev"), layer=0.0)),
     InvalidArgumentTypeError, ["cfg.layer", "0.0"]),
    ("compat layer unknown", lambda d: compat.OrderedDataLoader(compat.OrderedConfig(shards=path_of(d, "saev"), layer=5)),
     InvalidArgumentError, ["layer", "5"]),
    ("compat tokens", lambda d: compat.ShuffledDataLoader(compat.ShuffledConfig(shards=path_of(d, "saev"), layer=0, tokens="img")),
     InvalidArgumentError, ["cfg.tokens", "'img'", "did you mean 'image'"]),
    ("compat no shards", lambda d: compat.IndexedDataset(compat.IndexedConfig()), InvalidArgumentError, ["cfg.shards"]),
    ("compat missing dir", lambda d: compat.OrderedDataLoader(compat.OrderedConfig(shards="/no/such/dir", layer=0)),
     shardkit.NotFoundError, ["Activations are not saved at '/no/such/dir'"]),
    ("compat cfg type", lambda d: compat.ShuffledDataLoader({"shards": "x"}), InvalidArgumentTypeError, ["cfg", "ShuffledConfig", "dict"]),
    ("compat scale_norm", lambda d: compat.ShuffledDataLoader(compat.ShuffledConfig(shards=path_of(d, "saev"), layer=0, scale_norm=True)),
     InvalidArgumentError, ["scale_norm"]),
    ("compat batch_size", lambda d: compat.ShuffledDataLoader(compat.ShuffledConfig(shards=path_of(d, "saev"), layer=0, batch_size=0)),
     InvalidArgumentError, ["batch_size", "0"]),
    # flat-tokens
    ("tokens seq_len float", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **{**d["flat_tokens"][1], "seq_len": 16.0}),
     InvalidArgumentTypeError, ["seq_len", "16.0"]),
    ("tokens batch_size zero", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **{**d["flat_tokens"][1], "batch_size": 0}),
     InvalidArgumentError, ["batch_size", "0"]),
    ("tokens split unknown", lambda d: flat_tokens.Loader(d["flat_tokens"][0][0], "valid", **d["flat_tokens"][1]),
     InvalidArgumentError, ["split", "'valid'", "did you mean 'validation'"]),
    ("tokens split None", lambda d: flat_tokens.Loader(d["flat_tokens"][0][0], None, **d["flat_tokens"][1]),
     InvalidArgumentTypeError, ["split", "None"]),
    ("tokens rank >= world", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **{**d["flat_tokens"][1], "rank": 4, "world_size": 4}),
     InvalidArgumentError, ["rank", "world_size"]),
    ("tokens world divides", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **{**d["flat_tokens"][1], "rank": 0, "world_size": 3}),
     InvalidArgumentError, ["batch_size=4", "world_size=3"]),
    ("tokens packed int", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **{**d["flat_tokens"][1], "packed": 0}),
     InvalidArgumentTypeError, ["packed"]),
    ("tokens unknown keyword", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], seq_len=16, batchsize=4),
     InvalidArgumentTypeError, ["batchsize", "'batch_size'"]),
    ("tokens load float", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **d["flat_tokens"][1]).load(1.0),
     InvalidArgumentTypeError, ["step", "1.0"]),
    ("tokens iter start", lambda d: flat_tokens.Loader(*d["flat_tokens"][0], **d["flat_tokens"][1]).iter(-1),
     InvalidArgumentError, ["start_step", "-1"]),
    ("tokens Split name", lambda d: flat_tokens.Split(d["flat_tokens"][0][0], "test"), InvalidArgumentError, ["name", "'test'"]),
    ("tokens Split item", lambda d: flat_tokens.open(d["flat_tokens"][0][0])["train"][1.0],
     InvalidArgumentTypeError, ["i", "1.0"]),
    ("tokens seq_starts", lambda d: flat_tokens.open(d["flat_tokens"][0][0])["train"].seq_starts("0"),
     InvalidArgumentTypeError, ["start", "'0'"]),
    ("tokens convert layout", lambda d: flat_tokens.convert(d["flat_tokens"][0][0], "/tmp/x", layout="v4"),
     InvalidArgumentError, ["layout", "'v4'", "'v3'"]),
    ("tokens build inputs", lambda d: flat_tokens.build("/tmp/x", "train", 3), InvalidArgumentTypeError, ["inputs", "int"]),
    ("tokens build tokenizer", lambda d: flat_tokens.build("/tmp/x", "train", "in.jsonl", tokenizer=3), InvalidArgumentTypeError, ["tokenizer"]),
    ("tokens Writer checkpoint", lambda d: flat_tokens.Writer("/tmp/x", "train", checkpoint_tokens=0),
     InvalidArgumentError, ["checkpoint_tokens", "0"]),
    ("tokens validate", lambda d: flat_tokens.validate(None), InvalidArgumentTypeError, ["path"]),
    # eagle3
    ("eagle3 batch_size float", lambda d: eagle3.Loader(d["eagle3"][0][0], batch_size=2.0), InvalidArgumentTypeError, ["batch_size", "2.0"]),
    ("eagle3 batch_size zero", lambda d: eagle3.Loader(d["eagle3"][0][0], batch_size=0), InvalidArgumentError, ["batch_size", "0"]),
    ("eagle3 no batch_size", lambda d: eagle3.Loader(d["eagle3"][0][0]), InvalidArgumentTypeError, ["batch_size"]),
    ("eagle3 rank", lambda d: eagle3.Loader(d["eagle3"][0][0], batch_size=2, rank=1, world_size=1), InvalidArgumentError, ["rank", "world_size"]),
    ("eagle3 shuffle", lambda d: eagle3.Loader(d["eagle3"][0][0], batch_size=2, shuffle="yes"), InvalidArgumentTypeError, ["shuffle"]),
    ("eagle3 unknown keyword", lambda d: eagle3.Loader(d["eagle3"][0][0], batchsize=2), InvalidArgumentTypeError, ["batchsize", "'batch_size'"]),
    ("eagle3 Cache max_open", lambda d: eagle3.Cache(d["eagle3"][0][0], max_open=0), InvalidArgumentError, ["max_open", "0"]),
    ("eagle3 item float", lambda d: eagle3.open(d["eagle3"][0][0])[1.0], InvalidArgumentTypeError, ["integers", "float"]),
    ("eagle3 validate deep", lambda d: eagle3.validate(d["eagle3"][0][0], deep="yes"), InvalidArgumentTypeError, ["deep"]),
    ("eagle3 set_version", lambda d: eagle3.set_version(d["eagle3"][0][0], 3), InvalidArgumentError, ["format_version 3"]),
    ("eagle3 collate", lambda d: eagle3.collate("abc"), InvalidArgumentTypeError, ["items"]),
    ("eagle3 Writer version", lambda d: eagle3.Writer("/tmp/x", {}, format_version=1.0), InvalidArgumentTypeError, ["format_version"]),
    # sdnb
    ("sdnb open", lambda d: sdnb.open(None), InvalidArgumentTypeError, ["path", "None"]),
    ("sdnb validate", lambda d: sdnb.validate(d["sdnb"][0][0], deep=1), InvalidArgumentTypeError, ["deep"]),
    ("sdnb save format", lambda d: sdnb.save("/tmp/x.sdnb", {}, format="zip"), InvalidArgumentError, ["format", "zip", "sdz"]),
    ("sdnb save align", lambda d: sdnb.save("/tmp/x.sdnb", {}, align=100), InvalidArgumentError, ["align", "100"]),
    ("sdnb save shard_size", lambda d: sdnb.save("/tmp/x.sdnb", {}, shard_size=1.5), InvalidArgumentTypeError, ["shard_size", "1.5"]),
    ("sdnb convert format", lambda d: sdnb.convert(d["sdnb"][0][0], "/tmp/y.sdnb", format=3), InvalidArgumentTypeError, ["format", "3"]),
    ("sdnb set_metadata", lambda d: sdnb.set_metadata(d["sdnb"][0][0], {"k": 1}), InvalidArgumentTypeError, ["metadata"]),
    ("sdnb set_metadata rewrite", lambda d: sdnb.set_metadata(d["sdnb"][0][0], {}, rewrite=None), InvalidArgumentTypeError, ["rewrite"]),
    ("sdnb prefetch str", lambda d: sdnb.open(d["sdnb"][0][0]).prefetch("w"), InvalidArgumentTypeError, ["names", "'w'"]),
    # top-level functions
    ("checksum", lambda d: shardkit.checksum(None), InvalidArgumentTypeError, ["path", "None"]),
    ("verify", lambda d: shardkit.verify(1.0), InvalidArgumentTypeError, ["path", "float"]),
    ("upload", lambda d: shardkit.upload(path_of(d, "saev"), None), InvalidArgumentTypeError, ["dst", "None"]),
    ("download", lambda d: shardkit.download(3, "/tmp/x"), InvalidArgumentTypeError, ["src", "int"]),
    ("upload progress", lambda d: shardkit.upload(path_of(d, "saev"), "s3://b/p", progress="bar"), InvalidArgumentTypeError, ["progress"]),
    ("cache_info", lambda d: shardkit.cache_info(dir=5), InvalidArgumentTypeError, ["dir", "int"]),
    ("clear_cache", lambda d: shardkit.clear_cache(url=5), InvalidArgumentTypeError, ["url", "int"]),
    ("unknown keyword top-level", lambda d: shardkit.verify(path_of(d, "saev"), deep=True), InvalidArgumentTypeError, ["deep", "verify"]),
    # shardkit.torch
    ("torch SaevDataset layer", lambda d: sktorch.SaevDataset(path_of(d, "saev"), layer=5, rank=0, world_size=1),
     InvalidArgumentError, ["layer 5"]),
    ("torch SaevDataset tokens", lambda d: sktorch.SaevDataset(path_of(d, "saev"), layer=0, tokens=None, rank=0, world_size=1),
     InvalidArgumentTypeError, ["tokens", "None"]),
    ("torch SaevDataset keyword", lambda d: sktorch.SaevDataset(path_of(d, "saev"), layer=0, batchsize=4),
     InvalidArgumentTypeError, ["batchsize", "did you mean 'batch_size'"]),
    ("torch SaevDataset missing", lambda d: sktorch.SaevDataset("/no/such/dir", layer=0, rank=0, world_size=1),
     shardkit.NotFoundError, ["/no/such/dir"]),
    ("torch SaevDataset rank", lambda d: sktorch.SaevDataset(path_of(d, "saev"), layer=0, rank=3, world_size=2),
     InvalidArgumentError, ["rank", "world_size"]),
    ("torch TokensDataset seq_len", lambda d: sktorch.TokensDataset(d["flat_tokens"][0][0], seq_len=0, batch_size=4, rank=0, world_size=1),
     InvalidArgumentError, ["seq_len", "0"]),
    ("torch TokensDataset split", lambda d: sktorch.TokensDataset(d["flat_tokens"][0][0], "dev", seq_len=4, batch_size=4, rank=0, world_size=1),
     InvalidArgumentError, ["split", "'dev'"]),
    ("torch Eagle3Dataset batch_size", lambda d: sktorch.Eagle3Dataset(d["eagle3"][0][0], batch_size=-2, rank=0, world_size=1),
     InvalidArgumentError, ["batch_size", "-2"]),
    ("torch Eagle3Dataset epoch", lambda d: sktorch.Eagle3Dataset(d["eagle3"][0][0], batch_size=2, epoch=0.5, rank=0, world_size=1),
     InvalidArgumentTypeError, ["epoch", "0.5"]),
    ("torch SaevLoader keyword", lambda d: sktorch.SaevLoader(path_of(d, "saev"), layer=0, batchsize=4),
     InvalidArgumentTypeError, ["batchsize", "did you mean 'batch_size'"]),
    ("torch SaevLoader layer", lambda d: sktorch.SaevLoader(path_of(d, "saev"), layer=12.0, device="cpu"),
     InvalidArgumentTypeError, ["layer", "12.0"]),
    ("torch TokensLoader keyword", lambda d: sktorch.TokensLoader(d["flat_tokens"][0][0], seq_len=4, batch_size=4, seqlen=4),
     InvalidArgumentTypeError, ["seqlen", "'seq_len'"]),
    ("torch Eagle3Loader device", lambda d: sktorch.Eagle3Loader(d["eagle3"][0][0], batch_size=2, device="gpu"),
     InvalidArgumentError, ["device", "'gpu'"]),
    ("torch Eagle3Loader device type", lambda d: sktorch.Eagle3Loader(d["eagle3"][0][0], batch_size=2, device=1.0),
     InvalidArgumentTypeError, ["device", "1.0"]),
    ("torch num_buffers", lambda d: sktorch.SaevLoader(path_of(d, "saev"), layer=0, device="cpu", num_buffers=2.0),
     InvalidArgumentTypeError, ["num_buffers", "2.0"]),
    ("torch host_buffers pinned on cpu", lambda d: sktorch.SaevLoader(path_of(d, "saev"), layer=0, device="cpu", host_buffers="pinned"),
     InvalidArgumentError, ["host_buffers='pinned'", "CUDA"]),
]


@pytest.mark.parametrize("name,call,cls,words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_argument_raises_the_documented_error_naming_it(data, name, call, cls, words):
    with pytest.raises(ShardkitError) as info:
        call(data)
    check(info, cls, *words)


def test_the_net_maps_pyo3_conversions_of_the_compiled_core(data):
    """Where a wrapper passes an argument through unchecked, PyO3's TypeError/OverflowError
    still arrives as the documented class."""
    from shardkit import _args, _shardkit as core

    def unchecked(path, layer):
        return core.Loader(path, layer=0, batch_size=layer)

    with pytest.raises(InvalidArgumentTypeError, match=r"argument 'batch_size'.*float"):
        _args.guard(unchecked)(path_of(data, "saev"), 1.5)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        _args.guard(unchecked)(path_of(data, "saev"), -1)

    def raises_type_error():
        raise TypeError("not an argument conversion")

    with pytest.raises(TypeError, match="not an argument conversion") as info:
        _args.guard(raises_type_error)()
    assert not isinstance(info.value, ShardkitError)  # a bug elsewhere is not relabelled


def test_every_public_callable_is_guarded():
    import inspect

    for module in (shardkit, saev, compat, flat_tokens, eagle3, sdnb, sktorch):
        names = module.__all__ if module is not shardkit else [
            "upload", "download", "checksum", "verify", "cache_info", "clear_cache", "storage_counters", "wait_for_cache"]
        for n in names:
            obj = getattr(module, n)
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                assert getattr(obj, "__shardkit_guarded__", False), f"{module.__name__}.{n}"
            elif inspect.isclass(obj) and "__init__" in vars(obj):
                assert getattr(vars(obj)["__init__"], "__shardkit_guarded__", False), f"{module.__name__}.{n}"


def test_device_default_is_the_machines_and_loaders_work_without_one(data):
    expect = "cuda" if torch.cuda.is_available() else "cpu"
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        expect = torch.accelerator.current_accelerator().type
    assert sktorch.default_device().type == expect
    (path,), kw = data["saev"]
    loaders = [
        sktorch.SaevLoader(path, **kw),
        sktorch.TokensLoader(*data["flat_tokens"][0], **data["flat_tokens"][1]),
        sktorch.Eagle3Loader(*data["eagle3"][0], **data["eagle3"][1]),
    ]
    for loader in loaders:
        assert loader.device.type == expect
        batch = next(iter(loader))
        assert all(t.device.type == expect for t in batch.values())


def test_properties_equal_what_was_passed_and_reprs_show_them(data):
    (path,), kw = data["saev"]
    sl = saev.Loader(path, layer=0, batch_size=32, seed=5, epoch=1, rank=0, world_size=1, drop_last=True,
                     memory_budget=64 << 10)
    assert (sl.batch_size, sl.seed, sl.layer, sl.shuffle, sl.order, sl.rank, sl.world_size, sl.drop_last, sl.epoch) == \
        (32, 5, 0, True, "block", 0, 1, True, 1)
    assert sl.tokens == "content" and sl.path == path
    r = repr(sl)
    for w in [path, "layer=0", "batch_size=32", "order='block'", "seed=5", "rank=0", "world_size=1", "drop_last=True", "epoch=1"]:
        assert w in r, (w, r)
    ol = saev.OrderedLoader(path, layer=0, batch_size=16)
    assert (ol.shuffle, ol.order, ol.batch_size) == (False, "sequential", 16)
    assert repr(ol).startswith("saev.OrderedLoader(")

    (tpath,), tkw = data["flat_tokens"]
    tl = flat_tokens.Loader(tpath, **{**tkw, "seed": 3})
    assert (tl.batch_size, tl.seed, tl.seq_len, tl.rank, tl.world_size, tl.shuffle, tl.drop_last, tl.split) == \
        (4, 3, 16, 0, 1, True, True, "train")
    next(iter(tl))
    for w in [os.fspath(tpath), "seq_len=16", "batch_size=4", "seed=3", "step=1"]:
        assert w in repr(tl), (w, repr(tl))

    (epath,), ekw = data["eagle3"]
    el = eagle3.Loader(epath, **{**ekw, "shuffle": False, "seed": 9})
    assert (el.batch_size, el.shuffle, el.seed, el.drop_last, el.rank, el.world_size) == (3, False, 9, False, 0, 1)
    for w in [os.fspath(epath), "batch_size=3", "shuffle=False", "seed=9", "epoch=0"]:
        assert w in repr(el), (w, repr(el))

    dev = sktorch.SaevLoader(path, layer=0, batch_size=32, seed=5, rank=0, world_size=1, device="cpu", memory_budget=64 << 10)
    assert (dev.batch_size, dev.seed, dev.layer, dev.order, dev.rank, dev.world_size, dev.shuffle) == \
        (32, 5, 0, "block", 0, 1, True)
    assert repr(dev).startswith("torch.SaevLoader(") and "device='cpu'" in repr(dev) and "batch_size=32" in repr(dev)
    tdev = sktorch.TokensLoader(tpath, **tkw, device="cpu")
    assert (tdev.batch_size, tdev.seq_len, tdev.step) == (4, 16, 0) and "seq_len=16" in repr(tdev)
    edev = sktorch.Eagle3Loader(epath, **ekw, device="cpu")
    assert (edev.batch_size, edev.seed, edev.epoch) == (3, 0, 0) and "batch_size=3" in repr(edev)

    ds = sktorch.SaevDataset(path, layer=0, batch_size=32, seed=2, rank=0, world_size=1, memory_budget=64 << 10)
    assert (ds.batch_size, ds.seed, ds.layer, ds.order, ds.rank, ds.world_size, ds.epoch, ds.shuffle) == \
        (32, 2, 0, "block", 0, 1, 0, True)
    assert "layer=0" in repr(ds) and "batch_size=32" in repr(ds) and path in repr(ds)
    assert pickle.loads(pickle.dumps(ds)).batch_size == 32  # no loader held: workers get it by pickle
    tds = sktorch.TokensDataset(tpath, **{**tkw, "rank": 0, "world_size": 1})
    assert (tds.batch_size, tds.seq_len, tds.split) == (4, 16, "train") and "seq_len=16" in repr(tds)
    eds = sktorch.Eagle3Dataset(epath, batch_size=3, shuffle=False, rank=0, world_size=1)
    assert (eds.batch_size, eds.shuffle) == (3, False) and "shuffle=False" in repr(eds)


def test_writer_and_reader_reprs(tmp_path, data):
    md = {"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 2, "cls_token": False,
          "d_model": 4, "n_examples": 2, "max_tokens_per_shard": 4, "data": "gASV", "dataset": "t", "protocol": "2.1"}
    w = saev.Writer(tmp_path / "s", md, progress=False)
    assert "saev.Writer(" in repr(w) and "next_example=0" in repr(w) and "n_examples=2" in repr(w)
    w.abort()
    assert "closed" in repr(w)
    with flat_tokens.Writer(tmp_path / "t.zarr", "train", progress=False) as tw:
        tw.append([[1, 2]])
        assert "seq_count=1" in repr(tw) and "split='train'" in repr(tw)
    view = saev.open(path_of(data, "saev")).indexed(0)
    assert "layer=0" in repr(view) and "tokens='content'" in repr(view)
    ix = compat.IndexedDataset(compat.IndexedConfig(shards=path_of(data, "saev"), layer=0))
    assert "rows=" in repr(ix)


def test_torch_datasets_fail_in_the_constructing_process(data, monkeypatch):
    """No DataLoader worker is needed to see a bad argument: the dataset opens the data once."""
    calls = []
    real = saev.Loader.__init__

    def spy(self, *a, **k):
        calls.append(os.getpid())
        return real(self, *a, **k)

    monkeypatch.setattr(saev.Loader, "__init__", spy)
    sktorch.SaevDataset(path_of(data, "saev"), **data["saev"][1])
    assert calls == [os.getpid()]


def test_rank_world_from_the_environment(data, monkeypatch):
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(InvalidArgumentError, match=r"\$RANK='x'"):
        sktorch.SaevDataset(path_of(data, "saev"), layer=0, batch_size=32, memory_budget=64 << 10)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    kw = {**data["saev"][1], "world_size": 4}
    del kw["rank"]
    ds = sktorch.SaevDataset(path_of(data, "saev"), **kw)
    assert (ds.rank, ds.world_size) == (1, 4)  # each one given or from the environment


# --- CLI inspect: text by default, JSON with --json, for every format -------------------

shardkit_bin = shardkit_cli


@pytest.mark.parametrize("which,cmd,key", [
    ("saev", "saev", "complete"),
    ("flat_tokens", "tokens", "train"),
    ("eagle3", "eagle3", "complete"),
    ("sdnb", "sdnb", "variables"),
])
def test_cli_inspect_prints_text_and_json_for_every_format(data, which, cmd, key):
    exe = shardkit_bin()
    path = path_of(data, which)
    text = subprocess.run([exe, cmd, "inspect", path], capture_output=True, text=True)
    assert text.returncode == 0, text.stderr
    assert not text.stdout.lstrip().startswith("{"), text.stdout  # text, not JSON
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.stdout)
    js = subprocess.run([exe, cmd, "inspect", "--json", path], capture_output=True, text=True)
    assert js.returncode == 0, js.stderr
    info = json.loads(js.stdout)
    assert key in info
    if which != "sdnb":
        # The text shows each top-level key of the JSON summary, aligned, with its value.
        lines = text.stdout.splitlines()
        for k, v in info.items():
            assert any(re.match(rf"^{re.escape(k)}(\s|$)", line) for line in lines), (k, text.stdout)
            if isinstance(v, (int, str)) and not isinstance(v, bool):
                assert any(line.startswith(k) and line.split(None, 1)[-1] == str(v) for line in lines), (k, v)
    # And the Python function returns the same summary as --json.
    if which in ("saev", "flat_tokens", "eagle3"):
        py = {"saev": saev.inspect, "flat_tokens": flat_tokens.inspect, "eagle3": eagle3.inspect}[which](path)
        assert py.keys() == info.keys()
