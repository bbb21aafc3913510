"""Weights read from their checkpoint files before each use, into a few page-locked staging buffers.

Weights that do not fit in host memory stay in the checkpoint's safetensors files. `StagedReads` plans each layer's
aligned direct-I/O windows (`diskio.plan_windows`) and where each byte range lands in a staging buffer; `start` queues
a layer's windows into a buffer on a thread pool, `views` waits for them and hands out each range's bytes, `release`
gives the buffer back. The reader knows files and byte ranges: which tensor a range holds, which layer runs next and
which copy last read a buffer are the caller's.

[Note: staged reads]
- A buffer is free, or holds one layer's read from `start` to `release`: FILLING while its windows are queued or
  read, READY once `views` waited for them. `start` takes a free buffer only.
- A layer's windows lie one after another in the (page-aligned) buffer in `plan_windows`' order (by file, then
  offset), each at a multiple of `DIRECT_IO_ALIGN_BYTES`. A range cut across windows lies in windows that are
  neighbours in the file (one ends, aligned, where the next begins), so its bytes are contiguous in the buffer too.
- `before` runs once per `start`, on the thread of the first window to begin, before any byte is written; the other
  windows wait for it. The layer's files' sizes and modification times are then checked against those recorded at
  opening, and again once the windows were read: bytes of a file changed under the reader are never handed out.
- No thread writes into a free buffer. A read that failed, that a Ctrl-C interrupted in `views`, or that was released
  unread is ended: its queued windows are cancelled and those being read waited for (with Ctrl-C held back) before
  its buffer is free. `close` waits for every window before it drops the buffers.
- `retarget` opens and checks another set of files (a new checkpoint's) beside the current ones, changing nothing;
  `switch` ends every read, then reads those from then on (the buffers kept where each new layer fits them).
"""

from __future__ import annotations

import enum
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..interrupts import deferred_interrupts
from .arena import HostArena
from .diskio import FileTruncated, Window, open_for_reads, plan_windows, pread_falling_back

__all__ = ["FileExtent", "StagedReads", "Retarget"]

_WINDOW_BYTES = 8 * 2**20  # one direct read (a multiple of DIRECT_IO_ALIGN_BYTES)


@dataclass(frozen=True)
class FileExtent:
    """One tensor's bytes as stored in a file: `nbytes` bytes from byte `offset` of `path`."""

    path: Path
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FileExtent of {self.path}: {name}={value!r} must be a non-negative int.")


class Retarget:
    """Files opened and checked for a `StagedReads` (`retarget`), their layers' windows and new buffers where the
    reader's are too small: `StagedReads.switch` takes them, `discard` (or the collector) closes what was not."""

    def __init__(self) -> None:
        self.files: dict[Path, _OpenFile] = {}
        self.fds, self.layouts = [], []  # descriptors (closed with it unless taken), each layer's `_Layout`
        self.buffer_bytes, self.capacity, self.arena = 0, 0, None  # largest layer, new buffer (bytes), new buffers
        weakref.finalize(self, _close_all, self.fds)

    def discard(self) -> None:
        with deferred_interrupts():
            _close_all(self.fds)
            if self.arena is not None:
                self.arena.release()
                self.arena = None


class _State(enum.Enum):
    FILLING = "filling"  # windows queued or being read
    READY = "ready"  # read; its views handed out


@dataclass(frozen=True)
class _Layout:
    """One layer's windows with where each starts in a buffer, each extent's (start, nbytes) there, its files and
    the buffer bytes it needs."""

    windows: tuple[tuple[Window, int], ...]
    extents: tuple[tuple[int, int], ...]
    paths: tuple[Path, ...]
    nbytes: int


class _OpenFile:
    """A file as the reader opened it: the descriptor reads use, whether it reads with direct I/O, and the file's
    (size, modification time) then."""

    def __init__(self, path: Path, fd: int, direct: bool) -> None:
        self.path, self.fd, self.direct = path, fd, direct
        status = os.fstat(fd)
        self.stamp = (status.st_size, status.st_mtime_ns)

    def check_holds(self, extent: FileExtent) -> None:
        if extent.offset + extent.nbytes > self.stamp[0]:
            raise ValueError(
                f"{self.path}: an extent of {extent.nbytes} bytes at offset {extent.offset} ends past the file's end "
                f"(its size is {self.stamp[0]} bytes): the extents do not describe this file. Compute them from the "
                "header of the file being read."
            )

    def check_unchanged(self) -> None:
        status = os.fstat(self.fd)
        if (status.st_size, status.st_mtime_ns) != self.stamp:
            raise RuntimeError(
                f"{self.path} changed on disk since it was opened for reading (size {self.stamp[0]} -> "
                f"{status.st_size} bytes, modification time {self.stamp[1]} -> {status.st_mtime_ns} ns): its bytes "
                "may no longer be the weights that were planned. Put the file back, or read the changed checkpoint "
                "with hf_prefetch.reload_weights(model, folder)."
            )


class _Fill:
    """One `start`: the windows of `layer` read into staging buffer `buffer`, `before` run once ahead of them."""

    def __init__(self, layer: int, buffer: int, before: Callable[[], None] | None) -> None:
        self.layer, self.buffer = layer, buffer
        self.state = _State.FILLING
        self.futures: list[Future] = []
        self.failed = False  # a window failed, or the read was ended unread: windows not begun yet skip
        self._before = before
        self._prepared = False
        self._lock = threading.Lock()

    def prepare(self, check: Callable[[], None]) -> bool:
        # `before`, then `check`, run once for the read by the first window to begin; False: write nothing.
        with self._lock:
            if not self._prepared and not self.failed:
                try:
                    if self._before is not None:
                        self._before()
                    check()
                except BaseException:
                    self.failed = True
                    raise
                self._prepared = True
            return self._prepared and not self.failed


class StagedReads:
    """Reads layers' byte ranges from their files into `num_buffers` page-locked staging buffers, ahead of use.

    `views(i)` hands out `layers[i]`'s extents in their order ([Note: staged reads]). Each file is opened once, for
    direct I/O where its file system allows (`buffered_files` are those read through the page cache), and its size
    and modification time recorded; an extent past a file's end is a ValueError. The buffers, each as large as
    the largest layer (`buffer_bytes`) or `min_buffer_bytes` where more (room for other files: `retarget`), are one
    `HostArena`, page-locked with `pin` (None: where CUDA is available); `threads` read windows of at most
    `window_bytes`. Counters: `bytes_read` (the extents' bytes), `reads` (windows),
    `read_seconds` (the reads' wall times, summed over threads).

    Example:

    ```python
    >>> import tempfile
    >>> from pathlib import Path
    >>> from hf_prefetch.host.file_reads import FileExtent, StagedReads
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "weights.bin"
    ...     _ = path.write_bytes(bytes(range(200)))
    ...     layers = [[FileExtent(path, 0, 4), FileExtent(path, 100, 2)], [FileExtent(path, 196, 4)]]
    ...     with StagedReads(layers, num_buffers=1) as reads:
    ...         reads.start(0, buffer=0)
    ...         first = [view.tolist() for view in reads.views(0)]
    ...         reads.release(0)  # once the copy out of buffer 0 is issued
    ...         reads.start(1, buffer=0)
    ...         second = reads.views(1)[0].tolist()
    >>> first, second, reads.bytes_read
    ([[0, 1, 2, 3], [100, 101]], [196, 197, 198, 199], 10)

    ```
    """

    def __init__(
        self,
        layers: Sequence[Sequence[FileExtent]],
        num_buffers: int,
        *,
        threads: int = 4,
        window_bytes: int = _WINDOW_BYTES,
        pin: bool | None = None,
        min_buffer_bytes: int = 0,
    ) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers}: a staged read needs at least one staging buffer.")
        if threads < 1:
            raise ValueError(f"threads={threads}: reads need at least one thread.")
        self.num_buffers = num_buffers
        self.bytes_read, self.reads, self.read_seconds = 0, 0, 0.0
        self._lock = threading.Lock()  # the counters, and a file's switch to the page cache
        self._closed, self._window_bytes, self._min_buffer_bytes = False, window_bytes, min_buffer_bytes
        self._pin = torch.cuda.is_available() if pin is None else pin  # page-locked for copies to a CUDA device
        self._fds: list[int] = []  # every descriptor opened, closed by `close` (or when the reader goes)
        weakref.finalize(self, _close_all, self._fds)
        files = self._prepare(layers, capacity=None)
        with deferred_interrupts():  # the reader's now (the list the Retarget's finalizer closes is left empty)
            self._fds[:], self._files, self._layouts = files.fds, files.files, files.layouts
            self.buffer_bytes, self._arena, self._capacity = files.buffer_bytes, files.arena, files.capacity
            files.fds.clear()
            files.arena = None
        self._fills: list[_Fill | None] = [None] * num_buffers  # each buffer's read, from `start` to `release`
        self._fill_by_layer: dict[int, _Fill] = {}  # the same, by layer
        self._threads: set[threading.Thread] = set()  # the pool's, as each starts (held apart from `self`)
        started = functools.partial(lambda into: into.add(threading.current_thread()), self._threads)
        self._pool = ThreadPoolExecutor(threads, "hf_prefetch-stage", started)

    @property
    def num_layers(self) -> int:
        return len(self._layouts)

    def started(self, layer: int) -> bool:
        """Whether `layer`'s read was started and its buffer not given back (nor ended by an error)."""
        return self._fill_by_layer.get(layer) is not None

    @property
    def buffered_files(self) -> list[Path]:
        """The files read through the page cache: their file system refused direct I/O."""
        return [path for path, file in self._files.items() if not file.direct]

    @property
    def opened_files(self) -> list[Path]:
        """The files the reader opened."""
        return list(self._files)

    def reopen(self, path: Path) -> int:
        """A new descriptor, through the page cache, of the file the reader opened at `path` (the same file where the
        path was replaced or deleted since), checked unchanged (`check_unchanged`); the caller closes it."""
        self.check_unchanged([path])
        file = self._files[path]
        try:
            return os.open(f"/proc/self/fd/{file.fd}", os.O_RDONLY)
        except OSError:  # no /proc: the path, where it still names that file
            pass
        fd = os.open(path, os.O_RDONLY)
        opened, status = os.fstat(file.fd), os.fstat(fd)
        if (status.st_dev, status.st_ino) != (opened.st_dev, opened.st_ino):
            os.close(fd)
            raise RuntimeError(
                f"{path} is no longer the file that was opened for reading (it was replaced or deleted on disk since):"
                " its bytes may not be the weights that were planned. Put the file back, or read the changed "
                "checkpoint with hf_prefetch.reload_weights(model, folder)."
            )
        return fd

    def retarget(self, layers: Sequence[Sequence[FileExtent]]) -> Retarget:
        """The files of `layers` (as many as now: a new checkpoint's) opened and checked as the constructor does, for
        `switch`; new buffers only where a layer outgrows the current ones. The reader is unchanged; raises as it."""
        if len(layers) != self.num_layers:
            raise ValueError(f"retarget: {len(layers)} layers for a reader of {self.num_layers}.")
        self._check_open()
        return self._prepare(layers, capacity=self._capacity)

    def switch(self, files: Retarget) -> None:
        """Read `files` (from `retarget`) from now on: every read ended first (as `release` ends one), the old files
        closed, the old buffers dropped where `files` brought new ones. The counters go on."""
        with deferred_interrupts():
            for fill in list(self._fills):
                if fill is not None:
                    self._end(fill)
            old = list(self._fds)
            self._fds[:] = files.fds  # the finalizer's list: closed with the reader from now on
            self._files, self._layouts, self.buffer_bytes = files.files, files.layouts, files.buffer_bytes
            if files.arena is not None:
                self._arena.release()
                self._arena, self._capacity = files.arena, files.capacity
            files.fds.clear()  # taken: the Retarget's finalizer closes nothing
            files.arena = None
            _close_all(old)

    def start(self, layer: int, buffer: int, before: Callable[[], None] | None = None) -> None:
        """Queue the reads of `layer` into staging buffer `buffer`. `before` runs first, on a reader thread (e.g. the
        wait for the copy that last read the buffer). Raises RuntimeError for a buffer not released yet, or a layer
        already being read into another buffer; where a window cannot be queued (a thread that cannot start), its
        error, with nothing started."""
        layout = self._layout(layer)
        self._check_buffer(buffer)
        held = self._fills[buffer]
        if held is not None:
            raise RuntimeError(
                f"Staging buffer {buffer} still holds layer {held.layer} ({held.state.value}): call "
                f"release({buffer}) once its copy is issued, then start another read into it."
            )
        other = self._fill_by_layer.get(layer)
        if other is not None:
            raise RuntimeError(
                f"Layer {layer} is already being read into staging buffer {other.buffer}: use its views, or "
                f"release({other.buffer}) before starting it again."
            )
        fill = _Fill(layer, buffer, before)
        staging = self._buffer(buffer)
        jobs = [
            functools.partial(self._read_window, fill, layout, window, staging[at : at + window.stop - window.start])
            for window, at in layout.windows
        ] or [functools.partial(fill.prepare, functools.partial(self.check_unchanged, layout.paths))]
        with deferred_interrupts():  # recorded with every window submitted: none is left unwaited for
            self._fills[buffer] = fill
            self._fill_by_layer[layer] = fill
            try:
                for job in jobs:
                    fill.futures.append(self._pool.submit(job))
            except BaseException:  # a thread that could not start: the read is ended, the buffer free again
                self._end(fill)
                raise

    def views(self, layer: int) -> list[torch.Tensor]:
        """Wait for the read of `layer` and return, per extent in the order given, a uint8 view of its bytes in the
        staging buffer (valid until the buffer is released). Raises the read's error (OSError naming the file and
        byte offset, RuntimeError for a file changed on disk), after which the buffer is free; RuntimeError for a
        layer not started."""
        layout = self._layout(layer)
        fill = self._fill_by_layer.get(layer)
        if fill is None:
            raise RuntimeError(
                f"views({layer}): layer {layer} was not started. Call start({layer}, buffer) first, early enough "
                "that its read overlaps other work."
            )
        if fill.state is _State.FILLING:
            try:
                errors = [future.exception() for future in fill.futures]  # waits; a Ctrl-C lands here
                error = next((err for err in errors if err is not None), None)
                if error is None:
                    self.check_unchanged(layout.paths)  # no file changed while it was read
            except BaseException:
                self._end(fill)
                raise
            if error is not None:
                self._end(fill)
                raise error
            fill.state = _State.READY
        staging = self._buffer(fill.buffer)
        return [staging[at : at + nbytes] for at, nbytes in layout.extents]

    def release(self, buffer: int) -> None:
        """The caller is done with staging buffer `buffer` (its copy was issued): it may be started again. A read
        not waited for is ended first (queued windows cancelled, those being read waited for). Releasing a free
        buffer does nothing."""
        self._check_buffer(buffer)
        fill = self._fills[buffer]
        if fill is not None:
            self._end(fill)

    def close(self) -> None:
        """Wait for the reads in flight (queued ones are cancelled), shut the threads down, close the files and
        drop the buffers; only once no copy out of a buffer is in flight. Idempotent. Called on one of the reader's
        own threads (the collector ran the owner's finalizer there, inside a read), a thread of its own does that
        once the read ends."""
        if self._closed:
            return
        with deferred_interrupts():
            self._closed = True
            self._fills = [None] * len(self._fills)
            self._fill_by_layer = {}
            if threading.current_thread() in self._threads:
                self._pool.shutdown(wait=False, cancel_futures=True)
                threading.Thread(target=self._drop, name="hf_prefetch-stage-close").start()
            else:
                self._drop()

    def _drop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        _close_all(self._fds)
        self._arena.release()

    def __enter__(self) -> StagedReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, layers: Sequence[Sequence[FileExtent]], capacity: int | None) -> Retarget:
        # Every file of `layers` opened (for direct I/O where its file system allows) and its extents checked, their
        # windows planned, and staging buffers allocated (page-locked with `_pin`) unless each layer fits `capacity`.
        files = Retarget()
        try:
            for path in dict.fromkeys(extent.path for layer in layers for extent in layer):
                with deferred_interrupts():  # opened and recorded with no Ctrl-C between: `discard` closes it
                    fd, direct = open_for_reads(path)
                    files.fds.append(fd)
                files.files[path] = _OpenFile(path, fd, direct)
            for extent in (extent for layer in layers for extent in layer):
                files.files[extent.path].check_holds(extent)
            files.layouts = [_plan(layer, self._window_bytes) for layer in layers]
            files.buffer_bytes = max((layout.nbytes for layout in files.layouts), default=0)
            if capacity is None or files.buffer_bytes > capacity:
                files.capacity = max(files.buffer_bytes, self._min_buffer_bytes)
                files.arena = HostArena([files.capacity] * self.num_buffers)
                if self._pin:
                    files.arena.bytes_view(0, files.arena.nbytes).zero_()  # touched pages page-lock ~10x faster
                    files.arena.pin()
        except BaseException:
            files.discard()
            raise
        return files

    def _layout(self, layer: int) -> _Layout:
        self._check_open()
        if not 0 <= layer < len(self._layouts):
            raise ValueError(f"layer={layer}: the reads were planned for layers 0 to {len(self._layouts) - 1}.")
        return self._layouts[layer]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("The staged reads were closed; create another StagedReads to read again.")

    def _check_buffer(self, buffer: int) -> None:
        if not 0 <= buffer < len(self._fills):
            raise ValueError(f"buffer={buffer}: the staging buffers are 0 to {len(self._fills) - 1}.")

    def _buffer(self, buffer: int) -> torch.Tensor:
        return self._arena.bytes_view(buffer, self.buffer_bytes)

    def check_unchanged(self, paths: Sequence[Path] | None = None) -> None:
        """RuntimeError naming a file of `paths` (None: every file) changed on disk since the reader opened it."""
        for path in self._files if paths is None else paths:
            self._files[path].check_unchanged()

    def _end(self, fill: _Fill) -> None:
        # The buffer is free once nothing can write into it any more.
        with deferred_interrupts():
            fill.failed = True
            for future in fill.futures:
                future.cancel()
            for future in fill.futures:
                if not future.cancelled():
                    future.exception()  # wait
            if self._fills[fill.buffer] is fill:
                self._fills[fill.buffer] = None
            if self._fill_by_layer.get(fill.layer) is fill:
                del self._fill_by_layer[fill.layer]

    def _read_window(self, fill: _Fill, layout: _Layout, window: Window, out: torch.Tensor) -> None:
        if not fill.prepare(functools.partial(self.check_unchanged, layout.paths)):
            return
        try:
            began = time.perf_counter()
            got = self._pread(self._files[window.path], out.numpy(), window.start)
            seconds = time.perf_counter() - began
            if window.start + got < window.end:
                raise FileTruncated(window.path, window.start + got, window.end)
        except BaseException:
            fill.failed = True
            raise
        with self._lock:
            self.bytes_read += sum(nbytes for _, nbytes, _ in window.pieces)
            self.reads += 1
            self.read_seconds += seconds

    def _pread(self, file: _OpenFile, out: np.ndarray, position: int) -> int:
        try:  # a direct read refused: this file through the page cache from now on
            return pread_falling_back(file.fd, file.direct, out, position, lambda: self._buffered(file))[0]
        except OSError as err:
            raise OSError(
                err.errno,
                f"Reading {out.nbytes} bytes of {file.path} at byte offset {position} failed: "
                f"{err.strerror or err}. Check the disk and the file; the layer can be started again once it reads.",
            ) from err

    def _buffered(self, file: _OpenFile) -> int:
        # `file`'s descriptor through the page cache, opened by the first thread that asks; the direct one stays open
        # (another thread may be reading with it) until `close`.
        with self._lock:
            if file.direct:
                fd = os.open(file.path, os.O_RDONLY)
                self._fds.append(fd)
                file.fd, file.direct = fd, False
            return file.fd


def _plan(layer: Sequence[FileExtent], window_bytes: int) -> _Layout:
    # The layer's windows, one after another in a staging buffer ([Note: staged reads]); an extent starts where its
    # first piece lands, its other pieces follow it there.
    ranges = [(extent.path, extent.offset, extent.nbytes, index) for index, extent in enumerate(layer)]
    windows, starts, at = [], {}, 0
    for window in plan_windows(ranges, window_bytes):
        windows.append((window, at))
        for offset, _, index in window.pieces:
            starts.setdefault(index, at + offset - window.start)
        at += window.stop - window.start
    extents = tuple((starts.get(index, 0), extent.nbytes) for index, extent in enumerate(layer))
    paths = tuple(dict.fromkeys(window.path for window, _ in windows))
    return _Layout(tuple(windows), extents, paths, at)


def _close_all(fds: list[int]) -> None:
    # Each descriptor leaves `fds` as it is closed, so that whatever an interrupt leaves there is still closed later.
    while fds:
        os.close(fds.pop())
