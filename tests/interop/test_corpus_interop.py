"""`tokens build` from the corpora people have: Parquet written by pyarrow (several row groups,
other columns, nulls, dictionary and large strings, list-of-ids columns), JSONL compressed by
Python's zstandard and gzip, single files, globs and directories. Each must build the same
dataset, token for token, as the same documents in plain JSONL, with the tokens Hugging Face's
tokenizers gives; bad input must name the file and the line, row or offset, and lose nothing
already committed. Both the CLI and ``shardkit.flat_tokens.build`` are checked."""

import gzip
import itertools
import json
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import zstandard
from tokenizers import models, pre_tokenizers, trainers

import shardkit
from shardkit import flat_tokens


def _texts(n=600):
    rng = np.random.default_rng(7)
    words = ["the", "quick", "brown", "fox", "jumps", "über", "naïve", "café", "—", "数据", "🙂",
             "lazy", "dog", "tokens", "shard", "\n", "\t", "  "]
    out = []
    for i in range(n):
        k = 0 if i % 97 == 5 else int(rng.integers(1, 200))
        out.append(" ".join(words[j] for j in rng.integers(0, len(words), k)))
    return out


TEXTS = _texts()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[BOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def _jsonl_lines(texts):
    return "".join(json.dumps({"id": i, "text": t, "meta": {"lang": "en"}}) + "\n"
                   for i, t in enumerate(texts))


def _arrays(path):
    split = flat_tokens.open(path).train
    return split.encoded(), split.seq_starts()


def _tokenized(tok, texts):
    """Each text's ids from Hugging Face's tokenizers itself (the reference every build is held
    to; no special tokens, as the build adds none)."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def _expected(docs):
    """encoded_tokens and seq_starts of `docs` by the flat-tokens rule (seqax's: 2*id, plus 1
    on a sequence's first token; seq_starts the running offsets from 0), computed here."""
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    enc = np.concatenate([np.asarray(d, dtype=np.int64) * 2 for d in docs] + [np.zeros(0, np.int64)])
    enc[starts[:-1][lengths > 0]] += 1
    return enc, starts


def _holds(path, docs):
    """The train split at `path` holds exactly `docs` (lists of ids), read by zarr-python and
    compared with arrays computed here, then the same through shardkit's reader."""
    want_enc, want_starts = _expected(docs)
    enc, starts = _arrays_unvalidated(path)
    assert np.array_equal(starts, want_starts), "seq_starts differ from the reference tokenization"
    assert np.array_equal(enc, want_enc), "encoded_tokens differ from the reference tokenization"
    split = flat_tokens.open(path).train
    assert len(split) == len(docs)
    assert all(split[i].tolist() == d for i, d in enumerate(docs)), "a document differs through shardkit's reader"


def _build(how, shardkit_bin, out, inputs, tokenizer_path=None, **kw):
    """Builds with the CLI or the Python API; returns the summary (Python) or stderr (CLI)."""
    inputs = [str(i) for i in (inputs if isinstance(inputs, list) else [inputs])]
    if how == "python":
        return flat_tokens.build(out, "train", inputs, tokenizer=tokenizer_path, progress=False, **kw)
    cmd = [shardkit_bin, "tokens", "build", "--out", str(out), "--split", "train", "--from", *inputs]
    if tokenizer_path is not None:
        cmd += ["--tokenizer", str(tokenizer_path)]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        cmd += [flag] if v is True else [flag, str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr


def _table(texts, with_nulls_in=None):
    n = len(texts)
    url = [None if i % 3 == 0 else f"https://example.org/{i}" for i in range(n)]
    text = list(texts)
    if with_nulls_in == "text":
        text = [None if i % 11 == 4 else t for i, t in enumerate(texts)]
    return pa.table({"id": pa.array(range(n), pa.int64()), "url": pa.array(url, pa.string()),
                     "text": pa.array(text, pa.string()), "score": pa.array(np.linspace(0, 1, n))})


@pytest.mark.parametrize("how", ["python", "cli"])
def test_parquet_zstd_and_gzip_build_the_plain_jsonl_dataset(how, shardkit_bin, tmp_path, tokenizer):
    tok, tok_path = tokenizer
    plain = tmp_path / "docs.jsonl"
    plain.write_text(_jsonl_lines(TEXTS), encoding="utf-8")
    ref = tmp_path / "ref.zarr"
    _build(how, shardkit_bin, ref, plain, tok_path)
    docs = _tokenized(tok, TEXTS)
    assert sum(d == [] for d in docs) >= 6 and max(map(len, docs)) > 100  # empty and long documents
    _holds(ref, docs)

    # Parquet: several row groups, a text column among others, nulls in another column.
    pqf = tmp_path / "docs.parquet"
    pq.write_table(_table(TEXTS), pqf, row_group_size=64, compression="zstd")
    assert pq.ParquetFile(pqf).metadata.num_row_groups > 5
    # zstd JSONL in two concatenated frames, gzip JSONL in two members.
    half = len(TEXTS) // 2
    zst = tmp_path / "docs.jsonl.zst"
    c = zstandard.ZstdCompressor(level=3)
    zst.write_bytes(c.compress(_jsonl_lines(TEXTS[:half]).encode())
                    + c.compress(_jsonl_lines(TEXTS[half:]).encode()))
    gz = tmp_path / "docs.json.gz"
    gz.write_bytes(gzip.compress(_jsonl_lines(TEXTS[:half]).encode())
                   + gzip.compress(_jsonl_lines(TEXTS[half:]).encode()))
    for name, src in [("parquet", pqf), ("zst", zst), ("gz", gz)]:
        out = tmp_path / f"{name}.zarr"
        _build(how, shardkit_bin, out, src, tok_path)
        _holds(out, docs)


def test_many_files_by_glob_list_and_directory(shardkit_bin, tmp_path, tokenizer):
    tok, tok_path = tokenizer
    docs = _tokenized(tok, TEXTS)
    parts = tmp_path / "parts"
    parts.mkdir()
    bounds = [0, 150, 151, 400, len(TEXTS)]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        pq.write_table(_table(TEXTS[a:b]), parts / f"part-{k:05d}.parquet", row_group_size=50)
    (parts / "README.txt").write_text("not a corpus file")
    for how, spec in [("python", str(parts / "part-*.parquet")), ("cli", str(parts / "part-*.parquet")),
                      ("python", parts), ("cli", parts)]:
        out = tmp_path / f"{how}-{abs(hash(str(spec)))}.zarr"
        summary = _build(how, shardkit_bin, out, spec, tok_path)
        _holds(out, docs)
        if how == "python":
            assert summary["inputs"] == [str(p) for p in sorted(parts.glob("part-*.parquet"))]
    # Mixed formats in one list, in the order given.
    zst = tmp_path / "tail.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_lines(TEXTS[400:]).encode()))
    head = tmp_path / "head.parquet"
    pq.write_table(_table(TEXTS[:400]), head, row_group_size=128)
    out = tmp_path / "mixed.zarr"
    _build("cli", shardkit_bin, out, [head, zst], tok_path)
    _holds(out, docs)


def test_null_texts_are_skipped_and_counted(shardkit_bin, tmp_path, tokenizer):
    tok, tok_path = tokenizer
    table = _table(TEXTS, with_nulls_in="text")
    kept = [t for t in table.column("text").to_pylist() if t is not None]
    nulls = len(TEXTS) - len(kept)
    assert nulls > 10
    docs = _tokenized(tok, kept)
    pqf = tmp_path / "nulls.parquet"
    pq.write_table(table, pqf, row_group_size=100)
    out = tmp_path / "nulls.zarr"
    summary = _build("python", shardkit_bin, out, pqf, tok_path)
    assert summary["null_values"] == nulls and summary["seq_count"] == len(kept)
    _holds(out, docs)
    # The same in JSONL: a null member is not a document either.
    jl = tmp_path / "nulls.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in table.column("text").to_pylist()))
    out2 = tmp_path / "nulls2.zarr"
    stderr = _build("cli", shardkit_bin, out2, jl, tok_path)
    assert f"{nulls} lines/rows had a null value" in stderr
    _holds(out2, docs)


def test_string_types_pyarrow_writes(shardkit_bin, tmp_path, tokenizer):
    tok, tok_path = tokenizer
    docs = _tokenized(tok, TEXTS)
    for name, arr in [("large", pa.array(TEXTS, pa.large_string())),
                      ("dict", pa.array(TEXTS, pa.string()).dictionary_encode()),
                      ("view", pa.array(TEXTS, pa.string_view()))]:
        f = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"body": arr}), f, row_group_size=200)
        out = tmp_path / f"{name}.zarr"
        _build("python", shardkit_bin, out, f, tok_path, field="body")
        _holds(out, docs)


def test_token_id_columns_and_lines(shardkit_bin, tmp_path):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, 50_000, int(rng.integers(0, 300))).tolist() for _ in range(400)]
    plain = tmp_path / "ids.jsonl"
    plain.write_text("".join(json.dumps(s) + "\n" for s in seqs))
    ref = tmp_path / "ref.zarr"
    _build("cli", shardkit_bin, ref, plain)
    _holds(ref, seqs)
    for typ in [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.uint16())]:
        f = tmp_path / "ids.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(seqs, typ), "n": [len(s) for s in seqs]}),
                       f, row_group_size=64)
        out = tmp_path / f"ids-{typ}.zarr".replace("<", "").replace(">", "")
        _build("python", shardkit_bin, out, f)
        _holds(out, seqs)
    zst = tmp_path / "ids.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"tokens": s}) + "\n" for s in seqs).encode()))
    out = tmp_path / "ids-zst.zarr"
    _build("cli", shardkit_bin, out, zst)
    _holds(out, seqs)


# ---------------------------------------------------------------------------------------------
# Refusals: each names the file and where, and nothing already committed is lost.


def _cli_error(shardkit_bin, out, inputs, *extra):
    r = subprocess.run([shardkit_bin, "tokens", "build", "--out", str(out), "--split", "train",
                        "--from", *[str(i) for i in inputs], *extra], capture_output=True, text=True)
    assert r.returncode != 0
    return r.stderr


def test_missing_column_and_wrong_types(shardkit_bin, tmp_path, tokenizer):
    _, tok_path = tokenizer
    f = tmp_path / "docs.parquet"
    pq.write_table(_table(TEXTS[:50]), f)
    out = tmp_path / "o.zarr"
    with pytest.raises(shardkit.CorruptDataError) as e:
        flat_tokens.build(out, "train", f, tokenizer=tok_path, field="content", progress=False)
    msg = str(e.value)
    assert str(f) in msg and '"content"' in msg and '"text"' in msg and '"url"' in msg
    with pytest.raises(shardkit.CorruptDataError) as e:
        flat_tokens.build(out, "train", f, tokenizer=tok_path, field="id", progress=False)
    assert str(f) in str(e.value) and "not strings" in str(e.value)
    err = _cli_error(shardkit_bin, out, [f])  # text without a tokenizer
    assert str(f) in err and "give a tokenizer" in err
    # JSONL: a value of the wrong type names its line.
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": 17}\n')
    err = _cli_error(shardkit_bin, tmp_path / "o2.zarr", [jl], "--tokenizer", str(tok_path))
    assert f"{jl}: line 4: member \"text\" must be a string, found a number" in err
    with pytest.raises(shardkit.CorruptDataError, match="line 4"):
        flat_tokens.build(tmp_path / "o3.zarr", "train", jl, tokenizer=tok_path, progress=False)
    # A pattern that matches nothing, and a file given twice.
    with pytest.raises(shardkit.NotFoundError, match="matches no file"):
        flat_tokens.build(out, "train", str(tmp_path / "nothing-*.parquet"), progress=False)
    with pytest.raises(shardkit.InvalidArgumentError, match="given twice"):
        flat_tokens.build(out, "train", [f, f], tokenizer=tok_path, progress=False)
    assert not out.exists(), "a refused build must not create the dataset"


def _committed_then(bad, shardkit_bin, tmp_path, tok_path, expect):
    """A finished split, then `append` from `bad`: the error names the file and the place, and
    the split still holds exactly what was committed."""
    plain = tmp_path / "first.jsonl"
    plain.write_text(_jsonl_lines(TEXTS[:100]), encoding="utf-8")
    out = tmp_path / "kept.zarr"
    flat_tokens.build(out, "train", plain, tokenizer=tok_path, progress=False)
    before = _arrays(out)
    with pytest.raises(shardkit.CorruptDataError) as e:
        flat_tokens.build(out, "train", bad, tokenizer=tok_path, append=True, progress=False)
    assert str(bad) in str(e.value)
    for x in expect:
        assert x in str(e.value), str(e.value)
    enc, starts = _arrays_unvalidated(out)
    if len(starts) == len(before[1]):
        # Nothing was appended before the fault: the split is untouched and still complete.
        assert np.array_equal(_arrays(out)[1], before[1])
    else:
        # Documents before the fault were committed after the finished ones; the split is
        # unfinished (resume completes it).
        with pytest.raises(flat_tokens.IncompleteDatasetError):
            flat_tokens.open(out).train
    assert np.array_equal(starts[: len(before[1])], before[1])
    assert np.array_equal(enc[: len(before[0])], before[0])
    return len(starts) - len(before[1])


def _arrays_unvalidated(path):
    import zarr
    g = zarr.open_group(str(path), mode="r")
    return np.asarray(g["train/encoded_tokens"][:]), np.asarray(g["train/seq_starts"][:])


def test_corrupt_parquet_page(shardkit_bin, tmp_path, tokenizer):
    _, tok_path = tokenizer
    f = tmp_path / "corrupt.parquet"
    # Plain pages (no dictionary), so the strings themselves sit in the compressed data pages.
    pq.write_table(_table(TEXTS), f, row_group_size=100, compression="zstd", use_dictionary=False)
    meta = pq.ParquetFile(f).metadata
    text_col = [meta.row_group(3).column(j).path_in_schema for j in range(meta.num_columns)].index("text")
    col = meta.row_group(3).column(text_col)
    data = bytearray(f.read_bytes())
    start = col.data_page_offset + col.total_compressed_size // 2
    data[start:start + 64] = b"\xa5" * 64
    f.write_bytes(bytes(data))
    # Row groups 0-2 decode: with a checkpoint per chunk... one chunk here, so the error may
    # come before anything is appended; either way nothing committed is lost.
    _committed_then(f, shardkit_bin, tmp_path, tok_path, ["column \"text\"", "from row 300"])


def test_truncated_zstd_and_gzip(shardkit_bin, tmp_path, tokenizer):
    _, tok_path = tokenizer
    body = _jsonl_lines(TEXTS).encode()
    for name, packed, word in [("t.jsonl.zst", zstandard.ZstdCompressor().compress(body), "zstd"),
                               ("t.json.gz", gzip.compress(body), "gzip")]:
        d = tmp_path / name.split(".")[-1]
        d.mkdir()
        f = d / name
        f.write_bytes(packed[: len(packed) * 2 // 3])
        _committed_then(f, shardkit_bin, d, tok_path, [f"truncated {word} stream", "compressed byte"])


def test_interrupted_build_resumes_exactly(shardkit_bin, tmp_path, tokenizer):
    """A KeyboardInterrupt raised in the progress callback after two files commits what was
    appended; resume finishes byte-identically to an uninterrupted build, and resume with
    different inputs is refused."""
    tok, tok_path = tokenizer
    parts = tmp_path / "parts"
    parts.mkdir()
    for k in range(6):
        pq.write_table(_table(TEXTS[k * 100:(k + 1) * 100]), parts / f"p{k}.parquet", row_group_size=30)
    ref = tmp_path / "ref.zarr"
    flat_tokens.build(ref, "train", parts, tokenizer=tok_path, progress=False)
    _holds(ref, _tokenized(tok, TEXTS))

    out = tmp_path / "out.zarr"
    calls = []

    def stop(bytes_read, bytes_total, sequences, tokens):
        calls.append((bytes_read, bytes_total, sequences, tokens))
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        flat_tokens.build(out, "train", parts, tokenizer=tok_path, checkpoint_tokens=1, progress=stop)
    assert calls[0][1] == sum(p.stat().st_size for p in parts.iterdir())
    assert calls[1][2] == 200 and calls[1][0] > calls[0][0] > 0
    with pytest.raises(flat_tokens.IncompleteDatasetError):
        flat_tokens.open(out).train
    with pytest.raises(shardkit.AlreadyExistsError, match="resume"):
        flat_tokens.build(out, "train", parts, tokenizer=tok_path, progress=False)
    # Other inputs in front: the check of the last committed document refuses them.
    other = tmp_path / "other.jsonl"
    other.write_text(_jsonl_lines(TEXTS[::-1]))
    with pytest.raises(shardkit.CorruptDataError, match="differs from the last sequence"):
        flat_tokens.build(out, "train", [other], tokenizer=tok_path, resume=True, progress=False)
    summary = flat_tokens.build(out, "train", parts, tokenizer=tok_path, resume=True, progress=False)
    assert summary["skipped_documents"] >= 200
    assert summary["seq_count"] == len(TEXTS)
    _holds(out, _tokenized(tok, TEXTS))
    for a, b in zip(sorted(ref.rglob("*")), sorted(out.rglob("*")), strict=True):
        assert a.relative_to(ref) == b.relative_to(out)
        if a.is_file():
            assert a.read_bytes() == b.read_bytes(), a


def test_tokenizer_objects_are_accepted(tmp_path, tokenizer):
    tok, tok_path = tokenizer
    plain = tmp_path / "d.jsonl"
    plain.write_text(_jsonl_lines(TEXTS[:50]))
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    flat_tokens.build(a, "train", plain, tokenizer=tok_path, progress=False)
    flat_tokens.build(b, "train", plain, tokenizer=tok, progress=False)
    docs = _tokenized(tok, TEXTS[:50])
    _holds(a, docs)
    _holds(b, docs)
    with pytest.raises(shardkit.InvalidArgumentTypeError, match="tokenizer must be"):
        flat_tokens.build(tmp_path / "c.zarr", "train", plain, tokenizer=42, progress=False)
