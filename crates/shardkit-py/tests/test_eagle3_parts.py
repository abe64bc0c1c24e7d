"""One EAGLE-3 cache written by many processes (``eagle3.PartWriter``), as NeMo's distributed
producer gives each rank a contiguous, shard-aligned block: ranks run as plain processes, are
killed with SIGKILL at many points (before, during and after their part, and during the commit),
and the job is restarted with the same or another world size. Every finished cache must equal,
byte for byte, what one process writes with ``eagle3.Writer``.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit import IncompleteDatasetError, eagle3
from shardkit.errors import AlreadyExistsError, LockedError

from _cli import shardkit_cli
from _procs import child_env, run_child, snapshot

TIMEOUT = 120
N = 14  # samples: 3 per shard, 5 shards (the last one short); of 3 ranks, shards 0..2, 2..4, 4..5

# The run configuration and the samples: deterministic and valid (one-hot probabilities).
COMMON = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from shardkit import eagle3
    N, S, V, H = %d, 4, 8, 2
    CONFIG = {"target_model": "demo", "target_vocab_size": V, "draft_vocab_size": V, "seq_length": S,
              "dtype": "fp32", "num_samples": N, "shard_size": 3, "aux_hidden_dim": 3 * H,
              "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(V)), "input_data": "demo",
              "split": None, "shuffle_seed": 7}
    TABLE = np.arange(V * H, dtype=np.float32).reshape(V, H) / 3

    def batch(first, end):
        i = np.arange(first, end)[:, None]
        t = np.arange(S)[None, :]
        probs = np.zeros((end - first, S, V), dtype=np.float32)
        np.put_along_axis(probs, ((i + t) %% V)[..., None], 1.0, axis=-1)
        return {
            "input_ids": ((i * 7 + t) %% V).astype(np.int64),
            "attention_mask": np.ones((end - first, S), dtype=np.int64),
            "loss_mask": np.ones((end - first, S), dtype=np.int64),
            "aux_hidden_states": (i[..., None] * 100 + t[..., None] * 10 + np.arange(3 * H)).astype(np.float32),
            "position_mask": np.ones((end - first, S, 1), dtype=bool),
            "target_probs": probs,
        }
    """
    % N
)

# A rank: rank 0 writes the embedding table first (as NeMo's producer does), then every rank adds
# its pending samples two at a time, printing a line after each and sleeping a little so that a
# kill lands near that line.
RANK = COMMON + textwrap.dedent(
    """
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = eagle3.PartWriter(sys.argv[1], CONFIG, N, rank=rank, world_size=world, target_embeddings=True)
    if rank == 0:
        w.write_target_embeddings(TABLE)
    print("open", flush=True)
    time.sleep(0.03)
    for first, end in w.pending:
        for at in range(first, end, 2):
            e = min(at + 2, end)
            w.add_batch(batch(at, e))
            print("wrote", e, flush=True)
            time.sleep(0.03)
    print("written", flush=True)
    time.sleep(0.03)
    print("status", w.close()["committed"], flush=True)
    """
)

SINGLE = COMMON + textwrap.dedent(
    """
    with eagle3.Writer(sys.argv[1], CONFIG) as w:
        w.write_target_embeddings(TABLE)
        w.add_batch(batch(0, N))
    """
)




def start(path, r, world, **extra):
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(path), str(r), str(world)],
        env=child_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def rank(path, r, world, kill_at=None, **extra):
    """Runs rank `r` of `world`; with `kill_at` (a line prefix), SIGKILLs it once it printed that
    line. Returns (killed or aborted, output lines)."""
    return run_child([sys.executable, "-c", RANK, str(path), str(r), str(world)], kill_at, **extra)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The cache one process writes with eagle3.Writer."""
    path = tmp_path_factory.mktemp("single") / "cache"
    out = subprocess.run([sys.executable, "-c", SINGLE, str(path)], env=child_env(), capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    files = snapshot(path)
    assert sorted(files) == sorted([f"shard-{k:06d}.safetensors" for k in range(5)] + [
        "manifest.json", "shardkit.checksums.json", "target_embeddings.safetensors"])
    return files


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_running_at_once_write_what_one_process_writes(tmp_path, single, world):
    path = tmp_path / "cache"
    procs = [start(path, r, world) for r in reversed(range(world))]
    finals = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err
        finals.append(out.strip().splitlines()[-1])
    # Exactly one rank saw the cache committed by its own finish or found it so; all agree after.
    assert "status True" in finals, finals
    assert snapshot(path) == single
    assert eagle3.status(path) == {"committed": True, "units": 5, "done": 5, "missing": [], "claimed": []}
    assert len(eagle3.open(path)) == N


@pytest.mark.parametrize(
    "victim,kill_at,abort_after,restart_world",
    [
        (1, "open", None, 2),  # before its part
        (1, "wrote 8", None, 3),  # mid-part (samples 6..12 are rank 1's; shard 2 durable)
        (0, "wrote 2", None, 4),  # rank 0, its table written, mid-shard
        (0, "written", None, 2),  # its part durable, before finishing
        (2, "written", None, 1),  # the last rank, every shard durable, before the commit
        # The last rank (rank 2: shard 4, 2 renames: the shard, its record), then mid-commit:
        (2, None, 1, 2),  # its shard published, before the shard's record (written again)
        (2, None, 3, 3),  # after the checksums sidecar, before manifest.json
        (2, None, 4, 2),  # after manifest.json, before the parts' state is removed
    ],
)
def test_a_rank_killed_anywhere_then_a_restart_with_any_world_size_finishes_the_same_bytes(
    tmp_path, single, victim, kill_at, abort_after, restart_world
):
    path = tmp_path / "cache"
    for r in range(3):
        if r == victim:
            extra = {} if abort_after is None else {"SHARDKIT_TEST_ABORT_AFTER_RENAMES": abort_after}
            killed, lines = rank(path, r, 3, kill_at=kill_at, **extra)
            assert killed, lines
        else:
            killed, lines = rank(path, r, 3)
            assert not killed and lines[-1].startswith("status"), lines
    st = eagle3.status(path)
    if st["committed"]:
        # Killed after its part was durable (the last rank committed without it), or after
        # manifest.json: the cache is whole and readable; only the parts' state is left.
        assert (victim, kill_at) == (0, "written") or abort_after == 4, st
        assert len(eagle3.open(path)) == N
    else:
        with pytest.raises(IncompleteDatasetError, match="written in parts"):
            eagle3.open(path)
        assert not os.path.exists(path / "manifest.json")
    # The restart: every rank of the new world size, one after another.
    finals = [rank(path, r, restart_world)[1][-1] for r in range(restart_world)]
    assert finals[-1] == "status True", finals
    assert snapshot(path) == single
    assert eagle3.status(path)["committed"]


def test_status_names_what_is_missing_and_claimed_and_refusals_name_the_cause(tmp_path, single):
    path = tmp_path / "cache"
    # Ranks 0 and 2 of 3 write their parts; rank 1 holds its claim, writing nothing.
    for r in (0, 2):
        rank(path, r, 3)
    ns = {}
    exec(COMMON, ns)
    config = ns["CONFIG"]
    holder = eagle3.PartWriter(path, config, N, rank=1, world_size=3, target_embeddings=True)
    assert holder.samples == (6, 12) and holder.pending == [(6, 12)]
    st = eagle3.status(path)
    assert st["committed"] is False and st["done"] == 3 and st["missing"] == [[2, 4]], st
    (claim,) = st["claimed"]
    assert claim["units"] == [2, 4] and claim["by"].startswith(f"rank 1 of 3, pid {os.getpid()}"), claim
    # Unreadable, and validate names the missing shards.
    with pytest.raises(IncompleteDatasetError, match="shard-000002.safetensors to shard-000003.safetensors"):
        eagle3.open(path)
    v = eagle3.validate(path)
    assert not v["valid"] and "written in parts" in json.dumps(v["errors"]), v
    # A second rank overlapping the live claim is refused naming the holder; another
    # configuration is refused naming the key; a whole-cache writer is locked out.
    with pytest.raises(LockedError, match="rank 1 of 3"):
        eagle3.PartWriter(path, config, N, rank=0, world_size=2, target_embeddings=True)
    with pytest.raises(AlreadyExistsError, match=r"manifest key\(s\) seq_length differ"):
        eagle3.PartWriter(path, dict(config, seq_length=5), N, rank=2, world_size=3, target_embeddings=True)
    with pytest.raises(LockedError):
        eagle3.Writer(path, config, resume=True)
    holder.abort()
    # The CLI says the same.
    out = subprocess.run([shardkit_cli(), "eagle3", "status", str(path), "--world-size", "2"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert "3 of 5 shards durable" in out.stdout and "missing: shards 2..4" in out.stdout, out.stdout
    assert "rank 0: shards 2" in out.stdout and "rank 1: shards 3" in out.stdout, out.stdout
    rank(path, 1, 3)
    assert snapshot(path) == single
    assert eagle3.commit_parts(path)["committed"]
    out = subprocess.run([shardkit_cli(), "eagle3", "status", str(path), "--json"], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert json.loads(out.stdout)["committed"] is True


RECIPES = Path(__file__).resolve().parents[1] / "examples" / "parallel"


def run_eagle3_recipe(cache, launcher=()):
    out = subprocess.run(
        [*launcher, str(RECIPES / "torchrun_eagle3.py"), "--cache", str(cache), "--n-samples", "37"],
        env=child_env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["committed"] and res["missing"] == [] and res["claimed"] == [], res
    return snapshot(res["path"])


def test_the_torchrun_eagle3_recipe_with_2_ranks_writes_what_one_process_writes(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch, which the test environment installs"
    want = run_eagle3_recipe(tmp_path / "one", [sys.executable])
    got = run_eagle3_recipe(tmp_path / "two", [torchrun, "--standalone", "--nproc_per_node", "2"])
    assert got == want
    assert "manifest.json" in got and "target_embeddings.safetensors" in got
    c = eagle3.Cache(tmp_path / "two")
    assert len(c) == 37
