"""saev directories written and read by the shardkit CLI, checked independently.

Every expectation here is computed with Python's own json, hashlib and numpy from the format
reference (../shared/formats/saev.md, §3-§7, §12-§13); shardkit's reader is never used to check
shardkit's writer.
"""

import hashlib
import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "saev"
CRASHED = "v2.0/36f76cd85cfb77f6ae191c8994a7e313994553017475db89e31564e3464623af"

# Canonical key order of each version written (saev.md §12 "Versions written").
KEYS = {
    "1.0.0": ["vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token", "d_vit",
              "n_imgs", "max_patches_per_shard", "data", "dtype", "protocol"],
    "2.0": ["family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex",
            "patches_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"],
    "2.1": ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model",
            "n_examples", "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"],
}
COUNT = {"1.0.0": "n_imgs", "2.0": "n_ex", "2.1": "n_examples"}
PROTOCOLS = list(KEYS)

DATASET = "données/😀"
# Strings exercising every escaping rule of §3.3: quote, backslash, the short escapes, other
# control characters, slash (never escaped), U+007F and U+2028 (raw in E-utf8, escaped in E-ascii)
# and a code point above U+FFFF (a surrogate pair in E-ascii).
TRICKY = 'q"b\\s/t\tn\nr\rf\fb\bc\x01\x1f del\x7f ls\u2028 é 😀'

# name: (n, layers, content tokens P, cls, d_model, budget M, labels for 2.x, escape input JSON)
CASES = {
    # eps = 40 // (2*6) = 3, N = 8 -> [3, 3, 2]
    "ragged": (8, [3, -1], 5, True, 6, 40, True, False),
    # eps = 13 // (1*4) = 3, N = 6 -> [3, 3]: no spurious empty shard
    "exact": (6, [-2], 4, False, 5, 13, False, True),
    # eps = 48 // (3*4) = 4, N = 2 -> [2]: one partial shard
    "single": (2, [0, 11, -1], 3, True, 4, 48, True, False),
}


def run(binary, *args, ok=True):
    r = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=60)
    if ok:
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stderr}"
    return r


def data_object(n, count_key):
    # Opaque to shardkit: its key order (unsorted on purpose), nesting, empty containers and the
    # float's text must survive; only the version's indentation and escaping apply.
    return {
        "root": "/" + DATASET,
        "zeta": [1, -2, {"y": None, "x": True}],
        "alpha": {},
        "empty": [],
        "frac": 0.5,
        "esc": TRICKY,
        count_key: n,
        "__class__": "Fake",
    }


def make_metadata(protocol, n, layers, p, cls, d, budget):
    """The metadata dict in canonical key order."""
    head = ["clip", "hf-hub:org/modèle", layers, p, cls, d, n, budget]
    if protocol == "1.0.0":
        tail = [data_object(n, "n_imgs"), "float32", "1.0.0"]
    elif protocol == "2.0":
        tail = [data_object(n, "n_ex"), DATASET, None, "float32", "2.0"]
    else:
        data = "gASVOAAAAAAAAACMEnNhZXYu/+=" + DATASET + TRICKY
        tail = [data, DATASET, "majority", "float32", "2.1"]
    md = dict(zip(KEYS[protocol], head + tail, strict=True))
    assert list(md) == KEYS[protocol]
    return md


def scrambled(md, seed):
    keys = list(md)
    rng = random.Random(seed)
    while keys == list(md):
        rng.shuffle(keys)
    return {k: md[k] for k in keys}


def r1_name(md):
    return hashlib.sha256(json.dumps(md, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def r2_name(md):
    compact = json.dumps(md, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(compact).hexdigest()[:8]


def expected_name(md):
    return r2_name(md) if md["protocol"] == "2.1" else r1_name(md)


def canonical_bytes(md):
    if md["protocol"] == "2.1":
        return json.dumps(md, indent=2, ensure_ascii=False).encode()
    return json.dumps(md, indent=4).encode()


def write_inputs(tmp_path, protocol, case, seed=0):
    n, layers, p, cls, d, budget, with_labels, escape_input = CASES[case]
    t = p + int(cls)
    md = make_metadata(protocol, n, layers, p, cls, d, budget)
    meta = tmp_path / "meta.json"
    meta.write_bytes(json.dumps(scrambled(md, seed), ensure_ascii=escape_input).encode())
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n, len(layers), t, d)).astype(np.float32)
    np.save(tmp_path / "acts.npy", acts)
    args = ["saev", "write", "--out", tmp_path / "root", "--metadata", meta, "--acts", tmp_path / "acts.npy"]
    labels = None
    if with_labels and protocol != "1.0.0":
        labels = rng.integers(0, 256, (n, p), dtype=np.uint8)
        np.save(tmp_path / "labels.npy", labels)
        args += ["--labels", tmp_path / "labels.npy"]
    return md, acts, labels, args


def written_dir(result):
    lines = result.stdout.strip().splitlines()
    assert lines, f"no directory printed; stderr: {result.stderr}"
    return Path(lines[-1])


def snapshot(directory):
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(directory.iterdir())}


# --------------------------------------------------------------------------------------------
# 1. write


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_write(shardkit_bin, tmp_path, protocol, case):
    md, acts, labels, args = write_inputs(tmp_path, protocol, case)
    n, L, T, D = acts.shape
    P = T - int(md["cls_token"])
    budget = md[KEYS[protocol][7]]
    eps = budget // (T * L)
    n_shards = -(-n // eps)

    out = written_dir(run(shardkit_bin, *args))
    assert out.parent.resolve() == (tmp_path / "root").resolve()

    # (a) metadata.json bytes: Python's own serialisation in canonical key order, no trailing \n.
    raw = (out / "metadata.json").read_bytes()
    assert raw == canonical_bytes(md)
    assert not raw.endswith(b"\n")
    if protocol == "2.1":
        assert DATASET.encode() in raw  # raw UTF-8
    else:
        assert raw.isascii() and b"\\ud83d\\ude00" in raw  # E-ascii surrogate pair

    # (b) directory name from the file as written (keys in file order).
    on_disk = json.loads(raw)
    assert list(on_disk) == KEYS[protocol]
    assert out.name == expected_name(on_disk)
    assert len(out.name) == (8 if protocol == "2.1" else 64)

    # (c) shards.json: one entry per real shard, the version's count key, 2-space indent.
    counts = [min(eps, n - s * eps) for s in range(n_shards)]
    assert sum(counts) == n and all(c > 0 for c in counts)
    entries = [{"name": f"acts{s:06d}.bin", COUNT[protocol]: c} for s, c in enumerate(counts)]
    assert (out / "shards.json").read_bytes() == json.dumps(entries, indent=2).encode()

    # Exactly the format's files; no temporaries, no spurious shard, labels.bin only if given.
    # (plus shardkit's checksums sidecar, which saev never opens).
    expected_files = {"metadata.json", "shards.json", "shardkit.checksums.json", *(e["name"] for e in entries)}
    if labels is not None:
        expected_files.add("labels.bin")
    assert {f.name for f in out.iterdir()} == expected_files

    # (d) every shard full size; contents equal the input rows, zeros past the count.
    shard_bytes = eps * L * T * D * 4
    for s, c in enumerate(counts):
        f = out / f"acts{s:06d}.bin"
        assert f.stat().st_size == shard_bytes, f.name
        stored = np.fromfile(f, dtype="<f4").reshape(eps, L, T, D)
        assert np.array_equal(stored[:c], acts[s * eps: s * eps + c]), f.name
        assert not stored[c:].any(), f"{f.name}: rows past {c} are not zero"

    # (e) labels.bin is the raw (N, P) uint8 array.
    if labels is not None:
        assert labels.shape == (n, P)
        assert (out / "labels.bin").read_bytes() == labels.tobytes()

    # (f) shardkit's validator agrees.
    r = run(shardkit_bin, "saev", "validate", out, "--json")
    report = json.loads(r.stdout)
    assert report["valid"] is True and not report["errors"], report

    # (g) writing the same dataset again is a no-op.
    before = snapshot(out)
    again = run(shardkit_bin, *args)
    assert written_dir(again) == out
    assert snapshot(out) == before


def test_write_default_protocol_is_2_1(shardkit_bin, tmp_path):
    """saev.md §12: the protocol written defaults to 2.1 when the metadata names none."""
    md = make_metadata("2.1", 4, [-1], 2, True, 3, 9)  # eps = 9 // 3 = 3 -> [3, 1]
    given = {k: v for k, v in md.items() if k != "protocol"}
    (tmp_path / "meta.json").write_text(json.dumps(scrambled(given, 1), ensure_ascii=False), encoding="utf-8")
    acts = np.arange(4 * 1 * 3 * 3, dtype=np.float32).reshape(4, 1, 3, 3)
    np.save(tmp_path / "acts.npy", acts)
    out = written_dir(run(shardkit_bin, "saev", "write", "--out", tmp_path / "root",
                          "--metadata", tmp_path / "meta.json", "--acts", tmp_path / "acts.npy"))
    assert (out / "metadata.json").read_bytes() == canonical_bytes(md)
    assert out.name == r2_name(md)
    expected = [{"name": "acts000000.bin", "n_examples": 3}, {"name": "acts000001.bin", "n_examples": 1}]
    assert (out / "shards.json").read_bytes() == json.dumps(expected, indent=2).encode()


# --------------------------------------------------------------------------------------------
# 2. export


def expected_export(acts, labels, slot, cls, tokens):
    n, _, T, D = acts.shape
    P = T - int(cls)
    x = acts[:, slot]  # (N, T, D)
    lab = None
    if tokens == "content":
        act = x[:, int(cls):].reshape(-1, D)
        ex = np.repeat(np.arange(n), P)
        tok = np.tile(np.arange(P), n)
        if labels is not None:
            lab = labels.astype(np.int64).reshape(-1)
    elif tokens == "special":
        act = x[:, 0]
        ex = np.arange(n)
        tok = np.full(n, -1)
        if labels is not None:
            lab = np.full(n, -1)
    else:
        act = x.reshape(-1, D)
        ex = np.repeat(np.arange(n), T)
        tok = np.tile(np.arange(T) - int(cls), n)
        if labels is not None:
            full = labels.astype(np.int64)
            if cls:
                full = np.concatenate([np.full((n, 1), -1), full], axis=1)
            lab = full.reshape(-1)
    return act, ex, tok, lab


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", ["ragged", "exact"])
def test_export(shardkit_bin, tmp_path, protocol, case):
    md, acts, labels, args = write_inputs(tmp_path, protocol, case, seed=7)
    out = written_dir(run(shardkit_bin, *args))
    cls = md["cls_token"]
    for slot, layer in enumerate(md["layers"]):
        for tokens in ["content", "special", "all"]:
            npz = tmp_path / f"export_{slot}_{tokens}.npz"
            r = run(shardkit_bin, "saev", "export", out, "--layer", layer, "--tokens", tokens,
                    "--out", npz, ok=False)
            if tokens == "special" and not cls:
                assert r.returncode != 0 and not npz.exists(), "special tokens without CLS must be refused"
                assert r.stderr.strip()
                continue
            assert r.returncode == 0, r.stderr
            act, ex, tok, lab = expected_export(acts, labels, slot, cls, tokens)
            with np.load(npz) as z:
                names = {"act", "example_idx", "token_idx"} | ({"token_label"} if labels is not None else set())
                assert set(z.files) == names, (layer, tokens)
                assert z["act"].dtype == np.float32 and z["act"].shape == act.shape
                assert np.array_equal(z["act"], act), (layer, tokens)
                for key, want in [("example_idx", ex), ("token_idx", tok), ("token_label", lab)]:
                    if want is None:
                        continue
                    assert z[key].dtype == np.int64, key
                    assert np.array_equal(z[key], want), (layer, tokens, key)

    # A layer value that is not recorded is an error (saev.md §6: absent value = error).
    absent = max(md["layers"]) + 100
    r = run(shardkit_bin, "saev", "export", out, "--layer", absent, "--out", tmp_path / "absent.npz", ok=False)
    assert r.returncode != 0 and not (tmp_path / "absent.npz").exists()


# --------------------------------------------------------------------------------------------
# 3. reference fixtures (read-only)


def fixture_dirs():
    if not FIXTURES.is_dir():
        return []
    return sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*") if p.is_dir())


@pytest.mark.parametrize("rel", fixture_dirs())
def test_fixture_names(saev_fixtures, rel):
    d = saev_fixtures / rel
    raw = (d / "metadata.json").read_bytes()
    assert not raw.endswith(b"\n")
    assert not (d / "shards.json").read_bytes().endswith(b"\n")
    md = json.loads(raw)
    assert d.name == expected_name(md)
    assert raw == canonical_bytes(md)  # saev's own bytes equal Python's rules for its version


def coded(e, slot, t, D):
    return [1000 * e + 100 * slot + t + d / 16 for d in range(D)]


@pytest.mark.parametrize("rel", [r for r in fixture_dirs() if r != CRASHED])
def test_fixture_get(shardkit_bin, saev_fixtures, rel):
    d = saev_fixtures / rel
    md = json.loads((d / "metadata.json").read_bytes())
    get = lambda k: next(md[x] for x in k if x in md)  # noqa: E731
    layers = md["layers"]
    P = get(["n_patches_per_img", "patches_per_ex", "content_tokens_per_example"])
    T = P + int(md["cls_token"])
    D = get(["d_vit", "d_model"])
    N = get(["n_imgs", "n_ex", "n_examples"])
    eps = get(["max_patches_per_shard", "patches_per_shard", "max_tokens_per_shard"]) // (T * len(layers))
    coords = {(0, 0, 0), (N - 1, len(layers) - 1, T - 1), (min(eps, N - 1), 0, T // 2),
              (N // 2, len(layers) // 2, 1)}
    for e, slot, t in sorted(coords):
        r = run(shardkit_bin, "saev", "get", d, "--example", e, "--layer", layers[slot], "--token", t)
        got = json.loads(r.stdout)
        want = coded(e, slot, t, D)
        assert got == want, (e, layers[slot], t)
        # The values are float32-exact, and the shard file agrees (independent of shardkit).
        assert np.array_equal(np.float32(want), np.float64(want))
        raw = np.fromfile(d / f"acts{e // eps:06d}.bin", "<f4").reshape(eps, len(layers), T, D)
        assert raw[e % eps, slot, t].tolist() == want
    # Past the last example is an error, even where saev left a spurious empty shard (case B).
    r = run(shardkit_bin, "saev", "get", d, "--example", N, "--layer", layers[0], "--token", 0, ok=False)
    assert r.returncode != 0 and r.stderr.strip()


# --------------------------------------------------------------------------------------------
# 4. errors


def small_inputs(tmp_path, protocol="2.1"):
    md = make_metadata(protocol, 5, [0], 3, False, 4, 12)  # (5, 1, 3, 4), eps 4
    (tmp_path / "m.json").write_text(json.dumps(md, ensure_ascii=False), encoding="utf-8")
    return md, tmp_path / "m.json"


BAD_ACTS = {
    "float64": np.zeros((5, 1, 3, 4), np.float64),
    "wrong_d": np.zeros((5, 1, 3, 5), np.float32),
    "wrong_tokens": np.zeros((5, 1, 4, 4), np.float32),
    "wrong_layers": np.zeros((5, 2, 3, 4), np.float32),
    "wrong_n": np.zeros((4, 1, 3, 4), np.float32),
    "wrong_ndim": np.zeros((5, 3, 4), np.float32),
}


@pytest.mark.parametrize("what", list(BAD_ACTS))
def test_write_rejects_bad_acts(shardkit_bin, tmp_path, what):
    _, meta = small_inputs(tmp_path)
    bad = tmp_path / f"bad_{what}_acts.npy"
    np.save(bad, BAD_ACTS[what])
    r = run(shardkit_bin, "saev", "write", "--out", tmp_path / "root", "--metadata", meta, "--acts", bad, ok=False)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert bad.name in r.stderr
    root = tmp_path / "root"
    assert not root.exists() or not list(root.rglob("shards.json"))


@pytest.mark.parametrize("what", ["wrong_shape", "int64"])
def test_write_rejects_bad_labels(shardkit_bin, tmp_path, what):
    _, meta = small_inputs(tmp_path)
    np.save(tmp_path / "acts.npy", np.zeros((5, 1, 3, 4), np.float32))
    bad = tmp_path / f"bad_{what}_labels.npy"
    np.save(bad, np.zeros((5, 4), np.uint8) if what == "wrong_shape" else np.zeros((5, 3), np.int64))
    r = run(shardkit_bin, "saev", "write", "--out", tmp_path / "root", "--metadata", meta,
            "--acts", tmp_path / "acts.npy", "--labels", bad, ok=False)
    assert r.returncode == 1 and bad.name in r.stderr


def test_rejected_labels_for_1_0_0_leave_nothing_behind(shardkit_bin, tmp_path):
    md, meta = small_inputs(tmp_path, "1.0.0")
    acts = np.arange(5 * 1 * 3 * 4, dtype=np.float32).reshape(5, 1, 3, 4)
    np.save(tmp_path / "acts.npy", acts)
    np.save(tmp_path / "labels.npy", np.zeros((5, 3), np.uint8))
    base = ["saev", "write", "--out", tmp_path / "root", "--metadata", meta, "--acts", tmp_path / "acts.npy"]
    r = run(shardkit_bin, *base, "--labels", tmp_path / "labels.npy", ok=False)
    assert r.returncode == 1 and "1.0.0" in r.stderr  # labels postdate 1.0.0 (saev.md §12)
    # A refused invocation must not leave a dataset directory that blocks the corrected one.
    assert not (tmp_path / "root" / r1_name(md)).exists()
    out = written_dir(run(shardkit_bin, *base))
    assert out.name == r1_name(md)


def test_validate_crashed_fixture(shardkit_bin, saev_fixtures):
    d = saev_fixtures / CRASHED
    r = run(shardkit_bin, "saev", "validate", d, "--json", ok=False)
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["valid"] is False and report["errors"]
    assert "2 of 7" in r.stdout
    # Reading it is refused too, never served as a 7-example dataset (saev.md §12, §13.11).
    r = run(shardkit_bin, "saev", "get", d, "--example", 0, "--layer", -1, "--token", 0, ok=False)
    assert r.returncode != 0 and "2 of 7" in r.stderr and not r.stdout.strip()
