"""EAGLE-3 offline target-output caches (NVIDIA NeMo Automodel): write, read, load.

A cache directory holds ``manifest.json`` (the run configuration, ``format_version`` 1 or 2),
``shard-NNNNNN.safetensors`` (sample ``i`` is row ``i % shard_size`` of shard
``i // shard_size``) and ``target_embeddings.safetensors``. Per sample: ``input_ids``,
``attention_mask``, ``loss_mask`` int64 ``[S]``, ``aux_hidden_states`` ``[S, 3H]`` and
``target_probs`` ``[S, Vd]`` in the cache dtype (bf16, fp16 or fp32), ``position_mask`` bool
``[S, 1]``. Version-2 top-k caches store ``target_probs_values`` / ``target_probs_indices``
``[S, k]``; reading them gives the full-width ``target_probs``. Version-2 manifests exist with
and without the input identity (``input_data``, ``split``, ``shuffle_seed``, added by NeMo
without a version bump): the writer writes the keys it is given, ``inspect`` says which.

bf16 arrays are ``ml_dtypes.bfloat16`` when ml_dtypes is installed, otherwise ``uint16`` arrays
of the raw bit patterns. Items are read-only views of the shards' memory maps; loader batches
are writable arrays over one buffer per batch; neither is copied on the way.

The classes are the offline-cache family's (``shardkit._offline``, shared with
``shardkit.dspark``); these refuse a DSpark cache.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from . import _args, _offline
from . import _shardkit as _core
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
    "set_version",
    "IncompleteDatasetError",
]

#: The fields of an item and of a batch, in NeMo's collate order.
ITEM_FIELDS = _offline.ITEM_FIELDS["eagle3"]


class Writer(_offline.Writer):
    __doc__ = _offline.Writer.__doc__
    _schema = "eagle3"


class PartWriter(_offline.PartWriter):
    __doc__ = _offline.PartWriter.__doc__
    _schema = "eagle3"


class Cache(_offline.Cache):
    __doc__ = _offline.Cache.__doc__
    _schema = "eagle3"


class Loader(_offline.Loader):
    __doc__ = _offline.Loader.__doc__
    _schema = "eagle3"


def open(cache_dir: PathLike, max_open: int = 64) -> Cache:  # noqa: A001 - mirrors the built-in
    """Opens a cache; an unfinished one raises IncompleteDatasetError naming the missing samples."""
    return open_cache(Cache, cache_dir, max_open)


def set_version(cache_dir: PathLike, version: int) -> Dict[str, Any]:
    """Switches a cache between format_version 1 and 2 by rewriting only its manifest."""
    version = _args.integer("version", version, lo=0, hi=255, rule="1 or 2")
    out: Dict[str, Any] = json.loads(_core.eagle3_set_version(_args.path("cache_dir", cache_dir), version))
    return out


_args.guard_module(globals(), __all__)
