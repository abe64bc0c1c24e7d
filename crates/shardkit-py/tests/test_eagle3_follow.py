"""Reading an EAGLE-3 cache while writer processes write it (``eagle3.Loader(follow=True)``):
the epoch read during the write serves every sample exactly once and whole, a state saved part
way resumes exactly in a fresh process, and the epochs after the commit are a plain loader's.
(The shared semantics are saev's: test_follow.py.)"""

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from shardkit import IncompleteDatasetError, eagle3
from shardkit.errors import InvalidArgumentError

TIMEOUT = 60
N, S, V, H = 14, 4, 8, 2  # 3 samples a shard: 5 shards

CONFIG = {"target_model": "demo", "target_vocab_size": V, "draft_vocab_size": V, "seq_length": S,
          "dtype": "fp32", "shard_size": 3, "aux_hidden_dim": 3 * H, "aux_layer_ids": [1, 2, 3],
          "selected_token_ids": list(range(V)), "input_data": "demo", "split": None, "shuffle_seed": 7}

# One rank: prints "open" once its part is set up, then adds a shard every `pause` seconds.
WRITER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from shardkit import eagle3
    config, N, rank, world, pause = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    S, V, H = 4, 8, 2
    def batch(first, end):
        i = np.arange(first, end)[:, None]
        t = np.arange(S)[None, :]
        probs = np.zeros((end - first, S, V), dtype=np.float32)
        np.put_along_axis(probs, ((i + t) % V)[..., None], 1.0, axis=-1)
        return {
            "input_ids": ((i * 7 + t) % V).astype(np.int64),
            "attention_mask": np.ones((end - first, S), dtype=np.int64),
            "loss_mask": np.ones((end - first, S), dtype=np.int64),
            "aux_hidden_states": (i[..., None] * 100 + t[..., None] * 10 + np.arange(3 * H)).astype(np.float32),
            "position_mask": np.ones((end - first, S, 1), dtype=bool),
            "target_probs": probs,
        }
    w = eagle3.PartWriter(sys.argv[6], config, N, rank=rank, world_size=world)
    print("open", flush=True)
    for first, end in w.pending:
        for at in range(first, end, 3):
            time.sleep(pause)
            w.add_batch(batch(at, min(at + 3, end)))
    print(json.dumps(w.close()["committed"]), flush=True)
""")

# A fresh process resuming each state of a JSON list and printing the samples of each batch of
# the rest.
RESUME = textwrap.dedent("""
    import json, sys
    from shardkit import eagle3
    out = []
    for st in json.loads(open(sys.argv[2]).read()):
        l = eagle3.Loader(sys.argv[1], batch_size=4, seed=3, follow=True)
        l.load_state_dict(st)
        out.append([(b["aux_hidden_states"][:, 0, 0] // 100).astype(int).tolist() for b in l])
    print(json.dumps(out))
""")


def start_writers(path, world, pause, ranks=None):
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(CONFIG), str(N), str(r), str(world), str(pause),
                          str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (range(world) if ranks is None else ranks)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "open", p.stderr.read()
    return procs


def finish(procs):
    for p in procs:
        _, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err


def samples(b):
    """The sample of each row, after checking every field is what was written (none torn)."""
    idx = (b["aux_hidden_states"][:, 0, 0] // 100).astype(int)
    i, t = idx[:, None], np.arange(S)[None, :]
    np.testing.assert_array_equal(b["input_ids"], (i * 7 + t) % V)
    np.testing.assert_array_equal(
        b["aux_hidden_states"], (i[..., None] * 100 + t[..., None] * 10 + np.arange(3 * H)).astype(np.float32))
    np.testing.assert_array_equal(b["target_probs"].argmax(-1), (i + t) % V)
    return idx.tolist()


def n_rounds(flat):
    i = n = 0
    while i < len(flat):
        i, n = i + 1 + 2 * flat[i], n + 1
    return n


def loader(path, **kw):
    return eagle3.Loader(path, batch_size=4, seed=3, **kw)


def test_a_follow_loader_reading_writer_processes_serves_each_sample_once_and_resumes_exactly(tmp_path):
    path = tmp_path / "cache"
    procs = start_writers(path, 2, 0.05)
    follow = loader(path, follow=True, follow_timeout=TIMEOUT)
    seen, states = [], []
    for b in follow:
        seen.append(samples(b))
        states.append(follow.state_dict())
    finish(procs)
    assert eagle3.status(path)["committed"]
    assert sorted(i for b in seen for i in b) == list(range(N))
    assert n_rounds(states[-1]["follow_rounds"]) > 1, f"the write was read in one round: {states[-1]}"

    # Fresh processes resume: a state taken in the last round continues batch for batch; one
    # taken in the first round continues its round exactly (later rounds are formed from what is
    # durable then), then serves every sample left once.
    final = states[-1]["follow_rounds"]
    last_round_start = max(i for i, st in enumerate(states) if st["follow_rounds"] != final) + 1
    first_round_end = next(i for i, st in enumerate(states) if st["follow_rounds"] != states[0]["follow_rounds"])
    state_file = tmp_path / "states.json"
    state_file.write_text(json.dumps([states[last_round_start], states[0]]))
    out = subprocess.run([sys.executable, "-c", RESUME, str(path), str(state_file)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    late, early = json.loads(out.stdout)
    assert late == seen[last_round_start + 1:]
    assert early[:first_round_end - 1] == seen[1:first_round_end]
    assert sorted(i for b in seen[:1] + early for i in b) == list(range(N))

    # Committed: the next epoch is a plain loader's, batch for batch.
    follow.set_epoch(1)
    plain = loader(path, epoch=1)
    assert [samples(b) for b in follow] == [samples(b) for b in plain]


def test_a_follow_loader_names_the_missing_shards_and_refuses_world_size_two(tmp_path):
    path = tmp_path / "cache"
    finish(start_writers(path, 2, 0.0, ranks=[0]))  # rank 1 (shards 3..5) never starts
    follow = loader(path, follow=True, follow_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(IncompleteDatasetError, match=r"shards 3\.\.5 \(claimed by no live writer\)"):
        for b in follow:
            samples(b)
    assert time.monotonic() - t0 < 10
    with pytest.raises(InvalidArgumentError, match=r"world_size 2 only when the ranks agree on its rounds"):
        loader(path, follow=True, rank=0, world_size=2)
    with pytest.raises(InvalidArgumentError, match="follow_timeout applies with follow=True only"):
        loader(path, follow_timeout=3)


def test_the_torch_dataset_passes_follow_through(tmp_path):
    torch = pytest.importorskip("torch")
    from shardkit.torch import Eagle3Dataset

    path = tmp_path / "cache"
    procs = start_writers(path, 2, 0.05)
    ds = Eagle3Dataset(path, batch_size=4, seed=3, follow=True, follow_timeout=TIMEOUT)
    served = []
    for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0):
        served += (b["aux_hidden_states"][:, 0, 0] // 100).long().tolist()
    finish(procs)
    assert sorted(served) == list(range(N))
    assert n_rounds(ds.state_dict()["follow_rounds"]) > 1
