"""Several ranks reading one saev dataset while writer processes record it
(``follow=True`` with ``follow_broadcast``): rank 0 alone looks for new shards and broadcasts
each round, every rank serves its split of it, and across the ranks every row is served exactly
once. The ranks are threads sharing a broadcast here, and ``torchrun`` processes through
``shardkit.torch.SaevLoader`` (which builds the broadcast over torch.distributed itself)."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from shardkit import IncompleteDatasetError, saev
from shardkit.errors import InvalidArgumentError, InvalidArgumentTypeError

from _procs import TIMEOUT, child_env
import test_eagle3_follow as e3
from test_follow import METADATA, N, T, WRITER, finish, loader, n_rounds, start_writers

ALL_ROWS = [(e, c) for e in range(N) for c in range(T - 1)]


def channel(world):
    """One broadcast per rank of `world` threads (what torch.distributed does between
    processes), and each rank's number of calls."""
    barrier = threading.Barrier(world)
    slot = []
    calls = [0] * world

    def for_rank(r):
        def broadcast(value):
            assert (value is not None) == (r == 0)
            if value is not None:
                slot[:] = [list(value)]
            barrier.wait()
            out = slot[0]
            barrier.wait()
            calls[r] += 1
            return out
        return broadcast

    return [for_rank(r) for r in range(world)], calls


def read_as_ranks(path, world, make=None, rows=None, **kw):
    """Each rank's served rows ((example, token) pairs of a saev `loader`, or what `rows` makes
    of a batch of `make(path, **options)`) and last state, the ranks on threads; an exception a
    rank raised is returned in its place."""
    make = make or loader
    rows = rows or (lambda b: list(zip(b["example_idx"].tolist(), b["token_idx"].tolist())))
    bcs, calls = channel(world)
    out = [None] * world

    def rank(r):
        try:
            l = make(path, follow=True, rank=r, world_size=world, follow_broadcast=bcs[r], **kw)
            served = []
            for b in l:
                served += rows(b)
            out[r] = (served, l.state_dict())
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return out, calls


def test_ranks_on_threads_sharing_a_broadcast_serve_every_row_once_across_them(tmp_path):
    procs, path = start_writers(tmp_path, 2, 0.1)  # slow enough for several rounds under load
    out, calls = read_as_ranks(path, 2, follow_timeout=60)
    finish(procs)
    for r in out:
        assert not isinstance(r, Exception), r
    served = [x for s, _ in out for x in s]
    assert sorted(served) == ALL_ROWS  # every row once, so no row on both ranks
    states = [st for _, st in out]
    assert states[0]["follow_rounds"] == states[1]["follow_rounds"]
    rounds = n_rounds(states[0]["follow_rounds"])
    assert rounds > 1, states[0]
    assert calls == [rounds, rounds]


def test_a_stop_on_rank_0_reaches_the_other_rank_and_a_callbacks_exception_is_the_loaders(tmp_path):
    procs, path = start_writers(tmp_path, 2, 0.0, ranks=[0])  # rank 1's shards never come
    finish(procs)
    out, _ = read_as_ranks(path, 2, follow_timeout=0.3)
    for r in out:
        assert isinstance(r, IncompleteDatasetError) and "shards 5..10" in str(r), r

    class Boom(Exception):
        pass

    def fails(value):
        raise Boom("the collective broke")

    l = loader(path, follow=True, rank=1, world_size=2, follow_broadcast=fails)
    with pytest.raises(Boom, match="the collective broke"):
        for _ in l:
            pass
    # The callback must return a list of ints.
    l = loader(path, follow=True, rank=1, world_size=2, follow_broadcast=lambda v: "nope")
    with pytest.raises(TypeError):
        for _ in l:
            pass
    with pytest.raises(InvalidArgumentError, match=r"world_size 2 only when the ranks agree.*follow_broadcast="):
        loader(path, follow=True, rank=0, world_size=2)
    with pytest.raises(InvalidArgumentTypeError, match="follow_broadcast must be a callable"):
        loader(path, follow=True, rank=0, world_size=2, follow_broadcast=3)
    with pytest.raises(InvalidArgumentError, match="follow_broadcast applies with follow=True only"):
        loader(path, follow_broadcast=fails)


def test_eagle3_ranks_sharing_a_broadcast_serve_every_sample_once_but_the_last_rounds_padding(tmp_path):
    path = tmp_path / "cache"
    procs = e3.start_writers(path, 2, 0.1)
    out, calls = read_as_ranks(str(path), 2, make=e3.loader, rows=e3.samples, follow_timeout=60)
    e3.finish(procs)
    for r in out:
        assert not isinstance(r, Exception), r
    (s0, st0), (s1, st1) = out
    assert st0["follow_rounds"] == st1["follow_rounds"] and n_rounds(st0["follow_rounds"]) > 1, st0
    assert st0["batch"] == st1["batch"]  # as many batches on each rank
    # Every sample, once but for at most one (of 2 ranks) padding the last round.
    assert sorted(set(s0 + s1)) == list(range(e3.N))
    assert len(s0 + s1) - e3.N <= 1
    assert calls == [n_rounds(st0["follow_rounds"])] * 2


# One torchrun rank: SaevLoader(follow=True) on torch.distributed (gloo, CPU), writing the rows
# it served to rank<r>.json.
RANK = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from shardkit.torch import SaevLoader
    dist.init_process_group("gloo")
    l = SaevLoader(sys.argv[1], layer=6, batch_size=7, seed=3, memory_budget=4096, follow=True,
                   follow_timeout=60, device="cpu")
    dist.barrier()
    if dist.get_rank() == 0:
        open(sys.argv[2], "w").close()  # the writers start now, while both ranks read
    served = []
    for b in l:
        served += zip(b["example_idx"].tolist(), b["token_idx"].tolist())
        dist.barrier()  # the training step's collective, between rounds' broadcasts
    with open(f"{sys.argv[3]}/rank{dist.get_rank()}.json", "w") as f:
        json.dump([dist.get_rank(), served, l.state_dict()["follow_rounds"]], f)
    dist.destroy_process_group()
""")


# The writer of test_follow, waiting for a file before its first shard (so that the ranks,
# slow to start under torchrun, read while it writes).
GATED_WRITER = WRITER.replace("print(w.path, flush=True)\n", """print(w.path, flush=True)
    import os
    while not os.path.exists(sys.argv[6]):
        time.sleep(0.01)
""")


def test_torchrun_ranks_reading_with_the_torch_loader_serve_every_row_once(tmp_path):
    pytest.importorskip("torch")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", GATED_WRITER, json.dumps(METADATA), str(r), "2", "0.05",
                          str(tmp_path / "data"), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    path = procs[0].stdout.readline().strip()
    assert path, procs[0].stderr.read()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), path,
         str(go), str(tmp_path)],
        env=child_env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=TIMEOUT,
    )
    finish(procs)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    served = [tuple(x) for _, s, _ in ranks for x in s]
    assert sorted(served) == ALL_ROWS
    assert ranks[0][2] == ranks[1][2] and n_rounds(ranks[0][2]) > 1, ranks


def test_a_torch_dataset_following_with_several_dataloader_workers_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from shardkit.torch import SaevDataset

    procs, path = start_writers(tmp_path, 2, 0.0, ranks=[0])
    finish(procs)
    ds = SaevDataset(path, layer=6, batch_size=7, seed=3, memory_budget=4096, follow=True, follow_timeout=1)
    with pytest.raises(Exception, match=r"DataLoader workers \(num_workers=2, world_size=1\).*num_workers=0"):
        for _ in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
            pass
