"""One flat-tokens split written by many processes (``flat_tokens.PartWriter``): the recipe's
3 plain processes write what one ``Writer`` writes, byte for byte; a rank SIGKILLed mid-part is
finished by a restart with another world size; ``status`` and the CLI say what is missing.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit import IncompleteDatasetError, flat_tokens
from shardkit.errors import AlreadyExistsError, LockedError

from _cli import shardkit_cli
from _procs import child_env, run_child, snapshot

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "parallel"
RECIPE = RECIPES / "processes_flat_tokens.py"
TIMEOUT = 120
N = 500  # documents; 40 a unit: 13 units, of 3 ranks units 0..5, 5..9, 9..13
PER_UNIT = 40



def env(**extra):
    return child_env(path_first=[RECIPES], **extra)


def run_cli(*args):
    out = subprocess.run([shardkit_cli(), *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return out


def run_recipe(root, world):
    out = subprocess.run(
        [sys.executable, str(RECIPE), "--root", str(root), "--n-docs", str(N), "--world-size", str(world),
         "--sequences-per-unit", str(PER_UNIT), "--batch", "16"],
        env=env(), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The split one process writes from the same documents."""
    sys.path.insert(0, str(RECIPES))
    try:
        from processes_flat_tokens import document
    finally:
        sys.path.remove(str(RECIPES))
    root = tmp_path_factory.mktemp("single") / "ds.zarr"
    with flat_tokens.Writer(root, "train", "v3", progress=False) as w:
        for at in range(0, N, 100):
            w.append([document(i) for i in range(at, min(at + 100, N))])
    return snapshot(root)


def test_three_processes_write_what_one_writer_writes(tmp_path, single):
    root = tmp_path / "ds.zarr"
    st = run_recipe(root, 3)
    # (A committed split no longer records its unit size: its status counts default-sized units.)
    assert st["committed"] is True and st["missing"] == [] and st["claimed"] == [], st
    assert snapshot(root) == single


# A rank as a child process: appends its pending documents one at a time, printing a line after
# each, and sleeping a little so that a kill lands near that line.
CHILD = textwrap.dedent(
    """
    import sys, time
    from processes_flat_tokens import document
    from shardkit import flat_tokens
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = flat_tokens.PartWriter(sys.argv[1], "train", %d, "v3", sequences_per_unit=%d, rank=rank,
                               world_size=world)
    print("open", flush=True)
    for first, end in w.pending:
        for i in range(first, end):
            w.append([document(i)])
            print("wrote", i + 1, flush=True)
            time.sleep(0.002)
    print("status", w.close()["committed"], flush=True)
    """
    % (N, PER_UNIT)
)


def rank(root, r, world, kill_at=None):
    """Runs rank `r` of `world`; with `kill_at` (a line), SIGKILLs it once it printed that line.
    Returns (killed, output lines)."""
    return run_child([sys.executable, "-c", CHILD, str(root), str(r), str(world)], kill_at, [RECIPES])


def test_a_rank_killed_mid_part_then_a_restart_with_2_ranks_writes_the_same_bytes(tmp_path, single):
    root = tmp_path / "ds.zarr"
    # Rank 1 of 3 (documents 200..360, units 5..9) is killed in unit 6 (documents 240..280).
    killed, lines = rank(root, 1, 3, kill_at="wrote 250")
    assert killed, lines
    for r in (0, 2):
        killed, lines = rank(root, r, 3)
        assert lines[-1] == "status False", lines
    st = flat_tokens.status(root, "train")
    assert st == {"committed": False, "units": 13, "done": 10, "missing": [[6, 9]], "claimed": []}, st
    with pytest.raises(IncompleteDatasetError, match=r"units 6\.\.9"):
        flat_tokens.Split(root, "train")
    # The CLI says the same, with what each rank of a restart with 2 would write.
    out = run_cli("flat-tokens", "status", str(root), "--world-size", "2")
    assert "10 of 13 units durable" in out.stdout, out.stdout
    assert "missing: units 6..9" in out.stdout, out.stdout
    assert "rank 0: units 6" in out.stdout and "rank 1: units 7..9" in out.stdout, out.stdout
    out = run_cli("tokens", "status", str(root), "--split", "train", "--json", "--world-size", "2")
    assert json.loads(out.stdout)["resume_plan"] == [[[6, 7]], [[7, 9]]], out.stdout
    # A live rank's claim is named to an overlapping one.
    holder = flat_tokens.PartWriter(root, "train", N, "v3", sequences_per_unit=PER_UNIT, rank=0, world_size=2)
    assert holder.pending == [(240, 280)]
    with pytest.raises(LockedError, match="rank 0 of 2"):
        flat_tokens.PartWriter(root, "train", N, "v3", sequences_per_unit=PER_UNIT, rank=1, world_size=3)
    holder.abort()
    # A rank started with another configuration is refused, naming the key, before writing.
    with pytest.raises(AlreadyExistsError, match="sequences_per_unit"):
        flat_tokens.PartWriter(root, "train", N, "v3", sequences_per_unit=PER_UNIT + 1, rank=1, world_size=2)
    with pytest.raises(AlreadyExistsError, match="total_sequences"):
        flat_tokens.PartWriter(root, "train", N + 1, "v3", sequences_per_unit=PER_UNIT, rank=1, world_size=2)
    # The restart with 2 ranks finishes the split.
    finals = [rank(root, r, 2)[1][-1] for r in range(2)]
    assert finals[-1] == "status True", finals
    assert snapshot(root) == single
    assert flat_tokens.commit_parts(root, "train")["committed"]
    out = run_cli("flat-tokens", "status", str(root), "--json")
    assert json.loads(out.stdout)["committed"] is True


@pytest.mark.parametrize(
    "abort_after",
    [
        8,  # rank 2 of 3 (units 9..13: a piece and a record each) dies with every unit durable
        9,  # ... dies in the commit, right after the checksum sidecar, before the cleanup
    ],
)
def test_the_last_rank_dying_at_its_commit_is_finished_by_a_restart(tmp_path, single, abort_after):
    root = tmp_path / "ds.zarr"
    for r in (0, 1):
        assert rank(root, r, 3)[1][-1] == "status False"
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), "2", "3"],
        env=env(SHARDKIT_TEST_ABORT_AFTER_RENAMES=abort_after), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert p.returncode == -signal.SIGABRT, p.stderr
    assert (root / ".shardkit-parts").is_dir()
    st = flat_tokens.status(root, "train")
    assert st["missing"] == [] and st["committed"] is (abort_after == 9), st
    if abort_after == 8:
        with pytest.raises(IncompleteDatasetError, match="killed while committing"):
            flat_tokens.Split(root, "train")
    finals = [rank(root, r, 2)[1][-1] for r in range(2)]
    assert finals == ["status True", "status True"], finals
    assert snapshot(root) == single
