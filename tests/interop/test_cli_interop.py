"""shardkit's output checked independently with Python's json, hashlib and numpy."""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT.parent / "shared" / "fixtures" / "saev"


def binary():
    env = os.environ.get("SHARDKIT_BIN")
    for p in [env, ROOT / "target/release/shardkit", ROOT / "target/debug/shardkit"]:
        if p and Path(p).exists():
            return str(p)
    pytest.skip("build the CLI first (cargo build -p shardkit-cli)")


def run(*args, ok=True):
    r = subprocess.run([binary(), *map(str, args)], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


KEYS = {
    "1.0.0": ["vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token", "d_vit",
              "n_imgs", "max_patches_per_shard", "data", "dtype", "protocol"],
    "2.0": ["family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex",
            "patches_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"],
    "2.1": ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model",
            "n_examples", "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"],
}
COUNT = {"1.0.0": "n_imgs", "2.0": "n_ex", "2.1": "n_examples"}


def metadata(protocol, n, layers, p, cls, d, budget):
    vals = {
        "family": "clip", "ckpt": "hf-hub:org/modèle", "layers": layers, "content": p,
        "cls_token": cls, "d_model": d, "n": n, "budget": budget,
        "data": {"root": "/données/😀", "n": n, "__class__": "Fake"} if protocol != "2.1" else "gASV…base64",
        "dataset": "/données/😀", "pixel_agg": None if protocol == "2.0" else "majority",
        "dtype": "float32", "protocol": protocol,
    }
    names = dict(zip(["family", "ckpt", "layers", "content", "cls_token", "d_model", "n", "budget",
                      "data", "dataset", "pixel_agg", "dtype", "protocol"], KEYS["2.1"], strict=True))
    if protocol != "2.1":
        names = dict(zip(names, KEYS[protocol] if protocol == "2.0" else
                         KEYS["1.0.0"][:9] + ["-", "-"] + KEYS["1.0.0"][9:], strict=True))
    return {names[k]: v for k, v in vals.items() if names[k] != "-"}


@pytest.mark.parametrize("protocol", ["1.0.0", "2.0", "2.1"])
@pytest.mark.parametrize("n", [7, 6])
def test_write_is_byte_exact_by_pythons_own_rules(tmp_path, protocol, n):
    L, P, cls, D, budget = 2, 3, True, 4, 24  # T = 4, eps = 3
    T = P + cls
    md = metadata(protocol, n, [-2, -1], P, cls, D, budget)
    scrambled = dict(reversed(list(md.items())))
    (tmp_path / "meta.json").write_text(json.dumps(scrambled, ensure_ascii=False))
    acts = np.random.default_rng(n).standard_normal((n, L, T, D)).astype(np.float32)
    np.save(tmp_path / "acts.npy", acts)
    args = ["saev", "write", "--out", tmp_path / "root", "--metadata", tmp_path / "meta.json",
            "--acts", tmp_path / "acts.npy"]
    labels = None
    if protocol != "1.0.0":
        labels = np.random.default_rng(0).integers(0, 9, (n, P)).astype(np.uint8)
        np.save(tmp_path / "labels.npy", labels)
        args += ["--labels", tmp_path / "labels.npy"]
    out = Path(run(*args).stdout.strip().splitlines()[-1])

    canonical = {k: md[k] for k in KEYS[protocol] if k in md}
    written = (out / "metadata.json").read_bytes()
    if protocol == "2.1":
        assert written == json.dumps(canonical, indent=2, ensure_ascii=False).encode()
        name = hashlib.sha256(json.dumps(json.loads(written), separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:8]
    else:
        assert written == json.dumps(canonical, indent=4).encode()
        name = hashlib.sha256(json.dumps(json.loads(written), sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert out.name == name

    eps = budget // (T * L)
    n_shards = -(-n // eps)
    counts = [min(eps, n - s * eps) for s in range(n_shards)]
    expected = [{"name": f"acts{s:06d}.bin", COUNT[protocol]: c} for s, c in enumerate(counts)]
    assert (out / "shards.json").read_bytes() == json.dumps(expected, indent=2).encode()
    stored = np.concatenate([np.fromfile(out / f"acts{s:06d}.bin", "<f4").reshape(eps, L, T, D) for s in range(n_shards)])
    assert np.array_equal(stored[:n], acts) and not stored[n:].any()
    if labels is not None:
        assert (out / "labels.bin").read_bytes() == labels.tobytes()
    report = json.loads(run("saev", "validate", out, "--json").stdout)
    assert report["valid"] and not report["errors"]

    before = {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
    again = run(*args)
    assert Path(again.stdout.strip().splitlines()[-1]) == out and "already complete" in again.stderr
    assert before == {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}

    for tokens in ["content", "special", "all"]:
        run("saev", "export", out, "--layer", "-1", "--tokens", tokens, "--out", tmp_path / "e.npz")
        z = np.load(tmp_path / "e.npz")
        slots = {"content": range(1, T), "special": [0], "all": range(T)}[tokens]
        want = np.stack([acts[e, 1, t] for e in range(n) for t in slots])
        assert z["act"].dtype == np.float32 and np.array_equal(z["act"], want)
        assert z["example_idx"].tolist() == [e for e in range(n) for _ in slots]
        assert z["token_idx"].tolist() == [t - 1 for _ in range(n) for t in slots]


def test_fixture_names_and_values():
    for d in sorted(p for p in FIXTURES.glob("*/*") if p.is_dir()):
        raw = (d / "metadata.json").read_bytes()
        assert not raw.endswith(b"\n")
        md = json.loads(raw)
        if md["protocol"] == "2.1":
            name = hashlib.sha256(json.dumps(md, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:8]
        else:
            name = hashlib.sha256(json.dumps(md, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        assert d.name == name
    a = FIXTURES / "v2.1" / "aa57b80c"
    for e, layer, slot, t in [(4, -1, 1, 3), (6, -2, 0, 0), (0, -1, 1, 4)]:
        got = json.loads(run("saev", "get", a, "--example", e, "--layer", layer, "--token", t).stdout)
        assert got == [1000 * e + 100 * slot + t + d / 16 for d in range(8)]


def test_errors_name_the_file(tmp_path):
    md = metadata("2.1", 5, [0], 3, False, 4, 12)
    (tmp_path / "m.json").write_text(json.dumps(md))
    np.save(tmp_path / "a.npy", np.zeros((5, 1, 3, 4), np.float64))
    r = run("saev", "write", "--out", tmp_path / "r", "--metadata", tmp_path / "m.json", "--acts", tmp_path / "a.npy", ok=False)
    assert r.returncode == 1 and "a.npy" in r.stderr
    crashed = next((FIXTURES / "v2.0").glob("36f76cd8*"))
    r = run("saev", "validate", crashed, "--json", ok=False)
    assert r.returncode == 1 and "2 of 7" in r.stdout


def test_stream_resumes_the_same_global_order_on_another_world_size(tmp_path):
    run("saev", "synth", "--out", tmp_path / "ds", "--examples", "40", "--content-tokens", "16",
        "--d-model", "8", "--budget", "170", "--layers=-2,-1")
    ds = next((tmp_path / "ds").iterdir())
    common = ["--layer", "-1", "--order", "block", "--seed", "9", "--memory-budget-mib", "1"]
    run("saev", "stream", ds, *common, "--batch-size", "40", "--out", tmp_path / "full.npz")
    run("saev", "stream", ds, *common, "--batch-size", "40", "--max-batches", "5", "--out", tmp_path / "head.npz")
    state = json.loads((tmp_path / "head.state.json").read_text())
    assert state["cursor"] == 200 and state["global_batch_size"] == 40
    parts = []
    for r in range(4):
        run("saev", "stream", ds, *common, "--batch-size", "10", "--rank", r, "--world-size", "4",
            "--resume", tmp_path / "head.state.json", "--out", tmp_path / f"r{r}.npz")
        z = np.load(tmp_path / f"r{r}.npz")
        parts.append(np.stack([z["example_idx"], z["token_idx"]], 1))
    full = np.load(tmp_path / "full.npz")
    full = np.stack([full["example_idx"], full["token_idx"]], 1)
    head = np.load(tmp_path / "head.npz")
    tail = np.concatenate([p[g * 10:(g + 1) * 10] for g in range(len(parts[0]) // 10 + 1) for p in parts])
    assert np.array_equal(np.concatenate([np.stack([head["example_idx"], head["token_idx"]], 1), tail]), full)
    assert len(set(map(tuple, full.tolist()))) == 40 * 16


def test_tokens_cli_reproduces_seqax_batches():
    ds = ROOT.parent / "shared" / "fixtures" / "flat_tokens" / "seqax_synthetic_dataset.zarr"
    golden = json.loads((ds.parent / "seqax_golden.json").read_text())
    assert run("tokens", "validate", ds).returncode == 0
    info = json.loads(run("tokens", "inspect", ds, "--json").stdout)
    assert info["train"]["token_count"] == 264992 and info["validation"]["max_token_id"] == 1019
    # The train split's encoded tokens read by zarr-python (2*id, +1 on a sequence's first token).
    import zarr

    encoded = np.asarray(zarr.open_group(str(ds), mode="r")["train/encoded_tokens"][:])
    assert len(encoded) == 264992
    for name, cfg in golden["packed_batches_train_split"].items():
        if name == "about":
            continue
        out = json.loads(run("tokens", "batch", ds, "--len", cfg["len"], "--batch", cfg["batch"],
                             "--streams", cfg["S"], "--read-blocks", cfg["R"], "--block", cfg["B"],
                             "--seed", cfg["seed"], "--step", cfg["step"]).stdout)
        want = cfg.get("first_8_rows", cfg.get("rows"))
        assert out["rows"][: len(want)] == want, name
        assert out["step_count"] == cfg["step_count"]
        # Targets are the decoded tokens of the packed rows, read straight from the zarr store:
        # row b is encoded_tokens[i*len:(i+1)*len] >> 1 for the b-th packed-sequence index i.
        n = cfg["len"]
        assert len(out["rows"]) == len(out["targets"]) == cfg["batch"], name
        for b, (row, targets) in enumerate(zip(out["rows"], out["targets"], strict=True)):
            assert targets == (encoded[row * n:(row + 1) * n] >> 1).tolist(), (name, b, row)
