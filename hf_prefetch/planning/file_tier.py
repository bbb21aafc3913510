"""The streamed layers that stay in the checkpoint's files (`Placement.READ`): where a host budget cannot pin every
streamed layer, the layers it cannot hold are read from their files before each copy (runtime/read_ahead.py). Pure:
the budget and the checkpoint's layout come in as numbers and a predicate.

A layer can stay in its files when each of its offloaded parameters is one checkpoint tensor stored as the model
holds it (the same dtype and bytes, dense, at an offset aligned to its element size: `stored_as_is`), it has no
routed experts (rows are gathered from pinned memory) and nothing compressed (its encoded bytes are new). Its ring
then gets `num_slots + 1` pinned staging buffers, each as large as its largest such layer: the slots' next copies
read from them while the next layer's read fills the spare one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ..alignment import DIRECT_IO_ALIGN_BYTES
from ..host.arena import HostArena
from .placements import LayerPlan, Placement, RingPlan, format_bytes

__all__ = [
    "READ",
    "file_eligible",
    "file_lines",
    "host_arena_bytes",
    "read_overflow",
    "staging_buffers",
    "staging_bytes",
]


def file_eligible(layer: LayerPlan, stored_as_is: Callable[[str], bool]) -> bool:
    """Whether `layer` can stay in the checkpoint's files (see the module's docstring)."""
    if not layer.streamed or layer.routed:
        return False
    return all(
        spec.placement in (Placement.STREAMED, Placement.READ)
        and spec.compressed is None
        and not spec.inner
        and stored_as_is(f"{layer.path}.{spec.name}")
        for spec in layer.offloaded
    )


def staging_buffers(ring: RingPlan) -> int:
    """How many staging buffers a ring with layers read from files gets: one per slot and a spare (0: none)."""
    return ring.num_slots + 1 if any(layer.read_from_files for layer in ring.streamed) else 0


def staging_bytes(rings: tuple[RingPlan, ...]) -> int:
    """Pinned host bytes of the staging buffers of `rings`, each as large as its ring's largest layer read from files
    with what direct I/O reads around each of its tensors (an aligned block before and after, at most)."""
    total = 0
    for ring in rings:
        layers = [layer for layer in ring.streamed if layer.read_from_files]
        largest = max(
            (layer.host_bytes + 2 * DIRECT_IO_ALIGN_BYTES * len(layer.offloaded) for layer in layers), default=0
        )
        total += staging_buffers(ring) * HostArena.bytes_for([largest])
    return total


READ = Placement.READ


def host_arena_bytes(rings: Sequence[RingPlan]) -> int:
    """The size of the host arena that holds the pinned offloaded parameters of `rings` (not those read from files),
    laid out as `HostArena` lays them out: each parameter's bytes in host memory (encoded where compressed) padded to
    `TENSOR_ALIGN_BYTES`. An arena's size is the sum of its tensors' padded sizes, so the rings' sizes add up to the
    arena of all of them."""
    specs = [p for ring in rings for layer in ring.layers for p in layer.offloaded if p.placement is not READ]
    return HostArena.bytes_for([p.host_nbytes for p in specs])


def _pinned(rings: tuple[RingPlan, ...]) -> int:
    return host_arena_bytes(rings) + staging_bytes(rings)


def read_overflow(
    rings: tuple[RingPlan, ...], host_bytes: int, stored_as_is: Callable[[str], bool]
) -> tuple[RingPlan, ...] | None:
    """`rings` with their last eligible streamed layers read from files instead of pinned, as few as make the pinned
    bytes (the host arena and the staging buffers) fit `host_bytes`; None where even every eligible layer in its
    files does not fit."""
    rings = tuple(rings)
    order = [(r, i) for r, ring in enumerate(rings) for i, layer in enumerate(ring.layers) if layer.streamed]
    for r, i in reversed(order):
        if _pinned(rings) <= host_bytes:
            return rings
        layer = rings[r].layers[i]
        if not file_eligible(layer, stored_as_is):
            continue
        params = tuple(replace(s, placement=READ) if s.placement is Placement.STREAMED else s for s in layer.params)
        layers = rings[r].layers[:i] + (replace(layer, params=params),) + rings[r].layers[i + 1 :]
        rings = rings[:r] + (replace(rings[r], layers=layers),) + rings[r + 1 :]
    return rings if _pinned(rings) <= host_bytes else None


def file_lines(plan) -> list[tuple[str, str]]:
    """`print(plan)`'s lines for the layers read from files: their bytes, the staging buffers, and with the disk's
    measured speed (`plan.read_gbps`) the read time of a forward (none without such layers)."""
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
