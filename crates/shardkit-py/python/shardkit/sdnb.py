"""Deeplearning4j SameDiff containers: single SDNB files, shard sets and SDZ archives.

An SDNB file is a 32-byte header, a FlatBuffers graph (variables, small arrays inline, ops,
key/value metadata), raw little-endian blobs for arrays of 1 MiB and more, and a manifest
locating the blobs. A shard set is ``<base>.shard<i>-of-<N>.sdnb``; an SDZ is a ZIP of either.

``open`` returns a read-only mapping from variable name to numpy array. Arrays are views of
the container's memory map, never copies, and not writeable; each keeps the map alive, so it
stays valid after the container is closed. Variables stored in 'f' order come back as
Fortran-ordered arrays with the logical values DL4J shows. ``BFLOAT16`` and ``FLOAT8`` (e4m3)
arrays are ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn`` when ml_dtypes is installed,
otherwise ``uint16`` / ``uint8`` arrays of the raw bit patterns.

``save`` writes arrays as they lie in memory: C- and F-contiguous arrays without a copy, others
copied to C order once. Bits are kept exactly (NaN payloads included).
"""

from __future__ import annotations

import collections.abc
import json
import dataclasses
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _args
from . import _shardkit as _core
from ._progress import Progress
from .errors import InvalidArgumentError
from .types import Validation

try:  # bf16 and fp8 as real numpy dtypes when available
    import ml_dtypes as _ml_dtypes

    _BF16: Any = np.dtype(_ml_dtypes.bfloat16)
    _FP8: Any = np.dtype(_ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover - exercised when ml_dtypes is absent
    _BF16 = _FP8 = None

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Container", "Variable", "open", "save", "convert", "set_metadata", "validate"]

#: numpy dtype -> SameDiff dtype name, for the types stored as they are.
_DTYPES = {
    np.dtype(t): name
    for t, name in [
        (np.bool_, "BOOL"),
        (np.int8, "INT8"),
        (np.int16, "INT16"),
        (np.int32, "INT32"),
        (np.int64, "INT64"),
        (np.uint8, "UINT8"),
        (np.uint16, "UINT16"),
        (np.uint32, "UINT32"),
        (np.uint64, "UINT64"),
        (np.float16, "HALF"),
        (np.float32, "FLOAT"),
        (np.float64, "DOUBLE"),
    ]
}

_VAR_TYPES = ("VARIABLE", "CONSTANT")


@dataclasses.dataclass(frozen=True)
class Variable:
    """One variable of the graph, with or without a stored array."""

    name: str
    #: "VARIABLE", "CONSTANT", "ARRAY" (an op's output) or "PLACEHOLDER".
    var_type: str
    #: SameDiff dtype name: "FLOAT", "BFLOAT16", "HALF", "FLOAT8", "INT64", ...
    dtype: str
    #: None when unknown (a placeholder without one); -1 marks a free dimension.
    shape: Optional[Tuple[int, ...]]
    #: "inline" (in the graph), "appended" (a blob), "empty" (zero elements) or "none".
    storage: str
    #: Bytes of the stored array (0 without one).
    nbytes: int
    #: Element order of the stored bytes: "c" or "f".
    order: str


def _array(dtype: str, buf: Any) -> np.ndarray:
    a = np.asarray(buf)
    if dtype == "BFLOAT16" and _BF16 is not None:
        a = a.view(_BF16)
    elif dtype == "FLOAT8" and _FP8 is not None:
        a = a.view(_FP8)
    return a


class Container(collections.abc.Mapping):  # type: ignore[type-arg]
    """An opened container: ``c[name]`` is the array of a variable that has one (storage
    inline, appended or empty); ``len`` and iteration cover those, in graph order.

    ``variables`` lists every variable (placeholders and op outputs included). Use it as a
    context manager or call ``close()``; after closing, reading arrays raises ValueError, but
    arrays already returned stay valid.
    """

    def __init__(self, path: PathLike) -> None:
        self._c: Any = _core.SdnbContainer(_args.path("path", path))
        self.path: str = self._c.path
        #: "sdnb", "sharded" or "sdz".
        self.kind: str = self._c.kind
        #: The graph's key/value metadata (shard 0's for a shard set).
        self.metadata: Dict[str, str] = dict(self._c.metadata)
        #: Every variable, in graph order.
        self.variables: List[Variable] = [
            Variable(
                v["name"],
                v["var_type"],
                v["dtype"],
                None if v["shape"] is None else tuple(v["shape"]),
                v["storage"],
                v["nbytes"],
                v["order"],
            )
            for v in self._c.variables
        ]
        #: The number of ops in the graph.
        self.op_count: int = self._c.op_count
        #: The files (or ``archive!entry`` names) that make up the model, in shard order.
        self.parts: List[str] = list(self._c.parts)
        #: Archive entries besides the model (SDZ only), e.g. ``tokenizer.json``.
        self.extra_entries: List[str] = list(self._c.extra_entries)
        #: The native runtime's ``manifest.json`` it was opened through (a bundle), else None.
        self.bundle_manifest: Optional[str] = getattr(self._c, "bundle_manifest", None)
        self._names = [v.name for v in self.variables if v.storage != "none"]
        self._known = frozenset(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        a = self._c.array(name)
        return _array(a["dtype"], a["array"])

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def prefetch(self, names: Optional[Iterable[str]] = None) -> None:
        """Fetches these tensors (default: all) of a container read from ``s3://`` in a few
        lists of parallel ranged GETs, so indexing them afterwards makes no request: the fast
        way to load a whole model from a store. Does nothing for a local container."""
        if isinstance(names, str):
            raise _args.InvalidArgumentTypeError(f"names must be a list of tensor names, got the string {names!r}")
        wanted = list(self._names if names is None else names)
        for n in wanted:
            if n not in self._known:
                raise KeyError(n)
        self._c.prefetch(wanted)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def extra_entry(self, name: str) -> bytes:
        """The bytes of an extra archive entry (inflated when it was compressed)."""
        if name not in self.extra_entries:
            raise KeyError(f"{self.path}: no extra entry {name!r} (has {self.extra_entries})")
        return bytes(self._c.extra_entry(name))

    @property
    def closed(self) -> bool:
        return bool(self._c.closed)

    def close(self) -> None:
        """Releases this object's hold on the memory map (arrays handed out keep theirs)."""
        self._c.close()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return (
            f"sdnb.Container({self.path!r}, kind={self.kind!r}, parts={len(self.parts)}, "
            f"arrays={len(self._names)}, variables={len(self.variables)}, "
            f"ops={self.op_count}{state})"
        )


def open(path: PathLike) -> Container:  # noqa: A001 - mirrors the built-in
    """Opens an ``.sdnb`` file, an ``.sdz`` archive, any shard of a set, or a set's base name.

    Every offset is checked once here; a damaged or foreign file raises ValueError naming the
    path, a missing one FileNotFoundError. An ``s3://`` URL is read by range: opening fetches
    headers, graphs and manifests, and each tensor is fetched the first time it is indexed
    (with ``SHARDKIT_CACHE_DIR`` set, the objects are copied whole into that cache instead).
    """
    return Container(path)


def validate(path: PathLike, deep: bool = False) -> Validation:
    """Whether the container opens (every structure, offset and manifest entry checked) and,
    with ``deep``, whether every byte matches its checksums sidecar: ``{"path", "valid",
    "errors", "notes"}`` (:class:`shardkit.types.Validation`, the same for every format)."""
    report: Validation = json.loads(_core.sdnb_validate(_args.path("path", path), _args.boolean("deep", deep)))
    return report


def _as_numpy(x: Any, where: str) -> Tuple[np.ndarray, Optional[str]]:
    """``x`` as a numpy array, and the dtype name when the numpy dtype does not say it (torch
    bf16/fp8 without ml_dtypes)."""
    if isinstance(x, np.ndarray):
        return x, None
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        kind = str(getattr(x, "dtype", ""))
        # numpy has no bf16/fp8: reinterpret the bits, then name the dtype ourselves.
        if kind in ("torch.bfloat16", "torch.float8_e4m3fn"):
            import torch  # noqa: WPS433 - only reached with a torch tensor

            bf16 = kind == "torch.bfloat16"
            bits = x.view(torch.int16).numpy().view(np.uint16) if bf16 else x.view(torch.uint8).numpy()
            real = _BF16 if bf16 else _FP8
            if real is not None:
                return bits.view(real), None
            return bits, "BFLOAT16" if bf16 else "FLOAT8"
        if hasattr(x, "numpy"):
            try:
                return x.numpy(), None
            except TypeError as e:  # e.g. torch's float8_e5m2
                raise InvalidArgumentError(f"{where}: {kind} cannot be stored ({e})") from None
    if x is None:
        raise _args.InvalidArgumentTypeError(f"{where}: expected an array (numpy, torch or a nested list), got None")
    try:
        a = np.asarray(x)
    except (ValueError, TypeError, OverflowError) as e:
        raise _args.InvalidArgumentTypeError(f"{where}: not a rectangular array of numbers ({e})") from None
    return a, None


def _dtype_name(a: np.ndarray, where: str) -> Tuple[np.ndarray, str]:
    d = a.dtype
    if _BF16 is not None and d == _BF16:
        return a, "BFLOAT16"
    if _FP8 is not None and d == _FP8:
        return a, "FLOAT8"
    if d.kind in "biuf":
        name = _DTYPES.get(d.newbyteorder("="))
        if name is not None:
            le = d.newbyteorder("<")
            if d != le:  # stored bytes are little-endian
                a = a.astype(le)
            return a, name
    raise InvalidArgumentError(
        f"{where}: dtype {d} cannot be stored (bool, int8-64, uint8-64, float16/32/64, "
        "ml_dtypes bfloat16 and float8_e4m3fn can)"
    )


def _tensor(name: str, x: Any, var_type: str, path: str) -> Tuple[str, str, str, List[int], str, np.ndarray]:
    where = f"{path}: tensor {name!r}"
    a, forced = _as_numpy(x, where)
    if forced is not None:
        dtype = forced
    else:
        a, dtype = _dtype_name(a, where)
    # Both layouts go out without a copy; anything else is copied to C order once.
    if a.flags.c_contiguous:
        order = "c"
    elif a.flags.f_contiguous:
        order = "f"
    else:
        a, order = np.ascontiguousarray(a), "c"
    data = a.ravel(order="K").view(np.uint8)  # a view: the array is contiguous
    return name, var_type, dtype, list(a.shape), order, data


def save(
    path: PathLike,
    tensors: Mapping[str, Any],
    metadata: Optional[Mapping[str, str]] = None,
    format: Optional[str] = None,  # noqa: A002 - the natural name
    shard_size: Optional[int] = None,
    *,
    var_types: Optional[Mapping[str, str]] = None,
    align: int = 64,
    slack: int = 65536,
    extra_entries: Optional[Mapping[str, bytes]] = None,
    progress: Any = None,
    bundle: bool = False,
) -> List[str]:
    """Writes ``tensors`` (name -> numpy array, torch tensor or array-like) as a container;
    returns the files written.

    ``format``: "sdnb" (one file), "sharded" (``<base>.shard<i>-of-<N>.sdnb`` beside ``path``,
    each at most ``shard_size`` bytes unless one tensor is larger) or "sdz" (a ZIP; a shard set
    inside when ``shard_size`` is given). None infers it: "sdz" for a ``.sdz`` path, "sharded"
    when ``shard_size`` is given, else "sdnb". ``var_types`` maps names to "VARIABLE" (the
    default) or "CONSTANT". ``align`` (a power of two, 8 to 32768) aligns blobs and archive
    entries; ``slack`` zero bytes after the graph leave room for in-place ``set_metadata``.
    ``extra_entries`` (SDZ only) adds archive entries such as ``tokenizer.json`` (names ending
    in ``.sdnb`` are refused). ``bundle=True`` also writes ``manifest.json`` beside a ``.sdz`` or
    ``.sdnb`` file, making its directory a bundle of Deeplearning4j's native runtime. Files are
    published atomically; the GIL is released while writing. ``progress``: None (a byte bar
    on a terminal when tqdm is installed), a bool, or a callable ``(bytes_done, bytes_total)``.
    """
    where = _args.path("path", path)
    _format(format)
    align = _args.integer("align", align, lo=8, hi=32768, rule="an alignment: a power of two from 8 to 32768")
    if align & (align - 1):
        raise InvalidArgumentError(f"align must be an alignment: a power of two from 8 to 32768, got {align}")
    slack = _args.count("slack", slack)
    if extra_entries is not None and not isinstance(extra_entries, Mapping):
        raise _args.InvalidArgumentTypeError(f"extra_entries must map names to bytes, got {type(extra_entries).__name__}")
    _args.callback("progress", progress)
    if not isinstance(tensors, collections.abc.Mapping):
        raise TypeError(f"{where}: tensors must be a mapping of name -> array, not {type(tensors).__name__}")
    var_types = dict(var_types or {})
    unknown = sorted(set(var_types) - set(tensors))
    if unknown:
        raise InvalidArgumentError(f"{where}: var_types names {unknown}, which are not among the tensors")
    for name, vt in var_types.items():
        if not isinstance(vt, str) or vt.upper() not in _VAR_TYPES:
            raise InvalidArgumentError(f"{where}: tensor {name!r}: var_type {vt!r} is not VARIABLE or CONSTANT")
    entries = []
    for name, x in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"{where}: tensor names must be strings, not {type(name).__name__}")
        entries.append(_tensor(name, x, var_types.get(name, "VARIABLE").upper(), where))
    extras = [(n, bytes(b)) for n, b in (extra_entries or {}).items()]
    bar = _byte_progress(progress)
    try:
        return _core.sdnb_save(
            where, entries, _pairs(metadata, where), format, _size(shard_size), int(align), int(slack), extras,
            _bytes_done(bar), **_bundle(bundle),
        )
    finally:
        bar.close()


def convert(
    src: Union[PathLike, Container],
    dst: PathLike,
    format: Optional[str] = None,  # noqa: A002
    shard_size: Optional[int] = None,
    metadata: Optional[Mapping[str, str]] = None,
    progress: Any = None,
    bundle: bool = False,
) -> List[str]:
    """Writes ``src`` (a path or an open Container) again as ``dst`` in another layout: the same
    variables and bytes, ops and other graph parts carried verbatim; ``metadata`` overrides the
    source's keys. ``format``, ``progress`` and ``bundle`` as in ``save``. Returns the files written."""
    where = _args.path("dst", dst)
    core = src._c if isinstance(src, Container) else _args.path("src", src)
    _format(format)
    _args.callback("progress", progress)
    bar = _byte_progress(progress)
    try:
        return _core.sdnb_convert(
            core, where, format, _size(shard_size), _pairs(metadata, where), _bytes_done(bar), **_bundle(bundle)
        )
    finally:
        bar.close()


def _bundle(bundle: Any) -> Dict[str, bool]:
    """The ``bundle`` keyword for the extension, passed only when set."""
    if not isinstance(bundle, bool):
        raise _args.InvalidArgumentTypeError(f"bundle must be a bool, got {type(bundle).__name__}")
    return {"bundle": True} if bundle else {}


def _byte_progress(progress: Any) -> Progress:
    return Progress(progress, unit="B", unit_scale=True, total=0)


def _bytes_done(bar: Progress) -> Optional[Callable[[int, int], None]]:
    """The writer's ``(done, total)`` hook feeding ``bar``; None when nobody listens."""
    if not bar.active:
        return None

    def update(done: int, total: int) -> None:
        bar.set_total(total)
        bar.advance(done - bar.position, done, total)

    return update


def set_metadata(path: PathLike, updates: Mapping[str, Optional[str]], rewrite: bool = False) -> bool:
    """Sets metadata keys (a value of None removes the key). Returns True when done in place
    (only the graph regions overwritten), False after a full atomic rewrite, which happens only
    with ``rewrite=True``; without it, an edit that does not fit the slack raises ValueError and
    nothing changes.

    An in-place edit rewrites the graph region, where small (inline) arrays live: do not edit a
    container whose inline arrays you still hold from ``open`` (appended arrays are unaffected).
    """
    where = _args.path("path", path)
    if not isinstance(updates, Mapping):
        raise _args.InvalidArgumentTypeError(f"updates must map str -> str or None, got {type(updates).__name__}")
    rewrite = _args.boolean("rewrite", rewrite)
    changes = []
    for k, v in updates.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, str)):
            raise _args.InvalidArgumentTypeError(f"{where}: metadata updates map str -> str or None, got {k!r}: {v!r}")
        changes.append((k, v))
    return _core.sdnb_set_metadata(where, changes, rewrite)["in_place"]


def _size(shard_size: Optional[int]) -> Optional[int]:
    if shard_size is None:
        return None
    return _args.integer("shard_size", shard_size, lo=1, hi=(1 << 64) - 1, rule="a positive number of bytes")




def _format(format: Optional[str]) -> Optional[str]:  # noqa: A002
    """The container format's name (its value is checked by the core, which names the path)."""
    if format is not None:
        _args.string("format", format)
    return format


def _pairs(metadata: Optional[Mapping[str, str]], where: str) -> List[Tuple[str, str]]:
    if metadata is not None and not isinstance(metadata, Mapping):
        raise _args.InvalidArgumentTypeError(f"{where}: metadata must map str -> str, got {type(metadata).__name__}")
    out = []
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise _args.InvalidArgumentTypeError(f"{where}: metadata maps str -> str, got {k!r}: {v!r}")
        out.append((k, v))
    return out



_args.guard_module(globals(), __all__)
