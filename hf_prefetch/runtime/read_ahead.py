"""The engine's reads of layers whose weights stay in the checkpoint's files (`Placement.READ`): each copy of such a
layer into its slot comes from a pinned staging buffer that a read filled, and the reads run ahead on threads.

[Note: weights read from files]
A ring whose layers do not all fit host memory keeps the rest in the checkpoint's own safetensors files
(planning/file_tier.py). Their host tensors are the files' pages, mapped read-only (the host's other paths read them
there: `state_dict` is refused, writes are refused, removals copy them), but no copy reads those pages: each copy of
such a layer into its slot comes from one of the ring's `num_slots + 1` pinned staging buffers, filled by direct I/O
(`host/file_reads.py`: no page cache, no second copy of the bytes).
- Order: the ring's READ layers, in forward order, cyclically (a decode's next forward starts over). When a layer's
  copy is issued its buffer is given back and reads start into every free buffer, for the next layers in that
  order: the disk reads while the link copies and the device computes, as far ahead as there are spare buffers.
- A buffer is read into again only after the copy out of it landed: its read first waits (on its reader thread) for
  the event that copy recorded; on the CPU copies are synchronous.
- A copy whose layer was not read ahead (the first forward, a miss, a layer run out of order) starts its read, taking
  a free buffer or else the one read for the layer furthest ahead, and waits for it: the forward stalls, the weights
  are right.
- A read fails (a file changed on disk, truncated, an I/O error) with the file and offset named, and the copy with
  it, before anything is written into the slot: the forward fails, and once the file is back the next one reads it.
- CUDA graphs cannot record these copies (a replay would copy whatever the buffer holds by then): a capture over
  them is refused (capture.py), compile with mode="default".
"""

from __future__ import annotations

from collections import deque

import torch

from ..host.file_reads import FileExtent, Retarget, StagedReads
from ..interrupts import deferred_interrupts
from ..planning.file_tier import staging_buffer_bytes, staging_buffers
from ..planning.placements import RingPlan
from .ring import LayerTransfer

__all__ = ["ReadAhead", "CAPTURE_REFUSED", "attach_reads", "read_extents"]

CAPTURE_REFUSED = (
    "hf_prefetch: this model's layers {layers} are read from the checkpoint's files at each use (max_memory['cpu'] "
    "holds less than what streams), and a CUDA graph cannot record those reads: a replay would copy whatever the "
    "staging buffers hold by then. Compile without CUDA graphs (generate(..., compile_config=CompileConfig("
    "mode='default')), or torch.compile(mode='default')), or give max_memory['cpu'] room for every streamed layer."
)


class ReadAhead:
    """One ring's layers read from files ([Note: weights read from files]): `sources(i)` before the copy of its
    `i`-th such layer (their index in `reads`), `copied(i, event)` once that copy is issued."""

    def __init__(self, reads: StagedReads) -> None:
        self.reads = reads
        self._count = reads.num_layers
        self._free = deque(range(reads.num_buffers))
        self._buffer_of: dict[int, int] = {}  # layer -> the buffer its read was started into (not given back yet)
        self._landed: list[torch.cuda.Event | None] = [None] * reads.num_buffers  # the last copy out of each buffer

    def sources(self, index: int) -> list[torch.Tensor]:
        """Layer `index`'s tensors' bytes in its staging buffer (uint8, in the layer's order), its read waited for,
        and started now if it was not read ahead. Raises the read's error (the buffer is then free)."""
        if index not in self._buffer_of:
            if not self._free:
                self._evict(index)
            self._start(index)
        try:
            return self.reads.views(index)
        except BaseException:
            with deferred_interrupts():  # a failed read ended it (file_reads); a Ctrl-C here leaves it started
                if not self.reads.started(index):
                    self._free.append(self._buffer_of.pop(index))
            raise

    def copied(self, index: int, landed: torch.cuda.Event | None) -> None:
        """The copy of layer `index` out of its buffer is issued (`landed`: the event it records on CUDA): the buffer
        is read into again once it landed; reads start for the next layers."""
        with deferred_interrupts():
            buffer = self._buffer_of.pop(index)
            self._landed[buffer] = landed
            self.reads.release(buffer)
            self._free.append(buffer)
        self._ahead(index)

    def close(self) -> None:
        self.reads.close()

    def switch(self, files: Retarget) -> None:
        """Read the layers from `files` (`StagedReads.retarget`, e.g. a new checkpoint's) from now on; every read
        started so far is ended. Call only while no copy out of a buffer is in flight."""
        with deferred_interrupts():
            self.reads.switch(files)
            self._buffer_of.clear()
            self._free = deque(range(self.reads.num_buffers))

    def _ahead(self, index: int) -> None:
        # The next layers after `index`, in cyclic order, into every free buffer.
        for step in range(1, self._count + 1):
            if not self._free:
                return
            following = (index + step) % self._count
            if following not in self._buffer_of:
                self._start(following)

    def _start(self, index: int) -> None:
        with deferred_interrupts():  # taken and recorded together
            buffer = self._free.popleft()
            landed = self._landed[buffer]
            before = landed.synchronize if landed is not None else None
            try:
                self.reads.start(index, buffer, before)
            except BaseException:
                self._free.appendleft(buffer)
                raise
            # `_landed[buffer]` stays: a read evicted before its `before` ran leaves that wait to the next read.
            self._buffer_of[index] = buffer

    def _evict(self, index: int) -> None:
        # No free buffer: give back the one read for the layer furthest ahead of `index` (its read is ended).
        furthest = max(self._buffer_of, key=lambda other: (other - index) % self._count)
        with deferred_interrupts():
            buffer = self._buffer_of.pop(furthest)
            self.reads.release(buffer)
            self._free.append(buffer)


def attach_reads(
    transfers: list[LayerTransfer], ring: RingPlan, extents: dict[str, FileExtent], device: torch.device
) -> list[ReadAhead]:
    """The reads of `ring`'s layers read from files (`transfers`: its streamed layers'; `extents`: where each
    parameter lies, by full name), [] without such layers: their copies come from its staging buffers from now on."""
    read = [transfer for transfer, layer in zip(transfers, ring.streamed, strict=True) if layer.read_from_files]
    if not read:
        return []
    # Buffers as large as the plan counted: a reload's new files (`retarget`) fit them.
    reads = StagedReads(
        read_extents(ring, extents),
        staging_buffers(ring),
        pin=device.type == "cuda",
        min_buffer_bytes=staging_buffer_bytes(ring),
    )
    ahead = ReadAhead(reads)
    for index, transfer in enumerate(read):
        transfer.reads, transfer.read_index, transfer.span = ahead, index, None
    return [ahead]


def read_extents(ring: RingPlan, extents: dict[str, FileExtent]) -> list[list[FileExtent]]:
    """Each of `ring`'s layers read from files: where each of its parameters lies (`extents`, by full name)."""
    read = [layer for layer in ring.streamed if layer.read_from_files]
    return [[extents[f"{layer.path}.{spec.name}"] for spec in layer.offloaded] for layer in read]
