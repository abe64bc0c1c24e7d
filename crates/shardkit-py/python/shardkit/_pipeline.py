"""The device-to-host pipeline the producers share (``shardkit.record``,
``shardkit.precompute_eagle3``): a model's batch is staged in named tensors on the model's
device, copied to pinned host memory on a side CUDA stream, and handed to a write callback on a
writer thread, so the model's stream never waits for the disk.

- ``buffers`` slots circulate between the producer and the writer thread. :meth:`Pipeline.take`
  waits while every slot is being written: that wait is the backpressure that bounds memory
  (``buffers`` staging sets on the device and as many pinned host sets) and makes a disk slower
  than the model slow the model down instead of filling RAM.
- A slot's tensors are allocated on first use and kept (grown when a larger batch comes), so a
  steady run allocates nothing per batch.
- On CUDA, :meth:`Pipeline.submit` records the host copy on a side stream after the model's
  stream's work (``wait_stream``) and an event after it; the writer thread waits on that event
  alone. On the CPU the staging tensors are host memory and are written as they are.
- A write that fails on the thread is kept and raised by the producer's next :meth:`take` (and
  by :meth:`drain`); the batches still queued behind it are dropped, not written, so nothing
  lands after a failure. :meth:`abort` drops the queued batches too.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

#: What the write callback receives: the batch's tensors (on the CPU, ``rows`` long), and the
#: ``meta`` the producer gave :meth:`Pipeline.submit`.
WriteFn = Callable[[Dict[str, torch.Tensor], Any], None]


class Slot:
    """One batch in flight: its staging tensors on the model's device and, on CUDA, the pinned
    host tensors they are copied into (and the event that copy records)."""

    def __init__(self) -> None:
        self.stage: Dict[str, torch.Tensor] = {}
        self.host: Dict[str, torch.Tensor] = {}
        self.event: Optional[Any] = None
        self.rows = 0
        self.meta: Any = None

    def tensor(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The staging tensor ``name`` for a batch of ``shape`` (dim 0: the batch's rows): the
        slot's own, reused when it is large enough, of that dtype and on that device; a view
        of its first ``shape[0]`` rows."""
        t = self.stage.get(name)
        if (t is None or t.shape[0] < shape[0] or tuple(t.shape[1:]) != tuple(shape[1:])
                or t.dtype != dtype or t.device != device):
            t = torch.empty(shape, dtype=dtype, device=device)
            self.stage[name] = t
            if device.type == "cuda":
                self.host[name] = torch.empty(shape, dtype=dtype, pin_memory=True)
                if self.event is None:
                    self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            else:
                self.host.pop(name, None)
        return t[: shape[0]]

    def _source(self) -> Dict[str, torch.Tensor]:
        """The batch as the writer reads it: the host copies on CUDA, else the staging tensors."""
        return {n: (self.host[n] if n in self.host else t)[: self.rows] for n, t in self.stage.items()}


class Pipeline:
    """Slots between a producer and a writer thread that calls ``write`` for each submitted
    batch, in submission order (see the module documentation)."""

    def __init__(self, write: WriteFn, *, buffers: int, name: str) -> None:
        self._write = write
        self._free: "queue.Queue[Slot]" = queue.Queue()
        for _ in range(buffers):
            self._free.put(Slot())
        self._todo: "queue.Queue[Optional[Slot]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._aborting = False
        self._side: Optional[Any] = None
        self._thread: Optional[threading.Thread] = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def error(self) -> Optional[BaseException]:
        """The error of a write that failed on the thread, if one did."""
        return self._error

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def take(self) -> Slot:
        """A free slot, its ``rows`` at 0: waits while every slot is being written (the
        backpressure); raises the error of a write that failed."""
        self.raise_if_failed()
        s = self._free.get()
        s.rows, s.meta = 0, None
        self.raise_if_failed()  # a write may have failed while this call waited
        return s

    def give_back(self, s: Slot) -> None:
        """Returns a slot taken but not submitted (its batch failed before it was complete)."""
        self._free.put(s)

    def submit(self, s: Slot, rows: int, meta: Any = None) -> None:
        """Queues the slot's first ``rows`` rows for writing, after the copy to pinned host
        memory on a side stream when the staging tensors are on CUDA."""
        s.rows, s.meta = rows, meta
        cuda = [t for t in s.stage.values() if t.device.type == "cuda"]
        if cuda:
            device = cuda[0].device
            if self._side is None:
                self._side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            # The copy starts once the model's stream has produced the batch, and runs beside
            # the next forward; only the writer thread waits for it (through the event).
            self._side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side):
                for n, t in s.stage.items():
                    s.host[n][:rows].copy_(t[:rows], non_blocking=True)
                assert s.event is not None
                s.event.record(self._side)
        self._todo.put(s)

    def _loop(self) -> None:
        while True:
            s = self._todo.get()
            if s is None:
                return
            try:
                if self._error is None and not self._aborting:
                    if s.event is not None and s.host:
                        s.event.synchronize()
                    self._write(s._source(), s.meta)
            except BaseException as e:  # the producer's next take() raises it
                self._error = e
            finally:
                s.rows, s.meta = 0, None
                self._free.put(s)

    def drain(self) -> Optional[BaseException]:
        """Waits for the batches queued, stops the thread and returns the error of a write that
        failed (None when every write succeeded). Idempotent."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None
        return self._error

    def abort(self) -> None:
        """Drops the batches still queued and stops the thread."""
        self._aborting = True
        self.drain()
