"""One layer's copy into its slot: the (slot, host) pairs it brings, its bytes, issuing them (on a stream, into a
CUDA-graph capture, or through several links) and the `done` event that marks their end (`loaded_on`). The engine
decides when; this module knows only what."""

from __future__ import annotations

import time

import torch

from .graph_copies import captured_copy
from .read_ahead import CAPTURE_REFUSED
from .ring import CopyEvent, LayerTransfer
from .shared_links import SharedLinks
from .timing import timing_event

__all__ = ["copy_all", "copy_bytes", "copy_pairs", "loaded_on"]


def loaded_on(layer: LayerTransfer, stream: torch.cuda.Stream, capturing: bool, timing: bool) -> None:
    # The layer's latest copy ran on `stream`: `done` now marks its end. A fresh event, since a pending timing
    # measurement may still hold the old one; a timing one when stalls are measured against it.
    layer.done = timing_event() if timing and not capturing else torch.cuda.Event()
    layer.event = CopyEvent.IN_GRAPH if capturing else CopyEvent.ON_STREAM
    layer.done.record(stream)


def copy_bytes(layer: LayerTransfer, whole: bool) -> int:
    return layer.nbytes + (sum(t.nbytes for t in layer.routed) if whole else 0)


def copy_pairs(layer: LayerTransfer, whole: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # (slot, host) of every tensor a copy brings (one byte range where they lie so): the routed ones only when whole.
    pairs = [layer.span] if layer.span is not None else list(zip(layer.device, layer.host, strict=True))
    if whole:
        pairs += [(tensor.device, tensor.host) for tensor in layer.routed]
    return pairs


def copy_all(
    layer: LayerTransfer,
    non_blocking: bool,
    captured_on: torch.cuda.Stream | None = None,
    whole: bool = True,
    links: SharedLinks | None = None,
    slot_free: torch.cuda.Event | None = None,
) -> None:
    if layer.reads is not None:  # [Note: weights read from files] in read_ahead.py
        _copy_read(layer, non_blocking, captured_on)
        return
    pairs = copy_pairs(layer, whole)
    if links is not None:  # the helper GPUs' shares are issued; the execution device copies the rest
        pairs = links.copy(pairs, non_blocking, slot_free)
    if captured_on is not None:
        for dst, src in pairs:
            captured_copy(dst, src, captured_on)
        return
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)


def _copy_read(layer: LayerTransfer, non_blocking: bool, captured_on: torch.cuda.Stream | None) -> None:
    # From the staging buffer its read filled, on the current stream; the buffer is read into again once this landed.
    if captured_on is not None:
        raise RuntimeError(CAPTURE_REFUSED.format(layers="(a ring's)"))
    begin = time.perf_counter()
    sources = layer.reads.sources(layer.read_index)
    layer.counters.read_wait_seconds += time.perf_counter() - begin
    layer.counters.read_bytes += layer.nbytes
    for dst, src in zip(layer.device, sources, strict=True):
        dst.view(-1).view(torch.uint8).copy_(src, non_blocking=non_blocking)
    landed = torch.cuda.Event() if layer.device and layer.device[0].is_cuda else None
    if landed is not None:
        landed.record()
    layer.reads.copied(layer.read_index, landed)
