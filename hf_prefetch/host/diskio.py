"""Reading checkpoint files from the disk: how much of a file the page cache holds, and direct I/O around it.

A checkpoint read right after its download comes from the disk, not from the page cache. Read through the cache,
every byte then lives twice (in the cache and where the loader put it) until the kernel reclaims the cache, and the
kernel's readahead decides the request sizes. Direct I/O (`O_DIRECT`) reads from the disk into aligned buffers:
large requests, several in flight, and no second copy. Bytes the cache already holds are faster read through it, so
`cached_fraction` asks the kernel (`mincore`) and the reader reads a file directly only when most of it is not
cached. `plan_windows` cuts the byte ranges a load needs into aligned windows, one direct read each. Bytes the cache
holds can also be mapped (`FileMapping`), so that the GPU's copy engine reads them from the cache's own pages. This
module knows files and byte ranges; which tensor goes where is the reader's job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..alignment import DIRECT_IO_ALIGN_BYTES, round_up

__all__ = [
    "FileMapping",
    "FileTruncated",
    "SharedMappings",
    "Window",
    "aligned_buffer",
    "cached_fraction",
    "open_direct",
    "open_for_reads",
    "plan_windows",
    "pread",
    "pread_falling_back",
    "read_exactly",
]


@dataclass(frozen=True)
class Window:
    """One direct read: bytes [start, stop) of `path` (aligned), and the `(file_offset, nbytes, key)` pieces of the
    load that lie in it (each piece is a part of one destination; `key` says which, for the caller)."""

    path: Path
    start: int
    stop: int
    pieces: tuple[tuple[int, int, object], ...]

    @property
    def end(self) -> int:
        """Where the last piece ends in the file (`stop` is rounded up to the alignment, possibly past the file)."""
        return max(offset + nbytes for offset, nbytes, _ in self.pieces)


def plan_windows(ranges: Sequence[tuple[Path, int, int, object]], window_bytes: int) -> list[Window]:
    """Cut `(path, file_offset, nbytes, key)` ranges into aligned windows of at most `window_bytes`, in file order.

    A window spans one aligned stretch of one file and reads only from its first needed byte to its last (rounded
    out to the alignment). Ranges share a window only where their aligned blocks touch, so no block that no range
    needs is read: a range costs at most one aligned block before and one after its bytes.

    Example:

    ```python
    >>> from pathlib import Path
    >>> from hf_prefetch.host.diskio import plan_windows
    >>> windows = plan_windows([(Path("a"), 100, 10_000, "w"), (Path("a"), 20_000, 50, "b")], window_bytes=8192)
    >>> [(w.start, w.stop, [(o, n) for o, n, _ in w.pieces]) for w in windows]
    [(0, 8192, [(100, 8092)]), (8192, 12288, [(8192, 1908)]), (16384, 20480, [(20000, 50)])]

    ```
    """
    if window_bytes <= 0 or window_bytes % DIRECT_IO_ALIGN_BYTES:
        raise ValueError(f"window_bytes={window_bytes} must be a positive multiple of {DIRECT_IO_ALIGN_BYTES}.")
    by_window: dict[tuple[Path, int], list[tuple[int, int, object]]] = {}
    for path, offset, nbytes, key in ranges:
        end = offset + nbytes
        while offset < end:
            index = offset // window_bytes
            cut = min(end, (index + 1) * window_bytes)
            by_window.setdefault((path, index), []).append((offset, cut - offset, key))
            offset = cut
    windows = []
    for (path, _), pieces in sorted(by_window.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        group: list[tuple[int, int, object]] = []
        stop = 0
        for piece in sorted(pieces, key=lambda piece: piece[0]):
            offset, nbytes, _ = piece
            if group and offset - offset % DIRECT_IO_ALIGN_BYTES > stop:  # a block between them that none needs
                windows.append(_window(path, group))
                group = []
            group.append(piece)
            stop = max(stop if len(group) > 1 else 0, round_up(offset + nbytes, DIRECT_IO_ALIGN_BYTES))
        windows.append(_window(path, group))
    return windows


def _window(path: Path, pieces: list[tuple[int, int, object]]) -> Window:
    first = pieces[0][0]
    last = max(offset + nbytes for offset, nbytes, _ in pieces)
    return Window(path, first - first % DIRECT_IO_ALIGN_BYTES, round_up(last, DIRECT_IO_ALIGN_BYTES), tuple(pieces))


def open_direct(path: Path) -> int | None:
    """A descriptor of `path` opened for direct I/O, or None where the platform or file system refuses it (tmpfs,
    some overlay and network file systems, macOS)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def open_for_reads(path: Path) -> tuple[int, bool]:
    """A descriptor of `path` for direct I/O where its file system allows it, else a plain one; and which it is."""
    fd = open_direct(path)
    return (fd, True) if fd is not None else (os.open(path, os.O_RDONLY), False)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of page-aligned anonymous memory (uint8), usable as a direct-I/O destination."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def pread(fd: int, out: np.ndarray, position: int) -> int:
    """Fill `out` from byte `position` of the file; stops early only at the end of the file. Returns bytes read."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got == 0:
            break
        done += got
    return done


class FileTruncated(OSError, ValueError):
    """A file that ends before the bytes a read needs: it was truncated after it was opened (an `OSError` with errno
    EIO, and a `ValueError`: its size no longer matches the header it was planned from)."""

    def __init__(self, path: Path | str, end: int, needed: int) -> None:
        super().__init__(
            errno.EIO,
            f"{path}: the file ended at byte {end} while reading up to byte {needed}; it was truncated after it was "
            "opened. Re-download or re-save the checkpoint, and load the model from it again.",
        )


def read_exactly(fd: int, out: np.ndarray, position: int, path: Path | str, needed: int | None = None) -> None:
    """Fill `out` from byte `position` of `path` (open as `fd`); `FileTruncated` where the file ends before byte
    `needed` (default: the end of `out`; a direct read's aligned window may reach past the file's end)."""
    got = pread(fd, out, position)
    needed = position + out.nbytes if needed is None else needed
    if position + got < needed:
        raise FileTruncated(path, position + got, needed)


def pread_falling_back(
    fd: int, direct: bool, out: np.ndarray, position: int, buffered: Callable[[], int]
) -> tuple[int, bool]:
    """`pread`, and where a descriptor opened for direct I/O has a read refused (EINVAL: a file system whose block
    size is above 4096, some FUSE mounts) the same read through the page cache, on the descriptor `buffered()` gives.
    Returns (bytes read, whether that read was direct)."""
    try:
        return pread(fd, out, position), direct
    except OSError as err:
        if not direct or err.errno != errno.EINVAL:
            raise
    return pread(buffered(), out, position), False


_libc: ctypes.CDLL | None = None


def c_library() -> ctypes.CDLL | None:
    # The C library, with mmap, munmap, mremap and mincore typed; None where there is none to load.
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        size_t, c_int = ctypes.c_size_t, ctypes.c_int
        libc.mmap.argtypes = [ctypes.c_void_p, size_t, c_int, c_int, c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if hasattr(libc, "mremap"):  # Linux
            libc.mremap.restype = ctypes.c_void_p
            libc.mremap.argtypes = [ctypes.c_void_p, size_t, size_t, c_int, ctypes.c_void_p]
        if hasattr(libc, "mincore"):
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if hasattr(libc, "madvise"):
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


def cached_fraction(path: Path) -> float | None:
    """The share of `path`'s pages the page cache holds now (0.0 to 1.0), or None where the kernel cannot say.

    Asks `mincore` about a read-only mapping of the file; nothing is read and no page is brought in.
    """
    size = os.stat(path).st_size
    if size == 0:
        return 1.0
    libc = c_library()
    if libc is None or not hasattr(libc, "mincore"):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
            if libc.mincore(address, size, pages.ctypes.data) != 0:
                return None
            return float(np.count_nonzero(pages & 1)) / len(pages)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


class FileMapping:
    """Bytes [start, stop) of an open file mapped read-only and shared: the page cache's own pages, no copy.

    `address` is where file byte `start` is; `close()` unmaps (idempotent; so does the object's end, should a caller
    lose it first). Touching a mapped byte past the file's end raises SIGBUS, so a caller reads it only through
    something that checks (the CUDA driver's registration, which fails instead). Raises OSError where the platform
    cannot map the file. `forget(start, stop)` drops the pages of a stretch that is no longer needed from the
    process's page tables (its resident memory) and keeps the mapping.
    """

    def __init__(self, fd: int, start: int, stop: int) -> None:
        libc = c_library()
        if libc is None:
            raise OSError(errno.ENOSYS, "no C library to map files with")
        base = start - start % mmap.ALLOCATIONGRANULARITY  # mmap's offset must be a multiple of it
        length = stop - base
        mapped = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)
        if mapped in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of bytes {base}-{stop} failed: {os.strerror(err)}")
        self.start = start
        self.address = mapped + start - base
        self.nbytes = stop - start
        self._unmap = weakref.finalize(self, libc.munmap, mapped, length)

    def forget(self, start: int, stop: int) -> None:
        """Drop the whole pages inside file bytes [start, stop) (and inside the mapping) from this process's page
        tables (`MADV_DONTNEED`): they stop counting as the process's resident memory, stay in the page cache, and
        are mapped again if touched. Unlike unmapping, it leaves the mappings as they are, so it does not wait for
        the page-locking of other threads. Only memory accounting depends on it: a refusal is ignored (the pages
        then go with `close()`)."""
        libc = c_library()
        if not self._unmap.alive or not hasattr(libc, "madvise"):
            return
        page = mmap.PAGESIZE
        first = -(-(self.address + max(start, self.start) - self.start) // page) * page
        last = (self.address + min(stop, self.start + self.nbytes) - self.start) // page * page
        if last > first:
            libc.madvise(first, last - first, mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._unmap()


class SharedMappings:
    """Read-only mappings of the files that `windows` (from `plan_windows`) lie in, shared by the threads that read
    the windows: one `FileMapping` per stretch of `stretch_bytes` of a file (a multiple of the windows' size, so that
    no window straddles two), made when a window of the stretch first asks for it and unmapped once every window of
    the stretch was released. A load so maps a file a few stretches at a time instead of once per window (a `mmap` or
    `munmap` waits for every page-locking in flight in the process), and never a whole checkpoint's address space at
    once. `fd(path)` opens the files. `close()` unmaps what is left, once no thread reads any more.

    Example:

    ```python
    >>> import ctypes, tempfile, os
    >>> from pathlib import Path
    >>> from hf_prefetch.host.diskio import SharedMappings, plan_windows
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "f"
    ...     _ = path.write_bytes(bytes(range(256)) * 64)
    ...     fd = os.open(path, os.O_RDONLY)
    ...     windows = plan_windows([(path, 100, 10_000, "t")], window_bytes=4096)
    ...     mappings = SharedMappings(windows, lambda _: fd, stretch_bytes=8192)
    ...     first = mappings.acquire(windows[0])
    ...     head = ctypes.string_at(first.address + 100 - first.start, 3)
    ...     for window in windows:
    ...         _ = mappings.acquire(window)
    ...         mappings.release(window)
    ...     mappings.close()
    ...     os.close(fd)
    >>> len(windows), head
    (3, b'def')

    ```
    """

    def __init__(self, windows: Sequence[Window], fd: Callable[[Path], int], stretch_bytes: int) -> None:
        self._fd = fd
        self._stretch = stretch_bytes
        self._lock = threading.Lock()
        self._left: dict[tuple[Path, int], int] = {}  # windows of a stretch not released yet
        self._bounds: dict[tuple[Path, int], tuple[int, int]] = {}  # the file bytes a stretch's mapping covers
        self._mappings: dict[tuple[Path, int], FileMapping | None] = {}  # None: the file system refused the mapping
        for window in windows:
            key, end = self._key(window), window.end
            if (end - 1) // stretch_bytes != key[1]:
                raise ValueError(
                    f"stretch_bytes={stretch_bytes} must be a multiple of the windows' size: bytes "
                    f"{window.start}-{end} of {window.path} straddle two stretches."
                )
            self._left[key] = self._left.get(key, 0) + 1
            low, high = self._bounds.get(key, (window.start, end))
            self._bounds[key] = (min(low, window.start), max(high, end))

    def acquire(self, window: Window) -> FileMapping | None:
        """The mapping that holds `window`'s bytes (None where the file system refused to map its stretch), made by
        the first window of the stretch that asks. Each window that asks must be `release`d once."""
        key = self._key(window)
        with self._lock:
            if key not in self._mappings:
                fd = self._fd(window.path)  # outside the refusal below: a descriptor that fails is no refusal
                try:
                    self._mappings[key] = FileMapping(fd, *self._bounds[key])
                except OSError:
                    self._mappings[key] = None
            return self._mappings[key]

    def release(self, window: Window) -> None:
        """`window` no longer reads its mapping: its stretch is unmapped after the last of its windows."""
        key = self._key(window)
        with self._lock:
            self._left[key] -= 1
            mapping = self._mappings.pop(key, None) if self._left[key] == 0 else None
        if mapping is not None:
            mapping.close()

    def close(self) -> None:
        """Unmap every stretch still mapped (windows that never ran, or failed before their release)."""
        with self._lock:
            mappings, self._mappings = list(self._mappings.values()), {}
        for mapping in mappings:
            if mapping is not None:
                mapping.close()

    def _key(self, window: Window) -> tuple[Path, int]:
        return (window.path, window.start // self._stretch)
