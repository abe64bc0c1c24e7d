"""shardkit.dspark: the Python API for NeMo Automodel's DSpark offline cache (writer, mapped
reader, loader, validation, the torch adapters), its refusals of bad arguments and hostile
files (each naming the file and the rule), and a writer killed with SIGKILL resuming to the
exact bytes. Caches written "by NeMo" come from the restatement in tests/interop/dspark_ref.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import shardkit
from shardkit import CorruptDataError, IncompleteDatasetError, dspark

from _procs import child_env, run_child, snapshot

INTEROP = Path(__file__).resolve().parents[3] / "tests" / "interop"
sys.path.insert(0, str(INTEROP))
import dspark_data as D  # noqa: E402
import dspark_ref as ref  # noqa: E402

TIMEOUT = 120


def write(path, n=5, s=2, dtype="bf16", seed=0, **kw):
    """A cache written by shardkit: manifest, weights, samples one by one."""
    m = D.manifest(n, s, dtype=dtype, **kw)
    x, w = D.samples(m, seed), D.weights(m, seed)
    with dspark.Writer(path, m) as wr:
        wr.write_target_weights(*w)
        for i in range(n):
            wr.add(D.item(x, i))
    return m, D.cast(m, x), w


def nemo(path, n=6, s=2, dtype="bf16", seed=0, world=1, x=None, **kw):
    """A cache written by NeMo's producer (the restatement); `x` replaces the samples."""
    m = D.manifest(n, s, dtype=dtype, **kw)
    x = D.samples(m, seed) if x is None else x
    ref.precompute_distributed(path, m, x, world, D.weights(m, seed))
    return m, D.cast(m, x)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def read_all(path):
    """Opens the cache and reads every item and the weights (what a training run touches)."""
    c = dspark.open(path)
    for i in range(len(c)):
        c[i]
    c.target_weights()
    return c


def findings(report):
    return " | ".join(f"{e['file']}: {e['message']}" for e in report["errors"])


# ---------------------------------------------------------------------------------------------
# Writing and reading


def test_write_read_and_coercions(tmp_path):
    m, want, w = write(tmp_path / "c", n=5, s=2, dtype="bf16")
    cache = dspark.open(tmp_path / "c")
    assert len(cache) == 5 and cache.manifest["format_version"] == 1 and cache.manifest["complete"] is True
    item = cache[3]
    assert sorted(item) == sorted(ref.CACHE_KEYS)
    assert item["input_ids"].dtype == np.int64 and item["input_ids"].shape == (4,)
    assert item["loss_mask"].dtype == np.int64
    assert item["target_hidden_states"].dtype == ml_dtypes.bfloat16 and item["target_hidden_states"].shape == (4, 6)
    assert item["target_last_hidden_states"].shape == (4, 3)
    for k in ref.CACHE_KEYS:
        assert np.array_equal(bits(item[k]), bits(want[k][3])), k
    assert not item["target_hidden_states"].flags.writeable, "a view of the shard's read-only map"
    assert np.array_equal(cache[-1]["input_ids"], want["input_ids"][4])
    assert [it["input_ids"].tolist() for it in cache[1:3]] == want["input_ids"][1:3].tolist()
    with pytest.raises(shardkit.OutOfRangeError, match="sample 5 is past the end: there are 5 samples"):
        cache[5]
    e, h = cache.target_weights()
    assert e.dtype == ml_dtypes.bfloat16 and e.shape == (D.VOCAB, 3)
    assert np.array_equal(bits(e), bits(w[0].astype(ml_dtypes.bfloat16)))
    assert np.array_equal(bits(h), bits(w[1].astype(ml_dtypes.bfloat16)))
    batch = dspark.collate([cache[0], cache[4]])
    assert batch["target_hidden_states"].shape == (2, 4, 6)
    assert np.array_equal(bits(batch["input_ids"]), bits(want["input_ids"][[0, 4]]))
    info = dspark.inspect(tmp_path / "c")
    assert info["schema"] == "dspark" and info["format_version"] == 1 and info["complete"] is True, info
    assert dspark.validate(tmp_path / "c", deep=True)["valid"]


def test_fields_and_a_finished_cache_resumed_is_left_as_it_is(tmp_path):
    path = tmp_path / "c"
    m, _, _ = write(path, n=3, s=2, dtype="fp16")
    before = snapshot(path)
    with dspark.Writer(path, m, resume=True) as w:
        assert w.next_sample == 3 and w.resumed_from == 3
        assert w.fields == {"input_ids": ("I64", (4,)), "loss_mask": ("I64", (4,)),
                            "target_hidden_states": ("F16", (4, 6)), "target_last_hidden_states": ("F16", (4, 3))}
    assert snapshot(path) == before


def test_writer_argument_refusals(tmp_path):
    m = D.manifest(3, 2)
    x = D.samples(m)
    w = dspark.Writer(tmp_path / "c", m)
    good = D.item(x, 0)
    with pytest.raises(shardkit.InvalidArgumentError, match=r"missing \['target_last_hidden_states'\]"):
        w.add({k: v for k, v in good.items() if k != "target_last_hidden_states"})
    with pytest.raises(shardkit.InvalidArgumentError, match="not tensors of this cache"):
        w.add({**good, "attention_mask": np.ones(4, dtype=np.int64)})
    with pytest.raises(shardkit.InvalidArgumentError, match="`input_ids` must have shape"):
        w.add({**good, "input_ids": np.zeros(5, dtype=np.int64)})
    with pytest.raises(shardkit.InvalidArgumentError, match="`target_hidden_states` must have shape"):
        w.add({**good, "target_hidden_states": np.zeros((4, 3), dtype=np.float32)})
    with pytest.raises(shardkit.InvalidArgumentError, match="`target_last_hidden_states` must have shape"):
        w.add({**good, "target_last_hidden_states": np.zeros((4, 6), dtype=np.float32)})
    with pytest.raises(shardkit.InvalidArgumentTypeError, match="`target_hidden_states` must hold floats"):
        w.add({**good, "target_hidden_states": np.zeros((4, 6), dtype=np.int64)})
    with pytest.raises(shardkit.InvalidArgumentTypeError, match="`input_ids` must hold integers"):
        w.add({**good, "input_ids": np.zeros(4, dtype=np.float32)})
    with pytest.raises(shardkit.InvalidArgumentError, match=r"refused `loss_mask` at sample 0, position 2: 2 "):
        w.add({**good, "loss_mask": np.array([0, 1, 2, 1])})
    with pytest.raises(shardkit.InvalidArgumentError, match=r"`target_hidden_states` at sample 0, position 1"):
        bad = good["target_hidden_states"].copy()
        bad[1, 0] = np.nan
        w.add({**good, "target_hidden_states": bad})
    with pytest.raises(shardkit.InvalidArgumentError, match="`lm_head.weight` has 4 columns; the hidden size is target_last_hidden_dim 3"):
        w.write_target_weights(np.zeros((D.VOCAB, 3), np.float32), np.zeros((D.VOCAB, 4), np.float32))
    with pytest.raises(shardkit.InvalidArgumentError, match="shape"):
        w.write_target_weights(np.zeros(D.VOCAB * 3, np.float32), np.zeros(D.VOCAB * 3, np.float32))
    assert w.next_sample == 0, "a refused sample stores nothing"
    w.add(good)
    with pytest.raises(IncompleteDatasetError, match="continues at sample"):
        w.close()


@pytest.mark.parametrize("change,words", [
    ({"dtype": "int8"}, "dtype"),
    ({"shard_size": 0}, "shard_size"),
    ({"seq_length": "4"}, "seq_length"),
    ({"target_hidden_dim": None}, "target_hidden_dim"),
])
def test_writer_manifest_refusals(tmp_path, change, words):
    m = {**D.manifest(3, 2), **change}
    with pytest.raises((shardkit.InvalidArgumentError, CorruptDataError), match=words):
        dspark.Writer(tmp_path / "c", m)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_writer_missing_manifest_key_is_named(tmp_path):
    m = D.manifest(3, 2)
    del m["target_last_hidden_dim"]
    with pytest.raises((shardkit.InvalidArgumentError, CorruptDataError), match="target_last_hidden_dim"):
        dspark.Writer(tmp_path / "c", m)


def test_an_existing_cache_is_refused_without_resume(tmp_path):
    path = tmp_path / "c"
    m, _ = nemo(path, n=4, s=2)
    before = snapshot(path)
    with pytest.raises(shardkit.AlreadyExistsError):
        dspark.Writer(path, m)
    assert snapshot(path) == before


# ---------------------------------------------------------------------------------------------
# Hostile files (written by NeMo's producer, then damaged)


def damage_truncated(path):
    p = path / "shard-000001.safetensors"
    p.write_bytes(p.read_bytes()[:-5])
    return "shard-000001.safetensors", "truncated"


def damage_tensor_names(path):
    p = str(path / "shard-000001.safetensors")
    with safe_open(p, framework="np") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["hidden_states"] = t.pop("target_hidden_states")
    save_file(t, p)
    return "shard-000001.safetensors", "target_hidden_states"


def damage_tensor_shape(path):
    p = str(path / "shard-000002.safetensors")
    with safe_open(p, framework="np") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["target_last_hidden_states"] = np.ascontiguousarray(t["target_last_hidden_states"][:, :, :2])
    save_file(t, p)
    return "shard-000002.safetensors", "target_last_hidden_states"


def damage_gap(path):
    os.remove(path / "shard-000001.safetensors")
    return str(path), "shard-000001.safetensors"


def damage_extra_shard(path):
    (path / "shard-000003.safetensors").write_bytes((path / "shard-000002.safetensors").read_bytes())
    return str(path), "shard-000003.safetensors"


def damage_not_json(path):
    (path / "manifest.json").write_text('{"format_version": 1, "dtype": ')
    return "manifest.json", "JSON"


def damage_types(path):
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, "shard_size": "2"}))
    return "manifest.json", "shard_size"


def damage_negative(path):
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, "num_samples": -6}))
    return "manifest.json", "num_samples"


def damage_version(path):
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, "format_version": 2}))
    return "manifest.json", "format_version"


def damage_weights_shape(path):
    e, h = ref.read_target_weights(str(path))
    save_file({"embed_tokens.weight": e, "lm_head.weight": np.ascontiguousarray(h[:, :2])},
              str(path / ref.TARGET_WEIGHTS))
    return ref.TARGET_WEIGHTS, "lm_head.weight"


def damage_weights_names(path):
    e, _ = ref.read_target_weights(str(path))
    save_file({"weight": e}, str(path / ref.TARGET_WEIGHTS))
    return ref.TARGET_WEIGHTS, "embed_tokens.weight"


HOSTILE = {f.__name__[len("damage_"):]: f for f in [
    damage_truncated, damage_tensor_names, damage_tensor_shape, damage_gap, damage_extra_shard,
    damage_not_json, damage_types, damage_negative, damage_version, damage_weights_shape,
    damage_weights_names]}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_files_are_refused_naming_the_file_and_the_rule(tmp_path, what):
    path = tmp_path / "c"
    nemo(path, n=6, s=2, dtype="bf16")
    name, rule = HOSTILE[what](path)
    with pytest.raises(CorruptDataError) as e:
        read_all(path)
    msg = str(e.value)
    assert name in msg and rule in msg, msg
    report = dspark.validate(path, deep=True)
    assert not report["valid"], report
    assert any(name in f["file"] + f["message"] and rule in f["message"] for f in report["errors"]), findings(report)


def test_a_short_cache_marked_complete_is_incomplete(tmp_path):
    # Shards missing from the end of a cache whose manifest says complete (copied in part).
    path = tmp_path / "c"
    nemo(path, n=6, s=2)
    os.remove(path / "shard-000002.safetensors")
    # NeMo's reader refuses the shard set; shardkit says which shard is missing.
    with pytest.raises(ValueError, match=r"found shard indices \[0, 1\]"):
        ref.CachedDSparkDataset(str(path))
    with pytest.raises((IncompleteDatasetError, CorruptDataError), match="shard-000002"):
        dspark.open(path)
    assert not dspark.validate(path)["valid"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_validate_deep_finds_nan_and_mask_values_nemo_wrote(tmp_path, dtype):
    m = D.manifest(6, 2, dtype=dtype)
    x = D.samples(m, 3)
    x["target_hidden_states"][3, 1, 2] = np.nan
    x["loss_mask"][4, 2] = 2
    path = tmp_path / "c"
    nemo(path, n=6, s=2, dtype=dtype, seed=3, x=x)
    assert len(ref.CachedDSparkDataset(str(path))) == 6, "NeMo checks neither"
    assert dspark.validate(path)["valid"], "a shallow check reads no values"
    report = dspark.validate(path, deep=True)
    assert not report["valid"]
    by_file = {}
    for f in report["errors"]:
        by_file.setdefault(os.path.basename(f["file"]), []).append(f["message"])
    assert sorted(by_file) == ["shard-000001.safetensors", "shard-000002.safetensors"], findings(report)
    assert any("target_hidden_states" in t and "NaN" in t and "sample 3" in t for t in by_file["shard-000001.safetensors"]), by_file
    assert any("loss_mask" in t and "2" in t and "sample 4" in t for t in by_file["shard-000002.safetensors"]), by_file


# ---------------------------------------------------------------------------------------------
# Killed and resumed


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, INTEROP)
    import dspark_data as D
    from shardkit import dspark
    m = D.manifest(N, S, seq=16, hidden=32, layers=[1, 2, 4], dtype="bf16")
    x, w = D.samples(m, 4), D.weights(m, 4)
    wr = dspark.Writer(PATH, m, resume=RESUME, progress=False)
    print("open", wr.next_sample, flush=True)
    for i in range(wr.next_sample, N):
        print("step", i, flush=True)
        time.sleep(0.01)
        wr.add(D.item(x, i))
    print("weights", flush=True)
    time.sleep(0.01)
    wr.write_target_weights(*w)
    print("close", flush=True)
    wr.close()
    print("done", flush=True)
    """
)
N, S = 23, 3


def child(path, resume):
    params = dict(INTEROP=str(INTEROP), PATH=str(path), RESUME=resume, N=N, S=S)
    return [sys.executable, "-c", "".join(f"{k} = {v!r}\n" for k, v in params.items()) + CHILD]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "c"
    killed, lines = run_child(child(path, False))
    assert not killed and lines[-1] == "done", lines
    snap = snapshot(path)
    assert sorted(snap) == sorted(["manifest.json", "shardkit.checksums.json", ref.TARGET_WEIGHTS]
                                  + [f"shard-{k:06d}.safetensors" for k in range(8)])
    return snap


@pytest.mark.parametrize("kill_at,again", [
    ("open", None), ("step 0", None), ("step 4", "step 11"), ("step 16", None), ("step 22", "weights"),
    ("weights", None), ("close", "close"),
])
def test_a_killed_writer_resumes_to_the_same_bytes(tmp_path, whole, kill_at, again):
    path = tmp_path / "c"
    killed, lines = run_child(child(path, False), kill_at)
    assert killed, lines
    for reader in (lambda: dspark.open(path), lambda: ref.CachedDSparkDataset(str(path))):
        try:
            reader()
        except (IncompleteDatasetError, ValueError, FileNotFoundError):
            pass
        else:  # only a kill after manifest.json was marked complete leaves a readable cache
            assert kill_at == "close", kill_at
    if (path / "manifest.json").exists() and json.loads((path / "manifest.json").read_text())["complete"]:
        # Marked complete only as the last step of close(): every data file is final.
        got = snapshot(path)
        assert {k: got.get(k) for k in whole if not k.endswith("checksums.json")} == {
            k: v for k, v in whole.items() if not k.endswith("checksums.json")}
    if again:
        killed, lines = run_child(child(path, True), again)
    killed, lines = run_child(child(path, True))
    assert not killed and lines[-1] == "done", lines
    resumed_at = int(lines[0].split()[1])
    assert resumed_at % S == 0 or resumed_at == N, lines[0]
    assert snapshot(path) == whole


# ---------------------------------------------------------------------------------------------
# Loaders


def test_loader_ranks_epochs_and_state(tmp_path):
    path = tmp_path / "c"
    _, want, _ = write(path, n=7, s=3, dtype="fp16")
    cache = dspark.open(path)
    seen = []
    for rank in range(2):
        loader = dspark.Loader(path, batch_size=2, seed=3, rank=rank, world_size=2)
        assert len(loader.indices()) == 4 and len(loader) == 2
        batches = list(loader)
        assert batches[0]["target_hidden_states"].flags.writeable, "batches belong to the caller"
        for b, start in zip(batches, (0, 2), strict=True):
            ref_b = dspark.collate([cache[i] for i in loader.indices()[start:start + 2]])
            assert sorted(b) == sorted(ref_b)
            for k in ref_b:
                assert np.array_equal(bits(b[k]), bits(ref_b[k])), k
        seen += loader.indices()
    assert sorted(set(seen)) == list(range(7)) and len(seen) == 8
    loader = dspark.Loader(path, batch_size=2, seed=3, rank=0, world_size=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["batch"] == 1 and state["seed"] == 3
    rest = [b["input_ids"].tolist() for b in it]
    again = dspark.Loader(path, batch_size=2, seed=3, rank=0, world_size=1)
    again.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in again] == rest
    with pytest.raises(shardkit.InvalidArgumentError, match="seed: state 3, this loader 0"):
        dspark.Loader(path, batch_size=2, seed=0, rank=0, world_size=1).load_state_dict(state)
    # The state round-trips through JSON (a checkpoint).
    again = dspark.Loader(path, batch_size=2, seed=3, rank=0, world_size=1)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [b["input_ids"].tolist() for b in again] == rest
    in_order = dspark.Loader(path, batch_size=3, shuffle=False, rank=0, world_size=1)
    assert in_order.indices() == list(range(7))
    assert np.array_equal(next(iter(in_order))["input_ids"], want["input_ids"][:3])


def test_torch_dataset_and_loader_on_cpu(tmp_path):
    import torch  # a required test dependency (scripts/setup-venv installs it)

    from shardkit import torch as sktorch

    path = tmp_path / "c"
    write(path, n=9, s=2, dtype="bf16")
    cache = dspark.open(path)
    host = dspark.Loader(path, batch_size=4, seed=5, rank=0, world_size=1)
    idx = host.indices()
    want = [dspark.collate([cache[i] for i in idx[a:a + 4]]) for a in range(0, 9, 4)]

    def same(got, ref_b):
        assert sorted(got) == sorted(ref_b)
        for k, a in ref_b.items():
            t = got[k]
            assert isinstance(t, torch.Tensor) and tuple(t.shape) == a.shape, k
            if a.dtype == ml_dtypes.bfloat16:
                assert t.dtype == torch.bfloat16
                t, a = t.view(torch.int16), a.view(np.int16)
            assert np.array_equal(t.cpu().numpy(), a), k

    dl = sktorch.DSparkLoader(path, batch_size=4, seed=5, rank=0, world_size=1, device="cpu")
    got = list(dl)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        same(g, w)
    ds = sktorch.DSparkDataset(path, batch_size=4, seed=5, rank=0, world_size=1)
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    for g, w in zip(got, want, strict=True):
        same(g, w)
    t = dspark.to_torch(want[0])
    assert t["target_hidden_states"].dtype == torch.bfloat16 and t["input_ids"].dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# Parts


def test_part_writers_write_what_one_writer_writes_and_report_status(tmp_path):
    m = D.manifest(7, 2, dtype="fp32")
    x, w = D.samples(m, 6), D.weights(m, 6)
    with dspark.Writer(tmp_path / "one", m) as wr:
        wr.write_target_weights(*w)
        wr.add_batch(D.rows(x, 0, 7))
    path = tmp_path / "parts"
    for r in (2, 0, 1):
        pw = dspark.PartWriter(path, m, 7, rank=r, world_size=3, target_weights=True)
        assert json.loads((path / "manifest.json").read_text())["complete"] is False
        if r == 0:
            pw.write_target_weights(*w)
        a, b = pw.samples
        pw.add_batch(D.rows(x, a, b))
        st = pw.close()
        assert st["committed"] is (r == 1), st
    assert dspark.status(path)["committed"] is True
    assert snapshot(path) == snapshot(tmp_path / "one")
    assert dspark.commit_parts(path)["committed"] is True
    assert snapshot(path) == snapshot(tmp_path / "one")


def test_a_part_writer_that_is_not_closed_leaves_the_cache_unreadable(tmp_path):
    m = D.manifest(6, 2)
    x = D.samples(m)
    path = tmp_path / "c"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(INTEROP)!r})
        import dspark_data as D
        from shardkit import dspark
        m = D.manifest(6, 2)
        pw = dspark.PartWriter({str(path)!r}, m, 6, rank=0, world_size=2)
        pw.add(D.item(D.samples(m), 0))
        pw.add(D.item(D.samples(m), 1))
        pw.add(D.item(D.samples(m), 2))
        print("partial", flush=True)
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    p = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == -signal.SIGKILL, p.stderr
    with pytest.raises(IncompleteDatasetError):
        dspark.open(path)
    st = dspark.status(path)
    assert st["committed"] is False and st["units"] == 3 and st["done"] == 1, st
    # The job restarted with another world size finishes it.
    for r in range(3):
        pw = dspark.PartWriter(path, m, 6, rank=r, world_size=3)
        for a, b in pw.pending:
            pw.add_batch(D.rows(x, a, b))
        pw.close()
    assert dspark.status(path)["committed"] is True
    c = dspark.open(path)
    assert [c[i]["input_ids"].tolist() for i in range(6)] == D.cast(m, x)["input_ids"].tolist()
