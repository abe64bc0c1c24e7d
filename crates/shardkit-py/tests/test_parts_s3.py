"""Datasets written in parts to s3:// (moto on loopback), the ranks plain processes that
coordinate through the store alone: the committed objects must equal, byte for byte, the files
one process writes locally, after a SIGKILL mid-part and a restart with another world size, and
after a kill mid-commit finished by ``commit_parts``. EAGLE-3 and flat-tokens likewise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from shardkit import eagle3, saev

from _cli import shardkit_cli
from _procs import child_env, run_child, snapshot
from _s3 import S3, environment

HERE = Path(__file__).resolve().parent
TIMEOUT = 120


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    server = S3()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(s3: S3, tmp_path: Path) -> Iterator[Dict[str, str]]:
    e = s3.env(SHARDKIT_STAGING_DIR=str(tmp_path / "staging"))
    with environment(e):
        yield e




def under(s3: S3, bucket: str, prefix: str) -> Dict[str, bytes]:
    return {k[len(prefix):]: v for k, v in s3.objects(bucket, prefix).items()}


def run(script: str, args: List[str], kill_at: str | None = None, **extra: Any) -> Tuple[bool, List[str]]:
    """Runs `script` with `args` in a child; with `kill_at` (a line prefix) SIGKILLs it once it
    printed that line. Returns (killed or failed, output lines)."""
    killed, lines = run_child([sys.executable, "-c", script, *args], kill_at, [HERE], **extra)
    return killed, lines


# A saev rank (test_s3's dataset: 40 examples, 9 a shard, 5 shards; of 3 ranks, shards 0..2,
# 2..4, 4..5), writing its pending examples 4 at a time with labels.
SAEV_RANK = textwrap.dedent(
    """
    import sys, time
    from shardkit import saev
    from test_s3 import saev_metadata, saev_acts, saev_labels
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = saev.PartWriter(sys.argv[1], saev_metadata(), rank=rank, world_size=world, progress=False)
    print("open", w.path, flush=True)
    for first, end in w.pending:
        for at in range(first, end, 4):
            e = min(at + 4, end)
            w.write(saev_acts(at, e - at), saev_labels(at, e - at))
            print("wrote", e, flush=True)
            time.sleep(0.03)
    print("status", w.close()["committed"], flush=True)
    """
)


@pytest.fixture
def saev_local(tmp_path: Path) -> Tuple[str, Dict[str, bytes]]:
    from test_s3 import write_saev

    local = Path(write_saev(tmp_path / "local"))
    return local.name, snapshot(local)


def test_three_saev_ranks_write_to_a_store_what_one_process_writes(
    tmp_path: Path, s3: S3, env: Dict[str, str], saev_local: Tuple[str, Dict[str, bytes]]
) -> None:
    name, want = saev_local
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    procs = [subprocess.Popen([sys.executable, "-c", SAEV_RANK, root, str(r), "3"], env=child_env([HERE]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (2, 0, 1)]
    finals = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err[-4000:]
        lines = out.strip().splitlines()
        assert lines[0] == f"open {root}/{name}", lines
        finals.append(lines[-1])
    assert "status True" in finals, finals
    assert under(s3, bucket, f"root/{name}/") == want
    assert saev.status(f"{root}/{name}")["committed"]


def test_a_saev_rank_killed_mid_part_in_a_store_then_a_restart_with_2_ranks_writes_the_same(
    tmp_path: Path, s3: S3, env: Dict[str, str], saev_local: Tuple[str, Dict[str, bytes]]
) -> None:
    name, want = saev_local
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    url = f"{root}/{name}"
    assert not run(SAEV_RANK, [root, "0", "3"])[0]
    # Rank 1 (examples 18..36) is killed after its first shard, in the middle of its second.
    killed, lines = run(SAEV_RANK, [root, "1", "3"], kill_at="wrote 30")
    assert killed, lines
    assert not run(SAEV_RANK, [root, "2", "3"])[0]
    st = saev.status(url)
    # Shard 2 was handed to the background upload as the kill landed: durable or not yet (a
    # killed rank loses the shard going up and the one filling, at most).
    assert not st["committed"] and st["missing"] in ([[3, 4]], [[2, 4]]) and st["claimed"] == [], st
    lost_2 = st["missing"] == [[2, 4]]
    # The CLI reads the store too.
    out = subprocess.run([shardkit_cli(), "saev", "status", url, "--world-size", "2"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert f"{3 if lost_2 else 4} of 5 shards durable" in out.stdout, out.stdout
    assert "rank 1: shards 3" in out.stdout and (not lost_2 or "rank 0: shards 2" in out.stdout), out.stdout
    finals = [run(SAEV_RANK, [root, str(r), "2"])[1][-1] for r in range(2)]
    assert finals[-1] == "status True", finals
    assert under(s3, bucket, f"root/{name}/") == want


def test_a_saev_commit_killed_in_a_store_is_finished_by_commit_parts(
    tmp_path: Path, s3: S3, env: Dict[str, str], saev_local: Tuple[str, Dict[str, bytes]]
) -> None:
    name, want = saev_local
    bucket = s3.bucket()
    root = f"s3://{bucket}/root"
    url = f"{root}/{name}"
    for r in range(2):
        assert not run(SAEV_RANK, [root, str(r), "3"])[0]
    # Rank 2 of 3 owns shard 4: its labels' piece, the shard and the record (3 PUTs), then the
    # commit's labels.bin (4) and sidecar (5); killed after the sidecar, before shards.json.
    failed, lines = run(SAEV_RANK, [root, "2", "3"], SHARDKIT_TEST_ABORT_AFTER_PUTS=5)
    assert failed and "status True" not in lines, lines
    with pytest.raises(Exception, match="shards.json"):
        saev.Dataset(url)
    st = saev.status(url)
    assert not st["committed"] and st["missing"] == [], st
    out = subprocess.run([shardkit_cli(), "saev", "status", url, "--commit", "--json"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["committed"] is True
    assert under(s3, bucket, f"root/{name}/") == want
    assert saev.commit_parts(url)["committed"]


EAGLE3_COMMON = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from shardkit import eagle3
    sys.path.insert(0, %r)
    from test_eagle3_parts import COMMON
    exec(COMMON)
    """
) % str(HERE)

EAGLE3_RANK = EAGLE3_COMMON + textwrap.dedent(
    """
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = eagle3.PartWriter(sys.argv[1], CONFIG, N, rank=rank, world_size=world, target_embeddings=True)
    if rank == 0:
        w.write_target_embeddings(TABLE)
    print("open", flush=True)
    for first, end in w.pending:
        for at in range(first, end, 2):
            e = min(at + 2, end)
            w.add_batch(batch(at, e))
            print("wrote", e, flush=True)
            time.sleep(0.03)
    print("status", w.close()["committed"], flush=True)
    """
)

EAGLE3_SINGLE = EAGLE3_COMMON + textwrap.dedent(
    """
    with eagle3.Writer(sys.argv[1], CONFIG) as w:
        w.write_target_embeddings(TABLE)
        w.add_batch(batch(0, N))
    """
)


def test_eagle3_ranks_killed_in_a_store_then_restarted_write_what_one_process_writes(
    tmp_path: Path, s3: S3, env: Dict[str, str]
) -> None:
    local = tmp_path / "single"
    assert not run(EAGLE3_SINGLE, [str(local)])[0]
    want = snapshot(local)
    bucket = s3.bucket()
    url = f"s3://{bucket}/cache"
    # 14 samples, 3 a shard: of 3 ranks, shards 0..2, 2..4, 4..5. Rank 1 is killed mid-part.
    assert not run(EAGLE3_RANK, [url, "0", "3"])[0]
    killed, lines = run(EAGLE3_RANK, [url, "1", "3"], kill_at="wrote 10")
    assert killed, lines
    st = eagle3.status(url)
    assert not st["committed"] and st["done"] == 3 and st["claimed"] == [], st
    out = subprocess.run([shardkit_cli(), "eagle3", "status", url, "--json"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["missing"] == [[3, 5]], out.stdout
    finals = [run(EAGLE3_RANK, [url, str(r), "2"])[1][-1] for r in range(2)]
    assert finals[-1] == "status True", finals
    assert under(s3, bucket, "cache/") == want
    assert eagle3.status(url)["committed"]


# A flat-tokens rank (test_flat_tokens_parts' split: 500 documents, 40 a unit, 13 units; of 3
# ranks units 0..5, 5..9, 9..13), appending its pending documents one at a time.
RECIPES = HERE.parent / "examples" / "parallel"
TOKENS_N, TOKENS_PER_UNIT = 500, 40
TOKENS_RANK = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, %r)
    from processes_flat_tokens import document
    from shardkit import flat_tokens
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    w = flat_tokens.PartWriter(sys.argv[1], "train", %d, "v3", sequences_per_unit=%d, rank=rank,
                               world_size=world, progress=False)
    print("open", flush=True)
    for first, end in w.pending:
        for i in range(first, end):
            w.append([document(i)])
            print("wrote", i + 1, flush=True)
            time.sleep(0.002)
    print("status", w.close()["committed"], flush=True)
    """
) % (str(RECIPES), TOKENS_N, TOKENS_PER_UNIT)


@pytest.fixture(scope="module")
def tokens_local(tmp_path_factory: Any) -> Dict[str, bytes]:
    """The split one process writes (locally: the same bytes it writes to a store, object by
    object, as tests/flat_tokens_parts_s3.rs checks)."""
    from shardkit import flat_tokens

    sys.path.insert(0, str(RECIPES))
    try:
        from processes_flat_tokens import document
    finally:
        sys.path.remove(str(RECIPES))
    root = tmp_path_factory.mktemp("tokens") / "ds.zarr"
    with flat_tokens.Writer(root, "train", "v3", progress=False) as w:
        for at in range(0, TOKENS_N, 100):
            w.append([document(i) for i in range(at, min(at + 100, TOKENS_N))])
    return snapshot(root)


def test_three_flat_tokens_ranks_write_to_a_store_what_one_process_writes(
    s3: S3, env: Dict[str, str], tokens_local: Dict[str, bytes]
) -> None:
    from shardkit import flat_tokens

    bucket = s3.bucket()
    url = f"s3://{bucket}/ds.zarr"
    procs = [subprocess.Popen([sys.executable, "-c", TOKENS_RANK, url, str(r), "3"], env=child_env([HERE]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (2, 0, 1)]
    finals = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err[-4000:]
        finals.append(out.strip().splitlines()[-1])
    assert "status True" in finals, finals
    assert under(s3, bucket, "ds.zarr/") == tokens_local
    assert flat_tokens.status(url, "train")["committed"]


def test_a_flat_tokens_rank_killed_in_a_store_then_a_restart_with_2_ranks_writes_the_same(
    s3: S3, env: Dict[str, str], tokens_local: Dict[str, bytes]
) -> None:
    from shardkit import flat_tokens

    bucket = s3.bucket()
    url = f"s3://{bucket}/ds.zarr"
    # Rank 1 of 3 (documents 200..360, units 5..9) is killed in unit 6 (documents 240..280).
    killed, lines = run(TOKENS_RANK, [url, "1", "3"], kill_at="wrote 250")
    assert killed, lines
    for r in (0, 2):
        assert run(TOKENS_RANK, [url, str(r), "3"])[1][-1] == "status False"
    st = flat_tokens.status(url, "train")
    assert st == {"committed": False, "units": 13, "done": 10, "missing": [[6, 9]], "claimed": []}, st
    # Only the parts state is in the store so far.
    assert all(k.startswith(".shardkit-parts/train/") for k in under(s3, bucket, "ds.zarr/"))
    # The CLI reads the store too.
    out = subprocess.run([shardkit_cli(), "tokens", "status", url, "--world-size", "2"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert "10 of 13 units durable" in out.stdout and "rank 1: units 7..9" in out.stdout, out.stdout
    finals = [run(TOKENS_RANK, [url, str(r), "2"])[1][-1] for r in range(2)]
    assert finals[-1] == "status True", finals
    assert under(s3, bucket, "ds.zarr/") == tokens_local
    out = subprocess.run([shardkit_cli(), "tokens", "status", url, "--json"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["committed"] is True
