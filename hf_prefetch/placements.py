"""The plan's types: every parameter of the layer lists with its `Placement`, layers, rings and the `OffloadPlan`.

A placement says where a parameter lives while the model is dispatched: resident on the execution device, streamed
through a slot of its layer list's buffer pool, or mapped (read in place from pinned host memory, the UVA backend).
The plan also says where the choice came from (`Source`). New ways of placing weights are new `Placement` kinds, not
new plan types. These are frozen values: choosing them is `planner`'s job, printing them `render`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from .codec import Layout, layout_of
from .config import PrefetchConfig
from .host import padded_bytes
from .links import ALIGN_BYTES, STAGES
from .offload_config import UVAConfig

if TYPE_CHECKING:
    from .memory_budget import MemoryBudget

__all__ = ["OffloadPlan", "RingPlan", "LayerPlan", "ParamSpec", "Placement", "Routing", "Source", "PoolKey"]

PoolKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


# Separates a tensor-subclass parameter's name from one of its inner tensors' attributes in a spec's name.
INNER_SEP = ":"
# Each compressed parameter's encoded bytes start at a multiple of this in its slot's staging buffer.
STAGING_ALIGN = 256


def staged_nbytes(layout: Layout) -> int:
    """Bytes one compressed parameter takes in a staging buffer, aligned for the next one."""
    return -(-layout.nbytes // STAGING_ALIGN) * STAGING_ALIGN


def compressed_layout(spec: ParamSpec) -> Layout | None:
    """The codec layout of a streamed parameter that may be kept compressed: not routed, dense (its values in
    row-major order are its storage), not part of a tensor subclass, of a dtype and size the codec encodes with a
    saving."""
    if spec.placement is not Placement.STREAMED or spec.stride != _contiguous(spec.shape) or spec.inner:
        return None
    numel = 1
    for size in spec.shape:
        numel *= size
    return layout_of(spec.dtype, numel)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, strides = 1, []
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


# A forward of t tokens with top_k experts each copies t * top_k expert rows (repeats included) when it routes, and
# num_experts rows when it does not. The rows are read by the GPU over the bus and cannot start before the router
# ran, while whole copies run on the copy engine ahead of use. Measured on an H100 (benchmarks/moe.py, Qwen3-30B-A3B
# shape, 128 experts, 8 per token): routing was 1.72x faster at 8 tokens (64 rows) and 0.89x at 16 (128 rows), so it
# pays while t * top_k <= ROUTED_BREAK_EVEN * num_experts (see docs/design.md, "Routed experts").
ROUTED_BREAK_EVEN = 0.75


class Placement(Enum):
    """Where a parameter lives while the model is dispatched."""

    RESIDENT = "resident"  # on the execution device, for good
    STREAMED = "streamed"  # in pinned host memory, copied into a slot of its ring's buffer pool before each use
    MAPPED = "mapped"  # in pinned host memory, read in place by the kernels over the bus (UVA zero-copy)
    # An expert tensor of a mixture-of-experts layer, in pinned host memory, streamed through its ring's slots like
    # STREAMED, except that a forward with few tokens copies only the rows of the experts its router picks (see
    # [Note: routed experts] in engine.py).
    ROUTED = "routed"


@dataclass(frozen=True)
class Routing:
    """The experts module a ROUTED parameter belongs to: dimension 0 of the parameter indexes its experts, and the
    module's forward receives the router's choice (`index_arg`, shape (tokens, top_k))."""

    module: str  # path inside the layer, e.g. "mlp.experts"
    num_experts: int
    top_k: int | None  # experts per token (the model config's `num_experts_per_tok`); None where unknown
    index_arg: str  # name of the forward's argument holding the routed expert indices


class Source(Enum):
    """Where the choice of offloaded parameters came from."""

    STRIDE = "stride"  # PrefetchConfig's group pattern (group_size, num_in_group)
    BUDGET = "budget"  # the streamed layers that fit a memory budget (max_memory)
    EXPLICIT = "explicit"  # layers named by the caller (make_plan(streamed=...))
    SIZE = "size"  # UVAConfig.cpu_offload_gb: parameters in layer order until that many GiB


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layer: its name inside the layer, the exact layout of its host storage and slot buffers, and
    its placement."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    placement: Placement = Placement.RESIDENT
    routing: Routing | None = None  # the experts module of a ROUTED parameter (and of one that could be)
    # A STREAMED parameter kept losslessly compressed in host memory: where the parts of its encoded bytes lie (a
    # function of dtype and size; see codec.py). Its copy brings these bytes into its slot's staging buffer, and the
    # layer's wait decodes them into its slot buffer.
    compressed: Layout | None = None

    @property
    def inner(self) -> str | None:
        """For one inner tensor of a tensor-subclass parameter (torchao's quantized tensors: `weight:qdata`), its
        attribute on the parameter; None for a plain parameter."""
        return self.name.partition(INNER_SEP)[2] or None

    @property
    def host_nbytes(self) -> int:
        """Bytes in host memory, and bytes a copy moves: the encoded ones when compressed."""
        return self.compressed.nbytes if self.compressed is not None else self.nbytes

    @property
    def key(self) -> PoolKey:
        # The name is part of the key so that two same-shaped parameters of one layer never share a buffer.
        return (self.name, self.shape, self.stride, self.dtype)


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a layer list: every parameter with its placement, and for a streamed layer its slot.

    A streamed layer is the `position`-th streamed layer of its ring; it uses `slot`, and after it ran the copy of
    `next_in_slot` (a position) starts into that slot. A layer that is alone in its slot (`owns_slot`) is copied once
    and keeps it. See [Note: slot reuse] in hf_prefetch/ring.py.
    """

    path: str
    index: int
    params: tuple[ParamSpec, ...]
    position: int | None = None
    slot: int | None = None
    next_in_slot: int | None = None

    @property
    def offloaded(self) -> tuple[ParamSpec, ...]:
        """The parameters kept in pinned host memory (streamed or mapped), in host-arena order."""
        return tuple(p for p in self.params if p.placement is not Placement.RESIDENT)

    @property
    def streamed(self) -> bool:
        """Whether the layer goes through its ring's slots (its STREAMED or ROUTED parameters)."""
        return any(p.placement in (Placement.STREAMED, Placement.ROUTED) for p in self.params)

    @property
    def routed(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.placement is Placement.ROUTED)

    @property
    def mapped(self) -> bool:
        return any(p.placement is Placement.MAPPED for p in self.params)

    @property
    def owns_slot(self) -> bool:
        """A streamed layer that no other layer shares its slot with: copied once, never again."""
        return self.streamed and self.next_in_slot == self.position

    @property
    def offloaded_bytes(self) -> int:
        """The bytes of the offloaded parameters' values (what the device does not hold for good)."""
        return sum(p.nbytes for p in self.offloaded)

    @property
    def host_bytes(self) -> int:
        """The offloaded parameters' bytes in host memory, and what a whole copy of the layer moves."""
        return sum(p.host_nbytes for p in self.offloaded)

    @property
    def staging_bytes(self) -> int:
        """Device bytes its compressed parameters' encoded bytes take in its slot's staging buffer."""
        return sum(staged_nbytes(p.compressed) for p in self.offloaded if p.compressed is not None)

    @property
    def bytes_per_token(self) -> int:
        """What a forward of one token copies of this layer: the routed parameters' rows of `top_k` experts (all of
        them where top_k is unknown), and every other offloaded byte (encoded where compressed)."""
        total = 0
        for p in self.offloaded:
            routing = p.routing if p.placement is Placement.ROUTED else None
            if routing is not None and routing.top_k is not None:
                total += p.nbytes * min(routing.top_k, routing.num_experts) // routing.num_experts
            else:
                total += p.host_nbytes
        return total

    @property
    def resident_bytes(self) -> int:
        return sum(p.nbytes for p in self.params if p.placement is Placement.RESIDENT)


@dataclass(frozen=True)
class RingPlan:
    """The layers of one layer list (`model.layers`, or the encoder's and the decoder's of a seq2seq model).

    Each ring prefetches cyclically through its own streamed layers with its own `num_slots` buffer slots.
    """

    path: str
    layers: tuple[LayerPlan, ...]
    num_slots: int
    # Pipeline placement: the CUDA device index these layers live and compute on; None: the execution device.
    device: int | None = None

    @property
    def streamed(self) -> tuple[LayerPlan, ...]:
        """The streamed layers in forward order; a layer's `position` is its index here."""
        return tuple(layer for layer in self.layers if layer.streamed)

    @property
    def offloaded_bytes(self) -> int:
        return sum(layer.offloaded_bytes for layer in self.layers)

    @property
    def pool_bytes(self) -> int:
        """The slots' buffers, and the staging buffers of compressed layers (one per slot, for the largest)."""
        sizes: dict[PoolKey, int] = {}
        for layer in self.streamed:
            for spec in layer.offloaded:
                sizes[spec.key] = padded_bytes(spec.nbytes)  # each at an aligned offset of its slot (pool.py)
        return (sum(sizes.values()) + padded_bytes(self.staging_bytes)) * self.num_slots

    @property
    def staging_bytes(self) -> int:
        """The staging buffer of each slot, which compressed layers' encoded bytes are copied into: as large as the
        largest such layer needs (0: none)."""
        return max((layer.staging_bytes for layer in self.streamed), default=0)

    @property
    def bytes_per_forward(self) -> int:
        """What crosses the link in a forward: the streamed layers that take turns in a slot (a layer that owns its
        slot was copied once; encoded bytes where compressed), and every mapped byte (read over the bus at least
        once)."""
        return sum(layer.host_bytes for layer in self.layers if not layer.owns_slot)

    @property
    def bytes_per_token(self) -> int:
        """What crosses the link in a forward of one token (decoding at batch 1): routed parameters copy only the
        rows of the experts a token uses; layers that own their slot copy nothing."""
        return sum(layer.bytes_per_token for layer in self.layers if not layer.owns_slot)

    @property
    def longest_run(self) -> int:
        """The most consecutive streamed layers in this list (a copy hides behind the resident layers around it)."""
        longest = run = 0
        for layer in self.layers:
            run = run + 1 if layer.streamed else 0
            longest = max(longest, run)
        return longest


@dataclass(frozen=True)
class OffloadPlan:
    """What a dispatch does: every parameter's placement, the slots of streamed layers, and the bytes involved.

    `print(plan)` shows a table; Jupyter renders it as HTML. Bytes: `offloaded_bytes` live in pinned host memory,
    `pool_bytes` is the static device buffer pool, `resident_bytes` are the weights and buffers that stay on the
    execution device, `streamed_bytes_per_forward` is what crosses the link in each forward.
    """

    config: PrefetchConfig | UVAConfig
    rings: tuple[RingPlan, ...]
    resident_bytes: int
    source: Source = Source.STRIDE
    # The memory budget the streamed layers were chosen to fit (Source.BUDGET).
    budget: MemoryBudget | None = None
    # Host-to-device link speed (GB/s) for the transfer time per forward; None leaves that line out.
    link_gbps: float | None = None
    # Experts of each streamed layer's routed tensors kept on the device (capped at the layer's num_experts).
    cached_experts: int = 0
    # The CUDA devices whose host links carry the streamed bytes, the execution device's first; () for its link only.
    # Each link copies an equal share of every streamed layer (links.py, [Note: shared links]).
    links: tuple[int, ...] = ()
    # Pipeline placement (`pipeline.py`): each GPU, in layer order, with the budget its layers were planned for; the
    # first is the execution device, which also holds everything outside the layer list. () on one device.
    gpus: tuple[tuple[int, MemoryBudget], ...] = ()

    @property
    def backend(self) -> str:
        """`"prefetch"` or `"uva"`."""
        return "uva" if isinstance(self.config, UVAConfig) else "prefetch"

    @property
    def offloaded_bytes(self) -> int:
        return sum(ring.offloaded_bytes for ring in self.rings)

    @property
    def host_bytes(self) -> int:
        """Host memory of the offloaded parameters: their values, encoded where compressed."""
        return sum(layer.host_bytes for ring in self.rings for layer in ring.layers)

    @property
    def compressed_bytes(self) -> tuple[int, int]:
        """(values, encoded bytes) of the compressed parameters."""
        specs = [p for ring in self.rings for layer in ring.layers for p in layer.offloaded if p.compressed]
        return sum(p.nbytes for p in specs), sum(p.host_nbytes for p in specs)

    @property
    def pool_bytes(self) -> int:
        return sum(ring.pool_bytes for ring in self.rings)

    @property
    def streamed_bytes_per_forward(self) -> int:
        return sum(ring.bytes_per_forward for ring in self.rings)

    @property
    def routed_bytes(self) -> int:
        """Offloaded bytes of ROUTED parameters (expert tensors that copy only routed experts in small forwards)."""
        return sum(p.nbytes for ring in self.rings for layer in ring.layers for p in layer.routed)

    @property
    def streamed_bytes_per_token(self) -> int:
        """What crosses the link in a forward of one token; equals `streamed_bytes_per_forward` without ROUTED
        parameters or when no forward routes (`routed_max_tokens` 0). With an expert cache, its share of the experts
        is expected to hit (a router that picks every expert equally often)."""
        if self.routed_max_tokens == 0:
            return self.streamed_bytes_per_forward
        total = sum(ring.bytes_per_token for ring in self.rings)
        for ring in self.rings:
            for layer in ring.layers:
                if not caches_experts(layer):
                    continue
                for spec in layer.routed:
                    r = spec.routing
                    if r.top_k is not None:
                        hit = min(self.cached_experts, r.num_experts) / r.num_experts
                        total -= int(spec.nbytes * min(r.top_k, r.num_experts) // r.num_experts * hit)
        return total

    @property
    def cache_bytes(self) -> int:
        """Device bytes of the expert cache: `cached_experts` rows of every routed tensor of every streamed layer."""
        return cache_bytes(self.rings, self.cached_experts)

    @property
    def routed_max_tokens(self) -> int:
        """The most tokens a forward may have for its routed experts to be copied expert by expert (0: no routed
        parameters): the config's `routed_max_tokens`, else the smallest break-even point of the experts modules,
        `floor(ROUTED_BREAK_EVEN * num_experts / top_k)` tokens, at least 1."""
        routings = {spec.routing for ring in self.rings for layer in ring.layers for spec in layer.routed}
        if not routings:
            return 0
        if getattr(self.config, "routed_max_tokens", None) is not None:
            return self.config.routed_max_tokens
        return min(max(1, int(ROUTED_BREAK_EVEN * r.num_experts / (r.top_k or r.num_experts))) for r in routings)

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.pool_bytes + self.cache_bytes

    @property
    def longest_run(self) -> int:
        return max((ring.longest_run for ring in self.rings), default=0)

    @property
    def saves_device_memory(self) -> bool:
        """Whether the plan keeps fewer bytes on the device than the unmodified model (the pool and the expert cache
        are smaller than what it offloads)."""
        return self.pool_bytes + self.cache_bytes < self.offloaded_bytes

    def gpu_bytes(self, index: int) -> tuple[int, int]:
        """Pipeline placement: (resident bytes, pool and expert-cache bytes) on GPU `index`. The first GPU holds the
        weights outside the layer list as well."""
        first = self.gpus[0][0] if self.gpus else index
        mine = [ring for ring in self.rings if (ring.device if ring.device is not None else first) == index]
        in_rings = sum(layer.resident_bytes for ring in self.rings for layer in ring.layers)
        resident = sum(layer.resident_bytes for ring in mine for layer in ring.layers)
        if index == first:
            resident += self.resident_bytes - in_rings
        return resident, sum(ring.pool_bytes for ring in mine) + cache_bytes(tuple(mine), self.cached_experts)

    @property
    def num_links(self) -> int:
        """How many host links carry the streamed bytes (1: the execution device's own)."""
        return max(1, len(self.links))

    @property
    def staging_bytes(self) -> int:
        """Device bytes of staging buffers on each other GPU of `links` (0 without): `STAGES` buffers that each hold
        the largest share of a streamed layer."""
        if not self.links:
            return 0
        largest = max(
            (
                -(-layer.offloaded_bytes // self.num_links // ALIGN_BYTES) * ALIGN_BYTES
                + 2 * ALIGN_BYTES * len(layer.offloaded)
                for ring in self.rings
                for layer in ring.streamed
            ),
            default=0,
        )
        return STAGES * largest

    @property
    def transfer_seconds_per_forward(self) -> float | None:
        """`streamed_bytes_per_forward` at `link_gbps` per link, over every link of `links` at once: the least time a
        forward can take; None without a link speed."""
        if self.link_gbps is None:
            return None
        return self.streamed_bytes_per_forward / (self.link_gbps * 1e9 * self.num_links)

    def __str__(self) -> str:
        from .render import render_text

        return render_text(self)

    def _repr_html_(self) -> str:
        from .render import render_html

        return render_html(self)

    def __repr__(self) -> str:
        return (
            f"OffloadPlan(backend={self.backend!r}, rings={[r.path for r in self.rings]}, "
            f"resident_bytes={self.resident_bytes}, pool_bytes={self.pool_bytes}, "
            f"offloaded_bytes={self.offloaded_bytes})"
        )


def caches_experts(layer: LayerPlan) -> bool:
    """Whether a streamed layer gets an expert cache: it shares its slot (a layer alone in its slot keeps every expert
    there) and its routed tensors belong to one experts module."""
    return bool(layer.routed) and not layer.owns_slot and len({spec.routing.module for spec in layer.routed}) == 1


def _cached_rows_bytes(layer: LayerPlan, cached_experts: int) -> int:
    if cached_experts <= 0 or not caches_experts(layer):
        return 0
    return sum(
        spec.nbytes // spec.routing.num_experts * min(cached_experts, spec.routing.num_experts)
        for spec in layer.routed
    )


def cache_bytes(rings: tuple[RingPlan, ...], cached_experts: int) -> int:
    """Device bytes of an expert cache of `cached_experts` per routed layer (capped at each layer's experts)."""
    return sum(_cached_rows_bytes(layer, cached_experts) for ring in rings for layer in ring.streamed)


def expert_row_bytes(rings: tuple[RingPlan, ...]) -> int:
    """Device bytes one more cached expert per routed layer costs (0 without routed tensors)."""
    return sum(_cached_rows_bytes(layer, 1) for ring in rings for layer in ring.streamed)
