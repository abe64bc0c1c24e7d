"""flat-tokens interop: zarr-python 3 and 2.18 read what shardkit writes, shardkit reads what
zarr-python 3 writes, seqax's own writer calls (under zarr-python 2.18) give the same chunk
bytes, and the shuffle matches numpy and seqax's golden vectors."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from shardkit import flat_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
import seqax_ref  # noqa: E402


def corpus(n_seqs, max_len, seed):
    """Ragged sequences (empty ones included), ids 1..50000, as numpy arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, n_seqs)
    lengths[::37] = 0
    return [rng.integers(1, 50_001, int(n), dtype=np.uint32) for n in lengths]


def encode(seqs):
    """(encoded_tokens, seq_starts, max_token_id) as seqax's Chunk.from_ragged computes them."""
    lengths = np.array([len(s) for s in seqs], dtype=np.uint64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    flat = np.concatenate(seqs).astype(np.uint32) if len(seqs) else np.zeros(0, np.uint32)
    enc = flat << np.uint32(1)
    firsts = starts[:-1][lengths > 0].astype(np.int64)
    enc[firsts] |= np.uint32(1)
    return enc, starts, int(flat.max()) if flat.size else 0


# A train split spanning three 4 Mi-token v2 chunks (several seq_starts chunks too would need
# 65,536+ documents: the validation split has them) and a shorter validation split.
TRAIN = corpus(9_000, 2_000, seed=1)
VALIDATION = corpus(70_000, 12, seed=2)


def write(path, layout):
    with flat_tokens.Writer(path, "train", layout=layout) as w:
        for i in range(0, len(TRAIN), 1000):
            w.append(TRAIN[i : i + 1000])
    with flat_tokens.Writer(path, "validation", layout=layout) as w:
        w.append(VALIDATION)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("flat_tokens")
    return {layout: write(base / f"{layout}.zarr", layout) for layout in ("v2", "v3")}


@pytest.mark.parametrize("layout", ["v2", "v3"])
def test_zarr_python_3_reads_our_output(written, layout):
    g = zarr.open_group(str(written[layout]), mode="r")
    assert g.metadata.zarr_format == (2 if layout == "v2" else 3)
    assert g.attrs["write_completed"] is True
    for name, seqs in [("train", TRAIN), ("validation", VALIDATION)]:
        enc, starts, max_id = encode(seqs)
        split = g[name]
        assert split.attrs["max_token_id"] == max_id
        tokens, seq_starts = split["encoded_tokens"], split["seq_starts"]
        assert tokens.dtype == np.uint32 and seq_starts.dtype == np.uint64
        assert np.array_equal(tokens[:], enc)
        assert np.array_equal(seq_starts[:], starts)
        if layout == "v3":
            assert tokens.metadata.dimension_names == ("token",)
            assert seq_starts.metadata.dimension_names == ("seq",)
            assert "_zarrs" not in dict(tokens.attrs)
    if layout == "v2":
        assert g["train/encoded_tokens"].chunks == (4_194_304,)
        assert g["train/seq_starts"].chunks == (65_536,)


ZARR2_READ = r"""
import hashlib, json, sys, zarr
g = zarr.open_group(sys.argv[1], mode="r")
out = {"root": dict(g.attrs)}
for name in ("train", "validation"):
    s = g[name]
    t, st = s["encoded_tokens"], s["seq_starts"]
    out[name] = {
        "attrs": dict(s.attrs), "dtypes": [str(t.dtype), str(st.dtype)],
        "filters": [repr(f) for f in (st.filters or [])], "compressor": repr(t.compressor),
        "tokens": hashlib.sha256(t[:].tobytes()).hexdigest(),
        "starts": hashlib.sha256(st[:].tobytes()).hexdigest(),
    }
print(json.dumps(out))
"""


def test_zarr_python_2_18_reads_our_v2_output(written, zarr2_python):
    r = subprocess.run([zarr2_python, "-c", ZARR2_READ, str(written["v2"])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["root"] == {"write_completed": True}
    for name, seqs in [("train", TRAIN), ("validation", VALIDATION)]:
        enc, starts, max_id = encode(seqs)
        s = got[name]
        assert s["attrs"] == {"max_token_id": max_id}
        assert s["dtypes"] == ["uint32", "uint64"]
        assert "Delta" in s["filters"][0] and "lz4" in s["compressor"]
        assert s["tokens"] == hashlib.sha256(enc.tobytes()).hexdigest()
        assert s["starts"] == hashlib.sha256(starts.tobytes()).hexdigest()


# seqax's tools/flat_tokens.py writer, as flat_tokens.md §4 describes its zarr calls, run under
# zarr-python 2.18 with one blosc thread: the chunk files must equal shardkit's v2 output.
SEQAX_WRITER = r"""
import sys, numpy as np, zarr
from numcodecs import Blosc, Delta, blosc
blosc.use_threads = False
root, split, data = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
g = zarr.open_group(root, mode="a").require_group(split)
if "max_token_id" not in g.attrs:
    g.attrs["max_token_id"] = 0
comp = Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)
if "encoded_tokens" not in g:
    g.empty("encoded_tokens", shape=(0,), chunks=(4194304,), dtype=np.uint32, compressor=comp)
if "seq_starts" not in g:
    g.zeros("seq_starts", shape=(1,), chunks=(65536,), dtype=np.uint64, compressor=comp,
            filters=[Delta(np.int64)])
for k in range(int(data["calls"])):
    tokens, starts, max_id = data[f"tokens{k}"], data[f"starts{k}"], int(data[f"max{k}"])
    n = g["encoded_tokens"].shape[0]
    if max_id > g.attrs["max_token_id"]:
        g.attrs["max_token_id"] = max_id
    g["encoded_tokens"].append(tokens)
    g["seq_starts"].append(starts[1:] + np.uint64(n))
"""


def test_seqax_writer_calls_under_zarr_2_18_give_our_chunk_bytes(written, zarr2_python, tmp_path):
    pieces = [VALIDATION[:30_000], VALIDATION[30_000:30_001], VALIDATION[30_001:]]
    data = {"calls": len(pieces)}
    for k, p in enumerate(pieces):
        enc, starts, max_id = encode(p)
        data.update({f"tokens{k}": enc, f"starts{k}": starts, f"max{k}": max_id})
    np.savez(tmp_path / "calls.npz", **data)
    ref = tmp_path / "seqax.zarr"
    r = subprocess.run([zarr2_python, "-c", SEQAX_WRITER, str(ref), "validation",
                        str(tmp_path / "calls.npz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ours = written["v2"] / "validation"
    for array in ("encoded_tokens", "seq_starts"):
        chunks = sorted(p.name for p in (ref / "validation" / array).iterdir() if p.name.isdigit())
        assert chunks == sorted(p.name for p in (ours / array).iterdir() if p.name.isdigit())
        assert len(chunks) >= (1 if array == "encoded_tokens" else 2)
        for c in chunks:
            a = (ref / "validation" / array / c).read_bytes()
            b = (ours / array / c).read_bytes()
            assert a == b, f"{array}/{c}: {len(a)} bytes from zarr-python 2.18, {len(b)} from shardkit"
    # The metadata agrees on everything but fill_value (0, not seqax's null, on encoded_tokens).
    for array in ("encoded_tokens", "seq_starts"):
        a = json.loads((ref / "validation" / array / ".zarray").read_text())
        b = json.loads((ours / array / ".zarray").read_text())
        a.pop("fill_value"), b.pop("fill_value")
        assert a == b
    assert (ref / "validation" / ".zattrs").read_text() == (ours / ".zattrs").read_text()


@pytest.mark.parametrize("fmt,shards", [(2, None), (3, None), (3, (4096,))])
def test_we_read_groups_zarr_python_3_writes_with_its_defaults(tmp_path, fmt, shards):
    path = tmp_path / f"zp3-v{fmt}.zarr"
    root = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    seqs = corpus(300, 50, seed=3)
    for name in ("train", "validation"):
        enc, starts, max_id = encode(seqs)
        g = root.create_group(name)
        g.attrs["max_token_id"] = max_id
        kw = {} if shards is None else {"shards": shards, "chunks": (512,)}
        g.create_array("encoded_tokens", data=enc, **kw)
        g.create_array("seq_starts", data=starts)
    ds = flat_tokens.open(path)
    split = ds.train
    assert split.completion == "unmarked"  # validated in full on open
    assert split.sharded == (shards is not None)
    assert np.array_equal(split.encoded(), enc)
    assert np.array_equal(split.seq_starts(), starts)
    assert [s.tolist() for s in split][:5] == [s.tolist() for s in seqs[:5]]
    assert flat_tokens.validate(path)["valid"]
    loader = flat_tokens.Loader(path, seq_len=16, batch_size=4, sequences_per_read_block=4,
                                read_blocks_per_shuffle_buffer=2)
    rows = loader.rows(3)
    b = loader.load(3)
    for k, r in enumerate(rows):
        assert np.array_equal(b["targets"][k], enc[r * 16 : (r + 1) * 16] >> 1)


def test_random_primitives_and_golden_batches_match_numpy_and_seqax(flat_tokens_fixtures):
    golden = json.loads((flat_tokens_fixtures / "seqax_golden.json").read_text())
    for seed, want in golden["seedsequence_generate_state_2_uint64"].items():
        got = np.random.SeedSequence(int(seed)).generate_state(2, np.uint64)
        assert got.tolist() == want
    for label, want in golden["philox_random_raw_5"].items():
        g = (np.random.Philox(key=[0, 0]) if label == "key [0,0]"
             else np.random.Philox(int(label.split()[1])))
        assert g.random_raw(5).tolist() == want
    for label, want in golden["perm"].items():
        seed, n = map(int, label[5:-1].split(","))
        assert seqax_ref.perm(seed, n).tolist() == want
    fixture = flat_tokens_fixtures / "seqax_synthetic_dataset.zarr"
    for name, cfg in golden["packed_batches_train_split"].items():
        if name == "about":
            continue
        params = dict(batch=cfg["batch"], S=cfg["S"], R=cfg["R"], B=cfg["B"], seed=cfg["seed"])
        want = cfg.get("first_8_rows") or cfg["rows"]
        ref = seqax_ref.step_rows(264_992 // cfg["len"], t=cfg["step"], **params)
        assert ref[: len(want)] == want, f"the numpy port reproduces seqax ({name})"
        loader = flat_tokens.Loader(
            fixture, seq_len=cfg["len"], batch_size=cfg["batch"], streams=cfg["S"],
            read_blocks_per_shuffle_buffer=cfg["R"], sequences_per_read_block=cfg["B"],
            seed=cfg["seed"], epochs=True,
        )
        assert loader.rows(cfg["step"]).tolist() == ref
        # Epoch 1 is seqax's order with seed + 2**64, computed here by numpy alone.
        epoch1 = seqax_ref.step_rows(264_992 // cfg["len"], t=cfg["step"],
                                     **{**params, "seed": cfg["seed"] + 2**64})
        assert loader.rows(loader.step_count + cfg["step"]).tolist() == epoch1


def test_cli_build_and_batch_agree_with_python(shardkit_bin, tmp_path):
    seqs = corpus(500, 300, seed=4)
    src = tmp_path / "tokens.jsonl"
    src.write_text("".join(json.dumps(s.tolist()) + "\n" for s in seqs))
    out = tmp_path / "ds.zarr"
    r = subprocess.run([shardkit_bin, "tokens", "build", "--out", out, "--split", "train",
                        "--from", src, "--layout", "v2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    enc, starts, _ = encode(seqs)
    split = flat_tokens.open(out).train
    assert np.array_equal(split.encoded(), enc) and np.array_equal(split.seq_starts(), starts)
    npz = tmp_path / "batch.npz"
    r = subprocess.run([shardkit_bin, "tokens", "batch", out, "--len", "32", "--batch", "8",
                        "--streams", "2", "--block", "8", "--read-blocks", "4", "--seed", "5",
                        "--step", "7", "--out", npz], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    loader = flat_tokens.Loader(out, seq_len=32, batch_size=8, streams=2,
                                sequences_per_read_block=8, read_blocks_per_shuffle_buffer=4,
                                seed=5)
    with np.load(npz) as got:
        want = loader.load(7)
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
        assert got["rows"].tolist() == loader.rows(7).tolist()


def test_cli_build_with_a_hugging_face_tokenizer(shardkit_bin, tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    texts = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(200)]
    texts += ["", "naïve café — ünïcödé"]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[BOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "ds.zarr"
    r = subprocess.run([shardkit_bin, "tokens", "build", "--out", out, "--split", "validation",
                        "--from", src, "--tokenizer", tmp_path / "tokenizer.json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    split = flat_tokens.open(out).validation
    assert len(split) == len(texts)
    for i, t in enumerate(texts):
        # No special tokens, as seqax's tools tokenize (add_special_tokens=False).
        assert split[i].tolist() == tok.encode(t, add_special_tokens=False).ids
    assert split[-1].size > 0 and split[len(texts) - 2].size == 0
