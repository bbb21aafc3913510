"""The static device buffer pool: `num_slots` buffers for each distinct (name, shape, stride, dtype).

Allocated once; offloaded parameters point at their slot's buffers for good. Which layer a slot holds is the ring's
`SlotTable` (ring.py). Each slot is one allocation, its buffers at `alignment.TENSOR_ALIGN_BYTES` boundaries in key
order, as a layer's tensors lie in the host arena: a layer whose tensors are the slot's keys in that order is one copy
of one byte range (`ring.byte_span`). The pool knows nothing about models, streams or copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..host.arena import padded_bytes, span_bytes

__all__ = ["BufferPool"]

PoolKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


class BufferPool:
    """`num_slots` device buffers per pool key, each slot one allocation.

    Example:

    ```python
    >>> import torch
    >>> from hf_prefetch.runtime.pool import BufferPool
    >>> pool = BufferPool([("w", (2, 3), (3, 1), torch.float32)], num_slots=2, device=torch.device("cpu"))
    >>> pool.buffer(("w", (2, 3), (3, 1), torch.float32), 1).shape, pool.nbytes
    (torch.Size([2, 3]), 8192)

    ```
    """

    def __init__(self, keys: Iterable[PoolKey], num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        offsets: dict[PoolKey, int] = {}
        slot_bytes = 0
        for key in dict.fromkeys(keys):
            offsets[key] = slot_bytes
            slot_bytes += padded_bytes(span_bytes(*key[1:]))
        slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        self._buffers: dict[PoolKey, list[torch.Tensor]] = {
            key: [_view(slot, offset, key) for slot in slots] for key, offset in offsets.items()
        }
        self.nbytes = slot_bytes * num_slots

    def buffer(self, key: PoolKey, slot: int) -> torch.Tensor:
        return self._buffers[key][slot]


def _view(slot: torch.Tensor, offset: int, key: PoolKey) -> torch.Tensor:
    _, shape, stride, dtype = key
    return slot[offset : offset + span_bytes(shape, stride, dtype)].view(dtype).as_strided(shape, stride)
