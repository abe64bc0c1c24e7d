"""PyTorch adapters (needs torch).

Device loaders, one per format (:class:`SaevLoader`, :class:`TokensLoader`,
:class:`Eagle3Loader`), yield dicts of tensors already on a device (by default
:func:`default_device`: the current accelerator, else the CPU): with ``device="cuda"`` the
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
With ``num_workers=0``, ``ds.state_dict()`` is the position; with workers, the dataset in the main
process has none, and its ``state_dict()`` raises InvalidArgumentError saying so.

``follow=True`` (reading data while it is written) on several ranks of an initialised
torch.distributed: the loaders (and the Dataset classes iterated with ``num_workers=0``) make
the ranks agree on each round themselves, rank 0 broadcasting it over a gloo group of their own
(see :func:`_round_broadcast`); DataLoader workers cannot take part in that collective, so a
Dataset with ``follow=True`` iterated by several workers (or ranks and workers) is refused.
"""

from __future__ import annotations

import os
from collections import deque
from datetime import timedelta
from typing import Any, Deque, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import _args, dspark, eagle3, flat_tokens, saev
from .errors import InvalidArgumentError
from .types import FollowBroadcast

PathLike = Union[str, "os.PathLike[str]"]
Device = Union[str, "torch.device", int, None]

__all__ = [
    "SaevLoader", "TokensLoader", "Eagle3Loader", "DSparkLoader",
    "SaevDataset", "TokensDataset", "Eagle3Dataset", "DSparkDataset", "SaevIterableDataset", "default_device",
]


def default_device() -> "torch.device":
    """The device loaders use when given none: the current accelerator (``torch.accelerator``
    where the installed torch has it; otherwise CUDA, then MPS, when available), else the CPU."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        current = acc.current_accelerator() if acc.is_available() else None
        return torch.device(current.type) if current is not None else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _device(device: Device) -> "torch.device":
    """``device`` (None: :func:`default_device`) checked to exist on this machine."""
    if device is None:
        return default_device()
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise _args.InvalidArgumentTypeError(
            f"device must be a torch.device, a string such as 'cuda:0' or 'cpu', or a CUDA index, "
            f"got {device!r} ({type(device).__name__})")
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(f"device={device!r} is not a device torch knows ({e})") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device={device!r} was asked for but torch sees no CUDA device")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise InvalidArgumentError(
                f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) (indices 0 to {torch.cuda.device_count() - 1})")
    elif d.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise InvalidArgumentError(f"device={device!r} was asked for but torch sees no MPS device")
    return d


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"${name}={text!r} is not an integer") from None


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """``rank``/``world_size``, each defaulting to torch.distributed's (when initialised) or to
    ``$RANK``/``$WORLD_SIZE``; checked (``0 <= rank < world_size``)."""
    _args.rank_world(rank, world_size)
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            env_rank, env_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            env_rank, env_world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        rank = env_rank if rank is None else int(rank)
        world_size = env_world if world_size is None else int(world_size)
    _args.rank_world(rank, world_size)
    return int(rank), int(world_size)


def _round_broadcast(follow: bool, rank: Optional[int], world_size: Optional[int],
                     follow_timeout: Optional[float]) -> Optional[FollowBroadcast]:
    """The ``follow_broadcast`` of a follow-mode loader on one of several ranks of an
    initialised torch.distributed (None otherwise): rank 0's ``broadcast_object_list`` over a
    gloo group of its own, made here, once (every rank constructs its loader, so every rank
    joins), so that it never interleaves with the training's collectives (NCCL or other) and
    its timeout outlasts rank 0's wait for shards (``follow_timeout``, default 3600 s)."""
    if not follow or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    r, w = _rank_world(rank, world_size)
    if w <= 1 or (r, w) != (torch.distributed.get_rank(), torch.distributed.get_world_size()):
        return None  # not torch.distributed's ranks: the caller agrees on rounds otherwise
    wait = 3600.0 if follow_timeout is None else float(follow_timeout)
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=wait + 60))
    if not isinstance(group, torch.distributed.ProcessGroup):  # every rank is a member
        raise InvalidArgumentError(f"rank {r} is not in the gloo group of its {w} ranks")

    def broadcast(value: Optional[List[int]]) -> List[int]:
        box: List[Any] = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        return [int(x) for x in box[0]]

    return broadcast


def _to_tensors(batch: Dict[str, Any], bf16: FrozenSet[str] = frozenset()) -> Dict[str, torch.Tensor]:
    """numpy arrays (bf16 included, and the ``bf16`` keys' uint16 bit patterns) as tensors
    sharing their memory."""
    return {k: _host_tensor(np.asarray(v), k in bf16) for k, v in batch.items()}


class _LoaderDataset(IterableDataset):  # type: ignore[type-arg]
    """A format's loader as an IterableDataset, split across ranks and DataLoader workers
    without duplicates, stateful per worker."""

    def __init__(self, path: PathLike, rank: Optional[int], world_size: Optional[int], epoch: int) -> None:
        super().__init__()
        self._path = _args.path("path", path)
        self._epoch = _args.count("epoch", epoch)
        self._rank, self._world = _rank_world(rank, world_size)
        self._loader: Any = None
        self._pending: Optional[Dict[str, Any]] = None
        # Set by a DataLoader worker when it iterates this dataset, in memory shared with the
        # process that built it: the position is then the workers', and state_dict() here
        # refuses instead of returning one that would restart the epoch.
        self._in_workers = torch.zeros(1, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]

    def _check(self) -> Any:
        """Builds this rank's loader once in the constructing process, so that a bad argument
        or a missing dataset fails here, not later inside a DataLoader worker."""
        return self._build(self._rank, self._world, self._epoch)

    def _build(self, rank: int, world_size: int, epoch: int) -> Any:
        raise NotImplementedError

    @property
    def path(self) -> str:
        return self._path

    @property
    def rank(self) -> int:
        """This process's rank (each DataLoader worker serves a slice of it)."""
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves."""
        return self._epoch

    @property
    def batch_size(self) -> int:
        return int(self._kw["batch_size"])

    @property
    def seed(self) -> int:
        return int(self._kw.get("seed", 0))

    def _params(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._kw.items() if k in self._SHOWN)

    _SHOWN: Tuple[str, ...] = ()
    _kw: Dict[str, Any]
    _broadcast: Optional[FollowBroadcast] = None

    def __repr__(self) -> str:
        return (
            f"torch.{type(self).__name__}({self._path!r}, {self._params()}, rank={self._rank}, "
            f"world_size={self._world}, epoch={self._epoch})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch for the next iteration (call before iterating, as with samplers).
        Right after ``load_state_dict``, the state's epoch keeps the loaded position; another
        epoch starts from its beginning."""
        epoch = _args.count("epoch", epoch)
        if self._pending is not None and int(self._pending.get("epoch", epoch)) != epoch:
            self._pending = None
        if self._loader is not None:
            self._loader.set_epoch(epoch)
        self._epoch = epoch

    def _split(self) -> Tuple[int, int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self._rank * nw + wid, self._world * nw

    def _make(self) -> Any:
        rank, world = self._split()
        info = get_worker_info()
        if info is not None and world > 1 and self._kw.get("follow"):
            raise InvalidArgumentError(
                f"{type(self).__name__}(follow=True) iterated by DataLoader workers (num_workers="
                f"{info.num_workers}, world_size={self._world}): readers of data being written agree "
                "on its rounds through a torch.distributed collective, which DataLoader workers cannot "
                "take part in; iterate with num_workers=0 (the engine already reads on every core)")
        loader = self._build(rank, world, self._epoch)
        if self._pending is not None:
            loader.load_state_dict(self._pending)
            self._pending = None
        return loader

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        if get_worker_info() is not None:
            self._in_workers[0] = 1
        self._loader = self._make()
        bf16 = self._bf16_keys(self._loader)
        for batch in self._loader:
            yield _to_tensors(batch, bf16)

    def _bf16_keys(self, loader: Any) -> FrozenSet[str]:
        """The keys whose arrays ``loader`` serves as bfloat16 bit patterns (none by default)."""
        return frozenset()

    def __len__(self) -> int:
        """Batches per epoch over this rank's workers."""
        info = get_worker_info()
        nw = info.num_workers if info is not None else 1
        return len(self._build(self._rank * nw, self._world * nw, self._epoch)) * nw

    def state_dict(self) -> Dict[str, Any]:
        """This process's (or, inside a DataLoader worker, this worker's) position: its
        loader's ``state_dict()``, the start of the epoch before any iteration.

        With ``DataLoader(num_workers > 0)`` the workers iterate copies of the dataset and hold
        the position: here, in the process that built it, this raises InvalidArgumentError.
        Checkpoint through torchdata's ``StatefulDataLoader`` instead (its ``state_dict()``
        calls this method in every worker), or use ``num_workers=0``."""
        if get_worker_info() is None and int(self._in_workers[0]):
            raise InvalidArgumentError(
                f"{type(self).__name__}.state_dict(): DataLoader workers (num_workers > 0) iterate "
                "copies of this dataset and hold the position; this one, in the main process, has "
                "none. Checkpoint with torchdata.stateful_dataloader.StatefulDataLoader(ds, "
                "batch_size=None, num_workers=N): its state_dict() and load_state_dict() save and "
                "restore every worker's position; or iterate with num_workers=0")
        if self._loader is not None:
            return dict(self._loader.state_dict())
        if self._pending is not None:
            return dict(self._pending)
        rank, world = self._split()
        return dict(self._build(rank, world, self._epoch).state_dict())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from ``state_dict()`` at the next iteration (inside a DataLoader worker,
        this worker). A state saved by a loader that would serve other rows is refused then."""
        if not isinstance(state, dict) or not state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict() needs a state from state_dict(), got "
                f"{state!r}: an empty state holds no position")
        self._pending = dict(state)
        self._loader = None
        if "epoch" in self._pending:
            self._epoch = int(self._pending["epoch"])


class SaevDataset(_LoaderDataset):
    """saev batches (:class:`shardkit.saev.Loader`'s arguments) as dicts of torch tensors.
    Every argument is checked here, in the constructing process (the dataset is opened once).
    ``act`` is as stored (``torch.bfloat16`` / ``torch.float16`` for a reduced-precision
    dataset, sharing the loader's memory; no ml_dtypes needed), or float32 with
    ``dtype="float32"`` (widened by the loader)."""

    _SHOWN = ("layer", "tokens", "batch_size", "order", "seed", "drop_last", "dtype")

    def __init__(
        self,
        path: PathLike,
        *,
        layer: Union[int, str],
        tokens: str = "content",
        batch_size: int = 16384,
        shuffle: Optional[bool] = None,
        order: Optional[str] = None,
        seed: int = 0,
        epoch: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        num_threads: Optional[int] = None,
        verify: bool = False,
        memory_budget: Optional[int] = None,
        ignore_labels: Sequence[int] = (),
        io_threads: int = 16,
        direct_io: bool = False,
        follow: bool = False,
        follow_timeout: Optional[float] = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(path, rank, world_size, epoch)
        self._kw: Dict[str, Any] = dict(
            layer=layer, tokens=tokens, batch_size=batch_size, shuffle=shuffle, order=order, seed=seed,
            drop_last=drop_last, num_threads=num_threads, verify=verify, memory_budget=memory_budget,
            ignore_labels=tuple(ignore_labels) if isinstance(ignore_labels, (list, tuple)) else ignore_labels,
            io_threads=io_threads, direct_io=direct_io, follow=follow, follow_timeout=follow_timeout,
            dtype=_args.dtype("dtype", dtype),
        )
        self._broadcast = _round_broadcast(follow, self._rank, self._world, follow_timeout)
        checked = self._check()
        self._kw["order"] = checked.order
        self._kw["layer"] = checked.layer

    def _build(self, rank: int, world_size: int, epoch: int) -> saev.Loader:
        kw = dict(self._kw)
        if kw["order"] == "sequential":
            kw.pop("shuffle")
        # This process's broadcast: not a DataLoader worker's (refused in _make).
        bc = self._broadcast if world_size == self._world else None
        return _TorchSaevLoader(self._path, rank=rank, world_size=world_size,
                                epoch=epoch if kw["order"] != "sequential" else 0, follow_broadcast=bc, **kw)

    def _bf16_keys(self, loader: Any) -> FrozenSet[str]:
        return frozenset({"act"}) if loader.dtype == "bfloat16" else frozenset()

    @property
    def layer(self) -> Union[int, str]:
        return self._kw["layer"]  # type: ignore[no-any-return]

    @property
    def dtype(self) -> Optional[str]:
        """The ``dtype`` asked for (None: as stored)."""
        return self._kw["dtype"]  # type: ignore[no-any-return]

    @property
    def order(self) -> str:
        return str(self._kw["order"])

    @property
    def shuffle(self) -> bool:
        return self.order != "sequential"

    @property
    def drop_last(self) -> bool:
        return bool(self._kw["drop_last"])


class SaevIterableDataset(SaevDataset):
    """The old name of :class:`SaevDataset` (shuffled, ``order="block"`` by default)."""


class TokensDataset(_LoaderDataset):
    """flat-tokens batches (:class:`shardkit.flat_tokens.Loader`'s arguments) as dicts of torch
    tensors; each worker of each rank loads its slice of every batch (seqax's hosts), so the
    global ``batch_size`` must divide by ``world_size * num_workers``. Every argument is
    checked here, in the constructing process."""

    _SHOWN = ("split", "seq_len", "batch_size", "packed", "seed")

    def __init__(
        self,
        path: PathLike,
        split: str = "train",
        *,
        seq_len: int,
        batch_size: int,
        packed: bool = True,
        streams: int = 1,
        read_blocks_per_shuffle_buffer: int = 1024,
        sequences_per_read_block: Optional[int] = None,
        seed: int = 0,
        epochs: bool = False,
        num_threads: Optional[int] = None,
        verify: bool = False,
        buffer_in_memory: Optional[bool] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        epoch: int = 0,
    ) -> None:
        super().__init__(path, rank, world_size, epoch)
        self._kw = dict(
            split=split, seq_len=seq_len, batch_size=batch_size, packed=packed, streams=streams,
            read_blocks_per_shuffle_buffer=read_blocks_per_shuffle_buffer,
            sequences_per_read_block=sequences_per_read_block, seed=seed, epochs=epochs,
            num_threads=num_threads, verify=verify, buffer_in_memory=buffer_in_memory,
        )
        self._check()

    def _build(self, rank: int, world_size: int, epoch: int) -> flat_tokens.Loader:
        return flat_tokens.Loader(self._path, rank=rank, world_size=world_size, epoch=epoch, **self._kw)

    @property
    def split(self) -> str:
        return str(self._kw["split"])

    @property
    def seq_len(self) -> int:
        return int(self._kw["seq_len"])

    @property
    def shuffle(self) -> bool:
        return True

    @property
    def drop_last(self) -> bool:
        return True


class Eagle3Dataset(_LoaderDataset):
    """EAGLE-3 batches (:class:`shardkit.eagle3.Loader`'s arguments) as dicts of torch tensors
    (bf16 as ``torch.bfloat16``). Every argument is checked here, in the constructing process."""

    _SHOWN = ("batch_size", "shuffle", "seed", "drop_last")
    #: The cache's module (its Loader serves the batches).
    _module: Any = eagle3

    def __init__(
        self,
        cache_dir: PathLike,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        epoch: int = 0,
        num_threads: Optional[int] = None,
        prefetch: int = 2,
        verify: bool = False,
        follow: bool = False,
        follow_timeout: Optional[float] = None,
    ) -> None:
        super().__init__(cache_dir, rank, world_size, epoch)
        self._kw = dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                        num_threads=num_threads, prefetch=prefetch, verify=verify, follow=follow,
                        follow_timeout=follow_timeout)
        self._broadcast = _round_broadcast(follow, self._rank, self._world, follow_timeout)
        self._check()

    def _build(self, rank: int, world_size: int, epoch: int) -> eagle3.Loader:
        # This process's broadcast: not a DataLoader worker's (refused in _make).
        bc = self._broadcast if world_size == self._world else None
        loader: eagle3.Loader = self._module.Loader(
            self._path, rank=rank, world_size=world_size, epoch=epoch, follow_broadcast=bc, **self._kw)
        return loader

    @property
    def shuffle(self) -> bool:
        return bool(self._kw["shuffle"])

    @property
    def drop_last(self) -> bool:
        return bool(self._kw["drop_last"])


# --- device loaders -------------------------------------------------------------------------

_ALIGN = 4096  # the engine's buffer alignment (page size: O_DIRECT and pinned copies need it)


def _torch_dtype(a: np.ndarray, bf16: bool = False) -> "torch.dtype":
    """The torch dtype of ``a``'s values (``bf16``: ``a`` holds bfloat16 bit patterns)."""
    if a.dtype.name == "bfloat16" or bf16:  # ml_dtypes, or the bit patterns
        return torch.bfloat16
    if a.dtype == np.bool_:
        return torch.bool
    return torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype


def _host_tensor(a: np.ndarray, bf16: bool = False) -> "torch.Tensor":
    """A CPU tensor sharing ``a``'s memory (bfloat16 through its bit pattern: an
    ``ml_dtypes.bfloat16`` array, or with ``bf16`` a uint16 array of the bit patterns)."""
    if a.dtype.name == "bfloat16" or bf16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _TorchSaevLoader(saev.Loader):
    """:class:`shardkit.saev.Loader` serving bfloat16 rows as their uint16 bit patterns, which
    the adapters here view as ``torch.bfloat16`` (so that torch users need no ml_dtypes)."""

    _bf16_bits = True


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

    def view(self, a: np.ndarray, bf16: bool = False) -> Optional["torch.Tensor"]:
        """``a`` as a view of the buffer it lies in (so torch knows the memory is pinned), or
        None when it lies in none of them (``bf16``: ``a`` holds bfloat16 bit patterns)."""
        ptr = a.__array_interface__["data"][0]
        for t, (start, n) in zip(self.tensors, self.regions):
            if start <= ptr and ptr + a.nbytes <= start + n:
                off = ptr - start
                flat = t[off : off + a.nbytes]
                return flat.view(_torch_dtype(a, bf16)).view(a.shape)
        return None


class _DeviceLoader:
    """Batches of a host loader delivered as tensors on ``device``.

    On CUDA, the engine gathers each batch into one of ``num_buffers`` pinned host buffers; the
    batch is copied to the GPU on a side stream while the next one is gathered (double
    buffering), and the training stream waits on the copy's event only when it takes the batch.
    The host buffer goes back to the engine as soon as its copy has finished. On CPU, batches
    are the loader's own memory, shared without a copy.

    ``widen``: keys whose (bfloat16/float16) tensors are widened to float32 on the device, after
    the copy, so the host gathers and copies the stored bytes (half of float32's). ``bf16``:
    keys the host loader serves as bfloat16 bit patterns (uint16 arrays).
    """

    @staticmethod
    def _mode_of(device: "torch.device", host_buffers: Optional[str]) -> Optional[str]:
        """The host buffers a loader on ``device`` uses: ``"pinned"`` on CUDA, ``"plain"`` (copies
        through unpinned torch buffers: other accelerators, and the same path tested on machines
        without a GPU), or None (the loader's own memory, shared: CPU only)."""
        if host_buffers is None and device.type != "cpu":
            return "pinned" if device.type == "cuda" else "plain"
        return host_buffers

    @staticmethod
    def _options(device: Device, num_buffers: int, host_buffers: Optional[str]) -> Tuple["torch.device", int, Optional[str]]:
        """The checked device options (before the host loader is built)."""
        d = _device(device)
        num_buffers = _args.integer(
            "num_buffers", num_buffers, lo=3, hi=1 << 16,
            rule="at least 3 (one being copied, one ahead, one gathering)")
        if host_buffers is not None and not isinstance(host_buffers, str):
            raise _args.InvalidArgumentTypeError(
                f"host_buffers must be 'pinned', 'plain' or None, got {host_buffers!r} ({type(host_buffers).__name__})")
        if host_buffers not in (None, "pinned", "plain"):
            raise InvalidArgumentError(f"host_buffers must be 'pinned', 'plain' or None, got {host_buffers!r}")
        if host_buffers == "pinned" and d.type != "cuda":
            raise InvalidArgumentError(f"host_buffers='pinned' needs a CUDA device, got device={str(d)!r}")
        return d, num_buffers, host_buffers

    def __init__(self, host: Any, core: Any, device: "torch.device", num_buffers: int, host_buffers: Optional[str],
                 *, widen: FrozenSet[str] = frozenset(), bf16: FrozenSet[str] = frozenset()) -> None:
        self._host = host
        self._core = core
        self.device = device
        self._num_buffers = int(num_buffers)
        self._mode = self._mode_of(device, host_buffers)
        self._widen = widen
        self._bf16 = bf16
        self._buffers: Optional[_HostBuffers] = None
        self._state: Optional[Dict[str, Any]] = None  # the position after the last batch handed out

    @property
    def loader(self) -> Any:
        """The host loader underneath."""
        return self._host

    @property
    def path(self) -> str:
        return str(self._host.path)

    @property
    def batch_size(self) -> int:
        return int(self._host.batch_size)

    @property
    def seed(self) -> int:
        return int(self._host.seed)

    @property
    def shuffle(self) -> bool:
        return bool(self._host.shuffle)

    @property
    def drop_last(self) -> bool:
        return bool(self._host.drop_last)

    @property
    def rank(self) -> int:
        return int(self._host.rank)

    @property
    def world_size(self) -> int:
        return int(self._host.world_size)

    @property
    def epoch(self) -> int:
        return int(self._host.epoch)

    @property
    def num_buffers(self) -> int:
        return self._num_buffers

    @property
    def host_buffers(self) -> Optional[str]:
        """``"pinned"``, ``"plain"`` or None (the loader's own memory, on CPU)."""
        return self._mode

    def __repr__(self) -> str:
        host = repr(self._host)
        inner = host[host.index("(") + 1 : -1] if "(" in host and host.endswith(")") else host
        return f"torch.{type(self).__name__}({inner}, device={str(self.device)!r}, host_buffers={self._mode!r})"

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

    def _source(self, k: str, a: np.ndarray) -> "torch.Tensor":
        bf16 = k in self._bf16
        view = self._buffers.view(a, bf16) if self._buffers is not None else None
        if view is not None:
            return view
        t = _host_tensor(a, bf16)
        # Small side arrays (saev's indices) are not in the engine's buffers: pin a copy so the
        # device copy stays asynchronous (torch's host allocator recycles it after the copy).
        return t.pin_memory() if self._mode == "pinned" else t

    def __iter__(self) -> Iterator[Dict[str, "torch.Tensor"]]:
        if self._mode is None:
            for batch in self._host_batches():
                self._state = self._host.state_dict()
                yield {k: _host_tensor(a, k in self._bf16) for k, a in batch.items()}
            return
        self._ensure_buffers()
        if self._state is not None and self._state != self._host.state_dict():
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
                        src = self._source(k, a)
                        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                        dst.copy_(src, non_blocking=True)
                        # Widened on the GPU, on the copy's stream, after the copy: the host
                        # moved the stored bytes.
                        out[k] = dst.float() if k in self._widen else dst
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record(stream)
            elif self.device.type == "cpu":
                # .float() of a reduced tensor is a new float32 tensor: the copy the clone makes.
                out = {k: self._source(k, a).float() if k in self._widen else self._source(k, a).clone()
                       for k, a in batch.items()}
                ev = None
            else:  # another accelerator (MPS, XPU, ...): a synchronous copy from the plain buffers
                out = {}
                for k, a in batch.items():
                    t = self._source(k, a).to(self.device, copy=True)
                    out[k] = t.float() if k in self._widen else t
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
    """saev batches (``act`` ``[n, d_model]``, ``example_idx``, ``token_idx``, ...) as
    tensors on ``device`` (default: :func:`default_device`); shuffled (``order="block"`` or
    ``"exact"``) or in storage order (``shuffle=False`` or ``order="sequential"``). Other
    arguments are :class:`shardkit.saev.Loader`'s.

    ``act`` is as stored (``dtype=None``): float32, or ``torch.bfloat16`` / ``torch.float16``
    for a reduced-precision dataset (no ml_dtypes needed); ``dtype="float32"`` widens it. On a
    GPU (any device but the CPU) the host gathers and copies the stored bytes (half of float32's,
    so the pinned buffers are half the size) and the rows are widened on the device after the
    copy; on the CPU the loader widens them as it gathers."""

    def __init__(
        self,
        path: PathLike,
        *,
        layer: Union[int, str],
        tokens: str = "content",
        batch_size: int = 16384,
        shuffle: Optional[bool] = None,
        order: Optional[str] = None,
        seed: int = 0,
        epoch: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        num_threads: Optional[int] = None,
        verify: bool = False,
        memory_budget: Optional[int] = None,
        ignore_labels: Sequence[int] = (),
        io_threads: int = 16,
        direct_io: bool = False,
        follow: bool = False,
        follow_timeout: Optional[float] = None,
        device: Device = None,
        num_buffers: int = 4,
        host_buffers: Optional[str] = None,
        dtype: Any = None,
    ) -> None:
        d, n, hb = self._options(device, num_buffers, host_buffers)
        want = _args.dtype("dtype", dtype)
        # Through host buffers (a device), float32 is made on the device: the host serves the
        # stored rows. Sharing the loader's memory (CPU), the loader widens them.
        on_device = want == "float32" and self._mode_of(d, hb) is not None
        host = _TorchSaevLoader(
            path, layer=layer, tokens=tokens, batch_size=batch_size, shuffle=shuffle, order=order, seed=seed,
            epoch=epoch, rank=rank, world_size=world_size, drop_last=drop_last, num_threads=num_threads,
            verify=verify, memory_budget=memory_budget, ignore_labels=ignore_labels, io_threads=io_threads,
            direct_io=direct_io, follow=follow, follow_timeout=follow_timeout,
            follow_broadcast=_round_broadcast(follow, rank, world_size, follow_timeout),
            dtype=None if on_device else want,
        )
        widen = on_device and host.dtype != "float32"
        super().__init__(host, host._l, d, n, hb, widen=frozenset({"act"}) if widen else frozenset(),
                         bf16=frozenset({"act"}) if host.dtype == "bfloat16" else frozenset())
        self._dtype = "float32" if widen else str(host.dtype)

    @property
    def dtype(self) -> str:
        """The type of the ``act`` tensors served (``"float32"``, ``"bfloat16"`` or
        ``"float16"``)."""
        return self._dtype

    def __repr__(self) -> str:
        r = super().__repr__()
        # Widened on the device: the host loader (whose words these are) serves the stored type.
        return r.replace(f", dtype={self._host.dtype!r}", f", dtype={self._dtype!r}") if self._widen else r

    @property
    def layer(self) -> Union[int, str]:
        return self._host.layer  # type: ignore[no-any-return]

    @property
    def order(self) -> str:
        return str(self._host.order)


class TokensLoader(_DeviceLoader):
    """flat-tokens batches (``inputs``, ``targets``, ``segment_ids`` int32, ``is_seq_start``,
    ``mask`` bool, ``[batch, seq_len]``) as tensors on ``device`` (default:
    :func:`default_device`), from the loader's ``step``. Other arguments are
    :class:`shardkit.flat_tokens.Loader`'s."""

    def __init__(
        self,
        path: PathLike,
        split: str = "train",
        *,
        seq_len: int,
        batch_size: int,
        packed: bool = True,
        streams: int = 1,
        read_blocks_per_shuffle_buffer: int = 1024,
        sequences_per_read_block: Optional[int] = None,
        seed: int = 0,
        host_index: Optional[int] = None,
        host_count: Optional[int] = None,
        epochs: bool = False,
        num_threads: Optional[int] = None,
        verify: bool = False,
        buffer_in_memory: Optional[bool] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        epoch: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        device: Device = None,
        num_buffers: int = 4,
        host_buffers: Optional[str] = None,
    ) -> None:
        d, n, hb = self._options(device, num_buffers, host_buffers)
        host = flat_tokens.Loader(
            path, split, seq_len=seq_len, batch_size=batch_size, packed=packed, streams=streams,
            read_blocks_per_shuffle_buffer=read_blocks_per_shuffle_buffer,
            sequences_per_read_block=sequences_per_read_block, seed=seed, host_index=host_index,
            host_count=host_count, epochs=epochs, num_threads=num_threads, verify=verify,
            buffer_in_memory=buffer_in_memory, rank=rank, world_size=world_size, epoch=epoch, shuffle=shuffle,
            drop_last=drop_last,
        )
        super().__init__(host, host._l, d, n, hb)

    @property
    def step(self) -> int:
        """The next step (seqax's global step)."""
        return int(self._host.step)

    @property
    def seq_len(self) -> int:
        return int(self._host.seq_len)


class Eagle3Loader(_DeviceLoader):
    """EAGLE-3 batches (every field of the cache, bf16 as ``torch.bfloat16``) as tensors on
    ``device`` (default: :func:`default_device`). Other arguments are
    :class:`shardkit.eagle3.Loader`'s."""

    _module: Any = eagle3

    def __init__(
        self,
        cache_dir: PathLike,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        epoch: int = 0,
        num_threads: Optional[int] = None,
        prefetch: int = 2,
        verify: bool = False,
        follow: bool = False,
        follow_timeout: Optional[float] = None,
        device: Device = None,
        num_buffers: int = 4,
        host_buffers: Optional[str] = None,
    ) -> None:
        d, n, hb = self._options(device, num_buffers, host_buffers)
        host = self._module.Loader(
            cache_dir, batch_size=batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
            drop_last=drop_last, epoch=epoch, num_threads=num_threads, prefetch=prefetch, verify=verify,
            follow=follow, follow_timeout=follow_timeout,
            follow_broadcast=_round_broadcast(follow, rank, world_size, follow_timeout),
        )
        super().__init__(host, host._l, d, n, hb)


class DSparkDataset(Eagle3Dataset):
    """DSpark batches (:class:`shardkit.dspark.Loader`'s arguments: ``input_ids``,
    ``loss_mask``, ``target_hidden_states``, ``target_last_hidden_states``) as dicts of torch
    tensors (bf16 as ``torch.bfloat16``). Every argument is checked here, in the constructing
    process."""

    _module = dspark


class DSparkLoader(Eagle3Loader):
    """DSpark batches as tensors on ``device`` (default: :func:`default_device`), bf16 as
    ``torch.bfloat16``; other arguments are :class:`shardkit.dspark.Loader`'s."""

    _module = dspark


_args.guard_module(globals(), __all__)
