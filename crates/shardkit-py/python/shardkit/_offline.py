"""NVIDIA NeMo Automodel's offline-cache family, EAGLE-3 and DSpark: one implementation of
the writers, the reader and the loader (the Rust core's ``shardkit::offline``), which
``shardkit.eagle3`` and ``shardkit.dspark`` present as each cache's own module. A cache's
manifest says which member it is (``aux_hidden_dim``: EAGLE-3; ``target_hidden_dim``:
DSpark); each module's classes refuse the other's caches.

bf16 arrays are ``ml_dtypes.bfloat16`` when ml_dtypes is installed, otherwise ``uint16`` arrays
of the raw bit patterns. Items are read-only views of the shards' memory maps; loader batches
are writable arrays over one buffer per batch; neither is copied on the way.
"""

from __future__ import annotations

import collections.abc
import json
import os
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union, cast

import numpy as np

from . import _args, _inputs
from . import _shardkit as _core
from ._progress import Closing, Parting, Progress
from .errors import IncompleteDatasetError, InvalidArgumentError, InvalidArgumentTypeError
from .types import EngineLoader, Eagle3Batch, FollowBroadcast, LoaderState, Validation, check_state

try:  # bf16 as a real numpy dtype when available
    import ml_dtypes as _ml_dtypes

    _BF16: Any = _ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - exercised when ml_dtypes is absent
    _BF16 = None

PathLike = Union[str, "os.PathLike[str]"]
Sample = Dict[str, np.ndarray]

#: The fields of an item and of a batch of each member, in NeMo's collate order.
ITEM_FIELDS = {
    "eagle3": ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs"),
    "dspark": ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"),
}

#: The target weights file and its tables, per member.
WEIGHTS = {
    "eagle3": ("target_embeddings.safetensors", ("weight",)),
    "dspark": ("target_weights.safetensors", ("embed_tokens.weight", "lm_head.weight")),
}

#: The float fields, whose bf16 values may come as uint16 bit patterns (no ml_dtypes).
_FLOAT_FIELDS = ("aux_hidden_states", "target_probs", "target_hidden_states", "target_last_hidden_states")


def _member_of(manifest: Mapping[str, Any]) -> Optional[str]:
    """The member a run configuration describes, from the key that sizes its hidden states."""
    found = [name for name, key in (("eagle3", "aux_hidden_dim"), ("dspark", "target_hidden_dim")) if key in manifest]
    return found[0] if len(found) == 1 else None


def _require(schema: str, found: Optional[str], path: str) -> None:
    """Refuses a cache (or configuration) of the other member in this member's module."""
    if schema and found is not None and found != schema:
        names = {"eagle3": "an EAGLE-3", "dspark": "a DSpark"}
        raise InvalidArgumentError(
            f"{path}: is {names[found]} cache (configuration); use shardkit.{found}, not shardkit.{schema}")


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


#: The cache dtype of each float code, with its largest finite value.
_FLOAT_CODES = {"BF16": ("bf16", 3.3895313892515355e38), "F16": ("fp16", 65504.0), "F32": ("fp32", 3.4028234663852886e38)}


def _coerce(x: Any, code: str, name: str, path: str, first: int) -> np.ndarray:
    """``x`` as a C-contiguous array of the stored dtype ``code`` (see the Writer's docstring
    for what each field takes). ``first`` is the cache's sample of row 0, for messages."""

    def where(i: Tuple[int, ...]) -> str:
        return f"sample {first + i[0]}" + (f", position {i[1]}" if len(i) > 1 else "")

    a = _inputs.array(x, name, path)
    if code in _FLOAT_CODES:
        dt, largest = _FLOAT_CODES[code]
        if code == "BF16" and ((_BF16 is not None and a.dtype == _BF16) or a.dtype == np.uint16):
            return np.ascontiguousarray(a)  # bfloat16 already, or its bit patterns
        if a.dtype.name == "bfloat16":
            a = a.astype(np.float32)  # exact
        if a.dtype.kind != "f":
            raise InvalidArgumentTypeError(
                f"{path}: `{name}` must hold floats (rounded to the cache dtype {dt}), got {a.dtype}"
            )
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
            if code == "BF16":
                out = a.astype(np.float32).astype(_BF16) if _BF16 is not None else _bf16_bits(a)
                wide = out.astype(np.float32) if _BF16 is not None else (out.astype(np.uint32) << 16).view(np.float32)
            else:
                out = a.astype(np.float16 if code == "F16" else np.float32)
                wide = out
            overflow = np.isfinite(a) & ~np.isfinite(wide)
        if overflow.any():
            idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(overflow)), a.shape))
            raise _inputs.refused(
                path, name, where(idx), repr(a[idx].item()),
                f"finite values within +-{largest:.6g}, the range of the cache dtype {dt}",
            )
        return np.ascontiguousarray(out)
    if code in ("I64", "I32"):
        bits = 64 if code == "I64" else 32
        return _inputs.integers(
            None, name, path, a=a, dtype=np.int64 if code == "I64" else np.int32,
            lo=-(1 << (bits - 1)), hi=(1 << (bits - 1)) - 1, allowed=f"int{bits} values (the cache stores int{bits})",
            where=where, booleans=name.endswith("_mask"),
        )
    if code == "BOOL":
        return _inputs.integers(None, name, path, a=a, dtype=np.bool_, lo=0, hi=1, allowed="0 or 1 (bool)",
                                where=where, booleans=True)
    raise InvalidArgumentError(f"{path}: `{name}` has stored dtype {code}, which this writer does not know")  # pragma: no cover


def _batch_arrays(fields: Dict[str, Tuple[Any, ...]], path: str, first: int, batch: Any) -> Tuple[int, Dict[str, np.ndarray]]:
    """The stored fields of ``batch`` (samples stacked on dim 0, the first being ``first``) as
    uint8 views of C-contiguous arrays in the cache dtypes, checked; and the batch size."""
    if not isinstance(batch, Mapping):
        raise InvalidArgumentTypeError(f"{path}: a batch is a dict of arrays, got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(fields))
    if unknown:
        raise InvalidArgumentError(f"{unknown} are not tensors of this cache (it stores {sorted(fields)})")
    missing = sorted(set(fields) - set(batch))
    if missing:
        raise InvalidArgumentError(f"missing {missing}")
    arrays = {}
    n = None
    for name, (code, row) in fields.items():
        a = _coerce(batch[name], code, name, path, first)
        if a.ndim != len(row) + 1 or tuple(a.shape[1:]) != row:
            raise InvalidArgumentError(
                f"{path}: `{name}` must have shape (b, {', '.join(map(str, row))}) = (batch, "
                f"{'seq_length' if len(row) == 1 else 'seq_length, ' + str(row[1])}); got {tuple(a.shape)}"
            )
        if n is None:
            n = a.shape[0]
        elif a.shape[0] != n:
            raise InvalidArgumentError(f"{name}: {a.shape[0]} samples, the other fields have {n}")
        arrays[name] = a.reshape(-1).view(np.uint8)
    return int(n or 0), arrays


def _write_weights(core: Any, path: str, manifest: Mapping[str, Any], tables: Mapping[str, Any]) -> None:
    """Writes the target weights file from ``tables`` (name -> 2-D array ``[vocab_rows,
    hidden]``): EAGLE-3 stores them float32 (float16/bfloat16 widened exactly), DSpark in the
    cache dtype (rounded to nearest even, as torch's ``.to`` does)."""
    member = _member_of(manifest) or "eagle3"
    code = "F32" if member == "eagle3" else {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[manifest["dtype"]]
    out = []
    for name, x in tables.items():
        if member == "eagle3":
            a = _inputs.float32(x, name, path)
        else:
            a = _coerce(x, code, name, path, 0)
        if a.ndim != 2:
            raise InvalidArgumentError(
                f"{path}: `{name}` must have shape (vocab_rows, hidden), 2-D; got {tuple(a.shape)}")
        out.append((name, np.ascontiguousarray(a).reshape(-1).view(np.uint8), int(a.shape[0]), int(a.shape[1])))
    core.write_target_weights(out)


class Writer(Closing[str]):
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

    _w: _core.Eagle3Writer
    #: The member this class writes ("eagle3", "dspark"); set by each member's module.
    _schema = ""

    def __init__(
        self,
        cache_dir: PathLike,
        manifest: Dict[str, Any],
        *,
        resume: bool = False,
        format_version: int = 1,
        progress: Any = None,
    ) -> None:
        cache_dir = _args.path("cache_dir", cache_dir)
        if not isinstance(manifest, Mapping):
            raise _args.InvalidArgumentTypeError(
                f"manifest must be a dict (the run configuration), got {type(manifest).__name__}")
        format_version = _args.integer("format_version", format_version, lo=0, hi=255, rule="1 or 2")
        _require(self._schema, _member_of(manifest), cache_dir)
        self._w = _core.Eagle3Writer(cache_dir, json.dumps(manifest), format_version, _args.boolean("resume", resume))
        self.path = cache_dir
        self.manifest: Dict[str, Any] = json.loads(self._w.manifest_json)
        self._fields = {f["name"]: (f["dtype"], tuple(f["shape"])) for f in self._w.fields}
        self._closed = False
        self._progress = Progress(
            _args.callback("progress", progress), unit="sample", total=int(self.manifest["num_samples"]), initial=self.next_sample
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
        """Adds one sample: a dict of arrays without the batch dimension (see ``add_batch``)."""
        if not isinstance(sample, Mapping):
            raise InvalidArgumentTypeError(f"{self.path}: a sample is a dict of arrays, got {type(sample).__name__}")
        self.add_batch({k: _inputs.array(v, str(k), self.path)[None] for k, v in sample.items()})

    def add_batch(self, batch: Dict[str, Any]) -> None:
        """Adds samples stacked on dim 0 (every stored field, the same batch size).

        Arrays may be numpy arrays, torch tensors or nested lists. Float fields take floats of
        any width (torch and ml_dtypes bfloat16 included), rounded to the cache dtype; a value
        that overflows it is refused. Integer fields take integers (masks also bools); floats
        are refused. Every value must follow the rules ``validate(deep=True)`` checks: finite
        floats, probabilities not negative and, lossless, each ``target_probs`` row summing to
        1 within the dtype's tolerance; masks 0 or 1, ``position_mask`` only where
        ``loss_mask`` is 1; ``input_ids`` below ``target_vocab_size``; top-k indices below
        ``draft_vocab_size``. A batch breaking one raises InvalidArgumentError naming the field,
        the sample, the position, the value and the rule, and nothing of it is stored.
        """
        n, arrays = _batch_arrays(self._fields, self.path, self.next_sample, batch)
        self._w.add_rows(n, arrays)
        self._progress.advance(n, self.next_sample, int(self.manifest["num_samples"]))

    def write_target_embeddings(self, array: Any) -> None:
        """Writes ``target_embeddings.safetensors``: ``weight``, float32 ``[vocab_rows, hidden]``
        (float16/bfloat16 widened exactly; float64 or integers only where float32 holds every
        value exactly)."""
        _write_weights(self._w, self.path, self.manifest, {"weight": array})

    def close(self) -> str:
        """Finishes the cache; raises IncompleteDatasetError (and stays resumable) when samples
        are missing."""
        return self._close_once(self._w.finish)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"{self._schema or 'eagle3'}.Writer({self.path!r}, next_sample={self.next_sample}, "
            f"num_samples={self.manifest.get('num_samples')}, shard_size={self.manifest.get('shard_size')}, {state})"
        )


class PartWriter(Parting):
    """Writes this process's part of one cache that several processes write together, as
    NeMo's distributed producer does: ``total_samples`` is known up front, and rank ``rank`` of
    ``world_size`` writes the shards ``shardkit.part_of(ceil(total_samples / shard_size), rank)``
    (contiguous, shard-aligned: samples ``samples[0]`` to ``samples[1]``) into the same
    ``cache_dir``. The rank that completes the set commits the cache (checksums sidecar, then
    ``manifest.json`` last), exactly as one ``Writer`` would have written it, byte for byte.
    Without ``rank`` and ``world_size`` they come from the launcher: ``RANK``/``WORLD_SIZE``
    (torchrun), Slurm or MPI variables. No collective is needed: the ranks coordinate through
    the directory (a shared file system across nodes), or through the store itself for an
    ``s3://`` URL (conditional writes and leases; see docs/parallel.md).

    ``manifest`` is the run configuration (as ``Writer`` takes it; ``num_samples`` may be left
    out, it is ``total_samples``); every rank must give the same, and the same
    ``format_version`` and ``target_embeddings``: a rank that differs is refused, naming the
    keys, before it writes anything. With ``target_embeddings=True`` the commit waits for
    ``target_embeddings.safetensors``: any rank writes it with ``write_target_embeddings``
    (typically rank 0 first thing, as NeMo's producer does; a rank giving the same table again
    writes nothing, another table is refused).

    Until the commit the directory has no ``manifest.json``: ``open`` raises
    ``IncompleteDatasetError`` naming the shards missing, and ``validate`` reports them. Each
    shard is durable as soon as it is full. After a kill, start the job again with the same or
    another world size: ``pending`` lists the samples this rank still owes (shards already
    durable are kept). As a context manager, a clean exit finishes the part (and commits if it
    completes the set); an exception leaves it to a restart. ``close()`` returns ``status()``.
    """

    _w: _core.Eagle3PartWriter
    _schema = ""

    def __init__(
        self,
        cache_dir: PathLike,
        manifest: Dict[str, Any],
        total_samples: int,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        format_version: int = 1,
        target_embeddings: bool = False,
        progress: Any = None,
    ) -> None:
        cache_dir = _args.path("cache_dir", cache_dir)
        if not isinstance(manifest, Mapping):
            raise _args.InvalidArgumentTypeError(
                f"manifest must be a dict (the run configuration), got {type(manifest).__name__}")
        total_samples = _args.count("total_samples", total_samples)
        rank = None if rank is None else _args.count("rank", rank)
        world_size = None if world_size is None else _args.count("world_size", world_size)
        format_version = _args.integer("format_version", format_version, lo=0, hi=255, rule="1 or 2")
        _require(self._schema, _member_of(manifest), cache_dir)
        self._w = _core.Eagle3PartWriter(
            cache_dir, json.dumps(manifest), total_samples, format_version,
            _args.boolean("target_embeddings", target_embeddings), rank, world_size,
        )
        self.path: str = self._w.path
        self.manifest: Dict[str, Any] = json.loads(self._w.manifest_json)
        self._fields = {f["name"]: (f["dtype"], tuple(f["shape"])) for f in self._w.fields}
        first, end = self._w.samples
        self._progress = Progress(_args.callback("progress", progress), unit="sample", total=end - first,
                                  initial=end - first - self._owed())
        self._closed = False

    @property
    def fields(self) -> Dict[str, Tuple[Any, ...]]:
        """Stored tensor name -> (safetensors dtype code, shape of one sample's row)."""
        return dict(self._fields)

    @property
    def samples(self) -> Tuple[int, int]:
        """(first, end) of the samples this rank's part covers."""
        first, end = self._w.samples
        return (int(first), int(end))

    @property
    def next_sample(self) -> Optional[int]:
        """The sample the next ``add_batch`` begins at (None once the part is written)."""
        return self._w.next_sample

    def add(self, sample: Dict[str, Any]) -> None:
        """Adds the next pending sample: a dict of arrays without the batch dimension."""
        if not isinstance(sample, Mapping):
            raise InvalidArgumentTypeError(f"{self.path}: a sample is a dict of arrays, got {type(sample).__name__}")
        self.add_batch({k: _inputs.array(v, str(k), self.path)[None] for k, v in sample.items()})

    def add_batch(self, batch: Dict[str, Any]) -> None:
        """Adds the next ``b`` pending samples, stacked on dim 0 (inputs and checks as
        ``Writer.add_batch``); the writer moves from one pending range to the next by itself."""
        n, arrays = _batch_arrays(self._fields, self.path, self.next_sample or 0, batch)
        self._w.add_rows(n, arrays)
        first, end = self._w.samples
        self._progress.advance(n, end - first - self._owed(), end - first)

    def write_target_embeddings(self, array: Any) -> None:
        """Writes ``target_embeddings.safetensors`` (float32 ``[vocab_rows, hidden]``) once for
        the cache; only with ``target_embeddings=True``."""
        _write_weights(self._w, self.path, self.manifest, {"weight": array})


    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        first, end = self.samples
        return (f"{self._schema or 'eagle3'}.PartWriter({self.path!r}, rank={self.rank}, world_size={self.world_size}, "
                f"samples={first}..{end}, {state})")


def status(cache_dir: PathLike) -> Dict[str, Any]:
    """Where a cache written in parts stands: ``{"committed", "units" (shards), "done",
    "missing" ([first, end] shard ranges), "claimed" ([{"units", "by"}] of live ranks)}``, and
    ``"missing_files": ["target_embeddings.safetensors"]`` while declared embeddings are owed."""
    st: Dict[str, Any] = json.loads(_core.eagle3_status(_args.path("cache_dir", cache_dir)))
    return st


def commit_parts(cache_dir: PathLike) -> Dict[str, Any]:
    """Commits a cache written in parts whose every part is durable (its last rank was killed
    while committing); returns ``status()``. A committed cache is left as it is."""
    st: Dict[str, Any] = json.loads(_core.eagle3_commit_parts(_args.path("cache_dir", cache_dir)))
    return st


def _item(fields: Sequence[Any]) -> Sample:
    return {f["name"]: _view(f["array"], f["dtype"]) for f in fields}


class Cache(collections.abc.Sequence):  # type: ignore[type-arg]
    """A cache opened for reading: ``len(cache) == num_samples``, ``cache[i]`` -> dict of arrays.

    Shards are memory-mapped on first use (at most ``max_open`` at a time). The object pickles
    without its handles and reopens them in each process, so PyTorch DataLoader workers work
    with fork and spawn alike.
    """

    _schema = ""

    def __init__(self, cache_dir: PathLike, max_open: int = 64) -> None:
        self.path = _args.path("cache_dir", cache_dir)
        self.max_open = _args.integer("max_open", max_open, lo=1, hi=1 << 20)
        self._c: Any = None
        self._pid = -1
        self._len = len(self._core())
        _require(self._schema, self._core().schema, self.path)
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
            raise _args.InvalidArgumentTypeError(f"sample indices must be integers or slices, not {type(i).__name__}")
        return _item(self._core().item(int(i)))

    def target_weights(self) -> Dict[str, np.ndarray]:
        """The target weights file's tables by name, ``[vocab_rows, hidden]`` each (read-only,
        memory-mapped): EAGLE-3's ``weight`` (float32), DSpark's ``embed_tokens.weight`` and
        ``lm_head.weight`` (the cache dtype, or float32 as older NeMo wrote them)."""
        return {name: _view(buf, code) for name, code, buf in self._core().target_weights()}

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
            f"{self._schema or 'eagle3'}.Cache({self.path!r}, num_samples={self._len}, dtype={m.get('dtype')!r}, "
            f"seq_length={m.get('seq_length')}, format_version={m.get('format_version')})"
        )


CacheT = TypeVar("CacheT", bound="Cache")


def open_cache(cls: Type[CacheT], cache_dir: PathLike, max_open: int = 64) -> CacheT:
    """Opens a cache as ``cls``; an unfinished one raises IncompleteDatasetError naming the
    missing samples."""
    return cls(cache_dir, max_open)


def collate(items: Sequence[Sample]) -> Sample:
    """Stacks items into a batch (each field on a new dim 0), as NeMo's collate does."""
    if isinstance(items, Mapping) or not isinstance(items, Sequence):
        raise _args.InvalidArgumentTypeError(f"items must be a list of items (dicts of arrays), got {type(items).__name__}")
    if not items:
        raise InvalidArgumentError("cannot collate an empty list of items")
    keys = set(items[0])
    for n, it in enumerate(items):
        if not isinstance(it, Mapping):
            raise _args.InvalidArgumentTypeError(f"items[{n}] must be a dict of arrays, got {type(it).__name__}")
        if set(it) != keys:
            raise InvalidArgumentError(f"items[{n}] has fields {sorted(it)}, items[0] has {sorted(keys)}")
    return {k: np.stack([it[k] for it in items]) for k in items[0]}


def to_torch(batch: Sample) -> Dict[str, Any]:
    """The batch as torch tensors, sharing memory (bf16 included, through its bit pattern)."""
    import torch  # noqa: WPS433 - optional dependency

    if not isinstance(batch, Mapping):
        raise _args.InvalidArgumentTypeError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    out = {}
    for k, a in batch.items():
        if (_BF16 is not None and a.dtype == _BF16) or (a.dtype == np.uint16 and k in _FLOAT_FIELDS):
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

    ``follow=True`` reads a cache while :class:`PartWriter` ranks write it (in a directory or
    an ``s3://`` prefix, which the loader only reads): each epoch is served in rounds of the shards
    durable when the round starts (the planned order restricted to their samples, the last
    batch of a round partial), new shards are picked up as they land, every sample is served
    once per epoch, and ``state_dict`` resumes exactly; a loader that has served every durable
    shard waits up to ``follow_timeout`` seconds (default 3600) for another, then raises
    IncompleteDatasetError naming the missing shards and who claims them. On a cache still
    being written it reads without ``drop_last`` or ``verify``, and with ``world_size`` > 1
    only given ``follow_broadcast`` (:data:`shardkit.types.FollowBroadcast`; shardkit.torch's
    loaders build it over torch.distributed): rank 0 alone looks for shards and broadcasts each
    round, which the ranks split as the epoch is split (the epoch's last round padded as the
    epoch is). Once committed, an epoch is the plain loader's. See docs/eagle3.md, "Reading
    while it is written".
    """

    _schema = ""

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
        follow: bool = False,
        follow_timeout: Optional[float] = None,
        follow_broadcast: Optional[FollowBroadcast] = None,
    ) -> None:
        if args:
            # The old signature took (batch_size, shuffle, seed, rank, world_size, drop_last)
            # by position; every loader now takes keywords.
            names = ["batch_size", "shuffle", "seed", "rank", "world_size", "drop_last"]
            if len(args) > len(names):
                raise _args.InvalidArgumentTypeError(f"Loader takes at most {len(names) + 1} positional arguments")
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
            raise _args.InvalidArgumentTypeError(
                f"{self._schema or 'eagle3'}.Loader() needs batch_size (samples per batch on each rank)")
        cache_dir = _args.path("cache_dir", cache_dir)
        batch_size = _args.count("batch_size", batch_size, lo=1)
        shuffle = _args.boolean("shuffle", shuffle)
        seed = _args.count("seed", seed)
        _args.rank_world(rank, world_size)
        drop_last = _args.boolean("drop_last", drop_last)
        epoch = _args.count("epoch", epoch)
        if io_threads is not None:
            _args.threads("io_threads", io_threads)
        num_threads = _args.threads("num_threads", num_threads)
        prefetch = _args.count("prefetch", prefetch, lo=1)
        verify = _args.boolean("verify", verify)
        follow = _args.boolean("follow", follow)
        follow_timeout = _args.follow_timeout(follow, follow_timeout)
        follow_broadcast = _args.follow_broadcast(follow, follow_broadcast)
        if io_threads is not None:
            warnings.warn(
                "io_threads is now num_threads (threads that read rows into batches; the reads "
                "of the next batches are started ahead whatever their number)",
                DeprecationWarning,
                stacklevel=2,
            )
            num_threads = num_threads or io_threads
        self.path = cache_dir
        self._l = _core.Eagle3Loader(
            self.path, batch_size, shuffle, seed, epoch, rank, world_size,
            drop_last, num_threads or 0, prefetch, verify, follow, follow_timeout, follow_broadcast,
        )
        self._opts: Dict[str, Any] = dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        _require(self._schema, self._l.state_dict().get("format"), self.path)

    @property
    def shuffle(self) -> bool:
        return self._opts["shuffle"]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        o = self._opts
        return (
            f"{self._schema or 'eagle3'}.Loader({self.path!r}, batch_size={o['batch_size']}, shuffle={o['shuffle']}, seed={o['seed']}, "
            f"rank={self.rank}, world_size={self.world_size}, drop_last={o['drop_last']}, epoch={self.epoch}, "
            f"batches={len(self)})"
        )

    def indices(self) -> List[int]:
        """This rank's sample indices for the current epoch, in order."""
        return list(self._l.indices())

    def state_dict(self) -> LoaderState:
        """``{"format", "seed", "epoch", "batch", "batch_size", "world_size"}`` and the
        parameters that decide the order, ``shuffle``, ``drop_last`` and ``samples`` (see
        :class:`shardkit.types.LoaderState`): save it with your checkpoint."""
        return cast(LoaderState, self._l.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at the state's position. A state taken by a loader that would serve other
        samples (another seed, batch_size, world_size, shuffle, drop_last or cache size) raises
        InvalidArgumentError naming each key that differs, with both values. Right after it,
        ``set_epoch`` of the state's epoch keeps the position."""
        check_state(dict(state), self._schema or "eagle3")
        self._l.load_state_dict(dict(state))

    def __iter__(self) -> Iterator[Eagle3Batch]:
        if self._l.epoch_finished and not self._l.resumed:
            # A finished epoch starts over, as PyTorch's samplers do (but a state saved at the
            # end of its epoch resumes to the end: the rest of that epoch is empty).
            self._l.advance_to(0)
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
    report: Validation = json.loads(_core.eagle3_validate(_args.path("cache_dir", cache_dir), _args.boolean("deep", deep)))
    return report


def inspect(cache_dir: PathLike) -> Dict[str, Any]:
    """Configuration, sizes and completeness."""
    info: Dict[str, Any] = json.loads(_core.eagle3_inspect(_args.path("cache_dir", cache_dir)))
    return info


# Guarded here, where they are defined: each member's module re-exports them or subclasses them.
_args.guard_module(globals(), [
    "Writer", "PartWriter", "Cache", "Loader", "status", "commit_parts", "open_cache", "collate",
    "to_torch", "validate", "inspect",
])
