"""Drop-in replacements for ``saev.data`` (saev's own class and field names).

Switch with one import line::

    # from saev.data import ShuffledConfig, ShuffledDataLoader
    from shardkit.saev.compat import ShuffledConfig, ShuffledDataLoader

Batches carry saev's keys (``act``, ``example_idx``, ``token_idx``; ``act``, ``image_i``,
``patch_i`` for protocol 1.x directories) as torch tensors when torch is installed (numpy arrays
otherwise). Differences from saev, on purpose: the shuffled order is deterministic (a function of
``seed``, the epoch and the buffer size) and differs between epochs; ``drop_last`` is honoured;
``n_threads`` sets I/O threads; ``buffer_size`` (in batches) sets the memory budget; timeouts and
``use_tmpdir`` are accepted and ignored; ``scale_norm=True`` raises NotImplementedError as in saev.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from .. import _args
from .. import saev as _saev
from ..errors import InvalidArgumentError, NotFoundError
from ..types import LoaderState

__all__ = [
    "IndexedConfig",
    "IndexedDataset",
    "OrderedConfig",
    "OrderedDataLoader",
    "ShuffledConfig",
    "ShuffledDataLoader",
]


def _tensor(a: Any) -> Any:
    try:
        import torch
    except ImportError:
        return a
    return torch.from_numpy(np.asarray(a))


class _Unsupported(InvalidArgumentError, NotImplementedError):
    """An option saev itself does not implement (a NotImplementedError there, as here)."""


class _NotSaved(NotFoundError, RuntimeError):
    """No dataset at ``shards``: a NotFoundError, and the RuntimeError saev raises."""


def _tokens(tokens: Optional[str], patches: Optional[str]) -> str:
    name = "tokens" if tokens is not None else "patches"
    t = _args.optional_choice(f"cfg.{name}", tokens if tokens is not None else patches, _saev.TOKENS)
    return {"image": "content", "patches": "content", "cls": "special"}.get(t or "content", t or "content")


def _root(shards: Optional[str], shard_root: Optional[str]) -> str:
    root = shards if shards is not None else shard_root
    if root is None:
        raise InvalidArgumentError("set cfg.shards (the dataset directory)")
    root = _args.path("cfg.shards" if shards is not None else "cfg.shard_root", root)
    if not os.path.isdir(root):
        raise _NotSaved(f"Activations are not saved at '{root}'.")
    return root


def _config(cfg: Any, kind: type) -> None:
    if not isinstance(cfg, kind):
        raise _args.InvalidArgumentTypeError(f"cfg must be a {kind.__name__}, got {type(cfg).__name__}")


def _layer(cfg: Any, ds: "_saev.Dataset") -> int:
    """saev's ``layer``: a recorded layer value."""
    if not _args.is_int(cfg.layer):
        raise _args.InvalidArgumentTypeError(
            f"cfg.layer must be a recorded layer value (an integer), got {cfg.layer!r} ({type(cfg.layer).__name__})")
    layer = int(cfg.layer)
    if layer not in ds.layers:
        raise InvalidArgumentError(f"{ds.path}: cfg.layer={layer} was not recorded (layers: {ds.layers})")
    return layer


def _keys(ds: "_saev.Dataset") -> Tuple[Any, ...]:
    return ("image_i", "patch_i") if ds.protocol.startswith("1") else ("example_idx", "token_idx")


@dataclasses.dataclass
class IndexedConfig:
    shards: Optional[str] = None
    tokens: Optional[str] = None
    layer: Union[int, str] = -2
    shard_root: Optional[str] = None
    patches: Optional[str] = None
    seed: int = 17
    debug: bool = False


class IndexedDataset:
    """saev's map-style dataset: ``len()`` rows, ``ds[i]`` -> dict for one row."""

    def __init__(self, cfg: IndexedConfig) -> None:
        _config(cfg, IndexedConfig)
        self.cfg = cfg
        tokens = _tokens(cfg.tokens, cfg.patches)
        self._ds = _saev.open(_root(cfg.shards, cfg.shard_root))
        self._view = self._ds.indexed(_layer(cfg, self._ds), tokens)
        self._ek, self._tk = _keys(self._ds)
        self.metadata = self._ds.metadata

    def __len__(self) -> int:
        return len(self._view)

    def __repr__(self) -> str:
        return f"compat.IndexedDataset({self._ds.path!r}, layer={self._view._layer}, tokens={self._view._tokens!r}, rows={len(self)})"

    def __getitem__(self, i: int) -> Dict[str, Any]:
        row = self._view[i]
        out = {"act": _tensor(row["act"]), self._ek: row["example_idx"], self._tk: row["token_idx"]}
        if "token_label" in row:
            out["token_label"] = row["token_label"]
        return out


@dataclasses.dataclass
class OrderedConfig:
    shards: Optional[str] = None
    tokens: Optional[str] = None
    layer: Union[int, str] = -2
    batch_size: int = 16384
    drop_last: bool = False
    batch_timeout_s: float = 30.0
    buffer_size: int = 64
    debug: bool = False
    log_every_s: float = 30.0
    shard_root: Optional[str] = None
    patches: Optional[str] = None


class OrderedDataLoader:
    """saev's ordered (evaluation) loader: every row in storage order, batched."""

    def __init__(self, cfg: OrderedConfig) -> None:
        _config(cfg, OrderedConfig)
        self.cfg = cfg
        root = _root(cfg.shards, cfg.shard_root)
        self._ds = _saev.open(root)
        self._ek, self._tk = _keys(self._ds)
        self._loader = _saev.OrderedLoader(
            root,
            layer=cfg.layer,
            tokens=_tokens(cfg.tokens, cfg.patches),
            batch_size=cfg.batch_size,
            drop_last=cfg.drop_last,
        )
        self.metadata = self._ds.metadata

    def __len__(self) -> int:
        return len(self._loader)

    def __repr__(self) -> str:
        return f"compat.{type(self).__name__}({self._ds.path!r}, {self._loader!r})"

    @property
    def batch_size(self) -> int:
        return self._loader.batch_size

    @property
    def drop_last(self) -> bool:
        return self._loader.drop_last

    def state_dict(self) -> LoaderState:
        """The position (a shardkit addition: saev's loader has none), as
        :meth:`shardkit.saev.Loader.state_dict`; ``load_state_dict`` resumes it exactly."""
        return self._loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes a position from ``state_dict()`` (refused, naming each differing key, when
        it was saved by a loader that would serve other rows); a state at the end of a pass
        resumes to a full pass, as the interrupted loader's next iteration was."""
        self._loader.load_state_dict(state)
        st = self._loader.state_dict()
        if st["batch"] >= len(self._loader):
            self._loader.load_state_dict({**st, "cursor": 0, "batch": 0})

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for b in self._loader:
            out = {"act": _tensor(b["act"]), self._ek: _tensor(b["example_idx"]), self._tk: _tensor(b["token_idx"])}
            if "token_label" in b:
                out["token_labels"] = _tensor(b["token_label"])
            yield out


@dataclasses.dataclass
class ShuffledConfig:
    shards: Optional[str] = None
    tokens: Optional[str] = None
    layer: Union[int, str] = -1
    batch_size: int = 16384
    drop_last: bool = False
    scale_norm: bool = False
    n_threads: int = 4
    buffer_size: int = 64
    min_buffer_fill: float = 0.0
    batch_timeout_s: float = 30.0
    seed: int = 17
    ignore_labels: List[int] = dataclasses.field(default_factory=list)
    use_tmpdir: bool = False
    debug: bool = False
    log_every_s: float = 30.0
    shard_root: Optional[str] = None
    patches: Optional[str] = None


class ShuffledDataLoader:
    """saev's shuffled (training) loader, deterministic: each iteration is the next epoch."""

    def __init__(self, cfg: ShuffledConfig) -> None:
        _config(cfg, ShuffledConfig)
        if cfg.scale_norm:
            raise _Unsupported("cfg.scale_norm=True is not implemented (as in saev)")
        self.cfg = cfg
        root = _root(cfg.shards, cfg.shard_root)
        self._ds = _saev.open(root)
        self._ek, self._tk = _keys(self._ds)
        row_bytes = 4 * self._ds.d_model
        _args.count("cfg.buffer_size", cfg.buffer_size, lo=1)
        _args.count("cfg.batch_size", cfg.batch_size, lo=1)
        _args.count("cfg.n_threads", cfg.n_threads, lo=1)
        budget = max(64 << 20, cfg.buffer_size * cfg.batch_size * row_bytes)
        self._loader = _saev.ShuffledLoader(
            root,
            layer=cfg.layer,
            tokens=_tokens(cfg.tokens, cfg.patches),
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            drop_last=cfg.drop_last,
            memory_budget=budget,
            ignore_labels=cfg.ignore_labels,
            io_threads=max(1, cfg.n_threads),
        )
        self._epoch = 0
        self.metadata = self._ds.metadata

    def __len__(self) -> int:
        return len(self._loader)

    def __repr__(self) -> str:
        return f"compat.{type(self).__name__}({self._ds.path!r}, {self._loader!r})"

    @property
    def batch_size(self) -> int:
        return self._loader.batch_size

    @property
    def drop_last(self) -> bool:
        return self._loader.drop_last

    def state_dict(self) -> LoaderState:
        """The position (a shardkit addition: saev's loader has none), as
        :meth:`shardkit.saev.Loader.state_dict`: ``epoch`` counts the iterations begun."""
        return self._loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes from ``state_dict()``: the next iteration serves the rest of the state's
        epoch (the next epoch when it was finished). A state saved by a loader that would serve
        other rows (another seed, buffer_size, batch_size, ...) raises InvalidArgumentError
        naming each differing key."""
        self._loader.load_state_dict(state)
        st = self._loader.state_dict()
        self._epoch = st["epoch"] + 1 if st["batch"] >= len(self._loader) else st["epoch"]

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        self._loader.set_epoch(self._epoch)  # keeps a position just loaded for this epoch
        self._epoch += 1
        for b in self._loader:
            yield {
                "act": _tensor(b["act"]),
                self._ek: _tensor(b["example_idx"].astype(np.int32)),
                self._tk: _tensor(b["token_idx"].astype(np.int32)),
            }


_args.guard_module(globals(), __all__)
