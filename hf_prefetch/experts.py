"""Copying routed experts' rows into a layer's slot, and the expert cache: its lookup, its counts and its policy
([Note: routed experts] in engine.py, `ring.ExpertCache`).

Tensor operations on one layer's tensors, queued on the current stream; the engine decides when they run (after the
layer's wait, before its experts' forward; a cache's re-rank before a forward) and orders the streams around them.
Nothing here synchronises with the host except `refresh_caches` and `collect_tallies`, which read the device's counts.
"""

from __future__ import annotations

import functools

import torch

from .ring import ExpertCache, LayerTransfer

__all__ = [
    "ExpertCaches",
    "copy_routed_rows",
    "gather_with_cache",
    "count_picks",
    "refresh_caches",
    "collect_tallies",
    "forget_cache",
    "gather_kernel",
]


def copy_routed_rows(layer: LayerTransfer, index: torch.Tensor) -> None:
    """The rows of every expert `index` names (a repeated pick is copied again), from host memory into the slot, with
    no host synchronisation and shapes fixed by `index`."""
    flat = index.reshape(-1)
    rows_by_kind: dict[tuple[torch.device, int], torch.Tensor] = {}
    for tensor in layer.routed:
        key = (tensor.source.device, tensor.num_experts)
        if key not in rows_by_kind:
            # Out-of-range entries (an expert-parallel sentinel) read no weights in the forward: any row will do.
            rows_by_kind[key] = flat.to(device=key[0], dtype=torch.long).clamp(0, key[1] - 1)
        rows = rows_by_kind[key]
        tensor.device_rows.index_copy_(0, rows, tensor.source_rows.index_select(0, rows))
        nbytes = rows.numel() * (tensor.nbytes // tensor.num_experts)
        layer.counters.routed_bytes += nbytes
        layer.counters.copied_bytes += nbytes
    layer.counters.routed_rows += flat.numel()


def _picked(cache: ExpertCache, index: torch.Tensor) -> torch.Tensor:
    # The router's choice as experts of this layer, on the cache's device (out-of-range entries: any expert will do).
    return index.reshape(-1).to(device=cache.slot_of.device, dtype=torch.long).clamp(0, cache.slot_of.numel() - 1)


def gather_with_cache(layer: LayerTransfer, index: torch.Tensor) -> None:
    """The rows of every expert `index` names, copied into the slot from the layer's cache where `slot_of` says it
    holds them and from host memory otherwise, looked up on the device: no host synchronisation, shapes fixed by
    `index`, so a CUDA graph records it and each replay looks up its own picks. Counts each pick (`picks`) and
    whether it was found (`tallies`) on the device. On CUDA one Triton kernel per routed tensor reads each row from
    one place; without Triton (and on the CPU) torch operations read every pick from host memory and keep the
    cache's rows where it holds them (the same values, no bytes saved)."""
    cache = layer.cache
    experts = _picked(cache, index)
    kernel = gather_kernel() if experts.is_cuda else None
    if kernel is None:
        slots = cache.slot_of.index_select(0, experts)
        found = slots >= 0
        for tensor, rows in zip(layer.routed, cache.rows, strict=True):
            values = tensor.source_rows.index_select(0, experts.to(tensor.source.device)).to(rows.device)
            cached = rows.index_select(0, slots.clamp(min=0))
            tensor.device_rows.index_copy_(0, experts, torch.where(found[:, None], cached, values))
        _count(cache, experts)
        hits = found.sum()
        cache.tallies.add_(torch.stack([hits, found.numel() - hits]))
        return
    for number, (tensor, rows) in enumerate(zip(layer.routed, cache.rows, strict=True)):
        kernel(
            experts,
            cache.slot_of,
            tensor.source_rows,
            rows,
            tensor.device_rows,
            cache.picks,
            cache.tallies,
            count=number == 0,
        )


def count_picks(layer: LayerTransfer, index: torch.Tensor) -> None:
    """A forward that does not gather (a whole one): its picks still count for the cache's next re-rank."""
    _count(layer.cache, _picked(layer.cache, index))


def _count(cache: ExpertCache, experts: torch.Tensor) -> None:
    cache.picks.index_add_(0, experts, torch.ones_like(experts))


class ExpertCaches:
    """The expert caches of one engine's layers: when they are loaded and re-ranked, and their counts."""

    def __init__(self, layers: list[LayerTransfer]) -> None:
        self.layers = [layer for layer in layers if layer.cache is not None]
        self._routing_forwards = 0  # since the last re-rank

    def before_routing_forward(self, non_blocking: bool) -> None:
        """Load caches that are not valid, and every `ExpertCache.REFRESH` routing forwards re-rank them all."""
        if not self.layers:
            return
        self._routing_forwards += 1
        if self._routing_forwards >= ExpertCache.REFRESH or not all(layer.cache.valid for layer in self.layers):
            self._routing_forwards = 0
            refresh_caches(self.layers, non_blocking)

    def collect(self) -> None:
        """Fold the device's hit and miss counts into the layers' counters."""
        if self.layers:
            collect_tallies(self.layers)


def refresh_caches(layers: list[LayerTransfer], non_blocking: bool) -> None:
    """Re-rank the caches of `layers` (each has one) by their picks since the last re-rank (the policy in
    `ring.ExpertCache`) and load the rows whose expert changes, on the current stream. Reads every layer's picks in one
    host synchronisation."""
    counts = torch.cat([layer.cache.picks for layer in layers]).tolist()  # the synchronisation
    start = 0
    for layer in layers:
        cache = layer.cache
        picks, start = counts[start : start + len(cache.scores)], start + len(cache.scores)
        cache.picks.zero_()
        cache.scores = [score / 2 + count for score, count in zip(cache.scores, picks, strict=True)]
        load_cache(layer, _reranked(cache), non_blocking)


def _reranked(cache: ExpertCache) -> list[int]:
    # The experts each row should hold. Not valid: the best-scored (ties: the lower index). Valid: the best outsiders
    # take the worst rows while each scores more than MARGIN times the expert it replaces.
    scores = cache.scores
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    if not cache.valid:
        return order[: cache.capacity]
    experts = list(cache.experts)
    held = set(experts)
    outsiders = [e for e in order if e not in held]
    weakest = sorted(range(cache.capacity), key=lambda row: (scores[experts[row]], -experts[row]))
    for row, incoming in zip(weakest, outsiders, strict=False):
        if scores[incoming] <= cache.MARGIN * scores[experts[row]]:
            break
        experts[row] = incoming
    return experts


def load_cache(layer: LayerTransfer, experts: list[int], non_blocking: bool) -> None:
    """Make row i of the cache hold expert `experts[i]`, on the current stream: first the lookup forgets the rows
    that change, then they get the host's values, then the lookup finds them. Invalid until every row holds its
    expert: an interrupt half-way leaves rows the lookup does not find and a cache that reloads, never a row found
    for an expert it does not hold."""
    cache = layer.cache
    changed = [row for row, expert in enumerate(experts) if not cache.valid or cache.experts[row] != expert]
    if not changed:
        return
    cache.valid = False
    kept = [-1] * cache.slot_of.numel()
    for row in set(range(len(experts))) - set(changed):
        kept[experts[row]] = row
    cache.slot_of.copy_(torch.tensor(kept))
    for row in changed:
        for tensor, cached in zip(layer.routed, cache.tensors, strict=True):
            cached[row].copy_(tensor.host[experts[row]], non_blocking=non_blocking)
            layer.counters.copied_bytes += tensor.nbytes // tensor.num_experts
            layer.counters.cache_loaded_bytes += tensor.nbytes // tensor.num_experts
    for row in changed:
        kept[experts[row]] = row
    cache.slot_of.copy_(torch.tensor(kept))
    cache.experts = list(experts)
    cache.valid = True


def collect_tallies(layers: list[LayerTransfer]) -> None:
    """Fold the device's hit and miss counts of the caches of `layers` (each has one) into the layers' counters (one
    host synchronisation); a miss is a routed row read from host memory."""
    tallies = torch.stack([layer.cache.tallies for layer in layers]).tolist()  # the synchronisation
    for layer, (hits, misses) in zip(layers, tallies, strict=True):
        layer.cache.tallies.zero_()
        row_bytes = sum(tensor.nbytes // tensor.num_experts for tensor in layer.routed)
        layer.counters.cache_hits += hits
        layer.counters.cache_misses += misses
        layer.counters.routed_rows += misses
        layer.counters.routed_bytes += misses * row_bytes
        layer.counters.copied_bytes += misses * row_bytes


def forget_cache(layer: LayerTransfer) -> None:
    """Host storage of the layer was (or is about to be) rewritten: the cache's rows may be older. The lookup stops
    finding them at once (queued on the current stream) and the next re-rank loads them again."""
    if layer.cache is not None:
        layer.cache.valid = False
        layer.cache.slot_of.fill_(-1)


@functools.cache
def gather_kernel():
    """The cached gather as one Triton kernel per routed tensor, or None where Triton is missing. Built on first use,
    so that importing hf_prefetch imports no Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather_rows(
        experts, slot_of, source, cache, out, picks, tallies, row_len, COUNT: tl.constexpr, BLOCK: tl.constexpr
    ):
        # Program (block, pick): one BLOCK of one picked expert's row, read from its cache row if it has one, else
        # from the host (through the mapped view). The first block of each pick counts it.
        block = tl.program_id(0)
        pick = tl.program_id(1)
        expert = tl.load(experts + pick)
        slot = tl.load(slot_of + expert)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < row_len
        if slot >= 0:
            values = tl.load(cache + slot * row_len + offsets, mask=inside)
        else:
            values = tl.load(source + expert * row_len + offsets, mask=inside)
        tl.store(out + expert * row_len + offsets, values, mask=inside)
        if COUNT:
            if block == 0:
                tl.atomic_add(picks + expert, 1)
                tl.atomic_add(tallies + (slot < 0).to(tl.int32), 1)

    block = 2048

    def launch(experts, slot_of, source, cache, out, picks, tallies, count):
        row_len = out.shape[1]
        grid = (triton.cdiv(row_len, block), experts.numel())
        gather_rows[grid](
            experts, slot_of, source, cache, out, picks, tallies, row_len, COUNT=count, BLOCK=block, num_warps=8
        )

    return launch
