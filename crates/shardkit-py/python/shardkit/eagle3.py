"""EAGLE-3 offline target-output caches (NVIDIA NeMo Automodel): write, read, load.

A cache directory holds ``manifest.json`` (the run configuration, ``format_version`` 1 or 2),
``shard-NNNNNN.safetensors`` (sample ``i`` is row ``i % shard_size`` of shard
``i // shard_size``) and ``target_embeddings.safetensors``. Per sample: ``input_ids``,
``attention_mask``, ``loss_mask`` int64 ``[S]``, ``aux_hidden_states`` ``[S, 3H]`` and
``target_probs`` ``[S, Vd]`` in the cache dtype (bf16, fp16 or fp32), ``position_mask`` bool
``[S, 1]``. Version-2 top-k caches store ``target_probs_values`` / ``target_probs_indices``
``[S, k]``; reading them gives the full-width ``target_probs``.

bf16 arrays are ``ml_dtypes.bfloat16`` when ml_dtypes is installed, otherwise ``uint16`` arrays
of the raw bit patterns. Items are read-only views of the shards' memory maps; loader batches
are writable arrays over one buffer per batch; neither is copied on the way.
"""

from __future__ import annotations

import collections.abc
import json
import os
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _shardkit as _core
from ._progress import Progress
from .errors import IncompleteDatasetError, InvalidArgumentError
from .types import EngineLoader, Eagle3Batch, LoaderState, Validation, check_state

try:  # bf16 as a real numpy dtype when available
    import ml_dtypes as _ml_dtypes

    _BF16: Any = _ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - exercised when ml_dtypes is absent
    _BF16 = None

PathLike = Union[str, "os.PathLike[str]"]
Sample = Dict[str, np.ndarray]

__all__ = [
    "Writer",
    "Cache",
    "Loader",
    "open",
    "collate",
    "to_torch",
    "validate",
    "inspect",
    "set_version",
    "IncompleteDatasetError",
]

#: The fields of an item and of a batch, in NeMo's collate order.
ITEM_FIELDS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "aux_hidden_states",
    "position_mask",
    "target_probs",
)


def _view(buf: Any, code: str) -> np.ndarray:
    a = np.asarray(buf)
    if code == "BF16" and _BF16 is not None:
        a = a.view(_BF16)
    return a


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even, through float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def _coerce(x: Any, code: str, name: str) -> np.ndarray:
    """``x`` as a C-contiguous array of the stored dtype ``code``."""
    a = np.asarray(x)
    if code == "BF16":
        if _BF16 is not None and a.dtype == _BF16:
            pass
        elif a.dtype == np.uint16:
            pass  # bit patterns
        elif np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float32).astype(_BF16) if _BF16 is not None else _bf16_bits(a)
        else:
            raise TypeError(f"{name}: expected floats or bfloat16 (as ml_dtypes or uint16 bits), got {a.dtype}")
    elif code in ("F16", "F32"):
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"{name}: expected floats, got {a.dtype}")
        a = a.astype(np.float16 if code == "F16" else np.float32, copy=False)
    elif code in ("I64", "I32"):
        if a.dtype != np.bool_ and not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected integers, got {a.dtype}")
        if code == "I32" and a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise InvalidArgumentError(f"{name}: values do not fit int32")
        a = a.astype(np.int64 if code == "I64" else np.int32, copy=False)
    elif code == "BOOL":
        if a.dtype != np.bool_:
            if not np.issubdtype(a.dtype, np.integer) or (a.size and (a.min() < 0 or a.max() > 1)):
                raise InvalidArgumentError(f"{name}: expected booleans (or 0/1), got {a.dtype}")
            a = a.astype(np.bool_)
    return np.ascontiguousarray(a)


class Writer:
    """Writes a cache: samples accumulate into shards of ``shard_size``, each written atomically
    and durably; the manifest is written first.

    ``manifest`` is the run configuration NeMo's producer writes (``target_model``,
    ``target_vocab_size``, ``draft_vocab_size``, ``seq_length``, ``dtype``, ``num_samples``,
    ``shard_size``, ``aux_hidden_dim``, ``aux_layer_ids``, ``selected_token_ids``, and optionally
    ``target_probs_topk``, ``input_data``, ``split``, ``shuffle_seed``). ``format_version`` is
    1 (the default) or 2 (what current NeMo accepts; required for top-k); a ``format_version``
    inside ``manifest`` is ignored.

    A cache that already has shards is refused unless ``resume=True``. Resuming requires the
    same configuration (the differing keys are listed) and a contiguous prefix of shards, and
    continues at ``next_sample``. As a context manager, a clean exit finishes the cache (every
    sample must have been added); an exception leaves it resumable.

    ``cache_dir`` may be an ``s3://bucket/prefix`` URL: each shard is uploaded in the background
    as soon as it is written (the local staging directory holds a few shards), manifest.json last
    on exit; a killed write resumes (``resume=True``) from what the store holds, on any machine.
    A lock object in the store keeps out a second writer on any machine (``LockedError``).
    """

    def __init__(
        self,
        cache_dir: PathLike,
        manifest: Dict[str, Any],
        *,
        resume: bool = False,
        format_version: int = 1,
        progress: Any = None,
    ) -> None:
        self._w = _core.Eagle3Writer(os.fspath(cache_dir), json.dumps(manifest), int(format_version), resume)
        self.path = os.fspath(cache_dir)
        self.manifest: Dict[str, Any] = json.loads(self._w.manifest_json)
        self._fields = {f["name"]: (f["dtype"], tuple(f["shape"])) for f in self._w.fields}
        self._closed = False
        self._progress = Progress(
            progress, unit="sample", total=int(self.manifest["num_samples"]), initial=self.next_sample
        )

    @property
    def fields(self) -> Dict[str, Tuple[Any, ...]]:
        """Stored tensor name -> (safetensors dtype code, shape of one sample's row)."""
        return dict(self._fields)

    @property
    def next_sample(self) -> int:
        """The first sample still to be written (``k * shard_size`` after a resume)."""
        return self._w.next_sample

    @property
    def resumed_from(self) -> Optional[int]:
        """The sample this writer started at, when the cache had shards already."""
        return self._w.resumed_from

    def add(self, sample: Dict[str, Any]) -> None:
        """Adds one sample: a dict of arrays without the batch dimension."""
        self.add_batch({k: np.asarray(v)[None] for k, v in sample.items()})

    def add_batch(self, batch: Dict[str, Any]) -> None:
        """Adds samples stacked on dim 0 (every stored field, the same batch size)."""
        unknown = sorted(set(batch) - set(self._fields))
        if unknown:
            raise InvalidArgumentError(f"{unknown} are not tensors of this cache (it stores {sorted(self._fields)})")
        missing = sorted(set(self._fields) - set(batch))
        if missing:
            raise InvalidArgumentError(f"missing {missing}")
        arrays = {}
        n = None
        for name, (code, row) in self._fields.items():
            a = _coerce(batch[name], code, name)
            if a.ndim != len(row) + 1 or tuple(a.shape[1:]) != row:
                raise InvalidArgumentError(f"{name}: shape {a.shape}, expected (batch, {', '.join(map(str, row))})")
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise InvalidArgumentError(f"{name}: {a.shape[0]} samples, the other fields have {n}")
            arrays[name] = a.reshape(-1).view(np.uint8)
        self._w.add_rows(int(n or 0), arrays)
        self._progress.advance(int(n or 0), self.next_sample, int(self.manifest["num_samples"]))

    def write_target_embeddings(self, array: Any) -> None:
        """Writes ``target_embeddings.safetensors``: ``weight``, float32 ``[vocab_rows, hidden]``."""
        a = np.ascontiguousarray(array, dtype=np.float32)
        if a.ndim != 2:
            raise InvalidArgumentError(f"embeddings must be 2-D [vocab_rows, hidden], got shape {a.shape}")
        self._w.write_target_embeddings(a.reshape(-1).view(np.uint8), a.shape[0], a.shape[1])

    def close(self) -> str:
        """Finishes the cache; raises IncompleteDatasetError (and stays resumable) when samples
        are missing."""
        if self._closed:
            return self.path
        self._closed = True
        self._progress.close()
        return self._w.finish()

    def abort(self) -> None:
        """Stops without finishing; the shards written stay and ``resume=True`` continues."""
        if not self._closed:
            self._closed = True
            self._progress.close()
            self._w.abort()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _item(fields: Sequence[Any]) -> Sample:
    return {f["name"]: _view(f["array"], f["dtype"]) for f in fields}


class Cache(collections.abc.Sequence):  # type: ignore[type-arg]
    """A cache opened for reading: ``len(cache) == num_samples``, ``cache[i]`` -> dict of arrays.

    Shards are memory-mapped on first use (at most ``max_open`` at a time). The object pickles
    without its handles and reopens them in each process, so PyTorch DataLoader workers work
    with fork and spawn alike.
    """

    def __init__(self, cache_dir: PathLike, max_open: int = 64) -> None:
        self.path = os.fspath(cache_dir)
        self.max_open = int(max_open)
        self._c: Any = None
        self._pid = -1
        self._len = len(self._core())
        self.manifest: Dict[str, Any] = json.loads(self._core().manifest_json)

    def _core(self) -> Any:
        if self._c is None or self._pid != os.getpid():
            self._c = _core.Eagle3Cache(self.path, self.max_open)
            self._pid = os.getpid()
        return self._c

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"sample indices must be integers or slices, not {type(i).__name__}")
        return _item(self._core().item(int(i)))

    def target_embeddings(self) -> np.ndarray:
        """The embedding table, float32 ``[vocab_rows, hidden]`` (read-only, memory-mapped)."""
        return np.asarray(self._core().target_embeddings())

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "max_open": self.max_open, "_len": self._len, "manifest": self.manifest}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._c, self._pid = None, -1

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"eagle3.Cache({self.path!r}, num_samples={self._len}, dtype={m.get('dtype')!r}, "
            f"seq_length={m.get('seq_length')}, format_version={m.get('format_version')})"
        )


def open(cache_dir: PathLike, max_open: int = 64) -> Cache:  # noqa: A001 - mirrors the built-in
    """Opens a cache; an unfinished one raises IncompleteDatasetError naming the missing samples."""
    return Cache(cache_dir, max_open)


def collate(items: Sequence[Sample]) -> Sample:
    """Stacks items into a batch (each field on a new dim 0), as NeMo's collate does."""
    if not items:
        raise InvalidArgumentError("cannot collate an empty list of items")
    return {k: np.stack([it[k] for it in items]) for k in items[0]}


def to_torch(batch: Sample) -> Dict[str, Any]:
    """The batch as torch tensors, sharing memory (bf16 included, through its bit pattern)."""
    import torch  # noqa: WPS433 - optional dependency

    out = {}
    for k, a in batch.items():
        if (_BF16 is not None and a.dtype == _BF16) or (a.dtype == np.uint16 and k in ("aux_hidden_states", "target_probs")):
            out[k] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            out[k] = torch.from_numpy(a)
    return out


class Loader(EngineLoader):
    """Batches of a cache: shuffled per epoch (or in order), split across ranks the way PyTorch's
    ``DistributedSampler`` does, read with many reads in flight a few batches ahead.

    Each rank gets ``ceil(N / world_size)`` samples, padded by wrapping around to the start of
    the epoch's order (or, with ``drop_last``, ``floor(N / world_size)`` and only full batches).
    ``rank`` and ``world_size`` default to ``$RANK`` and ``$WORLD_SIZE``. Iterating continues
    from the loader's position (``state_dict()`` saves it); a finished epoch starts over;
    ``set_epoch`` switches to another order.
    """

    def __init__(
        self,
        cache_dir: PathLike,
        *args: Any,
        batch_size: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        epoch: int = 0,
        num_threads: Optional[int] = None,
        prefetch: int = 2,
        io_threads: Optional[int] = None,
        verify: bool = False,
    ) -> None:
        if args:
            # The old signature took (batch_size, shuffle, seed, rank, world_size, drop_last)
            # by position; every loader now takes keywords.
            names = ["batch_size", "shuffle", "seed", "rank", "world_size", "drop_last"]
            if len(args) > len(names):
                raise TypeError(f"Loader takes at most {len(names) + 1} positional arguments")
            warnings.warn(
                f"pass {', '.join(names[:len(args)])} by keyword (every shardkit loader takes the same keywords)",
                DeprecationWarning,
                stacklevel=2,
            )
            given = dict(zip(names, args))
            batch_size = given.get("batch_size", batch_size)
            shuffle = given.get("shuffle", shuffle)
            seed = given.get("seed", seed)
            rank = given.get("rank", rank)
            world_size = given.get("world_size", world_size)
            drop_last = given.get("drop_last", drop_last)
        if batch_size is None:
            raise TypeError("Loader() needs batch_size")
        if io_threads is not None:
            warnings.warn(
                "io_threads is now num_threads (threads that read rows into batches; the reads "
                "of the next batches are started ahead whatever their number)",
                DeprecationWarning,
                stacklevel=2,
            )
            num_threads = num_threads or io_threads
        self.path = os.fspath(cache_dir)
        self._l = _core.Eagle3Loader(
            self.path, int(batch_size), bool(shuffle), int(seed), int(epoch), rank, world_size,
            bool(drop_last), int(num_threads or 0), int(prefetch), bool(verify),
        )

    def indices(self) -> List[int]:
        """This rank's sample indices for the current epoch, in order."""
        return list(self._l.indices())

    def state_dict(self) -> LoaderState:
        """``{"format", "seed", "epoch", "batch", "batch_size", "world_size"}`` (see
        :class:`shardkit.types.LoaderState`): save it with your checkpoint."""
        return {"format": "eagle3", **self._l.state_dict()}  # type: ignore[typeddict-item]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(dict(state), "eagle3")
        self._l.load_state_dict({k: v for k, v in state.items() if k != "format"})

    def __iter__(self) -> Iterator[Eagle3Batch]:
        if self._l.state_dict()["batch"] >= len(self):
            self._l.advance_to(0)  # a finished epoch starts over, as PyTorch's samplers do
        it = self._l.iter()
        try:
            for b in it:
                self._l.advance_to(b["cursor"])
                yield _item(b["fields"])  # type: ignore[misc]
        finally:
            it.close()


def validate(cache_dir: PathLike, deep: bool = False) -> Validation:
    """``{"path", "valid", "errors", "notes"}``, each finding ``{"file", "message"}``
    (:class:`shardkit.types.Validation`, the same for every format); ``deep`` reads every value
    (NaN/Inf, masks, sums) and checks the checksums sidecar."""
    report: Validation = json.loads(_core.eagle3_validate(os.fspath(cache_dir), deep))
    return report


def inspect(cache_dir: PathLike) -> Dict[str, Any]:
    """Configuration, sizes and completeness."""
    info: Dict[str, Any] = json.loads(_core.eagle3_inspect(os.fspath(cache_dir)))
    return info


def set_version(cache_dir: PathLike, version: int) -> Dict[str, Any]:
    """Switches a cache between format_version 1 and 2 by rewriting only its manifest."""
    out: Dict[str, Any] = json.loads(_core.eagle3_set_version(os.fspath(cache_dir), int(version)))
    return out
