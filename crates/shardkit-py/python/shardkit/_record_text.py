"""Token activations of a language model (shardkit.record.TextRecorder): the recorder over fixed
windows of token ids, with the ids kept beside the activations."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from . import _args, flat_tokens
from .errors import InvalidArgumentError

# The token ids beside the activations: a flat-tokens dataset in the saev directory.
TOKEN_IDS = "token_ids"
SPLIT = "train"


def _union(a: List[Tuple[int, int]], b: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for first, end in sorted(a + b):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


def _covers(ranges: List[Tuple[int, int]], first: int, end: int) -> bool:
    return any(f <= first and end <= e for f, e in ranges)


def _owed(ranges: List[Tuple[int, int]], first: int, end: int, what: str) -> bool:
    """Whether windows ``first..end`` are all in ``ranges`` (owed), or none; a batch owing
    some of them only is refused (it would shift the rows of what follows)."""
    if _covers(ranges, first, end):
        return True
    if any(f < end and first < e for f, e in ranges):
        raise InvalidArgumentError(
            f"windows {first}..{end} are partly owed to the {what} ({ranges}): cut the batches with batches(), "
            "whose batches never cross a shard")
    return False


class TextRecorder:
    """Records named modules of a causal or masked language model over windows of ``context``
    token ids into a saev dataset of shardkit's text dialect (docs/record.md "Language
    models"), keeping each window's token ids beside it.

    An example is one window: a ``(context,)`` row of token ids run through the model as one
    sequence; its ``context`` token positions are the example's content tokens (no CLS, no
    padding: a window is all real tokens, so no row holds a pad token's activations). The ids go
    to the flat-tokens dataset ``token_ids`` inside the dataset directory (split ``train``,
    sequence ``i`` = example ``i``'s window; read it with :func:`token_ids`), written in parts by
    the same ranks, so the activation of row (example ``e``, token ``t``) belongs to token
    ``token_ids(path)[e][t]``.

    Arguments as :class:`ActivationRecorder`'s, plus ``context`` (tokens per window) and
    ``tokenizer`` (recorded in the provenance). metadata.json gets ``shardkit_dialect: "text"``,
    ``family`` = the model's ``config.model_type`` unless given, ``cls_token: false`` and
    ``content_tokens_per_example = context``.

    Feed ``rec(input_ids)`` with the windows of :meth:`batches`, in order; it returns the
    model's output, or None for a batch whose activations were durable already (only its ids
    were owed after a kill).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        root: Any,
        *,
        layers: Sequence[int],
        n_examples: int,
        context: int,
        metadata: Optional[Mapping[str, Any]] = None,
        modules: Optional[Sequence[str]] = None,
        capture: str = "output",
        tokenizer: Any = None,
        inputs: Any = None,
        d_model: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        buffers: int = 4,
        progress: Any = None,
        dtype: Any = None,
        max_rel_error: Optional[float] = None,
    ) -> None:
        from .record import ActivationRecorder

        self._context = _args.count("context", context, lo=1)
        md: Dict[str, Any] = {"family": getattr(getattr(model, "config", None), "model_type", None) or "text",
                              "ckpt": getattr(getattr(model, "config", None), "_name_or_path", "") or "unknown",
                              "data": "", "dataset": ""}
        md.update(metadata or {})
        md["shardkit_dialect"] = "text"
        self._acts = ActivationRecorder(
            model, root, layers=layers, n_examples=n_examples, metadata=md, modules=modules, capture=capture,
            cls_token=False, content_tokens=self._context, prefix_tokens=0, d_model=d_model, rank=rank,
            world_size=world_size, buffers=buffers, processor=tokenizer, inputs=inputs, progress=progress,
            dtype=dtype, max_rel_error=max_rel_error)
        try:
            self._ids = flat_tokens.PartWriter(
                os.path.join(self._acts.path, TOKEN_IDS), SPLIT, n_examples,
                sequences_per_unit=self._acts._per_shard, rank=rank, world_size=world_size, progress=False)
        except BaseException:
            self._acts.abort()
            raise
        self._acts_pending = self._acts.pending
        self._ids_pending = self._ids.pending
        self._pending = _union(self._acts_pending, self._ids_pending)
        self._next = self._pending[0][0] if self._pending else None
        self._closed = False

    @property
    def path(self) -> str:
        """The dataset directory (``root/<hash>``)."""
        return self._acts.path

    @property
    def dtype(self) -> str:
        """The stored value type of the activations (``"float32"``, ``"bfloat16"`` or ``"float16"``)."""
        return self._acts.dtype

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """(first, end) windows this rank still owes (activations or ids), in order."""
        return list(self._pending)

    def batches(self, batch_size: int) -> List[Tuple[int, int]]:
        """The pending windows in batches that start at shard starts and never cross a shard
        (see :meth:`ActivationRecorder.batches`)."""
        from .record import shard_batches

        return shard_batches(self._pending, self._acts._per_shard, batch_size)

    def forward(self, input_ids: Any, *args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        """Records the next pending windows: ``input_ids`` of shape (batch, context); an
        ``attention_mask``, if given, must be all ones (a padded window would record pad
        tokens). Returns the model's output (None when only the ids were owed)."""
        if self._closed:
            raise InvalidArgumentError("the recorder is closed")
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(np.asarray(input_ids))
        if ids.dim() != 2 or ids.shape[1] != self._context:
            raise InvalidArgumentError(
                f"input_ids must be (batch, {self._context}) windows of token ids, got {tuple(ids.shape)}")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise InvalidArgumentError(
                "attention_mask has zeros: a window must be all real tokens (padding would be recorded as rows); "
                "pack the token stream into full windows")
        if self._next is None:
            raise InvalidArgumentError("every pending window is recorded already")
        first, end = self._next, self._next + int(ids.shape[0])
        if not _covers(self._pending, first, end):
            raise InvalidArgumentError(
                f"a batch of {end - first} windows from window {first} runs past this rank's pending windows "
                f"{self._pending}; cut them with batches()")
        host = ids.detach().to("cpu", torch.int64).numpy()
        if host.min(initial=0) < 0:
            raise InvalidArgumentError("input_ids holds a negative token id")
        owe_ids = _owed(self._ids_pending, first, end, "token ids")
        owe_acts = _owed(self._acts_pending, first, end, "activations")
        # The ids first: a shard whose activations are durable has its ids durable too.
        if owe_ids:
            self._ids.append(list(host))
        out = None
        if owe_acts:
            out = self._acts.forward(ids, *args, attention_mask=attention_mask, **kwargs) \
                if attention_mask is not None else self._acts.forward(ids, *args, **kwargs)
        self._advance(end)
        return out

    __call__ = forward

    def _advance(self, end: int) -> None:
        nxt = None
        for f, e in self._pending:
            if end < e:
                nxt = max(f, end)
                break
        self._next = nxt

    def close(self) -> Dict[str, Any]:
        """Finishes this rank's part of both (the ids first) and returns the dataset's status
        (``token_ids`` holds the ids split's)."""
        self._closed = True
        ids = self._ids.close()
        status = self._acts.close()
        return {**status, TOKEN_IDS: ids}

    def abort(self) -> None:
        """Stops without finishing: what is durable stays, and a restart continues."""
        self._closed = True
        self._ids.abort()
        self._acts.abort()

    def __enter__(self) -> "TextRecorder":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._closed:
            self.close()
        elif exc_type is not None:
            self.abort()


def token_ids(path: Any) -> flat_tokens.Split:
    """The token ids beside a text-dialect dataset's activations: ``token_ids(path)[e]`` is
    example ``e``'s window (uint32)."""
    return flat_tokens.Split(os.path.join(_args.path("path", path), TOKEN_IDS), SPLIT)
