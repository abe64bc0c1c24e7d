"""The Python writers survive SIGKILL at any point, to the standard of the CLI's kill tests
(crates/shardkit-cli/tests/kill.rs, eagle3_kill.rs, tokens_kill.rs).

Each writer runs in a child process that writes a deterministic dataset of a few MB in many
small steps and is killed with SIGKILL at points spread over the whole write: right after the
writer opened, after step k of n (early, middle, late), during the final commit. What the kill
left is then checked: it is either not started, refused as incomplete, or complete and
byte-identical to an uninterrupted write. A resumed run (killed itself in some cases, then run
to the end) must produce exactly the bytes of the uninterrupted write, with no temporary and no
lock file left behind.

``sdnb.save`` is not resumable: after a kill the target is either as it was (absent, or the
container being overwritten) or the complete new container, and saving again to the same path
succeeds with the identical bytes and cleans up. Kill points there are fractions of the time an
uninterrupted save takes, or events seen on disk (a temporary appeared, the target replaced).

shardkit's checksums sidecar (`*.checksums.json`) is part of the exact bytes; where a writer
publishes it after its commit point, a state missing it is named and accepted as in the CLI
tests (EAGLE-3); a sidecar that does not match the data present fails the test.

The kill points are fixed (markers and delays listed below), not drawn at random: a failure
reruns with the same parameters.
"""

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shardkit
from shardkit import IncompleteDatasetError, eagle3, flat_tokens, saev, sdnb

from _procs import snapshot

# ---------------------------------------------------------------------------------------------
# Child processes


def is_leftover(path):
    """Whether `path` is a file a writer keeps only while it works: a `.NAME.tmp` temporary
    (EAGLE-3's are `NAME.tmp`, without the dot), a `.NAME.lock` file, the safetensors crate's
    `.tmpXXXXXX`, saev's `.shardkit-writing` marker, an SDNB shard-set overwrite's journal
    `.BASE.shard-set.pending`. (zarr v2's `.zarray`, `.zattrs`, `.zgroup`
    are data.)"""
    n = os.path.basename(path)
    return n.endswith(".tmp") or n.endswith(".shard-set.pending") or (n.startswith(".") and n.endswith(".lock")) or n == ".shardkit-writing" or (
        len(n) == 10 and n.startswith(".tmp") and n[4:].isalnum())


def hidden(names):
    """The leftovers among `names`."""
    return sorted(n for n in names if is_leftover(n))



def visible(snap):
    """`snap` without leftovers."""
    return {k: v for k, v in snap.items() if not is_leftover(k)}


def is_sidecar(path):
    """shardkit's checksums sidecar: `shardkit.checksums.json` in a dataset directory,
    `NAME.checksums.json` (a shard set's `BASE.shard-set.checksums.json`) beside a container."""
    return os.path.basename(path).endswith("checksums.json")


def data_files(snap):
    """`snap` without the checksums sidecar."""
    return {k: v for k, v in snap.items() if not is_sidecar(k)}


def diff(a, b):
    """A short description of how two snapshots differ (for assertion messages)."""
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"only in got: {only_a}; only in expected: {only_b}; different bytes: {changed}"


def spawn(code):
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def run_to_end(code, timeout=60):
    """Runs a child to completion; its stdout lines (fails the test on a non-zero exit)."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{p.stderr}"
    return p.stdout.splitlines()


def run_and_kill(code, marker, delay=0.0, timeout=60, when=None):
    """Starts a child and kills it with SIGKILL `delay` seconds after it prints the line
    `marker` (the child prints each marker *before* doing that step's work, so the kill lands
    inside the step or later), or, with `when`, as soon as `when()` is true after the marker.
    Returns the lines the child printed before it died: what it had started (it may have
    finished instead, if it outran the kill)."""
    child = spawn(code)
    deadline = time.monotonic() + timeout
    buf = ""
    fd = child.stdout.fileno()
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"child never printed {marker!r} within {timeout} s"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536).decode()
            if not chunk:  # the child ended without printing the marker
                child.wait(timeout)
                err = child.stderr.read()
                assert child.returncode == 0, f"child failed ({child.returncode}):\n{err}"
                return buf.splitlines()
            buf += chunk
            if marker in buf.splitlines():
                break
        while when is not None and not when() and child.poll() is None:
            assert time.monotonic() < deadline, "the kill condition never came true"
            time.sleep(0.0001)
        if delay:
            time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout)
        buf += child.stdout.read()
        err = child.stderr.read()
        # Killed, or finished cleanly in the meantime; never an exception of its own.
        assert child.returncode in (-signal.SIGKILL, 0), f"child failed ({child.returncode}):\n{err}"
        return buf.splitlines()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()


PRELUDE = """
import os, sys, time
import numpy as np
from shardkit import eagle3, flat_tokens, saev, sdnb

def say(s):
    sys.stdout.write(s + "\\n")
    sys.stdout.flush()
"""


def child_code(body, **params):
    lines = [f"{k} = {v!r}" for k, v in params.items()]
    return PRELUDE + "\n".join(lines) + "\n" + textwrap.dedent(body)


# ---------------------------------------------------------------------------------------------
# saev: 47 examples of 2 layers x (CLS + 32) tokens x 256 floats (67.6 KB each, 3.2 MB in all)
# with labels, 3 examples per shard: 16 shards, the last one holding 2 (the short last shard
# resume must keep); written 2 examples per step (24 steps).

SAEV_MD = {
    "family": "clip", "ckpt": "kill-test", "layers": [-2, -1], "content_tokens_per_example": 32,
    "cls_token": True, "d_model": 256, "n_examples": 47, "max_tokens_per_shard": 2 * 33 * 3,
    "data": "gASV", "dataset": "kill", "protocol": "2.1",
}

SAEV_CHILD = """
N, B = MD["n_examples"], 2
def acts(a, b):
    e = np.arange(a, b, dtype=np.float32)[:, None, None, None]
    l = np.arange(2, dtype=np.float32)[None, :, None, None]
    t = np.arange(33, dtype=np.float32)[None, None, :, None]
    d = np.arange(256, dtype=np.float32)[None, None, None, :]
    return 1000 * e + 100 * l + t + d / 16
def labels(a, b):
    return ((np.arange(a, b)[:, None] * 7 + np.arange(32)[None, :]) % 5).astype(np.uint8)
w = saev.Writer(ROOT, MD, resume=RESUME, progress=False)
say(f"open {w.next_example}")
for step, a in enumerate(range(0, N, B)):
    b = min(a + B, N)
    if b <= w.next_example:
        continue
    say(f"step {step}")
    w.write(acts(max(a, w.next_example), b), labels(max(a, w.next_example), b))
say("close")
say("path " + w.close())
"""


def saev_code(root, resume):
    return child_code(SAEV_CHILD, ROOT=str(root), MD=SAEV_MD, RESUME=resume)


@pytest.fixture(scope="module")
def saev_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("saev-ref")
    out = run_to_end(saev_code(root, False))
    path = out[-1].removeprefix("path ")
    ref = snapshot(path)
    assert hidden(ref) == [], hidden(ref)
    # 16 shards, metadata.json, shards.json, labels.bin (and the checksums sidecar).
    assert len(data_files(ref)) == 16 + 3, sorted(ref)
    return os.path.basename(path), ref


def saev_state(d, ref):
    """What a kill left in the dataset directory `d`."""
    if not os.path.exists(os.path.join(d, "metadata.json")):
        # Nothing but the writer's own hidden files may exist before metadata.json.
        assert not os.path.isdir(d) or visible(snapshot(d)) == {}, sorted(snapshot(d))
        return "not started"
    try:
        saev.open(d)
    except IncompleteDatasetError as e:
        assert "examples are present" in str(e), str(e)
        assert saev.validate(d)["valid"] is False
        return "incomplete"
    got = snapshot(d)
    # A kill between shards.json (the commit record) and the marker's removal may leave the
    # marker or a lock behind; the visible files must be exact.
    assert visible(got) == ref, diff(visible(got), ref)
    return "complete"


def expect_state(state, printed, *, started, completes, incomplete):
    """The state a kill left agrees with how far the child got (`printed`): once the writer
    opened (`started`), the dataset exists; until the child reached the step that completes
    it (`completes`), it is `incomplete` and never served."""
    if any(line.startswith(started) for line in printed):
        assert state != "not started", f"the writer had opened ({printed[:1]}) but nothing is on disk"
    if completes not in printed:
        assert state in (incomplete, "not started"), f"killed after {printed[-1:]}, but the dataset is {state}"


# (marker of the first kill, delay after it, marker of a kill of the first resume or None)
SAEV_POINTS = [
    ("open 0", 0.0, None),        # right after the writer created the directory
    ("step 0", 0.0, None),        # the first batch, no shard full yet
    ("step 1", 0.002, "step 4"),  # the first shard being published
    ("step 5", 0.0, None),
    ("step 9", 0.001, "step 15"),
    ("step 16", 0.0005, "close"),
    ("step 23", 0.0, None),       # the short last shard
    ("close", 0.0, None),         # inside finish(): labels.bin, shards.json, the marker
    ("close", 0.003, "close"),
]


@pytest.mark.parametrize("first,delay,second", SAEV_POINTS)
def test_saev_writer_killed_then_resumed_is_exact(tmp_path, saev_reference, first, delay, second):
    name, ref = saev_reference
    d = str(tmp_path / name)
    printed = run_and_kill(saev_code(tmp_path, False), first, delay)
    state = saev_state(d, ref)
    expect_state(state, printed, started="open 0", completes="close", incomplete="incomplete")
    if second is not None:
        printed = run_and_kill(saev_code(tmp_path, True), second)
        expect_state(saev_state(d, ref), printed, started="open", completes="close", incomplete="incomplete")
    out = run_to_end(saev_code(tmp_path, True))
    assert out[-1] == "path " + d
    if state == "incomplete":
        resumed_at = int(out[0].split()[1])
        # A whole shard boundary, or the end (killed after the last shard, before shards.json).
        assert resumed_at % 3 == 0 or resumed_at == SAEV_MD["n_examples"], out[0]
    got = snapshot(d)
    assert got == ref, diff(got, ref)
    assert os.listdir(tmp_path) == [name]


# ---------------------------------------------------------------------------------------------
# EAGLE-3: 40 samples (seq 64, aux 3 x 64, 256 draft tokens, bf16; 58 KB each, 2.3 MB in all),
# format version 2, 3 samples per shard: 14 shards; one sample per step (40 steps), then the
# target embeddings.

E3_MANIFEST = {
    "target_model": "kill/test", "target_vocab_size": 5000, "draft_vocab_size": 256,
    "seq_length": 64, "dtype": "bf16", "num_samples": 40, "shard_size": 3,
    "aux_hidden_dim": 192, "aux_layer_ids": [1, 5, 9], "selected_token_ids": list(range(0, 5000, 19))[:256],
}

E3_CHILD = """
N, S, H3, V = 40, 64, 192, 256
def sample(i):
    rng = np.random.default_rng(i)
    probs = rng.random((S, V), dtype=np.float32) + 0.01
    return {
        "input_ids": rng.integers(0, 5000, S), "attention_mask": np.ones(S, dtype=np.int64),
        "loss_mask": (np.arange(S) % 3 != 0).astype(np.int64),
        "position_mask": (np.arange(S) % 3 != 0)[:, None],
        "aux_hidden_states": rng.standard_normal((S, H3), dtype=np.float32),
        "target_probs": probs / probs.sum(-1, keepdims=True),
    }
w = eagle3.Writer(ROOT, MANIFEST, resume=RESUME, format_version=2, progress=False)
say(f"open {w.next_sample}")
for i in range(w.next_sample, N):
    say(f"step {i}")
    w.add(sample(i))
say("embeddings")
w.write_target_embeddings(np.arange(5000 * 64, dtype=np.float32).reshape(5000, 64) / 7)
say("close")
say("path " + w.close())
"""


def e3_code(root, resume):
    return child_code(E3_CHILD, ROOT=str(root), MANIFEST=E3_MANIFEST, RESUME=resume)


@pytest.fixture(scope="module")
def e3_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3-ref") / "cache"
    run_to_end(e3_code(root, False))
    ref = snapshot(root)
    assert hidden(ref) == [], hidden(ref)
    # manifest.json, target_embeddings, 14 shards (and the checksums sidecar).
    assert len(data_files(ref)) == 14 + 2, sorted(ref)
    return ref


def e3_state(d, ref):
    if not os.path.exists(os.path.join(d, "manifest.json")):
        assert not os.path.isdir(d) or visible(snapshot(d)) == {}, sorted(snapshot(d))
        return "not started"
    # The manifest is whole JSON and every file named like a shard is a valid shard: the only
    # errors concern the missing shards.
    v = eagle3.validate(d)
    try:
        eagle3.open(d)
    except IncompleteDatasetError as e:
        assert re.search(r"samples? \d+( to \d+)? (is|are) missing", str(e)), str(e)
        assert v["errors"] and all("missing" in e["message"] or "shard set" in e["message"] for e in v["errors"]), v["errors"]
        return "incomplete"
    assert v["errors"] == [], v["errors"]
    got = visible(snapshot(d))
    # Complete from the last shard on: the embeddings and the checksums sidecar (written by
    # close()) may still be to come, as in eagle3_kill.rs; whatever is there is exact.
    late = {k for k in ref if k == "target_embeddings.safetensors" or is_sidecar(k)}
    expected = {k: b for k, b in ref.items() if k not in late or k in got}
    assert got == expected, diff(got, expected)
    return "complete" if got == ref else "samples complete"


E3_POINTS = [
    ("open 0", 0.0, None),
    ("step 0", 0.0, None),
    ("step 2", 0.001, "step 10"),  # the first shard being published
    ("step 17", 0.0005, "step 30"),
    ("step 35", 0.002, None),
    ("step 39", 0.0, "embeddings"),  # the short last shard
    ("embeddings", 0.0, None),
    ("close", 0.0, "close"),
]


@pytest.mark.parametrize("first,delay,second", E3_POINTS)
def test_eagle3_writer_killed_then_resumed_is_exact(tmp_path, e3_reference, first, delay, second):
    ref = e3_reference
    d = str(tmp_path / "cache")
    printed = run_and_kill(e3_code(d, False), first, delay)
    state = e3_state(d, ref)
    # The last shard is published by the last add(): complete from there on.
    expect_state(state, printed, started="open 0", completes="embeddings", incomplete="incomplete")
    if "close" not in printed:
        assert state != "complete", state
    if second is not None:
        printed = run_and_kill(e3_code(d, True), second)
        expect_state(e3_state(d, ref), printed, started="open", completes="embeddings", incomplete="incomplete")
    out = run_to_end(e3_code(d, True))
    resumed_at = int(out[0].split()[1])
    assert resumed_at % 3 == 0 or resumed_at == 40, out[0]
    got = snapshot(d)
    assert got == ref, diff(got, ref)


# ---------------------------------------------------------------------------------------------
# flat-tokens: 2,000 ragged sequences (empty ones included; about 400 K tokens, 1.6 MB) appended
# 50 per step (40 steps), a commit every 20,000 tokens and a flush() every 4 steps; small
# shards/chunks so that the dataset has several files per array.

TOKENS_CHILD = """
def corpus():
    rng = np.random.default_rng(0x5eed)
    out = []
    for i in range(2000):
        n = 0 if i % 50 == 7 else int(rng.integers(1, 400))
        out.append(rng.integers(1, 50000, n))
    return out
SEQS, STEP = corpus(), 50
kw = {} if LAYOUT == "v2" else dict(tokens_per_shard=1 << 16, tokens_per_chunk=1 << 11)
w = flat_tokens.Writer(ROOT, "train", LAYOUT, resume=RESUME, checkpoint_tokens=20000, progress=False, **kw)
start = w.resumed_from or 0
say(f"open {start}")
for step, a in enumerate(range(0, len(SEQS), STEP)):
    b = a + STEP
    if b <= start:
        continue
    say(f"step {step}")
    w.append(SEQS[max(a, start):b])
    if step % 4 == 3:
        w.flush()
say("close")
print("counts", w.close())
"""


def tokens_code(root, layout, resume):
    return child_code(TOKENS_CHILD, ROOT=str(root), LAYOUT=layout, RESUME=resume)


@pytest.fixture(scope="module")
def tokens_reference(tmp_path_factory):
    refs = {}
    for layout in ("v2", "v3"):
        root = tmp_path_factory.mktemp(f"tokens-ref-{layout}") / "ds.zarr"
        run_to_end(tokens_code(root, layout, False))
        ref = snapshot(root)
        assert hidden(ref) == [], hidden(ref)
        if layout == "v3":  # several shards (v2 has one 4 Mi-token chunk per array)
            shards = [k for k in ref if k.startswith(os.path.join("train", "encoded_tokens", "c"))]
            assert len(shards) >= 6, f"expected several shard files, got {sorted(ref)}"
        refs[layout] = ref
    return refs


def tokens_state(d, ref):
    try:
        split = flat_tokens.open(d)["train"]
    except IncompleteDatasetError as e:
        assert "interrupted" in str(e) or "not finished" in str(e) or "write" in str(e), str(e)
        return "interrupted"
    except (FileNotFoundError, ValueError, KeyError) as e:
        # Killed before the split existed: nothing of it may be readable.
        exists = os.path.exists(os.path.join(d, "train", ".zgroup")) or os.path.exists(
            os.path.join(d, "train", "zarr.json"))
        assert not exists, f"neither interrupted nor complete: {e!r}"
        return "not started"
    assert len(split) == 2000
    got = visible(snapshot(d))
    if got == data_files(ref) and got != ref:
        # Served as complete, the checksums sidecar not yet written (see the note above).
        return "complete without checksums"
    assert got == ref, diff(got, ref)
    return "complete"


# flat-tokens writes its sidecar right after its commit (write_completed: true rewrites the group
# attributes the sidecar covers): a kill in that instant leaves a complete dataset without one,
# which a resumed run (or `shardkit tokens checksum`) adds. A stale sidecar is never left: the
# first change of a write removes it.


def root_marked_complete(d):
    """True once the dataset's root metadata says write_completed: true (finish() has committed
    and is writing the checksums sidecar)."""
    def check():
        for name in ("zarr.json", ".zattrs"):
            try:
                with open(os.path.join(d, name), "rb") as f:
                    if b'"write_completed": true' in f.read():
                        return True
            except OSError:
                pass
        return False
    return check


TOKENS_POINTS = [
    ("v3", "open 0", 0.0, None),
    ("v3", "step 0", 0.0, None),
    ("v3", "step 3", 0.001, "step 20"),  # inside the first flush()
    ("v3", "step 30", 0.0, "close"),
    ("v3", "step 39", 0.0, None),
    ("v3", "close", 0.0, "close"),       # inside the final commit
    ("v2", "step 0", 0.0, None),
    ("v2", "step 7", 0.001, "step 30"),
    ("v2", "close", 0.0005, None),
    ("v3", "close", "marked", None),    # right after finish() marked the dataset complete
    ("v2", "close", "marked", None),
]


@pytest.mark.parametrize("layout,first,delay,second", TOKENS_POINTS)
def test_flat_tokens_writer_killed_then_resumed_is_exact(tmp_path, tokens_reference, layout, first, delay,
                                                         second):
    ref = tokens_reference[layout]
    d = str(tmp_path / "ds.zarr")
    if delay == "marked":
        printed = run_and_kill(tokens_code(d, layout, False), first, when=root_marked_complete(d))
    else:
        printed = run_and_kill(tokens_code(d, layout, False), first, delay)
    state = tokens_state(d, ref)
    expect_state(state, printed, started="open 0", completes="close", incomplete="interrupted")
    if second is not None:
        printed = run_and_kill(tokens_code(d, layout, True), second)
        expect_state(tokens_state(d, ref), printed, started="open", completes="close", incomplete="interrupted")
    out = run_to_end(tokens_code(d, layout, True))
    resumed_at = int(out[0].split()[1])
    assert 0 <= resumed_at <= 2000
    got = snapshot(d)
    assert got == ref, diff(got, ref)
    # "complete without checksums" is the documented outcome of a kill between the commit and
    # the sidecar (README, Guarantees); the resumed run above restored the sidecar.


# ---------------------------------------------------------------------------------------------
# sdnb.save: 2 tensors of 1.5 MB (appended blobs), 40 of 16 KB and 20 small ones (inline), about
# 3.9 MB; a single SDNB file, a shard set of 1 MiB shards, and an SDZ archive. Killed at
# fractions of the time an uninterrupted save takes, measured in the same way.

SDNB_CHILD = """
tensors = {}
for i in range(2):
    tensors[f"big.{i}"] = (np.arange(384 * 1024, dtype=np.float32) * (i + 1)).reshape(384, 1024)
for i in range(40):
    tensors[f"layer{i}.w"] = np.full((64, 64), i, dtype=np.float32) + np.arange(64, dtype=np.float32)
for i in range(20):
    tensors[f"layer{i}.b"] = np.arange(32, dtype=np.float16) * i
say("go")
t0 = time.perf_counter()
files = sdnb.save(TARGET, tensors, {"creation.time": "1700000000000", "model.name": "kill"},
                  format=FORMAT, shard_size=SHARD_SIZE, progress=False)
say(f"saved {time.perf_counter() - t0:.6f} {len(files)}")
"""

SDNB_CASES = {
    "sdnb": ("model.sdnb", "sdnb", None),
    "sharded": ("model.sdnb", "sharded", 1 << 20),
    "sdz": ("model.sdz", "sdz", None),
}
# Kill points: a fraction of the uninterrupted save's duration after the child starts saving;
# ("tmp", fraction): that long after a temporary first appears in the directory; "published":
# as soon as the (first) container file is replaced, while the checksums sidecar is written.
FRACTIONS = [0.0, ("tmp", 0.0), 0.1, ("tmp", 0.3), 0.4, 0.9, "published", 1.5]

STALE_SIDECAR = (
    "an overwritten container beside the old container's checksums (shardkit.verify would call "
    "intact data damaged): write_model must remove the old sidecar before publishing")


def sdnb_code(d, case):
    name, fmt, shard = SDNB_CASES[case]
    return child_code(SDNB_CHILD, TARGET=os.path.join(str(d), name), FORMAT=fmt, SHARD_SIZE=shard)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("case", list(SDNB_CASES))
def test_sdnb_save_killed_leaves_the_old_state_or_the_whole_container(tmp_path, case, overwrite):
    """A kill leaves the target absent (a new save) or holding the old container's bytes (an
    overwrite), or else the whole new container; saving again gives the new bytes."""
    name, fmt, shard_size = SDNB_CASES[case]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    times = []
    for _ in range(2):  # the second run warms the page cache; take the faster
        out = run_to_end(sdnb_code(ref_dir, case))
        times.append(float(out[-1].split()[1]))
    n_files = int(out[-1].split()[2])
    ref = snapshot(ref_dir)
    assert hidden(ref) == [], hidden(ref)
    assert len(data_files(ref)) == n_files and (n_files >= 4 if case == "sharded" else n_files == 1), sorted(ref)
    with sdnb.open(ref_dir / name) as m:
        assert m.kind == fmt and len(m) == 62
    full = min(times)
    # The container an overwrite replaces: the same names, shapes and layout, other values.
    tensors, metadata = sdnb_tensors()
    old_tensors = {k: v + 1 for k, v in tensors.items()}
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    sdnb.save(old_dir / name, old_tensors, metadata, format=fmt, shard_size=shard_size, progress=False)
    old = snapshot(old_dir)
    assert sorted(old) == sorted(ref) and old != ref

    first = sorted(data_files(ref))[0]  # model.sdnb, model.sdz, or model.shard0-of-N.sdnb

    def replaced(path):
        ino = os.stat(path).st_ino if os.path.exists(path) else None

        def check():
            try:
                return os.stat(path).st_ino != ino
            except FileNotFoundError:
                return False
        return check

    outcomes, stale = {}, []
    for i, frac in enumerate(FRACTIONS):
        d = tmp_path / f"t{i}"
        d.mkdir()
        if overwrite:
            sdnb.save(d / name, old_tensors, metadata, format=fmt, shard_size=shard_size, progress=False)
        if frac == "published":
            run_and_kill(sdnb_code(d, case), "go", when=replaced(d / first))
        elif isinstance(frac, tuple):
            run_and_kill(sdnb_code(d, case), "go", frac[1] * full,
                         when=lambda d=d: any(n.endswith(".tmp") for n in os.listdir(d)))
        else:
            run_and_kill(sdnb_code(d, case), "go", frac * full)
        got = snapshot(d)
        data = data_files(visible(got))
        if any(k.endswith(".shard-set.pending") for k in got):
            # A shard set's save was committed (its journal written) and the kill came during
            # the renames: each file is the old one or the new one, and sdnb.open serves the
            # whole new set.
            assert case == "sharded", f"{case} at {frac}: {sorted(got)}"
            assert all(data[k] in (old.get(k) if overwrite else None, ref.get(k)) for k in data), f"{case} at {frac}"
            assert_model(d / name, tensors)
            state = "committed, renames pending"
            expected = None
        elif data == data_files(old if overwrite else {}):
            state = "untouched"  # at most a temporary and the lock file were left
            if overwrite:
                with sdnb.open(d / name) as m:
                    np.testing.assert_array_equal(m["big.0"], old_tensors["big.0"])
            else:
                with pytest.raises(shardkit.NotFoundError, match="no such file"):
                    sdnb.open(d / name)
            expected = old if overwrite else {}
        elif data == data_files(ref):
            with sdnb.open(d / name) as m:
                assert m.kind == fmt
            state = "complete"
            expected = ref
        else:
            raise AssertionError(f"{case} at {frac}: neither the old nor the new container: {diff(data, ref)}")
        # The checksums sidecar is written after the container is published: it may be missing
        # after a kill, but never describe a container other than the one present.
        sidecar = {k: v for k, v in visible(got).items() if is_sidecar(k)}
        if expected is not None and not all(expected.get(k) == v for k, v in sidecar.items()):
            assert overwrite and state == "complete" and all(old.get(k) == v for k, v in sidecar.items()), (
                f"{case} at {frac}: the checksums sidecar matches neither container")
            assert shardkit.verify(d / first)["intact"] is False
            stale.append(frac)
        if hidden(got):
            state += " with leftovers"
        outcomes[state] = outcomes.get(state, 0) + 1
        # Saving again succeeds, gives the same bytes and removes what the kill left.
        sdnb.save(d / name, tensors, metadata, format=fmt, shard_size=shard_size, progress=False)
        got = snapshot(d)
        assert got == ref, f"{case} at {frac}: {diff(got, ref)}"
    # Some kill landed inside the save (a temporary left, the target not replaced yet).
    assert outcomes.get("untouched with leftovers", 0) >= 1, outcomes
    assert not stale, f"{STALE_SIDECAR} (killed at {stale})"


def assert_model(path, tensors):
    """`path` opens as exactly `tensors`."""
    with sdnb.open(path) as m:
        assert sorted(m) == sorted(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(m[k], v, err_msg=k)


def test_sdnb_shard_set_overwrite_killed_at_every_rename(tmp_path):
    """A shard-set overwrite renames N temporaries (a kill between two renames is too narrow a
    window to hit by timing, so the child aborts itself after its K-th rename through the
    SHARDKIT_TEST_ABORT_AFTER_RENAMES hook). Its journal is the commit point: killed after any
    rename, the set opens as the whole new model, never a mix; the next save finishes the
    publication and gives the uninterrupted bytes."""
    tensors, metadata = sdnb_tensors()
    old_tensors = {k: v + 1 for k, v in tensors.items()}
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    names = [os.path.basename(p) for p in sdnb.save(ref_dir / "model.sdnb", tensors, metadata, shard_size=1 << 20,
                                                    progress=False)]
    ref = snapshot(ref_dir)
    assert len(names) >= 4
    # Renames: the journal, the N shards, then the checksums sidecar.
    for k in range(1, len(names) + 3):
        d = tmp_path / f"k{k}"
        d.mkdir()
        sdnb.save(d / "model.sdnb", old_tensors, metadata, shard_size=1 << 20, progress=False)
        old = snapshot(d)
        env = dict(os.environ, SHARDKIT_TEST_ABORT_AFTER_RENAMES=str(k))
        p = subprocess.run([sys.executable, "-c", sdnb_code(d, "sharded")], env=env, capture_output=True, text=True,
                           timeout=60)
        got = snapshot(d)
        assert p.returncode == -signal.SIGABRT, f"k={k}: the child was not stopped ({p.returncode}): {p.stderr}"
        assert any(n.endswith(".shard-set.pending") for n in got) == (k <= len(names) + 1), (k, sorted(got))
        assert all(got[n] in (old[n], ref[n]) for n in names if n in got), k
        assert_model(d / "model.sdnb", tensors)
        report = shardkit.verify(d / names[0])
        assert report["intact"] or not report["sidecar"], (k, report)
        sdnb.save(d / "model.sdnb", tensors, metadata, shard_size=1 << 20, progress=False)
        assert snapshot(d) == ref, f"k={k}: {diff(snapshot(d), ref)}"


def test_sdnb_shard_set_journal_hides_the_old_set(tmp_path):
    """A committed overwrite to a set with another shard count: the old set's files that no new
    shard replaces are not part of the model while the renames are pending."""
    tensors, metadata = sdnb_tensors()
    small = {k: v for k, v in tensors.items() if not k.startswith("big")}
    d = tmp_path / "d"
    d.mkdir()
    old_names = [os.path.basename(p) for p in sdnb.save(d / "model.sdnb", tensors, metadata, shard_size=1 << 20,
                                                        progress=False)]
    code = child_code(SDNB_CHILD.replace("range(2)", "range(0)"), TARGET=str(d / "model.sdnb"), FORMAT="sharded",
                      SHARD_SIZE=1 << 20)
    env = dict(os.environ, SHARDKIT_TEST_ABORT_AFTER_RENAMES="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGABRT, p.stderr
    assert set(old_names) <= set(os.listdir(d))
    assert_model(d / "model.sdnb", small)
    assert shardkit.verify(d / old_names[0])["sidecar"] is False  # the old sidecar went first
    new_names = [os.path.basename(p) for p in sdnb.save(d / "model.sdnb", small, metadata, shard_size=1 << 20,
                                                        progress=False)]
    assert len(new_names) < len(old_names)
    assert sorted(os.listdir(d)) == sorted(new_names + ["model.shard-set.checksums.json"]), os.listdir(d)
    assert_model(d / "model.sdnb", small)


def sdnb_tensors():
    """The child's tensors and metadata, in this process (the same code)."""
    ns = {"np": np, "say": lambda s: None, "time": time, "sdnb": None}
    src = SDNB_CHILD.split('say("go")')[0]
    exec(src, ns)  # noqa: S102 - our own code, shared with the child
    return ns["tensors"], {"creation.time": "1700000000000", "model.name": "kill"}
