"""A fault inside a loader's threads reaches Python as an exception, for each of the three
loaders: a panicking gather or prefetch thread, a thread that cannot start, a failing read.
Never a StopIteration that would end an epoch early."""

import pytest

import shardkit

from shardkit import _shardkit as _core

from _loaders import LOADERS


@pytest.fixture(autouse=True)
def disarm():
    _core._clear_faults()
    yield
    _core._clear_faults()


def run(loader):
    """(batches before the exception, the exception)."""
    n = 0
    it = iter(loader)
    try:
        for _ in it:
            n += 1
    except Exception as e:  # noqa: BLE001 - the test inspects whatever comes out
        return n, e
    return n, None


@pytest.mark.parametrize("which", list(LOADERS))
@pytest.mark.parametrize("fault,after,text,kind", [
    ("panic_in_gather", 3, "a gather thread panicked", shardkit.InternalError),
    ("panic_in_prepare", 2, "the prefetch thread panicked", shardkit.InternalError),
    ("spawn_fails", 0, "cannot start", shardkit.InternalError),
    ("read_fails", 2, "Input/output error", shardkit.ShardkitOSError),
])
def test_a_fault_is_an_exception(tmp_path, which, fault, after, text, kind):
    loader = LOADERS[which](tmp_path)
    full = len(loader)
    assert run(loader) == (full, None)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    if hasattr(loader, "step"):
        loader.step = 0
    if fault == "spawn_fails":
        after = 1  # the loader's gather pool runs already: its next pass's threads fail
    _core._inject_fault(fault, after)
    n, e = run(loader)
    assert isinstance(e, kind), f"{which}: {e!r}"
    assert text in str(e), f"{which}: {e}"
    assert n < full
