"""Host storage for offloaded weights: one exact-size arena, page-locked when the device is CUDA.

PyTorch's pinned allocator rounds every request up to a power of two (a 3 GiB request pins 4 GiB) and caches the
block. The arena instead allocates ordinary memory of exactly the needed size and page-locks it once with
`cudaHostRegister`. The arena knows byte offsets and layouts; it knows nothing about models or streams.
"""

from __future__ import annotations

import ctypes
import logging
import warnings
import weakref
from collections.abc import Sequence

import torch

__all__ = ["HostArena", "ALIGN_BYTES"]

logger = logging.getLogger(__name__)

# Every tensor starts on a 4 KiB boundary: DMA-friendly, valid for any dtype, and O_DIRECT-compatible for the loader.
ALIGN_BYTES = 4096
_PAGE_BYTES = 4096

_warned_unpinned = False


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class HostArena:
    """`sizes[i]` bytes at `offsets[i]` of one host buffer, page-locked with `cudaHostRegister` by `pin()`.

    Fill the arena first, then pin it: registering memory that is already touched is about ten times faster than
    registering fresh memory (the kernel then only locks pages instead of also allocating them). Views stay valid
    after `release()` (the memory is then ordinary pageable memory, freed with the last view).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.offsets: list[int] = []
        total = 0
        for size in sizes:
            self.offsets.append(total)
            total += _round_up(size, ALIGN_BYTES)
        self.nbytes = _round_up(total, _PAGE_BYTES)
        # Over-allocate one page so that the registered range starts on a page boundary and shares no page with
        # another allocation (two registrations of one page fail).
        raw = torch.empty(self.nbytes + _PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE_BYTES
        self._buffer = raw[start : start + self.nbytes]
        self.pinned = False
        self._unpin: weakref.finalize | None = None

    def pin(self) -> bool:
        """Page-lock the arena (once); False, with one warning, where the platform refuses."""
        if not self.pinned and self.nbytes > 0:
            self.pinned = _register(self._buffer)
            if self.pinned:
                # Unregister when the arena dies even without release() (a dispatched model that is simply
                # dropped): freed memory that stays registered makes the next registration of it fail.
                self._unpin = weakref.finalize(self, _unregister, self._buffer.data_ptr())
                self._unpin.atexit = False
        return self.pinned

    def view(self, index: int, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The tensor stored at slot `index` of the arena, with the given layout."""
        offset = self.offsets[index]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        span = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
        flat = self._buffer[offset : offset + span * itemsize].view(dtype)
        return flat.as_strided(tuple(shape), tuple(stride))

    def bytes_view(self, index: int, nbytes: int) -> torch.Tensor:
        """The raw bytes at slot `index` (uint8), for readers that fill the arena directly."""
        offset = self.offsets[index]
        return self._buffer[offset : offset + nbytes]

    def release(self) -> None:
        """Unpin the arena. Call only when no copy from it is in flight."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False
        self._buffer = torch.empty(0, dtype=torch.uint8)


def _unregister(pointer: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(err) != 0:
        _clear_last_cuda_error()
        logger.warning("cudaHostUnregister failed with CUDA error %s", int(err))


def _register(buffer: torch.Tensor) -> bool:
    global _warned_unpinned
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(err) == 0:
        return True
    _clear_last_cuda_error()
    if not _warned_unpinned:
        _warned_unpinned = True
        warnings.warn(
            f"Could not page-lock {buffer.numel() / 2**30:.2f} GiB of host memory for offloaded weights "
            f"(cudaHostRegister returned error {int(err)}). Falling back to pageable memory: copies will be several "
            "times slower and synchronous. In containers raise the locked-memory limit "
            "(ulimit -l / --ulimit memlock).",
            stacklevel=4,
        )
    return False


def _clear_last_cuda_error() -> None:
    # A failed runtime call leaves its code in the thread's last-error slot, where PyTorch's next kernel-launch check
    # would report it. torch.cuda.cudart() binds no cudaGetLastError, so call the libcudart this process loaded.
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except OSError:
            continue
