"""What the writers accept (issue 32, classes 2 and 4): every format refuses values it cannot
store (out of range, lossy, non-finite, not a distribution) with a ShardkitError naming the
field, where, the value and the rule; converts exactly where the conversion is exact (bf16/fp16
torch and numpy in, the float32 path's bytes out); and a refused write leaves the dataset as it
was, so the write continues, completes and resumes."""

import hashlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _cli import shardkit_cli
from shardkit.errors import InvalidArgumentError, InvalidArgumentTypeError, ShardkitError

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------------------------- saev ---

L, T, D, P = 1, 8, 16, 8


def md(n=4):
    return {"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": P, "cls_token": False,
            "d_model": D, "n_examples": n, "max_tokens_per_shard": 16, "data": "gASV", "dataset": "d",
            "protocol": "2.1"}


def acts(first, b):
    # Small halves (exact in bf16, fp16 and float32): e.g. 1.5, 2.0, ...
    return (np.arange(first * T * D, (first + b) * T * D) % 64 / 2).reshape(b, L, T, D).astype(np.float32)


def labels(first, b):
    return ((np.arange(first * P, (first + b) * P) * 7) % 256).reshape(b, P)


def tree(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def saev_bytes(root, convert):
    with saev.Writer(root, md(), progress=False) as w:
        w.write(convert(acts(0, 4)), labels(0, 4))
    out = b""
    for name in sorted(f for f in os.listdir(w.path) if f.startswith("acts")):
        with open(os.path.join(w.path, name), "rb") as f:
            out += f.read()
    return out


@pytest.mark.parametrize(
    "name, convert",
    [
        ("float64", lambda a: a.astype(np.float64)),
        ("float16", lambda a: a.astype(np.float16)),
        ("ml_dtypes bfloat16", lambda a: a.astype(ml_dtypes.bfloat16)),
        ("torch float32", lambda a: torch.from_numpy(a)),
        ("torch bfloat16", lambda a: torch.from_numpy(a).to(torch.bfloat16)),
        ("torch float16", lambda a: torch.from_numpy(a).to(torch.float16)),
        ("torch float64 requiring grad", lambda a: torch.from_numpy(a).double().requires_grad_()),
        ("nested lists", lambda a: a.tolist()),
    ],
)
def test_saev_exact_conversions_write_the_float32_bytes(tmp_path, name, convert):
    want = saev_bytes(tmp_path / "f32", lambda a: a)
    assert saev_bytes(tmp_path / "other", convert) == want, name


def test_saev_integer_acts_convert_when_exact(tmp_path):
    a = (np.arange(4 * T * D) % 50).reshape(4, L, T, D)
    with saev.Writer(tmp_path / "i", md(), progress=False) as w:
        w.write(a.astype(np.int32), labels(0, 4))
    shards = sorted(f for f in os.listdir(w.path) if f.startswith("acts"))
    got = np.concatenate([np.fromfile(os.path.join(w.path, f), dtype="<f4") for f in shards])
    assert len(shards) == 2 and np.array_equal(got, a.reshape(-1).astype(np.float32))


@pytest.mark.parametrize(
    "bad, cls, words",
    [
        (lambda: acts(0, 2).astype(np.float64) + 0.1, InvalidArgumentError,
         ["`acts` is float64", "0.1", "no exact float32 value", "cast explicitly"]),
        (lambda: np.full((2, L, T, D), 2**24 + 1, dtype=np.int64), InvalidArgumentError,
         ["`acts` is int64", "16777217", "cast explicitly"]),
        (lambda: np.ones((2, L, T, D), dtype=bool), InvalidArgumentTypeError, ["`acts` must be floats", "bool"]),
        (lambda: np.ones((2, L, T, D), dtype=np.complex64), InvalidArgumentTypeError, ["complex64"]),
        (lambda: None, InvalidArgumentTypeError, ["`acts` must be an array", "None"]),
        (lambda: [[1.0, 2.0], [3.0]], InvalidArgumentTypeError, ["not a rectangular array"]),
        (lambda: np.ones((2, L, T, D + 1), dtype=np.float32), InvalidArgumentError,
         [f"`acts` must have shape (b, {L}, {T}, {D})", "d_model", f"got (2, {L}, {T}, {D + 1})"]),
        (lambda: np.ones((2, T, D), dtype=np.float32), InvalidArgumentError, ["must have shape"]),
    ],
)
def test_saev_refuses_acts_it_cannot_store_exactly(tmp_path, bad, cls, words):
    with saev.Writer(tmp_path, md(), progress=False) as w:
        w.write(acts(0, 2), labels(0, 2))
        before = tree(w.path)
        with pytest.raises(cls) as e:
            w.write(bad(), labels(2, 2))
        assert isinstance(e.value, ShardkitError)
        for word in words:
            assert word in str(e.value), (word, str(e.value))
        assert w.next_example == 2 and tree(w.path) == before
        w.write(acts(2, 2), labels(2, 2))
    assert saev.validate(w.path)["valid"]


@pytest.mark.parametrize(
    "bad, cls, words",
    [
        (np.array([[0, 300] + [0] * (P - 2)] * 2), InvalidArgumentError,
         ["refused `labels` at example 2, content token 1: 300", "0 to 255", "nothing of this write was stored"]),
        (np.array([[0] * (P - 1) + [-1]] * 2), InvalidArgumentError, ["example 2, content token 7: -1"]),
        (torch.full((2, P), 256), InvalidArgumentError, [": 256 "]),
        (np.full((2, P), 1.0), InvalidArgumentTypeError, ["`labels` must hold integers", "float64", "cast explicitly"]),
        (np.ones((2, P), dtype=bool), InvalidArgumentTypeError, ["must hold integers", "bool"]),
        (np.ones((2, P + 1), dtype=np.uint8), InvalidArgumentError, [f"`labels` must have shape (2, {P})"]),
        ([[1, 2], [3]], InvalidArgumentTypeError, ["not a rectangular array"]),
    ],
)
def test_saev_refuses_labels_outside_uint8(tmp_path, bad, cls, words):
    with saev.Writer(tmp_path, md(), progress=False) as w:
        w.write(acts(0, 2), labels(0, 2))
        before = tree(w.path)
        with pytest.raises(cls) as e:
            w.write(acts(2, 2), bad)
        for word in words:
            assert word in str(e.value), (word, str(e.value))
        assert w.next_example == 2 and tree(w.path) == before
        w.write(acts(2, 2), torch.from_numpy(labels(2, 2)))  # any integer dtype, torch too
    assert saev.validate(w.path)["valid"]
    got = np.fromfile(os.path.join(w.path, "labels.bin"), dtype=np.uint8).reshape(4, P)
    assert np.array_equal(got, labels(0, 4))


def test_saev_refused_write_leaves_a_resumable_dataset(tmp_path):
    with saev.Writer(tmp_path / "ref", md(), progress=False) as w:
        w.write(acts(0, 4), labels(0, 4))
    ref = tree(w.path)
    with pytest.raises(InvalidArgumentError, match="refused `labels` at example 2, content token 0: 412"):
        with saev.Writer(tmp_path / "x", md(), progress=False) as w:
            w.write(acts(0, 2), labels(0, 2))
            w.write(acts(2, 2), labels(2, 2) + 300)
    with pytest.raises(shardkit.IncompleteDatasetError):
        saev.open(w.path)
    with saev.Writer(tmp_path / "x", md(), resume=True, progress=False) as w:
        w.write(acts(w.next_example, 4 - w.next_example), labels(w.next_example, 4 - w.next_example))
    assert tree(w.path) == ref


def test_saev_write_after_close_is_an_invalid_argument(tmp_path):
    w = saev.Writer(tmp_path, md(), progress=False)
    w.write(acts(0, 4), labels(0, 4))
    w.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        w.write(acts(0, 1), labels(0, 1))


def test_torch_is_imported_only_for_torch_tensors(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from shardkit import saev, eagle3, flat_tokens, sdnb\n"
        f"md = {md()!r}\n"
        f"with saev.Writer({str(tmp_path)!r}, md, progress=False) as w:\n"
        f"    w.write(np.zeros((4, {L}, {T}, {D}), np.float64), np.zeros((4, {P}), np.int64))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -------------------------------------------------------------------------------- EAGLE-3 ---

SEQ, H, VD = 4, 2, 6


def config(n=4, dtype="fp32", topk=None):
    m = {
        "target_model": "t", "target_vocab_size": 100, "draft_vocab_size": VD, "seq_length": SEQ,
        "dtype": dtype, "num_samples": n, "shard_size": 2, "aux_hidden_dim": 3 * H,
        "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(VD)),
    }
    if topk is not None:
        m["target_probs_topk"] = topk
    return m


def batch(first, b, topk=None):
    out = {
        "input_ids": np.arange(first * SEQ, (first + b) * SEQ).reshape(b, SEQ) % 100,
        "attention_mask": np.ones((b, SEQ), dtype=np.int64),
        "loss_mask": np.tile([0, 1], (b, SEQ // 2)),
        "aux_hidden_states": (np.arange(b * SEQ * 3 * H) % 13 / 4).reshape(b, SEQ, 3 * H).astype(np.float32),
        "position_mask": np.tile([[False], [True]], (b, SEQ // 2, 1)),
    }
    if topk is None:
        out["target_probs"] = np.full((b, SEQ, VD), 0.125, dtype=np.float32)
        out["target_probs"][..., :2] = 0.25
    else:
        out["target_probs_indices"] = np.tile(np.arange(topk, dtype=np.int32), (b, SEQ, 1))
        out["target_probs_values"] = np.full((b, SEQ, topk), 0.25, dtype=np.float32)
    return out


def spoil(field, index, value):
    def f(b):
        a = np.array(b[field])
        a[index] = value
        return {**b, field: a}

    return f


EAGLE3_REFUSALS = [
    ("input_ids", spoil("input_ids", (1, 2), 100), None,
     ["refused `input_ids` at sample 3, position 2: 100", "0 to 99", "target_vocab_size"]),
    ("input_ids", spoil("input_ids", (0, 0), -5), None, ["sample 2, position 0: -5"]),
    ("attention_mask", spoil("attention_mask", (0, 1), 2), None, ["sample 2, position 1: 2", "0 or 1"]),
    ("loss_mask", spoil("loss_mask", (1, 3), 7), None, ["sample 3, position 3: 7"]),
    ("position_mask", spoil("loss_mask", (0, 1), 0), None, ["`position_mask` at sample 2, position 1", "loss_mask is 1"]),
    ("aux_hidden_states", spoil("aux_hidden_states", (1, 3, 0), np.nan), None, ["sample 3, position 3: NaN", "finite fp32"]),
    ("target_probs", spoil("target_probs", (0, 2, 0), np.inf), None, ["sample 2, position 2: inf"]),
    ("target_probs", spoil("target_probs", (1, 1, 0), 0.5), None,
     ["sample 3, position 1: the row sums to 1.25", "within 0.0001", "fp32 tolerance"]),
    # A row summing to 1 with a negative entry: [-0.25, 0.5, 0.25, 0.25, 0.125, 0.125].
    ("target_probs", lambda b: {**b, "target_probs": np.tile(
        np.array([-0.25, 0.5, 0.25, 0.25, 0.125, 0.125], np.float32), (2, SEQ, 1))},
     None, ["sample 2, position 0: -0.25", "probabilities from 0 to 1"]),
    ("target_probs_indices", spoil("target_probs_indices", (0, 1, 1), VD), 2,
     [f"sample 2, position 1: {VD}", f"0 to {VD - 1}", "draft_vocab_size"]),
]


@pytest.mark.parametrize("field, bad, topk, words", EAGLE3_REFUSALS)
def test_eagle3_refuses_what_validate_deep_would_report(tmp_path, field, bad, topk, words):
    path = tmp_path / "c"
    w = eagle3.Writer(path, config(topk=topk), format_version=2 if topk else 1, progress=False)
    w.add_batch(batch(0, 2, topk))
    before = tree(path)
    with pytest.raises(InvalidArgumentError) as e:
        w.add_batch(bad(batch(2, 2, topk)))
    text = str(e.value)
    assert f"refused `{field}` at " in text, text
    for word in words:
        assert word in text, (word, text)
    assert w.next_sample == 2 and tree(path) == before
    w.add_batch(batch(2, 2, topk))
    w.close()
    report = eagle3.validate(path, deep=True)
    assert report["valid"], report


@pytest.mark.parametrize(
    "field, value, cls, words",
    [
        ("input_ids", np.full((2, SEQ), 1.0), InvalidArgumentTypeError, ["`input_ids` must hold integers", "float64"]),
        ("input_ids", np.ones((2, SEQ), dtype=bool), InvalidArgumentTypeError, ["`input_ids` must hold integers", "bool"]),
        ("input_ids", np.full((2, SEQ), 2**63, dtype=np.uint64), InvalidArgumentError, ["9223372036854775808", "int64"]),
        ("aux_hidden_states", np.zeros((2, SEQ, 3 * H), dtype=np.int32), InvalidArgumentTypeError, ["must hold floats"]),
        ("input_ids", None, InvalidArgumentTypeError, ["`input_ids` must be an array", "None"]),
        ("input_ids", np.zeros((2, SEQ + 1), dtype=np.int64), InvalidArgumentError,
         [f"`input_ids` must have shape (b, {SEQ})", f"got (2, {SEQ + 1})"]),
        ("position_mask", np.full((2, SEQ, 1), 3), InvalidArgumentError, ["refused `position_mask`", ": 3 ", "0 or 1"]),
    ],
)
def test_eagle3_refuses_wrong_types_and_shapes(tmp_path, field, value, cls, words):
    w = eagle3.Writer(tmp_path / "c", config(), progress=False)
    with pytest.raises(cls) as e:
        w.add_batch({**batch(0, 2), field: value})
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    assert w.next_sample == 0
    w.abort()


def test_eagle3_fp16_overflow_is_refused_not_stored_as_inf(tmp_path):
    w = eagle3.Writer(tmp_path / "c", config(dtype="fp16"), progress=False)
    b = batch(0, 2)
    b["aux_hidden_states"][1, 2, 3] = 1e5
    with pytest.raises(InvalidArgumentError) as e:
        w.add_batch(b)
    assert "refused `aux_hidden_states` at sample 1, position 2: 100000.0" in str(e.value)
    assert "65504" in str(e.value) and "fp16" in str(e.value)
    assert w.next_sample == 0
    w.abort()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_eagle3_torch_and_numpy_half_inputs_write_the_same_bytes(tmp_path, dtype):
    def write(path, convert):
        with eagle3.Writer(path, config(n=2, dtype=dtype), progress=False) as w:
            b = batch(0, 2)
            w.add_batch({k: convert(k, v) for k, v in b.items()})
        with open(path / "shard-000000.safetensors", "rb") as f:
            return f.read()

    want = write(tmp_path / "np", lambda k, v: v)
    floats = ("aux_hidden_states", "target_probs")
    variants = {
        "torch bf16": lambda k, v: torch.from_numpy(v).to(torch.bfloat16) if k in floats else torch.from_numpy(v),
        "torch fp16": lambda k, v: torch.from_numpy(v).to(torch.float16) if k in floats else torch.from_numpy(v),
        "numpy bf16": lambda k, v: v.astype(ml_dtypes.bfloat16) if k in floats else v,
        "float64 and int32": lambda k, v: v.astype(np.float64) if k in floats else (
            v.astype(np.int32) if v.dtype != bool else v),
        "masks as 0/1 ints": lambda k, v: v.astype(np.int8) if k == "position_mask" else v,
    }
    for name, convert in variants.items():
        assert write(tmp_path / name.replace(" ", "_"), convert) == want, name


def test_eagle3_single_sample_add_takes_torch_tensors(tmp_path):
    with eagle3.Writer(tmp_path / "c", config(n=2, dtype="bf16"), progress=False) as w:
        for i in range(2):
            one = {k: v[0] for k, v in batch(i, 1).items()}
            w.add({k: torch.from_numpy(np.asarray(v)) for k, v in one.items()})
    assert eagle3.validate(tmp_path / "c", deep=True)["valid"]


def test_eagle3_refused_batch_leaves_a_resumable_cache(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(InvalidArgumentError, match="input_ids"):
        with eagle3.Writer(path, config(), progress=False) as w:
            w.add_batch(batch(0, 2))
            w.add_batch(spoil("input_ids", (0, 0), 1000)(batch(2, 2)))
    with eagle3.Writer(path, config(), resume=True, progress=False) as w:
        assert w.next_sample == 2
        w.add_batch(batch(2, 2))
    assert eagle3.validate(path, deep=True)["valid"]


def test_eagle3_embeddings_must_be_exact_float32(tmp_path):
    with eagle3.Writer(tmp_path / "c", config(n=2), progress=False) as w:
        w.add_batch(batch(0, 2))
        with pytest.raises(InvalidArgumentError, match="`weight` is float64.*cast explicitly"):
            w.write_target_embeddings(np.full((4, H), 0.1))
        with pytest.raises(InvalidArgumentError, match=r"must have shape \(vocab_rows, hidden\)"):
            w.write_target_embeddings(np.zeros(4, np.float32))
        w.write_target_embeddings(torch.ones((4, H), dtype=torch.bfloat16))
    assert np.array_equal(eagle3.open(tmp_path / "c").target_embeddings(), np.ones((4, H), np.float32))


# ---------------------------------------------------------------------------- flat-tokens ---


@pytest.mark.parametrize(
    "bad, cls, words",
    [
        (None, InvalidArgumentTypeError, ["sequences must be an iterable", "NoneType"]),
        ("abc", InvalidArgumentTypeError, ["sequences must be an iterable", "str"]),
        ([None], InvalidArgumentTypeError, ["`sequence 0` must be an array", "None"]),
        ([[1, 2], [1.0, 2.0]], InvalidArgumentTypeError, ["must hold integers", "float64", "cast explicitly"]),
        ([np.array([True, False])], InvalidArgumentTypeError, ["must hold integers", "bool"]),
        ([[1, [2, 3]]], InvalidArgumentTypeError, ["`sequence 0` is not a rectangular array"]),
        ([["a", "b"]], InvalidArgumentTypeError, ["`sequence 0` must hold numbers"]),
        ([torch.tensor([1, -3])], InvalidArgumentError,
         ["refused `token ids` at sequence 0 of this append, position 1: -3", "0 to 2147483647"]),
        ([[1], np.array([2**31], dtype=np.uint32)], InvalidArgumentError, ["sequence 1 of this append, position 0"]),
    ],
)
def test_flat_tokens_refuses_what_is_not_token_ids(tmp_path, bad, cls, words):
    path = tmp_path / "t.zarr"
    with flat_tokens.Writer(path, "train", progress=False) as w:
        w.append([[5, 6]])
        with pytest.raises(cls) as e:
            w.append(bad)
        for word in words:
            assert word in str(e.value), (word, str(e.value))
        assert (w.seq_count, w.token_count) == (1, 2)
        w.append([torch.tensor([7, 8], dtype=torch.int32), np.array([9], dtype=np.uint16), [10]])
    split = flat_tokens.open(path).train
    assert [s.tolist() for s in split] == [[5, 6], [7, 8], [9], [10]]


def test_flat_tokens_closed_writer_is_an_invalid_argument(tmp_path):
    w = flat_tokens.Writer(tmp_path / "t.zarr", "train", progress=False)
    w.append([[1, 2]])
    w.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        w.append([[3]])


# ---------------------------------------------------------------------------------- SDNB ---


@pytest.mark.parametrize(
    "value, words",
    [
        (None, ["tensor 'w'", "expected an array", "None"]),
        ([[1, 2], [3]], ["tensor 'w'", "not a rectangular array"]),
    ],
)
def test_sdnb_refuses_what_is_not_an_array(tmp_path, value, words):
    with pytest.raises(InvalidArgumentTypeError) as e:
        sdnb.save(tmp_path / "m.sdnb", {"w": value})
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    assert not (tmp_path / "m.sdnb").exists()


def test_sdnb_refuses_bool_bytes_other_than_0_and_1(tmp_path):
    mask = np.array([1, 0, 2], dtype=np.uint8).view(np.bool_)
    with pytest.raises(InvalidArgumentError) as e:
        sdnb.save(tmp_path / "m.sdnb", {"mask": mask})
    assert "refused `mask` at element 2: byte 2" in str(e.value) and "0 or 1" in str(e.value)
    assert not (tmp_path / "m.sdnb").exists()
    sdnb.save(tmp_path / "m.sdnb", {"mask": np.array([True, False, True])})
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert c["mask"].tolist() == [True, False, True]


def test_sdnb_keeps_torch_bf16_as_bf16(tmp_path):
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    sdnb.save(tmp_path / "m.sdnb", {"w": t})
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert [v.dtype for v in c.variables if v.name == "w"] == ["BFLOAT16"]
        assert np.asarray(c["w"]).astype(np.float32).tolist() == [1.5, -2.0, 3.25]


# ----------------------------------------------------------------------------------- CLI ---


_cli = shardkit_cli


def _eagle3_cli_write(tmp_path, b, dtype="fp32"):
    from safetensors.numpy import save_file

    (tmp_path / "run.json").write_text(__import__("json").dumps(config(n=2, dtype=dtype)))
    save_file(b, str(tmp_path / "b.safetensors"))
    return subprocess.run(
        [_cli(), "eagle3", "write", "--out", str(tmp_path / "c"), "--manifest", str(tmp_path / "run.json"),
         str(tmp_path / "b.safetensors")],
        capture_output=True, text=True,
    )


def test_cli_eagle3_write_refuses_values_and_foreign_dtypes(tmp_path):
    b = batch(0, 2)
    b["position_mask"] = b["position_mask"].astype(bool)
    b["input_ids"] = b["input_ids"].astype(np.int64)
    b["loss_mask"] = b["loss_mask"].astype(np.int64)
    (tmp_path / "ok").mkdir()
    ok = _eagle3_cli_write(tmp_path / "ok", dict(b))
    assert ok.returncode == 0, ok.stderr
    assert eagle3.validate(tmp_path / "ok" / "c", deep=True)["valid"]

    (tmp_path / "ids").mkdir()
    bad = dict(b, input_ids=np.where(np.arange(SEQ) == 1, 100, b["input_ids"]).astype(np.int64))
    r = _eagle3_cli_write(tmp_path / "ids", bad)
    assert r.returncode != 0
    assert "refused `input_ids` at sample 0, position 1: 100" in r.stderr, r.stderr

    # float64 bits where int64 goes (same size): refused, not reinterpreted.
    (tmp_path / "f64").mkdir()
    r = _eagle3_cli_write(tmp_path / "f64", dict(b, attention_mask=b["attention_mask"].astype(np.float64)))
    assert r.returncode != 0
    assert "`attention_mask` is F64" in r.stderr and "stores it as I64" in r.stderr, r.stderr


def test_cli_sdnb_pack_refuses_an_index_dtype_that_reinterprets(tmp_path):
    import json

    src = tmp_path / "in"
    src.mkdir()
    np.save(src / "w.npy", np.arange(4, dtype=np.int32))
    index = {"arrays": [{"file": "w.npy", "name": "w", "dtype": "FLOAT", "var_type": "VARIABLE"}]}
    (src / "sdnb-index.json").write_text(json.dumps(index))
    r = subprocess.run([_cli(), "sdnb", "pack", "--from", str(src), "--out", str(tmp_path / "m.sdnb")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "holds <i4 but the index says FLOAT" in r.stderr, r.stderr
    assert not (tmp_path / "m.sdnb").exists()
    # bf16 as uint16 bits is how unpack writes it: accepted.
    np.save(src / "w.npy", np.array([0x3FC0, 0x4000], dtype=np.uint16))
    index["arrays"][0]["dtype"] = "BFLOAT16"
    (src / "sdnb-index.json").write_text(json.dumps(index))
    r = subprocess.run([_cli(), "sdnb", "pack", "--from", str(src), "--out", str(tmp_path / "m.sdnb")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with sdnb.open(tmp_path / "m.sdnb") as c:
        assert np.asarray(c["w"]).astype(np.float32).tolist() == [1.5, 2.0]
