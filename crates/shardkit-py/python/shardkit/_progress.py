"""The ``progress`` argument every writer takes: None (a tqdm bar when stderr is a terminal and
tqdm is installed), a bool, or a callable that is called instead of drawing a bar."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar


class Progress:
    """A bar or a callback for one write; ``advance`` moves the bar and calls the callback."""

    def __init__(
        self, progress: Any, *, unit: str, desc: str = "writing", total: Optional[int] = None,
        initial: int = 0, unit_scale: bool = False,
    ) -> None:
        self.callback: Optional[Callable[..., None]] = None
        self._bar = None
        self.position = initial
        self.total = total
        self.bytes = 0
        self._t0 = time.monotonic()
        if callable(progress) and not isinstance(progress, bool):
            self.callback = progress
        elif progress or (progress is None and sys.stderr.isatty()):
            try:
                from tqdm.auto import tqdm  # type: ignore
            except ImportError:
                return
            self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit_scale, desc=desc)

    @property
    def active(self) -> bool:
        """Whether there is anything to report to."""
        return self._bar is not None or self.callback is not None

    def advance(self, n: int, *args: Any, nbytes: int = 0) -> None:
        """Moves the bar by ``n`` and calls the callback with ``args``; ``nbytes`` written
        with them show on the bar as GB/s since the bar started (the producers' bars)."""
        self.position += n
        self.bytes += nbytes
        if self._bar is not None:
            if self.bytes:
                rate = self.bytes / max(time.monotonic() - self._t0, 1e-9) / 1e9
                self._bar.set_postfix_str(f"{rate:.2f} GB/s", refresh=False)
            self._bar.update(n)
        if self.callback is not None:
            self.callback(*args)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_R = TypeVar("_R")
_W = TypeVar("_W", bound="Closing[Any]")


class Closing(Generic[_R]):
    """What every writer does once: ``close()`` finishes it (the result kept, so a second
    ``close()`` returns it again), ``abort()`` stops it without finishing, and as a context
    manager a clean exit closes and an exception aborts. A writer sets ``_w`` (its core object,
    with ``finish()`` and ``abort()``) and ``_progress``, and defines ``close`` with its own
    docstring as ``return self._close_once(finish)``."""

    _w: Any  # the core writer; each writer declares its type
    _progress: Progress
    _closed: bool = False
    _result: Optional[_R] = None

    def _close_once(self, finish: Callable[[], _R]) -> _R:
        if not self._closed:
            self._closed = True
            self._progress.close()
            self._result = finish()
        if self._result is None:
            raise RuntimeError("the writer failed to finish; it stays resumable")
        return self._result

    def abort(self) -> None:
        """Stops without finishing: what was written stays durable, and a restart (or
        ``resume=True``) continues."""
        if not self._closed:
            self._closed = True
            self._progress.close()
            self._w.abort()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> _R:
        raise NotImplementedError


class Parting(Closing[Dict[str, Any]]):
    """What every part writer (saev, EAGLE-3, flat-tokens) shares: its rank, the ranges it
    still owes, and ``close()`` returning the dataset's status."""

    @property
    def rank(self) -> int:
        """This process's rank."""
        return int(self._w.rank[0])

    @property
    def world_size(self) -> int:
        """How many processes write the dataset."""
        return int(self._w.rank[1])

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """(first, end) ranges still to write, in the order to write them (the part's, less
        what is durable already)."""
        return [(int(b), int(e)) for b, e in self._w.pending]

    def _owed(self) -> int:
        return sum(e - b for b, e in self.pending)

    def close(self) -> Dict[str, Any]:
        """Finishes the part (fails, leaving it to a restart, if pending items remain) and
        commits the dataset when every part is durable. Returns ``status()``."""
        return self._close_once(lambda: json.loads(self._w.finish()))
