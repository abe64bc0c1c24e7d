"""One writer per dataset, from Python too: a second writer raises BlockingIOError naming the
path and the holder's pid, without touching anything; a writer killed with SIGKILL leaves no
lock behind, so the job restarted after it resumes at once."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev, sdnb

from _procs import snapshot

SAEV_MD = {
    "family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 4,
    "cls_token": False, "d_model": 8, "n_examples": 10, "max_tokens_per_shard": 8,
    "data": "gASV", "dataset": "t", "protocol": "2.1",
}



def test_a_killed_writer_leaves_no_lock(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time, numpy as np
            from shardkit import saev
            w = saev.Writer({str(tmp_path)!r}, {SAEV_MD!r}, progress=False)
            w.write(np.ones((2, 1, 4, 8), dtype=np.float32))
            print(w.path, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        path = child.stdout.readline().strip()
        assert path, "the child writer did not start"
        before = snapshot(path)
        with pytest.raises(shardkit.LockedError) as e:
            saev.Writer(tmp_path, SAEV_MD, resume=True, progress=False)
        assert path in str(e.value) and f"pid {child.pid}" in str(e.value)
        assert snapshot(path) == before
        # Readers are not blocked while it writes.
        assert saev.validate(path)["valid"] is False
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with saev.Writer(tmp_path, SAEV_MD, resume=True, progress=False) as w:
        w.write(np.ones((10 - w.next_example, 1, 4, 8), dtype=np.float32))
    assert saev.validate(w.path)["valid"]


def test_second_writers_in_one_process_are_refused(tmp_path):
    me = f"pid {os.getpid()}"
    with saev.Writer(tmp_path / "s", SAEV_MD, progress=False) as w:
        with pytest.raises(shardkit.LockedError, match=me):
            saev.Writer(tmp_path / "s", SAEV_MD, resume=True, progress=False)
        w.write(np.zeros((10, 1, 4, 8), dtype=np.float32))

    m = {"target_model": "t", "target_vocab_size": 100, "draft_vocab_size": 4, "seq_length": 2,
         "dtype": "bf16", "num_samples": 2, "shard_size": 2, "aux_hidden_dim": 3,
         "aux_layer_ids": [1, 2, 3], "selected_token_ids": [0, 1, 2, 3]}
    first = eagle3.Writer(tmp_path / "e", m)
    with pytest.raises(shardkit.LockedError, match=me):
        eagle3.Writer(tmp_path / "e", m, resume=True)
    first.abort()
    del first

    with flat_tokens.Writer(tmp_path / "t.zarr", "train", progress=False) as t:
        t.append([[1, 2, 3]])
        with pytest.raises(shardkit.LockedError, match=me):
            flat_tokens.Writer(tmp_path / "t.zarr", "validation", progress=False)

    target = str(tmp_path / "m.sdnb")
    seen = []

    def progress(done, total):
        if not seen:
            with pytest.raises(shardkit.LockedError, match=me) as e:
                sdnb.save(target, {"w": np.ones((4, 4), dtype=np.float32)})
            seen.append(str(e.value))

    sdnb.save(target, {"w": np.zeros((64, 64), dtype=np.float32)}, progress=progress)
    assert seen and "m.sdnb" in seen[0]
    np.testing.assert_array_equal(sdnb.open(target)["w"], np.zeros((64, 64), dtype=np.float32))
