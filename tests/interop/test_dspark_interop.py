"""DSpark interop with NeMo Automodel's offline cache, through its restatement in dspark_ref.py
(numpy, safetensors, ml_dtypes; checked on its own by test_dspark_ref.py):

- shardkit's Writer writes, byte for byte, every file NeMo's producer writes for the same
  tensors (manifest.json with "complete": true, the shards, target_weights.safetensors);
- each side reads what the other wrote, item for item; shardkit's shuffled loader serves each
  sample once per epoch;
- the completeness marker: absent (older NeMo) accepted, false refused;
- parallel writers both ways: NeMo's distributed producer killed, then finished by shardkit's
  PartWriter ranks; shardkit's ranks killed, then finished by NeMo's producer;
- a rerun with another configuration is refused by both, naming the keys NeMo names, touching
  nothing;
- shardkit.part_of is NeMo's partition_cache_shards.

Only shardkit's own checksums sidecar (``shardkit.checksums.json``) is allowed beside NeMo's
files in a finished cache.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit import dspark
from shardkit.errors import AlreadyExistsError, CorruptDataError, IncompleteDatasetError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dspark_data as D  # noqa: E402
import dspark_ref as ref  # noqa: E402

TIMEOUT = 120
DTYPES = ["bf16", "fp16", "fp32"]
#: (num_samples, shard_size): divisible, a short last shard, one short shard, one-sample shards,
#: no samples at all (NeMo writes a manifest and the weights, no shard).
SIZES = [(6, 3), (7, 3), (2, 5), (3, 1), (0, 4)]


def is_sidecar(name):
    """shardkit's checksums sidecar, the one file of a finished cache NeMo does not write."""
    return name.endswith("checksums.json")


def files(root, keep_sidecar=False):
    """Every file directly in `root` (name -> bytes), without shardkit's sidecar."""
    return {p.name: p.read_bytes() for p in sorted(Path(root).iterdir())
            if p.is_file() and (keep_sidecar or not is_sidecar(p.name))}


def stamps(root):
    """Every file under `root` (relative path -> (bytes, mtime_ns)), hidden ones included."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (f.read(), os.stat(p).st_mtime_ns)
    return out


def diff(got, want):
    only_g, only_w = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    changed = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    return f"only ours: {only_g}; only NeMo's: {only_w}; different bytes: {changed}"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def same_item(got, want, i):
    assert sorted(got) == sorted(ref.CACHE_KEYS), sorted(got)
    for k in ref.CACHE_KEYS:
        g, w = np.asarray(got[k]), want[k][i]
        assert g.dtype == w.dtype and g.shape == w.shape, (i, k, g.dtype, g.shape, w.dtype, w.shape)
        assert np.array_equal(bits(g), bits(w)), (i, k)


def nemo(path, m, x, w, world=1, **kw):
    """The cache NeMo's distributed producer writes (uninterrupted unless kw says so)."""
    return ref.precompute_distributed(path, m, x, world, w, **kw)


def ours(path, m, x, w, *, cast=False):
    """shardkit's Writer: the weights, then a batch of the first samples, then one by one."""
    given = D.cast(m, x) if cast else x
    n = int(m["num_samples"])
    with dspark.Writer(path, m) as wr:
        wr.write_target_weights(*w)
        k = min(n, 2)
        if k:
            wr.add_batch(D.rows(given, 0, k))
        for i in range(k, n):
            wr.add(D.item(given, i))
    return path


def differing_keys(err):
    """The keys a refusal names, in its order: a writer says NeMo's "mismatched fields: a, b",
    a part writer (as eagle3's) "manifest key(s) a, b differ"."""
    msg = str(err)
    found = re.search(r"mismatched fields: (.+?)\)", msg) or re.search(r"manifest key\(s\) (.+?) differ", msg)
    assert found, msg
    return found.group(1).split(", ")


# ---------------------------------------------------------------------------------------------
# Byte identity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,s", SIZES)
@pytest.mark.parametrize("cast", [False, True], ids=["float32-in", "cache-dtype-in"])
def test_writer_output_is_nemos_byte_for_byte(tmp_path, dtype, n, s, cast):
    m = D.manifest(n, s, dtype=dtype)
    x, w = D.samples(m, 1), D.weights(m, 1)
    nemo(tmp_path / "nemo", m, x, w)
    want = files(tmp_path / "nemo")
    got = files(ours(tmp_path / "ours", m, x, w, cast=cast))
    assert got == want, diff(got, want)
    assert sorted(want) == sorted(["manifest.json", "target_weights.safetensors"]
                                  + [f"shard-{k:06d}.safetensors" for k in range(-(-n // s))])
    text = (tmp_path / "ours" / "manifest.json").read_text()
    assert text == ref.manifest_text({**m, "complete": True})
    assert "Mod\\u00e8l-1B" in text and json.loads(text)["complete"] is True
    assert [p.name for p in (tmp_path / "ours").iterdir() if p.name not in want] == ["shardkit.checksums.json"]


def test_format_version_and_complete_in_the_given_manifest_are_ignored(tmp_path):
    m = D.manifest(3, 2, dtype="fp16")
    x, w = D.samples(m, 2), D.weights(m, 2)
    nemo(tmp_path / "nemo", m, x, w)
    ours(tmp_path / "ours", {**m, "format_version": 1, "complete": False}, x, w)
    assert files(tmp_path / "ours") == files(tmp_path / "nemo")


# ---------------------------------------------------------------------------------------------
# Reading each other's caches


@pytest.mark.parametrize("dtype", DTYPES)
def test_nemos_reader_reads_our_cache(tmp_path, dtype):
    m = D.manifest(7, 3, seq=5, hidden=4, layers=(0, 2, 5), dtype=dtype)
    x, w = D.samples(m, 3), D.weights(m, 3)
    path = ours(tmp_path / "ours", m, x, w)
    ds = ref.CachedDSparkDataset(str(path))
    want = D.cast(m, x)
    assert len(ds) == 7 and ds.manifest["complete"] is True
    for i in range(7):
        same_item(ds[i], want, i)
    batch = ref.collate([ds[i] for i in (6, 0, 3)])
    for k in ref.CACHE_KEYS:
        assert np.array_equal(bits(batch[k]), bits(want[k][[6, 0, 3]])), k
    e, h = ref.read_target_weights(str(path))
    dt = ref.DTYPES[dtype]
    assert np.array_equal(bits(e), bits(w[0].astype(dt))) and np.array_equal(bits(h), bits(w[1].astype(dt)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_our_cache_and_loader_read_nemos_cache(tmp_path, dtype):
    m = D.manifest(10, 3, seq=3, hidden=2, dtype=dtype)
    x, w = D.samples(m, 4), D.weights(m, 4)
    path = tmp_path / "nemo"
    nemo(path, m, x, w, world=2)
    want = D.cast(m, x)
    cache = dspark.Cache(path)
    assert len(cache) == 10
    for i in range(10):
        same_item(cache[i], want, i)
    same_item(dspark.open(path)[-1], want, 9)
    e, h = cache.target_weights()
    dt = ref.DTYPES[dtype]
    assert e.dtype == dt and e.shape == (D.VOCAB, 2)
    assert np.array_equal(bits(e), bits(w[0].astype(dt))) and np.array_equal(bits(h), bits(w[1].astype(dt)))
    v = dspark.validate(path, deep=True)
    assert v["valid"], v
    info = dspark.inspect(path)
    assert info["schema"] == "dspark" and info["format_version"] == 1 and info["complete"] is True, info


@pytest.mark.parametrize("n", [10, 9])
def test_the_shuffled_loader_serves_each_of_nemos_samples_once_an_epoch(tmp_path, n):
    m = D.manifest(n, 4, seq=3, hidden=2, dtype="bf16")
    x, w = D.samples(m, 5), D.weights(m, 5)
    path = tmp_path / "nemo"
    nemo(path, m, x, w, world=3)
    want = D.cast(m, x)
    ids = {tuple(want["input_ids"][i]): i for i in range(n)}
    assert len(ids) == n, "the seeded ids tell the samples apart"
    orders = []
    for epoch in range(2):
        for world in (1, 2):
            seen = []
            for rank in range(world):
                loader = dspark.Loader(path, batch_size=3, shuffle=True, seed=11, rank=rank, world_size=world,
                                       epoch=epoch)
                idx = loader.indices()
                batches = list(loader)
                assert len(batches) == len(loader) == -(-len(idx) // 3)
                got = [int(i) for b in batches for i in (ids[tuple(r)] for r in b["input_ids"])]
                assert got == idx, "batches follow indices()"
                for b, start in zip(batches, range(0, len(idx), 3), strict=True):
                    assert sorted(b) == sorted(ref.CACHE_KEYS)
                    for k in ref.CACHE_KEYS:
                        assert np.array_equal(bits(b[k]), bits(want[k][idx[start:start + 3]])), k
                seen += got
            if world == 1:
                assert sorted(seen) == list(range(n)), seen
                orders.append(seen)
            else:
                # DistributedSampler: each rank ceil(n / 2), padded by wrapping around.
                assert set(seen) == set(range(n)) and len(seen) == 2 * -(-n // 2), seen
    assert orders[0] != orders[1], "another epoch, another order"


# ---------------------------------------------------------------------------------------------
# The completeness marker


def test_manifests_of_older_nemo_without_the_marker_are_accepted(tmp_path):
    m = D.manifest(5, 2, dtype="fp32")
    x, w = D.samples(m, 6), D.weights(m, 6)
    path = tmp_path / "old"
    nemo(path, m, x, w)
    ref.write_manifest(str(path), m)  # what NeMo wrote before the marker existed
    assert "complete" not in json.loads((path / "manifest.json").read_text())
    assert len(ref.CachedDSparkDataset(str(path))) == 5
    cache = dspark.open(path)
    want = D.cast(m, x)
    for i in range(5):
        same_item(cache[i], want, i)
    assert dspark.validate(path, deep=True)["valid"]
    assert [len(b["input_ids"]) for b in dspark.Loader(path, batch_size=2, shuffle=False)] == [2, 2, 1]


@pytest.mark.parametrize("shards", ["some", "all"])
def test_a_cache_marked_incomplete_is_refused(tmp_path, shards):
    m = D.manifest(6, 2, dtype="bf16")
    x, w = D.samples(m, 7), D.weights(m, 7)
    path = tmp_path / "cut"
    # Killed after one shard a rank, or after every shard but before the final manifest.
    nemo(path, m, x, w, world=2, stop_after=1 if shards == "some" else None)
    if shards == "all":
        ref.write_manifest(str(path), {**m, "complete": False})
        assert ref.existing_shard_indices(str(path)) == {0, 1, 2}
    assert json.loads((path / "manifest.json").read_text())["complete"] is False
    with pytest.raises(ValueError):
        ref.CachedDSparkDataset(str(path))
    with pytest.raises(IncompleteDatasetError):
        dspark.Cache(path)
    with pytest.raises(IncompleteDatasetError):
        dspark.Loader(path, batch_size=2)
    v = dspark.validate(path)
    assert not v["valid"] and any("complete" in e["message"] for e in v["errors"]), v
    assert dspark.inspect(path)["complete"] is False


@pytest.mark.parametrize("marker", [1, "true", None])
def test_a_marker_that_is_not_true_is_refused_as_nemo_refuses_it(tmp_path, marker):
    m = D.manifest(2, 2)
    x, w = D.samples(m), D.weights(m)
    nemo(tmp_path, m, x, w)
    ref.write_manifest(str(tmp_path), {**m, "complete": marker})
    with pytest.raises(ValueError, match="marked incomplete"):
        ref.CachedDSparkDataset(str(tmp_path))
    with pytest.raises((IncompleteDatasetError, CorruptDataError)):
        dspark.Cache(tmp_path)
    assert not dspark.validate(tmp_path)["valid"]


# ---------------------------------------------------------------------------------------------
# Parallel writers, both ways


def finish_with_part_writers(path, m, x, w, world):
    """shardkit's ranks, one after another, each adding the samples it still owes."""
    n = int(m["num_samples"])
    for r in range(world):
        pw = dspark.PartWriter(path, m, n, rank=r, world_size=world, target_weights=True)
        if r == 0:
            pw.write_target_weights(*w)  # the same table NeMo wrote: nothing changes
        for a, b in pw.pending:
            for at in range(a, b, 2):
                pw.add_batch(D.rows(x, at, min(at + 2, b)))
        pw.close()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stop,torn", [(0, False), (1, False), (1, True), ({0: 0}, False), ({1: 1}, True)],
                         ids=["nothing", "one-each", "one-each-torn", "rank0-none", "rank1-one-torn"])
def test_nemo_killed_then_finished_by_part_writers(tmp_path, world, stop, torn):
    m = D.manifest(11, 2, dtype="bf16")
    x, w = D.samples(m, 8), D.weights(m, 8)
    nemo(tmp_path / "whole", m, x, w, world=3)
    whole = files(tmp_path / "whole")
    path = tmp_path / "cut"
    assert not nemo(path, m, x, w, world=3, stop_after=stop, torn=torn)["complete"]
    # NeMo's torn temporaries (`shard-NNNNNN.safetensors.tmp`) go, as shardkit's own do.
    assert any(p.name.endswith(".tmp") for p in path.iterdir()) == torn
    finish_with_part_writers(path, m, x, w, world)
    got = files(path)
    assert got == whole, diff(got, whole)
    assert dspark.status(path)["committed"] is True
    ds = ref.CachedDSparkDataset(str(path))
    want = D.cast(m, x)
    for i in range(11):
        same_item(ds[i], want, i)
    assert dspark.validate(path, deep=True)["valid"]


RANK_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, HERE)
    import dspark_data as D
    from shardkit import dspark
    m = D.manifest(*SIZE, dtype=DTYPE)
    x, w = D.samples(m, SEED), D.weights(m, SEED)
    pw = dspark.PartWriter(PATH, m, m["num_samples"], rank=RANK, world_size=WORLD, target_weights=True)
    if RANK == 0:
        pw.write_target_weights(*w)
    done = 0
    for a, b in pw.pending:
        for i in range(a, b):
            if done == KILL_AFTER:
                print("killing", done, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            pw.add(D.item(x, i))
            done += 1
    print("status", json.dumps(pw.close()), flush=True)
    """
)


def run_rank(path, rank, world, kill_after=None, size=(11, 2), dtype="bf16", seed=9):
    """Rank `rank` of `world` in a child process, SIGKILLing itself before its sample
    `kill_after` of its block (None: it finishes). Returns its output lines."""
    params = dict(HERE=str(HERE), PATH=str(path), RANK=rank, WORLD=world, KILL_AFTER=kill_after,
                  SIZE=size, DTYPE=dtype, SEED=seed)
    code = "".join(f"{k} = {v!r}\n" for k, v in params.items()) + RANK_CHILD
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if kill_after is None:
        assert p.returncode == 0, p.stderr
    else:
        assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    return p.stdout.splitlines()


@pytest.mark.parametrize(
    "world,kills,nemo_world",
    [
        (2, {0: 3}, 2),  # rank 0 killed mid-shard in its block, rank 1 done
        (3, {1: 2, 2: 0}, 1),  # rank 1 after one shard, rank 2 before anything; rank 0 done
        (3, {0: 0, 1: 0, 2: 0}, 3),  # every rank killed before its first sample
        (1, {0: 9}, 2),  # the only rank, well into its block
    ],
)
def test_part_writers_killed_then_finished_by_nemo(tmp_path, world, kills, nemo_world):
    size, dtype, seed = (11, 2), "bf16", 9
    m = D.manifest(*size, dtype=dtype)
    x, w = D.samples(m, seed), D.weights(m, seed)
    whole = tmp_path / "whole"
    nemo(whole, m, x, w)
    path = tmp_path / "cache"
    for r in range(world):
        lines = run_rank(path, r, world, kills.get(r), size, dtype, seed)
        assert (lines[-1].startswith("killing") if r in kills else lines[-1].startswith("status")), lines
    # What the ranks left: a manifest NeMo's producer accepts as its own unfinished run.
    recorded = ref.read_manifest(str(path), allow_incomplete=True)
    assert recorded["complete"] is False and ref.manifest_mismatch_fields(recorded, m) == []
    with pytest.raises(ValueError):
        ref.CachedDSparkDataset(str(path))
    assert nemo(path, m, x, w, world=nemo_world)["complete"]
    got = files(path)
    want = files(whole)
    # NeMo's files are exactly an uninterrupted run's; anything else is shardkit's own state
    # (which NeMo neither reads nor removes), never a shard, manifest or weights file.
    assert {k: got[k] for k in want if k in got} == want, diff(got, want)
    extra = sorted(set(got) - set(want))
    assert all(not ref.SHARD_RE.match(k) and k not in ("manifest.json", ref.TARGET_WEIGHTS) for k in extra), extra
    ds = ref.CachedDSparkDataset(str(path))
    cast = D.cast(m, x)
    for i in range(size[0]):
        same_item(ds[i], cast, i)
    v = dspark.validate(path, deep=True)
    assert v["valid"], v
    cache = dspark.open(path)
    for i in range(size[0]):
        same_item(cache[i], cast, i)


# ---------------------------------------------------------------------------------------------
# A rerun with another configuration


CHANGES = {
    "shuffle_seed": 43,
    "chat_template_sha256": ref.chat_template_sha256("{{ messages }}"),
    "train_split": "train[:90%]",
}


@pytest.mark.parametrize("state", ["interrupted", "finished-by-nemo", "finished-by-us"])
@pytest.mark.parametrize("keys", [["shuffle_seed"], ["chat_template_sha256"], ["train_split"],
                                  ["train_split", "shuffle_seed", "chat_template_sha256"]],
                         ids=lambda k: "+".join(k))
def test_a_rerun_with_another_configuration_is_refused_naming_nemos_keys(tmp_path, state, keys):
    m = D.manifest(6, 2, dtype="fp16")
    x, w = D.samples(m, 10), D.weights(m, 10)
    path = tmp_path / "cache"
    if state == "finished-by-us":
        ours(path, m, x, w)
    else:
        nemo(path, m, x, w, world=2, stop_after=1 if state == "interrupted" else None)
    other = {**m, **{k: CHANGES[k] for k in keys}}
    want = ref.manifest_mismatch_fields(ref.read_manifest(str(path), allow_incomplete=True), other)
    assert want == sorted(keys)
    before = stamps(path)
    with pytest.raises(AlreadyExistsError) as e:
        dspark.Writer(path, other, resume=True)
    assert differing_keys(e.value) == want, str(e.value)
    for r, world in ((0, 1), (1, 2), (2, 3)):
        with pytest.raises(AlreadyExistsError) as e:
            dspark.PartWriter(path, other, 6, rank=r, world_size=world)
        assert differing_keys(e.value) == want, str(e.value)
    assert stamps(path) == before, "nothing on disk was touched"
    # NeMo refuses the same rerun, naming the same keys.
    with pytest.raises(ValueError, match=re.escape(f"(mismatched fields: {want})")):
        nemo(path, other, x, w)
    assert stamps(path) == before


# ---------------------------------------------------------------------------------------------
# The partition


def part_of(units, rank, world_size):
    """shardkit.part_of as (start, end) units (the one place to adjust to its signature)."""
    r = shardkit.part_of(units, rank=rank, world_size=world_size)
    return (r.start, r.stop) if isinstance(r, range) else tuple(r)


def nemo_shards(n, s, world, rank):
    """NeMo's block of `rank` as (first shard, end shard)."""
    start, _, count = ref.partition_cache_shards(n, s, world, rank)
    return start, start + -(-count // s)


def test_part_of_is_nemos_partition():
    checked = 0
    for n in list(range(0, 30)) + [97, 256, 1000, 1001]:
        for s in (1, 2, 3, 7, 64):
            units = -(-n // s)
            for world in range(1, 10):
                for rank in range(world):
                    assert part_of(units, rank, world) == nemo_shards(n, s, world, rank), (n, s, world, rank)
                    checked += 1
    assert checked > 5000


@pytest.mark.parametrize("n,s,world", [(11, 2, 3), (5, 2, 5), (9, 3, 3), (4, 4, 3), (0, 2, 2)])
def test_part_writer_blocks_are_nemos(tmp_path, n, s, world):
    m = D.manifest(n, s)
    for rank in range(world):
        pw = dspark.PartWriter(tmp_path / "c", m, n, rank=rank, world_size=world)
        _, first, count = ref.partition_cache_shards(n, s, world, rank)
        first = min(first, n)  # NeMo's start for a rank without samples may pass the end
        assert pw.samples == (first, first + count), (rank, pw.samples)
        pw.abort()
