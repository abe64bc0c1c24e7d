"""Reading a saev dataset while writer processes record it (``saev.Loader(follow=True)``): the
epoch read during the write serves every row exactly once and never a torn row, a state saved
part way resumes exactly in a fresh process, and the epochs after the commit are a finished
dataset's."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shardkit import IncompleteDatasetError, saev
from shardkit.errors import InvalidArgumentError

TIMEOUT = 60
N, PER_SHARD, SHARDS = 30, 3, 10  # 2 layers x (CLS + 4 tokens) per example, 30 tokens a shard
L, T, D = 2, 5, 8

METADATA = {
    "family": "clip", "ckpt": "follow", "layers": [6, 11], "content_tokens_per_example": T - 1,
    "cls_token": True, "d_model": D, "n_examples": N, "max_tokens_per_shard": PER_SHARD * L * T,
    "data": "follow", "dataset": "follow", "protocol": "2.1",
}

# One rank of a write: prints the dataset's path, then writes a shard every `pause` seconds.
WRITER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from shardkit import saev
    md, rank, world, pause = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    L, T, D = 2, 5, 8
    def acts(first, end):
        e = np.arange(first, end, dtype=np.float32)[:, None, None, None]
        return e * 1000 + np.arange(L * T * D, dtype=np.float32).reshape(1, L, T, D)
    with saev.PartWriter(sys.argv[5], md, rank=rank, world_size=world, progress=False) as w:
        print(w.path, flush=True)
        for first, end in w.pending:
            for at in range(first, end, 3):
                time.sleep(pause)
                w.write(acts(at, min(at + 3, end)))
    print(json.dumps(w.close()), flush=True)
""")

# A fresh process resuming each state of a JSON list and printing the batches of the rest.
RESUME = textwrap.dedent("""
    import json, sys
    from shardkit import saev
    out = []
    for st in json.loads(open(sys.argv[2]).read()):
        l = saev.Loader(sys.argv[1], layer=6, batch_size=7, seed=3, memory_budget=4096, follow=True)
        l.load_state_dict(st)
        out.append([[b["example_idx"].tolist(), b["token_idx"].tolist(), b["act"].tolist()] for b in l])
    print(json.dumps(out))
""")


def expected(e, c):
    """Layer 6 (slot 0), content token c (slot c + 1) of example e, as written."""
    return e * 1000 + (c + 1) * D + np.arange(D, dtype=np.float32)


def start_writers(root, world, pause, ranks=None):
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(METADATA), str(r), str(world), str(pause), str(root)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (range(world) if ranks is None else ranks)
    ]
    path = procs[0].stdout.readline().strip()
    assert path, procs[0].stderr.read()
    return procs, path


def finish(procs):
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err
    return out


def n_rounds(flat):
    i = n = 0
    while i < len(flat):
        i, n = i + 1 + 2 * flat[i], n + 1
    return n


def rows(batch):
    return [batch["example_idx"].tolist(), batch["token_idx"].tolist(), batch["act"].tolist()]


def loader(path, **kw):
    return saev.Loader(path, layer=6, batch_size=7, seed=3, memory_budget=4096, **kw)


def test_a_follow_loader_reading_two_writer_processes_serves_each_row_once_and_resumes_exactly(tmp_path):
    procs, path = start_writers(tmp_path, 2, 0.03)
    follow = loader(path, follow=True, follow_timeout=TIMEOUT)
    seen, states = [], []
    for b in follow:
        # No torn row: every row is exactly what was written.
        for e, c, a in zip(b["example_idx"], b["token_idx"], b["act"]):
            np.testing.assert_array_equal(a, expected(int(e), int(c)))
        seen.append(rows(b))
        states.append(follow.state_dict())
    finish(procs)
    status = saev.status(path)  # the rank finishing last commits
    assert status["committed"], status
    served = sorted((e, c) for ex, tok, _ in seen for e, c in zip(ex, tok))
    assert served == [(e, c) for e in range(N) for c in range(T - 1)]
    final = states[-1]
    assert final["cursor"] == N * (T - 1)
    assert n_rounds(final["follow_rounds"]) > 1, f"the write was read in one round: {final}"

    # Fresh processes resume: a state taken in the last round continues batch for batch; one taken
    # in the first round continues its round exactly, then serves every row left once.
    last_round_start = max(i for i, st in enumerate(states) if st["follow_rounds"] != final["follow_rounds"]) + 1
    first_round_end = next(i for i, st in enumerate(states) if st["follow_rounds"] != states[0]["follow_rounds"])
    picks = [states[last_round_start], states[0]]
    state_file = tmp_path / "states.json"
    state_file.write_text(json.dumps(picks))
    out = subprocess.run([sys.executable, "-c", RESUME, path, str(state_file)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    late, early = json.loads(out.stdout)
    assert late == seen[last_round_start + 1:]
    assert early[:first_round_end - 1] == seen[1:first_round_end]
    resumed = sorted((e, c) for ex, tok, _ in seen[:1] + early for e, c in zip(ex, tok))
    assert resumed == served

    # Committed: the next epoch is a finished dataset's, batch for batch.
    follow.set_epoch(1)
    plain = loader(path, epoch=1)
    assert [rows(b) for b in follow] == [rows(b) for b in plain]


def test_a_follow_loader_names_the_missing_shards_when_they_do_not_come(tmp_path):
    # Rank 0 of 2 writes its part and exits; rank 1 never starts.
    procs, path = start_writers(tmp_path, 2, 0.0, ranks=[0])
    finish(procs)
    follow = loader(path, follow=True, follow_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(IncompleteDatasetError, match=r"shards 5\.\.10 \(claimed by no live writer\)"):
        for _ in follow:
            pass
    assert time.monotonic() - t0 < 10
    with pytest.raises(IncompleteDatasetError, match="shards.json is missing"):
        loader(path)
    with pytest.raises(InvalidArgumentError, match=r"world_size 2 only when the ranks agree on its rounds"):
        loader(path, follow=True, rank=0, world_size=2)
    with pytest.raises(InvalidArgumentError, match="follow_timeout applies with follow=True only"):
        loader(path, follow_timeout=3)


def test_ctrl_c_interrupts_a_follow_loader_waiting_for_shards(tmp_path):
    procs, path = start_writers(tmp_path, 2, 0.0, ranks=[0])
    finish(procs)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from shardkit import saev
            l = saev.Loader(sys.argv[1], layer=6, batch_size=7, memory_budget=4096, follow=True)
            print("reading", flush=True)
            for _ in l:
                pass
        """), path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "reading"
    time.sleep(1.0)  # past rank 0's shards: waiting for rank 1's (an hour by default)
    reader.send_signal(signal.SIGINT)
    _, err = reader.communicate(timeout=20)
    assert reader.returncode != 0 and "KeyboardInterrupt" in err, err


def test_the_torch_dataset_passes_follow_through(tmp_path):
    torch = pytest.importorskip("torch")
    from shardkit.torch import SaevDataset

    procs, path = start_writers(tmp_path, 2, 0.02)
    ds = SaevDataset(path, layer=6, batch_size=7, seed=3, memory_budget=4096, follow=True, follow_timeout=TIMEOUT)
    served = []
    for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0):
        served += zip(b["example_idx"].tolist(), b["token_idx"].tolist())
    finish(procs)
    assert sorted(served) == [(e, c) for e in range(N) for c in range(T - 1)]
    assert n_rounds(ds.state_dict()["follow_rounds"]) > 1
