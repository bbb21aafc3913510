"""The disk's sequential read speed (`measure_read_gbps`), timed at load for the plan's read time of the weights read
from the checkpoint's files, and by the benchmarks."""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..alignment import DIRECT_IO_ALIGN_BYTES, round_up
from .diskio import aligned_buffer, open_for_reads, pread

__all__ = ["measure_read_gbps"]

_MEASURE_CHUNK_BYTES = 16 * 2**20  # one read of `measure_read_gbps`
_MEASURE_THREADS = 4


def measure_read_gbps(path: Path, nbytes: int, *, threads: int = _MEASURE_THREADS) -> float:
    """The sequential read speed of `path`, in GB/s (1e9 bytes a second): its first `nbytes` (at most the whole
    file) read in aligned chunks of 16 MiB by `threads` threads, with direct I/O where the file system allows, else
    through the page cache (which then gives the cache's speed for bytes it holds).

    Example:

    ```python
    >>> import tempfile
    >>> from pathlib import Path
    >>> from hf_prefetch.host.read_speed import measure_read_gbps
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "weights.bin"
    ...     _ = path.write_bytes(bytes(3 * 2**20))
    ...     gbps = measure_read_gbps(path, 2**20)
    >>> gbps > 0
    True

    ```
    """
    path = Path(path)
    if nbytes <= 0:
        raise ValueError(f"measure_read_gbps: nbytes={nbytes}; give the bytes to read, a positive int.")
    fd, direct = open_for_reads(path)
    try:
        return _timed_reads(path, fd, nbytes, threads)
    except OSError as err:
        if not direct or err.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)  # the file system opened the file for direct I/O but refused its reads
    try:
        return _timed_reads(path, fd, nbytes, threads)
    finally:
        os.close(fd)


def _timed_reads(path: Path, fd: int, nbytes: int, threads: int) -> float:
    # GB/s of reading the first `nbytes` of `fd` in aligned chunks, each thread into a buffer of its own.
    total = min(nbytes, os.fstat(fd).st_size)
    if total == 0:
        raise ValueError(f"{path} is empty: there is nothing to time. Measure a checkpoint file with weights in it.")
    starts = iter(range(0, total, _MEASURE_CHUNK_BYTES))
    take = threading.Lock()

    def read_chunks() -> int:
        buffer, got = aligned_buffer(_MEASURE_CHUNK_BYTES), 0
        while True:
            with take:
                start = next(starts, None)
            if start is None:
                return got
            length = round_up(min(_MEASURE_CHUNK_BYTES, total - start), DIRECT_IO_ALIGN_BYTES)
            got += min(pread(fd, buffer[:length], start), total - start)

    began = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="hf_prefetch-measure") as pool:
        got = sum(future.result() for future in [pool.submit(read_chunks) for _ in range(threads)])
    return got / (time.perf_counter() - began) / 1e9
