"""The plan's types below the plan itself: every parameter of the layer lists with its `Placement`, its layers and
rings (`OffloadPlan`, which holds them, is offload_plan.py's).

A placement says how a parameter reaches the kernels while the model is dispatched: resident on the execution device,
streamed through a slot of its layer list's buffer pool, gathered expert by expert (routed), or mapped (read in place
from pinned host memory, the UVA backend). Each placement also says where the tensor lives (`Storage`: device memory,
pinned host memory, a checkpoint's file) and where it is computed (`Compute`: the device or the host's cores). The
plan also says where the choice came from (`Source`). New ways of placing weights are new `Placement` kinds with
their storage and compute, not new plan types. These are frozen values: choosing them is `selection`'s and
`budget`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..alignment import STAGING_ALIGN_BYTES, round_up
from ..formats.lossless import Layout, layout_of, not_encoded
from ..host.arena import padded_bytes

__all__ = [
    "RingPlan",
    "LayerPlan",
    "ParamSpec",
    "Placement",
    "Storage",
    "Compute",
    "Routing",
    "Source",
    "PoolKey",
    "host_layers",
]

PoolKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


# Separates a tensor-subclass parameter's name from one of its inner tensors' attributes in a spec's name.
INNER_SEP = ":"


def staged_nbytes(layout: Layout) -> int:
    """Bytes one compressed parameter takes in a staging buffer, aligned for the next one."""
    return round_up(layout.nbytes, STAGING_ALIGN_BYTES)


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


def kept_plain(layer: LayerPlan, spec: ParamSpec) -> str | None:
    """With `compress=True`, why a streamed parameter of a streamed layer is not kept compressed, in words that follow
    a count of tensors; None for one that is, and for one that does not stream."""
    if spec.compressed is not None or spec.placement not in (Placement.STREAMED, Placement.ROUTED, Placement.READ):
        return None
    if spec.placement is Placement.READ:
        return "read from the checkpoint's files as stored"
    if layer.owns_slot:
        return "in layers alone in their slot, which are copied once"
    if spec.placement is Placement.ROUTED:
        return "routed experts, copied row by row"
    if spec.inner:
        return "parts of a parameter stored as several tensors"
    if spec.stride != _contiguous(spec.shape):
        return "not dense in row-major order"
    numel = 1
    for size in spec.shape:
        numel *= size
    # Encodable by dtype and size, yet plain: its values had more escapes than its layout holds (compressed_storage).
    return not_encoded(spec.dtype, numel) or "whose values have too many rare exponents for their layout"


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


class Storage(Enum):
    """Where a parameter's bytes live while the model is dispatched."""

    DEVICE = "device"  # the execution device's memory
    PINNED_HOST = "pinned host"  # the host arena, page-locked on CUDA (host/arena.py)
    FILE = "file"  # the checkpoint's own files, read at each use


class Compute(Enum):
    """Where the kernels that read a parameter run."""

    DEVICE = "device"  # the execution device, from device memory, a slot or a mapped view
    HOST = "host"  # the host's cores, from host storage


class Placement(Enum):
    """How a parameter reaches the kernels while the model is dispatched; `storage` and `compute` say where its bytes
    live and where they are computed on."""

    RESIDENT = "resident"  # on the execution device, for good
    STREAMED = "streamed"  # in pinned host memory, copied into a slot of its ring's buffer pool before each use
    MAPPED = "mapped"  # in pinned host memory, read in place by the kernels over the bus (UVA zero-copy)
    # An expert tensor of a mixture-of-experts layer, in pinned host memory, streamed through its ring's slots like
    # STREAMED, except that a forward with few tokens copies only the rows of the experts its router picks (see
    # [Note: routed experts] in runtime/routed.py).
    ROUTED = "routed"
    # In its checkpoint's file, read before each copy into a pinned staging buffer of its ring (direct I/O, on
    # threads, ahead of use) and copied from there into its slot like STREAMED: the weights that do not fit host
    # memory (see [Note: weights read from files] in runtime/read_ahead.py).
    READ = "read"
    # An expert tensor like ROUTED, in its checkpoint's file: a forward reads the experts its router picks that the
    # ring's host expert cache lacks into that cache (pinned), and copies their rows from there into the slot (see
    # [Note: experts read from files] in runtime/file_experts.py).
    READ_ROUTED = "read routed"

    @property
    def storage(self) -> Storage:
        if self is Placement.RESIDENT:
            return Storage.DEVICE
        return Storage.FILE if self in (Placement.READ, Placement.READ_ROUTED) else Storage.PINNED_HOST

    @property
    def compute(self) -> Compute:
        return Compute.DEVICE


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
    # function of dtype and size; see formats/lossless.py). Its copy brings these bytes into its slot's staging buffer,
    # and the layer's wait decodes them into its slot buffer.
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
    and keeps it. See [Note: slot reuse] in runtime/ring.py.
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
        """Whether the layer goes through its ring's slots (its STREAMED, ROUTED, READ or READ_ROUTED parameters)."""
        return any(p.placement not in (Placement.RESIDENT, Placement.MAPPED) for p in self.params)

    @property
    def read_from_files(self) -> bool:
        """Whether the layer's offloaded parameters stay in the checkpoint's files (READ), read at each copy."""
        return any(p.placement is Placement.READ for p in self.params)

    @property
    def routed(self) -> tuple[ParamSpec, ...]:
        """Its expert tensors copied row by row as the router picks (ROUTED, and READ_ROUTED ones from files)."""
        return tuple(p for p in self.params if p.placement in (Placement.ROUTED, Placement.READ_ROUTED))

    @property
    def streamed_kind(self) -> str:
        """How a streamed layer's offloaded parameters travel, in a word for the plan's table."""
        if self.routed:
            return "read routed" if self.experts_from_files else "routed"
        return "read" if self.read_from_files else "streamed"

    @property
    def experts_from_files(self) -> bool:
        """Whether its routed experts stay in the checkpoint's files (READ_ROUTED), read as the router picks them."""
        return any(p.placement is Placement.READ_ROUTED for p in self.params)

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
        """What a whole copy of the layer moves: the offloaded parameters' bytes in host storage (in pinned memory,
        or in the checkpoint's files for READ ones)."""
        return sum(p.host_nbytes for p in self.offloaded)

    @property
    def pinned_bytes(self) -> int:
        """The offloaded parameters' bytes in pinned host memory (READ and READ_ROUTED ones stay in their files)."""
        return sum(p.host_nbytes for p in self.offloaded if p.placement.storage is not Storage.FILE)

    @property
    def staging_bytes(self) -> int:
        """Device bytes its compressed parameters' encoded bytes take in its slot's staging buffer."""
        return sum(staged_nbytes(p.compressed) for p in self.offloaded if p.compressed is not None)

    @property
    def bytes_per_token(self) -> int:
        """What a forward of one token copies of this layer: the routed parameters' rows of `top_k` experts (all of
        them where top_k is unknown), and every other offloaded byte (encoded where compressed)."""
        routed = (Placement.ROUTED, Placement.READ_ROUTED)
        return sum(picked_bytes(p) if p.placement in routed else p.host_nbytes for p in self.offloaded)

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
    # Layers whose experts stay in the checkpoint's files (READ_ROUTED): the ring's host expert cache, as many pinned
    # buffers of `expert_buffer_bytes` (one expert's rows of a layer, as direct I/O reads them) as it holds experts.
    host_cached_experts: int = 0
    expert_buffer_bytes: int = 0

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
                sizes[spec.key] = padded_bytes(spec.nbytes)  # each at an aligned offset of its slot (runtime/pool.py)
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


def caches_experts(layer: LayerPlan) -> bool:
    """Whether a streamed layer gets an expert cache: it shares its slot (a layer alone in its slot keeps every expert
    there) and its routed tensors belong to one experts module, in pinned host memory (experts read from files have
    their host expert cache instead)."""
    if not layer.routed or layer.owns_slot or layer.experts_from_files:
        return False
    return len({spec.routing.module for spec in layer.routed}) == 1


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


def host_layers(rings: tuple[RingPlan, ...]) -> list[LayerPlan]:
    """The streamed layers whose routed experts may compute on the host: those that take turns in a slot (a layer alone
    in its slot is copied once and computes on the device from it), in pinned host memory (not read from files)."""
    return [
        layer
        for ring in rings
        for layer in ring.streamed
        if layer.routed and not layer.owns_slot and not layer.experts_from_files
    ]


def picked_bytes(spec: ParamSpec) -> int:
    """A routed parameter's bytes that a forward of one token picks: the rows of its `top_k` experts (every row where
    top_k is unknown)."""
    r = spec.routing
    return spec.nbytes * min(r.top_k, r.num_experts) // r.num_experts if r.top_k is not None else spec.nbytes


def routed_bytes_per_token(rings: tuple[RingPlan, ...]) -> int:
    """The routed experts' bytes a one-token forward picks in the layers of `host_layers`."""
    return sum(picked_bytes(spec) for layer in host_layers(rings) for spec in layer.routed)


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB" if abs(num_bytes) >= 2**10 else f"{num_bytes} B"
