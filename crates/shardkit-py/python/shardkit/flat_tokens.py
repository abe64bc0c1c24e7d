"""flat-tokens (MatX seqax) token datasets: write, read, and load seqax's shuffled batches.

A dataset is a zarr group with splits ``train`` and ``validation``; each holds
``encoded_tokens`` uint32 (``id*2+1`` at a sequence start, ``id*2`` otherwise), ``seq_starts``
uint64 (``seq_count + 1`` entries from 0 to ``token_count``) and the attribute ``max_token_id``.
shardkit writes zarr v3 (sharded zstd, the default) or seqax's own zarr v2 layout
(``layout="v2"``, readable by seqax), crash-safely, and marks a finished dataset with
``write_completed: true`` on its root. See the README for the details and guarantees.

    >>> with Writer("DS.zarr", "train") as w:
    ...     w.append([[1, 2], [3, 4, 5], [6, 7, 8]])
    >>> loader = Loader("DS.zarr", seq_len=4, batch_size=2, sequences_per_read_block=1,
    ...                 read_blocks_per_shuffle_buffer=1)
    >>> batch = loader.load(0)       # dict of numpy arrays, (batch_size, seq_len)
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union, cast

import numpy as np

from . import _args, _inputs
from . import _shardkit as _core
from ._progress import Closing, Parting, Progress
from .errors import IncompleteDatasetError, InvalidArgumentError, InvalidArgumentTypeError, NotFoundError, OutOfRangeError
from .types import LoaderState, TokensBatch, Validation, check_state

PathLike = Union[str, "os.PathLike[str]"]
Batch = TokensBatch  # the old name

__all__ = [
    "Writer",
    "PartWriter",
    "status",
    "commit_parts",
    "Dataset",
    "Split",
    "Loader",
    "open",
    "validate",
    "inspect",
    "mark_complete",
    "convert",
    "build",
    "IncompleteDatasetError",
    "MAX_TOKEN_ID",
]

#: The largest token id the encoding holds (``2*id + 1`` must fit in uint32).
MAX_TOKEN_ID = (1 << 31) - 1

_SPLITS = ("train", "validation")
_LAYOUTS = ("v2", "v3")


def _array(buf: Any) -> np.ndarray:
    return np.asarray(buf)


def _flatten(sequences: Iterable[Any], path: str = "") -> "tuple[np.ndarray, np.ndarray]":
    """Sequences (lists of ints, integer numpy arrays or torch tensors) as one uint32 array and
    their lengths, refusing anything but integer ids in 0..2^31-1 with the offending sequence
    and position named."""
    if sequences is None or isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
        raise InvalidArgumentTypeError(
            f"{path}: sequences must be an iterable of token-id sequences (lists, numpy arrays or torch "
            f"tensors), got {type(sequences).__name__}"
        )
    arrays: List[np.ndarray] = []
    for i, s in enumerate(sequences):
        field = "token ids"
        try:
            a = _inputs.array(s, f"sequence {i}", path)
        except InvalidArgumentTypeError:
            if isinstance(s, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in s):
                a = np.asarray(s, dtype=object)  # ints past 64 bits: refused below, by value
            else:
                raise
        if a.ndim != 1:
            raise InvalidArgumentError(
                f"{path}: sequence {i}: expected a 1-D sequence of token ids, got shape {tuple(a.shape)}"
            )
        if a.dtype == object:
            j, bad = next((j, x) for j, x in enumerate(a.tolist()) if not 0 <= x <= MAX_TOKEN_ID)
            raise _inputs.refused(path, field, f"sequence {i} of this append, position {j}", bad, _ID_RULE)
        if a.size:

            def where(idx: "tuple[int, ...]", i: int = i) -> str:
                return f"sequence {i} of this append, position {idx[0]}"

            a = _inputs.integers(
                None, field, path, a=a, dtype=a.dtype, lo=0, hi=MAX_TOKEN_ID, allowed=_ID_RULE, where=where
            )
        arrays.append(a)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.uint64, count=len(arrays))
    if not arrays:
        return np.zeros(0, dtype=np.uint32), lengths
    flat = np.concatenate([a.astype(np.uint32, copy=False) for a in arrays])
    return np.ascontiguousarray(flat), lengths


_ID_RULE = f"0 to {MAX_TOKEN_ID} (below 2^31, as 2*id+1 must fit the uint32 encoding)"


class Writer:
    """Appends sequences to one split of a dataset, creating the dataset as needed.

    ``layout`` is ``"v3"`` (sharded zstd) or ``"v2"`` (seqax's codecs, which seqax can read);
    the default, ``None``, is v3 for a new dataset and the dataset's own format otherwise. An
    existing split is refused unless ``resume=True``, which continues it: ``resumed_from`` then
    says how many sequences it already holds (skip those in your input after a crash).

    Use as a context manager: a clean exit marks the dataset complete; an exception commits
    what was appended and leaves the dataset unfinished (``IncompleteDatasetError`` on open,
    ``resume=True`` continues it). ``progress`` is None (a token counter on a terminal when
    tqdm is installed), a bool, or a callable ``f(seq_count, token_count)``.

    ``path`` may be an ``s3://bucket/prefix`` URL: the dataset is staged locally, each commit's
    chunks are uploaded as it is made (every ``checkpoint_tokens`` tokens), and a killed write
    resumes with ``resume=True`` on this machine or any other (see docs/storage.md).
    A lock object in the store keeps out a second writer on any machine (``LockedError``).
    """

    def __init__(
        self,
        path: PathLike,
        split: str,
        layout: Optional[str] = None,
        *,
        resume: bool = False,
        checkpoint_tokens: int = 1 << 28,
        tokens_per_shard: Optional[int] = None,
        tokens_per_chunk: Optional[int] = None,
        progress: Any = None,
    ) -> None:
        path = _args.path("path", path)
        split = _args.choice("split", split, _SPLITS)
        self._w = _core.TokensWriter(
            path,
            split,
            _args.optional_choice("layout", layout, _LAYOUTS),
            _args.boolean("resume", resume),
            _args.count("checkpoint_tokens", checkpoint_tokens, lo=1),
            _args.optional_count("tokens_per_shard", tokens_per_shard, lo=1),
            _args.optional_count("tokens_per_chunk", tokens_per_chunk, lo=1),
        )
        self.path = path
        self.split = split
        self._final: Optional["_core.WriterCounts"] = None  # counts kept once closed
        self._closed = False
        self._warned_zero = False
        self._progress = Progress(
            _args.callback("progress", progress), unit="tok", unit_scale=True, desc=f"writing {split}",
            initial=self.token_count,
        )

    @property
    def format(self) -> str:
        """The dataset's zarr format: "v2" or "v3"."""
        return self._w.format

    @property
    def resumed_from(self) -> Optional[int]:
        """Sequences the split held when this writer opened it (None for a new split)."""
        return self._w.resumed_from

    def _counts(self) -> "_core.WriterCounts":
        return self._final if self._final is not None else self._w.counts

    @property
    def seq_count(self) -> int:
        """Sequences in the split so far."""
        return self._counts()["seq_count"]

    @property
    def token_count(self) -> int:
        """Tokens in the split so far."""
        return self._counts()["token_count"]

    @property
    def max_token_id(self) -> int:
        """The running ``max_token_id``."""
        return self._counts()["max_token_id"]

    def append(self, sequences: Iterable[Any]) -> None:
        """Appends whole sequences: lists of ints or integer numpy arrays (any integer dtype).

        Ids must be integers in 0..2^31-1: a float (even a whole one), a bool, None or a ragged
        sequence raises InvalidArgumentTypeError, an id out of range InvalidArgumentError naming
        the sequence, the position and the value, and nothing of the call is appended. Empty sequences
        are allowed (``seq_starts`` repeats a value). Id 0 is the loader's input at sequence
        starts (seqax's convention); a sequence containing it is written, with a warning.
        """
        before = self.token_count
        tokens, lengths = _flatten(sequences, f"{self.path}/{self.split}")
        self._w.append_flat(tokens, lengths)
        zero = self._w.counts["sequences_with_id_zero"]
        if zero and not self._warned_zero:
            self._warned_zero = True
            warnings.warn(
                f"{self.path}/{self.split}: a sequence contains token id 0, which the loader "
                "feeds as the input at sequence starts (seqax's convention); written anyway",
                stacklevel=2,
            )
        self._progress.advance(self.token_count - before, self.seq_count, self.token_count)

    def flush(self) -> None:
        """Commits what was appended: a crash after this resumes from here."""
        self._w.flush()

    def close(self) -> Dict[str, int]:
        """Commits and marks the dataset complete; returns its counts."""
        if self._closed:
            raise RuntimeError("the writer is already closed")
        self._closed = True
        self._progress.close()
        self._final = self._w.counts
        done = self._w.finish()
        return {"seq_count": done["seq_count"], "token_count": done["token_count"], "max_token_id": done["max_token_id"]}

    def abort(self) -> None:
        """Commits what was appended (best effort) without marking the dataset complete."""
        if not self._closed:
            self._closed = True
            self._progress.close()
            self._final = self._w.counts
            self._w.abort()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            if not self._closed:
                self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"flat_tokens.Writer({self.path!r}, split={self.split!r}, format={self.format!r}, "
            f"seq_count={self.seq_count}, token_count={self.token_count}, {state})"
        )


class PartWriter(Parting):
    """Writes this process's part of one split that several processes write together.

    The split's ``total_sequences`` sequences (documents) are cut into units of
    ``sequences_per_unit``; rank ``rank`` of ``world_size`` writes the units
    ``shardkit.part_of(n_units, rank)``, i.e. the contiguous sequences ``sequences[0]`` to
    ``sequences[1]``, in order. Each unit is durable as soon as it is full (a private piece
    under ``.shardkit-parts``); the rank that completes the set commits the split, which is
    then byte for byte what one ``Writer`` writes from the same sequences and layout. Without
    ``rank`` and ``world_size`` they come from the launcher (torchrun, Slurm, MPI variables).

    After a kill, start the job again with the same or another world size: ``pending`` lists
    the sequences this rank still owes, and ``append`` takes them in that order. Use as a
    context manager: a clean exit finishes the part (and commits if it was the last); an
    exception leaves it to a restart. ``close()`` returns the split's ``status()``.
    ``progress`` is None (a bar on a terminal if tqdm is installed), a bool, or a callable
    called after each ``append`` with (sequences written of the part, sequences of the part).

    ``path`` may be an ``s3://bucket/prefix`` URL naming a new prefix (its dataset then holds
    this one split): the ranks coordinate through the store alone (conditional writes, lock
    objects with leases), each unit's piece is staged locally and uploaded once full, and the
    commit streams the split to the store as ``Writer`` does (a commit killed midway resumes
    from its last checkpoint, on any machine).
    """

    _w: _core.TokensPartWriter

    def __init__(
        self,
        path: PathLike,
        split: str,
        total_sequences: int,
        layout: Optional[str] = None,
        *,
        sequences_per_unit: int = 65536,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        tokens_per_shard: Optional[int] = None,
        tokens_per_chunk: Optional[int] = None,
        progress: Any = None,
    ) -> None:
        path = _args.path("path", path)
        split = _args.choice("split", split, _SPLITS)
        self._w = _core.TokensPartWriter(
            path,
            split,
            _args.count("total_sequences", total_sequences),
            _args.optional_choice("layout", layout, _LAYOUTS),
            _args.count("sequences_per_unit", sequences_per_unit, lo=1),
            None if rank is None else _args.count("rank", rank),
            None if world_size is None else _args.count("world_size", world_size),
            _args.optional_count("tokens_per_shard", tokens_per_shard, lo=1),
            _args.optional_count("tokens_per_chunk", tokens_per_chunk, lo=1),
        )
        self.path = path
        self.split = split
        first, end = self.sequences
        self._progress = Progress(_args.callback("progress", progress), unit="seq", total=end - first,
                                  initial=end - first - self._owed(), desc=f"writing {split}")

    @property
    def sequences(self) -> "tuple[int, int]":
        """(first, end) of the sequences this rank's part covers."""
        first, end = self._w.sequences
        return (int(first), int(end))

    @property
    def next_sequence(self) -> Optional[int]:
        """The sequence the next ``append`` begins at (None once the part is written)."""
        return self._w.next_sequence

    def append(self, sequences: Iterable[Any]) -> None:
        """Appends the next pending sequences (what ``Writer.append`` takes); each unit
        completed is durable."""
        tokens, lengths = _flatten(sequences, f"{self.path}/{self.split}")
        self._w.append_flat(tokens, lengths)
        first, end = self.sequences
        self._progress.advance(len(lengths), end - first - self._owed(), end - first)


    finish = Parting.close

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        first, end = self.sequences
        return (f"flat_tokens.PartWriter({self.path!r}, split={self.split!r}, rank={self.rank}, "
                f"world_size={self.world_size}, sequences={first}..{end}, {state})")


def status(path: PathLike, split: str = "train") -> Dict[str, Any]:
    """Where a split written in parts stands: ``{"committed", "units", "done", "missing"
    ([first, end] unit ranges), "claimed" ([{"units", "by"}] of live ranks)}``."""
    split = _args.choice("split", split, _SPLITS)
    st: Dict[str, Any] = json.loads(_core.tokens_parts_status(_args.path("path", path), split))
    return st


def commit_parts(path: PathLike, split: str = "train") -> Dict[str, Any]:
    """Commits a split written in parts whose every unit is durable (its last rank was killed
    while committing); returns ``status()``. A committed split is left as it is."""
    split = _args.choice("split", split, _SPLITS)
    st: Dict[str, Any] = json.loads(_core.tokens_commit_parts(_args.path("path", path), split))
    return st


class Split:
    """One split opened for reading: ``len()`` documents, ``split[i]`` -> uint32 token ids."""

    def __init__(self, path: PathLike, name: str) -> None:
        self._s = _core.TokensSplit(_args.path("path", path), _args.choice("name", name, _SPLITS))
        self.name = name
        self.path: str = self._s.path
        counts, info = self._s.counts, self._s.info
        self.token_count: int = counts["token_count"]
        self.seq_count: int = counts["seq_count"]
        self.max_token_id: int = counts["max_token_id"]
        self.format: str = info["format"]
        self.completion: str = info["completion"]
        self.sharded: bool = info["sharded"]

    def __len__(self) -> int:
        return self.seq_count

    def __getitem__(self, i: int) -> np.ndarray:
        """The token ids of document ``i`` (negative indices count from the end)."""
        return _array(self._s.ids(_args.integer("i", i)))

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.seq_count):
            yield self[i]

    def seq_starts(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """``seq_starts[start:stop]`` (uint64); the whole array by default."""
        stop = self.seq_count + 1 if stop is None else _args.integer("stop", stop)
        return _array(self._s.seq_starts(_args.integer("start", start), stop))

    def encoded(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """``encoded_tokens[start:stop]`` (uint32, as stored)."""
        stop = self.token_count if stop is None else _args.integer("stop", stop)
        return _array(self._s.encoded(_args.integer("start", start), stop))

    def __repr__(self) -> str:
        return (
            f"flat_tokens.Split({self.path!r}, format={self.format!r}, "
            f"token_count={self.token_count}, seq_count={self.seq_count}, "
            f"max_token_id={self.max_token_id})"
        )


class Dataset:
    """A dataset's splits by name: ``ds["train"]``, ``ds.train``, ``"validation" in ds``."""

    def __init__(self, path: PathLike) -> None:
        self.path = _args.path("path", path)
        self.splits: List[str]
        local = _core.local_path(self.path)
        if local is None:
            self.splits = list(_core.tokens_splits(self.path))
        else:
            if not os.path.exists(local):
                raise NotFoundError(f"{self.path}: no such directory")
            if not os.path.isdir(local):
                raise NotFoundError(
                    f"{self.path}: not a directory; expected a flat-tokens dataset (a directory "
                    "holding train/ and/or validation/ zarr groups)")
            self.splits = [s for s in _SPLITS if os.path.isdir(os.path.join(local, s))]
        if not self.splits:
            # The library's report says what the path is instead (a split directory, a directory
            # holding datasets one level down) and what to open.
            found = json.loads(_core.tokens_validate(self.path))["errors"]
            why = (f"{found[0]['file']}: {found[0]['message']}" if found else
                   f"{self.path}: holds neither a train nor a validation split")
            raise NotFoundError(why)
        self._open: Dict[str, Split] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.splits

    def __getitem__(self, name: str) -> Split:
        if name not in _SPLITS:
            raise KeyError(f"split must be 'train' or 'validation', got {name!r}")
        if name not in self._open:
            self._open[name] = Split(self.path, name)
        return self._open[name]

    @property
    def train(self) -> Split:
        return self["train"]

    @property
    def validation(self) -> Split:
        return self["validation"]

    def __repr__(self) -> str:
        return f"flat_tokens.Dataset({self.path!r}, splits={self.splits})"


def open(path: PathLike) -> Dataset:  # noqa: A001 - mirrors the built-in's role
    """Opens a dataset. Splits open on first use: a shardkit write that did not finish raises
    IncompleteDatasetError; data without the completion marker (seqax's) is validated in full
    first (see :func:`mark_complete`)."""
    return Dataset(path)


class Loader:
    """seqax's ``ShufflingLoader`` order, any step served directly.

    ``load(step)`` returns this host's rows as a dict of numpy arrays shaped
    ``(batch_size // host_count, seq_len)``: ``inputs``, ``targets``, ``segment_ids`` (int32),
    ``is_seq_start`` and ``mask`` (bool). The same parameters give seqax's rows at every step;
    ``sequences_per_read_block=None`` is seqax's recommendation, ``2**20 // seq_len``.
    ``packed=False`` gives one document per row, truncated to ``seq_len`` and right-padded
    (``mask`` False on padding). Host ``h`` of ``host_count`` serves rows
    ``[h*b/H, (h+1)*b/H)`` and reads only those. Past ``step_count``, ``load`` raises
    IndexError unless ``epochs=True``, where step ``k`` is step ``k % step_count`` of epoch
    ``k // step_count`` in a new order (epoch 0 is seqax's).

    Iterating yields the rest of the current epoch from the loader's position (``step``,
    advanced as you go; set it, or ``set_epoch``, or use ``load_state_dict`` to resume; with
    ``epochs=True`` the next iteration serves the next epoch), prepared ahead on ``num_threads`` threads (default:
    every core) that read and decode rows in parallel. ``verify=True`` checks the chunk files a
    step decodes against the dataset's checksums sidecar first (ValueError naming a damaged one).

    ``buffer_in_memory`` reads each shuffle buffer whole into memory when a step first needs it
    and serves rows from there, as seqax does; while iterating, the next minipoch's buffers are
    read in the background (with ``epochs=True`` across epochs too), so two minipochs' buffers
    are held. ``None`` (default) does so for ``s3://`` splits whose two minipochs' buffers fit
    in ``SHARDKIT_TOKEN_BUFFER_GIB`` (16), ``True`` always, ``False`` never (rows are read one
    by one). ``buffers_in_memory`` says which was chosen.
    """

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
    ) -> None:
        path = _args.path("path", path)
        split = _args.choice("split", split, _SPLITS)
        seq_len = _args.count("seq_len", seq_len, lo=1)
        batch_size = _args.count("batch_size", batch_size, lo=1)
        packed = _args.boolean("packed", packed)
        streams = _args.count("streams", streams, lo=1)
        read_blocks_per_shuffle_buffer = _args.count("read_blocks_per_shuffle_buffer", read_blocks_per_shuffle_buffer, lo=1)
        sequences_per_read_block = _args.optional_count("sequences_per_read_block", sequences_per_read_block, lo=1)
        seed = _args.count("seed", seed)
        _args.rank_world(rank, world_size)
        _args.rank_world(host_index, host_count)
        epochs = _args.boolean("epochs", epochs)
        num_threads = _args.threads("num_threads", num_threads)
        verify = _args.boolean("verify", verify)
        buffer_in_memory = _args.optional_boolean("buffer_in_memory", buffer_in_memory)
        epoch = _args.count("epoch", epoch)
        shuffle = _args.boolean("shuffle", shuffle)
        drop_last = _args.boolean("drop_last", drop_last)
        # The common loader keywords: rank/world_size are seqax's host_index/host_count (hosts
        # that each load their slice of every batch), not read from $RANK (seqax's default is
        # one host).
        if rank is not None and host_index is not None and rank != host_index:
            raise InvalidArgumentError(f"rank={rank} and host_index={host_index} disagree (they are the same thing)")
        if world_size is not None and host_count is not None and world_size != host_count:
            raise InvalidArgumentError(
                f"world_size={world_size} and host_count={host_count} disagree (they are the same thing)")
        host_index = rank if rank is not None else (host_index or 0)
        host_count = world_size if world_size is not None else (host_count or 1)
        _args.rank_world(host_index, host_count)
        if batch_size % host_count:
            raise InvalidArgumentError(
                f"batch_size={batch_size} does not divide by world_size={host_count} (seqax's host_count: "
                "each host loads an equal slice of every global batch)")
        if not shuffle:
            raise InvalidArgumentError(
                "shuffle=False: flat-tokens batches follow seqax's shuffled order (use "
                "Dataset(path)[split] to read sequences in storage order)")
        if not drop_last:
            raise InvalidArgumentError(
                "drop_last=False: seqax's step_count counts full batches only, and so does this loader")
        self._l = _core.TokensLoader(
            path,
            split,
            int(seq_len),
            int(batch_size),
            bool(packed),
            int(streams),
            int(read_blocks_per_shuffle_buffer),
            None if sequences_per_read_block is None else int(sequences_per_read_block),
            int(seed),
            int(host_index),
            int(host_count),
            bool(epochs),
            int(num_threads or 0),
            bool(verify),
            None if buffer_in_memory is None else bool(buffer_in_memory),
        )
        self._epochs = bool(epochs)
        self._world = int(host_count)
        self._rank = int(host_index)
        self._path, self._split = path, split
        self._params = (seq_len, batch_size, seed, packed, epochs)
        self.step = 0
        self._epoch = 0  # the epoch being served: a step at its end is "epoch finished"
        self._resumed = False  # a state was loaded and no pass has started since
        if epoch:
            self.set_epoch(epoch)

    @property
    def path(self) -> str:
        """The dataset."""
        return self._path

    @property
    def split(self) -> str:
        return self._split

    @property
    def batch_size(self) -> int:
        """The global batch (sequences per step over all hosts); each host loads
        ``batch_size // world_size`` rows of it."""
        return self._params[1]

    @property
    def seq_len(self) -> int:
        return self._params[0]

    @property
    def seed(self) -> int:
        return self._params[2]

    @property
    def rank(self) -> int:
        """This host's index (seqax's ``host_index``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Hosts sharing each batch (seqax's ``host_count``)."""
        return self._world

    @property
    def shuffle(self) -> bool:
        """Always True: seqax's shuffled order."""
        return True

    @property
    def drop_last(self) -> bool:
        """Always True: seqax serves full batches only."""
        return True

    def __repr__(self) -> str:
        seq_len, batch_size, seed, packed, epochs = self._params
        return (
            f"flat_tokens.Loader({self._path!r}, {self._split!r}, seq_len={seq_len}, "
            f"batch_size={batch_size}, packed={packed}, seed={seed}, rank={self._rank}, "
            f"world_size={self._world}, epochs={epochs}, step={self.step}, step_count={self.step_count})"
        )

    @property
    def buffers_in_memory(self) -> bool:
        """Whether shuffle buffers are read whole into memory (see ``buffer_in_memory``)."""
        return self._l.buffers_in_memory

    @property
    def step_count(self) -> int:
        """Steps in an epoch (seqax's ``step_count``)."""
        return self._l.step_count

    def __len__(self) -> int:
        return self._l.step_count

    @staticmethod
    def _batch(t: "_core.TokensBatchOut") -> TokensBatch:
        return {
            "inputs": _array(t["inputs"]),
            "targets": _array(t["targets"]),
            "segment_ids": _array(t["segment_ids"]),
            "is_seq_start": _array(t["is_seq_start"]),
            "mask": _array(t["mask"]),
        }

    def load(self, step: int) -> Batch:
        """This host's rows of ``step``; reads only those rows."""
        step = _args.integer("step", step)
        if step < 0:
            raise OutOfRangeError(f"step {step} is before the start: steps count from 0 (no negative indexing)")
        return self._batch(self._l.load(step))

    def rows(self, step: int) -> np.ndarray:
        """The sequence index (packed row, or document when unpacked) of each row of ``step``."""
        step = _args.integer("step", step)
        if step < 0:
            raise OutOfRangeError(f"step {step} is before the start: steps count from 0 (no negative indexing)")
        return _array(self._l.rows(step))

    def iter(self, start_step: int = 0) -> Iterator[Batch]:
        """Batches from ``start_step`` to the end of the epoch (endless with ``epochs=True``)."""
        return self._iter_from(_args.count("start_step", start_step))

    def _iter_from(self, start_step: int) -> Iterator[Batch]:
        it = self._l.iter(start_step)
        try:
            for t in it:
                yield self._batch(t)
        finally:
            it.close()

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch from ``step`` (advancing it), as every loader's
        iteration: ``for epoch in ...: loader.set_epoch(epoch); for batch in loader: ...``.
        With ``epochs=True`` the next iteration continues with the next epoch;
        ``iter(start_step)`` is seqax's endless stream."""
        resumed, self._resumed = self._resumed, False
        n = self.step_count
        if n == 0:
            return
        if self.step == (self._epoch + 1) * n and (resumed or not self._epochs):
            return  # a state saved at the end of its epoch resumes to the end of that epoch
        self._epoch = self.epoch if self.step < (self._epoch + 1) * n else self.step // n
        end = (self._epoch + 1) * n
        it = self._l.iter(self.step)
        try:
            for t in it:
                self.step = t["step"] + 1
                yield self._batch(t)
                if self.step >= end:
                    break
        finally:
            it.close()

    def set_epoch(self, epoch: int) -> None:
        """Goes to the first step of ``epoch`` (``epoch * step_count`` with ``epochs=True``;
        without, epoch 0 is the only one). Right after ``load_state_dict``, the state's epoch
        keeps the loaded step (the training loop calls ``set_epoch`` at every epoch's start)."""
        epoch = _args.count("epoch", epoch)
        if epoch < 0 or (epoch > 0 and not self._epochs):
            raise InvalidArgumentError(f"epoch {epoch} does not exist: this loader has epochs={self._epochs}")
        if self._resumed and epoch == self.epoch:
            return
        self._resumed = False
        self.step = epoch * self.step_count
        self._epoch = epoch

    @property
    def epoch(self) -> int:
        """The epoch being served: that of the next step, or the one just finished (a state
        saved after an epoch's last batch says epoch e, batch ``step_count``)."""
        n = self.step_count
        if n and self._epoch * n <= self.step <= (self._epoch + 1) * n:
            return self._epoch
        return self.step // n if n else 0

    def state_dict(self) -> LoaderState:
        """The next step and the parameters that decide the order (see
        :class:`shardkit.types.LoaderState`): ``step`` is seqax's global step; ``epoch`` and
        ``batch`` are the same position counted per epoch."""
        return cast(LoaderState, self._l.state_dict(self.epoch, self.step))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at ``state["step"]`` (or ``epoch``/``batch``). A state saved by a loader
        that would serve other rows (another split, dataset size, seed, seq_len, global batch,
        packing, streams or shuffle buffer) raises InvalidArgumentError naming each key that
        differs, with both values; ``world_size`` may differ when the global batch is the same.
        Right after it, ``set_epoch`` of the state's epoch keeps the step."""
        check_state(dict(state), "flat_tokens")
        step = self._l.resume_step(dict(state))
        self.step = step
        n = self.step_count
        epoch = int(state.get("epoch", -1))
        self._epoch = epoch if n and epoch * n <= step <= (epoch + 1) * n else (step // n if n else 0)
        self._resumed = True


def validate(path: PathLike) -> Validation:
    """Every violation of every split: ``{"path", "valid", "errors", "notes"}``, each finding
    ``{"file", "message"}`` (:class:`shardkit.types.Validation`, the same for every format)."""
    report: Validation = json.loads(_core.tokens_validate(_args.path("path", path)))
    return report


def inspect(path: PathLike) -> Dict[str, Any]:
    """Per split: format, completion, counts, max_token_id, sequence length statistics."""
    info: Dict[str, Any] = json.loads(_core.tokens_inspect(_args.path("path", path)))
    return info


def mark_complete(path: PathLike) -> None:
    """Validates an unmarked dataset (seqax's) in full and marks it complete, so later opens
    skip the full validation. Raises ValueError listing the problems when it is not valid."""
    _core.tokens_mark_complete(_args.path("path", path))


def convert(src: PathLike, dst: PathLike, layout: str = "v3") -> Dict[str, Dict[str, int]]:
    """Rewrites the dataset at ``src`` into a new dataset at ``dst`` in ``layout``: seqax's v2
    chunks must be decoded whole for every row read, so v3 serves random rows far faster; v2 is
    what seqax reads. The sequences, and every batch a Loader serves, stay the same."""
    done = _core.tokens_convert(_args.path("src", src), _args.path("dst", dst), _args.choice("layout", layout, _LAYOUTS))
    return {
        c["split"]: {"seq_count": c["seq_count"], "token_count": c["token_count"], "max_token_id": c["max_token_id"]}
        for c in done
    }


def _tokenizer_arg(tokenizer: Any) -> "tuple[Optional[str], bool]":
    """(text, is_json) for the core: a tokenizer.json path, a ``tokenizers.Tokenizer``, or a
    ``transformers`` fast tokenizer (its backend tokenizer)."""
    if tokenizer is None:
        return None, False
    if isinstance(tokenizer, (str, os.PathLike)):
        return os.fspath(tokenizer), False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        tokenizer = backend
    to_str = getattr(tokenizer, "to_str", None)
    if callable(to_str):
        return to_str(), True
    raise _args.InvalidArgumentTypeError(
        "tokenizer must be a path to a tokenizer.json, a tokenizers.Tokenizer or a transformers "
        f"fast tokenizer, got {type(tokenizer).__name__}"
    )


def build(
    path: PathLike,
    split: str,
    inputs: Union[PathLike, Sequence[PathLike]],
    *,
    tokenizer: Any = None,
    field: Optional[str] = None,
    layout: Optional[str] = None,
    resume: bool = False,
    append: bool = False,
    checkpoint_tokens: int = 1 << 28,
    num_threads: Optional[int] = None,
    progress: Any = None,
) -> Dict[str, Any]:
    """Builds ``split`` of the dataset at ``path`` from corpora, as ``shardkit tokens build``.

    ``inputs`` is a file, a directory (its .jsonl/.json/.parquet files, compressed or not, in
    name order), a glob pattern (``"data/*.parquet"``) or a list of them, read in order. JSONL
    may be plain, zstd (``.jsonl.zst``) or gzip (``.json.gz``), recognised by content; each
    line is token ids (a list), text (a string) or an object holding either in ``field``.
    Parquet holds documents in the column ``field``: strings, or lists of integer ids. Null
    values are skipped and counted (``null_values``).

    With a ``tokenizer`` (a tokenizer.json path, a ``tokenizers.Tokenizer`` or a transformers
    fast tokenizer) documents are text, tokenized on ``num_threads`` threads (default: every
    core) without special tokens, truncation or padding; ``field`` defaults to ``"text"``.
    Without one they are token ids; ``field`` defaults to ``"input_ids"`` then ``"tokens"``.
    Memory stays bounded whatever the size of a file.

    ``resume=True`` continues an interrupted build from the same inputs (the documents already
    committed are skipped, the last of them checked); ``append=True`` adds the inputs to a
    finished split. An error (bad input names the file and line, row or byte offset) or a
    KeyboardInterrupt commits what was appended and leaves the split resumable. ``progress`` is
    None (a bar in input bytes on a terminal when tqdm is installed), a bool, or a callable
    ``f(bytes_read, bytes_total, sequences, tokens)``. Returns the summary: the split's counts
    (``seq_count``, ``token_count``, ``max_token_id``) and what this build did
    (``appended_sequences``, ``appended_tokens``, ``skipped_documents``, ``null_values``,
    ``bytes_read``, ``inputs``).
    """
    path = _args.path("path", path)
    split = _args.choice("split", split, _SPLITS)
    if isinstance(inputs, (str, os.PathLike)):
        specs = [_args.path("inputs", inputs)]
    elif isinstance(inputs, (list, tuple)):
        specs = [_args.path(f"inputs[{i}]", x) for i, x in enumerate(inputs)]
    else:
        raise _args.InvalidArgumentTypeError(
            f"inputs must be a path, a glob pattern or a list of them, got {type(inputs).__name__}")
    if not specs:
        raise InvalidArgumentError("inputs is empty: give at least one file, directory or glob pattern")
    if field is not None:
        _args.string("field", field)
    layout = _args.optional_choice("layout", layout, _LAYOUTS)
    resume, append = _args.boolean("resume", resume), _args.boolean("append", append)
    checkpoint_tokens = _args.count("checkpoint_tokens", checkpoint_tokens, lo=1)
    num_threads = _args.threads("num_threads", num_threads)
    _args.callback("progress", progress)
    text, is_json = _tokenizer_arg(tokenizer)
    bar = Progress(progress, unit="B", unit_scale=True, desc=f"building {split}")
    last = [0]

    def report(bytes_read: int, bytes_total: Optional[int], sequences: int, tokens: int) -> None:
        if bytes_total is not None:
            bar.set_total(bytes_total)
        bar.advance(bytes_read - last[0], bytes_read, bytes_total, sequences, tokens)
        last[0] = bytes_read

    try:
        summary = _core.tokens_build(
            os.fspath(path),
            split,
            [os.fspath(s) for s in specs],
            field=field,
            tokenizer=text,
            tokenizer_is_json=is_json,
            layout=layout,
            resume=resume,
            append=append,
            checkpoint_tokens=checkpoint_tokens,
            num_threads=num_threads or 0,
            progress=report if bar.active else None,
        )
    finally:
        bar.close()
    out: Dict[str, Dict[str, int]] = json.loads(summary)
    return out


_args.guard_module(globals(), __all__)
