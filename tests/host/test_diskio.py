import ctypes
import mmap
import os
from pathlib import Path

import pytest

from hf_prefetch.alignment import DIRECT_IO_ALIGN_BYTES
from hf_prefetch.host import diskio
from hf_prefetch.host.diskio import (
    FileMapping,
    SharedMappings,
    aligned_buffer,
    cached_fraction,
    open_direct,
    plan_windows,
    pread,
)

A, B = Path("a"), Path("b")


@pytest.mark.parametrize(
    "ranges, window, expected",
    [
        # one range inside one window: read from its first aligned byte to its last
        ([(A, 5000, 100, "x")], 8192, [(A, 4096, 8192, [(5000, 100, "x")])]),
        # a range across a window boundary is cut there
        ([(A, 8000, 400, "x")], 8192, [(A, 4096, 8192, [(8000, 192, "x")]), (A, 8192, 12288, [(8192, 208, "x")])]),
        # two ranges of one window share its read, in file order whatever the order given
        ([(A, 300, 10, "y"), (A, 0, 10, "x")], 8192, [(A, 0, 4096, [(0, 10, "x"), (300, 10, "y")])]),
        # ranges whose aligned blocks do not touch are read apart: no block between them that none needs
        (
            [(A, 100, 10, "x"), (A, 20_000, 10, "y")],
            32768,
            [(A, 0, 4096, [(100, 10, "x")]), (A, 16384, 20480, [(20_000, 10, "y")])],
        ),
        # ranges within neighbouring blocks share one read
        ([(A, 4000, 10, "x"), (A, 4200, 10, "y")], 32768, [(A, 0, 8192, [(4000, 10, "x"), (4200, 10, "y")])]),
        # files never share a window
        ([(B, 0, 10, "y"), (A, 0, 10, "x")], 8192, [(A, 0, 4096, [(0, 10, "x")]), (B, 0, 4096, [(0, 10, "y")])]),
        # empty ranges read nothing
        ([(A, 0, 0, "x")], 8192, []),
    ],
)
def test_plan_windows(ranges, window, expected):
    windows = plan_windows(ranges, window)
    assert [(w.path, w.start, w.stop, list(w.pieces)) for w in windows] == expected
    for w in windows:
        assert w.start % DIRECT_IO_ALIGN_BYTES == 0 and w.stop % DIRECT_IO_ALIGN_BYTES == 0
        assert w.stop - w.start <= window


def test_plan_windows_reads_at_most_a_block_before_and_after_each_range():
    ranges = [(A, 17 + i * 50_000, 3000 + i, i) for i in range(40)]  # many ranges, far apart, in one large window
    read = sum(w.stop - w.start for w in plan_windows(ranges, 8 * 2**20))
    assert read <= sum(n for _, _, n, _ in ranges) + 2 * DIRECT_IO_ALIGN_BYTES * len(ranges)


def test_plan_windows_covers_every_byte_once():
    ranges = [(A, 17, 100_000, "x"), (A, 100_017, 3, "y"), (A, 300_001, 70_000, "z")]
    covered = {}
    for w in plan_windows(ranges, 16384):
        for offset, nbytes, key in w.pieces:
            assert w.start <= offset and offset + nbytes <= w.stop
            for byte in range(offset, offset + nbytes):
                assert byte not in covered
                covered[byte] = key
    assert len(covered) == sum(n for _, _, n, _ in ranges)


@pytest.mark.parametrize("window", [0, 1000, -4096])
def test_plan_windows_refuses_unaligned_windows(window):
    with pytest.raises(ValueError, match="window_bytes=.* must be a positive multiple of 4096"):
        plan_windows([(A, 0, 1, "x")], window)


def test_cached_fraction_of_a_file_just_written_and_read(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 4096 + 5))
    path.read_bytes()
    fraction = cached_fraction(path)
    assert fraction is None or fraction == 1.0  # None only where the kernel cannot say
    (tmp_path / "empty").write_bytes(b"")
    assert cached_fraction(tmp_path / "empty") == 1.0


def test_direct_reads_into_an_aligned_buffer(tmp_path):
    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    buffer = aligned_buffer(8 * 4096)
    assert buffer.ctypes.data % DIRECT_IO_ALIGN_BYTES == 0 and buffer.nbytes == 8 * 4096
    fd = open_direct(path)
    if fd is None:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    try:
        got = pread(fd, buffer[: 6 * 4096], 4096)  # past the end: stops at the end of the file
    finally:
        os.close(fd)
    assert got == len(data) - 4096 and bytes(buffer[:got]) == data[4096:]


def test_a_file_mapping_holds_the_file_s_bytes(tmp_path):
    data = os.urandom(3 * 4096 + 123)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for start, stop in [(0, len(data)), (5000, 9000), (4096, 4097), (len(data) - 10, len(data))]:
            mapping = FileMapping(fd, start, stop)
            assert mapping.nbytes == stop - start
            assert ctypes.string_at(mapping.address, mapping.nbytes) == data[start:stop]
            mapping.close()
            mapping.close()  # closing twice does nothing
    finally:
        os.close(fd)


def _resident_kib(address: int) -> int:
    # The resident memory of the mapping holding `address`, from /proc/self/smaps.
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux's /proc/self/smaps")
def test_a_file_mapping_forgets_the_pages_of_a_stretch_and_keeps_its_bytes(tmp_path):
    page, kib = mmap.PAGESIZE, mmap.PAGESIZE // 1024
    data = os.urandom(64 * page)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        mapping = FileMapping(fd, 0, len(data))
        try:
            assert ctypes.string_at(mapping.address, mapping.nbytes) == data  # every page touched
            assert _resident_kib(mapping.address) == 64 * kib
            mapping.forget(100, 40 * page + 5)  # the whole pages inside: pages 1 to 39
            assert _resident_kib(mapping.address) == (64 - 39) * kib
            assert ctypes.string_at(mapping.address, mapping.nbytes) == data  # mapped again when touched
        finally:
            mapping.close()
        mapping.forget(0, len(data))  # closed: nothing to forget
        # A mapping that starts inside its first page (mapped from the page's start): bytes outside [start, stop) are
        # never forgotten, whatever the caller asks.
        mapping = FileMapping(fd, 100, 10 * page)
        try:
            assert ctypes.string_at(mapping.address - 100, 10 * page) == data[: 10 * page]
            assert _resident_kib(mapping.address) == 10 * kib
            mapping.forget(0, 100 * page)
            assert _resident_kib(mapping.address) == kib  # the page `start` is in stays
        finally:
            mapping.close()
    finally:
        os.close(fd)


def _windows_of(path: Path, nbytes: int, window_bytes: int):
    return plan_windows([(path, 0, nbytes, "t")], window_bytes=window_bytes)


def test_shared_mappings_map_a_stretch_for_its_first_window_and_unmap_it_after_its_last(tmp_path, monkeypatch):
    page = mmap.PAGESIZE
    data = os.urandom(10 * page)
    (tmp_path / "f").write_bytes(data)
    opened, closed = [], []

    class Counted(FileMapping):
        def __init__(self, *args):
            super().__init__(*args)
            opened.append(self)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(diskio, "FileMapping", Counted)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        windows = _windows_of(tmp_path / "f", len(data), page)  # ten windows, in stretches of four pages
        mappings = SharedMappings(windows, lambda path: fd, stretch_bytes=4 * page)
        assert not opened  # nothing is mapped before a window asks
        for i, window in enumerate(windows[:6]):
            mapping = mappings.acquire(window)
            assert ctypes.string_at(mapping.address + window.start - mapping.start, page) == data[i * page :][:page]
            mappings.release(window)
        assert len(opened) == 2 and closed == opened[:1]  # the first stretch's four windows are done
        assert mappings.acquire(windows[6]) is opened[1]
        mappings.close()  # windows 6-9 never released: what is left is unmapped
        assert closed == opened
    finally:
        os.close(fd)


def test_shared_mappings_tell_a_refused_mapping_from_a_failing_descriptor(tmp_path, monkeypatch):
    page = mmap.PAGESIZE
    (tmp_path / "f").write_bytes(b"x" * 3 * page)
    windows = _windows_of(tmp_path / "f", 3 * page, page)

    def refuse(*args):
        raise OSError("no mmap here")

    monkeypatch.setattr(diskio, "FileMapping", refuse)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert SharedMappings(windows, lambda path: fd, stretch_bytes=page).acquire(windows[0]) is None
    finally:
        os.close(fd)

    def no_descriptor(path):
        raise OSError(24, "Too many open files")

    with pytest.raises(OSError, match="Too many open files"):
        SharedMappings(windows, no_descriptor, stretch_bytes=page).acquire(windows[0])


def test_shared_mappings_refuse_stretches_that_are_not_a_multiple_of_the_windows(tmp_path):
    windows = _windows_of(tmp_path / "f", 6 * 4096, 2 * 4096)
    with pytest.raises(
        ValueError, match="stretch_bytes=12288 must be a multiple of the windows' size: bytes 8192-16384"
    ):
        SharedMappings(windows, lambda path: 0, stretch_bytes=3 * 4096)


def test_a_file_mapping_of_a_closed_descriptor_is_an_os_error(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 10)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError, match="mmap of bytes 0-10 failed"):
        FileMapping(fd, 0, 10)
