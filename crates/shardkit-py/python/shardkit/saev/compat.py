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
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from .. import saev as _saev

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


def _tokens(tokens: Optional[str], patches: Optional[str]) -> str:
    t = tokens if tokens is not None else patches
    return {"image": "content", "patches": "content", "cls": "special"}.get(t or "content", t or "content")


def _root(shards: Optional[str], shard_root: Optional[str]) -> str:
    root = shards if shards is not None else shard_root
    if root is None:
        raise ValueError("set `shards` (the dataset directory)")
    if not os.path.isdir(root):
        raise RuntimeError(f"Activations are not saved at '{root}'.")
    return os.fspath(root)


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
        self.cfg = cfg
        self._ds = _saev.open(_root(cfg.shards, cfg.shard_root))
        self._view = self._ds.indexed(int(cfg.layer), _tokens(cfg.tokens, cfg.patches))
        self._ek, self._tk = _keys(self._ds)
        self.metadata = self._ds.metadata

    def __len__(self) -> int:
        return len(self._view)

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
        if cfg.scale_norm:
            raise NotImplementedError("scale_norm is not implemented (as in saev)")
        self.cfg = cfg
        root = _root(cfg.shards, cfg.shard_root)
        self._ds = _saev.open(root)
        self._ek, self._tk = _keys(self._ds)
        row_bytes = 4 * self._ds.d_model
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

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        self._loader.set_epoch(self._epoch)
        self._epoch += 1
        for b in self._loader:
            yield {
                "act": _tensor(b["act"]),
                self._ek: _tensor(b["example_idx"].astype(np.int32)),
                self._tk: _tensor(b["token_idx"].astype(np.int32)),
            }
