"""Typed shapes shared by every format: batches, loader states and validation reports.

Every loader (``saev.Loader``, ``flat_tokens.Loader``, ``eagle3.Loader``) takes the same keywords
(``batch_size``, ``shuffle``, ``seed``, ``epoch``, ``rank``, ``world_size``, ``drop_last``,
``num_threads``, ``verify``), has ``set_epoch``, ``__len__`` (batches per epoch on this rank),
and ``state_dict()`` / ``load_state_dict()`` with the shape :class:`LoaderState`.
"""

import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.8-3.10
    from typing_extensions import NotRequired, TypedDict

__all__ = [
    "SaevBatch", "TokensBatch", "Eagle3Batch", "LoaderState", "Validation", "Finding", "FollowBroadcast",
]  # and EngineLoader (internal)


FollowBroadcast = Callable[[Optional[List[int]]], List[int]]
"""A follow-mode loader's round broadcast (``follow_broadcast=``): called on every rank reading
together, once per round, in the same order: on rank 0 with what it found (a list of ints),
which it returns; on the others with ``None``, returning rank 0's list (for example
``torch.distributed.broadcast_object_list([value], src=0)``)."""

class SaevBatch(TypedDict):
    """A batch of activation rows (numpy arrays over the loader's buffers)."""

    act: np.ndarray
    """``(n, d_model)`` activations: float32, or as a reduced-precision dataset stores them
    (``ml_dtypes.bfloat16`` / ``np.float16``) unless the loader was given ``dtype="float32"``."""
    example_idx: np.ndarray
    """``(n,)`` int64: the example of each row."""
    token_idx: np.ndarray
    """``(n,)`` int64: the token of each row (-1 for CLS)."""
    layer: NotRequired[np.ndarray]
    """``(n,)`` int64, when the loader reads several layers."""
    token_label: NotRequired[np.ndarray]
    """``(n,)`` uint8 patch labels, when the dataset has ``labels.bin``."""


class TokensBatch(TypedDict):
    """seqax's batch: ``(rows, seq_len)`` arrays."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    is_seq_start: np.ndarray
    mask: np.ndarray


class Eagle3Batch(TypedDict):
    """NeMo's collated EAGLE-3 batch (fields in NeMo's order; ``position_mask`` and
    ``target_probs`` only when the cache stores them)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    aux_hidden_states: np.ndarray
    position_mask: NotRequired[np.ndarray]
    target_probs: NotRequired[np.ndarray]


class LoaderState(TypedDict, total=False):
    """What ``state_dict()`` returns and ``load_state_dict()`` takes, for every loader.

    The first six keys are common to all formats; the rest are the format's own: its position
    (saev ``cursor``, flat-tokens ``step``) and every parameter that decides which rows land in
    which batch. ``load_state_dict`` checks each parameter the state has against the loader's
    and raises InvalidArgumentError naming every key that differs, with both values; a state
    saved by an older version, with fewer keys, is checked on those it has. Right after
    ``load_state_dict``, ``set_epoch`` of the state's epoch keeps the position. See "Resuming
    training" in docs/api.md.
    """

    format: str
    """``"saev"``, ``"flat_tokens"`` or ``"eagle3"``."""
    seed: int
    """The shuffle seed (checked: an explicit ``seed=`` that differs is refused)."""
    epoch: int
    """The epoch being served (a state saved after an epoch's last batch keeps that epoch, with
    ``batch`` equal to the batches per epoch)."""
    batch: int
    """The next batch of the epoch (0-based): the one the next iteration yields."""
    batch_size: int
    """Rows (or samples) per batch on each rank."""
    world_size: int
    # saev
    cursor: int
    """saev: global rows of the epoch consumed."""
    global_batch_size: int
    """saev and flat-tokens: the batch over all ranks (a state resumes on any world size with
    the same one)."""
    order: str
    layer: Any
    """saev: the layer read (an int, or ``"all"``)."""
    tokens: str
    ignore_labels: List[int]
    drop_last: bool
    """saev, EAGLE-3."""
    memory_budget: int
    window_blocks: int
    """saev: the blocks per window the memory budget gives (what decides the block order)."""
    rows: int
    """saev: selected rows per epoch (the dataset, layer, tokens and ignored labels)."""
    follow_rounds: List[int]
    """saev and EAGLE-3 with ``follow=True``: the epoch's rounds so far, each as its count of
    shard ranges then their (first, end) shards; saev's ``cursor`` counts the rows of the rounds
    in order, EAGLE-3's ``batch`` their batches (each round's last one may be short)."""
    # flat-tokens (seqax)
    step: int
    """flat-tokens: seqax's global step."""
    split: str
    step_count: int
    """flat-tokens: steps per epoch (the dataset's size)."""
    seq_len: int
    packed: bool
    streams: int
    read_blocks_per_shuffle_buffer: int
    sequences_per_read_block: int
    epochs: bool
    # EAGLE-3
    shuffle: bool
    samples: int
    """EAGLE-3: samples in the cache."""


class Finding(TypedDict):
    """One problem ``validate`` found."""

    file: str
    """The file it concerns (the dataset itself when the finding is about all of it)."""
    message: str


class Validation(TypedDict):
    """What every format's ``validate()`` returns."""

    path: str
    valid: bool
    """No errors (notes may exist)."""
    errors: List[Finding]
    notes: List[Finding]
    """Facts worth knowing that are not errors (e.g. a missing checksums sidecar)."""


class EngineLoader:
    """What the saev and EAGLE-3 loaders share: a compiled engine loader ``_l`` that keeps the
    epoch, the rank split and the position."""

    _l: Any
    _opts: Dict[str, Any]
    """The options the loader was built with (``batch_size``, ``seed``, ``drop_last``, ...)."""

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self._l)

    @property
    def batch_size(self) -> int:
        """Rows (saev) or samples (EAGLE-3) per batch on this rank."""
        return int(self._opts["batch_size"])

    @property
    def seed(self) -> int:
        return int(self._opts["seed"])

    @property
    def drop_last(self) -> bool:
        return bool(self._opts["drop_last"])

    @property
    def epoch(self) -> int:
        return int(self._l.epoch)

    @property
    def rank(self) -> int:
        return int(self._l.rank_world["rank"])

    @property
    def world_size(self) -> int:
        return int(self._l.rank_world["world_size"])

    def set_epoch(self, epoch: int) -> None:
        """Switches to ``epoch`` (a different order) from its start."""
        from . import _args

        self._l.set_epoch(_args.count("epoch", epoch))


def check_state(state: Dict[str, Any], fmt: str) -> None:
    """Refuses a state saved by another format's loader."""
    from .errors import InvalidArgumentError

    if not isinstance(state, dict) or not state:
        raise InvalidArgumentError(
            f"expected a {fmt} loader's state_dict(), got {state!r}: an empty state holds no position")
    got = state.get("format", fmt)
    if got != fmt:
        raise InvalidArgumentError(f"this state was saved by a {got} loader, not a {fmt} one")
