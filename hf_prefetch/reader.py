"""Reading a checkpoint's tensors into caller-owned tensors, in host memory or on a CUDA device, from a thread pool.

Host destinations of a file the page cache holds are filled straight by positional reads, big tensors split into
chunks so that every reader thread has work. Device destinations, and every destination of a file read directly (one
the cache mostly does not hold, see `diskio`), go through windows: aligned byte ranges read into bounce buffers and
copied from there to each destination in the window. The reader knows byte ranges (`checkpoint.TensorEntry`); which
tensor goes where is the loader's call.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpoint, TensorEntry
from .diskio import Window, cached_fraction, open_direct, plan_windows, pread
from .host import HostArena

__all__ = ["TensorReader"]

_CHUNK_BYTES = 16 * 2**20  # one positional read; big tensors are split so that every reader thread has work
_READERS = min(16, os.cpu_count() or 4)
_WINDOW_BYTES = 8 * 2**20  # one windowed read (a multiple of diskio.DIRECT_ALIGN_BYTES)
_BOUNCE_BUFFERS = 2 * _READERS  # windows being read or copied out
_DIRECT_BELOW = 0.5  # `direct=None`: a file is read directly when the page cache holds less than this share of it


class TensorReader:
    """Fills tensors with checkpoint tensors, casting where the dtypes differ.

    Host destinations (pinned or not) are written in place by positional reads from a thread pool; CUDA destinations
    (and every destination of a file read directly) through windows of bounce buffers ([Note: windowed reads]),
    whose asynchronous copies to the device overlap the next reads. No intermediate copy of a whole tensor is made,
    except for the rare destination that is not contiguous, or a device cast of a tensor whose offset in its file is
    not a multiple of its element size.

    Example:

    ```python
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> from hf_prefetch.checkpoint import Checkpoint
    >>> from hf_prefetch.reader import TensorReader
    >>> out = torch.empty(2, 3, dtype=torch.bfloat16)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_file({"w": torch.ones(2, 3)}, f"{folder}/model.safetensors")
    ...     with Checkpoint.open(folder) as checkpoint, TensorReader(checkpoint) as reader:
    ...         reader.load([(checkpoint["w"], out)])
    >>> out.sum().item(), reader.bytes_read
    (6.0, 24)

    ```
    """

    def __init__(
        self, checkpoint: Checkpoint, on_read: Callable[[int], Any] | None = None, direct: bool | None = None
    ) -> None:
        self.checkpoint = checkpoint
        self.on_read = on_read
        self.direct = direct
        self.bytes_read = 0
        self.direct_bytes = 0  # of bytes_read, read with direct I/O
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="hf_prefetch-read")
        self._direct_fds: dict[Path, int | None] = {}  # None: read this file through the page cache

    def load(self, reads: Sequence[tuple[TensorEntry, torch.Tensor]]) -> None:
        """Fill each `(entry, out)` pair's `out` (same shape as the entry) and return once all are filled."""
        for entry, out in reads:
            if tuple(out.shape) != entry.shape:
                raise ValueError(f"{entry.key!r} has shape {list(entry.shape)}, the destination {list(out.shape)}.")
        reads = [(entry, out) for entry, out in reads if out.numel()]
        windowed = [(entry, out) for entry, out in reads if self._through_windows(entry, out)]
        chosen = {id(out) for _, out in windowed}
        rest = [(entry, out) for entry, out in reads if id(out) not in chosen]
        futures = [f for entry, out in rest if out.device.type == "cpu" for f in self._submit_host(entry, out)]
        windows = None
        try:
            if windowed:
                windows = _Windows(self, windowed)
                futures += windows.submit()
            for entry, out in rest:
                if out.device.type != "cpu":  # rare (see `_through_windows`): synchronous, via pageable memory
                    out.copy_(self.read_tensor(entry))
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()  # wait: nothing may still write into `out` once this returns
            if windows is not None:
                windows.finish()

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """A new host tensor holding `entry`."""
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            self._read(entry, _bytes_of(out), 0)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        fds, self._direct_fds = self._direct_fds, {}
        for fd in fds.values():
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, entry: TensorEntry, out: np.ndarray, start: int) -> None:
        self.checkpoint.read(entry, out, start)
        self._count(out.nbytes, direct=False)

    def _count(self, nbytes: int, direct: bool) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.direct_bytes += nbytes if direct else 0
            if self.on_read is not None:
                self.on_read(nbytes)

    def _read_cast(self, entry: TensorEntry, out: torch.Tensor, first: int) -> None:
        # Elements [first, first + out.numel()) of `entry`, through a small temporary, cast into `out`.
        staged = torch.empty(out.numel(), dtype=entry.dtype)
        self._read(entry, _bytes_of(staged), first * entry.dtype.itemsize)
        out.copy_(staged.view(out.shape))

    def _submit_host(self, entry: TensorEntry, out: torch.Tensor) -> list[Future]:
        if not out.is_contiguous():
            return [self._pool.submit(lambda: out.copy_(self.read_tensor(entry)))]
        if out.dtype == entry.dtype:
            raw = _bytes_of(out)
            return [self._pool.submit(self._read, entry, raw[a:b], a) for a, b in _spans(entry.nbytes, _CHUNK_BYTES)]
        flat, step = out.view(-1), max(1, _CHUNK_BYTES // entry.dtype.itemsize)
        return [self._pool.submit(self._read_cast, entry, flat[a:b], a) for a, b in _spans(flat.numel(), step)]

    def _through_windows(self, entry: TensorEntry, out: torch.Tensor) -> bool:
        # Windows carry every contiguous device destination, and the contiguous host destinations of files read
        # directly (a host destination of a cached file is read straight into place, with no bounce). A window copies
        # raw bytes, or casts whole elements: a cast needs the tensor's elements aligned in the file (window
        # boundaries are multiples of every element size) and is done for device destinations only (host casts go
        # through `_read_cast`).
        if not out.is_contiguous():
            return False
        if out.dtype != entry.dtype:
            return out.device.type != "cpu" and entry.offset % entry.dtype.itemsize == 0
        return out.device.type != "cpu" or self._direct_fd(entry.path) is not None

    def _direct_fd(self, path: Path) -> int | None:
        with self._lock:  # one descriptor per file, whichever thread asks first
            if path not in self._direct_fds:
                wanted = self.direct
                if wanted is None:
                    fraction = cached_fraction(path)
                    wanted = fraction is not None and fraction < _DIRECT_BELOW
                self._direct_fds[path] = open_direct(path) if wanted else None
            return self._direct_fds[path]


class _Windows:
    """One `load`'s windowed reads. [Note: windowed reads] The byte ranges of the reads are cut into aligned windows
    (`diskio.plan_windows`); a reader thread takes a free bounce buffer, reads one window into it (with O_DIRECT for
    a file read directly, else through the page cache), and copies each piece of the window to its destination: a
    host destination at once, a device destination asynchronously on a copy stream of its device, behind which an
    event is recorded. A bounce buffer goes back to the free queue after its host copies returned and is refilled
    only after its events completed. The buffers are page-locked when a destination is on a device, so those copies
    are asynchronous and overlap the next reads."""

    def __init__(self, reader: TensorReader, reads: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        self.reader = reader
        # A piece's key: (entry, the destination as a flat tensor of its elements).
        ranges = [(e.path, e.offset, e.nbytes, (e, out.reshape(-1))) for e, out in reads]
        self.windows = plan_windows(ranges, _WINDOW_BYTES)
        # fds[path]: the descriptor each window of the file is read with; direct[path]: whether that is direct I/O.
        self.fds: dict[Path, int] = {}
        self.direct: dict[Path, bool] = {}
        for path in dict.fromkeys(w.path for w in self.windows):
            fd = reader._direct_fd(path)
            self.direct[path] = fd is not None
            self.fds[path] = fd if fd is not None else reader.checkpoint.fd(path)
        devices = list(dict.fromkeys(out.device for _, out in reads if out.device.type == "cuda"))
        buffers = min(_BOUNCE_BUFFERS, len(self.windows))
        self.bounce = HostArena([_WINDOW_BYTES] * buffers)
        # streams[device]: the copies out of bounce buffers into that device, ordered after the work queued on the
        # device's current stream so far (the destinations were allocated there).
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        try:
            if devices:
                self.bounce.bytes_view(0, self.bounce.nbytes).zero_()  # touched pages page-lock ~10x faster
                self.bounce.pin()
            for device in devices:
                self.streams[device] = torch.cuda.Stream(device)
                self.streams[device].wait_stream(torch.cuda.current_stream(device))
        except BaseException:
            self.bounce.release()
            raise
        # free: (bounce buffer index, events recorded behind its last device copies)
        self.free: queue.SimpleQueue[tuple[int, list[torch.cuda.Event]]] = queue.SimpleQueue()
        for index in range(len(self.bounce.offsets)):
            self.free.put((index, []))

    def submit(self) -> list[Future]:
        return [self.reader._pool.submit(self._read_window, window) for window in self.windows]

    def finish(self) -> None:
        """After every submitted window has ended: wait for the device copies, then release the buffers."""
        for stream in self.streams.values():
            stream.synchronize()
        self.bounce.release()

    def _read_window(self, window: Window) -> None:
        index, pending = self.free.get()
        try:
            for event in pending:
                event.synchronize()  # the last copies out of this buffer have finished
            pending = []
            buffer = self.bounce.bytes_view(index, window.stop - window.start)
            direct = self.direct[window.path]
            try:
                got = pread(self.fds[window.path], buffer.numpy(), window.start)
            except OSError as err:
                if not direct or err.errno != errno.EINVAL:
                    raise
                # A file system that opens files for direct I/O but refuses a read (a block size above 4096, some
                # FUSE mounts): this window through the page cache.
                direct = False
                got = pread(self.reader.checkpoint.fd(window.path), buffer.numpy(), window.start)
            needed = max(offset + nbytes for offset, nbytes, _ in window.pieces) - window.start
            if got < needed:
                raise ValueError(
                    f"{window.path}: the file ended at byte {window.start + got} while reading up to byte "
                    f"{window.start + needed}; it was truncated after it was opened. Re-download or re-save the "
                    "checkpoint."
                )
            for offset, nbytes, (entry, flat) in window.pieces:
                source = buffer[offset - window.start : offset - window.start + nbytes]
                if flat.dtype == entry.dtype:  # raw bytes, whatever their alignment
                    target = flat.view(torch.uint8)[offset - entry.offset : offset - entry.offset + nbytes]
                else:  # whole elements, cast on the way (`_through_windows` checked their alignment)
                    size = entry.dtype.itemsize
                    first = (offset - entry.offset) // size
                    target, source = flat[first : first + nbytes // size], source.view(entry.dtype)
                if target.device.type == "cpu":
                    target.copy_(source)
                    continue
                stream = self.streams[target.device]
                with torch.cuda.stream(stream):
                    target.copy_(source, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                pending.append(event)
            self.reader._count(sum(nbytes for _, nbytes, _ in window.pieces), direct=direct)
        finally:
            self.free.put((index, pending))


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    # The raw bytes of a contiguous host tensor, as a writable uint8 numpy array sharing its memory.
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, total)) for a in range(0, total, step)]
