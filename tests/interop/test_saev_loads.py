"""Directories shardkit writes are ones saev itself loads: `saev synth` (what the demo runs)
and the Python writer produce metadata that saev's `Metadata.load` accepts (checked by the
independent restatement in saev_ref.py), with a `data` pickle that saev's `make_data_cfg`
decodes, and values where saev's reader looks for them; metadata saev would refuse is refused
before anything is created."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import saev_ref
import shardkit
from shardkit import saev


def _synth(shardkit_bin, out, protocol, *extra):
    r = subprocess.run([shardkit_bin, "saev", "synth", "--out", str(out), "--protocol", protocol,
                        *map(str, extra)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("protocol", ["1.0.0", "2.0", "2.1"])
@pytest.mark.parametrize("shape", [
    # examples, layers, content tokens, cls, d_model, budget (None: synth's default)
    (300, "-2,-1", 16, True, 8, 200),
    (70000, "5", 1, False, 2, None),  # N >= 2^16: a 4-byte int in the pickle
])
def test_synth_output_loads_in_saev(shardkit_bin, tmp_path, protocol, shape):
    n, layers, p, cls, d, budget = shape
    extra = ["--examples", n, f"--layers={layers}", "--content-tokens", p, "--d-model", d]
    extra += [] if cls else ["--no-cls"]
    extra += [] if budget is None else ["--budget", budget]
    directory = _synth(shardkit_bin, tmp_path / "root", protocol, *extra)
    md = saev_ref.load_metadata(directory, protocol)
    if protocol == "2.1":
        assert saev_ref.make_data_cfg(md) == saev_ref.FakeImg(n_examples=n)
        assert md["pixel_agg"] == "majority" and md["dataset"] == "fake"
    else:
        assert md["data"]["__class__"] == "Fake"
    values = [int(x) for x in layers.split(",")]
    for e in (0, n // 2, n - 1):
        for slot, lv in enumerate(values):
            for t in (0, p - 1 + int(cls)):
                v = saev_ref.vector(directory, md, e, lv, t, protocol)
                want = np.float32(1000 * e + 100 * slot + t) + np.arange(d, dtype=np.float32) / 16
                assert np.array_equal(v, want.astype(np.float32)), (e, lv, t)
    r = subprocess.run([shardkit_bin, "saev", "validate", str(directory)], capture_output=True, text=True)
    assert r.returncode == 0 and "note:" not in r.stdout and "error:" not in r.stdout, r.stdout


def _md21(n=4):
    return {
        "family": "clip", "ckpt": "c", "layers": [-1], "content_tokens_per_example": 2,
        "cls_token": False, "d_model": 4, "n_examples": n, "max_tokens_per_shard": 4,
        "data": "gASVOAAAAAAAAACMEnNhZXYuZGF0YS5kYXRhc2V0c5SMB0Zha2VJbWeUk5QpgZR9lIwKbl9leGFtcGxlc5RLBHNiLg==",
        "dataset": "fake", "protocol": "2.1",
    }


def test_python_writer_output_loads_in_saev(tmp_path):
    root = tmp_path / "saev" / "shards"
    acts = np.arange(4 * 1 * 2 * 4, dtype=np.float32).reshape(4, 1, 2, 4)
    with saev.Writer(root, _md21()) as w:
        w.write(acts)
    md = saev_ref.load_metadata(w.path)
    assert saev_ref.make_data_cfg(md) == saev_ref.FakeImg(n_examples=4)
    assert np.array_equal(saev_ref.vector(w.path, md, 3, -1, 1), acts[3, 0, 1])


@pytest.mark.parametrize("key,value,needle", [
    ("data", {"n_examples": 4, "__class__": "FakeImg"}, "`data` must be a string"),
    ("data", 17, "`data` must be a string"),
    ("family", "vit", "`family` must be one of"),
    ("pixel_agg", None, "`pixel_agg` must be"),
    ("pixel_agg", "mean", "`pixel_agg` must be"),
    ("dataset", None, "`dataset` must be a string"),
])
def test_python_writer_refuses_what_saev_would_not_load(tmp_path, key, value, needle):
    md = _md21()
    md[key] = value
    root = tmp_path / "root"
    with pytest.raises(shardkit.InvalidArgumentError) as e:
        saev.Writer(root, md)
    assert needle in str(e.value)
    assert not root.exists()
    # The restated saev loader agrees that such metadata fails.
    d = tmp_path / "probe"
    d.mkdir()
    (d / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(TypeError):
        saev_ref.load_metadata(d)


def test_validate_says_saev_will_not_load_a_foreign_directory(tmp_path):
    root = tmp_path / "saev" / "shards"
    with saev.Writer(root, _md21()) as w:
        w.write(np.zeros((4, 1, 2, 4), np.float32))
    mdp = Path(w.path) / "metadata.json"
    md = json.loads(mdp.read_text())
    md["data"] = {"n_examples": 4, "__class__": "FakeImg"}
    mdp.write_text(json.dumps(md, indent=2))
    report = saev.validate(w.path)
    assert not report["valid"]
    errors = [e for e in report["errors"] if e["file"] == str(mdp)]
    assert errors and errors[0]["message"].startswith("saev 2.1 will not load this directory")
    assert saev.inspect(w.path)["saev_loads"] is False
    # shardkit still reads it.
    assert saev.open(w.path).get(0, -1, 0).shape == (4,)


def test_activations_recorded_from_a_vision_model_load_in_saev(tmp_path):
    """A dataset shardkit.record made from a tiny seeded Hugging Face ViT: saev's metadata rules
    accept it, and saev's indexed addressing finds each block's output (CLS and content tokens)
    at the layer labels given, whatever order the blocks ran in."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardkit.record import ActivationRecorder

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                 intermediate_size=32, image_size=16, patch_size=8)
    model = transformers.ViTModel(cfg).eval()
    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    md = {"family": "clip", "ckpt": "tiny-vit", "data": "seeded", "dataset": "mem", "max_tokens_per_shard": 50}
    with ActivationRecorder(model, tmp_path / "shards", layers=[2, 0], n_examples=5, metadata=md) as rec:
        for first, end in rec.batches(5):
            rec(x[first:end])
    with torch.no_grad():
        hidden = [h.numpy() for h in model(x, output_hidden_states=True).hidden_states]
    loaded = saev_ref.load_metadata(rec.path)
    assert loaded["layers"] == [2, 0] and loaded["cls_token"] is True
    for e in range(5):
        for block in (2, 0):
            for slot, token in ((0, 0), (4, 4)):  # CLS; the last content token
                v = saev_ref.vector(rec.path, loaded, e, block, slot)
                assert np.array_equal(v, hidden[block + 1][e, token]), (e, block, slot)


def _convert(shardkit_bin, src, dtype, out):
    r = subprocess.run([shardkit_bin, "saev", "convert", str(src), "--dtype", dtype, "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_reduced_dataset_converted_to_float32_loads_in_saev(shardkit_bin, tmp_path, dtype):
    """saev refuses a reduced dataset by its `dtype: Literal["float32"]` (and the validator
    names why); `saev convert --dtype float32` writes one saev loads, holding the stored values
    widened exactly (numpy/ml_dtypes' own rounding of the coded float32 values)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n, d = 9, 8
    reduced = _synth(shardkit_bin, tmp_path / "reduced", "2.1", "--examples", n, "--layers=-2,-1",
                     "--content-tokens", 4, "--d-model", d, "--budget", 30, "--dtype", dtype)
    with pytest.raises(TypeError, match=rf"dtype='{dtype}' violates type hint Literal\['float32'\]"):
        saev_ref.load_metadata(reduced)
    r = subprocess.run([shardkit_bin, "saev", "validate", str(reduced)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    assert (f"dtype {dtype}: shardkit's reduced-precision dialect of protocol 2.1; saev does not load "
            "it (saev's protocol 2.1 Metadata declares `dtype: Literal[\"float32\"]`)") in r.stdout

    wide = _convert(shardkit_bin, reduced, "float32", tmp_path / "wide")
    md = saev_ref.load_metadata(wide)
    assert md["dtype"] == "float32"
    assert saev_ref.make_data_cfg(md) == saev_ref.FakeImg(n_examples=n)
    np_type = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    for e in (0, n // 2, n - 1):
        for slot, lv in enumerate((-2, -1)):
            for t in (0, 4):
                coded = np.float32(1000 * e + 100 * slot + t) + np.arange(d, dtype=np.float32) / 16
                want = coded.astype(np.float32).astype(np_type).astype(np.float32)
                assert np.array_equal(saev_ref.vector(wide, md, e, lv, t), want), (e, lv, t)
    r = subprocess.run([shardkit_bin, "saev", "validate", str(wide)], capture_output=True, text=True)
    assert r.returncode == 0 and "note:" not in r.stdout and "error:" not in r.stdout, r.stdout
    # The float32 dataset converted is saev's own float32 dataset's name and metadata again.
    f32 = _synth(shardkit_bin, tmp_path / "f32", "2.1", "--examples", n, "--layers=-2,-1",
                 "--content-tokens", 4, "--d-model", d, "--budget", 30)
    assert wide.name == f32.name
    assert (wide / "metadata.json").read_bytes() == (f32 / "metadata.json").read_bytes()
