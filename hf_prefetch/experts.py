"""Copying routed experts' rows into a layer's slot, and the expert cache's policy ([Note: routed experts] in
engine.py, `ring.ExpertCache`).

Tensor operations on one layer's tensors, queued on the current stream; the engine decides when they run (after the
layer's wait, before its experts' forward) and orders the streams around them. Counters are the layer's own.
"""

from __future__ import annotations

import torch

from .ring import LayerTransfer

__all__ = ["copy_routed_rows", "copy_with_cache", "load_cache", "forget_cache"]


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


def copy_with_cache(layer: LayerTransfer, index: torch.Tensor, non_blocking: bool) -> None:
    """With an expert cache: the distinct experts picked are read on the host (a synchronisation); cached ones are
    copied from the cache's rows, the others from host memory. Then the policy's bookkeeping and, every
    `ExpertCache.REFRESH` forwards, its re-ranking. The layer's routed tensors share one experts module (the planner
    gives a cache to no other layer)."""
    cache = layer.cache
    num_experts = layer.routed[0].num_experts
    if not cache.valid:
        load_cache(layer, cache.experts, non_blocking)
    picked = sorted(set(index.reshape(-1).clamp(0, num_experts - 1).tolist()))
    row_of = cache.row_of
    hits = [e for e in picked if e in row_of]
    misses = [e for e in picked if e not in row_of]
    device = layer.routed[0].device.device
    if hits:
        experts = torch.tensor(hits, device=device)
        rows = torch.tensor([row_of[e] for e in hits], device=device)
        for tensor, cached in zip(layer.routed, cache.tensors, strict=True):
            tensor.device.index_copy_(0, experts, cached.index_select(0, rows))
    if misses:
        experts = torch.tensor(misses, device=layer.routed[0].source.device)
        for tensor in layer.routed:
            tensor.device_rows.index_copy_(
                0, experts.to(device), tensor.source_rows.index_select(0, experts).to(device)
            )
            nbytes = len(misses) * (tensor.nbytes // tensor.num_experts)
            layer.counters.routed_bytes += nbytes
            layer.counters.copied_bytes += nbytes
    layer.counters.routed_rows += len(misses)
    layer.counters.cache_hits += len(hits)
    layer.counters.cache_misses += len(misses)
    for expert in picked:
        cache.picks[expert] += 1
    cache.forwards += 1
    if cache.forwards % cache.REFRESH == 0:
        ranked = _reranked(cache.experts, cache.picks)
        if ranked != cache.experts:
            load_cache(layer, ranked, non_blocking)


def _reranked(current: list[int], picks: list[int]) -> list[int]:
    # The experts picked in the most forwards (ties: the lower index); rows whose expert stays keep it.
    wanted = set(sorted(range(len(picks)), key=lambda e: (-picks[e], e))[: len(current)])
    incoming = iter(sorted(wanted - set(current), key=lambda e: (-picks[e], e)))
    return [e if e in wanted else next(incoming) for e in current]


def load_cache(layer: LayerTransfer, experts: list[int], non_blocking: bool) -> None:
    """Rows whose expert changes (all of them when the cache is not valid) get the host's values, on the current
    stream: after the kernels that read the old rows, before those that read the new ones. Invalid until every row
    holds its expert: an interrupt half-way leaves a cache that reloads, never rows that hold other experts than
    `experts` says."""
    cache = layer.cache
    changed = [row for row, expert in enumerate(experts) if not cache.valid or cache.experts[row] != expert]
    cache.valid = False
    for row in changed:
        for tensor, cached in zip(layer.routed, cache.tensors, strict=True):
            cached[row].copy_(tensor.host[experts[row]], non_blocking=non_blocking)
            layer.counters.copied_bytes += tensor.nbytes // tensor.num_experts
            layer.counters.cache_loaded_bytes += tensor.nbytes // tensor.num_experts
    cache.experts = list(experts)
    cache.valid = True


def forget_cache(layer: LayerTransfer) -> None:
    """Host storage of the layer was (or is about to be) rewritten: the cache's rows may be older."""
    if layer.cache is not None:
        layer.cache.valid = False
