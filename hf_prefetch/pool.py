"""The static device buffer pool: `num_slots` buffers for each distinct (name, shape, stride, dtype).

Allocated once; offloaded parameters point at their slot's buffers for good. Which layer a slot holds is the ring's
`SlotTable` (ring.py). The pool knows nothing about models, streams or copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["BufferPool"]

PoolKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


class BufferPool:
    """`num_slots` device buffers per pool key.

    Example:

    ```python
    >>> import torch
    >>> from hf_prefetch.pool import BufferPool
    >>> pool = BufferPool([("w", (2, 3), (3, 1), torch.float32)], num_slots=2, device=torch.device("cpu"))
    >>> pool.buffer(("w", (2, 3), (3, 1), torch.float32), 1).shape, pool.nbytes
    (torch.Size([2, 3]), 48)

    ```
    """

    def __init__(self, keys: Iterable[PoolKey], num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self._buffers: dict[PoolKey, list[torch.Tensor]] = {}
        for key in dict.fromkeys(keys):
            _, shape, stride, dtype = key
            self._buffers[key] = [
                torch.empty_strided(shape, stride, dtype=dtype, device=device) for _ in range(num_slots)
            ]

    def buffer(self, key: PoolKey, slot: int) -> torch.Tensor:
        return self._buffers[key][slot]

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for slots in self._buffers.values() for b in slots)
