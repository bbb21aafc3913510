"""The streamed parameters that stay in the checkpoint's files: where a host budget cannot pin every streamed layer,
the layers it cannot hold are read from their files before each copy (`Placement.READ`, runtime/read_ahead.py), and
the routed experts of a mixture-of-experts layer as its router picks them (`Placement.READ_ROUTED`,
runtime/file_experts.py). Pure: the budget and the checkpoint's layout come in as numbers and predicates (`Stored`).

A layer can stay in its files (READ) when each of its offloaded parameters is one checkpoint tensor stored as the model
holds it (the same dtype and bytes, dense, at an offset aligned to its element size: `Stored.as_is`) and it has no
routed experts; with `compress=True` such a layer is read plain (encoded bytes are made at load, not stored). Its ring
then gets `num_slots + 1` pinned staging buffers, each as large as its largest such layer: the slots' next copies read
from them while the next layer's read fills the spare one.

A layer's routed experts can stay in their files (READ_ROUTED) when the layer takes turns in a slot, its routed tensors
belong to one experts module, and each expert's rows of each are stored as the model holds them, in one or more
pieces (`Stored.row_pieces`: a fused tensor stored whole, or experts stored one by one), whatever their dtype (MXFP4
blocks and scales too: the experts' forward reads only the picked rows). Its other offloaded
parameters stay pinned. The ring's host expert cache holds at least one token's picks of any such layer; what the host
budget leaves once everything else is pinned goes to it, one buffer per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..alignment import DIRECT_IO_ALIGN_BYTES, round_up
from ..host.arena import HostArena
from .placements import LayerPlan, Placement, RingPlan, Storage, format_bytes, picked_bytes

__all__ = [
    "READ",
    "READ_ROUTED",
    "Stored",
    "file_eligible",
    "experts_eligible",
    "file_lines",
    "host_arena_bytes",
    "pinned_bytes",
    "read_overflow",
    "staging_buffers",
    "staging_bytes",
    "staging_buffer_bytes",
    "expert_cache_bytes",
    "fewest_pinned",
]

READ = Placement.READ
READ_ROUTED = Placement.READ_ROUTED


@dataclass(frozen=True)
class Stored:
    """How the checkpoint stores each parameter (by full name), for the loaders' plans: `as_is`, whether it is one
    checkpoint tensor stored as the model holds it; `row_pieces`, in how many file extents each expert's row (its
    slice along dimension 0) is stored as the model holds it (1 for a tensor stored whole as is, 0: not so stored)."""

    as_is: Callable[[str], bool]
    row_pieces: Callable[[str], int]


def file_eligible(layer: LayerPlan, stored: Stored) -> bool:
    """Whether `layer` can stay in the checkpoint's files whole (READ; see the module's docstring)."""
    if not layer.streamed or layer.routed:
        return False
    return all(  # a compressed one is read plain: its encoded bytes are made at load, not in the files
        spec.placement in (Placement.STREAMED, READ) and not spec.inner and stored.as_is(f"{layer.path}.{spec.name}")
        for spec in layer.offloaded
    )


def experts_eligible(layer: LayerPlan, stored: Stored) -> bool:
    """Whether `layer`'s routed experts can stay in the checkpoint's files (READ_ROUTED; see the module docstring)."""
    if not layer.routed or layer.owns_slot or len({spec.routing.module for spec in layer.routed}) != 1:
        return False
    return all(  # any dtype: a routed tensor's module reads only the picked rows ([Note: routed experts])
        spec.compressed is None
        and not spec.inner
        and stored.row_pieces(f"{layer.path}.{spec.name}") > 0
        for spec in layer.routed
    )


def staging_buffers(ring: RingPlan) -> int:
    """How many staging buffers a ring with layers read from files gets: one per slot and a spare (0: none)."""
    return ring.num_slots + 1 if any(layer.read_from_files for layer in ring.streamed) else 0


def _read_size(nbytes: int, extents: int) -> int:
    # What direct I/O reads of `extents` extents of `nbytes` in all, at most: an aligned block before and after each
    # (diskio.plan_windows reads no block between them that none needs).
    return round_up(nbytes + 2 * DIRECT_IO_ALIGN_BYTES * extents, DIRECT_IO_ALIGN_BYTES)


def staging_buffer_bytes(ring: RingPlan) -> int:
    """The bytes of each of `ring`'s staging buffers: its largest layer read from files as direct I/O reads it."""
    layers = [layer for layer in ring.streamed if layer.read_from_files]
    return max((_read_size(layer.host_bytes, len(layer.offloaded)) for layer in layers), default=0)


def staging_bytes(rings: tuple[RingPlan, ...]) -> int:
    """Pinned host bytes of the staging buffers of `rings` (`staging_buffer_bytes` each)."""
    return sum(staging_buffers(ring) * HostArena.bytes_for([staging_buffer_bytes(ring)]) for ring in rings)


def expert_cache_bytes(rings: tuple[RingPlan, ...]) -> int:
    """Pinned host bytes of the rings' host expert caches."""
    return sum(HostArena.bytes_for([r.expert_buffer_bytes] * r.host_cached_experts) for r in rings)


def host_arena_bytes(rings: Sequence[RingPlan]) -> int:
    """The size of the host arena that holds the pinned offloaded parameters of `rings` (not those read from files),
    laid out as `HostArena` lays them out: each parameter's bytes in host memory (encoded where compressed) padded to
    `TENSOR_ALIGN_BYTES`. An arena's size is the sum of its tensors' padded sizes, so the rings' sizes add up to the
    arena of all of them."""
    specs = [
        p
        for ring in rings
        for layer in ring.layers
        for p in layer.offloaded
        if p.placement.storage is not Storage.FILE
    ]
    return HostArena.bytes_for([p.host_nbytes for p in specs])


def pinned_bytes(rings: tuple[RingPlan, ...]) -> int:
    """Pinned host memory of `rings`: the host arena, the staging buffers and the host expert caches."""
    return host_arena_bytes(rings) + staging_bytes(rings) + expert_cache_bytes(rings)


def read_overflow(rings: tuple[RingPlan, ...], host_bytes: int, stored: Stored) -> tuple[RingPlan, ...] | None:
    """`rings` with their last eligible streamed layers (or their routed experts) read from files instead of pinned,
    as few as make the pinned bytes fit `host_bytes`, the host expert caches given what is left; None where even every
    eligible layer in its files does not fit."""
    rings = _overflowed(tuple(rings), host_bytes, stored)
    if pinned_bytes(rings) > host_bytes:
        return None
    for r, ring in enumerate(rings):  # what the budget leaves, to each ring's cache in turn
        if ring.host_cached_experts:
            total = sum(
                s.routing.num_experts for layer in ring.layers if layer.experts_from_files for s in layer.routed[:1]
            )
            spare = (host_bytes - pinned_bytes(rings)) // HostArena.bytes_for([ring.expert_buffer_bytes])
            more = max(0, min(total - ring.host_cached_experts, spare))
            rings = rings[:r] + (replace(ring, host_cached_experts=ring.host_cached_experts + more),) + rings[r + 1 :]
    return rings


def fewest_pinned(rings: tuple[RingPlan, ...], stored: Stored) -> int:
    """The least host budget `read_overflow` accepts for `rings`: the fewest pinned bytes of its steps (one more of
    the last eligible streamed layers, or their routed experts, read from files each), the host expert caches their
    smallest."""
    seen: list[int] = []
    _overflowed(tuple(rings), -1, stored, seen)
    return min(seen)


def _overflowed(
    rings: tuple[RingPlan, ...], host_bytes: int, stored: Stored, seen: list[int] | None = None
) -> tuple[RingPlan, ...]:
    # `rings` with their last eligible streamed layers (or routed experts) read from files, until the pinned bytes fit
    # `host_bytes` or none is left; the host expert caches their smallest. `seen` gets each step's pinned bytes.
    order = [(r, i) for r, ring in enumerate(rings) for i, layer in enumerate(ring.layers) if layer.streamed]
    for r, i in reversed(order):
        pinned = pinned_bytes(rings)
        if seen is not None:
            seen.append(pinned)
        if pinned <= host_bytes:
            break
        layer = rings[r].layers[i]
        if file_eligible(layer, stored):
            params = tuple(
                replace(s, placement=READ, compressed=None) if s.placement is Placement.STREAMED else s
                for s in layer.params
            )
        elif experts_eligible(layer, stored):
            routed = {id(spec) for spec in layer.routed}
            params = tuple(replace(s, placement=READ_ROUTED) if id(s) in routed else s for s in layer.params)
        else:
            continue
        layers = rings[r].layers[:i] + (replace(layer, params=params),) + rings[r].layers[i + 1 :]
        rings = rings[:r] + (replace(rings[r], layers=layers),) + rings[r + 1 :]
        rings = tuple(_with_expert_cache(ring, stored) for ring in rings)
    if seen is not None:
        seen.append(pinned_bytes(rings))
    return rings


def _with_expert_cache(ring: RingPlan, stored: Stored) -> RingPlan:
    # The smallest host expert cache of `ring`: one token's picks of any layer whose experts are read from files, in
    # buffers as large as one expert's rows of its largest such layer as direct I/O reads them.
    layers = [layer for layer in ring.layers if layer.experts_from_files]
    if not layers:
        return replace(ring, host_cached_experts=0, expert_buffer_bytes=0)
    picks = max(
        min(spec.routing.top_k or spec.routing.num_experts, spec.routing.num_experts)
        for layer in layers
        for spec in layer.routed
    )
    largest = max(
        _read_size(
            sum(s.nbytes // s.routing.num_experts for s in layer.routed),
            sum(stored.row_pieces(f"{layer.path}.{s.name}") for s in layer.routed),
        )
        for layer in layers
    )
    return replace(ring, host_cached_experts=picks, expert_buffer_bytes=largest)


def file_lines(plan) -> list[tuple[str, str]]:
    """`print(plan)`'s lines for the layers read from files: their bytes, the staging buffers, and with the disk's
    measured speed (`plan.read_gbps`) the read time of a forward (none without such layers)."""
    return _layer_lines(plan) + _expert_lines(plan)


def _expert_lines(plan) -> list[tuple[str, str]]:
    layers = [layer for ring in plan.rings for layer in ring.streamed if layer.experts_from_files]
    if not layers:
        return []
    size = format_bytes
    total = sum(spec.nbytes for layer in layers for spec in layer.routed)
    experts = sum(layer.routed[0].routing.num_experts for layer in layers)
    cached = sum(ring.host_cached_experts for ring in plan.rings)
    per_token = sum(picked_bytes(spec) for layer in layers for spec in layer.routed)
    missed = per_token * max(0.0, 1 - cached / experts)
    pinned = size(expert_cache_bytes(plan.rings))
    line = (
        f"{len(layers)} layers' routed experts, {size(total)}, read from the checkpoint's files as their routers pick "
        f"them, through a host expert cache of {cached} of their {experts} experts ({pinned} pinned); a token's "
        f"picks: {size(per_token)}, {size(int(missed))} of them read from files where picks are uniform"
    )
    if plan.read_gbps:
        line += f" ({missed / plan.read_gbps / 1e9:.3f} s at the disk's {plan.read_gbps:.2f} GB/s, measured)"
    return [("experts from files", line)]


def _layer_lines(plan) -> list[tuple[str, str]]:
    layers = [layer for ring in plan.rings for layer in ring.streamed if layer.read_from_files]
    if not layers:
        return []
    size, total = format_bytes, sum(layer.host_bytes for layer in layers)
    buffers = "/".join(str(staging_buffers(ring)) for ring in plan.rings)
    line = (
        f"{len(layers)} layers, {size(total)} read from the checkpoint's files for each copy, into {buffers} pinned "
        f"staging buffers ({size(staging_bytes(plan.rings))})"
    )
    if plan.read_gbps:
        line += f"; at the disk's {plan.read_gbps:.2f} GB/s (measured): {total / plan.read_gbps / 1e9:.3f} s a forward"
    return [("read from files", line)]
