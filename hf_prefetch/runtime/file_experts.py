"""The engine's reads of routed experts that stay in the checkpoint's files (`Placement.READ_ROUTED`): a forward reads
the experts its router picks that the ring's host expert cache lacks, and copies their rows from the cache into the
layer's slot.

[Note: experts read from files]
A mixture-of-experts model whose host budget cannot pin every streamed layer keeps the routed experts of its last
streamed layers in the checkpoint's own safetensors files (planning/file_tier.py); their other parameters (attention,
the router, shared experts) stay pinned and stream as usual. No copy ever brings those routed tensors whole: loaded by
`from_pretrained` they have no host storage (their host tensors are meta, the parameters a placeholder of no memory
while their data is not the slot's); written by `dispatch_model(offload_folder=...)` (stored whole) their host
tensors are the file's pages, mapped read-only as for layers read from files.
- The host expert cache of a ring is a `StagedReads` whose units are (layer, expert): one unit holds one expert's
  rows of each of the layer's routed tensors, as the files store them (`ExpertRows`: a fused tensor's row, or the
  separate tensors of a checkpoint that stores experts one by one). Its `num_buffers` page-locked buffers are the
  cache's entries; a unit read stays READY in its buffer until evicted.
- Eviction: each layer's share of the cache is `capacity // layers` buffers. A miss takes a free buffer, else the
  least recently picked unit of a layer holding more than its share, else of any layer, never one the gather under
  way needs; among layers, first the one whose next gather is furthest away (the layers run in a cycle: the gathering
  layer's own other experts, then the layer before it). A global least-recently-used order would keep nothing
  whenever a forward picks more experts than the cache holds: each layer's picks would be evicted by the others'
  before its next gather. Shares keep each layer's own (a uniform router then finds about `capacity / experts` of
  its picks there).
- Every forward of such a layer, routing or not, gathers: at its experts module (after the layer's wait), the
  router's choice is read on the host (one synchronisation), the distinct experts it names are looked up, those
  missing are read into buffers (direct I/O, on the reader's threads, all at once) and every picked expert's pieces
  are copied into its rows of the slot on the compute stream. The experts' forward then reads exactly those rows.
- More distinct picks than the cache holds (a long prefill) go in rounds of at most its size; a buffer is read into
  again only after the copies out of it landed (the reader thread waits for the event they recorded).
- A read that fails (a file changed, truncated, an I/O error) fails the forward with the file and offset named,
  before its rows are copied; its buffer is free again and the next forward reads it. A Ctrl-C while reads are waited
  for ends them the same way. The cache never holds a unit that did not read whole.
- No CUDA graph can record this (the host reads the router's choice): a capture over such a layer is refused.
  torch.compile without CUDA graphs runs the gather as its op, in Python.
- `remove_offload` reads each meta one whole from the files into memory (`expert_rows.read_whole`) through the
  files the reader opened (those it reads where a path was replaced since); one written since refuses the removal.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ..host.expert_rows import ExpertRows
from ..host.file_reads import FileExtent, Retarget, StagedReads
from ..interrupts import deferred_interrupts
from ..planning.placements import RingPlan
from .ring import LayerTransfer

__all__ = ["FileExperts", "FileExpertLayer", "CAPTURE_REFUSED", "attach_file_experts", "expert_units"]

CAPTURE_REFUSED = (
    "hf_prefetch: the routed experts of layers {layers} are read from the checkpoint's files as their routers pick "
    "them (max_memory['cpu'] holds less than what streams), which needs the router's choice on the host: a CUDA graph "
    "cannot record it. Compile without CUDA graphs (generate(..., compile_config=CompileConfig(mode='default')), or "
    "torch.compile(mode='default')), or give max_memory['cpu'] room for every streamed layer."
)


@dataclass(frozen=True)
class FileExpertLayer:
    """One layer's routed experts in the files: unit `first + e` is its expert e; `targets[e]` says where each piece
    of that unit goes: (routed tensor index, byte offset of the piece in the expert's row)."""

    first: int
    num_experts: int
    row_bytes: tuple[int, ...]  # per routed tensor
    targets: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def unit_bytes(self) -> int:
        """The bytes a read of one expert brings: its rows of every routed tensor."""
        return sum(self.row_bytes)


class FileExperts:
    """One ring's host expert cache over `reads` (its units: every layer's experts, see `FileExpertLayer`)."""

    def __init__(self, reads: StagedReads, layers: list[FileExpertLayer]) -> None:
        self.reads = reads
        self.layers = layers
        self._free = deque(range(reads.num_buffers))
        self._buffer_of: dict[int, int] = {}  # unit -> the buffer holding it (started, not given back)
        # Per layer, its cached units, least recently picked first.
        self._order: list[OrderedDict[int, None]] = [OrderedDict() for _ in layers]
        self._layer_of = [i for i, spec in enumerate(layers) for _ in range(spec.num_experts)]  # unit -> layer
        self._share = reads.num_buffers // max(1, len(layers))
        self._landed: list[torch.cuda.Event | None] = [None] * reads.num_buffers  # the last copy out of each buffer

    @property
    def capacity(self) -> int:
        return self.reads.num_buffers

    def cached(self, layer: int) -> list[int]:
        """The experts of `layer` the cache holds now."""
        spec = self.layers[layer]
        return sorted(u - spec.first for u in self._buffer_of if spec.first <= u < spec.first + spec.num_experts)

    def gather(self, transfer: LayerTransfer, index: torch.Tensor, cuda: bool) -> None:
        """Copy the rows of the experts `index` names (the router's choice, any shape, read here on the host) into
        `transfer`'s slot, reading from files those the cache lacks; copies on the current stream."""
        spec = self.layers[transfer.files_layer]
        picked = index.detach().reshape(-1).to("cpu", torch.int64)  # waits for the router
        picked = picked[(picked >= 0) & (picked < spec.num_experts)]
        counters = transfer.counters
        counters.routed_picks += picked.numel()
        picked = picked.unique().tolist()
        targets = [tensor.device.view(-1).view(torch.uint8) for tensor in transfer.routed]
        for begin in range(0, len(picked), self.capacity):
            units = [spec.first + e for e in picked[begin : begin + self.capacity]]
            keep = set(units)
            missing = [u for u in units if u not in self._buffer_of]
            waited = time.perf_counter()
            try:
                for unit in missing:
                    self._start(unit, keep)
                pieces = [self.reads.views(unit) for unit in units]
            except BaseException:  # the round's other reads are ended too: none stays cached unread
                with deferred_interrupts():
                    for unit in missing:
                        if unit in self._buffer_of:
                            self._forget(unit)
                raise
            counters.host_cache_hits += len(units) - len(missing)
            counters.host_cache_misses += len(missing)
            counters.read_bytes += len(missing) * spec.unit_bytes
            counters.read_wait_seconds += time.perf_counter() - waited if missing else 0.0
            # Issued and recorded with no Ctrl-C between: a buffer is read into again only after its copies landed.
            with deferred_interrupts():
                for unit, views in zip(units, pieces, strict=True):
                    expert = unit - spec.first
                    for view, (tensor, at) in zip(views, spec.targets[expert], strict=True):
                        start = expert * spec.row_bytes[tensor] + at
                        targets[tensor][start : start + view.numel()].copy_(view, non_blocking=cuda)
                    self._order[transfer.files_layer].move_to_end(unit)
                landed = torch.cuda.current_stream(targets[0].device).record_event() if cuda else None
                for unit in units:
                    self._landed[self._buffer_of[unit]] = landed
            counters.routed_rows += len(units)
            counters.routed_bytes += spec.unit_bytes * len(units)
            counters.copied_bytes += spec.unit_bytes * len(units)

    def close(self) -> None:
        self.reads.close()

    def switch(self, files: Retarget, layers: list[FileExpertLayer]) -> None:
        """Read the experts from `files` (`StagedReads.retarget`, e.g. a new checkpoint's), laid out as `layers` says,
        from now on (the same layers and experts: `same_units`): the cache is emptied (every read ended). Call only
        while no copy out of a buffer is in flight."""
        with deferred_interrupts():
            self.reads.switch(files)
            self.layers = layers
            self._buffer_of.clear()
            self._order = [OrderedDict() for _ in layers]
            self._free = deque(range(self.reads.num_buffers))

    def same_units(self, layers: list[FileExpertLayer]) -> bool:
        """Whether `layers` number the same layers' experts as the cache does (what `switch` needs)."""
        return [(spec.first, spec.num_experts) for spec in layers] == [(s.first, s.num_experts) for s in self.layers]

    def _start(self, unit: int, keep: set[int]) -> None:
        # Read `unit` into a free buffer, or else into the one of the least recently picked unit not in `keep`.
        with deferred_interrupts():  # taken and recorded together
            if not self._free:
                self._forget(self._victim(self._layer_of[unit], keep))
            buffer = self._free.popleft()
            landed = self._landed[buffer]
            try:
                self.reads.start(unit, buffer, landed.synchronize if landed is not None else None)
            except BaseException:
                self._free.appendleft(buffer)
                raise
            self._buffer_of[unit] = buffer
            self._order[self._layer_of[unit]][unit] = None

    def _victim(self, layer: int, keep: set[int]) -> int:
        # A unit not in `keep`: first of a layer over its share, then of any; the layers taken in the order their
        # next gathers come furthest from now (`layer`'s own other experts first: a whole cycle away, then the layer
        # before it...), each its least recently picked unit.
        count = len(self._order)
        ahead = sorted(range(count), key=lambda other: -((other - layer) % count or count))
        for over_share in (True, False):
            for other in ahead:
                if over_share and len(self._order[other]) <= self._share:
                    continue
                for unit in self._order[other]:
                    if unit not in keep:
                        return unit
        raise RuntimeError("hf_prefetch: the host expert cache has no buffer left: it holds fewer than a round.")

    def _forget(self, unit: int) -> None:
        buffer = self._buffer_of.pop(unit)
        self._order[self._layer_of[unit]].pop(unit)
        self.reads.release(buffer)
        self._free.append(buffer)  # `_landed[buffer]` stays: the next read into it waits for that copy


def attach_file_experts(
    transfers: list[LayerTransfer], ring: RingPlan, rows: dict[str, ExpertRows], device: torch.device
) -> list[FileExperts]:
    """The host expert cache of `ring`'s layers whose experts are read from files (`transfers`: its streamed layers';
    `rows`: where each routed tensor's experts lie, by full name), [] without such layers: their gathers read from it
    from now on."""
    chosen = [t for t, layer in zip(transfers, ring.streamed, strict=True) if layer.experts_from_files]
    if not chosen:
        return []
    units, specs = expert_units(ring, rows)
    pin, room = device.type == "cuda", ring.expert_buffer_bytes  # as the plan counted: a reload's files fit it
    experts = FileExperts(StagedReads(units, ring.host_cached_experts, pin=pin, min_buffer_bytes=room), specs)
    for index, transfer in enumerate(chosen):
        transfer.files, transfer.files_layer = experts, index
    return [experts]


def expert_units(ring: RingPlan, rows: dict[str, ExpertRows]) -> tuple[list[list[FileExtent]], list[FileExpertLayer]]:
    """The units of `ring`'s host expert cache (each (layer, expert)'s extents in the files, from `rows`: where each
    routed tensor's experts lie, by full name) and each layer's place among them."""
    units: list[list[FileExtent]] = []
    specs = []
    for layer in (layer for layer in ring.streamed if layer.experts_from_files):
        stored = [rows[f"{layer.path}.{spec.name}"] for spec in layer.routed]
        num_experts = layer.routed[0].routing.num_experts
        targets = []
        for e in range(num_experts):
            units.append([extent for where in stored for extent, _ in where.rows[e]])
            targets.append(tuple((t, at) for t, where in enumerate(stored) for _, at in where.rows[e]))
        row_bytes = tuple(where.row_bytes for where in stored)
        specs.append(FileExpertLayer(len(units) - num_experts, num_experts, row_bytes, tuple(targets)))
    return units, specs
