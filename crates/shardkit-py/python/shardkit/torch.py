"""PyTorch adapters (needs torch).

Device loaders, one per format (:class:`SaevLoader`, :class:`TokensLoader`,
:class:`Eagle3Loader`), yield dicts of tensors already on a device: with ``device="cuda"`` the
engine gathers rows straight into pinned host buffers allocated through torch, each batch is
copied on a side CUDA stream while the next is gathered, and the training stream waits only on
that copy. They keep their loader's ``state_dict``/``load_state_dict``/``set_epoch``. Use them in
the training process itself, not inside ``DataLoader`` workers: the engine already gathers on
every core, and a worker would add a copy through shared memory.

:class:`SaevDataset`, :class:`TokensDataset` and :class:`Eagle3Dataset` serve batches through
``torch.utils.data.DataLoader``. Each DataLoader worker of each rank serves its own slice of the global stream (sub-rank
``rank * num_workers + worker``, sub-world ``world_size * num_workers``), so no row is duplicated
and every row of an epoch is served once. Batches are already formed: use
``torch.utils.data.DataLoader(ds, batch_size=None, num_workers=N)``. The dataset implements
``state_dict``/``load_state_dict`` per worker, which torchdata's ``StatefulDataLoader`` collects
and restores; resume with the same world size and number of workers (or the same global batch).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import eagle3, flat_tokens, saev
from .errors import InvalidArgumentError

__all__ = [
    "SaevLoader", "TokensLoader", "Eagle3Loader",
    "SaevDataset", "TokensDataset", "Eagle3Dataset", "SaevIterableDataset",
]


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _to_tensors(batch: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """numpy arrays (bf16 included) as tensors sharing their memory."""
    return {k: _host_tensor(np.asarray(v)) for k, v in batch.items()}


class _LoaderDataset(IterableDataset):  # type: ignore[type-arg]
    """A format's loader as an IterableDataset, split across ranks and DataLoader workers
    without duplicates, stateful per worker."""

    def __init__(self, rank: Optional[int], world_size: Optional[int], epoch: int) -> None:
        super().__init__()
        self._epoch = int(epoch)
        self._rank, self._world = _rank_world(rank, world_size)
        self._loader: Any = None
        self._pending: Optional[Dict[str, Any]] = None

    def _build(self, rank: int, world_size: int, epoch: int) -> Any:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch for the next iteration (call before iterating, as with samplers)."""
        self._epoch = int(epoch)

    def _split(self) -> Tuple[int, int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self._rank * nw + wid, self._world * nw

    def _make(self) -> Any:
        rank, world = self._split()
        loader = self._build(rank, world, self._epoch)
        if self._pending is not None:
            loader.load_state_dict(self._pending)
            self._pending = None
        return loader

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        self._loader = self._make()
        for batch in self._loader:
            yield _to_tensors(batch)

    def __len__(self) -> int:
        """Batches per epoch over this rank's workers."""
        info = get_worker_info()
        nw = info.num_workers if info is not None else 1
        return len(self._build(self._rank * nw, self._world * nw, self._epoch)) * nw

    def state_dict(self) -> Dict[str, Any]:
        """This worker's position (its loader's ``state_dict()``)."""
        if self._loader is None:
            return self._pending or {}
        return dict(self._loader.state_dict())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes this worker from ``state_dict()`` at its next iteration."""
        self._pending = dict(state) if state else None
        if self._pending and "epoch" in self._pending:
            self._epoch = int(self._pending["epoch"])


class SaevDataset(_LoaderDataset):
    """saev batches (:class:`shardkit.saev.Loader`'s arguments) as dicts of torch tensors."""

    def __init__(self, path: str, *, layer: Any, rank: Optional[int] = None, world_size: Optional[int] = None,
                 epoch: int = 0, **kw: Any) -> None:
        super().__init__(rank, world_size, epoch)
        self._path = os.fspath(path)
        self._kw: Dict[str, Any] = dict(layer=layer, **kw)

    def _build(self, rank: int, world_size: int, epoch: int) -> saev.Loader:
        shuffled = self._kw.get("shuffle") is not False and self._kw.get("order") != "sequential"
        extra: Dict[str, Any] = {"epoch": epoch} if shuffled else {}
        return saev.Loader(self._path, rank=rank, world_size=world_size, **extra, **self._kw)


class SaevIterableDataset(SaevDataset):
    """The old name of :class:`SaevDataset` (shuffled, ``order="block"`` by default)."""


class TokensDataset(_LoaderDataset):
    """flat-tokens batches (:class:`shardkit.flat_tokens.Loader`'s arguments) as dicts of torch
    tensors; each worker of each rank loads its slice of every batch (seqax's hosts), so the
    global ``batch_size`` must divide by ``world_size * num_workers``."""

    def __init__(self, path: str, split: str = "train", *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, epoch: int = 0, **kw: Any) -> None:
        super().__init__(rank, world_size, epoch)
        self._path, self._split_name = os.fspath(path), split
        self._kw = kw

    def _build(self, rank: int, world_size: int, epoch: int) -> flat_tokens.Loader:
        return flat_tokens.Loader(self._path, self._split_name, rank=rank, world_size=world_size, epoch=epoch,
                                  **self._kw)


class Eagle3Dataset(_LoaderDataset):
    """EAGLE-3 batches (:class:`shardkit.eagle3.Loader`'s arguments) as dicts of torch tensors
    (bf16 as ``torch.bfloat16``)."""

    def __init__(self, cache_dir: str, *, batch_size: int, rank: Optional[int] = None,
                 world_size: Optional[int] = None, epoch: int = 0, **kw: Any) -> None:
        super().__init__(rank, world_size, epoch)
        self._path = os.fspath(cache_dir)
        self._kw = dict(batch_size=batch_size, **kw)

    def _build(self, rank: int, world_size: int, epoch: int) -> eagle3.Loader:
        return eagle3.Loader(self._path, rank=rank, world_size=world_size, epoch=epoch, **self._kw)


# --- device loaders -------------------------------------------------------------------------

_ALIGN = 4096  # the engine's buffer alignment (page size: O_DIRECT and pinned copies need it)


def _torch_dtype(a: np.ndarray) -> "torch.dtype":
    if a.dtype.name == "bfloat16":  # ml_dtypes
        return torch.bfloat16
    if a.dtype == np.bool_:
        return torch.bool
    return torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype


def _host_tensor(a: np.ndarray) -> "torch.Tensor":
    """A CPU tensor sharing ``a``'s memory (bfloat16 through its bit pattern)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _HostBuffers:
    """Page-aligned batch buffers allocated through torch (pinned for a GPU), lent to a loader's
    engine: rows are gathered straight into them and copied from there to the device."""

    def __init__(self, count: int, nbytes: int, pinned: bool) -> None:
        nbytes = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
        self.tensors: List["torch.Tensor"] = []
        self.regions: List[Tuple[int, int]] = []
        for _ in range(count):
            t = torch.empty(nbytes + _ALIGN, dtype=torch.uint8, pin_memory=pinned)
            skip = (-t.data_ptr()) % _ALIGN
            self.tensors.append(t[skip : skip + nbytes])
            self.regions.append((t.data_ptr() + skip, nbytes))

    def view(self, a: np.ndarray) -> Optional["torch.Tensor"]:
        """``a`` as a view of the buffer it lies in (so torch knows the memory is pinned), or
        None when it lies in none of them."""
        ptr = a.__array_interface__["data"][0]
        for t, (start, n) in zip(self.tensors, self.regions):
            if start <= ptr and ptr + a.nbytes <= start + n:
                off = ptr - start
                flat = t[off : off + a.nbytes]
                return flat.view(_torch_dtype(a)).view(a.shape)
        return None


class _DeviceLoader:
    """Batches of a host loader delivered as tensors on ``device``.

    On CUDA, the engine gathers each batch into one of ``num_buffers`` pinned host buffers; the
    batch is copied to the GPU on a side stream while the next one is gathered (double
    buffering), and the training stream waits on the copy's event only when it takes the batch.
    The host buffer goes back to the engine as soon as its copy has finished. On CPU, batches
    are the loader's own memory, shared without a copy.
    """

    def __init__(self, host: Any, core: Any, device: Any, num_buffers: int, host_buffers: Optional[str]) -> None:
        self._host = host
        self._core = core
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for but torch sees no CUDA device")
        if num_buffers < 3:
            raise InvalidArgumentError(f"num_buffers must be at least 3 (one being copied, one ahead, one gathering), got {num_buffers}")
        self._num_buffers = int(num_buffers)
        # "pinned" on CUDA; "plain" copies through unpinned torch buffers (tests the same path on
        # machines without a GPU); None shares the loader's memory (CPU only).
        if host_buffers is None and self.device.type != "cpu":
            host_buffers = "pinned"
        if host_buffers not in (None, "pinned", "plain"):
            raise InvalidArgumentError(f"host_buffers must be 'pinned', 'plain' or None, got {host_buffers!r}")
        self._mode = host_buffers
        self._buffers: Optional[_HostBuffers] = None
        self._state: Optional[Dict[str, Any]] = None  # the position after the last batch handed out

    @property
    def loader(self) -> Any:
        """The host loader underneath."""
        return self._host

    def __len__(self) -> int:
        return len(self._host)

    def set_epoch(self, epoch: int) -> None:
        self._host.set_epoch(epoch)
        self._state = None

    def state_dict(self) -> Dict[str, Any]:
        """The position after the last batch this loader handed out (batches copied ahead but
        not yet handed out are served again after a resume)."""
        return dict(self._state) if self._state is not None else self._host.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._host.load_state_dict(state)
        self._state = None

    def _host_batches(self) -> Iterator[Dict[str, np.ndarray]]:
        return iter(self._host)

    def _ensure_buffers(self) -> None:
        if self._mode is None or self._buffers is not None:
            return
        bufs = _HostBuffers(self._num_buffers, self._core.batch_bytes, self._mode == "pinned")
        # The engine keeps the tensor list alive as long as any of its buffers exists.
        self._core._set_batch_buffers(bufs.tensors, bufs.regions)
        self._buffers = bufs

    def _source(self, a: np.ndarray) -> "torch.Tensor":
        view = self._buffers.view(a) if self._buffers is not None else None
        if view is not None:
            return view
        t = _host_tensor(a)
        # Small side arrays (saev's indices) are not in the engine's buffers: pin a copy so the
        # device copy stays asynchronous (torch's host allocator recycles it after the copy).
        return t.pin_memory() if self._mode == "pinned" else t

    def __iter__(self) -> Iterator[Dict[str, "torch.Tensor"]]:
        if self._mode is None:
            for batch in self._host_batches():
                self._state = self._host.state_dict()
                yield {k: _host_tensor(a) for k, a in batch.items()}
            return
        self._ensure_buffers()
        if self._state is not None:
            # Batches copied ahead of an abandoned iteration were taken from the loader but
            # never handed out: go back to the last one that was.
            self._host.load_state_dict(self._state)
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        pending: Deque[Tuple[Any, Any]] = deque()  # (host arrays, copy-done event) not yet released
        host = self._host_batches()

        def issue() -> Optional[Tuple[Dict[str, "torch.Tensor"], Any, Dict[str, Any]]]:
            # Release the host buffers whose copies are done, and wait for the oldest when they
            # would leave the engine too few to gather into.
            while pending and (len(pending) >= self._num_buffers - 1 or pending[0][1] is None or pending[0][1].query()):
                arrays, ev = pending.popleft()
                if ev is not None:
                    ev.synchronize()
                del arrays
            batch = next(host, None)
            if batch is None:
                return None
            state = self._host.state_dict()
            out: Dict[str, "torch.Tensor"] = {}
            if cuda:
                with torch.cuda.stream(stream):
                    for k, a in batch.items():
                        src = self._source(a)
                        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                        dst.copy_(src, non_blocking=True)
                        out[k] = dst
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record(stream)
            else:
                out = {k: self._source(a).clone() for k, a in batch.items()}
                ev = None
            pending.append((batch, ev))
            return out, ev, state

        try:
            ahead = issue()
            while ahead is not None:
                current, ev, state = ahead
                ahead = issue()  # the next batch's copy overlaps this batch's use
                if cuda:
                    main = torch.cuda.current_stream(self.device)
                    main.wait_event(ev)
                    for t in current.values():
                        t.record_stream(main)  # its memory is not reused until main is done with it
                self._state = state
                yield current
        finally:
            close = getattr(host, "close", None)
            if close is not None:
                close()
            while pending:
                arrays, ev = pending.popleft()
                if ev is not None:
                    ev.synchronize()
                del arrays


class SaevLoader(_DeviceLoader):
    """saev batches (``act`` float32 ``[n, d_model]``, ``example_idx``, ``token_idx``, ...) as
    tensors on ``device``; shuffled (``order="block"`` or ``"exact"``) or in storage order
    (``shuffle=False`` or ``order="sequential"``). Other arguments are
    :class:`shardkit.saev.Loader`'s."""

    def __init__(self, path: str, *, layer: Any, device: Any = "cuda", num_buffers: int = 4,
                 host_buffers: Optional[str] = None, **kw: Any) -> None:
        host = saev.Loader(path, layer=layer, **kw)
        super().__init__(host, host._l, device, num_buffers, host_buffers)


class TokensLoader(_DeviceLoader):
    """flat-tokens batches (``inputs``, ``targets``, ``segment_ids`` int32, ``is_seq_start``,
    ``mask`` bool, ``[batch, seq_len]``) as tensors on ``device``, from the loader's ``step``.
    Arguments are :class:`shardkit.flat_tokens.Loader`'s."""

    def __init__(self, path: str, split: str = "train", *, device: Any = "cuda", num_buffers: int = 4, host_buffers: Optional[str] = None, **kw: Any) -> None:
        host = flat_tokens.Loader(path, split, **kw)
        super().__init__(host, host._l, device, num_buffers, host_buffers)


class Eagle3Loader(_DeviceLoader):
    """EAGLE-3 batches (every field of the cache, bf16 as ``torch.bfloat16``) as tensors on
    ``device``. Arguments are :class:`shardkit.eagle3.Loader`'s."""

    def __init__(self, cache_dir: str, *args: Any, device: Any = "cuda", num_buffers: int = 4,
                 host_buffers: Optional[str] = None, **kw: Any) -> None:
        host = eagle3.Loader(cache_dir, *args, **kw)
        super().__init__(host, host._l, device, num_buffers, host_buffers)
