"""One saev dataset written by many processes (``saev.PartWriter``): the recipes run under
``torchrun`` and as a Slurm-style array, ranks are killed with SIGKILL at many points (before,
during and after their part, and during the commit), and the job is restarted with the same or
another world size. Every finished dataset must equal, byte for byte, what one process writes.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit import IncompleteDatasetError, saev
from shardkit.errors import InvalidArgumentError, LockedError

from _cli import shardkit_cli
from _procs import TIMEOUT, child_env, run_child, snapshot

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "parallel"
N = 40  # examples: 3 per shard, 14 shards (the last one short); of 3 ranks, shards 0..5, 5..10, 10..14



def env(**extra):
    return child_env(path_first=[RECIPES], **extra)


def run_cli(*args):
    out = subprocess.run([shardkit_cli(), *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return out


def run_recipe(script, root, n=N, **extra):
    out = subprocess.run(
        [sys.executable, str(RECIPES / script), "--root", str(root), "--n-examples", str(n)],
        env=env(**extra), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The dataset one process writes (the recipe run without a launcher)."""
    root = tmp_path_factory.mktemp("single")
    res = run_recipe("torchrun_saev.py", root)
    assert res["committed"], res
    return Path(res["path"]).name, snapshot(res["path"])


def test_the_torchrun_recipe_with_3_ranks_writes_what_one_process_writes(tmp_path, single):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch, which the test environment installs"
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "3", str(RECIPES / "torchrun_saev.py"),
         "--root", str(tmp_path), "--n-examples", str(N)],
        env=env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["committed"] and res["missing"] == [] and res["claimed"] == [], res
    name, want = single
    assert Path(res["path"]).name == name
    assert snapshot(res["path"]) == want


def test_slurm_array_tasks_run_at_once_in_any_order_write_what_one_process_writes(tmp_path, single):
    procs = [
        subprocess.Popen(
            [sys.executable, str(RECIPES / "slurm_array_saev.py"), "--root", str(tmp_path), "--n-examples", str(N)],
            env=env(SLURM_ARRAY_TASK_ID=10 + i, SLURM_ARRAY_TASK_MIN=10, SLURM_ARRAY_TASK_COUNT=4),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in (3, 1, 0, 2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert any(r["committed"] for r in results)
    name, want = single
    path = tmp_path / name
    assert snapshot(path) == want
    assert saev.status(path)["committed"]


# A rank as a child process: writes its pending examples two at a time (with labels), printing
# a line after each write, and sleeping a little so that a kill lands near that line.
CHILD = textwrap.dedent(
    """
    import sys, time
    from torchrun_saev import activations, metadata
    from shardkit import saev
    import numpy as np
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = saev.PartWriter(sys.argv[1], metadata(%d), rank=rank, world_size=world, progress=False)
    print("open", flush=True)
    time.sleep(0.05)
    for first, end in w.pending:
        for at in range(first, end, 2):
            e = min(at + 2, end)
            labels = np.array([[(x * 7 + t) %% 256 for t in range(4)] for x in range(at, e)], dtype=np.uint8)
            w.write(activations(at, e), labels)
            print("wrote", e, flush=True)
            time.sleep(0.05)
    print("written", flush=True)
    time.sleep(0.05)
    print("status", w.close()["committed"], flush=True)
    """
    % N
)


def rank(root, r, world, kill_at=None, **extra):
    """Runs rank `r` of `world`; with `kill_at` (a line prefix), SIGKILLs it once it printed
    that line. Returns (killed, output lines)."""
    return run_child([sys.executable, "-c", CHILD, str(root), str(r), str(world)], kill_at, [RECIPES], **extra)


@pytest.fixture(scope="module")
def single_labelled(tmp_path_factory):
    root = tmp_path_factory.mktemp("single_labelled")
    killed, lines = rank(root, 0, 1)
    assert not killed and lines[-1] == "status True", lines
    (path,) = [p for p in root.iterdir()]
    return path.name, snapshot(path)


@pytest.mark.parametrize(
    "victim,kill_at,abort_after,restart_world",
    [
        (1, "open", None, 2),  # before its part
        (1, "wrote 21", None, 3),  # mid-part (examples 15..30 are rank 1's)
        (1, "wrote 21", None, 4),
        (0, "wrote 15", None, 2),  # its part written, before finishing
        (2, "written", None, 4),  # the last rank, every shard durable, before the commit
        # The last rank, mid-commit (its 4 shards took 3 renames each: labels, shard, record):
        (2, None, 13, 3),  # after labels.bin
        (2, None, 14, 2),  # after the checksums sidecar
    ],
)
def test_a_rank_killed_anywhere_then_a_restart_with_any_world_size_finishes_the_same_bytes(
    tmp_path, single_labelled, victim, kill_at, abort_after, restart_world
):
    name, want = single_labelled
    path = tmp_path / name
    for r in range(3):
        if r == victim:
            extra = {} if abort_after is None else {"SHARDKIT_TEST_ABORT_AFTER_RENAMES": abort_after}
            killed, lines = rank(tmp_path, r, 3, kill_at=kill_at, **extra)
            assert killed, lines
        else:
            killed, lines = rank(tmp_path, r, 3)
            assert not killed and lines[-1].startswith("status"), lines
    st = saev.status(path)
    if st["committed"]:
        # Killed after its part was durable: the last rank committed without it.
        assert (victim, kill_at) == (0, "wrote 15"), st
        assert snapshot(path) == want
    else:
        with pytest.raises(IncompleteDatasetError):
            saev.open(path)
    # The restart: every rank of the new world size, one after another.
    finals = [rank(tmp_path, r, restart_world)[1][-1] for r in range(restart_world)]
    assert finals[-1] == "status True", finals
    assert snapshot(path) == want
    assert saev.status(path) == {"committed": True, "units": 14, "done": 14, "missing": [], "claimed": []}


def test_status_names_what_is_missing_and_claimed_and_commit_parts_finishes(tmp_path, single_labelled):
    name, want = single_labelled
    path = tmp_path / name
    # Ranks 0 and 2 of 3 write their parts; rank 1 holds its claim, writing nothing.
    for r in (0, 2):
        rank(tmp_path, r, 3)
    meta = json.loads((path / "metadata.json").read_text())
    holder = saev.PartWriter(tmp_path, meta, rank=1, world_size=3, progress=False)
    st = saev.status(path)
    assert st["committed"] is False and st["done"] == 9 and st["missing"] == [[5, 10]], st
    (claim,) = st["claimed"]
    assert claim["units"] == [5, 10] and claim["by"].startswith(f"rank 1 of 3, pid {os.getpid()}"), claim
    # A second rank 1 (or any overlapping part) is refused naming the holder.
    with pytest.raises(LockedError, match="rank 1 of 3"):
        saev.PartWriter(tmp_path, meta, rank=0, world_size=2, progress=False)
    with pytest.raises(InvalidArgumentError, match="rank and world_size"):
        saev.PartWriter(tmp_path, meta, rank=1, progress=False)
    holder.abort()
    # The CLI says the same.
    out = run_cli("saev", "status", str(path), "--world-size", "2")
    assert "9 of 14 shards durable" in out.stdout, out.stdout
    assert "rank 0: shards 5..7" in out.stdout and "rank 1: shards 7..10" in out.stdout, out.stdout
    rank(tmp_path, 1, 3)
    assert snapshot(path) == want
    assert saev.commit_parts(path)["committed"]
    out = run_cli("saev", "status", str(path), "--json")
    assert json.loads(out.stdout)["committed"] is True
