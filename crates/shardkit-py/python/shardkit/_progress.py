"""The ``progress`` argument every writer takes: None (a tqdm bar when stderr is a terminal and
tqdm is installed), a bool, or a callable that is called instead of drawing a bar."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional


class Progress:
    """A bar or a callback for one write; ``advance`` moves the bar and calls the callback."""

    def __init__(
        self, progress: Any, *, unit: str, desc: str = "writing", total: Optional[int] = None,
        initial: int = 0, unit_scale: bool = False,
    ) -> None:
        self.callback: Optional[Callable[..., None]] = None
        self._bar = None
        self.position = initial
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

    def advance(self, n: int, *args: Any) -> None:
        """Moves the bar by ``n`` and calls the callback with ``args``."""
        self.position += n
        if self._bar is not None:
            self._bar.update(n)
        if self.callback is not None:
            self.callback(*args)

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
