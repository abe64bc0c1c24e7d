"""Resuming training, for every loader and every torch wrapper: the documented loop

    for epoch in range(start_epoch, E):
        loader.set_epoch(epoch)
        for batch in loader: ...          # checkpoint loader.state_dict() mid-epoch

stopped mid-epoch (or right after an epoch's last batch) and resumed in a fresh loader from its
state gives exactly the batches the uninterrupted run gives; a state saved by a loader that
would serve other rows is refused, naming each differing key with both values; a state saved
before the order's parameters were recorded still loads; multi-worker DataLoaders checkpoint
through torchdata's StatefulDataLoader, and the main-process dataset refuses instead of
returning a state that would restart the epoch."""

import numpy as np
import pytest

import shardkit
from shardkit import eagle3, flat_tokens, saev
from shardkit.saev import compat

import torch  # noqa: E402 - a required test dependency
from torch.utils.data import DataLoader  # noqa: E402

from shardkit import torch as sktorch  # noqa: E402

from _cli import shardkit_cli  # noqa: E402
from _loaders import eagle3_data, tokens_data  # noqa: E402

E = 3  # epochs of the loop


def saev_data(tmp_path):
    """Every row distinct: act[e, t, d] = 1000 e + 10 t + d."""
    md = {"family": "clip", "ckpt": "x", "layers": [0, 5], "content_tokens_per_example": 6,
          "cls_token": False, "d_model": 8, "n_examples": 23, "max_tokens_per_shard": 60,
          "data": "gASV", "dataset": "t", "protocol": "2.1"}
    e, l, t, d = np.meshgrid(np.arange(23), np.arange(2), np.arange(6), np.arange(8), indexing="ij")
    acts = (1000 * e + 100 * l + 10 * t + d).astype(np.float32)
    with saev.Writer(tmp_path / "saev", md, progress=False) as w:
        w.write(acts, labels=None)
    return (w.path,), dict(layer=5, batch_size=10, memory_budget=16 << 10, seed=3, num_threads=2,
                           rank=0, world_size=1)


def tokens_data_epochs(tmp_path):
    args, kw = tokens_data(tmp_path)
    return args, dict(kw, epochs=True, seed=9)


def eagle3_data_seeded(tmp_path):
    args, kw = eagle3_data(tmp_path)
    return args, dict(kw, seed=6)


DATA = {"saev": saev_data, "flat_tokens": tokens_data_epochs, "eagle3": eagle3_data_seeded}
HOST = {"saev": saev.Loader, "flat_tokens": flat_tokens.Loader, "eagle3": eagle3.Loader}
DEVICE = {"saev": sktorch.SaevLoader, "flat_tokens": sktorch.TokensLoader, "eagle3": sktorch.Eagle3Loader}
DATASET = {"saev": sktorch.SaevDataset, "flat_tokens": sktorch.TokensDataset, "eagle3": sktorch.Eagle3Dataset}
FORMATS = list(DATA)


def arrays(batch):
    """A batch as plain numpy arrays (copied: the loader's buffers are recycled)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.view(torch.int16) if v.dtype == torch.bfloat16 else v
            v = v.cpu().numpy()
        else:
            v = np.asarray(v)
            v = v.view(np.uint16) if v.dtype.name == "bfloat16" else v
        out[k] = np.array(v)
    return out


def loop(loader, start_epoch, stop=None, epoch_of=None):
    """The documented loop over ``loader`` (anything with set_epoch and iteration) from
    ``start_epoch`` to E. With ``stop=(epoch, k)``: stops after k batches of that epoch and
    returns the state_dict() taken there (``epoch_of``: the object holding set_epoch/state_dict,
    when iteration goes through another, e.g. a DataLoader)."""
    owner = epoch_of if epoch_of is not None else loader
    out = []
    for epoch in range(start_epoch, E):
        owner.set_epoch(epoch)
        for k, batch in enumerate(loader, 1):
            out.append(arrays(batch))
            if stop == (epoch, k):
                return out, owner.state_dict()
    return out, None


def same_batches(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g) == sorted(w), i
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=f"batch {i}, {k}")


def check_resume(make, length, load=None):
    """Stops the loop mid-epoch 1 and right after epoch 0's last batch; a fresh loader resumed
    from the state finishes exactly as the uninterrupted run."""
    full, _ = loop(make(), 0)
    assert len(full) == E * length
    for stop in [(1, 2), (0, length)]:
        head, state = loop(make(), 0, stop=stop)
        assert state, stop
        resumed = make()
        (load or (lambda l, s: l.load_state_dict(s)))(resumed, state)
        tail, _ = loop(resumed, int(state["epoch"]))
        same_batches(head + tail, full)


# --- host loaders --------------------------------------------------------------------------


@pytest.mark.parametrize("which", FORMATS)
def test_the_documented_loop_resumes_exactly(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    kws = [kw]
    if which == "saev":
        kws += [dict(kw, order="exact"), dict(kw, shuffle=False, seed=0), dict(kw, drop_last=True)]
    if which == "eagle3":
        kws += [dict(kw, drop_last=True), dict(kw, shuffle=False)]
    for k in kws:
        make = lambda k=k: HOST[which](*args, **k)  # noqa: E731
        check_resume(make, len(make()))


@pytest.mark.parametrize("which", FORMATS)
def test_set_epoch_of_another_epoch_after_a_load_starts_that_epoch(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    a = HOST[which](*args, **kw)
    _, state = loop(a, 0, stop=(0, 2))
    b = HOST[which](*args, **kw)
    b.load_state_dict(state)
    b.set_epoch(2)
    c = HOST[which](*args, **kw)
    c.set_epoch(2)
    same_batches([arrays(x) for x in b], [arrays(x) for x in c])


@pytest.mark.parametrize("which", FORMATS)
def test_a_state_is_checked_on_every_parameter_that_decides_the_rows(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    a = HOST[which](*args, **kw)
    next(iter(a))
    state = a.state_dict()
    changes = {
        "saev": [
            (dict(order="exact"), "order: state block, this loader exact"),
            (dict(seed=4), "seed: state 3, this loader 4"),
            (dict(layer=0), "layer: state 5, this loader 0"),
            (dict(tokens="all"), "tokens: state content, this loader all"),
            (dict(memory_budget=8 << 10), "memory_budget: state 16384 bytes"),
            (dict(drop_last=True), "drop_last: state false, this loader true"),
            (dict(ignore_labels=[1]), None),  # no labels.bin: refused by the constructor
            (dict(batch_size=5), "global_batch_size: state 10, this loader 5"),
        ],
        "flat_tokens": [
            (dict(seed=1), "seed: state 9, this loader 1"),
            (dict(seq_len=8), "seq_len: state 16, this loader 8"),
            (dict(batch_size=8), "global_batch_size: state 4, this loader 8"),
            (dict(packed=False), "packed: state True, this loader False"),
            (dict(streams=2), "streams: state 1, this loader 2"),
            (dict(read_blocks_per_shuffle_buffer=4), "read_blocks_per_shuffle_buffer: state 2, this loader 4"),
            (dict(sequences_per_read_block=8), "sequences_per_read_block: state 4, this loader 8"),
            (dict(epochs=False), "epochs: state True, this loader False"),
        ],
        "eagle3": [
            (dict(seed=7), "seed: state 6, this loader 7"),
            (dict(batch_size=4), "batch_size: state 3, this loader 4"),
            (dict(shuffle=False), "shuffle: state true, this loader false"),
            (dict(drop_last=True), "drop_last: state false, this loader true"),
            (dict(world_size=2), "world_size: state 1, this loader 2"),
        ],
    }[which]
    for change, words in changes:
        if words is None:
            continue
        other = HOST[which](*args, **dict(kw, **change))
        with pytest.raises(shardkit.InvalidArgumentError) as e:
            other.load_state_dict(state)
        assert words in str(e.value) and "serves other rows" in str(e.value), (change, str(e.value))
    # Several differing keys: each one named.
    other = HOST[which](*args, **dict(kw, **changes[0][0], **changes[1][0]))
    with pytest.raises(shardkit.InvalidArgumentError) as e:
        other.load_state_dict(state)
    assert changes[0][1] in str(e.value) and changes[1][1] in str(e.value)
    # A state of another format.
    with pytest.raises(shardkit.InvalidArgumentError, match="saved by a"):
        a.load_state_dict(dict(state, format="sdnb"))
    with pytest.raises(shardkit.InvalidArgumentError, match="empty state"):
        a.load_state_dict({})


def test_states_name_the_dataset(tmp_path):
    """Another dataset of the same shape but another size (saev rows, flat-tokens steps,
    EAGLE-3 samples) is refused."""
    args, kw = DATA["saev"](tmp_path)
    state = saev.Loader(*args, **kw).state_dict()
    with pytest.raises(shardkit.InvalidArgumentError, match="rows: state 99, this loader 138"):
        saev.Loader(*args, **kw).load_state_dict(dict(state, rows=99))
    args, kw = DATA["flat_tokens"](tmp_path)
    state = flat_tokens.Loader(*args, **kw).state_dict()
    with pytest.raises(shardkit.InvalidArgumentError, match="step_count: state 999"):
        flat_tokens.Loader(*args, **kw).load_state_dict(dict(state, step_count=999))
    with pytest.raises(shardkit.InvalidArgumentError, match="split: state 'validation', this loader 'train'"):
        flat_tokens.Loader(*args, **kw).load_state_dict(dict(state, split="validation"))
    args, kw = DATA["eagle3"](tmp_path)
    state = eagle3.Loader(*args, **kw).state_dict()
    with pytest.raises(shardkit.InvalidArgumentError, match="samples: state 5, this loader 24"):
        eagle3.Loader(*args, **kw).load_state_dict(dict(state, samples=5))


def test_another_world_size_with_the_same_global_batch_is_accepted(tmp_path):
    args, kw = DATA["saev"](tmp_path)
    a = saev.Loader(*args, **kw)
    _, state = loop(a, 0, stop=(1, 2))
    for rank in range(2):
        r = saev.Loader(*args, **dict(kw, batch_size=5, rank=rank, world_size=2))
        r.load_state_dict(state)
        assert r.state_dict()["cursor"] == state["cursor"]
    args, kw = DATA["flat_tokens"](tmp_path)
    a = flat_tokens.Loader(*args, **kw)
    _, state = loop(a, 0, stop=(1, 2))
    r = flat_tokens.Loader(*args, **dict(kw, rank=1, world_size=2))
    r.load_state_dict(state)
    assert r.step == state["step"]


OLD_KEYS = {
    "saev": ("format", "seed", "epoch", "batch", "batch_size", "world_size", "cursor", "global_batch_size"),
    "flat_tokens": ("format", "seed", "epoch", "batch", "world_size", "step", "seq_len", "packed", "streams",
                    "read_blocks_per_shuffle_buffer", "sequences_per_read_block", "epochs"),
    "eagle3": ("format", "seed", "epoch", "batch", "batch_size", "world_size"),
}


@pytest.mark.parametrize("which", FORMATS)
def test_a_state_saved_before_the_order_was_recorded_still_loads(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    full, _ = loop(HOST[which](*args, **kw), 0)
    head, state = loop(HOST[which](*args, **kw), 0, stop=(1, 2))
    old = {k: state[k] for k in OLD_KEYS[which]}
    if which == "flat_tokens":
        old["batch_size"] = state["global_batch_size"]  # what older versions saved there
    r = HOST[which](*args, **kw)
    r.load_state_dict(old)
    tail, _ = loop(r, old["epoch"])
    same_batches(head + tail, full)
    # ... and is still checked on the keys it has.
    with pytest.raises(shardkit.InvalidArgumentError, match="seed: state"):
        HOST[which](*args, **dict(kw, seed=kw["seed"] + 1)).load_state_dict(old)


def test_saev_compat_loaders_resume(tmp_path):
    args, kw = DATA["saev"](tmp_path)
    cfg = compat.ShuffledConfig(shards=args[0], layer=5, batch_size=10, seed=2, buffer_size=4)

    def epochs(dl, n, stop=None):
        out = []
        for e in range(n):
            for k, b in enumerate(dl, 1):
                out.append(arrays(b))
                if stop == (e, k):
                    return out, dl.state_dict()
        return out, None

    full, _ = epochs(compat.ShuffledDataLoader(cfg), 3)
    for stop, left in [((1, 2), 2), ((0, len(compat.ShuffledDataLoader(cfg))), 2)]:
        head, state = epochs(compat.ShuffledDataLoader(cfg), 3, stop)
        r = compat.ShuffledDataLoader(cfg)
        r.load_state_dict(state)
        tail, _ = epochs(r, left)
        same_batches(head + tail, full)
    other = compat.ShuffledDataLoader(compat.ShuffledConfig(shards=args[0], layer=5, batch_size=10, seed=3,
                                                             buffer_size=4))
    with pytest.raises(shardkit.InvalidArgumentError, match="seed: state 2, this loader 3"):
        other.load_state_dict(state)

    ocfg = compat.OrderedConfig(shards=args[0], layer=5, batch_size=10)
    full = [arrays(b) for b in compat.OrderedDataLoader(ocfg)]
    dl = compat.OrderedDataLoader(ocfg)
    it = iter(dl)
    head = [arrays(next(it)) for _ in range(4)]
    state = dl.state_dict()
    r = compat.OrderedDataLoader(ocfg)
    r.load_state_dict(state)
    same_batches(head + [arrays(b) for b in r], full)


# --- shardkit.torch ------------------------------------------------------------------------


@pytest.mark.parametrize("which", FORMATS)
@pytest.mark.parametrize("host_buffers", [None, "plain"])
def test_device_loaders_resume_exactly(which, host_buffers, tmp_path):
    args, kw = DATA[which](tmp_path)
    make = lambda: DEVICE[which](*args, device="cpu", host_buffers=host_buffers, **kw)  # noqa: E731
    check_resume(make, len(make()))


@pytest.mark.parametrize("which", FORMATS)
def test_datasets_resume_exactly_without_workers(which, tmp_path):
    args, kw = DATA[which](tmp_path)

    class Loop:
        """A DataLoader over a fresh dataset, set_epoch/state_dict going to the dataset."""

        def __init__(self):
            self.ds = DATASET[which](*args, **kw)
            self.dl = DataLoader(self.ds, batch_size=None, num_workers=0)

        def set_epoch(self, e):
            self.ds.set_epoch(e)

        def state_dict(self):
            return self.ds.state_dict()

        def load_state_dict(self, s):
            self.ds.load_state_dict(s)

        def __iter__(self):
            return iter(self.dl)

    check_resume(Loop, len(HOST[which](*args, **kw)))
    # Before any iteration, the state is the start of the epoch (not {}).
    ds = DATASET[which](*args, **kw)
    ds.set_epoch(1)
    st = ds.state_dict()
    assert st["format"] == which and st["epoch"] == 1 and st["batch"] == 0
    with pytest.raises(shardkit.InvalidArgumentError, match="empty state"):
        ds.load_state_dict({})


@pytest.mark.parametrize("which", FORMATS)
def test_a_multi_worker_dataloader_refuses_a_main_process_state(which, tmp_path):
    args, kw = DATA[which](tmp_path)
    ds = DATASET[which](*args, **kw)
    dl = DataLoader(ds, batch_size=None, num_workers=2)
    it = iter(dl)
    next(it)
    next(it)
    with pytest.raises(shardkit.InvalidArgumentError, match="StatefulDataLoader") as e:
        ds.state_dict()
    assert "num_workers=0" in str(e.value)
    del it


stateful = pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.parametrize("which", FORMATS)
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(which, workers, tmp_path):
    args, kw = DATA[which](tmp_path)
    if which == "flat_tokens" and workers:
        kw = dict(kw, batch_size=4)  # the global batch divides by world_size x workers

    class Loop:
        def __init__(self):
            self.ds = DATASET[which](*args, **kw)
            self.dl = stateful.StatefulDataLoader(self.ds, batch_size=None, num_workers=workers)

        def set_epoch(self, e):
            self.ds.set_epoch(e)

        def state_dict(self):
            return self.dl.state_dict()

        def load_state_dict(self, s):
            self.dl.load_state_dict(s)

        def __iter__(self):
            return iter(self.dl)

    full, _ = loop(Loop(), 0)
    length = len(full) // E
    for stop in [(1, 2), (0, length)]:
        head, state = loop(Loop(), 0, stop=stop)
        resumed = Loop()
        resumed.load_state_dict(state)
        # The loop resumes at the epoch it was in (saved with the checkpoint: the
        # DataLoader's state has no epoch of its own).
        tail, _ = loop(resumed, stop[0])
        same_batches(head + tail, full)


def test_the_cli_stream_state_is_checked_and_old_states_load(tmp_path):
    """``shardkit saev stream --resume STATE``: the state file holds the order's parameters (a
    Python loader can load it), a stream with another seed refuses it naming the key, and a
    four-key state written by an older version still resumes."""
    import json
    import os
    import subprocess
    from pathlib import Path

    exe = shardkit_cli()
    args, kw = DATA["saev"](tmp_path)
    common = ["saev", "stream", args[0], "--layer", "5", "--order", "block", "--seed", "3",
              "--memory-budget-mib", "1", "--batch-size", "10"]

    def run(*extra, ok=True):
        r = subprocess.run([exe, *common, *map(str, extra)], capture_output=True, text=True)
        assert (r.returncode == 0) == ok, r.stderr
        return r

    run("--max-batches", "4", "--out", tmp_path / "head.npz")
    state = json.loads((tmp_path / "head.state.json").read_text())
    assert state["cursor"] == 40 and state["order"] == "block" and state["layer"] == 5 and state["rows"] == 138
    # The same state in Python: a loader with the CLI's parameters resumes it.
    py = saev.Loader(*args, **dict(kw, memory_budget=1 << 20))
    py.load_state_dict(state)
    run("--resume", tmp_path / "head.state.json", "--out", tmp_path / "tail.npz")
    tail = np.load(tmp_path / "tail.npz")["example_idx"]
    np.testing.assert_array_equal(np.concatenate([b["example_idx"] for b in py]), tail)
    # Another seed: refused, naming it.
    common[common.index("--seed") + 1] = "4"
    r = run("--resume", tmp_path / "head.state.json", "--out", tmp_path / "x.npz", ok=False)
    assert "seed: state 3, this loader 4" in r.stderr
    # A state with only the position (older versions) resumes, checked on what it has.
    common[common.index("--seed") + 1] = "3"
    old = {k: state[k] for k in ("seed", "epoch", "cursor", "global_batch_size")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    run("--resume", tmp_path / "old.json", "--out", tmp_path / "old.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "old.npz")["example_idx"], tail)
