"""PyTorch adapters (needs torch): an IterableDataset over a saev loader.

Each DataLoader worker of each rank serves its own slice of the global stream (sub-rank
``rank * num_workers + worker``, sub-world ``world_size * num_workers``), so no row is duplicated
and every row of an epoch is served once. Batches are already formed: use
``torch.utils.data.DataLoader(ds, batch_size=None, num_workers=N)``. The dataset implements
``state_dict``/``load_state_dict`` per worker, which torchdata's ``StatefulDataLoader`` collects
and restores; resume with the same world size and number of workers (or the same global batch).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import saev

__all__ = ["SaevIterableDataset"]


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> tuple:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class SaevIterableDataset(IterableDataset):
    """Shuffled (or ordered) saev batches as dicts of torch tensors, split across ranks and
    DataLoader workers without duplicates."""

    def __init__(
        self,
        path: str,
        *,
        layer: Any,
        tokens: str = "content",
        batch_size: int = 16384,
        seed: int = 0,
        epoch: int = 0,
        order: str = "block",
        drop_last: bool = False,
        memory_budget: Optional[int] = None,
        ignore_labels: Any = (),
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self._kw: Dict[str, Any] = dict(
            layer=layer,
            tokens=tokens,
            batch_size=batch_size,
            seed=seed,
            order=order,
            drop_last=drop_last,
            memory_budget=memory_budget,
            ignore_labels=ignore_labels,
        )
        self._path = os.fspath(path)
        self._epoch = epoch
        self._rank, self._world = _rank_world(rank, world_size)
        self._loader: Optional[saev.ShuffledLoader] = None
        self._pending: Optional[Dict[str, int]] = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch for the next iteration (call before iterating, as with samplers)."""
        self._epoch = int(epoch)

    def _make(self) -> saev.ShuffledLoader:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        loader = saev.ShuffledLoader(
            self._path,
            epoch=self._epoch,
            rank=self._rank * nw + wid,
            world_size=self._world * nw,
            **self._kw,
        )
        if self._pending is not None:
            loader.load_state_dict(self._pending)
            self._pending = None
        return loader

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        self._loader = self._make()
        for batch in self._loader:
            yield {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}

    def __len__(self) -> int:
        info = get_worker_info()
        nw = info.num_workers if info is not None else 1
        probe = saev.ShuffledLoader(self._path, rank=self._rank, world_size=self._world * nw, **self._kw)
        return len(probe) * nw

    def state_dict(self) -> Dict[str, int]:
        """This worker's position (four integers)."""
        if self._loader is None:
            return self._pending or {}
        return self._loader.state_dict()

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Resumes this worker from ``state_dict()`` at its next iteration."""
        self._pending = dict(state) if state else None
        if self._pending:
            self._epoch = int(self._pending["epoch"])
