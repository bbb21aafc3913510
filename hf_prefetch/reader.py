"""Reading a checkpoint's tensors into caller-owned tensors, in host memory or on a CUDA device, from a thread pool.

Big tensors are split into chunks so that every reader thread has work; a CUDA destination is filled through a small
ring of pinned staging buffers. The reader knows byte ranges (`checkpoint.TensorEntry`); which tensor goes where is
the loader's call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpoint, TensorEntry

__all__ = ["TensorReader"]

_CHUNK_BYTES = 16 * 2**20  # one positional read; big tensors are split so that every reader thread has work
_READERS = min(8, os.cpu_count() or 4)
_STAGING_BYTES = 32 * 2**20  # one pinned staging buffer (CUDA destinations only)
_STAGING_BUFFERS = 4


class TensorReader:
    """Fills tensors with checkpoint tensors, casting where the dtypes differ.

    Host destinations (pinned or not) are written in place by positional reads from a thread pool; CUDA destinations
    are filled through a small ring of pinned staging buffers whose asynchronous copies overlap the next reads. No
    intermediate copy of a whole tensor is made, except for the rare destination that is not contiguous.

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

    def __init__(self, checkpoint: Checkpoint, on_read: Callable[[int], Any] | None = None) -> None:
        self.checkpoint = checkpoint
        self.on_read = on_read
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="hf_prefetch-read")

    def load(self, reads: Sequence[tuple[TensorEntry, torch.Tensor]]) -> None:
        """Fill each `(entry, out)` pair's `out` (same shape as the entry) and return once all are filled."""
        for entry, out in reads:
            if tuple(out.shape) != entry.shape:
                raise ValueError(f"{entry.key!r} has shape {list(entry.shape)}, the destination {list(out.shape)}.")
        futures = [f for entry, out in reads if out.device.type == "cpu" for f in self._submit_host(entry, out)]
        try:
            # One device at a time: a staging ring's copies and events are on that device's stream (pipeline
            # placement reads layers onto several GPUs).
            for device in dict.fromkeys(out.device for _, out in reads if out.device.type != "cpu"):
                self._to_device([(entry, out) for entry, out in reads if out.device == device])
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()  # wait: nothing may still write into `out` once this returns

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """A new host tensor holding `entry`."""
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            self._read(entry, _bytes_of(out), 0)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, entry: TensorEntry, out: np.ndarray, start: int) -> None:
        self.checkpoint.read(entry, out, start)
        with self._lock:
            self.bytes_read += out.nbytes
            if self.on_read is not None:
                self.on_read(out.nbytes)

    def _read_cast(self, entry: TensorEntry, out: torch.Tensor, first: int) -> None:
        # Elements [first, first + out.numel()) of `entry`, through a small temporary, cast into `out`.
        staged = torch.empty(out.numel(), dtype=entry.dtype)
        self._read(entry, _bytes_of(staged), first * entry.dtype.itemsize)
        out.copy_(staged.view(out.shape))

    def _submit_host(self, entry: TensorEntry, out: torch.Tensor) -> list[Future]:
        if out.numel() == 0:
            return []
        if not out.is_contiguous():
            return [self._pool.submit(lambda: out.copy_(self.read_tensor(entry)))]
        if out.dtype == entry.dtype:
            raw = _bytes_of(out)
            return [self._pool.submit(self._read, entry, raw[a:b], a) for a, b in _spans(entry.nbytes, _CHUNK_BYTES)]
        flat, step = out.view(-1), max(1, _CHUNK_BYTES // entry.dtype.itemsize)
        return [self._pool.submit(self._read_cast, entry, flat[a:b], a) for a, b in _spans(flat.numel(), step)]

    def _to_device(self, reads: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        # [Note: staging ring] A CUDA destination is read in pieces of at most _STAGING_BYTES into the next pinned
        # staging buffer and copied to the device asynchronously on `stream`, so reading the next pieces overlaps the
        # copy. A staging buffer is refilled only after the event recorded behind its last copy has completed.
        pieces = []
        for entry, out in reads:
            if out.numel() and not out.is_contiguous():
                out.copy_(self.read_tensor(entry))  # rare (a permuted layout): synchronous, through pageable memory
            elif out.numel():
                flat, step = out.view(-1), _STAGING_BYTES // entry.dtype.itemsize
                pieces += [(entry, a, flat[a:b]) for a, b in _spans(flat.numel(), step)]
        if not pieces:
            return
        device = pieces[0][2].device  # every piece's (`load` groups reads by device)
        # stream: runs the staging -> device copies, ordered after the work queued on the current stream so far (the
        # destinations were allocated there). copied[k]: recorded on `stream` after the last copy out of ring[k].
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        ring = [torch.empty(_STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(_STAGING_BUFFERS)]
        copied: list[torch.cuda.Event | None] = [None] * len(ring)
        # Own reader threads: the shared pool may be busy with host destinations queued before.
        stagers = ThreadPoolExecutor(_STAGING_BUFFERS, thread_name_prefix="hf_prefetch-stage")
        try:
            for i, (entry, first, out) in enumerate(pieces):
                k = i % len(ring)
                if copied[k] is not None:
                    copied[k].synchronize()
                nbytes, start = out.numel() * entry.dtype.itemsize, first * entry.dtype.itemsize
                raw = ring[k].numpy()
                spans = _spans(nbytes, _STAGING_BYTES // _STAGING_BUFFERS)
                for future in [stagers.submit(self._read, entry, raw[a:b], start + a) for a, b in spans]:
                    future.result()
                staged = ring[k][:nbytes]
                with torch.cuda.stream(stream):
                    if out.dtype == entry.dtype:
                        out.view(torch.uint8).copy_(staged, non_blocking=True)
                    else:
                        out.copy_(staged.view(entry.dtype), non_blocking=True)  # cast on the device
                    copied[k] = torch.cuda.Event()
                    copied[k].record(stream)
        finally:
            stagers.shutdown(wait=True, cancel_futures=True)
            stream.synchronize()


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    # The raw bytes of a contiguous host tensor, as a writable uint8 numpy array sharing its memory.
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, total)) for a in range(0, total, step)]
