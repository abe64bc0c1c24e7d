"""saev activation directories (protocols 1.0.0, 1.1, 2.0, 2.1): write, read, stream.

A directory ``<root>/<hash>/`` holds ``metadata.json``, ``shards.json``, float32 shards
``acts%06d.bin`` of shape (examples_per_shard, n_layers, tokens_per_example, d_model) and an
optional uint8 ``labels.bin`` (n_examples, content_tokens). See the README for the format and the
guarantees (crash safety, exact resume, deterministic orders).

Reduced precision (shardkit's dialect of protocol 2.1, which saev's own loaders refuse): a
writer given ``dtype="bfloat16"`` or ``"float16"`` rounds its float32 input to nearest even
(as ``x.astype(ml_dtypes.bfloat16)`` / ``x.astype(np.float16)`` do), stores half the bytes, and
records each shard's rounding error in ``acts%06d.error.json`` (``inspect(path)["precision"]``
merges them); ``max_rel_error=`` refuses a row rounded worse. Readers serve rows as stored
(``dtype=None``: ``ml_dtypes.bfloat16`` or ``np.float16`` arrays) or widened to float32
(``dtype="float32"``). numpy has no bfloat16 of its own: bfloat16 rows as stored need
``ml_dtypes`` (``pip install ml_dtypes``); ``shardkit.torch`` serves ``torch.bfloat16`` without
it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np

from .. import _args, _inputs
from .. import _shardkit as _core
from .._progress import Closing, Parting, Progress
from ..errors import IncompleteDatasetError, InvalidArgumentError
from ..types import EngineLoader, FollowBroadcast, LoaderState, SaevBatch, Validation, check_state

try:  # bfloat16 as a numpy dtype, when installed (an optional dependency)
    import ml_dtypes as _ml_dtypes

    _BF16: Any = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised when ml_dtypes is absent
    _BF16 = None

PathLike = Union[str, "os.PathLike[str]"]
Batch = SaevBatch  # the old name

__all__ = [
    "Writer",
    "PartWriter",
    "status",
    "commit_parts",
    "Dataset",
    "IndexedView",
    "Loader",
    "OrderedLoader",
    "ShuffledLoader",
    "open",
    "validate",
    "inspect",
    "convert",
    "IncompleteDatasetError",
]


def _array(buf: Any) -> np.ndarray:
    # The buffer protocol of RustBuffer: numpy wraps Rust memory, keeping it alive.
    return np.asarray(buf)


def _values(buf: Any, dtype: str, bits: bool = False) -> np.ndarray:
    """Activation values of ``dtype`` from the core (bfloat16 comes as its uint16 bit
    patterns): a view as ``ml_dtypes.bfloat16``, or, with ``bits``, the bit patterns as they
    are (shardkit.torch views them as ``torch.bfloat16``)."""
    a = np.asarray(buf)
    if dtype == "bfloat16" and not bits:
        return a.view(_bf16("rows"))
    return a


def _bf16(what: str) -> Any:
    """numpy's bfloat16 (ml_dtypes'), or the error saying how to do without it."""
    if _BF16 is None:
        raise InvalidArgumentError(
            f"{what}: the dataset stores bfloat16, which numpy has no type of its own for: install "
            "ml_dtypes (pip install ml_dtypes) for ml_dtypes.bfloat16 arrays, or pass dtype='float32' "
            "for rows widened to float32 (shardkit.torch serves torch.bfloat16 without ml_dtypes)")
    return _BF16


def _read_dtype(path: str, stored: str, dtype: Any) -> bool:
    """Whether a reader asked for ``dtype`` (None: as stored; ``"float32"``: widened) of a
    dataset that stores ``stored`` serves float32 widened from it; another type is refused."""
    want = _args.dtype("dtype", dtype)
    if want is None or want == stored:
        return False
    if want == "float32":
        return True
    raise InvalidArgumentError(
        f"{path}: dtype={dtype!r}, but the dataset stores {stored}: readers serve rows as stored "
        f"(dtype=None) or widened to float32 (dtype='float32'); to store {want}, convert it "
        f"(shardkit saev convert --dtype {want})")


def _checked_examples(w: Any, path: str, acts: Any, labels: Any) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """``acts`` as float32 (b, L, T, D) and ``labels`` as uint8 (b, P) for writer ``w`` (whose
    ``shape``, ``content_tokens`` and ``next_example`` say what fits), or the error naming what
    does not."""
    s = w.shape
    a = _inputs.float32(acts, "acts", path)
    _inputs.check_shape(
        a, "acts", path, (None, s["n_layers"], s["tokens_per_example"], s["d_model"]),
        "(batch, layers, tokens_per_example, d_model)",
    )
    lab = None
    if labels is not None:
        first = w.next_example or 0
        raw = _inputs.array(labels, "labels", path)
        _inputs.check_shape(raw, "labels", path, (a.shape[0], w.content_tokens), "(batch, content tokens)")
        lab = _inputs.integers(
            labels, "labels", path, dtype=np.uint8, lo=0, hi=255, a=raw,
            allowed="0 to 255, labels.bin stores uint8",
            where=lambda i: f"example {first + i[0]}, content token {i[1]}",
        )
    return a, lab


class Writer(Closing[str]):
    """Streams activations into ``root/<hash>/``, crash-safely and resumably.

    ``metadata`` is what goes into metadata.json (any key order; its ``protocol`` — "1.0.0",
    "2.0" or "2.1", default "2.1" — selects the version and its key names). Use as a context
    manager: a clean exit completes the dataset; an exception leaves it resumable with
    ``resume=True``. ``progress`` is None (a bar on a terminal if tqdm is installed), a bool, or a
    callable ``f(examples_done, n_examples)``.

    ``root`` may be an ``s3://bucket/prefix`` URL: each shard is uploaded in the background as
    soon as it is full (the local staging directory holds a few shards), the commit record last
    on exit; a killed write resumes (``resume=True``) from what the store holds, on any machine.
    A lock object in the store keeps out a second writer on any machine (``LockedError``).

    ``dtype`` is the stored value type: ``"float32"`` (saev's, the default), or ``"bfloat16"``
    (``"bf16"``) / ``"float16"`` (``"fp16"``), shardkit's reduced-precision dialect of protocol
    2.1 (half the bytes; metadata.json's ``dtype``, which the directory's hash covers; saev's own
    loaders refuse it). Input is still float32, rounded to nearest even; each shard's rounding
    error goes to ``acts%06d.error.json``. ``max_rel_error`` bounds the relative L2 error
    ``||x - q|| / ||x||`` of each row (``d_model`` values): a write holding a row rounded worse,
    or a value that overflows (float16 beyond 65504), is refused with InvalidArgumentError naming
    the shard, example, row, layer and token; nothing of it is stored and the writer goes on.
    """

    _w: _core.Writer

    def __init__(
        self,
        root: PathLike,
        metadata: Dict[str, Any],
        *,
        resume: bool = False,
        progress: Any = None,
        dtype: Any = None,
        max_rel_error: Optional[float] = None,
    ) -> None:
        root = _args.path("root", root)
        if not isinstance(metadata, Mapping):
            raise _args.InvalidArgumentTypeError(
                f"metadata must be a dict (metadata.json's keys), got {type(metadata).__name__}")
        self._w = _core.Writer(root, json.dumps(metadata), _args.boolean("resume", resume),
                               _args.dtype("dtype", dtype), _args.rel_error("max_rel_error", max_rel_error))
        self._progress = Progress(_args.callback("progress", progress), unit="ex", total=self._w.shape["n_examples"],
                                  initial=self._w.next_example)
        self._path: str = self._w.path
        self._closed = False

    @property
    def path(self) -> str:
        """The dataset directory."""
        return self._path

    @property
    def next_example(self) -> int:
        """The first example index still to be written (non-zero after a resume)."""
        return self._w.next_example

    @property
    def dtype(self) -> str:
        """The stored value type: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
        return self._w.dtype

    @property
    def already_complete(self) -> bool:
        """True when the same dataset was already complete: writes are then discarded."""
        return self._w.start == "complete"

    @property
    def shape(self) -> Tuple[int, ...]:
        """(n_examples, n_layers, tokens_per_example, d_model)."""
        s = self._w.shape
        return (s["n_examples"], s["n_layers"], s["tokens_per_example"], s["d_model"])

    def write(self, acts: Any, labels: Any = None) -> None:
        """Appends the next ``b`` examples: ``acts`` of shape (b, L, T, D) and, if the dataset
        has labels, ``labels`` of shape (b, P) (P content tokens per example).

        ``acts`` may be a numpy array, a torch tensor or a nested list. The writer takes float32:
        float32 as it is, float16 and bfloat16 (numpy, ``ml_dtypes``, torch) widened exactly,
        and float64 or integer input only when float32 holds every value exactly (otherwise
        InvalidArgumentError: cast explicitly to write rounded values); a bfloat16 or float16
        dataset then rounds it to nearest even. ``labels`` are integers of any dtype in 0 to 255
        (labels.bin is uint8); a label outside is refused, not wrapped. A refused write (also
        one over ``max_rel_error``) stores nothing: the dataset stays as it was, and resumable.
        """
        s = self._w.shape
        a, lab = _checked_examples(self._w, self._path, acts, labels)
        self._w.write(a, lab)
        self._progress.advance(int(a.shape[0]), self._w.next_example, s["n_examples"])

    def close(self) -> str:
        """Completes the dataset (fails, leaving it resumable, if examples are missing) and
        returns its directory."""
        self._path = self._close_once(self._w.finish)
        return self._path

    def __repr__(self) -> str:
        n = self._w.shape["n_examples"]
        state = "closed" if self._closed else "open"
        dt = "" if self.dtype == "float32" else f", dtype={self.dtype!r}"
        return f"saev.Writer({self._path!r}, next_example={self.next_example}, n_examples={n}{dt}, {state})"


class PartWriter(Parting):
    """Writes this process's part of one saev dataset that several processes write together.

    Rank ``rank`` of ``world_size`` writes the shards ``shardkit.part_of(n_shards, rank)``
    (contiguous, shard-aligned: examples ``examples[0]`` to ``examples[1]``) into the same
    ``root/<hash>/`` directory; the rank that completes the set commits it, exactly as one
    ``Writer`` would have written it (same bytes, same hash directory). Without ``rank`` and
    ``world_size`` they come from the launcher: ``RANK``/``WORLD_SIZE`` (torchrun), Slurm
    (``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT``, ``SLURM_PROCID``/``SLURM_NTASKS``) or MPI.
    No collective is needed: the ranks coordinate through the directory (a shared file system
    across nodes), or through the store itself for an ``s3://`` root (conditional writes and
    leases; see docs/parallel.md).

    Each shard is durable as soon as it is full. After a kill, start the job again, with the
    same or another world size: ``pending`` lists the examples this rank still owes (shards
    already durable are kept), and ``write`` takes them in that order. Use as a context
    manager: a clean exit finishes the part (and commits if it was the last); an exception
    leaves it to a restart. ``close()`` returns the dataset's status (``status()``).
    ``dtype`` and ``max_rel_error`` are :class:`Writer`'s (every rank gives the same ``dtype``:
    it is part of the dataset's hash).
    """

    _w: _core.PartWriter

    def __init__(
        self,
        root: PathLike,
        metadata: Dict[str, Any],
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        progress: Any = None,
        dtype: Any = None,
        max_rel_error: Optional[float] = None,
    ) -> None:
        root = _args.path("root", root)
        if not isinstance(metadata, Mapping):
            raise _args.InvalidArgumentTypeError(
                f"metadata must be a dict (metadata.json's keys), got {type(metadata).__name__}")
        rank = None if rank is None else _args.count("rank", rank)
        world_size = None if world_size is None else _args.count("world_size", world_size)
        self._w = _core.PartWriter(root, json.dumps(metadata), rank, world_size, _args.dtype("dtype", dtype),
                                   _args.rel_error("max_rel_error", max_rel_error))
        first, end = self._w.examples
        self._progress = Progress(_args.callback("progress", progress), unit="ex", total=end - first,
                                  initial=end - first - self._owed())
        self._path: str = self._w.path
        self._closed = False

    @property
    def path(self) -> str:
        """The dataset directory."""
        return self._path

    @property
    def dtype(self) -> str:
        """The stored value type: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
        return self._w.dtype

    @property
    def examples(self) -> Tuple[int, int]:
        """(first, end) of the examples this rank's part covers."""
        first, end = self._w.examples
        return (int(first), int(end))

    @property
    def next_example(self) -> Optional[int]:
        """The example the next ``write`` begins at (None once the part is written)."""
        return self._w.next_example

    @property
    def shape(self) -> Tuple[int, ...]:
        """(n_examples, n_layers, tokens_per_example, d_model) of the whole dataset."""
        s = self._w.shape
        return (s["n_examples"], s["n_layers"], s["tokens_per_example"], s["d_model"])

    def write(self, acts: Any, labels: Any = None) -> None:
        """Writes the next ``b`` pending examples (see ``Writer.write`` for the inputs taken)."""
        a, lab = _checked_examples(self._w, self._path, acts, labels)
        self._w.write(a, lab)
        first, end = self._w.examples
        self._progress.advance(int(a.shape[0]), end - first - self._owed(), end - first)


    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        first, end = self.examples
        dt = "" if self.dtype == "float32" else f", dtype={self.dtype!r}"
        return (f"saev.PartWriter({self._path!r}, rank={self.rank}, world_size={self.world_size}, "
                f"examples={first}..{end}{dt}, {state})")


def status(path: PathLike) -> Dict[str, Any]:
    """Where a dataset written in parts stands: ``{"committed", "units" (shards), "done",
    "missing" ([first, end] shard ranges), "claimed" ([{"units", "by"}] of live ranks)}``."""
    st: Dict[str, Any] = json.loads(_core.saev_status(_args.path("path", path)))
    return st


def commit_parts(path: PathLike) -> Dict[str, Any]:
    """Commits a dataset written in parts whose every shard is durable (its last rank was
    killed while committing); returns ``status()``. A committed dataset is left as it is."""
    st: Dict[str, Any] = json.loads(_core.saev_commit_parts(_args.path("path", path)))
    return st


class IndexedView:
    """saev's indexed semantics: ``len()`` rows, ``view[i]`` -> dict for one row (``act`` as
    stored, or float32 for a view made with ``dtype="float32"``)."""

    def __init__(self, ds: "Dataset", layer: int, tokens: str, dtype: Any = None) -> None:
        self._ds = ds
        self._layer = layer
        self._tokens = tokens
        self._stored = not _read_dtype(ds.path, ds.dtype, dtype)
        if self._stored and ds.dtype == "bfloat16":
            _bf16(ds.path)
        self._len = ds._d.indexed_len(layer, tokens)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"saev.IndexedView({self._ds.path!r}, layer={self._layer}, tokens={self._tokens!r}, rows={self._len})"

    def __getitem__(self, i: int) -> Dict[str, Any]:
        r = self._ds._d.indexed_get(self._layer, self._tokens, _args.integer("i", i), self._stored)
        act = _values(r["act"], self._ds.dtype if self._stored else "float32")
        row: Dict[str, Any] = {"act": act, "example_idx": r["example_idx"], "token_idx": r["token_idx"]}
        if r["token_label"] is not None:
            row["token_label"] = r["token_label"]
        return row


class Dataset:
    """A complete saev directory opened for random access (see :func:`open`).

    ``dtype`` is the stored value type. ``get``, ``take`` and ``indexed`` return rows as stored
    (``dtype=None``: float32, ``ml_dtypes.bfloat16`` or ``np.float16`` arrays) or widened to
    float32 (``dtype="float32"``)."""

    def __init__(self, path: PathLike) -> None:
        self._d = _core.Dataset(_args.path("path", path))
        lay = self._d.layout
        self.n_examples: int = lay["n_examples"]
        self.n_layers: int = lay["n_layers"]
        self.tokens_per_example: int = lay["tokens_per_example"]
        self.d_model: int = lay["d_model"]
        self.content_tokens_per_example: int = lay["content_tokens"]
        self.cls_token: bool = lay["cls_token"]
        self.examples_per_shard: int = lay["examples_per_shard"]
        self.n_shards: int = lay["n_shards"]
        self.dtype: str = lay["dtype"]
        self.metadata: Dict[str, Any] = json.loads(self._d.metadata_json)
        self.protocol: str = self.metadata["protocol"]
        self.layers: List[int] = list(self._d.layers)
        self.has_labels: bool = self._d.has_labels
        self.path: str = self._d.path

    def get(self, example: int, layer: int, token: int, *, dtype: Any = None) -> np.ndarray:
        """The (d_model,) vector of ``example``, recorded layer value ``layer`` and stored token
        slot ``token`` (slot 0 is CLS when the dataset has one); as stored, or float32 with
        ``dtype="float32"``."""
        stored = self._stored(dtype)
        return _values(self._d.get(
            _args.integer("example", example), self._layer_value(layer), _args.integer("token", token), stored),
            self.dtype if stored else "float32")

    def _stored(self, dtype: Any) -> bool:
        """Whether a read asked for ``dtype`` serves the stored values (see ``get``)."""
        stored = not _read_dtype(self.path, self.dtype, dtype)
        if stored and self.dtype == "bfloat16":
            _bf16(self.path)
        return stored

    def _layer_value(self, layer: Any) -> int:
        """A recorded layer value of this dataset."""
        v = _args.integer("layer", layer)
        if v not in self.layers:
            raise InvalidArgumentError(f"{self.path}: layer {v} was not recorded (layers: {self.layers})")
        return v

    def take(self, examples: Any, layer: Any, tokens: Any, *, dtype: Any = None) -> np.ndarray:
        """Many vectors at once, (n, d_model); arguments broadcast like numpy arrays. As stored,
        or float32 with ``dtype="float32"``."""
        stored = self._stored(dtype)
        e, l, t = np.broadcast_arrays(
            _int_array("examples", examples), _int_array("layer", layer), _int_array("tokens", tokens)
        )
        out = _values(self._d.take(e.ravel().tolist(), l.ravel().tolist(), t.ravel().tolist(), stored),
                      self.dtype if stored else "float32")
        return out.reshape(e.shape + (self.d_model,))

    def indexed(self, layer: int, tokens: str = "content", *, dtype: Any = None) -> IndexedView:
        """saev's indexed view of one layer: ``tokens`` is content, special (CLS) or all; rows
        as stored, or float32 with ``dtype="float32"``."""
        return IndexedView(self, self._layer_value(layer), _args.choice("tokens", tokens, TOKENS), dtype)

    def __repr__(self) -> str:
        return (
            f"saev.Dataset({self.path!r}, protocol={self.protocol!r}, n_examples={self.n_examples}, "
            f"layers={self.layers}, tokens_per_example={self.tokens_per_example}, "
            f"d_model={self.d_model}, dtype={self.dtype!r})"
        )


#: The ``tokens`` selections (``image``/``patches`` and ``cls`` are saev's older names).
TOKENS = ("content", "special", "all", "image", "patches", "cls")
#: The orders of :class:`Loader`.
ORDERS = ("block", "exact", "sequential")


def _int_array(name: str, value: Any) -> np.ndarray:
    """Integer coordinates (a scalar, a sequence or an integer array) as int64."""
    a = np.asarray(value)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or a.size == 0) or a.dtype == np.bool_:
        raise _args.InvalidArgumentTypeError(f"{name} must be integers, got {a.dtype} ({_args._show(value)})")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{name}: {int(a.max())} is out of range")
    return a.astype(np.int64, copy=False)


def open(path: PathLike) -> Dataset:  # noqa: A001 - mirrors the built-in's role
    """Opens a complete saev directory; an incomplete one raises IncompleteDatasetError."""
    return Dataset(path)


class Loader(EngineLoader):
    """Batches of activation rows, shuffled (default) or in storage order.

    Shuffled (the default) uses ``order="block"`` (windows of blocks) or ``"exact"`` (a full
    permutation of rows); ``shuffle=False`` (or ``order="sequential"``) serves storage order (example-major, then token),
    as saev's ordered loader does. The order depends only on (seed, epoch, memory_budget,
    global batch size) and the dataset; ``rank`` and ``world_size`` default to ``$RANK`` and
    ``$WORLD_SIZE``, and ranks take disjoint parts of one global order. ``num_threads`` gather
    threads (default: every core) copy rows into batches, from the page cache when the data are
    there; ``direct_io=True`` reads with O_DIRECT instead (``io_threads`` reads in flight).
    ``verify=True`` checks every block a pass reads against the dataset's checksums sidecar
    (``shardkit.checksum(path)`` adds one to data written by other tools); a damaged block
    raises CorruptDataError naming the shard and the byte range.

    ``follow=True`` reads a dataset while :class:`PartWriter` ranks write it: each epoch is
    served in rounds of the shards durable when the round starts (the planned order restricted
    to them), new shards are picked up as they land, every row is served once per epoch, and
    ``state_dict`` resumes exactly; a loader that has served every durable shard waits up to
    ``follow_timeout`` seconds (default 3600) for another, then raises IncompleteDatasetError
    naming the missing shards and who claims them. On a dataset still being written it reads
    without ``drop_last``, ``ignore_labels`` or ``verify``, and with ``world_size`` > 1 only
    given ``follow_broadcast`` (:data:`shardkit.types.FollowBroadcast`; shardkit.torch's
    loaders build it over torch.distributed): rank 0 alone looks for shards and broadcasts each
    round to the others, which split it as the epoch is split. On a committed dataset without
    it, it changes nothing. See docs/saev.md, "Reading while it is written".

    ``dtype=None`` (the default) serves rows as stored: float32, or for a reduced-precision
    dataset ``ml_dtypes.bfloat16`` / ``np.float16`` arrays over the loader's buffers (half the
    bytes); ``dtype="float32"`` widens them to float32 (exactly, once a batch is gathered).

    Yields :class:`shardkit.types.SaevBatch` dicts of numpy arrays.
    """

    #: Serve bfloat16 as uint16 bit patterns (shardkit.torch's loaders, which need no ml_dtypes).
    _bf16_bits = False

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
        follow_broadcast: Optional[FollowBroadcast] = None,
        dtype: Any = None,
    ) -> None:
        path = _args.path("path", path)
        want = _args.dtype("dtype", dtype)
        if not (isinstance(layer, str) and layer == "all"):
            if isinstance(layer, str):
                raise InvalidArgumentError(f"layer must be a recorded layer value (an integer) or 'all', got {layer!r}")
            if not _args.is_int(layer):
                raise _args.InvalidArgumentTypeError(
                    f"layer must be a recorded layer value (an integer) or 'all', got {layer!r} ({type(layer).__name__})")
            layer = int(layer)
        tokens = _args.choice("tokens", tokens, TOKENS)
        batch_size = _args.count("batch_size", batch_size, lo=1)
        shuffle = _args.optional_boolean("shuffle", shuffle)
        order = _args.optional_choice("order", order, ORDERS)
        seed = _args.count("seed", seed)
        epoch = _args.count("epoch", epoch)
        _args.rank_world(rank, world_size)
        drop_last = _args.boolean("drop_last", drop_last)
        num_threads = _args.threads("num_threads", num_threads)
        verify = _args.boolean("verify", verify)
        memory_budget = _args.optional_count("memory_budget", memory_budget, lo=1)
        if isinstance(ignore_labels, (str, bytes)) or not isinstance(ignore_labels, (Sequence, np.ndarray, set, frozenset)):
            raise _args.InvalidArgumentTypeError(
                f"ignore_labels must be a sequence of patch labels (0..255), got {ignore_labels!r}")
        ignore_labels = [_args.integer("ignore_labels", x, lo=0, hi=255) for x in ignore_labels]
        io_threads = _args.integer("io_threads", io_threads, lo=1, hi=1 << 16)
        direct_io = _args.boolean("direct_io", direct_io)
        follow = _args.boolean("follow", follow)
        follow_timeout = _args.follow_timeout(follow, follow_timeout)
        follow_broadcast = _args.follow_broadcast(follow, follow_broadcast)
        if order is None:
            # Shuffled: the core's default order (the loader contract writes it once).
            order = None if shuffle is None or shuffle else "sequential"
        elif shuffle is not None and (order == "sequential") == bool(shuffle):
            raise InvalidArgumentError(
                f"order={order!r} contradicts shuffle={shuffle!r} (shuffled orders: 'block', 'exact'; "
                "unshuffled: 'sequential')"
            )
        kw: Dict[str, Any] = dict(
            layer=layer,
            tokens=tokens,
            batch_size=batch_size,
            order=order,
            verify=verify,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            memory_budget=memory_budget,
            io_threads=io_threads,
            threads=num_threads or 0,
            direct_io=direct_io,
            follow=follow,
            follow_timeout=follow_timeout,
            follow_broadcast=follow_broadcast,
            upcast=want == "float32",
        )
        if order != "sequential":
            kw.update(seed=seed, epoch=epoch, ignore_labels=[int(x) for x in ignore_labels])
        elif seed or epoch or ignore_labels:
            raise InvalidArgumentError("seed, epoch and ignore_labels apply to shuffled orders only")
        self._l = _core.Loader(path, **kw)
        _read_dtype(path, self._l.stored_dtype, dtype)  # refuses a type other than stored or float32
        self._dtype: str = self._l.dtype
        if self._dtype == "bfloat16" and not self._bf16_bits:
            _bf16(path)
        self._path = path
        self._opts: Dict[str, Any] = dict(
            layer=layer, tokens=tokens, batch_size=batch_size, order=self._l.order, seed=seed, drop_last=drop_last)

    @property
    def path(self) -> str:
        """The dataset directory."""
        return self._path

    @property
    def layer(self) -> Union[int, str]:
        """The recorded layer value read (or ``"all"``)."""
        return self._opts["layer"]  # type: ignore[no-any-return]

    @property
    def tokens(self) -> str:
        """The token selection: ``"content"``, ``"special"`` or ``"all"``."""
        return self._opts["tokens"]  # type: ignore[no-any-return]

    @property
    def order(self) -> str:
        """``"block"``, ``"exact"`` or ``"sequential"``."""
        return self._opts["order"]  # type: ignore[no-any-return]

    @property
    def shuffle(self) -> bool:
        """Whether the order is shuffled (not ``"sequential"``)."""
        return self.order != "sequential"

    @property
    def dtype(self) -> str:
        """The type of the ``act`` values served: the stored one, or ``"float32"`` widened."""
        return self._dtype

    @property
    def stored_dtype(self) -> str:
        """The dataset's stored value type."""
        return str(self._l.stored_dtype)

    def __repr__(self) -> str:
        o = self._opts
        dt = "" if self._dtype == "float32" == self.stored_dtype else f", dtype={self._dtype!r}"
        return (
            f"{type(self).__module__.replace('shardkit.', '')}.{type(self).__name__}({self._path!r}, "
            f"layer={o['layer']!r}, tokens={o['tokens']!r}, batch_size={o['batch_size']}, order={o['order']!r}, "
            f"seed={o['seed']}, rank={self.rank}, world_size={self.world_size}, drop_last={o['drop_last']}, "
            f"epoch={self.epoch}, batches={len(self)}{dt})"
        )

    @property
    def rows(self) -> int:
        """Selected rows per epoch over all ranks."""
        return int(self._l.rows)

    def state_dict(self) -> LoaderState:
        """The position and every parameter that decides the order (see
        :class:`shardkit.types.LoaderState`); pass it to ``load_state_dict`` to resume exactly,
        on any number of ranks with the same global batch size."""
        return cast(LoaderState, self._l.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at the state's position. A state taken by a loader that would serve other
        rows (another seed, order, layer, tokens, ignore_labels, drop_last, memory budget of the
        block order, global batch or dataset) raises InvalidArgumentError naming each key that
        differs, with both values. Right after it, ``set_epoch`` of the state's epoch keeps the
        position."""
        check_state(dict(state), "saev")
        self._l.load_state_dict(dict(state))

    def __iter__(self) -> Iterator[SaevBatch]:
        it = self._l.iter()
        try:
            for b in it:
                batch: SaevBatch = {
                    "act": _values(b["act"], self._dtype, self._bf16_bits),
                    "example_idx": _array(b["example_idx"]),
                    "token_idx": _array(b["token_idx"]),
                }
                layer, label = b["layer"], b["token_label"]
                if layer is not None:
                    batch["layer"] = _array(layer)
                if label is not None:
                    batch["token_label"] = _array(label)
                yield batch
        finally:
            it.close()  # an abandoned iteration stops its reader threads at once


class OrderedLoader(Loader):
    """``Loader(shuffle=False)``: batches in storage order, saev's ordered loader."""

    def __init__(
        self,
        path: PathLike,
        *,
        layer: Union[int, str],
        tokens: str = "content",
        batch_size: int = 16384,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        num_threads: Optional[int] = None,
        verify: bool = False,
        memory_budget: Optional[int] = None,
        io_threads: int = 16,
        direct_io: bool = False,
        follow: bool = False,
        follow_timeout: Optional[float] = None,
        follow_broadcast: Optional[FollowBroadcast] = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            path, shuffle=False, layer=layer, tokens=tokens, batch_size=batch_size, rank=rank,
            world_size=world_size, drop_last=drop_last, num_threads=num_threads, verify=verify,
            memory_budget=memory_budget, io_threads=io_threads, direct_io=direct_io, follow=follow,
            follow_timeout=follow_timeout, follow_broadcast=follow_broadcast, dtype=dtype,
        )


class ShuffledLoader(Loader):
    """``Loader(shuffle=True)``: shuffled batches, saev's shuffled loader (``order="block"`` by
    default, or ``"exact"``)."""

    def __init__(
        self,
        path: PathLike,
        *,
        layer: Union[int, str],
        tokens: str = "content",
        batch_size: int = 16384,
        order: str = "block",
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
        follow_broadcast: Optional[FollowBroadcast] = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            path, shuffle=True, layer=layer, tokens=tokens, batch_size=batch_size, order=order, seed=seed,
            epoch=epoch, rank=rank, world_size=world_size, drop_last=drop_last, num_threads=num_threads,
            verify=verify, memory_budget=memory_budget, ignore_labels=ignore_labels, io_threads=io_threads,
            direct_io=direct_io, follow=follow, follow_timeout=follow_timeout,
            follow_broadcast=follow_broadcast, dtype=dtype,
        )


def validate(path: PathLike) -> Validation:
    """Every problem of a directory: ``{"path", "valid", "errors", "notes"}``, each finding
    ``{"file", "message"}`` (:class:`shardkit.types.Validation`, the same for every format)."""
    report: Validation = json.loads(_core.validate(_args.path("path", path)))
    return report


def inspect(path: PathLike) -> Dict[str, Any]:
    """Version, shapes, layers, counts, sizes, completeness and hash recipe of a directory.

    ``"dtype"`` is the stored value type; ``"precision"`` (None for float32) is the rounding
    error of a bfloat16/float16 dataset, its shards' ``acts%06d.error.json`` merged:
    ``{"dtype", "rows", "values", "max_abs_error", "max_rel_l2_error", "mean_rel_l2_error",
    "overflow", "flushed_to_zero", ...}``."""
    info: Dict[str, Any] = json.loads(_core.inspect(_args.path("path", path)))
    return info


def convert(
    src: PathLike,
    dst_root: PathLike,
    dtype: Any,
    *,
    max_rel_error: Optional[float] = None,
    progress: Any = None,
) -> str:
    """Writes the complete dataset ``src`` again in ``dtype`` under ``dst_root`` (a directory
    or ``s3://`` prefix) and returns the new dataset's path (``dst_root/<hash>``: the metadata
    is ``src``'s with ``dtype`` changed, so its name changes too).

    float32 to ``"bfloat16"``/``"float16"`` rounds to nearest even, recording each shard's
    error (``max_rel_error=`` refuses a row rounded worse, naming it); back to ``"float32"`` is
    exact and gives a dataset saev's own loaders read. The result is byte-identical to writing
    the same float32 rows in ``dtype`` with :class:`Writer`. It streams (memory stays a few
    runs of 64 MiB), and it is resumable: a conversion interrupted at any point (a kill,
    Ctrl-C, an exception from ``progress``) is continued by calling it again; one already
    complete returns at once. ``progress`` is None (a bar on a terminal if tqdm is
    installed), a bool, or a callable ``(examples_done, examples)``."""
    name = _args.dtype("dtype", dtype)
    if name is None:
        raise InvalidArgumentError("dtype must name the type to convert to ('float32', 'bfloat16' or 'float16'), got None")
    bound = _args.rel_error("max_rel_error", max_rel_error)
    bar = Progress(_args.callback("progress", progress), unit="B", unit_scale=True, desc="converting")
    seen = [0]

    def report(done: int, total: int, example_bytes: int, resumed_from: Optional[int]) -> None:
        if bar.total is None:
            bar.set_total(total * example_bytes)
            bar.advance(done * example_bytes, done, total)
        else:
            bar.advance((done - seen[0]) * example_bytes, done, total, nbytes=(done - seen[0]) * example_bytes)
        seen[0] = done

    try:
        path: str = _core.convert(
            _args.path("src", src), _args.path("dst_root", dst_root), name, bound, report
        )
    finally:
        bar.close()
    return path


_args.guard_module(globals(), __all__)

