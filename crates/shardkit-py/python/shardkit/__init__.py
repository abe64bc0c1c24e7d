"""shardkit: exact, crash-safe, fast access to the on-disk caches ML training reads.

Formats: ``shardkit.saev`` (the saev Sharded Activation File Protocol),
``shardkit.flat_tokens`` (MatX seqax's token datasets in zarr), ``shardkit.eagle3``
(NeMo Automodel's EAGLE-3 offline cache) and ``shardkit.sdnb`` (Deeplearning4j SameDiff
SDNB/SDZ containers). Arrays are numpy arrays over memory owned by the Rust core (no copies);
``shardkit.torch`` adapts loaders to PyTorch.
"""

import atexit
import os
from typing import Any, Dict, Optional, Union

from ._shardkit import __version__
from . import _args
from . import _shardkit as _core
from . import errors
from .errors import (
    AlreadyExistsError,
    CorruptDataError,
    IncompleteDatasetError,
    InternalError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    LockedError,
    RemoteError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ShardkitError,
    ShardkitOSError,
)
from . import dspark, eagle3, flat_tokens, saev, sdnb

__all__ = [
    "saev", "flat_tokens", "eagle3", "dspark", "sdnb", "part_of", "checksum", "verify", "upload", "download",
    "storage_counters", "wait_for_cache", "cache_info", "clear_cache", "errors", "__version__",
    "ShardkitError", "CorruptDataError", "IncompleteDatasetError", "InvalidArgumentError",
    "InvalidArgumentTypeError", "ShardkitOSError", "NotFoundError", "AlreadyExistsError", "LockedError", "RemoteError", "PermissionDeniedError",
    "OutOfRangeError", "InternalError",
]


def upload(
    src: Union[str, "os.PathLike[str]"], dst: str, *, progress: Any = None,
) -> Dict[str, int]:
    """Copies the dataset in local directory ``src`` (any format) to ``dst``
    (``s3://bucket/prefix``): data objects first (large ones as multipart uploads), the commit
    record last (saev's shards.json, EAGLE-3's manifest.json, the zarr group documents), so a
    reader never sees a partial dataset. Several files go up at once. Objects already present at
    the same size (and ETag) are skipped: rerunning after a kill finishes the upload. Returns
    ``{"copied", "skipped", "bytes"}``."""
    return _transfer(src, dst, True, progress, "uploading")


def download(
    src: str, dst: Union[str, "os.PathLike[str]"], *, progress: Any = None,
) -> Dict[str, int]:
    """Copies the dataset at ``src`` (``s3://bucket/prefix``, or one object into the file
    ``dst``) into local directory ``dst``, each file written atomically and the commit record
    last, skipping files already complete. Objects are read with parallel ranged GETs in windows
    of bounded size. Returns ``{"copied", "skipped", "bytes"}``."""
    return _transfer(src, dst, False, progress, "downloading")


def _transfer(src: Any, dst: Any, up: bool, progress: Any, desc: str) -> Dict[str, int]:
    from ._progress import Progress

    src, dst = _args.path("src", src), _args.path("dst", dst)
    _args.callback("progress", progress)

    bar = Progress(progress, unit="B", desc=desc, unit_scale=True)
    seen = [0]

    def report(done: int, total: int) -> None:
        bar.set_total(total)
        bar.advance(done - seen[0], done, total)
        seen[0] = done

    try:
        out: Dict[str, int] = dict(
            _core.transfer(src, dst, up, report if bar.active else None)
        )
    finally:
        bar.close()
    return out


def storage_counters() -> Dict[str, int]:
    """Object-store requests this process has made so far: ``{"gets", "get_bytes", "puts",
    "put_bytes"}`` (GETs are ranged and coalesced: compare ``get_bytes / gets`` with the request
    size), and the bytes the local cache served instead: ``"cache_read_bytes"`` (its pages read
    into a buffer) and ``"cache_mapped_bytes"`` (its pages mapped, rows copied straight out)."""
    return dict(_core.storage_counters())


def wait_for_cache() -> None:
    """Waits until the pages that reads fetched through the local cache (``SHARDKIT_CACHE_DIR``)
    are written into it: reads return first, and the pages are written in the background.
    Raises the first failure to write them since the last call (the cache's disk full, say).
    Runs at interpreter exit, so the pages a job read stay cached for the next."""
    _core.wait_for_cache()


def cache_info(dir: Union[str, "os.PathLike[str]", None] = None) -> "_core.CacheInfo":
    """What the local cache (``dir``, default ``SHARDKIT_CACHE_DIR``) holds: ``{"dir",
    "bytes", "limit_bytes", "objects"}``, each object ``{"url", "bytes", "pages",
    "last_used"}`` (``pages`` 0 for a container copied whole; ``last_used`` in Unix seconds),
    the largest first. Raises InvalidArgumentError for a directory that is not a shardkit
    cache."""
    return _core.cache_info(_args.optional_path("dir", dir))


def clear_cache(url: Optional[str] = None, *, dir: Union[str, "os.PathLike[str]", None] = None) -> Dict[str, int]:
    """Removes the cached objects at or below ``url`` (``s3://bucket/prefix`` or one object's
    URL; every object when None) from the local cache (``dir``, default
    ``SHARDKIT_CACHE_DIR``); returns ``{"files", "bytes"}`` removed. Safe beside processes
    reading through the cache: they fetch again what they miss."""
    if url is not None:
        _args.string("url", url)
    return dict(_core.clear_cache(url, _args.optional_path("dir", dir)))


def _keep_cache_at_exit() -> None:
    try:
        _core.wait_for_cache()
    except ShardkitError as e:  # at exit there is no caller left to raise to
        import sys

        print(f"shardkit: {e}", file=sys.stderr)


atexit.register(_keep_cache_at_exit)


def part_of(units: int, rank: int, world_size: int) -> range:
    """The contiguous block of ``units`` (shards, sequences) that rank ``rank`` of
    ``world_size`` writes in a write in parts: NeMo's ``partition_cache_shards`` (the first
    ``units % world_size`` ranks take one unit more; ranks beyond ``units`` get none)."""
    units = _args.count("units", units)
    rank = _args.count("rank", rank)
    world_size = _args.count("world_size", world_size, lo=1)
    start, end = _core.part_of(units, rank, world_size)
    return range(start, end)


def checksum(path: Union[str, "os.PathLike[str]"]) -> str:
    """Hashes every file of a dataset (any format: a directory, or an SDNB file, SDZ archive, shard
    file or shard set's base name) into its checksums sidecar (xxh3-64 per block), for data
    written by other tools; shardkit's writers add it themselves. Returns the sidecar's path:
    ``shardkit.checksums.json`` in a directory, ``NAME.checksums.json`` beside a container file,
    ``BASE.shard-set.checksums.json`` beside a shard set."""
    return os.fspath(_core.checksum(_args.path("path", path)))


def verify(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Checks every byte of a dataset against its checksums sidecar:
    ``{"sidecar": bool, "intact": bool, "damage": [{"file", "start", "end", "what"}]}``
    (``intact`` is False without a sidecar). ``path`` is any path the format's ``open`` takes
    (a directory, an SDNB file, an SDZ archive, a shard or a shard set's base name), local or
    ``s3://``."""
    v = _core.verify_checksums(_args.path("path", path))
    has, damage = v["has_sidecar"], v["damage"]
    return {
        "sidecar": has,
        "intact": has and not damage,
        "damage": [{"file": os.fspath(d["file"]), "start": d["start"], "end": d["end"], "what": d["what"]} for d in damage],
    }


_args.guard_module(globals(), ["upload", "download", "storage_counters", "wait_for_cache", "cache_info", "clear_cache",
                               "checksum", "verify"])
