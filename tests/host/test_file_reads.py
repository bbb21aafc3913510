"""Staged reads of checkpoint files on the CPU: real safetensors files, the extents from their headers, and the reads
recorded (or slowed down, or failed) through `diskio.pread`."""

import errno
import fcntl
import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from hf_prefetch.alignment import DIRECT_IO_ALIGN_BYTES, round_up
from hf_prefetch.host import diskio, file_reads, read_speed
from hf_prefetch.host.diskio import open_direct
from hf_prefetch.host.file_reads import FileExtent, StagedReads
from hf_prefetch.host.read_speed import measure_read_gbps
from hf_prefetch.runtime.read_ahead import ReadAhead

LAYERS = 5


def _extents(path: Path) -> dict[str, FileExtent]:
    # Each tensor's bytes in a safetensors file, from its header.
    with open(path, "rb") as file:
        header_bytes = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_bytes))
    header.pop("__metadata__", None)
    start = 8 + header_bytes
    return {
        key: FileExtent(path, start + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
        for key, info in header.items()
    }


def _write_checkpoint(folder: Path) -> SimpleNamespace:
    # Three files of odd sizes (none a multiple of the alignment, so each ends in a short read), several tensors each,
    # and five layers drawing on them; the last layer holds the tensor at the very end of each file.
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.big": torch.randn(37, 301, generator=generator),  # across several 8 KiB windows
        "a.odd": torch.randn(13, generator=generator).to(torch.bfloat16),
        "a.byte": torch.randint(0, 256, (4097,), generator=generator, dtype=torch.uint8),
        "b.w": torch.randn(33, 129, generator=generator).half(),
        "b.empty": torch.empty(0, 4),
        "b.i": torch.randint(-(2**40), 2**40, (1000,), generator=generator),
        "c.x": torch.randn(5, 7, generator=generator),
        "c.y": torch.randint(-128, 128, (12345,), generator=generator, dtype=torch.int8),
    }
    files, extents = {}, {}
    for name in "abc":
        files[name] = folder / f"{name}.safetensors"
        save_file({k: t for k, t in tensors.items() if k[0] == name}, files[name])
        extents.update(_extents(files[name]))
        assert files[name].stat().st_size % DIRECT_IO_ALIGN_BYTES
    last = [k for k, e in extents.items() if e.nbytes and e.offset + e.nbytes == e.path.stat().st_size]
    assert len(last) == 3
    layers = [["a.big", "b.w"], ["a.odd", "c.x", "b.empty"], ["c.y", "a.byte"], ["b.i", "a.big"], [*last, "c.x"]]
    return SimpleNamespace(files=files, tensors=tensors, extents=extents, layers=layers)


@pytest.fixture
def checkpoint(tmp_path) -> SimpleNamespace:
    """`.files` (a, b, c), `.tensors` and `.extents` by key, `.layers` (lists of keys)."""
    return _write_checkpoint(tmp_path)


def _layers(checkpoint) -> list[list[FileExtent]]:
    return [[checkpoint.extents[key] for key in layer] for layer in checkpoint.layers]


def _check(views: list[torch.Tensor], checkpoint, layer: int) -> None:
    keys = checkpoint.layers[layer]
    assert len(views) == len(keys)
    for view, key in zip(views, keys, strict=True):
        expected = checkpoint.tensors[key].contiguous().reshape(-1).view(torch.uint8)
        assert view.dtype == torch.uint8 and torch.equal(view, expected), f"layer {layer}: {key}"


class _Reads:
    """`diskio.pread` recorded: each call's (fd, address, nbytes, position), the reads running (`active`) and
    begun; each read waits `delay` seconds first, and `hook(fd, out, position, real)`, where set, may fail it or
    return what it read instead of the real read (None: read as usual)."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.active = 0
        self.delay = delay
        self.hook = None
        self._lock = threading.Lock()
        real = diskio.pread

        def pread(fd, out, position):
            with self._lock:
                self.active += 1
                self.calls.append((fd, out.ctypes.data, out.nbytes, position))
            try:
                time.sleep(self.delay)
                got = self.hook(fd, out, position, real) if self.hook is not None else None
                return real(fd, out, position) if got is None else got
            finally:
                with self._lock:
                    self.active -= 1

        monkeypatch.setattr(diskio, "pread", pread)
        monkeypatch.setattr(read_speed, "pread", pread)

    def wait_for_a_read(self) -> None:
        deadline = time.monotonic() + 5
        while not self.active and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.active


def _of(path: Path):
    # Whether a descriptor is of `path`.
    return lambda fd: os.fstat(fd).st_ino == path.stat().st_ino


def _taken_for_direct(path: Path) -> int:
    # A descriptor taken for direct I/O: opened plainly, marked with O_APPEND (which reads ignore).
    return os.open(path, os.O_RDONLY | os.O_APPEND)


def _is_taken_for_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)


def _refuse_direct(fd, out, position, real):
    # As a file system that opens files for direct I/O and refuses their reads.
    if _is_taken_for_direct(fd):
        raise OSError(errno.EINVAL, "Invalid argument")


@pytest.mark.parametrize("window_bytes", [8192, 8 * 2**20])
def test_every_layer_is_read_bitwise_through_two_buffers_in_turn(checkpoint, monkeypatch, window_bytes):
    reads = _Reads(monkeypatch)
    layers = _layers(checkpoint)
    with StagedReads(layers, 2, threads=3, window_bytes=window_bytes) as staged:
        for _ in range(3):
            staged.start(0, 0)
            staged.start(1, 1)
            for layer in range(LAYERS):
                _check(staged.views(layer), checkpoint, layer)
                staged.release(layer % 2)
                if layer + 2 < LAYERS:
                    staged.start(layer + 2, layer % 2)
        assert staged.bytes_read == 3 * sum(e.nbytes for layer in layers for e in layer)
        assert staged.reads == len(reads.calls) > 3 * LAYERS and staged.read_seconds > 0
        assert staged.buffered_files == [path for path in checkpoint.files.values() if open_direct(path) is None]
    for _, address, nbytes, position in reads.calls:  # what direct I/O needs
        assert (
            address % DIRECT_IO_ALIGN_BYTES == nbytes % DIRECT_IO_ALIGN_BYTES == position % DIRECT_IO_ALIGN_BYTES == 0
        )
        assert nbytes <= window_bytes
    with pytest.raises(RuntimeError, match="were closed"):
        staged.views(0)


def test_before_runs_once_on_a_reader_thread_ahead_of_the_reads(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch)
    seen = []

    def before():
        time.sleep(0.05)  # the other threads wait for it
        seen.append((threading.current_thread().name, len(reads.calls)))

    with StagedReads(_layers(checkpoint), 1, threads=3, window_bytes=8192) as staged:
        staged.start(0, 0, before=before)
        _check(staged.views(0), checkpoint, 0)
    assert len(seen) == 1 and seen[0][0].startswith("hf_prefetch-stage") and seen[0][1] == 0


def test_a_layer_of_empty_tensors_reads_nothing_and_still_runs_before(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch)
    seen = []
    with StagedReads([[checkpoint.extents["b.empty"]]], 1) as staged:
        staged.start(0, 0, before=lambda: seen.append(True))
        assert [view.numel() for view in staged.views(0)] == [0]
    assert seen == [True] and reads.calls == [] and staged.bytes_read == 0


def test_a_busy_buffer_a_layer_read_twice_and_a_layer_not_started_are_refused(checkpoint):
    with StagedReads(_layers(checkpoint), 2) as staged:
        with pytest.raises(RuntimeError, match=r"views\(3\): layer 3 was not started"):
            staged.views(3)
        staged.start(0, 0)
        with pytest.raises(RuntimeError, match=r"Staging buffer 0 still holds layer 0 \(filling\).*release\(0\)"):
            staged.start(1, 0)
        with pytest.raises(RuntimeError, match="Layer 0 is already being read into staging buffer 0"):
            staged.start(0, 1)
        _check(staged.views(0), checkpoint, 0)
        with pytest.raises(RuntimeError, match=r"Staging buffer 0 still holds layer 0 \(ready\)"):
            staged.start(1, 0)
        staged.release(0)
        staged.release(0)  # a free buffer: nothing to do
        staged.start(1, 0)
        _check(staged.views(1), checkpoint, 1)
        with pytest.raises(ValueError, match="buffer=2: the staging buffers are 0 to 1"):
            staged.start(2, 2)
        with pytest.raises(ValueError, match="layer=5: the reads were planned for layers 0 to 4"):
            staged.start(5, 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_extent_past_the_file_s_end_is_refused_naming_the_file_offset_and_size(checkpoint):
    path = checkpoint.files["b"]
    size = path.stat().st_size
    opened = len(os.listdir("/proc/self/fd"))
    past = FileExtent(path, size - 10, 11)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .* at offset {size - 10} .* size is {size} bytes"):
        StagedReads([[checkpoint.extents["a.big"]], [past]], 1)
    assert len(os.listdir("/proc/self/fd")) == opened


@pytest.mark.parametrize("offset, nbytes", [(-1, 4), (0, -4), (1.5, 4)])
def test_a_file_extent_refuses_negative_and_fractional_values(offset, nbytes):
    with pytest.raises(ValueError, match="must be a non-negative int"):
        FileExtent(Path("x"), offset, nbytes)


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_under_the_reader_is_refused_naming_it(checkpoint, change):
    path = checkpoint.files["b"]
    with StagedReads(_layers(checkpoint), 2) as staged:
        if change == "truncated":
            os.truncate(path, path.stat().st_size - 100)
        else:  # the same size, a new modification time
            path.write_bytes(path.read_bytes())
            status = os.stat(path)
            os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
        staged.start(0, 0)  # a.big and b.w
        with pytest.raises(
            RuntimeError, match=rf"{re.escape(str(path))} changed on disk .*reload_weights\(model, folder\)"
        ):
            staged.views(0)
        staged.start(2, 0)  # the buffer is free again; layer 2 reads no tensor of b
        _check(staged.views(2), checkpoint, 2)


def test_a_file_changed_while_it_is_read_is_refused(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch)
    path = checkpoint.files["a"]

    def touch(fd, out, position, real):
        status = os.stat(path)
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
        reads.hook = None

    reads.hook = touch
    with StagedReads(_layers(checkpoint), 1, threads=1) as staged:
        staged.start(0, 0)
        with pytest.raises(RuntimeError, match=rf"{re.escape(str(path))} changed on disk"):
            staged.views(0)


@pytest.mark.parametrize("failure", ["EIO", "short read"])
def test_a_read_error_names_the_file_and_offset_and_the_reader_recovers(checkpoint, monkeypatch, failure):
    reads = _Reads(monkeypatch)
    path, of_a = checkpoint.files["a"], _of(checkpoint.files["a"])

    def fail(fd, out, position, real):
        if not (of_a(fd) and position == 8192):
            return None
        if failure == "EIO":
            raise OSError(errno.EIO, "Input/output error")
        real(fd, out, position)
        return 100

    reads.hook = fail
    with StagedReads(_layers(checkpoint), 2, threads=2, window_bytes=8192) as staged:
        staged.start(0, 0)
        said = "at byte offset 8192 failed" if failure == "EIO" else ": the file ended at byte 8292 .* truncated"
        with pytest.raises(OSError, match=rf"{re.escape(str(path))} ?{said}") as caught:
            staged.views(0)
        assert caught.value.errno == errno.EIO and reads.active == 0  # no window of the failed read still runs
        staged.start(1, 1)
        _check(staged.views(1), checkpoint, 1)
        reads.hook = None  # the disk reads again
        staged.release(0)  # as a caller's cleanup would: the buffer is already free
        staged.start(0, 0)
        _check(staged.views(0), checkpoint, 0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_close_waits_for_the_reads_in_flight_and_is_idempotent(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch, delay=0.2)
    opened = len(os.listdir("/proc/self/fd"))
    staged = StagedReads(_layers(checkpoint), 2, threads=2, window_bytes=8192)
    staged.start(0, 0)
    staged.start(1, 1)
    reads.wait_for_a_read()
    staged.close()
    assert reads.active == 0
    begun = len(reads.calls)
    time.sleep(0.3)
    assert len(reads.calls) == begun  # the queued windows were cancelled
    assert len(os.listdir("/proc/self/fd")) == opened
    staged.close()
    with pytest.raises(RuntimeError, match="were closed"):
        staged.start(0, 0)


@pytest.mark.parametrize("ended_by", ["a Ctrl-C while waiting", "a release before waiting"])
def test_a_read_ended_unfinished_leaves_no_read_running_into_its_buffer(checkpoint, monkeypatch, ended_by):
    reads = _Reads(monkeypatch, delay=0.3)
    with StagedReads(_layers(checkpoint), 2, threads=2, window_bytes=8192) as staged:
        windows = len(staged._layouts[0].windows)
        staged.start(0, 0)
        if ended_by == "a release before waiting":
            reads.wait_for_a_read()
            staged.release(0)
        else:
            ctrl_c = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
            ctrl_c.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    staged.views(0)
            finally:
                ctrl_c.cancel()
        assert reads.active == 0
        begun = len(reads.calls)
        time.sleep(0.4)
        assert len(reads.calls) == begun < windows  # nothing of the ended read began after it
        reads.delay = 0.0
        staged.start(0, 0)  # the buffer is free
        _check(staged.views(0), checkpoint, 0)


def test_a_ctrl_c_from_before_reads_nothing_and_frees_the_buffer(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch)

    def before():
        raise KeyboardInterrupt

    with StagedReads(_layers(checkpoint), 1, threads=2, window_bytes=8192) as staged:
        staged.start(0, 0, before=before)
        with pytest.raises(KeyboardInterrupt):
            staged.views(0)
        assert reads.calls == []
        staged.start(0, 0)
        _check(staged.views(0), checkpoint, 0)


def test_files_opened_without_direct_io_are_reported_and_read_through_the_page_cache(checkpoint, monkeypatch):
    refused = checkpoint.files["b"]
    real = diskio.open_direct
    monkeypatch.setattr(diskio, "open_direct", lambda path: None if path == refused else real(path))
    with StagedReads(_layers(checkpoint), 1) as staged:
        assert staged.buffered_files == [refused]
        staged.start(0, 0)
        _check(staged.views(0), checkpoint, 0)


def test_a_direct_read_the_file_system_refuses_goes_through_the_page_cache(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch)
    monkeypatch.setattr(diskio, "open_direct", _taken_for_direct)
    reads.hook = _refuse_direct
    with StagedReads(_layers(checkpoint), 1, window_bytes=8192) as staged:
        assert staged.buffered_files == []
        for layer in range(LAYERS):
            staged.start(layer, 0)
            _check(staged.views(layer), checkpoint, layer)
            staged.release(0)
        assert staged.buffered_files == list(checkpoint.files.values())


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_on_tmpfs_the_fallback_to_the_page_cache_is_reported():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        checkpoint = _write_checkpoint(Path(folder))
        if open_direct(checkpoint.files["a"]) is not None:
            pytest.skip("this kernel opens tmpfs files with O_DIRECT")
        with StagedReads(_layers(checkpoint), 1) as staged:
            assert staged.buffered_files == list(checkpoint.files.values())
            for layer in range(LAYERS):
                staged.start(layer, 0)
                _check(staged.views(layer), checkpoint, layer)
                staged.release(0)


def test_measure_read_gbps_reads_up_to_nbytes_in_aligned_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(read_speed, "_MEASURE_CHUNK_BYTES", 2**20)
    reads = _Reads(monkeypatch)
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(5 * 2**20 + 123))
    nbytes = 3 * 2**20 + 5
    assert measure_read_gbps(path, nbytes) > 0
    assert sorted(position for *_, position in reads.calls) == [0, 2**20, 2**21, 3 * 2**20]
    assert sum(n for _, _, n, _ in reads.calls) == 3 * 2**20 + round_up(5, DIRECT_IO_ALIGN_BYTES)
    for _, address, n, position in reads.calls:
        assert address % DIRECT_IO_ALIGN_BYTES == n % DIRECT_IO_ALIGN_BYTES == position % DIRECT_IO_ALIGN_BYTES == 0
    reads.calls.clear()
    assert measure_read_gbps(path, 2**30) > 0  # the whole file, its last chunk a short read at its end
    assert max(position for *_, position in reads.calls) == 5 * 2**20
    with pytest.raises(ValueError, match="nbytes=0"):
        measure_read_gbps(path, 0)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        measure_read_gbps(tmp_path / "empty", 4096)


def test_measure_read_gbps_reads_through_the_page_cache_where_direct_reads_are_refused(tmp_path, monkeypatch):
    reads = _Reads(monkeypatch)
    monkeypatch.setattr(diskio, "open_direct", _taken_for_direct)
    taken: list[bool] = []
    reads.hook = lambda fd, *args: taken.append(_is_taken_for_direct(fd)) or _refuse_direct(fd, *args)
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(2**20 + 7))
    assert measure_read_gbps(path, 2**30) > 0
    assert True in taken and taken[-1] is False  # refused, then read plainly


def test_a_read_evicted_before_its_wait_for_the_buffer_leaves_that_wait_to_the_next_read(checkpoint, monkeypatch):
    # Layer 2's read into buffer 0 must first wait for the copy out of buffer 0 (its event); evicted while still queued
    # behind layer 1's, it never waited, so the read that takes buffer 0 next must wait instead.
    _Reads(monkeypatch, delay=0.2)
    waited = []
    landed = SimpleNamespace(synchronize=lambda: waited.append(threading.current_thread()))
    with StagedReads(_layers(checkpoint), 2, threads=1, window_bytes=8192) as staged:
        ahead = ReadAhead(staged)
        ahead.sources(0)
        ahead.copied(0, landed)  # reads start for layers 1 (buffer 1) and 2 (buffer 0, after `landed`)
        assert not waited
        _check(ahead.sources(4), checkpoint, 4)  # out of order: layer 2 is evicted, layer 4 read into buffer 0
        assert len(waited) == 1 and waited[0] is not threading.main_thread()


def test_a_retarget_reads_other_files_once_switched_and_ends_the_reads_of_the_old_ones(checkpoint, monkeypatch):
    reads = _Reads(monkeypatch, delay=0.2)
    folder = checkpoint.files["a"].parent / "other"
    folder.mkdir()
    other = _write_checkpoint(folder)
    for name in "abc":  # the same tensors with other bytes
        tensors = {k: t for k, t in checkpoint.tensors.items() if k[0] == name}
        other.tensors.update({k: (t + 1) if t.is_floating_point() else t ^ 1 for k, t in tensors.items()})
        save_file({k: other.tensors[k] for k in tensors}, other.files[name])
    other.extents = {k: e for path in other.files.values() for k, e in _extents(path).items()}
    opened = len(os.listdir("/proc/self/fd"))
    with StagedReads(_layers(checkpoint), 2, threads=2, window_bytes=8192) as staged:
        arena = staged._arena
        staged.start(0, 0)
        staged.start(1, 1)
        reads.wait_for_a_read()
        files = staged.retarget(_layers(other))
        assert staged.started(0) and arena is staged._arena  # nothing of the reader changed yet
        staged.switch(files)
        assert reads.active == 0 and not staged.started(0) and not staged.started(1)  # the old reads were ended
        assert staged._arena is arena  # the layers fit the buffers it has
        assert len(os.listdir("/proc/self/fd")) == opened + len(staged.opened_files)  # the old files were closed
        reads.delay = 0.0
        for layer in range(LAYERS):
            staged.start(layer, 0)
            _check(staged.views(layer), other, layer)
            staged.release(0)
        with pytest.raises(ValueError, match="retarget: 4 layers for a reader of 5"):
            staged.retarget(_layers(other)[:4])
        bigger = staged.retarget([[*_layers(checkpoint)[0], checkpoint.extents["c.y"]]] * LAYERS)
        bigger.discard()  # what was opened and allocated for it, dropped
        assert len(os.listdir("/proc/self/fd")) == opened + len(staged.opened_files)
        bigger = staged.retarget([[*_layers(checkpoint)[0], checkpoint.extents["c.y"]]] * LAYERS)
        staged.switch(bigger)
        assert staged._arena is not arena and staged.buffer_bytes > 0
        staged.start(3, 1)
        views = staged.views(3)
        assert torch.equal(views[-1], checkpoint.tensors["c.y"].view(torch.uint8))
    assert len(os.listdir("/proc/self/fd")) == opened
    with pytest.raises(RuntimeError, match="were closed"):
        staged.retarget(_layers(checkpoint))
