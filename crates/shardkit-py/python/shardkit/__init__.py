"""shardkit: exact, crash-safe, fast access to the on-disk caches ML training reads.

Formats: ``shardkit.saev`` (the saev Sharded Activation File Protocol),
``shardkit.flat_tokens`` (MatX seqax's token datasets in zarr), ``shardkit.eagle3``
(NeMo Automodel's EAGLE-3 offline cache) and ``shardkit.sdnb`` (Deeplearning4j SameDiff
SDNB/SDZ containers). Arrays are numpy arrays over memory owned by the Rust core (no copies);
``shardkit.torch`` adapts loaders to PyTorch.
"""

import os
from typing import Any, Dict, Union

from ._shardkit import __version__
from . import _shardkit as _core
from . import errors
from .errors import (
    AlreadyExistsError,
    CorruptDataError,
    IncompleteDatasetError,
    InternalError,
    InvalidArgumentError,
    LockedError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ShardkitError,
    ShardkitOSError,
)
from . import eagle3, flat_tokens, saev, sdnb

__all__ = [
    "saev", "flat_tokens", "eagle3", "sdnb", "checksum", "verify", "errors", "__version__",
    "ShardkitError", "CorruptDataError", "IncompleteDatasetError", "InvalidArgumentError",
    "ShardkitOSError", "NotFoundError", "AlreadyExistsError", "LockedError", "PermissionDeniedError",
    "OutOfRangeError", "InternalError",
]


def checksum(path: Union[str, "os.PathLike[str]"]) -> str:
    """Hashes every file of a dataset (any format: a directory, or an SDNB/SDZ container file)
    into its checksums sidecar (xxh3-64 per block), for data written by other tools; shardkit's
    writers add it themselves. Returns the sidecar's path."""
    return os.fspath(_core.checksum(os.fspath(path)))


def verify(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Checks every byte of a dataset against its checksums sidecar:
    ``{"sidecar": bool, "intact": bool, "damage": [{"file", "start", "end", "what"}]}``
    (``intact`` is False without a sidecar)."""
    v = _core.verify_checksums(os.fspath(path))
    has, damage = v["has_sidecar"], v["damage"]
    return {
        "sidecar": has,
        "intact": has and not damage,
        "damage": [{"file": os.fspath(d["file"]), "start": d["start"], "end": d["end"], "what": d["what"]} for d in damage],
    }
