"""shardkit.flat_tokens: the Python API over the Rust core (writer, reader, seqax loader)."""

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import IncompleteDatasetError, flat_tokens
from shardkit import _shardkit as _core

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "flat_tokens" / "seqax_synthetic_dataset.zarr"
GOLDEN = ROOT.parent / "shared" / "fixtures" / "flat_tokens" / "seqax_golden.json"


@pytest.fixture
def seqax_copy(tmp_path):
    if not FIXTURE.is_dir():
        pytest.skip(f"fixture not found at {FIXTURE}")
    dst = tmp_path / "seqax.zarr"
    shutil.copytree(FIXTURE, dst)
    return dst


@pytest.mark.parametrize("layout", ["v2", "v3"])
def test_the_specs_example_appended_in_two_calls(tmp_path, layout):
    path = tmp_path / "ds.zarr"
    with flat_tokens.Writer(path, "train", layout=layout) as w:
        w.append([[1, 2], [3, 4, 5], [6, 7, 8]])
    assert w.format == layout and w.resumed_from is None
    with flat_tokens.Writer(path, "train", resume=True) as w:
        assert w.resumed_from == 3
        w.append([np.array([9], dtype=np.uint16), np.array([], dtype=np.int64), [10, 11]])
    split = flat_tokens.open(path)["train"]
    assert split.format == layout and split.completion == "complete"
    assert split.encoded().tolist() == [3, 4, 7, 8, 10, 13, 14, 16, 19, 21, 22]
    assert split.encoded().dtype == np.uint32
    assert split.seq_starts().tolist() == [0, 2, 5, 8, 9, 9, 11]
    assert split.seq_starts().dtype == np.uint64
    assert split.max_token_id == 11
    assert len(split) == 6
    assert split[1].tolist() == [3, 4, 5] and split[-1].tolist() == [10, 11]
    assert split[4].tolist() == []
    assert [s.tolist() for s in split][:2] == [[1, 2], [3, 4, 5]]
    with pytest.raises(shardkit.OutOfRangeError, match="sequence 6 is out of range for 6 sequences"):
        split[6]


def test_bad_ids_are_refused_before_anything_is_appended(tmp_path):
    path = tmp_path / "ds.zarr"
    with flat_tokens.Writer(path, "train") as w:
        w.append([[5, 6]])
        bad_value, bad_type = shardkit.InvalidArgumentError, shardkit.InvalidArgumentTypeError
        for bad, cls, words in [
            ([[1], [2, 2**31]], bad_value, "refused `token ids` at sequence 1 of this append, position 1: 2147483648"),
            ([[-1]], bad_value, "at sequence 0 of this append, position 0: -1 "),
            ([np.array([2**63], dtype=np.uint64)], bad_value, "9223372036854775808"),
            ([[2**70]], bad_value, "1180591620717411303424"),
            ([[1.5]], bad_type, "must hold integers"),
            ([[[1, 2]]], bad_value, "1-D"),
        ]:
            with pytest.raises(cls, match=words.replace("(", r"\(")) as e:
                w.append(bad)
            assert type(e.value) is cls, (bad, type(e.value))
        assert (w.seq_count, w.token_count) == (1, 2)
        w.append([np.array([flat_tokens.MAX_TOKEN_ID], dtype=np.int64)])
        with pytest.warns(UserWarning, match="token id 0"):
            w.append([[0, 1]])
    split = flat_tokens.open(path).train
    assert split.max_token_id == flat_tokens.MAX_TOKEN_ID
    assert split[1].tolist() == [flat_tokens.MAX_TOKEN_ID]


def test_an_exception_leaves_an_unfinished_dataset_that_resume_completes(tmp_path):
    path = tmp_path / "ds.zarr"
    seqs = [list(range(1, n + 2)) for n in range(40)]
    with pytest.raises(RuntimeError, match="^the job died$"):
        with flat_tokens.Writer(path, "validation", layout="v2") as w:
            w.append(seqs[:25])
            raise RuntimeError("the job died")
    with pytest.raises(IncompleteDatasetError, match="25 sequences committed"):
        flat_tokens.open(path)["validation"]
    assert flat_tokens.inspect(path)["validation"]["completion"] == "interrupted"
    report = flat_tokens.validate(path)
    assert not report["valid"] and "write_completed is false" in report["errors"][0]["message"]
    with pytest.raises(shardkit.AlreadyExistsError, match="resume"):
        flat_tokens.Writer(path, "validation")
    with flat_tokens.Writer(path, "validation", resume=True) as w:
        assert w.format == "v2"
        w.append(seqs[w.resumed_from:])
    split = flat_tokens.open(path)["validation"]
    assert [s.tolist() for s in split] == seqs
    assert flat_tokens.validate(path)["valid"]


def test_progress_callback_and_v3_sizes(tmp_path):
    seen = []
    w = flat_tokens.Writer(tmp_path / "ds.zarr", "train", tokens_per_shard=64, tokens_per_chunk=16,
                           progress=lambda seqs, toks: seen.append((seqs, toks)))
    w.append([[1] * 100, [2] * 50])
    w.append([[3]])
    assert w.close() == {"seq_count": 3, "token_count": 151, "max_token_id": 3}
    assert (w.seq_count, w.token_count, w.max_token_id) == (3, 151, 3)  # kept once closed
    assert seen == [(2, 150), (3, 151)]
    meta = json.loads((tmp_path / "ds.zarr/train/encoded_tokens/zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [64]
    with pytest.raises(shardkit.InvalidArgumentError, match="v3"):
        flat_tokens.Writer(tmp_path / "other.zarr", "train", layout="v2", tokens_per_shard=64)
    with pytest.raises(shardkit.InvalidArgumentError, match="layout"):
        flat_tokens.Writer(tmp_path / "other.zarr", "train", layout="v4")


def test_the_fixture_reads_with_the_documented_facts():
    if not FIXTURE.is_dir():
        pytest.skip("fixture missing")
    ds = flat_tokens.open(FIXTURE)
    assert ds.splits == ["train", "validation"]
    t, v = ds.train, ds.validation
    assert (t.token_count, t.seq_count, t.max_token_id) == (264_992, 512, 1017)
    assert (v.token_count, v.seq_count, v.max_token_id) == (278_035, 512, 1019)
    assert t.seq_starts(0, 5).tolist() == [0, 555, 629, 1377, 1440]
    assert t.encoded(0, 8).tolist() == [3, 2, 10, 18, 14, 16, 10, 4]
    assert t.completion == "unmarked" and t.format == "v2" and not t.sharded
    lengths = np.diff(v.seq_starts())
    assert (lengths.min(), lengths.max()) == (1, 1024)


def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_loader_rows_equal_seqaxs_golden_batches(name):
    if not GOLDEN.is_file():
        pytest.skip("golden vectors missing")
    cfg = golden()["packed_batches_train_split"][name]
    loader = flat_tokens.Loader(
        FIXTURE, "train", seq_len=cfg["len"], batch_size=cfg["batch"], streams=cfg["S"],
        read_blocks_per_shuffle_buffer=cfg["R"], sequences_per_read_block=cfg["B"],
        seed=cfg["seed"],
    )
    assert loader.step_count == cfg["step_count"] == len(loader)
    want = cfg.get("first_8_rows") or cfg["rows"]
    rows = loader.rows(cfg["step"])
    assert rows[: len(want)].tolist() == want
    batch = loader.load(cfg["step"])
    first = flat_tokens.open(FIXTURE).train.encoded(rows[0] * cfg["len"], (rows[0] + 1) * cfg["len"])
    assert batch["targets"][0].tolist() == (first >> 1).tolist()


def test_unpacked_golden_documents_and_padding():
    cfg = golden()["unpacked_single_read_block"]
    loader = flat_tokens.Loader(FIXTURE, seq_len=cfg["len"], batch_size=cfg["batch"], packed=False,
                                read_blocks_per_shuffle_buffer=cfg["R"],
                                sequences_per_read_block=cfg["B"], seed=cfg["seed"])
    assert loader.rows(0).tolist() == cfg["documents"]
    batch = loader.load(0)
    split = flat_tokens.open(FIXTURE).train
    for k, doc in enumerate(cfg["documents"]):
        ids = split[doc][: cfg["len"]]
        n = len(ids)
        assert batch["targets"][k, :n].tolist() == ids.tolist()
        assert batch["mask"][k].sum() == n and batch["mask"][k, :n].all()
        assert (batch["targets"][k, n:] == 0).all()


def test_batches_decode_into_model_inputs_without_copies(tmp_path):
    path = tmp_path / "ds.zarr"
    with flat_tokens.Writer(path, "train") as w:
        w.append([[1, 2], [3, 4, 5], [6, 7, 8]])
    loader = flat_tokens.Loader(path, seq_len=8, batch_size=1, sequences_per_read_block=1,
                                read_blocks_per_shuffle_buffer=1)
    b = loader.load(0)
    assert set(b) == {"inputs", "targets", "segment_ids", "is_seq_start", "mask"}
    assert b["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert b["inputs"].tolist() == [[0, 1, 0, 3, 4, 0, 6, 7]]
    assert b["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 3, 3, 3]]
    assert b["is_seq_start"].tolist() == [[True, False, True, False, False, True, False, False]]
    assert b["mask"].all()
    for k, dtype in [("inputs", np.int32), ("targets", np.int32), ("segment_ids", np.int32),
                     ("is_seq_start", np.bool_), ("mask", np.bool_)]:
        assert b[k].dtype == dtype and b[k].shape == (1, 8)
        assert not b[k].flags.owndata, "a view of Rust memory, not a copy"
        # The memory is exported by the Rust batch, not by a numpy (or bytes) copy of it.
        assert isinstance(b[k].base, memoryview) and type(b[k].base.obj).__name__ == "RustBuffer", k
    # All five arrays are views into the one batch buffer the loader decoded into: laid out
    # one after another (64-byte aligned), not scattered over separate allocations.
    spans = sorted((a.__array_interface__["data"][0], a.nbytes) for a in b.values())
    assert all(s + n <= t for (s, n), (t, _) in itertools.pairwise(spans)), "fields overlap"
    assert spans[-1][0] + spans[-1][1] - spans[0][0] <= sum(-(-n // 64) * 64 for _, n in spans), spans


def test_hosts_epochs_iteration_and_state():
    kw = dict(seq_len=64, batch_size=64, streams=2, read_blocks_per_shuffle_buffer=8,
              sequences_per_read_block=16, seed=0)
    whole = flat_tokens.Loader(FIXTURE, **kw)
    halves = [flat_tokens.Loader(FIXTURE, host_index=h, host_count=2, **kw) for h in range(2)]
    assert np.concatenate([h.rows(5) for h in halves]).tolist() == whole.rows(5).tolist()
    assert halves[1].load(5)["targets"].shape == (32, 64)
    with pytest.raises(shardkit.OutOfRangeError, match=r"step 64 is past the end: there are 64 steps \(valid indices: 0 to 63\); enable epochs"):
        whole.load(whole.step_count)
    with pytest.raises(shardkit.InvalidArgumentError, match="host_count"):
        flat_tokens.Loader(FIXTURE, host_index=0, host_count=3, **kw)

    ep = flat_tokens.Loader(FIXTURE, epochs=True, **kw)
    n = ep.step_count
    assert ep.rows(0).tolist() == whole.rows(0).tolist()
    assert ep.rows(n)[:8].tolist() == [2069, 2065, 2108, 1976, 2110, 2804, 2803, 2106]

    # Iterating continues from the loader's position; state_dict resumes exactly.
    it = iter(whole)
    first = [next(it)["targets"].copy() for _ in range(3)]
    assert whole.step == 3
    state = whole.state_dict()
    assert state["step"] == 3 and state["sequences_per_read_block"] == 16
    other = flat_tokens.Loader(FIXTURE, **kw)
    other.load_state_dict(state)
    assert (next(iter(other))["targets"] == whole.load(3)["targets"]).all()
    assert (first[1] == whole.load(1)["targets"]).all()
    assert len(list(whole.iter(n - 2))) == 2
    with pytest.raises(shardkit.InvalidArgumentError, match="seed"):
        flat_tokens.Loader(FIXTURE, **{**kw, "seed": 1}).load_state_dict(state)


def test_seqax_data_is_validated_and_marked(seqax_copy):
    report = flat_tokens.validate(seqax_copy)
    assert report["valid"] and any("no completion marker" in n["message"] for n in report["notes"])
    info = flat_tokens.inspect(seqax_copy)
    assert info["train"]["seq_count"] == 512 and info["train"]["min_seq_len"] == 2
    flat_tokens.mark_complete(seqax_copy)
    assert flat_tokens.open(seqax_copy).train.completion == "complete"
    (seqax_copy / "train" / ".zattrs").write_text('{\n    "max_token_id": 3\n}')
    report = flat_tokens.validate(seqax_copy)
    assert not report["valid"] and "exceed max_token_id 3" in report["errors"][0]["message"]


def test_missing_things_raise_natural_exceptions(tmp_path):
    with pytest.raises(shardkit.NotFoundError, match="absent.zarr: no such directory"):
        flat_tokens.open(tmp_path / "absent.zarr")
    with pytest.raises(KeyError, match="split must be 'train' or 'validation', got 'test'"):
        flat_tokens.open(FIXTURE)["test"]
    with pytest.raises(shardkit.InvalidArgumentError, match="split"):
        flat_tokens.Writer(tmp_path / "x.zarr", "test")


def test_convert_between_layouts(tmp_path):
    out = flat_tokens.convert(FIXTURE, tmp_path / "v3.zarr")
    assert out["train"] == {"seq_count": 512, "token_count": 264_992, "max_token_id": 1017}
    v3 = flat_tokens.open(tmp_path / "v3.zarr").train
    assert v3.format == "v3" and v3.sharded and v3.completion == "complete"
    assert (v3.encoded() == flat_tokens.open(FIXTURE).train.encoded()).all()
    with pytest.raises(shardkit.AlreadyExistsError, match="v3.zarr: the destination of a conversion must not exist"):
        flat_tokens.convert(FIXTURE, tmp_path / "v3.zarr", layout="v2")


def test_buffers_read_ahead_survive_a_fork(tmp_path):
    """A loader that read ahead in the parent (a background thread the child does not have)
    still serves every batch in a forked child, as a DataLoader worker would, instead of
    waiting forever for the parent's thread."""
    import os
    import time

    kw = dict(seq_len=64, batch_size=16, read_blocks_per_shuffle_buffer=32, sequences_per_read_block=8,
              buffer_in_memory=True, seed=3)
    loader = flat_tokens.Loader(FIXTURE, **kw)
    assert loader.buffers_in_memory
    want = [b["targets"].copy() for b in flat_tokens.Loader(FIXTURE, **kw)]
    assert len(want) > 8
    it = iter(loader)
    # Steps of the first minipoch prepared; the next minipoch's read started on its thread
    # before next() returned (the first buffer is served only once it has): the fork finds it
    # running, or over; the child has no such thread either way.
    next(it)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            got = [b["targets"].copy() for b in loader.iter(0)]
            code = 0 if len(got) == len(want) and all((a == b).all() for a, b in zip(got, want)) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's read-ahead")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    rest = [b["targets"].copy() for b in it]
    assert len(rest) == len(want) - 1
    assert all((a == b).all() for a, b in zip(rest, want[1:], strict=True))


def test_buffers_of_many_groups_equal_rows_read_one_by_one(tmp_path):
    """A shuffle buffer of more than one fetch group (16 Mi tokens) is fetched and decoded in
    groups, several at once: its batches equal those read row by row, and a read failing in a
    later group ends the pass with the error instead of a shorter epoch."""
    path = tmp_path / "big.zarr"
    rng = np.random.default_rng(7)
    with flat_tokens.Writer(path, "train", layout="v3", progress=False) as w:
        while w.token_count < 40 << 20:
            lengths = rng.integers(1, 4096, size=1024)
            ids = rng.integers(1, 50_000, size=int(lengths.sum()), dtype=np.uint32)
            w.append(np.split(ids, np.cumsum(lengths)[:-1]))
    kw = dict(seq_len=2048, batch_size=64, seed=11)
    in_memory = flat_tokens.Loader(path, "train", buffer_in_memory=True, **kw)
    assert in_memory.buffers_in_memory
    by_row = flat_tokens.Loader(path, "train", buffer_in_memory=False, **kw)
    n = 0
    for a, b in zip(in_memory, by_row, strict=True):
        for k in ("targets", "inputs", "segment_ids", "is_seq_start"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {n}: {k}")
        n += 1
    assert n == len(by_row) and n * 64 * 2048 >= 40 << 20, n
    # The buffer's third group fails to read (its fetches are the loader's first reads).
    _core._inject_fault("read_fails", 2)
    try:
        got = 0
        with pytest.raises(shardkit.ShardkitOSError, match="big.zarr") as e:
            for _ in flat_tokens.Loader(path, "train", buffer_in_memory=True, **kw):
                got += 1
        assert e.value.errno == 5 and got == 0, (e.value, got)  # EIO, before any batch
    finally:
        _core._clear_faults()
