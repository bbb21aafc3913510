"""Reading a checkpoint's tensors into caller-owned tensors, in host memory or on a CUDA device, from a thread pool.

Host destinations of a file the page cache holds are filled straight by positional reads, big tensors split into
chunks so that every reader thread has work. CUDA destinations of a file the page cache holds are copied by the copy
engine straight out of the cache's pages (mapped reads). Every destination of a file read directly (one the cache
mostly does not hold, see `diskio`), and device destinations that the mapped reads cannot take, go through windows:
aligned byte ranges read into bounce buffers and copied from there to each destination in the window. The reader
knows byte ranges (`checkpoint.TensorEntry`); which tensor goes where is the loader's call.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..host.arena import HostArena, lock_read_only, unlock
from ..host.diskio import (
    FileMapping,
    FileTruncated,
    SharedMappings,
    Window,
    cached_fraction,
    open_direct,
    plan_windows,
    pread_falling_back,
    read_exactly,
)
from ..interrupts import deferred_interrupts
from .checkpoint import Checkpoint, TensorEntry

__all__ = ["TensorReader", "MAPPED_FROM", "driver_maps_files"]

_CHUNK_BYTES = 16 * 2**20  # one positional read; big tensors are split so that every reader thread has work
_READERS = min(16, os.cpu_count() or 4)
_WINDOW_BYTES = 8 * 2**20  # one windowed read (a multiple of alignment.DIRECT_IO_ALIGN_BYTES)
_BOUNCE_BUFFERS = 2 * _READERS  # windows being read or copied out
_DIRECT_BELOW = 0.5  # `direct=None`: a file is read directly when the page cache holds less than this share of it
MAPPED_FROM = 0.9  # a file the page cache holds at least this share of is mapped (reads onto CUDA, host storage)
_SPAN_BYTES = 32 * 2**20  # one mapped read: at most _READERS spans are page-locked (and resident) at once
_STRETCH_BYTES = 2**30  # the mapped reads map a file this much at a time

# Whether the driver page-locks read-only mappings of a file system's files for a device, by (device index, st_dev):
# asked once per process, and answered False for good once a span of that file system is refused.
_maps_files: dict[tuple[int, int], bool] = {}
_maps_files_lock = threading.Lock()


class TensorReader:
    """Fills tensors with checkpoint tensors, casting where the dtypes differ.

    Host destinations (pinned or not) are written in place by positional reads from a thread pool. CUDA destinations
    of a file the page cache holds are copied from the cache's pages by the copy engine ([Note: mapped reads]) unless
    `mapped=False`; the other CUDA destinations (a cast, a file read directly, a driver that cannot lock file mappings)
    and every destination of a file read directly go through windows of bounce buffers ([Note: windowed reads]), whose
    asynchronous copies to the device overlap the next reads. No intermediate copy of a whole tensor is made, except
    for the rare destination that is not contiguous, or a device cast of a tensor whose offset in its file is not a
    multiple of its element size.

    Example:

    ```python
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> from hf_prefetch.loading.checkpoint import Checkpoint
    >>> from hf_prefetch.loading.reader import TensorReader
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
        self,
        checkpoint: Checkpoint,
        on_read: Callable[[int], Any] | None = None,
        direct: bool | None = None,
        mapped: bool = True,
    ) -> None:
        self.checkpoint = checkpoint
        self.on_read = on_read
        self.direct = direct
        self.mapped = mapped  # False: no mapped reads, CUDA destinations go through windows
        self.bytes_read = 0
        self.direct_bytes = 0  # of bytes_read, read with direct I/O
        self.mapped_bytes = 0  # of bytes_read, copied by the copy engine from the page cache's pages
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="hf_prefetch-read")
        self._direct_fds: dict[Path, int | None] = {}  # None: read this file through the page cache
        # The descriptors `close` did not get to (a Ctrl-C as it began, a reader dropped unclosed) close as it goes.
        weakref.finalize(self, _close_all, self._direct_fds)
        self._fractions: dict[Path, float | None] = {}  # the share of each file the page cache held when first asked
        self._mapped_files: dict[tuple[torch.device, Path], bool] = {}  # `_through_mapping`'s answer per file

    def load(self, reads: Sequence[tuple[TensorEntry, torch.Tensor]]) -> None:
        """Fill each `(entry, out)` pair's `out` (same shape as the entry) and return once all are filled."""
        for entry, out in reads:
            if tuple(out.shape) != entry.shape:
                raise ValueError(f"{entry.key!r} has shape {list(entry.shape)}, the destination {list(out.shape)}.")
        reads = [(entry, out) for entry, out in reads if out.numel()]
        mapped = [(entry, out) for entry, out in reads if self._through_mapping(entry, out)]
        chosen = {id(out) for _, out in mapped}
        windowed = [(e, out) for e, out in reads if id(out) not in chosen and self._through_windows(e, out)]
        chosen |= {id(out) for _, out in windowed}
        rest = [(entry, out) for entry, out in reads if id(out) not in chosen]
        host = [job for entry, out in rest if out.device.type == "cpu" for job in self._host_jobs(entry, out)]
        futures: list[Future] = []
        windows = spans = None

        def end() -> None:
            # Nothing may still write into `out` once `load` returns, and the bounce buffers and mappings are released
            # only after every copy out of them ended. Idempotent: what an interrupt stopped is done again.
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()  # wait
            try:
                if windows is not None:
                    windows.finish()
            finally:
                if spans is not None:
                    spans.finish()

        try:
            spans = _Mapped(self, mapped) if mapped else None
            windows = _Windows(self, windowed) if windowed else None
            # Interleaved: the host's reads (CPU copies) and the mapped reads (the copy engine's) overlap.
            jobs = [host, spans.jobs() if spans else [], windows.jobs() if windows else []]
            with deferred_interrupts():  # each job recorded as it is submitted: none is left unawaited
                for job in _interleave(jobs):
                    futures.append(self._pool.submit(job))
            for entry, out in rest:
                if out.device.type != "cpu":  # rare (see `_through_windows`): synchronous, via pageable memory
                    out.copy_(self.read_tensor(entry))
            for future in futures:
                future.result()
            # Ended inside the `try`: a Ctrl-C landing as the `finally` began left the bounce buffers to the collector
            # with copies to the device in flight; one landing here is one more the `finally` ends the reads after.
            end()
        finally:
            end()

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """A new host tensor holding `entry`."""
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            self._read(entry, _bytes_of(out), 0)
        return out

    def close(self) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        finally:
            with deferred_interrupts():
                _close_all(self._direct_fds)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, entry: TensorEntry, out: np.ndarray, start: int) -> None:
        self.checkpoint.read(entry, out, start)
        self._count(out.nbytes, direct=False)

    def _count(self, nbytes: int, direct: bool, mapped: bool = False) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.direct_bytes += nbytes if direct else 0
            self.mapped_bytes += nbytes if mapped else 0
            if self.on_read is not None:
                self.on_read(nbytes)

    def _read_cast(self, entry: TensorEntry, out: torch.Tensor, first: int) -> None:
        # Elements [first, first + out.numel()) of `entry`, through a small temporary, cast into `out`.
        staged = torch.empty(out.numel(), dtype=entry.dtype)
        self._read(entry, _bytes_of(staged), first * entry.dtype.itemsize)
        out.copy_(staged.view(out.shape))

    def _host_jobs(self, entry: TensorEntry, out: torch.Tensor) -> list[Callable[[], Any]]:
        if not out.is_contiguous():
            return [lambda: out.copy_(self.read_tensor(entry))]
        if out.dtype == entry.dtype:
            raw = _bytes_of(out)
            return [functools.partial(self._read, entry, raw[a:b], a) for a, b in _spans(entry.nbytes, _CHUNK_BYTES)]
        flat, step = out.view(-1), max(1, _CHUNK_BYTES // entry.dtype.itemsize)
        return [functools.partial(self._read_cast, entry, flat[a:b], a) for a, b in _spans(flat.numel(), step)]

    def _through_windows(self, entry: TensorEntry, out: torch.Tensor) -> bool:
        # Windows carry every contiguous device destination, and the contiguous host destinations of files read
        # directly (a host destination of a cached file is read straight into place, with no bounce). A window copies
        # raw bytes, or casts whole elements: a cast needs the tensor's elements aligned in the file (window
        # boundaries are multiples of every element size) and is done for device destinations only (host casts go
        # through `_read_cast`).
        if not out.is_contiguous() or not entry.one_run:  # (a slice of rows is read by `Checkpoint.read`)
            return False
        if out.dtype != entry.dtype:
            return out.device.type != "cpu" and entry.offset % entry.dtype.itemsize == 0
        return out.device.type != "cpu" or self._direct_fd(entry.path) is not None

    def _through_mapping(self, entry: TensorEntry, out: torch.Tensor) -> bool:
        # Mapped reads copy raw bytes onto a CUDA device, from a file the page cache (nearly) holds whole: a mapped
        # page the cache lacks is read from the disk when it is page-locked, one fault at a time.
        if not self.mapped or out.device.type != "cuda" or not out.is_contiguous() or out.dtype != entry.dtype:
            return False
        if not entry.one_run:
            return False
        key = (out.device, entry.path)
        if key not in self._mapped_files:  # decided once per file and device, in the thread calling load
            fraction = self._cached(entry.path)
            self._mapped_files[key] = (
                self._direct_fd(entry.path) is None
                and fraction is not None
                and fraction >= MAPPED_FROM
                and driver_maps_files(self.checkpoint, out.device, entry.path)
            )
        return self._mapped_files[key]

    def _cached(self, path: Path) -> float | None:
        with self._lock:
            if path in self._fractions:
                return self._fractions[path]
        fraction = cached_fraction(path)
        with self._lock:
            return self._fractions.setdefault(path, fraction)

    def _direct_fd(self, path: Path) -> int | None:
        wanted = self.direct
        if wanted is None and path not in self._direct_fds:
            fraction = self._cached(path)
            wanted = fraction is not None and fraction < _DIRECT_BELOW
        with self._lock:  # one descriptor per file, whichever thread asks first
            if path not in self._direct_fds:
                with deferred_interrupts():  # opened and recorded with no Ctrl-C between: `close` finds it
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

    def jobs(self) -> list[Callable[[], Any]]:
        return [functools.partial(self._read_window, window) for window in self.windows]

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
            # A direct read refused: this window through the page cache.
            got, direct = pread_falling_back(
                self.fds[window.path],
                self.direct[window.path],
                buffer.numpy(),
                window.start,
                lambda: self.reader.checkpoint.fd(window.path),
            )
            if window.start + got < window.end:
                raise FileTruncated(window.path, window.start + got, window.end)
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
            self.reader._count(_piece_bytes(window), direct=direct)
        finally:
            self.free.put((index, pending))


class _Mapped:
    """One `load`'s mapped reads. [Note: mapped reads] The byte ranges of CUDA destinations of files the page cache
    holds are cut into aligned spans of at most `_SPAN_BYTES` (`diskio.plan_windows`). The files are mapped read-only
    a stretch of `_STRETCH_BYTES` at a time (`diskio.SharedMappings`: the page cache's own pages; a stretch is mapped
    for its first span and unmapped after its last), not once per span: a `mmap` or `munmap` waits for every
    page-locking in flight. A reader thread page-locks its span of the mapping for the copy engine
    (`arena.lock_read_only`), queues one asynchronous copy per piece on its device's copy stream, waits for the event
    behind them, and only then unlocks the span (no copy may read a page after it was unlocked) and drops its pages
    from the process's page tables (`FileMapping.forget`): at most one span per reader thread counts as resident
    memory at once. No CPU copies a byte, and no bounce buffer is needed. A span whose file cannot be mapped, or that
    the driver refuses to lock (possible for a single span of a device that passed `driver_maps_files`), is read with
    positional reads into pageable memory and copied from there, synchronously. Spans are whole pages of the
    process (at least `mmap.PAGESIZE`), so two spans never lock one page."""

    def __init__(self, reader: TensorReader, reads: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        self.reader = reader
        ranges = [(e.path, e.offset, e.nbytes, (e, out.reshape(-1))) for e, out in reads]
        span_bytes = -(-_SPAN_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
        self.spans = plan_windows(ranges, span_bytes)
        self.mappings = SharedMappings(
            self.spans, reader.checkpoint.fd, stretch_bytes=max(1, _STRETCH_BYTES // span_bytes) * span_bytes
        )
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        for device in dict.fromkeys(out.device for _, out in reads):  # destinations were allocated on the current
            self.streams[device] = torch.cuda.Stream(device)  # stream: the copies come after that
            self.streams[device].wait_stream(torch.cuda.current_stream(device))

    def jobs(self) -> list[Callable[[], Any]]:
        return [functools.partial(self._copy_span, span) for span in self.spans]

    def finish(self) -> None:
        """After every submitted span has ended: wait for the device copies, then unmap what is still mapped."""
        try:
            self._drain()
        finally:
            self.mappings.close()

    def _drain(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def _copy_span(self, span: Window) -> None:
        try:
            self._copy_mapped(span)
        finally:
            self.mappings.release(span)

    def _copy_mapped(self, span: Window) -> None:
        # The span's bytes up to its last piece's end (the file may end before the span's aligned end); a mapped page
        # past the file's end would fail the lock.
        fd, end = self.reader.checkpoint.fd(span.path), span.end
        size = os.fstat(fd).st_size
        if size < end:
            raise FileTruncated(span.path, size, end)
        # Locked and unlocked under a destination's device: a thread's current device is 0, where a call would
        # create a context of its own when the destinations are elsewhere.
        device = span.pieces[0][2][1].device
        mapping = self.mappings.acquire(span)
        address = mapping.address + span.start - mapping.start if mapping is not None else 0
        with torch.cuda.device(device):
            locked = mapping is not None and lock_read_only(address, end - span.start)
        if not locked:
            if mapping is not None:  # refused by the driver: later loads read this file system's files through windows
                mapping.forget(span.start, end)  # pages the refused lock brought in
                with _maps_files_lock:
                    _maps_files[_maps_key(device, fd)] = False
            buffer = torch.empty(end - span.start, dtype=torch.uint8)
            read_exactly(fd, buffer.numpy(), span.start, span.path, end)
            self._copy(span, buffer, non_blocking=False)
            self.reader._count(_piece_bytes(span), direct=False)
            return
        try:
            pages = (ctypes.c_uint8 * (end - span.start)).from_address(address)
            for event in self._copy(span, torch.from_numpy(np.ctypeslib.as_array(pages)), non_blocking=True):
                event.synchronize()
        except BaseException:
            self._drain()  # whatever this span queued has run before its pages are unlocked
            raise
        finally:
            with torch.cuda.device(device):
                unlock(address)
        mapping.forget(span.start, end)
        self.reader._count(_piece_bytes(span), direct=False, mapped=True)

    def _copy(self, span: Window, source: torch.Tensor, non_blocking: bool) -> list[torch.cuda.Event]:
        # Each piece of the span from `source` (the span's bytes) to its destination, on its device's copy stream;
        # returns the events recorded behind them.
        used: set[torch.device] = set()
        for offset, nbytes, (entry, flat) in span.pieces:
            target = flat.view(torch.uint8)[offset - entry.offset : offset - entry.offset + nbytes]
            with torch.cuda.stream(self.streams[target.device]):
                target.copy_(source[offset - span.start : offset - span.start + nbytes], non_blocking=non_blocking)
            used.add(target.device)
        events = []
        for device in used:
            event = torch.cuda.Event(blocking=True)  # waited for by a reader thread: sleeping, not spinning
            event.record(self.streams[device])
            events.append(event)
        return events


def driver_maps_files(checkpoint: Checkpoint, device: torch.device, path: Path) -> bool:
    """Whether the driver page-locks read-only mappings of `path`'s file system for the CUDA `device`. Asked once per
    device and file system: it page-locks the first bytes of a read-only mapping of the file."""
    fd = checkpoint.fd(path)
    key = _maps_key(device, fd)
    with _maps_files_lock:
        if key not in _maps_files:
            try:
                mapping = FileMapping(fd, 0, min(os.fstat(fd).st_size, 4096))
            except OSError:  # a file system that cannot map files: windows, and ask again next time
                return False
            try:
                with torch.cuda.device(key[0]):
                    locked = lock_read_only(mapping.address, mapping.nbytes)
                    if locked:
                        unlock(mapping.address)
                _maps_files[key] = locked
            finally:
                mapping.close()
        return _maps_files[key]


def _close_all(fds: dict[Path, int | None]) -> None:
    # Each descriptor leaves `fds` as it is closed, so that whatever an interrupt leaves there is still closed later.
    while fds:
        fd = fds.popitem()[1]
        if fd is not None:
            os.close(fd)


def _maps_key(device: torch.device, fd: int) -> tuple[int, int]:
    return (device.index if device.index is not None else torch.cuda.current_device(), os.fstat(fd).st_dev)


def _interleave(lists: Sequence[list]) -> list:
    # One item of each list in turn, while any has items left.
    return [item for row in itertools.zip_longest(*lists) for item in row if item is not None]


def _piece_bytes(window: Window) -> int:
    return sum(nbytes for _, nbytes, _ in window.pieces)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    # The raw bytes of a contiguous host tensor, as a writable uint8 numpy array sharing its memory.
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, total)) for a in range(0, total, step)]
