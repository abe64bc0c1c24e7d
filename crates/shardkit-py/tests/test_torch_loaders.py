"""shardkit.torch device loaders: every format's batches as tensors, equal to the host loader's,
through the loader's own memory (CPU) or through torch-allocated host buffers lent to the
engine and copied from (the path CUDA takes with pinned buffers; here with plain ones), with
resumable state, recycled buffers and faults that surface as exceptions."""

from collections import Counter

import numpy as np
import pytest

import shardkit

import torch  # noqa: E402 - a required test dependency (scripts/setup-venv installs it)

from shardkit import _shardkit as _core  # noqa: E402
from shardkit import torch as sktorch  # noqa: E402

from _loaders import DATA, HOST  # noqa: E402

DEVICE = {"saev": sktorch.SaevLoader, "flat_tokens": sktorch.TokensLoader, "eagle3": sktorch.Eagle3Loader}
FORMATS = list(DATA)


@pytest.fixture(autouse=True)
def disarm():
    _core._clear_faults()
    yield
    _core._clear_faults()


def numpy_of(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def host_bits(a):
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def same(batch, ref):
    assert sorted(batch) == sorted(ref)
    for k, a in ref.items():
        t = batch[k]
        assert isinstance(t, torch.Tensor), k
        assert tuple(t.shape) == a.shape, k
        if a.dtype.name == "bfloat16":
            assert t.dtype == torch.bfloat16, k
        np.testing.assert_array_equal(numpy_of(t.cpu()), host_bits(np.asarray(a)), err_msg=k)


def reference(which, tmp_path, epochs=1):
    args, kw = DATA[which](tmp_path)
    host = HOST[which](*args, **kw)
    out = []
    for e in range(epochs):
        host.set_epoch(e if which != "flat_tokens" else 0)  # flat-tokens: epochs=False, one epoch
        out.append([{k: np.array(v) for k, v in b.items()} for b in host])
    return args, kw, out


@pytest.mark.parametrize("which", FORMATS)
def test_cpu_batches_share_the_loaders_memory(tmp_path, which):
    args, kw, (ref,) = reference(which, tmp_path)
    dl = DEVICE[which](*args, device="cpu", **kw)
    assert len(dl) == len(ref) and dl.host_buffers is None
    # Keep the host loader's own batches (what it handed to the device loader) to compare
    # addresses with: each tensor must be that memory, not a copy of it.
    host_batches = []
    host_iter = dl._host_batches

    def recording():
        for b in host_iter():
            host_batches.append(b)
            yield b

    dl._host_batches = recording
    got = list(dl)
    assert len(got) == len(ref) == len(host_batches)
    for b, r, h in zip(got, ref, host_batches, strict=True):
        same(b, r)
        assert sorted(h) == sorted(b)
        for k, a in h.items():
            t = b[k]
            assert t.data_ptr() == a.__array_interface__["data"][0], k
            assert np.shares_memory(numpy_of(t), host_bits(a)), k


@pytest.mark.parametrize("which", FORMATS)
def test_lent_buffers_give_the_same_batches_epoch_after_epoch(tmp_path, which):
    args, kw, ref = reference(which, tmp_path, epochs=3)
    # Three buffers for many batches: each goes back to the engine once its copy is done.
    dl = DEVICE[which](*args, device="cpu", host_buffers="plain", num_buffers=3, **kw)
    for e, epoch in enumerate(ref):
        dl.set_epoch(e if which != "flat_tokens" else 0)
        got = list(dl)
        assert len(got) == len(epoch) > 3
        for b, r in zip(got, epoch, strict=True):
            same(b, r)


@pytest.mark.parametrize("which", FORMATS)
def test_the_engine_gathers_into_the_lent_buffers(tmp_path, which):
    args, kw = DATA[which](tmp_path)
    dl = DEVICE[which](*args, device="cpu", host_buffers="plain", num_buffers=3, **kw)
    next(iter(dl))
    bufs = dl._buffers
    assert bufs is not None and len(bufs.regions) == 3
    assert all(start % 4096 == 0 and n >= dl.loader._l.batch_bytes for start, n in bufs.regions)
    seen = 0
    for batch in dl.loader:  # the host loader underneath now fills the lent buffers
        big = max(batch.values(), key=lambda a: a.nbytes)
        assert bufs.view(big) is not None
        seen += 1
    assert seen > 0


@pytest.mark.parametrize("which", FORMATS)
@pytest.mark.parametrize("host_buffers", [None, "plain"])
def test_state_dict_counts_only_batches_handed_out(tmp_path, which, host_buffers):
    args, kw, (ref,) = reference(which, tmp_path)
    dl = DEVICE[which](*args, device="cpu", host_buffers=host_buffers, num_buffers=3, **kw)
    k = 2
    it = iter(dl)
    for i in range(k):
        same(next(it), ref[i])
    it.close()  # the loader had copied batch k ahead: it must not be lost
    state = dl.state_dict()
    # A new loader resumed from the state, and the same loader iterated again, both go on at k.
    fresh = DEVICE[which](*args, device="cpu", host_buffers=host_buffers, num_buffers=3, **kw)
    fresh.load_state_dict(state)
    for loader in (fresh, dl):
        rest = list(loader)
        assert len(rest) == len(ref) - k
        for b, r in zip(rest, ref[k:], strict=True):
            same(b, r)


def test_saev_sequential_order(tmp_path):
    args, kw = DATA["saev"](tmp_path)
    kw.pop("memory_budget")
    from shardkit import saev

    ref = [{k: np.array(v) for k, v in b.items()} for b in saev.OrderedLoader(*args, **kw)]
    got = list(sktorch.SaevLoader(*args, order="sequential", device="cpu", host_buffers="plain", **kw))
    assert len(got) == len(ref) == 48 * 16 // 32
    for b, r in zip(got, ref, strict=True):
        same(b, r)
    with pytest.raises(shardkit.InvalidArgumentError, match="apply to shuffled orders only"):
        sktorch.SaevLoader(*args, order="sequential", seed=1, device="cpu", **kw)


@pytest.mark.parametrize("which", FORMATS)
def test_a_fault_in_the_engine_is_an_exception(tmp_path, which):
    args, kw = DATA[which](tmp_path)
    dl = DEVICE[which](*args, device="cpu", host_buffers="plain", num_buffers=3, **kw)
    full = len(dl)
    _core._inject_fault("panic_in_gather", 2)
    n = 0
    with pytest.raises(shardkit.InternalError, match="a gather thread panicked"):
        for _ in dl:
            n += 1
    assert n < full


def test_bad_arguments(tmp_path):
    args, kw = DATA["saev"](tmp_path)
    with pytest.raises(shardkit.InvalidArgumentError, match="num_buffers must be at least 3"):
        sktorch.SaevLoader(*args, device="cpu", host_buffers="plain", num_buffers=2, **kw)
    with pytest.raises(shardkit.InvalidArgumentError, match="host_buffers must be"):
        sktorch.SaevLoader(*args, device="cpu", host_buffers="shared", **kw)
    if not torch.cuda.is_available():
        with pytest.raises(shardkit.InvalidArgumentError, match="torch sees no CUDA device"):
            sktorch.SaevLoader(*args, device="cuda", **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the pinned-buffer, side-stream path runs where a GPU is lent")
@pytest.mark.parametrize("which", FORMATS)
def test_cuda_batches_equal_the_host_loaders(tmp_path, which):
    args, kw, ref = reference(which, tmp_path, epochs=2)
    dl = DEVICE[which](*args, device="cuda", num_buffers=3, **kw)
    for e, epoch in enumerate(ref):
        dl.set_epoch(e if which != "flat_tokens" else 0)
        got = list(dl)
        assert len(got) == len(epoch)
        for b, r in zip(got, epoch, strict=True):
            assert all(t.is_cuda for t in b.values())
            same(b, r)
    assert all(t.is_pinned() for t in dl._buffers.tensors)


def test_bench_gpu_runs_every_path_at_toy_sizes(tmp_path):
    """scripts/bench_gpu.py on CPU (--smoke): each loader feeds the SAE step, and so does a
    DataLoader with workers; the figures themselves mean nothing at this size."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "bench_gpu.py"
    out = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--smoke", "--dir", str(tmp_path), "--workers", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    report = json.loads(out)
    assert report["device"] == "cpu"
    for which in FORMATS:
        entry = report[which]
        assert entry["resident"]["steps_per_s"] > 0 and entry["shardkit"]["steps_per_s"] > 0
        assert entry["ratio"] == pytest.approx(entry["shardkit"]["steps_per_s"] / entry["resident"]["steps_per_s"])
    assert report["saev"]["dataloader_2_workers"]["rows_per_s"] > 0


# --- IterableDatasets: every format, split across ranks and DataLoader workers ------------------

def _dataset(which, data, rank, world_size):
    args, kw = data
    kw = {k: v for k, v in kw.items() if k not in ("rank", "world_size", "num_threads")}
    cls = {"saev": sktorch.SaevDataset, "flat_tokens": sktorch.TokensDataset, "eagle3": sktorch.Eagle3Dataset}[which]
    return cls(*args, rank=rank, world_size=world_size, **kw)


def _ids(which, b):
    """What identifies a batch's rows: (example, token) for saev, the tokens of each row for
    flat-tokens, the input ids of each sample for EAGLE-3."""
    if which == "saev":
        return list(zip(b["example_idx"].tolist(), b["token_idx"].tolist(), strict=True))
    if which == "flat_tokens":
        return [tuple(r) for r in b["inputs"].tolist()]
    return [tuple(r) for r in b["input_ids"].tolist()]


@pytest.mark.parametrize("which", FORMATS)
def test_datasets_split_ranks_and_workers_without_duplicates(tmp_path, which):
    """Two ranks x two DataLoader workers serve exactly what one loader serves in an epoch."""
    args, kw = data = DATA[which](tmp_path)
    one = HOST[which](*args, **kw)
    want = sorted(r for b in one for r in _ids(which, b))
    seen = []
    for rank in range(2):
        ds = _dataset(which, data, rank, 2)
        assert len(ds) >= 1
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        for b in dl:
            assert all(isinstance(v, torch.Tensor) for v in b.values())
            seen += _ids(which, b)
    assert len(want) > 0
    if which != "flat_tokens":  # packed token rows can repeat; (example, token) and samples cannot
        assert len(set(want)) == len(want)
    counts, once = Counter(seen), Counter(want)
    assert not once - counts, f"rows never served: {sorted(once - counts)[:5]}"
    extra = counts - once
    if which == "eagle3":
        # DistributedSampler semantics: each rank's part is padded to ceil(N / 2) samples by
        # wrapping to the start of the epoch's order, so exactly (-N) % 2 samples come twice
        # (none for this dataset's 24 samples) and no sample more than twice.
        pad = -len(want) % 2
        assert sum(extra.values()) == pad and all(c == 1 for c in extra.values()), extra
    else:
        assert not extra, f"rows served more than once: {sorted(extra)[:5]}"
    assert sorted(seen) == sorted(want + list(extra.elements()))


@pytest.mark.parametrize("which", FORMATS)
def test_dataset_state_resumes_where_it_stopped(tmp_path, which):
    data = DATA[which](tmp_path)
    ds = _dataset(which, data, 0, 1)
    full = [_ids(which, b) for b in ds]
    ds = _dataset(which, data, 0, 1)
    it = iter(ds)
    first = [_ids(which, next(it)) for _ in range(2)]
    state = ds.state_dict()
    assert state["format"] == which and state["batch"] == 2 and state["epoch"] == 0
    again = _dataset(which, data, 0, 1)
    again.load_state_dict(state)
    rest = [_ids(which, b) for b in again]
    assert first + rest == full


def test_dataset_set_epoch_changes_the_order(tmp_path):
    ds = _dataset("saev", DATA["saev"](tmp_path), 0, 1)
    e0 = [_ids("saev", b) for b in ds]
    ds.set_epoch(1)
    e1 = [_ids("saev", b) for b in ds]
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, []))
