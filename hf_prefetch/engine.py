"""The transfer engine: the one owner of the copy stream, the copy events and the slot bookkeeping.

It moves bytes from host storage into pool slots (`prefetch`), orders the compute stream after them (`wait`) and
hands a slot to its next layer once the current one has run (`release`). It knows layers only as positions in a
ring; it knows nothing about modules, hooks or transformers. See [Note: stream ordering] and [Note: slot reuse]
in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .pool import BufferPool

__all__ = ["PrefetchEngine", "RingTransfers", "LayerTransfer", "TransferCounters"]


@dataclass
class LayerTransfer:
    """The copies that bring one streamed layer into its slot: `device[i].copy_(host[i])`."""

    host: list[torch.Tensor]  # host storage (pinned when `pinned`), never moved or resized
    device: list[torch.Tensor]  # this layer's buffers in its slot of the pool
    slot: int
    next_in_slot: int  # the layer (ring position) that takes over `slot` after this one ran
    nbytes: int
    # Recorded on the copy stream after this layer's copy; the compute stream waits on it before the layer runs.
    done: torch.cuda.Event | None = None


@dataclass
class RingTransfers:
    """The streamed layers of one layer list, in forward order, and the pool slots they share."""

    layers: list[LayerTransfer]
    pool: BufferPool


@dataclass
class TransferCounters:
    copies: int = 0
    copied_bytes: int = 0
    misses: int = 0


class PrefetchEngine:
    """Copies layer weights from host storage into pool slots ahead of use. On CPU the copies are synchronous."""

    def __init__(self, device: torch.device, rings: Sequence[RingTransfers], pinned: bool) -> None:
        self.device = device
        self.rings = list(rings)
        self.counters = TransferCounters()
        self._cuda = device.type == "cuda"
        # Asynchronous copies are only truly async (and only safe to overlap) from page-locked memory; from
        # pageable memory every copy blocks the host until it completed.
        self._non_blocking = self._cuda and pinned
        # copy_stream: runs every host-to-device weight copy. It is ordered after the compute stream by a wait
        # before each copy (the slot may still be read by queued kernels), and the compute stream is ordered after
        # it by each layer's `done` event.
        self.copy_stream = torch.cuda.Stream(device) if self._cuda else None
        if self._cuda:
            for ring in self.rings:
                for layer in ring.layers:
                    layer.done = torch.cuda.Event()

    def prefetch(self, ring: int, position: int) -> None:
        """Start copying layer `position` of `ring` into its slot, after all compute queued so far."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if transfers.pool.owners[layer.slot] == position:
            return  # already there or on its way
        transfers.pool.owners[layer.slot] = position
        self.counters.copies += 1
        self.counters.copied_bytes += layer.nbytes
        if not self._cuda:
            _copy_all(layer, non_blocking=False)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            _copy_all(layer, self._non_blocking)
            layer.done.record()

    def wait(self, ring: int, position: int) -> None:
        """Order the compute stream after layer `position`'s copy; load it now if its slot holds another layer."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if transfers.pool.owners[layer.slot] != position:
            self._load_now(transfers, position)
        elif self._cuda:
            torch.cuda.current_stream(self.device).wait_event(layer.done)

    def release(self, ring: int, position: int) -> None:
        """Layer `position` has been queued: hand its slot to the next layer that uses it."""
        self.prefetch(ring, self.rings[ring].layers[position].next_in_slot)

    def start(self) -> None:
        """Fill every slot with its first layer (called once the parameters point at the pool)."""
        for index, transfers in enumerate(self.rings):
            for position in range(min(transfers.pool.num_slots, len(transfers.layers))):
                self.prefetch(index, position)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has landed."""
        if self._cuda:
            self.copy_stream.synchronize()

    def _load_now(self, transfers: RingTransfers, position: int) -> None:
        # A miss: the slot holds (or is receiving) another layer's weights, e.g. after a forward interrupted by an
        # exception or a model that skips or repeats layers. Copy on the compute stream so the layer sees its own
        # weights, after any copy into the slot still in flight.
        layer = transfers.layers[position]
        transfers.pool.owners[layer.slot] = position
        self.counters.misses += 1
        self.counters.copies += 1
        self.counters.copied_bytes += layer.nbytes
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        _copy_all(layer, self._non_blocking)


def _copy_all(layer: LayerTransfer, non_blocking: bool) -> None:
    for dst, src in zip(layer.device, layer.host):
        dst.copy_(src, non_blocking=non_blocking)
