"""Checkpoint files' own pages as part of a host arena: mapped, checked, made private, let go.

`HostArena(files=...)` reserves its range and hands the file-backed parts to `MappedFiles`, which maps each part's
pages read-only over it, checks that the files stay as they were mapped, turns the parts into private memory at the
same addresses (`make_private`) and maps what is left copy-on-write when the arena is released. The rules they keep
are [Note: mapped host storage] in arena.py; page-locking stays the arena's.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .diskio import c_library, pread

__all__ = ["FilePiece", "MappedFiles"]

logger = logging.getLogger(__name__)

# mmap and mremap flags Python's mmap module does not name (Linux values).
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2


@dataclass(frozen=True)
class FilePiece:
    """Where an arena entry's bytes already are: `offset` in the file `path`, open read-only as `fd` (a checkpoint
    shard). The arena keeps a duplicate of `fd` for as long as it maps the file."""

    path: str
    fd: int
    offset: int


class _File:
    """A mapped file: the arena's own descriptor of it, and what `fstat` said when it was mapped."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = os.dup(fd)
        status = os.fstat(self.fd)
        self.stamp = (status.st_size, status.st_mtime_ns)

    def check_unchanged(self) -> None:
        status = os.fstat(self.fd)
        if (status.st_size, status.st_mtime_ns) != self.stamp:
            raise RuntimeError(
                f"{self.path} changed on disk since it was loaded (size {self.stamp[0]} -> {status.st_size} bytes, "
                "or its modification time): the streamed weights are that file's own pages, so the loaded values "
                "are gone. Load the model again (write a changed checkpoint to a new folder, not over the one a model "
                "was loaded from; or load with map_files=False)."
            )

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Region(NamedTuple):
    start: int  # in the arena, page-aligned
    length: int  # whole pages
    file: _File
    offset: int  # in the file, page-aligned


class MappedFiles:
    """The parts of the arena range at `base` that are files' pages: `regions` of (start, length, piece), each start
    and length page-aligned and `piece.offset` within the region's first page where the entry starts. Maps them
    read-only over the range (raises OSError where one cannot be mapped; the caller then unmaps the range).
    `nbytes` is what is still mapped from files (read by every forward's gate)."""

    def __init__(self, base: int = 0, regions: Sequence[tuple[int, int, FilePiece]] = ()) -> None:
        self.base = base
        self._regions: list[_Region] = []
        self.nbytes = 0
        self._opened: dict[int, _File] = {}  # each mapped file, once, by the caller's descriptor
        self._close = weakref.finalize(self, _close_all, self._opened)  # with the arena, if nothing closed them
        self._close.atexit = False
        if not regions:
            return
        libc = _libc()
        try:
            for start, length, piece in regions:
                if piece.fd not in self._opened:
                    self._opened[piece.fd] = _File(piece.path, piece.fd)
                region = _Region(start, length, self._opened[piece.fd], piece.offset - piece.offset % mmap.PAGESIZE)
                if not _map(libc, base, region, mmap.PROT_READ, mmap.MAP_SHARED):
                    err = ctypes.get_errno()
                    raise OSError(
                        err, f"mapping {length} bytes of {piece.path} into host storage failed: {os.strerror(err)}"
                    )
                self._regions.append(region)
                self.nbytes += length
        except BaseException:
            self._regions, self.nbytes = [], 0
            self._close()
            raise

    def check(self) -> None:
        """Raise RuntimeError if a file still mapped changed on disk since it was mapped (its size or modification
        time): its pages may no longer hold the weights that were loaded. One `fstat` per file."""
        if self._regions:  # the descriptors are closed only once no region is a file's
            for file in self._opened.values():
                file.check_unchanged()

    def make_private(self, unpinned: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Every region becomes private memory at the same addresses, with the same bytes: positional reads into new
        memory (a file cut short raises OSError here, not SIGBUS at a touch), then, with Ctrl-C held back and inside
        `unpinned()` (the arena's range not page-locked), each copy moved over its region (`mremap`, atomic per
        region). An error or Ctrl-C before the moves changes nothing; after any exception during them, what maps each
        region is read back from the kernel: anonymous memory is a completed move, nothing (a failed move that
        unmapped its target) gets the file's pages mapped back."""
        from ..interrupts import deferred_interrupts

        libc, base = _libc(), self.base
        copies: list[tuple[int, int, int]] = []  # (start, length, address of its private copy)
        try:
            for region in self._regions:
                protection, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_ANONYMOUS
                copy = libc.mmap(None, region.length, protection, flags, -1, 0)
                if copy in (None, _MAP_FAILED):
                    raise MemoryError(f"No private memory for {region.length} bytes of host storage.")
                copies.append((region.start, region.length, copy))
                _read_into(region.file, region.offset, copy, region.length)
            with deferred_interrupts(), unpinned():
                moved: set[int] = set()
                try:
                    for start, length, copy in copies:
                        where = libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, base + start)
                        if where != base + start:  # not expected: the range is ours and page-aligned
                            raise OSError(ctypes.get_errno(), "mremap of host storage failed")
                        moved.add(start)
                finally:
                    if len(moved) < len(copies):  # a signal handler's exception, or a failed mremap
                        kinds = _mapping_kinds(base + start for start, _, _ in copies)
                        for region in self._regions:
                            kind = kinds.get(base + region.start, "file")
                            if kind == "anonymous":
                                moved.add(region.start)
                            elif kind is None:
                                _map(libc, base, region, mmap.PROT_READ, mmap.MAP_SHARED)
                    copies = [c for c in copies if c[0] not in moved]
                    self._regions = [region for region in self._regions if region.start not in moved]
                    self.nbytes = sum(region.length for region in self._regions)
                    if not self._regions:
                        self._close()
        finally:
            for _, length, copy in copies:  # those not moved into the arena
                libc.munmap(copy, length)

    def release(self, forget: bool = False) -> None:
        """Map what is still a file's copy-on-write (`MAP_PRIVATE`, writable, no copy) at the same addresses, and
        close the files: a view that outlives the arena may be written, and the file never changes. Only once the
        range is not page-locked (a page the device had locked is then not copied on a write). With `forget`, zero
        pages instead, for views that will not be read: no page of the files stays mapped (a deleted file is freed)."""
        if self._regions:
            libc = _libc()
            for region in self._regions:
                if forget:
                    where, flags = self.base + region.start, mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED
                    if libc.mmap(where, region.length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != where:
                        logger.warning("Could not unmap %s: %s", region.file.path, os.strerror(ctypes.get_errno()))
                elif not _map(libc, self.base, region, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE):
                    error = os.strerror(ctypes.get_errno())
                    logger.warning("Could not map %s copy-on-write: %s", region.file.path, error)
        self._regions, self.nbytes = [], 0
        self._close()


def _libc() -> ctypes.CDLL:
    libc = c_library()
    if libc is None:
        raise OSError("no C library to map files with")
    return libc


def _map(libc: ctypes.CDLL, base: int, region: _Region, protection: int, sharing: int) -> bool:
    # The region's file pages over its place in the range; False (errno set) where the kernel refuses.
    where = base + region.start
    flags = sharing | _MAP_FIXED
    return libc.mmap(where, region.length, protection, flags, region.file.fd, region.offset) == where


def _read_into(file: _File, offset: int, address: int, nbytes: int) -> None:
    # The file's bytes [offset, offset + nbytes) into memory at `address`; the last page may run past the file's end
    # (zeros there, as in its mapping), anything shorter raises.
    done = pread(file.fd, (ctypes.c_uint8 * nbytes).from_address(address), offset)
    if done < nbytes and offset + nbytes - os.fstat(file.fd).st_size >= mmap.PAGESIZE:
        raise OSError(f"{file.path} ended at byte {offset + done} while reading host storage back from it.")


def _mapping_kinds(addresses: Iterable[int]) -> dict[int, str | None]:
    # What maps each of `addresses` now, from one read of /proc/self/maps: "file" (its inode field is not 0),
    # "anonymous", or None (nothing).
    wanted = sorted(addresses)
    kinds: dict[int, str | None] = dict.fromkeys(wanted)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            for address in wanted[bisect.bisect_left(wanted, low) : bisect.bisect_left(wanted, high)]:
                kinds[address] = "file" if fields[4] != "0" else "anonymous"
    return kinds


def _close_all(files: dict[int, _File]) -> None:
    for file in files.values():
        file.close()
    files.clear()
