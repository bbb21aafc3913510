import os
import threading
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import save_file

from hf_prefetch.host import diskio
from hf_prefetch.loading import reader as reader_module
from hf_prefetch.loading.checkpoint import Checkpoint
from hf_prefetch.loading.reader import TensorReader


@pytest.fixture
def shards(tmp_path):
    """Two files whose tensors have odd sizes and offsets (so windows cut tensors anywhere)."""
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(1000, 37).to(torch.bfloat16),
        "b": torch.randint(0, 100, (3,), dtype=torch.int64),
        "c": torch.randn(5000),
        "d": torch.randn(17, 3, 11).to(torch.float16),
    }
    save_file({k: tensors[k] for k in "ab"}, str(tmp_path / "one.safetensors"))
    save_file({k: tensors[k] for k in "cd"}, str(tmp_path / "two.safetensors"))
    return tmp_path, tensors


def _checkpoint(folder):
    # A checkpoint over both files (as an index would make it).
    one, two = Checkpoint.open(folder / "one.safetensors"), Checkpoint.open(folder / "two.safetensors")
    return Checkpoint(folder, {**one.entries, **two.entries})


def _buffered_as_direct(monkeypatch):
    # Windowed reads through an ordinary descriptor: the windows, bounce buffers and copies run where the file
    # system refuses O_DIRECT (tmpfs in CI).
    monkeypatch.setattr(reader_module, "open_direct", lambda path: os.open(path, os.O_RDONLY))


@pytest.mark.parametrize("window_bytes", [4096, 8 * 2**20])
def test_windowed_reads_fill_host_tensors_bitwise(shards, monkeypatch, window_bytes):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", window_bytes)
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    for k in tensors:
        assert torch.equal(outs[k], tensors[k]), k
    total = sum(t.nbytes for t in tensors.values())
    assert reader.bytes_read == reader.direct_bytes == total


def test_cast_and_strided_destinations_are_read_through_the_page_cache(shards, monkeypatch):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    cast = torch.empty(1000, 37, dtype=torch.float32)
    strided = torch.empty(11, 3, 17, dtype=torch.float16).permute(2, 1, 0)
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint["a"], cast), (checkpoint["d"], strided)])
    assert torch.equal(cast, tensors["a"].float()) and torch.equal(strided, tensors["d"])
    assert reader.direct_bytes == 0


def test_direct_false_and_cached_files_read_through_the_page_cache(shards, monkeypatch):
    folder, tensors = shards
    opened = []
    monkeypatch.setattr(reader_module, "open_direct", lambda path: opened.append(path))
    out = torch.empty_like(tensors["c"])
    with _checkpoint(folder) as checkpoint:
        with TensorReader(checkpoint, direct=False) as reader:
            reader.load([(checkpoint["c"], out)])
        monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 1.0)  # the page cache holds it
        with TensorReader(checkpoint) as reader:
            reader.load([(checkpoint["c"], out)])
        monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 0.1)  # on the disk only
        with TensorReader(checkpoint) as reader:
            reader.load([(checkpoint["c"], out)])
    assert opened == [folder / "two.safetensors"] and torch.equal(out, tensors["c"])


def test_a_file_truncated_after_opening_is_an_error_naming_it(shards, monkeypatch):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    with _checkpoint(folder) as checkpoint:
        os.truncate(folder / "two.safetensors", checkpoint["d"].offset + 10)
        out = torch.empty_like(tensors["d"])
        with TensorReader(checkpoint, direct=True) as reader, pytest.raises(ValueError, match="two.safetensors: the "
                                                                            "file ended at byte"):  # fmt: skip
            reader.load([(checkpoint["d"], out)])


def test_real_direct_io_where_the_file_system_allows_it(shards):
    folder, tensors = shards
    from hf_prefetch.host.diskio import open_direct

    fd = open_direct(folder / "one.safetensors")
    if fd is None:
        pytest.skip(f"the file system of {folder} refuses O_DIRECT")
    os.close(fd)
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k], tensors[k]) for k in tensors)
    assert reader.direct_bytes == reader.bytes_read


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [None, True])
def test_windowed_reads_onto_cuda(shards, monkeypatch, direct):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)
    monkeypatch.setattr(reader_module, "MAPPED_FROM", 2.0)  # no mapped reads: windows through the page cache
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=direct) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)


@pytest.mark.gpu
def test_windowed_reads_cast_onto_cuda(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)  # casts of pieces cut at many window boundaries
    casts = {"a": torch.float32, "c": torch.bfloat16, "d": torch.float32}
    outs = {k: torch.empty(tensors[k].shape, dtype=dtype, device="cuda") for k, dtype in casts.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in casts])
    assert all(torch.equal(outs[k].cpu(), tensors[k].to(casts[k])) for k in casts)


class _Locks:
    """Records the mapped reads' page-locks and unlocks (the real ones run), and their mappings' opening and closing;
    `refuse(n)` says whether the n-th lock (from 0) is refused."""

    def __init__(self, monkeypatch, refuse=lambda n: False):
        self.locked, self.unlocked, self.opened, self.closed = [], [], [], []
        real_lock, real_unlock, real_mapping = (
            reader_module.lock_read_only,
            reader_module.unlock,
            reader_module.FileMapping,
        )

        def lock(pointer, nbytes):
            if refuse(len(self.locked)):
                self.locked.append(None)
                return False
            self.locked.append(pointer)
            return real_lock(pointer, nbytes)

        def unlock(pointer):
            self.unlocked.append(pointer)
            real_unlock(pointer)

        locks = self

        class Mapping(real_mapping):
            def __init__(self, *args):
                super().__init__(*args)
                locks.opened.append(self)

            def close(self):
                locks.closed.append(self)
                super().close()

        monkeypatch.setattr(reader_module, "lock_read_only", lock)
        monkeypatch.setattr(reader_module, "unlock", unlock)
        monkeypatch.setattr(reader_module, "FileMapping", Mapping)  # the probe's
        monkeypatch.setattr(diskio, "FileMapping", Mapping)  # the reads' (`diskio.SharedMappings`)
        monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 1.0)  # the page cache holds them
        monkeypatch.setattr(reader_module, "_maps_files", {})  # probed afresh: no answer left by another test

    def balanced(self) -> bool:
        locked = [p for p in self.locked if p is not None]
        return sorted(locked) == sorted(self.unlocked) and len(self.opened) == len(self.closed)


@pytest.mark.gpu
def test_mapped_reads_onto_cuda(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_SPAN_BYTES", 4096)  # pieces cut at many span boundaries
    locks = _Locks(monkeypatch)
    key = (torch.cuda.current_device(), os.stat(folder / "one.safetensors").st_dev)
    monkeypatch.setattr(reader_module, "_maps_files", {key: True})  # probed: the probe's mapping is not counted
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert reader.mapped_bytes == reader.bytes_read == sum(t.nbytes for t in tensors.values())
    assert len(locks.locked) > 20 and locks.balanced()
    assert len(locks.opened) == 2  # each file mapped once for the load, not once per span


@pytest.mark.gpu
def test_without_mapped_reads_cuda_destinations_go_through_windows(shards, monkeypatch):
    folder, tensors = shards
    locks = _Locks(monkeypatch)
    key = (torch.cuda.current_device(), os.stat(folder / "one.safetensors").st_dev)
    monkeypatch.setattr(reader_module, "_maps_files", {key: True})  # the driver would lock them
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, mapped=False) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert reader.mapped_bytes == 0 and reader.bytes_read == sum(t.nbytes for t in tensors.values())
    assert locks.locked == [] and locks.opened == []


@pytest.mark.gpu
def test_a_span_the_driver_refuses_to_lock_is_copied_from_pageable_memory(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_SPAN_BYTES", 4096)
    locks = _Locks(monkeypatch, refuse=lambda n: n % 3 == 1)
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert 0 < reader.mapped_bytes < reader.bytes_read and locks.balanced()


@pytest.mark.gpu
def test_an_error_during_mapped_reads_leaves_no_span_locked_or_mapped(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_SPAN_BYTES", 4096)
    locks = _Locks(monkeypatch)
    real_copy, calls, counting = reader_module._Mapped._copy, [], threading.Lock()

    def copy(self, span, source, non_blocking):
        with counting:  # reader threads copy at once: the 5th call is known when it starts, not when it ends
            calls.append(span)
            fifth = len(calls) == 5
        events = real_copy(self, span, source, non_blocking)
        if fifth:  # after its copies were queued: they must end before its pages are unlocked
            raise RuntimeError("copy failed")
        return events

    monkeypatch.setattr(reader_module._Mapped, "_copy", copy)
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        with pytest.raises(RuntimeError, match="copy failed"):
            reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert len(calls) >= 5 and locks.balanced()


@pytest.mark.gpu
def test_mapped_reads_of_a_file_truncated_after_opening_name_it(shards, monkeypatch):
    folder, tensors = shards
    _Locks(monkeypatch)
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        os.truncate(folder / "two.safetensors", 1000)
        with pytest.raises(ValueError, match="two.safetensors: the file ended at byte 1000.*truncated"):
            reader.load([(checkpoint["c"], torch.empty(5000, device="cuda"))])


@pytest.mark.gpu
def test_files_the_page_cache_holds_only_partly_are_not_mapped(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)
    locks = _Locks(monkeypatch)
    monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 0.7)  # not read directly, not mapped either
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert reader.mapped_bytes == reader.direct_bytes == 0 and not locks.locked


@pytest.mark.gpu
@pytest.mark.parametrize("probed", [False, True])
def test_files_that_cannot_be_mapped_are_read_another_way(shards, monkeypatch, probed):
    # Not probed yet: the probe's mapping fails, so windows carry the reads. Probed (the driver locks mappings), but
    # each file's mapping fails (no address space, say): every span is read into pageable memory and copied from
    # there, and the file system's answer stays (a mapping that fails is not the driver refusing to lock one).
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_SPAN_BYTES", 4096)
    monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 1.0)
    key = (torch.cuda.current_device(), os.stat(folder / "one.safetensors").st_dev)
    monkeypatch.setattr(reader_module, "_maps_files", {key: True} if probed else {})

    def refuse(*args):
        raise OSError("no mmap here")

    monkeypatch.setattr(reader_module, "FileMapping", refuse)
    monkeypatch.setattr(diskio, "FileMapping", refuse)
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert reader.mapped_bytes == 0 and reader.bytes_read == sum(t.nbytes for t in tensors.values())
    # A failed probe answers nothing.
    assert reader_module._maps_files == ({key: True} if probed else {})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_mapped_reads_onto_a_second_gpu(shards, monkeypatch):
    # Destinations on cuda:1 while cuda:0 is current: locked, copied and unlocked under cuda:1.
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_SPAN_BYTES", 4096)
    locks = _Locks(monkeypatch)
    outs = {k: torch.empty_like(t, device="cuda:1") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)
    assert reader.mapped_bytes == reader.bytes_read and locks.balanced()
    assert list(reader_module._maps_files) == [(1, os.stat(folder / "one.safetensors").st_dev)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_ctrl_c_anywhere_in_a_read_leaves_no_descriptor_open_no_job_running_and_no_copy_in_flight(
    shards, monkeypatch
):
    # A Ctrl-C at every bytecode of a load's reads and of the reader's and checkpoint's descriptors: a descriptor
    # opened but not yet recorded, or swapped out by `close` before it was closed, stayed open for the process's
    # life; a job submitted but not yet recorded was never waited for; a Ctrl-C as the reads ended left the bounce
    # buffers to the collector with their copies to the device in flight.
    import gc

    from hf_prefetch.loading import checkpoint as checkpoint_module
    from tests.interrupting import at_every_point

    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    reads = _RecordedReads(monkeypatch)
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    outs["a"] = torch.empty_like(tensors["a"], dtype=torch.float32)  # a cast: through the page cache
    opened = len(os.listdir("/proc/self/fd"))

    def read(_):
        with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
            try:
                reader.load([(checkpoint[k], out) for k, out in outs.items()])
            finally:
                reads.ended()

    def check(_, where):
        if len(os.listdir("/proc/self/fd")) != opened:
            gc.collect()  # what a reference cycle kept: closed by its finalizer
        assert len(os.listdir("/proc/self/fd")) == opened, where
        assert reads.problems == [], where

    functions = [TensorReader.load, TensorReader.close, TensorReader.__exit__, TensorReader._direct_fd]
    functions += [reader_module.open_direct, Checkpoint.fd, Checkpoint.close, checkpoint_module._close_all]
    functions += [getattr(reader_module, "_close_all", Checkpoint.fd)]
    assert at_every_point(lambda: None, read, check, functions, opcodes=True) > 100
    assert torch.equal(outs["a"], tensors["a"].float()) and all(torch.equal(outs[k], tensors[k]) for k in "bcd")


class _RecordedReads:
    """The reader's thread pool replaced by `_LazyPool`, and its windowed reads recorded: `ended()` (as `load` ends)
    adds to `problems` each job still pending and each window whose bounce buffers were read into but not finished
    (their copies waited for and the buffers released by `finish`)."""

    def __init__(self, monkeypatch) -> None:
        self.pools: list[_LazyPool] = []
        self.windows: list = []
        self.problems: list[str] = []
        recorded = self

        class Windows(reader_module._Windows):
            def __init__(self, *args) -> None:
                super().__init__(*args)
                self.read = self.finished = False
                recorded.windows.append(self)

            def _read_window(self, window) -> None:
                self.read = True
                super()._read_window(window)

            def finish(self) -> None:
                super().finish()
                self.finished = True

        def pool(*args, **kwargs) -> _LazyPool:
            self.pools.append(_LazyPool())
            return self.pools[-1]

        monkeypatch.setattr(reader_module, "_Windows", Windows)
        monkeypatch.setattr(reader_module, "ThreadPoolExecutor", pool)

    def ended(self) -> None:
        self.problems += [f"{f} left running" for pool in self.pools for f in pool.futures if not f.done()]
        self.problems += ["bounce buffers read into, then left" for w in self.windows if w.read and not w.finished]
        self.pools, self.windows = [], []


class _LazyPool:
    """The reader's thread pool for `at_every_point`: a job runs in the thread that waits for its future (the main
    thread, which the test interrupts), and a job nobody waits for never runs, so that its future stays pending."""

    def __init__(self) -> None:
        self.futures: list[_LazyFuture] = []

    def submit(self, job):
        self.futures.append(_LazyFuture(job))
        return self.futures[-1]

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        for future in self.futures if cancel_futures else []:
            future.cancel()


class _LazyFuture(Future):
    def __init__(self, job) -> None:
        super().__init__()
        self._job = job

    def result(self, timeout=None):
        self._run()
        return super().result(timeout)

    def exception(self, timeout=None):
        self._run()
        return super().exception(timeout)

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._job = None
        return cancelled

    def _run(self) -> None:
        if self.done() or not self.set_running_or_notify_cancel():
            return
        job, self._job = self._job, None  # what it holds (the bounce buffers) is freed once it ran
        try:
            self.set_result(job())
        except BaseException as error:
            self.set_exception(error)
