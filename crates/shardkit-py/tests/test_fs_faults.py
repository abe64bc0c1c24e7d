"""Filesystem faults give a clear error and leave what is on disk intact, for every format
(saev, EAGLE-3, flat-tokens, SDNB):

- a full disk: a file size limit (RLIMIT_FSIZE, so writes fail with EFBIG) and a real ENOSPC on
  a 2 MB tmpfs (mounted in a private mount namespace). The error names a path inside the dataset
  being written; a dataset completed earlier is untouched byte for byte; a resumable write that
  failed resumes to the bytes of an uninterrupted write once there is room.
- a read-only directory (chmod 555, written by a child that the mode binds: as root, one dropped
  to nobody; or a read-only bind mount): the writer fails naming the path and creates nothing.
- an unreadable shard (chmod 000, read by a child that the mode binds): reading fails naming it.
- a shard replaced by a symlink to a valid copy (read through it) or by a FIFO (a clear error
  naming it, never a hang). Each such operation runs in a child process watched for a thread
  blocked opening the FIFO (`wchan` = wait_for_partner), with a 20 s limit besides.

Writers and readers run in child processes where the fault needs it (a resource limit, dropped
privileges, a possible hang); the code they run is the same code this module runs in-process
(`WRITERS_SRC`, exec'd here and sent to the children). Every fault is made real as root (CI) and
as an ordinary user alike; _faults.py says how.
"""

import errno
import hashlib
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from shardkit import saev, sdnb

from _faults import DROP_SRC, must_drop, private_mounts, world_dir  # noqa: F401 - world_dir: a fixture
from _procs import snapshot

FORMATS = ["saev", "eagle3", "flat_tokens", "sdnb"]

# ---------------------------------------------------------------------------------------------
# Writers of a small dataset (written first, must stay intact) and a big one (about 3 MB, whose
# files exceed the size limits below), shared with the child processes.

WRITERS_SRC = r'''
import numpy as np
from shardkit import eagle3, flat_tokens, saev, sdnb

def _saev_md(big):
    n, d = (48, 1024) if big else (8, 64)
    return {"family": "clip", "ckpt": "faults-big" if big else "faults-small", "layers": [0],
            "content_tokens_per_example": 16, "cls_token": False, "d_model": d, "n_examples": n,
            "max_tokens_per_shard": 16 * 4, "data": "gASV", "dataset": "t", "protocol": "2.1"}

def write_saev(root, big, resume=False, stop_after=None):
    """root/<hash>: 8 or 48 examples of 16 x 64 or 16 x 1024 floats, 4 per shard, 4 per step."""
    md = _saev_md(big)
    n, d = md["n_examples"], md["d_model"]
    w = saev.Writer(root, md, resume=resume, progress=False)
    for step, a in enumerate(range(w.next_example, n, 4)):
        if stop_after is not None and step == stop_after:
            w.abort()
            return w.path
        e = np.arange(a, a + 4, dtype=np.float32)[:, None, None, None]
        w.write(e * 1000 + np.arange(16 * d, dtype=np.float32).reshape(1, 1, 16, d))
    return w.close()

def _e3_manifest(big):
    s, h, v = (64, 64, 1024) if big else (4, 2, 6)
    return {"target_model": "t", "target_vocab_size": 5000, "draft_vocab_size": v, "seq_length": s,
            "dtype": "fp32" if big else "bf16", "num_samples": 12 if big else 24,
            "shard_size": 2 if big else 4, "aux_hidden_dim": 3 * h, "aux_layer_ids": [1, 2, 3],
            "selected_token_ids": list(range(v))}

def write_eagle3(cache, big, resume=False, stop_after=None):
    """12 samples of 300 KB (2 per shard) or 24 tiny ones (4 per shard), 1 per step."""
    m = _e3_manifest(big)
    s, v, h3 = m["seq_length"], m["draft_vocab_size"], m["aux_hidden_dim"]
    w = eagle3.Writer(cache, m, resume=resume, format_version=2)
    for step, i in enumerate(range(w.next_sample, m["num_samples"])):
        if stop_after is not None and step == stop_after:
            w.abort()
            return str(cache)
        rng = np.random.default_rng(i)
        p = rng.random((s, v), dtype=np.float32) + 0.01
        w.add({"input_ids": rng.integers(0, 5000, s), "attention_mask": np.ones(s, dtype=np.int64),
               "loss_mask": np.ones(s, dtype=np.int64), "position_mask": np.ones((s, 1), dtype=bool),
               "aux_hidden_states": rng.standard_normal((s, h3), dtype=np.float32),
               "target_probs": p / p.sum(-1, keepdims=True)})
    return w.close()

def _corpus(big):
    rng = np.random.default_rng(7 if big else 3)
    return [rng.integers(1, 1 << 30, int(rng.integers(1, 800))) for _ in range(2000 if big else 20)]

def write_flat_tokens(path, big, resume=False, stop_after=None):
    """20 or 2,000 sequences of random 30-bit ids (about 3.2 MB), 50 per step; v3 shards of
    2^16 tokens (256 KB before zstd, which cannot shrink random ids much)."""
    seqs = _corpus(big)
    w = flat_tokens.Writer(path, "train", resume=resume, checkpoint_tokens=50000,
                           tokens_per_shard=1 << 16, progress=False)
    start = w.resumed_from or 0
    for step, a in enumerate(range(start, len(seqs), 50)):
        if stop_after is not None and step == stop_after:
            w.abort()
            return str(path)
        w.append(seqs[a:a + 50])
    w.close()
    return str(path)

def write_sdnb(path, big, resume=False, stop_after=None):
    """64 KB in 3 tensors, or 3 MB in 5."""
    k = 4 if big else 1
    t = {"w%d" % i: np.arange(k * 40000, dtype=np.float32) * (i + 1) for i in range(3 + 2 * big)}
    t["b"] = np.ones(16, dtype=np.float16)
    sdnb.save(path, t, {"creation.time": "1700000000000"}, progress=False)
    return str(path)

WRITERS = {"saev": write_saev, "eagle3": write_eagle3, "flat_tokens": write_flat_tokens, "sdnb": write_sdnb}
'''
exec(WRITERS_SRC)  # noqa: S102 - the module's own source, shared with the children

# Where each format's dataset goes under a parent directory (saev: the root of hash-named dirs).
TARGET = {"saev": "saev", "eagle3": "cache", "flat_tokens": "ds.zarr", "sdnb": "m.sdnb"}
BIG_TARGET = {"saev": "saev", "eagle3": "cache-big", "flat_tokens": "big.zarr", "sdnb": "m.sdnb"}


def dataset_snapshot(which, path):
    """The files of a dataset: its directory, or for SDNB the container's directory (the
    container, its checksums sidecar, and any temporary or lock file a writer left there)."""
    return snapshot(os.path.dirname(path) if which == "sdnb" else path)


def is_leftover(name):
    n = os.path.basename(name)
    return n.endswith(".tmp") or (n.startswith(".") and n.endswith(".lock")) or n == ".shardkit-writing"


def without_leftovers(snap):
    return {k: v for k, v in snap.items() if not is_leftover(k)}


# ---------------------------------------------------------------------------------------------
# Children


CHILD = r'''
import json, os, resource, signal, sys
import numpy.random  # numpy imports it lazily: from the stdlib, unreadable once unprivileged
{writers}
def _report(**kw):
    sys.stdout.write("RESULT " + json.dumps(kw) + "\n")
    sys.stdout.flush()
if {fsize!r} is not None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize!r}, {fsize!r}))
DROP = {drop!r}
{drop_src}
try:
    result = {call}
except Exception as e:
    _report(ok=False, type=type(e).__name__, mro=[c.__name__ for c in type(e).__mro__],
            errno=getattr(e, "errno", None), message=str(e))
else:
    _report(ok=True, result=result)
'''


def child(call, *, fsize=None, drop=False, timeout=60):
    """Runs `call` (an expression over WRITERS' functions) in a child process, after setting a
    file size limit and/or dropping root privileges (everything is imported first); returns
    {"ok": True, "result": ...} or {"ok": False, "type", "mro", "errno", "message"}."""
    code = CHILD.format(writers=WRITERS_SRC, fsize=fsize, drop=drop, drop_src=DROP_SRC, call=call)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child died ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def written_as(path):
    """`path` and the temporary sibling it is written through (`.NAME.tmp`), which an error
    while writing names."""
    d, n = os.path.split(str(path))
    return str(path), os.path.join(d, f".{n}.tmp")


def check_io_error(r, which, strerror, *inside):
    """`r` (a child's report) is an OSError whose message names a path under one of `inside`
    and says `strerror`."""
    assert r["ok"] is False, f"{which}: the write succeeded despite the fault: {r}"
    msg = r["message"]
    assert strerror in msg, msg
    assert any(str(p) in msg for p in inside), f"{msg!r} names none of {inside}"
    assert "OSError" in r["mro"], r


# ---------------------------------------------------------------------------------------------
# A full disk: RLIMIT_FSIZE (EFBIG)

# Larger than every file of the small datasets and every metadata file; smaller than a shard,
# chunk or container of the big ones.
FSIZE = {"saev": 64 << 10, "eagle3": 64 << 10, "flat_tokens": 64 << 10, "sdnb": 1 << 20}


@pytest.mark.parametrize("which", FORMATS)
def test_file_size_limit_fails_naming_the_file_and_keeps_the_finished_dataset(tmp_path, which):
    write = WRITERS[which]
    small = write(str(tmp_path / TARGET[which]), False)
    before = dataset_snapshot(which, small)
    assert before and all(len(b) < FSIZE[which] for b in before.values())
    big = str(tmp_path / BIG_TARGET[which])  # sdnb: the same file, overwritten
    r = child(f"WRITERS[{which!r}]({big!r}, True)", fsize=FSIZE[which])
    # The finished dataset is untouched, whatever the failed write left beside it (for SDNB,
    # overwritten in place: nothing else either, no temporary, no lock file).
    assert dataset_snapshot(which, small) == before
    if which == "saev":
        # The big dataset's directory (a sibling, named by its own hash) is where it failed.
        new = set(os.listdir(big)) - {os.path.basename(small)}
        assert len(new) == 1, new
        big = os.path.join(big, new.pop())
    check_io_error(r, which, "File too large", *written_as(big))


@pytest.mark.parametrize("which", ["saev", "eagle3", "flat_tokens"])
def test_resume_past_the_file_size_limit_fails_then_resumes_exactly(tmp_path, which):
    write = WRITERS[which]
    ref = tmp_path / "ref"
    reference = snapshot(write(str(ref / BIG_TARGET[which]), True))
    d = tmp_path / "t"
    path = write(str(d / BIG_TARGET[which]), True, stop_after=2)
    committed = without_leftovers(snapshot(path))
    assert committed and committed != reference
    r = child(f"WRITERS[{which!r}]({str(d / BIG_TARGET[which])!r}, True, resume=True)", fsize=FSIZE[which])
    # What the first run committed is untouched (the failed run may leave temporaries).
    assert without_leftovers(snapshot(path)) == committed
    # With room again, a resume completes it to the bytes of an uninterrupted write.
    write(str(d / BIG_TARGET[which]), True, resume=True)
    assert snapshot(path) == reference
    check_io_error(r, which, "File too large", path)


# ---------------------------------------------------------------------------------------------
# A full disk: ENOSPC on a 2 MB tmpfs, mounted in a private mount namespace (as root or not)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 2 MB tmpfs, as its path through the namespace that holds it."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    with private_mounts(f"mount -t tmpfs -o size=2m tmpfs {shlex.quote(str(d))}") as ns:
        view = pathlib.Path(ns + str(d))
        st = os.statvfs(view)
        assert st.f_blocks * st.f_frsize <= 2 << 20, "not the 2 MB tmpfs"
        yield view


@pytest.mark.parametrize("which", FORMATS)
def test_no_space_left_fails_naming_the_file_and_keeps_the_finished_dataset(tiny_tmpfs, which):
    write = WRITERS[which]
    small = write(str(tiny_tmpfs / TARGET[which]), False)
    before = dataset_snapshot(which, small)
    assert before
    big = str(tiny_tmpfs / BIG_TARGET[which])
    r = child(f"WRITERS[{which!r}]({big!r}, True)")
    assert dataset_snapshot(which, small) == before
    if which == "saev":
        new = set(os.listdir(big)) - {os.path.basename(small)}
        assert len(new) == 1, new
        big = os.path.join(big, new.pop())
    check_io_error(r, which, "No space left on device", *written_as(big))
    assert r["errno"] == errno.ENOSPC and r["type"] == "ShardkitOSError", r
    # Still readable (saev and sdnb check every shard's size at open).
    if which == "saev":
        assert saev.open(small).n_examples == 8
    elif which == "sdnb":
        with sdnb.open(small) as m:
            assert len(m) == 4


# ---------------------------------------------------------------------------------------------
# A read-only directory: chmod 555 (a permission check; `world_dir` comes from _faults) or a
# read-only bind mount in a private mount namespace


@pytest.fixture
def ro_bind(world_dir):
    """(writable source dir, the same dir mounted read-only, as its path through the namespace)."""
    src, ro = os.path.join(world_dir, "src"), os.path.join(world_dir, "ro")
    os.mkdir(src)
    os.mkdir(ro)
    q = shlex.quote
    with private_mounts(f"mount --bind {q(src)} {q(ro)}\nmount -o remount,bind,ro {q(ro)}") as ns:
        yield src, ns + ro


@pytest.mark.parametrize("which", FORMATS)
@pytest.mark.parametrize("how", ["chmod-555", "ro-mount"])
def test_read_only_directory_fails_naming_the_path_and_creates_nothing(world_dir, request, which, how):
    write = WRITERS[which]
    if how == "chmod-555":
        drop = must_drop()
        d = os.path.join(world_dir, "ro")
        os.mkdir(d)
        small = write(os.path.join(d, TARGET[which]), False)
        # Readable and traversable by all, writable by none but root (whose rights the child drops).
        for dirpath, dirs, _ in os.walk(d):
            for n in dirs:
                os.chmod(os.path.join(dirpath, n), 0o555)
        os.chmod(d, 0o555)
        view = d
    else:
        drop = False
        src, view = request.getfixturevalue("ro_bind")
        small = write(os.path.join(src, TARGET[which]), False)
        small = os.path.join(view, os.path.relpath(small, src))
    before = snapshot(view)
    assert before, f"no finished dataset under {view}"
    big = os.path.join(view, BIG_TARGET[which])
    r = child(f"WRITERS[{which!r}]({big!r}, True)", drop=drop)
    assert snapshot(view) == before, "a write into a read-only directory changed it"
    strerror = "Permission denied" if how == "chmod-555" else "Read-only file system"
    check_io_error(r, which, strerror, view)
    if how == "chmod-555":
        assert r["errno"] == errno.EACCES and r["type"] == "PermissionDeniedError", r
        assert "PermissionError" in r["mro"], r
    else:
        assert r["errno"] == errno.EROFS and r["type"] == "ShardkitOSError", r
    # The finished dataset still reads.
    if which == "saev":
        assert saev.open(small).n_examples == 8
    elif which == "sdnb":
        with sdnb.open(small) as m:
            assert len(m) == 4


# ---------------------------------------------------------------------------------------------
# Reading: an unreadable shard, a symlinked shard, a FIFO in place of a shard

# The file each test tampers with, relative to the dataset's parent directory.
SHARD = {
    "saev": None,  # found at run time: saev/<hash>/acts000000.bin
    "eagle3": os.path.join("cache", "shard-000001.safetensors"),
    "flat_tokens": os.path.join("ds.zarr", "train", "encoded_tokens", "c", "0"),
    "sdnb": "m.sdnb",
}

# Reading operations, as code for a child: each prints a digest of what it read.
READS = {
    ("saev", "open"): "d = saev.open(P); out(d.take(np.arange(8)[:, None], 0, np.arange(16)[None, :]))",
    ("saev", "validate"): "out(saev.validate(P))",
    ("saev", "load"): "out([b['act'] for b in saev.OrderedLoader(P, layer=0, batch_size=32)])",
    ("eagle3", "open"): "c = eagle3.open(P); out([c[i]['target_probs'] for i in range(len(c))])",
    ("eagle3", "validate"): "out(eagle3.validate(P, deep=True))",
    ("eagle3", "load"): "out([b['input_ids'] for b in eagle3.Loader(P, batch_size=4, shuffle=False, rank=0, world_size=1)])",
    ("flat_tokens", "open"): "s = flat_tokens.open(P)['train']; out([s[i] for i in range(len(s))])",
    ("flat_tokens", "validate"): "out(flat_tokens.validate(P))",
    ("flat_tokens", "load"): ("l = flat_tokens.Loader(P, 'train', seq_len=64, batch_size=4, "
                              "sequences_per_read_block=8, read_blocks_per_shuffle_buffer=2); "
                              "out([l.load(k)['targets'] for k in range(l.step_count)])"),
    ("sdnb", "open"): "m = sdnb.open(P); out([m[k] for k in m])",
}

READ_CHILD = r'''
import hashlib, json, os, sys
import numpy as np
import numpy.random
from shardkit import eagle3, flat_tokens, saev, sdnb
P = {path!r}
def out(x):
    if isinstance(x, dict):  # a validation report
        sys.stdout.write("REPORT " + json.dumps(x) + "\n")
        return
    h = hashlib.sha256()
    for a in (x if isinstance(x, list) else [x]):
        h.update(np.ascontiguousarray(a).tobytes())
    sys.stdout.write("DIGEST " + h.hexdigest() + "\n")
DROP = {drop!r}
{drop_src}
try:
    {code}
except Exception as e:
    sys.stdout.write("ERROR " + json.dumps([[c.__name__ for c in type(e).__mro__], str(e)]) + "\n")
'''


def blocked_opening_a_fifo(pid):
    """Whether a thread of `pid` sleeps in the kernel's FIFO open (no writer will ever come)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/wchan") as f:
                if f.read().strip() == "wait_for_partner":
                    return True
        except OSError:
            pass
    return False


def read_in_child(path, code, *, drop=False, timeout=20.0):
    """Runs a READS operation on `path` in a child: ("digest", hex), ("report", dict),
    ("error", (mro names, message)) or ("hang", why). A child seen twice, 0.2 s apart, blocked
    opening a FIFO is a hang at once; otherwise the limit is `timeout` seconds."""
    src = READ_CHILD.format(path=str(path), drop=drop, drop_src=DROP_SRC, code=code)
    p = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    seen_blocked = 0
    try:
        while True:
            try:
                stdout, stderr = p.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            seen_blocked = seen_blocked + 1 if blocked_opening_a_fifo(p.pid) else 0
            if seen_blocked >= 2:
                return "hang", "blocked in open() of the FIFO (wchan wait_for_partner)"
            if time.monotonic() > deadline:
                return "hang", f"no answer within {timeout} s"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, f"the reader died ({p.returncode}), a panic or a crash:\n{stdout}\n{stderr}"
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "DIGEST":
            return "digest", rest
        if kind == "REPORT":
            return "report", json.loads(rest)
        if kind == "ERROR":
            return "error", tuple(json.loads(rest))
    raise AssertionError(f"no answer from the reader:\n{stdout}\n{stderr}")


@pytest.fixture
def datasets(world_dir):
    """The small dataset of each format under a directory any user can read; returns
    (parent, {format: dataset path}, {format: shard path})."""
    paths = {which: WRITERS[which](os.path.join(world_dir, TARGET[which]), False) for which in FORMATS}
    shards = {which: os.path.join(world_dir, SHARD[which]) for which in FORMATS if SHARD[which]}
    shards["saev"] = os.path.join(paths["saev"], "acts000000.bin")
    return world_dir, paths, shards


def mentions(message, dataset, shard):
    """Whether `message` names `shard`: its path, or (as flat-tokens names chunks) the dataset's
    path and the shard's path relative to it."""
    rel = os.path.relpath(shard, dataset)
    return shard in message or (dataset in message and rel != "." and rel in message)


def expect_clear_error(which, op, res, dataset, shard, strerror=None):
    """`res` (from read_in_child) is an exception, or an invalid validation report, naming
    `shard`; returns (exception mro names, message), or None for a report."""
    kind, detail = res
    assert kind != "hang", f"{which} {op}: {detail}"
    assert kind != "digest", f"{which} {op}: read something from a file it cannot read"
    if kind == "report":
        assert detail["valid"] is False, detail
        named = [e for e in detail["errors"] if mentions(json.dumps(e), dataset, shard)]
        assert named, f"{which} {op}: no error names {shard}: {detail['errors']}"
        if strerror:
            assert any(strerror in json.dumps(e) for e in named), named
        return None
    mro, msg = detail
    assert mentions(msg, dataset, shard), f"{which} {op}: {msg!r} does not name {shard}"
    if strerror:
        assert strerror in msg, msg
    return mro, msg


OPS = sorted(READS)


@pytest.mark.parametrize("which,op", OPS)
def test_unreadable_shard_fails_naming_it(datasets, which, op):
    drop = must_drop()  # chmod 000 binds an ordinary user; root reads it as nobody
    _, paths, shards = datasets
    shard = shards[which]
    before = dataset_snapshot(which, paths[which])
    os.chmod(shard, 0)
    res = read_in_child(paths[which], READS[which, op], drop=drop)
    r = expect_clear_error(which, op, res, paths[which], shard, "Permission denied")
    if r is not None:
        mro, msg = r
        assert mro[0] == "PermissionDeniedError" and "PermissionError" in mro and "ShardkitError" in mro, (mro, msg)
    os.chmod(shard, 0o644)
    assert dataset_snapshot(which, paths[which]) == before, "a failed read changed the dataset"


def test_io_errors_are_the_matching_oserror_subclass(datasets):
    drop = must_drop()
    _, paths, shards = datasets
    for which in ("saev", "eagle3", "flat_tokens", "sdnb"):
        os.chmod(shards[which], 0)
        kind, detail = read_in_child(paths[which], READS[which, "open"], drop=drop)
        assert kind == "error", (which, kind, detail)
        mro, msg = detail
        assert mro[:2] == ["PermissionDeniedError", "ShardkitOSError"] and "PermissionError" in mro, f"{which}: {mro}: {msg}"


def hang(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


# A FIFO in place of a shard once hung every reader but saev's (File::open blocks on a FIFO
# until a writer opens it); each format now refuses it by type before reading. Kept as a map so a
# regression can be marked while it is fixed.
FIFO_HANGS = {}


@pytest.mark.parametrize("which,op", [
    pytest.param(w, o, marks=hang(FIFO_HANGS[w, o])) if (w, o) in FIFO_HANGS else (w, o) for w, o in OPS
])
def test_fifo_in_place_of_a_shard_is_a_clear_error(datasets, which, op):
    _, paths, shards = datasets
    shard = shards[which]
    os.remove(shard)
    os.mkfifo(shard)
    res = read_in_child(paths[which], READS[which, op])
    expect_clear_error(which, op, res, paths[which], shard)


@pytest.mark.parametrize("which,op", OPS)
def test_symlinked_shard_reads_through_the_link(datasets, which, op):
    parent, paths, shards = datasets
    expected = read_in_child(paths[which], READS[which, op])
    assert expected[0] in ("digest", "report"), expected
    if expected[0] == "report":
        assert expected[1]["valid"] is True, expected
    shard = shards[which]
    elsewhere = os.path.join(parent, "elsewhere")
    os.makedirs(elsewhere, exist_ok=True)
    copy = os.path.join(elsewhere, os.path.basename(shard) + ".copy")
    with open(shard, "rb") as f:
        original = hashlib.sha256(f.read()).hexdigest()
    shutil.copy2(shard, copy)
    os.remove(shard)
    os.symlink(copy, shard)
    with open(copy, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == original  # the link's target is the shard's bytes
    got = read_in_child(paths[which], READS[which, op])
    # The read succeeds (a refusal fails this test) and serves exactly what the shard held.
    assert got[0] != "error", f"{which} {op}: refused the symlinked shard: {got[1]}"
    assert got == expected, f"{which} {op}: read {got} through the symlink, expected {expected}"
