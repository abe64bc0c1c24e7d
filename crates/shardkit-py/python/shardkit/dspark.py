"""DSpark offline target-supervision caches (NVIDIA NeMo Automodel, ``dspark_cache.py``,
format_version 1): write, read, load.

A cache directory holds ``manifest.json`` (NeMo's ``build_cache_manifest``: the target, the
sizes, and the run's input identity ``train_data_path``, ``train_split``, ``shuffle_seed``,
``mask_reasoning_content``, ``chat_template_sha256``; plus ``"complete"``), shards
``shard-NNNNNN.safetensors`` (sample ``i`` is row ``i % shard_size`` of shard
``i // shard_size``) and ``target_weights.safetensors`` (``embed_tokens.weight`` and
``lm_head.weight``, ``[V, H]``). Per sample: ``input_ids`` and ``loss_mask`` int64 ``[S]``,
``target_hidden_states`` ``[S, target_hidden_dim]`` and ``target_last_hidden_states``
``[S, target_last_hidden_dim]`` in the cache dtype (bf16, fp16 or fp32).

Like NeMo's producers, the writers put the manifest down with ``"complete": false`` before the
first shard and mark it complete once every shard is durable; readers refuse a cache marked
incomplete (a manifest without the key, from NeMo before the marker, reads as complete). A
rerun into a directory whose manifest records another run (any key but ``format_version`` and
``complete``) is refused, naming the keys, as NeMo refuses it. ``PartWriter`` splits the shards
exactly as NeMo's distributed producer does, so either can finish a cache the other began.

The classes are the offline-cache family's (``shardkit._offline``, shared with
``shardkit.eagle3``); these refuse an EAGLE-3 cache.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _args, _offline
from ._offline import PathLike, collate, commit_parts, inspect, open_cache, status, to_torch, validate
from .errors import IncompleteDatasetError

__all__ = [
    "Writer",
    "PartWriter",
    "status",
    "commit_parts",
    "Cache",
    "Loader",
    "open",
    "collate",
    "to_torch",
    "validate",
    "inspect",
    "IncompleteDatasetError",
]

#: The fields of an item and of a batch, in NeMo's collate order (``CACHE_KEYS``).
ITEM_FIELDS = _offline.ITEM_FIELDS["dspark"]


class Writer(_offline.Writer):
    """Writes a DSpark cache: samples accumulate into shards of ``shard_size``, each written
    atomically and durably; the manifest first (``"complete": false``), marked complete by
    ``close()``.

    ``manifest`` is the run configuration NeMo's ``build_cache_manifest`` returns
    (``target_model``, ``target_model_type``, ``target_vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``seq_length``, ``dtype``, ``num_samples``, ``shard_size``,
    ``target_hidden_dim`` = ``hidden_size * len(target_layer_ids)``,
    ``target_last_hidden_dim`` = ``hidden_size``, ``target_layer_ids``, ``train_data_path``,
    ``train_split``, ``shuffle_seed``, ``mask_reasoning_content``, ``chat_template_sha256``);
    ``format_version`` and ``complete`` inside it are ignored.

    ``add``/``add_batch`` take ``input_ids`` and ``loss_mask`` (integers; the mask 0 or 1),
    ``target_hidden_states`` and ``target_last_hidden_states`` (floats, rounded to the cache
    dtype to nearest even as torch's ``.to`` does; NaN, infinities and overflow are refused).
    A directory holding another run's manifest is refused, naming the keys that differ; one
    with shards is refused unless ``resume=True`` (a contiguous prefix, continued at
    ``next_sample``). As a context manager, a clean exit finishes the cache; an exception
    leaves it resumable. ``cache_dir`` may be an ``s3://bucket/prefix`` URL (see
    ``shardkit.eagle3.Writer``).
    """

    _schema = "dspark"

    def __init__(self, cache_dir: PathLike, manifest: Dict[str, Any], *, resume: bool = False,
                 progress: Any = None) -> None:
        super().__init__(cache_dir, manifest, resume=resume, format_version=1, progress=progress)

    def write_target_weights(self, embed_tokens: Any, lm_head: Any) -> None:
        """Writes ``target_weights.safetensors``: ``embed_tokens.weight`` and ``lm_head.weight``,
        ``[vocab_rows, hidden_size]`` each, stored in the cache dtype (NeMo's
        ``write_target_weights``)."""
        _offline._write_weights(self._w, self.path, self.manifest,
                                {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head})


class PartWriter(_offline.PartWriter):
    """Writes this process's part of one DSpark cache that several processes write together:
    rank ``rank`` of ``world_size`` writes the shards NeMo's ``partition_cache_shards`` gives it
    (``shardkit.part_of(ceil(total_samples / shard_size), rank, world_size)``) into the same
    ``cache_dir``; the rank completing the set commits the cache (checksums sidecar, then
    ``manifest.json`` with ``"complete": true``), byte for byte what one ``Writer`` writes.

    A directory NeMo's distributed producer began (its manifest ``"complete": false``, some of
    the shards) is finished when every rank gives the same ``manifest``: like NeMo's rerun, each
    rank writes its whole block again. Another manifest is refused, naming the keys. With
    ``target_weights=True`` the commit waits for ``target_weights.safetensors``
    (``write_target_weights``, typically on rank 0). Otherwise as ``shardkit.eagle3.PartWriter``:
    ``rank``/``world_size`` from the launcher by default, restarts with any world size keep the
    shards already durable, ``close()`` returns ``status()``.
    """

    _schema = "dspark"

    def __init__(self, cache_dir: PathLike, manifest: Dict[str, Any], total_samples: int, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 target_weights: bool = False, progress: Any = None) -> None:
        super().__init__(cache_dir, manifest, total_samples, rank=rank, world_size=world_size,
                         format_version=1, target_embeddings=_args.boolean("target_weights", target_weights),
                         progress=progress)

    def write_target_weights(self, embed_tokens: Any, lm_head: Any) -> None:
        """Writes ``target_weights.safetensors`` once for the cache (a later call with the same
        tables writes nothing; other tables are refused); only with ``target_weights=True``."""
        _offline._write_weights(self._w, self.path, self.manifest,
                                {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head})


class Cache(_offline.Cache):
    """A DSpark cache opened for reading: ``len(cache) == num_samples``, ``cache[i]`` -> dict of
    read-only arrays (``input_ids``, ``loss_mask``, ``target_hidden_states``,
    ``target_last_hidden_states``). A manifest marked ``"complete": false`` raises
    IncompleteDatasetError, as NeMo's reader refuses it. Pickles without its handles (PyTorch
    DataLoader workers, fork or spawn)."""

    _schema = "dspark"

    def target_weights(self) -> Tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        """``(embed_tokens.weight, lm_head.weight)``, ``[vocab_rows, hidden_size]`` each, in the
        dtype they were stored in (read-only, memory-mapped): NeMo's
        ``read_target_weight_modules``."""
        tables = super().target_weights()
        return tables["embed_tokens.weight"], tables["lm_head.weight"]


class Loader(_offline.Loader):
    """Batches of a DSpark cache (dicts of the four fields), shuffled per epoch or in order,
    split across ranks as PyTorch's ``DistributedSampler`` splits them, read with many reads in
    flight; ``state_dict()`` resumes exactly. The keywords are ``shardkit.eagle3.Loader``'s
    (``follow=True`` reads a cache while ``PartWriter`` ranks write it)."""

    _schema = "dspark"


def open(cache_dir: PathLike, max_open: int = 64) -> Cache:  # noqa: A001 - mirrors the built-in
    """Opens a cache; an unfinished one raises IncompleteDatasetError naming what is missing."""
    return open_cache(Cache, cache_dir, max_open)


_args.guard_module(globals(), __all__)
