"""Copying routed experts' rows into a layer's slot: at the router, and ahead of it (the experts the layer picked in
its previous forward); and the expert cache: its lookup, its counts and its policy ([Note: routed experts] in
routed.py, `ring.ExpertCache`, `ring.RecentPicks`).

Tensor operations on one layer's tensors, queued on the current stream; the engine decides when they run (after the
layer's wait, before its experts' forward; with a routing copy, on the copy stream; a cache's re-rank before a
forward) and orders the streams around them. Nothing here synchronises with the host except `refresh_caches` and
`collect_tallies`, which read the device's counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import warn_at_caller
from ..planning.placements import caches_experts
from .expert_kernels import (
    CANDIDATE_HITS,
    CANDIDATES,
    FETCHED,
    FOUND_CACHED,
    FOUND_RECENT,
    FROM_HOST,
    TALLIES,
    fetch_kernel,
    gather_kernel,
)
from .expert_policy import WINDOW, RecentPolicy
from .ring import ExpertCache, LayerTransfer, RecentPicks, RoutedTensor

if TYPE_CHECKING:
    from ..planning.offload_plan import OffloadPlan
    from ..planning.placements import LayerPlan

__all__ = [
    "add_lookups",
    "ExpertCaches",
    "copy_routed_rows",
    "gather_looked_up",
    "fetch_recent",
    "remember_picks",
    "count_picks",
    "refresh_caches",
    "collect_tallies",
    "forget_cache",
]


def add_lookups(transfer: LayerTransfer, layer: LayerPlan, plan: OffloadPlan, device: torch.device) -> None:
    """What a routing forward looks up on the device for a layer whose slot takes turns and whose routed tensors
    belong to one experts module (`caches_experts`; one module's picks name no other's experts): its expert cache, and
    the experts it picked in its latest forward, fetched with its copy. Fetching ahead reads rows through the mapped
    view from the copy stream: on CUDA only with its Triton kernel. On CUDA with Triton every such layer's gather is
    that kernel's (`gather_looked_up`, counted in `tallies`), with neither a cache nor recent picks too: one pass
    over the picked rows, where torch's ops read them into a temporary and copy that into the slot."""
    if not caches_experts(layer):
        return
    transfer.cache = _expert_cache(transfer.routed, plan.cached_experts, device)
    num_experts = transfer.routed[0].num_experts
    fetches = device.type != "cuda" or fetch_kernel() is not None
    recent = getattr(plan.config, "recent_experts", None)  # None: the measured policy; True: always; False: never
    if recent is not False and plan.routed_max_tokens > 0 and fetches:
        transfer.recent = RecentPicks(
            experts=torch.full((num_experts,), -1, dtype=torch.long, device=device),
            ready=torch.zeros(num_experts, dtype=torch.int32, device=device),
            chosen=torch.full((num_experts,), -1, dtype=torch.long, device=device),
            marked=torch.zeros(num_experts, dtype=torch.int32, device=device),
            enabled=torch.full((1,), int(recent is True), dtype=torch.int32, device=device),
            policy=RecentPolicy(fixed=recent is True, on=recent is True),
        )
    one_pass = device.type == "cuda" and gather_kernel() is not None
    if transfer.cache is not None or transfer.recent is not None or one_pass:
        transfer.tallies = torch.zeros(TALLIES, dtype=torch.long, device=device)


def _expert_cache(routed: list[RoutedTensor], cached_experts: int, device: torch.device) -> ExpertCache | None:
    # As many rows as the plan counted (`placements.caches_experts`, `_cached_rows_bytes`).
    if cached_experts <= 0:
        return None
    if device.type == "cuda" and gather_kernel() is None:
        warn_at_caller(
            "The expert cache reads every pick from host memory: its lookup kernel needs Triton, "
            "which is not installed (`pip install triton`). Results are the same; set expert_cache=0 to save its "
            "memory."
        )
    num_experts = routed[0].num_experts
    capacity = min(cached_experts, num_experts)
    tensors = [torch.empty((capacity, *t.host.shape[1:]), dtype=t.host.dtype, device=device) for t in routed]
    # Rows viewed as the slot's rows are (`RoutedTensor.device_rows`), so that a gather reads either alike.
    rows = [t.view(capacity, -1).view(r.device_rows.dtype) for t, r in zip(tensors, routed, strict=True)]
    return ExpertCache(
        tensors,
        rows,
        slot_of=torch.full((num_experts,), -1, dtype=torch.long, device=device),
        picks=torch.zeros(num_experts, dtype=torch.long, device=device),
        experts=list(range(capacity)),
        scores=[0.0] * num_experts,
    )


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
    layer.counters.routed_picks += flat.numel()


def _picked(layer: LayerTransfer, index: torch.Tensor) -> torch.Tensor:
    # The router's choice as experts of this layer, on the slot's device (out-of-range entries: any expert will do).
    num_experts = layer.routed[0].num_experts
    return index.reshape(-1).to(device=layer.tallies.device, dtype=torch.long).clamp(0, num_experts - 1)


def gather_looked_up(layer: LayerTransfer, index: torch.Tensor) -> None:
    """The rows of every expert `index` names, for a layer with `tallies` (an expert cache, recent picks, or on CUDA
    the Triton gather):
    nothing for a pick already in the slot (`recent.ready`), from the cache's row where `slot_of` says it holds it,
    from host memory otherwise. Looked up on the device: no host synchronisation, shapes fixed by `index`, so a CUDA
    graph records it and each replay looks up its own picks. Counts each pick (`cache.picks`) and where it was found
    (`tallies`) on the device. On CUDA one Triton kernel per routed tensor reads each row from one place; without
    Triton (and on the CPU) torch operations read every pick that is not in the slot from host memory and keep the
    cache's rows where it holds them (the same values, no bytes saved)."""
    cache, recent = layer.cache, layer.recent
    experts = _picked(layer, index)
    kernel = gather_kernel() if experts.is_cuda else None
    if kernel is None:
        ready = recent.ready.index_select(0, experts) > 0 if recent is not None else torch.zeros_like(experts) > 0
        slots = cache.slot_of.index_select(0, experts) if cache is not None else torch.full_like(experts, -1)
        found = (slots >= 0) & ~ready
        for number, tensor in enumerate(layer.routed):
            values = tensor.source_rows.index_select(0, experts.to(tensor.source.device)).to(tensor.device.device)
            if cache is not None:
                values = torch.where(found[:, None], cache.rows[number].index_select(0, slots.clamp(min=0)), values)
            kept = tensor.device_rows.index_select(0, experts)
            tensor.device_rows.index_copy_(0, experts, torch.where(ready[:, None], kept, values))
        if cache is not None:
            _count(cache, experts)
        kinds = torch.where(ready, FOUND_RECENT, torch.where(found, FOUND_CACHED, FROM_HOST))
        layer.tallies.index_add_(0, kinds, torch.ones_like(kinds))
        if recent is not None:  # each marked expert counts once however many tokens pick it (marked 1 -> 2)
            picked = torch.zeros_like(recent.marked).index_fill_(0, experts, 1)
            first = (recent.marked == 1) & (picked > 0)
            layer.tallies[CANDIDATE_HITS] += first.sum()
            recent.marked.copy_(torch.where(first, 2, recent.marked))
        return
    with torch.cuda.device(experts.device):  # Triton launches on the current device's current stream
        for number, tensor in enumerate(layer.routed):
            kernel(
                experts,
                recent.ready if recent is not None else None,
                recent.marked if recent is not None else None,
                cache.slot_of if cache is not None else None,
                tensor.source_rows,
                cache.rows[number] if cache is not None else None,
                tensor.device_rows,
                cache.picks if cache is not None else None,
                layer.tallies,
                count=number == 0,
            )


def fetch_recent(layer: LayerTransfer, tokens: int | None = None) -> None:
    """With a copy of the layer without its routed tensors (`Fill.ROUTED`), on the same stream: mark the experts its
    router picked in its latest forward (`recent.experts`) that its cache does not hold (`recent.marked`, counted as
    `CANDIDATES`), and where the layer's policy fetches (`recent.enabled`, on the device) copy their rows from host
    memory into the slot, each marked `ready`; every other mark cleared first. No host synchronisation. Reads as many
    entries as the latest forward run in Python recorded (`recent.count`), or as a forward of `tokens` tokens (the
    one under way) records, whichever is more: a CUDA graph replay records its picks without Python, and the graph
    of the forward under way, in a capture, is one of that many tokens. Entries past the picks are -1. Counts the rows
    in `tallies`.

    Whether the cache holds an expert is read once, before any row is copied (into `recent.chosen`): `prepare` may
    change the cache's rows on the compute stream while this runs on the copy stream, and one decision per expert
    keeps every row of every tensor and its mark together (all fetched and marked, or none: the gather then reads the
    final `slot_of`). On CUDA that is two Triton kernels for the whole layer (`fetch_kernel`): the copy stream carries
    the layer's critical path, and every launch on it is time the link waits."""
    recent = layer.recent
    num_experts = recent.ready.numel()
    entries = min(max(recent.count, (tokens or 0) * recent.top_k), num_experts)
    if entries == 0:
        recent.ready.zero_()
        recent.marked.zero_()
        return
    experts = recent.experts[:entries]
    kernel = fetch_kernel() if experts.is_cuda else None
    if kernel is None:
        take = (experts >= 0) & (experts < num_experts)
        if layer.cache is not None:
            take &= layer.cache.slot_of.index_select(0, experts.clamp(0, num_experts - 1)) < 0
        marks = torch.zeros(num_experts + 1, dtype=recent.ready.dtype, device=experts.device)
        marks.index_fill_(0, torch.where(take, experts, num_experts), 1)  # a repeated pick marks once
        recent.marked.copy_(marks[:num_experts])
        layer.tallies[CANDIDATES] += recent.marked.sum()
        fetched = recent.marked * recent.enabled
        wanted = fetched > 0
        for tensor in layer.routed:
            values = tensor.source_rows.to(tensor.device.device)
            tensor.device_rows.copy_(torch.where(wanted[:, None], values, tensor.device_rows))
        recent.ready.copy_(fetched)
        layer.tallies[FETCHED] += fetched.sum()  # each expert once, as on CUDA
        return
    slot_of = layer.cache.slot_of if layer.cache is not None else None
    pairs = [(tensor.source_rows, tensor.device_rows) for tensor in layer.routed]
    with torch.cuda.device(experts.device):  # Triton launches on the current device's current stream
        kernel(experts, slot_of, recent.chosen, recent.ready, recent.marked, recent.enabled, pairs, layer.tallies)


def remember_picks(layer: LayerTransfer, index: torch.Tensor, routing: bool) -> None:
    """After the router of a layer with recent picks, on the compute stream: its picks (a whole forward's: its last
    token's), for its next copy to fetch. Capped at one entry per expert (the latest tokens')."""
    recent = layer.recent
    if routing or index.dim() < 2:
        flat = index.reshape(-1)
    else:
        flat = index.reshape(-1, index.shape[-1])[-1]
    flat = flat[-recent.experts.numel() :]
    recent.experts[: flat.numel()].copy_(flat)
    recent.experts[flat.numel() :].fill_(-1)
    recent.count = flat.numel()
    recent.top_k = index.shape[-1] if index.dim() >= 2 else 1


def count_picks(layer: LayerTransfer, index: torch.Tensor) -> None:
    """A forward that does not gather (a whole one): its picks still count for the cache's next re-rank."""
    _count(layer.cache, _picked(layer, index))


def _count(cache: ExpertCache, experts: torch.Tensor) -> None:
    cache.picks.index_add_(0, experts, torch.ones_like(experts))


class ExpertCaches:
    """The expert caches and recent-pick policies of one engine's layers: when caches are loaded and re-ranked and
    policies decide; and the device's counts of every layer with a cache or recent picks."""

    def __init__(self, layers: list[LayerTransfer]) -> None:
        self.layers = [layer for layer in layers if layer.cache is not None]
        self.counted = [layer for layer in layers if layer.tallies is not None]
        self.deciding = [layer for layer in layers if layer.recent is not None]  # fixed ones measure too
        self._since_rerank = 0  # routing forwards since the caches' last re-rank
        self._since_decision = 0  # and since the policies' last decision

    def before_whole_forward(self) -> None:
        """A forward of many tokens (a new prompt's prefill): the picks of what came before say less of the next
        tokens', so each policy's counts so far weigh a quarter (`RecentPolicy.discount`); windows keep counting
        across prompts, so that short generations decide too."""
        for layer in self.deciding:
            layer.recent.policy.discount()

    def before_routing_forward(self, non_blocking: bool) -> None:
        """Load caches that are not valid; every `ExpertCache.REFRESH` routing forwards re-rank them all, and every
        `expert_policy.WINDOW` let each layer's recent-pick policy decide, from counts read in one synchronisation."""
        if not self.layers and not self.deciding:
            return
        self._since_rerank += 1
        self._since_decision += 1
        if self.deciding and self._since_decision >= WINDOW:
            self._since_decision = 0
            self.collect()
            for layer in self.deciding:
                layer.recent.policy.decide()
                # Written every time (not only on a change): an interrupt between a decision and its flag is undone
                # by the next decision.
                layer.recent.enabled.fill_(int(layer.recent.policy.on))
        if self.layers and (self._since_rerank >= ExpertCache.REFRESH or not all(c.cache.valid for c in self.layers)):
            self._since_rerank = 0
            refresh_caches(self.layers, non_blocking)

    def collect(self) -> None:
        """Fold the device's counts of picks and fetched rows into the layers' counters (and their policies')."""
        if self.counted:
            collect_tallies(self.counted)


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
        held_score, score = scores[experts[row]], scores[incoming]
        noise = (score + held_score) ** 0.5  # counts' standard deviation
        if score <= cache.MARGIN * held_score or score - held_score <= cache.SIGNIFICANCE * noise:
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
    """Fold the device's counts of `layers` (each has `tallies`) into their counters (one host synchronisation): each
    pick found fetched ahead, found in the cache or copied from host memory at the router, and each row fetched ahead
    (copied from host memory, picked again or not)."""
    # The device's counts only grow: the copy stream may still be adding to them (a fetch for the next forward), and
    # a count added between a read and a reset would be lost; each read takes what grew since the one before.
    tallies = torch.stack([layer.tallies for layer in layers]).tolist()  # the synchronisation
    for layer, now in zip(layers, tallies, strict=True):
        seen = layer.tallies_seen or [0] * len(now)
        counts, layer.tallies_seen = [n - s for n, s in zip(now, seen, strict=True)], now
        recent, cached, from_host, fetched = (counts[i] for i in (FOUND_RECENT, FOUND_CACHED, FROM_HOST, FETCHED))
        row_bytes = sum(tensor.nbytes // tensor.num_experts for tensor in layer.routed)
        layer.counters.recent_hits += recent
        layer.counters.routed_picks += recent + cached + from_host
        if layer.cache is not None:
            layer.counters.cache_hits += cached
            layer.counters.cache_misses += from_host
        if layer.recent is not None:
            layer.counters.recent_fetched += fetched
            layer.recent.policy.add(counts[CANDIDATES], counts[CANDIDATE_HITS], recent + from_host)
        layer.counters.routed_rows += from_host + fetched
        layer.counters.routed_bytes += (from_host + fetched) * row_bytes
        layer.counters.copied_bytes += (from_host + fetched) * row_bytes


def forget_cache(layer: LayerTransfer) -> None:
    """Host storage of the layer was (or is about to be) rewritten: the cache's rows may be older. The lookup stops
    finding them at once (queued on the current stream) and the next re-rank loads them again."""
    if layer.cache is not None:
        layer.cache.valid = False
        layer.cache.slot_of.fill_(-1)
