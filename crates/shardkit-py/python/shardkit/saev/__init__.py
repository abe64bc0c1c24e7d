"""saev activation directories (protocols 1.0.0, 1.1, 2.0, 2.1): write, read, stream.

A directory ``<root>/<hash>/`` holds ``metadata.json``, ``shards.json``, float32 shards
``acts%06d.bin`` of shape (examples_per_shard, n_layers, tokens_per_example, d_model) and an
optional uint8 ``labels.bin`` (n_examples, content_tokens). See the README for the format and the
guarantees (crash safety, exact resume, deterministic orders).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _shardkit as _core
from .._progress import Progress
from ..errors import IncompleteDatasetError, InvalidArgumentError
from ..types import EngineLoader, LoaderState, SaevBatch, Validation, check_state

PathLike = Union[str, "os.PathLike[str]"]
Batch = SaevBatch  # the old name

__all__ = [
    "Writer",
    "Dataset",
    "IndexedView",
    "Loader",
    "OrderedLoader",
    "ShuffledLoader",
    "open",
    "validate",
    "inspect",
    "IncompleteDatasetError",
]


def _array(buf: Any) -> np.ndarray:
    # The buffer protocol of RustBuffer: numpy wraps Rust memory, keeping it alive.
    return np.asarray(buf)


class Writer:
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
    """

    def __init__(
        self,
        root: PathLike,
        metadata: Dict[str, Any],
        *,
        resume: bool = False,
        progress: Any = None,
    ) -> None:
        self._w = _core.Writer(os.fspath(root), json.dumps(metadata), resume)
        self._progress = Progress(progress, unit="ex", total=self._w.shape["n_examples"], initial=self._w.next_example)
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
    def already_complete(self) -> bool:
        """True when the same dataset was already complete: writes are then discarded."""
        return self._w.start == "complete"

    @property
    def shape(self) -> Tuple[int, ...]:
        """(n_examples, n_layers, tokens_per_example, d_model)."""
        s = self._w.shape
        return (s["n_examples"], s["n_layers"], s["tokens_per_example"], s["d_model"])

    def write(self, acts: Any, labels: Any = None) -> None:
        """Appends ``acts`` float32 (b, L, T, D) and, if the dataset has labels, uint8 (b, P)."""
        a = np.ascontiguousarray(acts, dtype=np.float32)
        lab = None if labels is None else np.ascontiguousarray(labels, dtype=np.uint8)
        self._w.write(a, lab)
        self._progress.advance(int(a.shape[0]) if a.ndim == 4 else 0, self._w.next_example, self._w.shape["n_examples"])

    def close(self) -> str:
        """Completes the dataset (fails, leaving it resumable, if examples are missing)."""
        if not self._closed:
            self._closed = True
            self._progress.close()
            self._path = self._w.finish()
        return self._path

    def abort(self) -> None:
        """Stops without completing; the directory stays resumable."""
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


class IndexedView:
    """saev's indexed semantics: ``len()`` rows, ``view[i]`` -> dict for one row."""

    def __init__(self, ds: "Dataset", layer: int, tokens: str) -> None:
        self._ds = ds
        self._layer = layer
        self._tokens = tokens
        self._len = ds._d.indexed_len(layer, tokens)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> Dict[str, Any]:
        r = self._ds._d.indexed_get(self._layer, self._tokens, int(i))
        row: Dict[str, Any] = {"act": _array(r["act"]), "example_idx": r["example_idx"], "token_idx": r["token_idx"]}
        if r["token_label"] is not None:
            row["token_label"] = r["token_label"]
        return row


class Dataset:
    """A complete saev directory opened for random access (see :func:`open`)."""

    def __init__(self, path: PathLike) -> None:
        self._d = _core.Dataset(os.fspath(path))
        lay = self._d.layout
        self.n_examples: int = lay["n_examples"]
        self.n_layers: int = lay["n_layers"]
        self.tokens_per_example: int = lay["tokens_per_example"]
        self.d_model: int = lay["d_model"]
        self.content_tokens_per_example: int = lay["content_tokens"]
        self.cls_token: bool = lay["cls_token"]
        self.examples_per_shard: int = lay["examples_per_shard"]
        self.n_shards: int = lay["n_shards"]
        self.metadata: Dict[str, Any] = json.loads(self._d.metadata_json)
        self.protocol: str = self.metadata["protocol"]
        self.layers: List[int] = list(self._d.layers)
        self.has_labels: bool = self._d.has_labels
        self.path: str = self._d.path

    def get(self, example: int, layer: int, token: int) -> np.ndarray:
        """The (d_model,) vector of ``example``, recorded layer value ``layer`` and stored token
        slot ``token`` (slot 0 is CLS when the dataset has one)."""
        return _array(self._d.get(int(example), int(layer), int(token)))

    def take(self, examples: Any, layer: Any, tokens: Any) -> np.ndarray:
        """Many vectors at once, (n, d_model); arguments broadcast like numpy arrays."""
        e, l, t = np.broadcast_arrays(
            np.asarray(examples, dtype=np.int64),
            np.asarray(layer, dtype=np.int64),
            np.asarray(tokens, dtype=np.int64),
        )
        out = _array(self._d.take(e.ravel().tolist(), l.ravel().tolist(), t.ravel().tolist()))
        return out.reshape(e.shape + (self.d_model,))

    def indexed(self, layer: int, tokens: str = "content") -> IndexedView:
        """saev's indexed view of one layer: ``tokens`` is content, special (CLS) or all."""
        return IndexedView(self, int(layer), tokens)

    def __repr__(self) -> str:
        return (
            f"saev.Dataset({self.path!r}, protocol={self.protocol!r}, n_examples={self.n_examples}, "
            f"layers={self.layers}, tokens_per_example={self.tokens_per_example}, "
            f"d_model={self.d_model})"
        )


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

    Yields :class:`shardkit.types.SaevBatch` dicts of numpy arrays.
    """

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
    ) -> None:
        if order is None:
            order = "block" if shuffle is None or shuffle else "sequential"
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
        )
        if order != "sequential":
            kw.update(seed=seed, epoch=epoch, ignore_labels=[int(x) for x in ignore_labels])
        elif seed or epoch or ignore_labels:
            raise InvalidArgumentError("seed, epoch and ignore_labels apply to shuffled orders only")
        self._l = _core.Loader(os.fspath(path), **kw)

    @property
    def rows(self) -> int:
        """Selected rows per epoch over all ranks."""
        return int(self._l.rows)

    def state_dict(self) -> LoaderState:
        """The position (see :class:`shardkit.types.LoaderState`); pass it to
        ``load_state_dict`` to resume exactly, on any number of ranks with the same global
        batch size."""
        st = self._l.state_dict()
        world = self.world_size
        gbs = st["global_batch_size"]
        return {
            "format": "saev",
            "seed": st["seed"],
            "epoch": st["epoch"],
            "batch": st["cursor"] // gbs if gbs else 0,
            "batch_size": gbs // world,
            "world_size": world,
            "cursor": st["cursor"],
            "global_batch_size": gbs,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(dict(state), "saev")
        st = {k: int(state[k]) for k in ("seed", "epoch") if k in state}
        if "cursor" in state and "global_batch_size" in state:
            st["cursor"] = int(state["cursor"])
            st["global_batch_size"] = int(state["global_batch_size"])
        elif all(k in state for k in ("batch", "batch_size", "world_size")):
            gbs = int(state["batch_size"]) * int(state["world_size"])
            st["cursor"] = int(state["batch"]) * gbs
            st["global_batch_size"] = gbs
        self._l.load_state_dict(st)

    def __iter__(self) -> Iterator[SaevBatch]:
        it = self._l.iter()
        try:
            for b in it:
                batch: SaevBatch = {
                    "act": _array(b["act"]),
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

    def __init__(self, path: PathLike, **kw: Any) -> None:
        super().__init__(path, shuffle=False, **kw)


class ShuffledLoader(Loader):
    """``Loader(shuffle=True)``: shuffled batches, saev's shuffled loader (``order="block"`` by
    default, or ``"exact"``)."""

    def __init__(self, path: PathLike, **kw: Any) -> None:
        kw.setdefault("order", "block")
        super().__init__(path, shuffle=True, **kw)


def validate(path: PathLike) -> Validation:
    """Every problem of a directory: ``{"path", "valid", "errors", "notes"}``, each finding
    ``{"file", "message"}`` (:class:`shardkit.types.Validation`, the same for every format)."""
    report: Validation = json.loads(_core.validate(os.fspath(path)))
    return report


def inspect(path: PathLike) -> Dict[str, Any]:
    """Version, shapes, layers, counts, sizes, completeness and hash recipe of a directory."""
    info: Dict[str, Any] = json.loads(_core.inspect(os.fspath(path)))
    return info

