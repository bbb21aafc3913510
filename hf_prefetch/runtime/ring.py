"""The bookkeeping of one ring (the streamed layers of one layer list): which layer each slot holds, the ring's state
with respect to CUDA graphs, and the capture that is recording it.

Pure bookkeeping: no streams, no copies, no CUDA. The engine drives it; every transition of a ring's state is written
once, in `RingTransfers`, and every change of the slot table goes through `SlotTable`.

[Note: slot reuse]
*When may a slot be overwritten?* Only when the layer that last used it has been queued on the compute stream, and the
copy is ordered after it. The post-forward hook of streamed layer k starts the copy of `next_in_slot(k)`: the next
streamed layer, in cyclic order, that uses k's slot (`k + num_slots` while it exists, else the first layer of the next
pass with that slot). With n streamed layers and n a multiple of `prefetch_step` this is vLLM's `(k + step) % n`; when
it is not, vLLM's rule would copy into a slot whose current layer has not run yet (a miss each forward), while this one
never does (tests/planning/test_selection.py checks every n <= 9, step <= 4). A layer alone in its slot is its own next
layer: it is copied once and keeps the slot.

*Who owns a slot?* The slot table names, for each slot, the layer whose weights it holds or is receiving. A copy
clears the owner, is issued, and only then names its layer (`SlotTable.claim`): an interrupt between any two
bytecodes (Ctrl-C in a notebook) leaves a slot that nobody owns, never a half-written slot that claims a layer. A
layer that runs while another owns its slot is a miss (see [Note: misses] in engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

import torch

from ..formats.lossless import Layout
from ..host.arena import padded_bytes
from .expert_policy import WINDOW, RecentPolicy
from .graph_copies import is_dense
from .pool import BufferPool

__all__ = [
    "SlotTable",
    "RingState",
    "CopyEvent",
    "Fill",
    "Capture",
    "LayerCounters",
    "RoutedTensor",
    "Decode",
    "ExpertCache",
    "RecentPicks",
    "LayerTransfer",
    "RingTransfers",
]


class SlotTable:
    """Which streamed layer (ring position) each slot of a ring holds or is receiving; None: nobody, or unknown."""

    def __init__(self, num_slots: int) -> None:
        self._owners: list[int | None] = [None] * num_slots

    @property
    def owners(self) -> tuple[int | None, ...]:
        return tuple(self._owners)

    def holds(self, slot: int, position: int) -> bool:
        return self._owners[slot] == position

    @contextmanager
    def claim(self, slot: int, position: int) -> Iterator[None]:
        """Around issuing a copy of layer `position` into `slot`: nobody owns the slot until the copy is issued."""
        self._owners[slot] = None
        yield
        self._owners[slot] = position

    def release(self, slot: int, position: int) -> None:
        """Forget that `slot` holds `position` (its copy belongs to a graph never replayed, or aborted)."""
        if self._owners[slot] == position:
            self._owners[slot] = None

    def forget(self) -> None:
        """Nobody owns any slot: every layer loads (or is copied) again before it runs."""
        self._owners = [None] * len(self._owners)


class RingState(Enum):
    """A ring's state with respect to CUDA graphs. See [Note: compile and CUDA graphs] in capture.py.

    EAGER: no graph has recorded this ring. Its forwards run the hooks in Python, which keep the slot table true.
    CAPTURING: a CUDA-graph capture under way is recording this ring's forward (`RingTransfers.capture` is open).
    SETTLED: a graph recorded this ring, and the slot table is true: since the last `prepare` the ring's last layer
        released in Python, or the table was settled (forgotten where a replay may have moved the slots).
    IN_FLIGHT: a graph recorded this ring, and a forward began (`prepare`) that may be a replay, which runs no Python
        and leaves the ring's last layers in the slots: the table must be settled before it is trusted.
    """

    EAGER = "eager"
    CAPTURING = "capturing"
    SETTLED = "settled"
    IN_FLIGHT = "in flight"


class CopyEvent(Enum):
    """What a layer's `done` event is."""

    ON_STREAM = "on stream"  # recorded on a stream outside any graph: the compute stream may wait on it
    IN_GRAPH = "in graph"  # recorded inside a capture: it belongs to the graph, outside it the layer has no copy
    LANDED = "landed"  # no event: the copy landed before a capture that kept the layer in its slot for good


class Fill(Enum):
    """What a layer's latest copy into its slot brought. See [Note: routed experts] in routed.py."""

    WHOLE = "whole"  # every tensor of the layer
    ROUTED = "routed"  # every tensor but the routed ones, whose rows its experts' forward copies as the router picks


@dataclass
class Capture:
    """One ring's part of a CUDA-graph capture, from the ring's first `wait` in it to its join (or its abort)."""

    steady: bool  # each of the ring's first layers was in its slot, copied outside any graph, when it began
    tokens: int | None  # the forward's token count (`prepare`'s): a graph is recorded for one input shape
    before: list[LayerCounters]  # the layers' counters when it began: what it adds is what each replay does
    copies: set[int] = field(default_factory=set)  # positions whose copy this capture recorded


@dataclass
class LayerCounters:
    """What happened to one streamed layer. Seconds are filled only when timing is on."""

    copies: int = 0
    copied_bytes: int = 0
    misses: int = 0
    # Expert rows copied from host memory, each copy once: a gather copies every pick (a repeated one again; with an
    # expert cache its misses, counted on the device and added by `experts.collect_tallies`), a layer whose experts
    # are read from files each distinct pick of a forward once.
    routed_rows: int = 0
    routed_bytes: int = 0  # their bytes, also counted in copied_bytes
    routed_picks: int = 0  # the router's picks in routing forwards (a repeated pick counts again)
    completions: int = 0  # layers copied without their routed tensors that a forward of many tokens completed
    cache_hits: int = 0  # picks found in the layer's expert cache (a repeated pick counts again)
    cache_misses: int = 0  # picks read from host memory while the layer has a cache
    cache_loaded_bytes: int = 0  # bytes loaded into the cache from host memory (also counted in copied_bytes)
    # Picks found in the slot, fetched by its copy because the layer picked them in its previous forward (their rows
    # count in routed_rows when fetched, picked again or not).
    recent_hits: int = 0
    recent_fetched: int = 0  # rows fetched ahead (in routed_rows; those not picked again crossed for nothing)
    host_picks: int = 0  # the router's picks computed on the host's cores (a repeated pick counts again)
    host_bytes: int = 0  # expert bytes the host's computations read (each picked expert once per forward)
    host_seconds: float = 0.0  # the host's compute time of those picks (in its worker thread)
    decoded_bytes: int = 0  # values written into the slot by decoding compressed bytes
    compressed_bytes: int = 0  # the compressed bytes they were decoded from (also counted in copied_bytes)
    decodes: int = 0
    # with timing: device time of the decoding (compute stream; between forwards, decode stream)
    decode_seconds: float = 0.0
    # Placement.READ: bytes read from the checkpoint's files for its copies, and the seconds its copies waited for
    # those reads (the disk behind; measured always)
    read_bytes: int = 0
    read_wait_seconds: float = 0.0
    # Placement.READ_ROUTED: a gather's picked experts found in the host expert cache, and read from the files (each
    # once per gather; their bytes count in read_bytes, their waits in read_wait_seconds)
    host_cache_hits: int = 0
    host_cache_misses: int = 0
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0
    compute_seconds: float = 0.0  # from the end of the layer's wait to the end of its forward


@dataclass
class RoutedTensor:
    """One ROUTED parameter of a layer: dimension 0 indexes experts."""

    host: torch.Tensor  # host storage
    source: torch.Tensor  # what rows are gathered from: `host`, or on CUDA its mapped (UVA) view
    device: torch.Tensor  # the parameter's buffer in the layer's slot
    num_experts: int
    # `source` and `device` as one row per expert (when contiguous), of the widest integer elements their layout
    # allows: the same bytes, read with wider loads (a gather through the mapped view runs ~20% faster with 8-byte
    # loads than with 2-byte ones: benchmarks/routed_gather.py).
    source_rows: torch.Tensor = field(init=False)
    device_rows: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.source_rows, self.device_rows = self.source, self.device
        if not (self.source.is_contiguous() and self.device.is_contiguous()):
            return
        self.source_rows = self.source.view(self.num_experts, -1)
        self.device_rows = self.device.view(self.num_experts, -1)
        for dtype in (torch.int64, torch.int32):
            if _rows_of(self.source, self.num_experts, dtype) and _rows_of(self.device, self.num_experts, dtype):
                self.source_rows = self.source_rows.view(dtype)
                self.device_rows = self.device_rows.view(dtype)
                break

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


def byte_span(device: list[torch.Tensor], host: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`device[i].copy_(host[i])` for every i as one copy, (slot bytes, host bytes): where each side's tensors are
    dense views of one storage, in the same order, each after the first starting at the first `TENSOR_ALIGN_BYTES`
    multiple (counted from the first tensor) past the end of the one before, as the pool lays out a slot and the arena
    a layer; the bytes in between are padding that no tensor uses. None otherwise, and for fewer than two tensors."""
    if len(device) < 2:
        return None
    sides = []
    for tensors in (device, host):
        storage, first = tensors[0].untyped_storage(), tensors[0].data_ptr()
        end = None  # of the tensor before, in bytes from `first`
        for tensor in tensors:
            start, nbytes = tensor.data_ptr() - first, tensor.numel() * tensor.element_size()
            if tensor.untyped_storage().data_ptr() != storage.data_ptr() or not is_dense(tensor) or nbytes == 0:
                return None
            if end is not None and start != padded_bytes(end):
                return None
            end = start + nbytes
        offset = first - storage.data_ptr()
        sides.append(torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, offset, (end,)))
    return sides[0], sides[1]


def _rows_of(tensor: torch.Tensor, num_experts: int, dtype: torch.dtype) -> bool:
    # Whether `tensor` can be viewed as `num_experts` rows of `dtype` elements.
    row_bytes = tensor.numel() // num_experts * tensor.element_size()
    return (
        tensor.is_contiguous()
        and row_bytes > 0
        and row_bytes % dtype.itemsize == 0
        and tensor.data_ptr() % dtype.itemsize == 0
    )


@dataclass
class ExpertCache:
    """Experts of one layer's routed tensors kept on the device: row i of each tensor holds expert `experts[i]`.

    Looked up on the device, with no host synchronisation (`experts.gather_looked_up`): `slot_of[e]` is the row that
    holds expert e, or -1. Picks are counted on the device too (`picks`, and the layer's `tallies`); the host reads
    them only when it re-ranks the cache (`experts.refresh_caches`, from the engine's `prepare`) and when statistics
    are collected.

    Policy: the first routing forward loads the experts picked most so far (a prefill's picks count); every `REFRESH`
    routing forwards the scores are re-read (picks since the last re-rank, plus half the score before) and an expert
    takes a cached one's row only when its score is more than `MARGIN` times the cached one's and the difference is
    more than `SIGNIFICANCE` standard deviations of counting noise (`sqrt` of their sum): an expert seldom picked
    leaves, popular ones stay, and near-equal ones do not trade places (each trade copies a row, and under routing
    that picks every expert alike, a trade on noise buys no hits). It holds the
    host's values while `valid`; rewriting host storage makes it invalid (every `slot_of` entry -1 at once) and the
    next routing forward loads it again.
    """

    REFRESH = WINDOW
    MARGIN = 2.0
    SIGNIFICANCE = 2.0

    tensors: list[torch.Tensor]  # per routed tensor: (capacity, *row shape) on the device
    rows: list[torch.Tensor]  # the same, as (capacity, n) rows of the routed tensor's `device_rows` dtype
    slot_of: torch.Tensor  # (num_experts,) int64 on the device: the row holding each expert, or -1
    picks: torch.Tensor  # (num_experts,) int64 on the device: picks since the last re-rank
    experts: list[int]  # the expert each row holds, while `valid`
    scores: list[float]  # per expert: decayed picks, as of the last re-rank
    valid: bool = False

    @property
    def capacity(self) -> int:
        return len(self.experts)


@dataclass
class RecentPicks:
    """The experts a layer's router picked in its latest forward, fetched into its slot by its next copy for a
    routing forward, ahead of its router ([Note: routed experts] in routed.py, `experts.fetch_recent`).

    `experts` is written on the compute stream after the router (`experts.remember_picks`) and read on the copy stream
    by the next such copy of the layer, which forks from the compute stream later. `ready[e]` is 1 only where that
    copy brought expert e's rows into the slot: every copy of the layer without its routed tensors rewrites `ready`
    (a miss clears it), so it never names a row that another layer or an older copy left there. Whether the rows are
    fetched at all is `policy`'s decision (expert_policy.py, measured per layer), on the device as `enabled`; the
    experts a fetch would bring are `marked` either way.
    """

    experts: torch.Tensor  # (num_experts,) int64 on the device: the latest forward's picks (the first `count`), -1
    ready: torch.Tensor  # (num_experts,) int32 on the device: 1 where the slot's rows hold the layer's expert
    chosen: torch.Tensor  # (num_experts,) int64 on the device: the fetch's own choice, read by its copies only
    # (num_experts,) int32 on the device: 1 for each expert the latest fetch would bring (brought or not), so that the
    # gather counts how many picks a fetch ahead finds (`expert_policy.py`).
    marked: torch.Tensor
    enabled: torch.Tensor  # (1,) int32 on the device: the policy's decision, read by the fetch (in CUDA graphs too)
    policy: RecentPolicy
    count: int = 0  # picks the latest forward run in Python recorded (a function of its shapes; replays set none)
    top_k: int = 0  # picks per token in that forward (the router's index: tokens x top_k)


@dataclass(frozen=True)
class Decode:
    """One compressed parameter of a layer: its encoded bytes in the slot's staging buffer, decoded into its slot
    buffer (`out`, flat) by the layer's wait."""

    name: str
    staged: torch.Tensor  # uint8, `layout.nbytes`: where the copy puts the host's encoded bytes
    out: torch.Tensor  # the parameter's slot buffer, flat
    layout: Layout


@dataclass
class LayerTransfer:
    """The copies that bring one streamed layer into its slot: `device[i].copy_(host[i])`, and for each ROUTED
    parameter either the same whole copy or the rows of the experts its router picks (`routed`)."""

    host: list[torch.Tensor]  # host storage (pinned when the arena is), never moved or resized
    device: list[torch.Tensor]  # this layer's buffers in its slot of the pool
    slot: int
    next_in_slot: int  # the layer (ring position) that takes over `slot` after this one ran
    nbytes: int  # of `host`
    routed: list[RoutedTensor] = field(default_factory=list)
    # Compressed parameters: `host` and `device` above hold their encoded bytes and staging views; each is decoded
    # into its slot buffer once per copy, on the compute stream, before the layer runs (`decoded`).
    decodes: list[Decode] = field(default_factory=list)
    decoded: bool = True
    # (slot bytes, host bytes): the copies of `device[i].copy_(host[i])` as one, where `byte_span` found them lying
    # in the same order and at the same distances on both sides, with only alignment padding between them.
    span: tuple[torch.Tensor, torch.Tensor] | None = None
    fill: Fill = Fill.WHOLE  # what the latest copy into the slot brought
    cache: ExpertCache | None = None  # routed experts kept on the device (see ExpertCache)
    recent: RecentPicks | None = None  # the latest forward's picks, fetched with the next routing copy
    # With a cache or recent picks: (TALLIES,) int64 on the device, picks found fetched ahead (`recent`), found in the
    # cache, and copied from host memory at the router, rows fetched ahead, and what a fetch ahead would bring and find
    # (`expert_kernels.FOUND_RECENT`...); read by `experts.collect_tallies`.
    tallies: torch.Tensor | None = None
    tallies_seen: list[int] | None = None  # `tallies` as the host last read them (they only grow)
    gathered: bool = False  # since the layer's wait, its experts' hook ran (`gather`)
    # PrefetchConfig.cpu_experts ([Note: experts on the host] in host_experts.py): the share of its picks the host
    # computes (0: none), and whether it computes all of them in every forward (its copies never bring them).
    host_share: float = 0.0
    host_always: bool = False
    # Placement.READ ([Note: weights read from files] in read_ahead.py): its ring's reads, and its index among them;
    # each copy comes from a staging buffer, `host` stays the files' mapped pages.
    reads: Any = None  # read_ahead.ReadAhead (which knows this module, not the other way)
    read_index: int = -1
    # Placement.READ_ROUTED ([Note: experts read from files] in file_experts.py): its ring's host expert cache and
    # this layer's place in it; its `routed` tensors are then never copied whole (their host storage is none, or a
    # file's pages).
    files: Any = None  # file_experts.FileExperts
    files_layer: int = -1
    # Recorded after this layer's latest copy; the compute stream waits on it before the layer runs. With timing on,
    # every copy gets a fresh event so that late reads see the right copy. `event` says what it is.
    done: torch.cuda.Event | None = None
    event: CopyEvent = CopyEvent.ON_STREAM
    counters: LayerCounters = field(default_factory=LayerCounters)
    # With timing on: when the layer's forward began (a CUDA event on the compute stream, or perf_counter on CPU).
    compute_begin: torch.cuda.Event | float | None = None

    @property
    def routed_whole_in_whole_forwards(self) -> bool:
        """Whether a forward that does not route copies its routed tensors whole: not where the host computes them in
        every forward (`host_always`), nor where they stay in files (`files`: every forward reads its picks)."""
        return not self.host_always and self.files is None


@dataclass
class RingTransfers:
    """The streamed layers of one layer list in forward order, the pool slots they share, and their bookkeeping."""

    layers: list[LayerTransfer]
    pool: BufferPool
    slots: SlotTable = field(init=False)
    state: RingState = RingState.EAGER
    capture: Capture | None = None
    # What each recorded graph counts in one run, by its forward's token count: the counters its capture added in
    # Python (copies, bytes, the routed rows of layers whose picks are not counted on the device). A replay runs no
    # Python, so `settle` adds them once per forward that ran none (`python_ran`) ([Note: compile and CUDA graphs]).
    recorded: dict[int | None, list[dict[str, int]]] = field(default_factory=dict)
    forward_tokens: int | None = None  # the token count of the forward under way (`begin_forward`)
    python_ran: bool = False  # a layer of the forward under way waited in Python: it is no replay

    def __post_init__(self) -> None:
        self.slots = SlotTable(self.pool.num_slots)

    @property
    def shares_slots(self) -> bool:
        """More streamed layers than slots: layers take turns in the slots, so their contents move every forward."""
        return len(self.layers) > self.pool.num_slots

    @property
    def num_first(self) -> int:
        """How many of the ring's layers are in their slots when a complete forward ends (its first layers)."""
        return min(self.pool.num_slots, len(self.layers))

    def holds(self, position: int, capturing: bool = False) -> bool:
        """Whether layer `position`'s weights are in (or on their way to) its slot. A copy only recorded in a capture
        (its event belongs to the graph) put nothing there outside it: after an aborted capture that is a miss."""
        layer = self.layers[position]
        return self.slots.holds(layer.slot, position) and (capturing or layer.event is not CopyEvent.IN_GRAPH)

    def missing_first_layers(self) -> list[int]:
        """The ring's first layers that are not in their slots (outside a capture)."""
        return [p for p in range(self.num_first) if not self.holds(p)]

    def first_layers_without_routed(self) -> list[int]:
        """The ring's first layers in their slots without their routed tensors (`Fill.ROUTED`)."""
        return [
            p
            for p in range(self.num_first)
            if self.holds(p) and self.layers[p].fill is Fill.ROUTED and self.layers[p].routed_whole_in_whole_forwards
        ]

    # --- The state's transitions: every change of `state` and `capture` is one of these ----------------------------

    def begin_capture(self) -> None:
        """The ring's forward begins in a capture. What an earlier capture left unjoined (an exception while
        recording) is forgotten first."""
        self.abort_capture()
        before = [replace(layer.counters) for layer in self.layers]
        self.capture = Capture(steady=not self.missing_first_layers(), tokens=self.forward_tokens, before=before)
        self.state = RingState.CAPTURING

    def join_capture(self) -> None:
        """The ring's last layer released in the capture. Until the graph is replayed the slots hold what they held
        when the capture began, after a replay its last layers: the table is forgotten, and `finish` copies the first
        layers after the capture and after each replay. With no more layers than slots nothing ever moves: if each
        layer was in its slot when the capture began it keeps it, with nothing to wait for."""
        steady = self.capture is not None and self.capture.steady
        if self.capture is not None:
            self.recorded[self.capture.tokens] = [
                _added(layer.counters, before) for layer, before in zip(self.layers, self.capture.before, strict=True)
            ]
        self.abort_capture()
        self.state = RingState.SETTLED
        if steady and not self.shares_slots:
            for layer in self.layers:
                layer.done, layer.event = None, CopyEvent.LANDED
        else:
            self.slots.forget()

    def abort_capture(self) -> None:
        """Forget a capture that never reached its join: slots claimed by copies it only recorded lose their owner.
        The ring counts as recorded from then on (a conservative guess: a graph may hold part of its forward)."""
        if self.capture is None:
            return
        for position, layer in enumerate(self.layers):
            if layer.event is CopyEvent.IN_GRAPH:
                self.slots.release(layer.slot, position)
        self.capture = None
        if self.state is RingState.CAPTURING:
            self.state = RingState.SETTLED

    def begin_forward(self, tokens: int | None) -> None:
        """`prepare` ran: a forward of `tokens` tokens begins, maybe a replay."""
        self.forward_tokens, self.python_ran = tokens, False
        if self.state is RingState.SETTLED:
            self.state = RingState.IN_FLIGHT

    def end_forward(self) -> None:
        """The ring's last layer released in Python: the table is true."""
        if self.state is RingState.IN_FLIGHT:
            self.state = RingState.SETTLED

    def settle(self) -> None:
        """Make the table true after forwards that ran no Python: a replay leaves the ring's last layers in the slots
        that take turns, so those are forgotten. Called before every use of the table outside a forward."""
        if self.state is RingState.IN_FLIGHT:
            if self.shares_slots:
                self.slots.forget()
            if not self.python_ran:  # a replay: it did what its capture recorded
                for layer, added in zip(self.layers, self.recorded.get(self.forward_tokens, ()), strict=False):
                    for name, value in added.items():
                        setattr(layer.counters, name, getattr(layer.counters, name) + value)
            self.state = RingState.SETTLED


def _added(now: LayerCounters, before: LayerCounters) -> dict[str, int]:
    # The counts (not the seconds: a capture times nothing) that grew from `before` to `now`.
    added = {}
    for counter in fields(LayerCounters):
        value = getattr(now, counter.name)
        if isinstance(value, int) and value != getattr(before, counter.name):
            added[counter.name] = value - getattr(before, counter.name)
    return added
