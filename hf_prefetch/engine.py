"""The transfer engine: the one owner of the copy stream, the copy events and the slot bookkeeping.

It moves bytes from host storage into pool slots (`prefetch`), orders the compute stream after them (`wait`) and
hands a slot to its next layer once the current one has run (`release`). It knows layers only as positions in a
ring; it knows nothing about modules, hooks or transformers. See [Note: stream ordering] and [Note: slot reuse]
in docs/design.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .driver import captured_copy
from .pool import BufferPool

__all__ = ["PrefetchEngine", "RingTransfers", "LayerTransfer", "LayerCounters"]


@dataclass
class LayerCounters:
    """What happened to one streamed layer. Seconds are filled only when timing is on."""

    copies: int = 0
    copied_bytes: int = 0
    misses: int = 0
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0
    compute_seconds: float = 0.0  # from the end of the layer's wait to the end of its forward


@dataclass
class LayerTransfer:
    """The copies that bring one streamed layer into its slot: `device[i].copy_(host[i])`."""

    host: list[torch.Tensor]  # host storage (pinned when `pinned`), never moved or resized
    device: list[torch.Tensor]  # this layer's buffers in its slot of the pool
    slot: int
    next_in_slot: int  # the layer (ring position) that takes over `slot` after this one ran
    nbytes: int
    # Recorded on the copy stream after this layer's latest copy; the compute stream waits on it before the layer
    # runs. With timing on, every copy gets a fresh event so that late reads see the right copy.
    # None after a capture that found the layer in its slot in a ring with no more layers than slots: its copy has
    # landed, nothing to wait for.
    done: torch.cuda.Event | None = None
    done_in_capture: bool = False  # `done` was last recorded in a CUDA-graph capture: record a fresh event next time
    counters: LayerCounters = field(default_factory=LayerCounters)
    # With timing on: when the layer's forward began (a CUDA event on the compute stream, or perf_counter on CPU).
    compute_begin: torch.cuda.Event | float | None = None


@dataclass
class RingTransfers:
    """The streamed layers of one layer list, in forward order, and the pool slots they share."""

    layers: list[LayerTransfer]
    pool: BufferPool


@dataclass
class _Pending:
    # A timing measurement whose events may not have completed yet: `begin` -> `end` on the device.
    counters: LayerCounters
    begin: torch.cuda.Event
    end: torch.cuda.Event
    # "copy_seconds": begin/end on the copy stream; "stall_seconds": compute stream ready -> copy done;
    # "compute_seconds": the layer's forward on the compute stream.
    counter: str


class PrefetchEngine:
    """Copies layer weights from host storage into pool slots ahead of use. On CPU the copies are synchronous.

    With `timing=True`, copy and stall times are measured with CUDA events that are read later, when they have
    completed (polled with `Event.query()`): no host synchronisation is added to the forward.
    """

    def __init__(
        self, device: torch.device, rings: Sequence[RingTransfers], pinned: bool, timing: bool = False
    ) -> None:
        self.device = device
        self.rings = list(rings)
        self.timing = timing
        self._cuda = device.type == "cuda"
        # Asynchronous copies are only truly async (and only safe to overlap) from page-locked memory; from
        # pageable memory every copy blocks the host until it completed.
        self._non_blocking = self._cuda and pinned
        # copy_stream: runs every host-to-device weight copy. It is ordered after the compute stream by a wait
        # before each copy (the slot may still be read by queued kernels), and the compute stream is ordered after
        # it by each layer's `done` event.
        self.copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._pending: deque[_Pending] = deque()
        # The copies issued in the CUDA-graph capture under way, as (ring, position): their `done` events belong to
        # it. Emptied when each ring's last layer joins the copy stream back into the capture.
        self._captured: set[tuple[int, int]] = set()
        # For each ring whose forward a capture under way has begun: whether its first layers were in their slots then
        # (the state every complete forward ends in once `finish` ran). Read when the ring joins the capture.
        self._steady_at_capture: dict[int, bool] = {}
        # A graph has recorded this engine's copies: replays skip the waits for each ring's first layers, so every
        # forward must `prepare` for one, and `finish` copies those layers after it. See [Note: compile and CUDA
        # graphs] in docs/design.md.
        self.graphs = False
        # The rings whose forward a capture recorded (a replay may run them), and for each ring whether the owner table
        # is known to be true: since the last `prepare` its last layer released in Python. See `_settle`.
        self._recorded: set[int] = set()
        self._exact = [True] * len(self.rings)
        if self._cuda:
            for ring in self.rings:
                for layer in ring.layers:
                    layer.done = torch.cuda.Event()

    def prefetch(self, ring: int, position: int) -> None:
        """Start copying layer `position` of `ring` into its slot, after all compute queued so far."""
        self._prefetch(ring, position, self._capturing())

    def _prefetch(self, ring: int, position: int, capturing: bool) -> None:
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if transfers.pool.owners[layer.slot] == position:
            return  # already there or on its way
        # No owner while the copy is being issued: an interrupt (Ctrl-C in a notebook) between here and the end
        # leaves a slot that nobody owns, so whichever layer runs next loads itself instead of trusting it.
        transfers.pool.owners[layer.slot] = None
        layer.counters.copies += 1
        layer.counters.copied_bytes += layer.nbytes
        if not self._cuda:
            self._copy_on_host(layer)
            layer.done_in_capture = False
        else:
            # In a capture this fork makes the copy stream join it: its copies become nodes of the graph.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                if capturing:
                    self._check_capturable()
                    layer.done, layer.done_in_capture = torch.cuda.Event(), True
                    self._captured.add((ring, position))
                    self.graphs = True
                elif self.timing:
                    self._poll()
                    begin, layer.done, layer.done_in_capture = _timing_event(), _timing_event(), False
                    begin.record()
                    self._pending.append(_Pending(layer.counters, begin, layer.done, "copy_seconds"))
                elif layer.done is None or layer.done_in_capture:
                    layer.done, layer.done_in_capture = torch.cuda.Event(), False
                _copy_all(layer, self._non_blocking, self.copy_stream if capturing else None)
                layer.done.record()
        transfers.pool.owners[layer.slot] = position

    def wait(self, ring: int, position: int) -> None:
        """Order the compute stream after layer `position`'s copy; load it now if its slot holds another layer."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        capturing = self._capturing()
        if capturing and (position == 0 or ring not in self._steady_at_capture):
            # The ring's forward begins in a capture: a capture that ended before its join (an exception while
            # recording) left state that is not this capture's.
            self._forget_capture([ring])
            self._steady_at_capture[ring] = self._steady(transfers)
            self.graphs = True  # a replay skips these waits: every forward must prepare (even with nothing to copy)
        if not self._holds(transfers, position, capturing):
            self._load_now(transfers, position)
        elif capturing:
            # A copy issued before the capture began is not waited for (its event lies outside the capture): the
            # capture began after a device synchronisation (torch.cuda.graph and inductor's CUDA graphs synchronise
            # first), and before each replay `prepare` orders the compute stream after every copy issued so far.
            if (ring, position) in self._captured:
                torch.cuda.current_stream(self.device).wait_event(layer.done)
        elif self._cuda and layer.done is not None:
            compute = torch.cuda.current_stream(self.device)
            if self.timing:
                ready = _timing_event()
                ready.record(compute)
                self._pending.append(_Pending(layer.counters, ready, layer.done, "stall_seconds"))
            compute.wait_event(layer.done)
        if self.timing and not capturing:
            self._begin_compute(layer)

    def release(self, ring: int, position: int) -> None:
        """Layer `position` has been queued: hand its slot to the next layer that uses it."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        capturing = self._capturing()
        if self.timing and not capturing:
            self._end_compute(layer)
        if not (capturing and layer.next_in_slot < position):
            # In a capture the next forward's first layers are left to `finish`, outside the graph: a graph must join
            # every copy it forks, so a recorded copy would keep the copy engine idle between replays.
            self._prefetch(ring, layer.next_in_slot, capturing)
        if position == len(transfers.layers) - 1:
            self._exact[ring] = True
            if capturing:
                self._join_capture(ring)

    def prepare(self) -> None:
        """Before each forward, once a CUDA graph has recorded this engine's copies (a replay runs no Python): load
        each ring's first layers that are not in their slots, and order the compute stream after every copy issued
        so far. See [Note: compile and CUDA graphs] in docs/design.md."""
        if not self._cuda or self._capturing():
            return
        self._settle()  # the previous forward may have been replayed and stopped before its `finish`
        self._exact = [False] * len(self.rings)
        if self._captured or self._steady_at_capture:
            self._forget_capture()  # a capture ended before its join
        if not self.graphs:
            return
        for transfers in self.rings:
            for position in self._missing_first_layers(transfers):
                self._load_now(transfers, position)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def finish(self) -> None:
        """After each forward, once a CUDA graph has recorded this engine's copies: start copying each ring's first
        layers into their slots, after the forward, where a replay (which leaves its last layers there) or a capture
        did not. See [Note: compile and CUDA graphs] in docs/design.md."""
        if not self._cuda or not self.graphs or self._capturing():
            return
        self._settle()
        for index, transfers in enumerate(self.rings):
            for position in self._missing_first_layers(transfers):
                self._prefetch(index, position, capturing=False)

    def _settle(self) -> None:
        # Make the owner table true again after forwards that ran no Python. A replay leaves its ring's last layers
        # in the slots, and only the table of a ring whose last layer released in Python since `prepare` is known to
        # be true: for any other ring a capture recorded (replayed, interrupted before its end, or not run at all),
        # forget what the slots hold. Called before every use of the table outside a forward, since `finish` may
        # never run (an exception or a KeyboardInterrupt between a replay and the model's forward hook).
        for index, transfers in enumerate(self.rings):
            if not self._exact[index] and index in self._recorded and _shares_slots(transfers):
                transfers.pool.owners[:] = [None] * transfers.pool.num_slots
            self._exact[index] = True

    def _capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def holds(self, ring: int, position: int) -> bool:
        """Whether layer `position`'s weights are in its slot (or on their way), outside a capture."""
        self._settle()
        return self._holds(self.rings[ring], position, capturing=False)

    def _forget_capture(self, rings: Sequence[int] | None = None) -> None:
        # What a capture that never reached its join left behind: copies it recorded (their events belong to it),
        # its steady flag, and slots claimed by layers whose only copy into them was recorded, never made.
        for ring in range(len(self.rings)) if rings is None else rings:
            transfers = self.rings[ring]
            self._captured = {(r, p) for r, p in self._captured if r != ring}
            self._steady_at_capture.pop(ring, None)
            for position, layer in enumerate(transfers.layers):
                if layer.done_in_capture and transfers.pool.owners[layer.slot] == position:
                    transfers.pool.owners[layer.slot] = None

    def _steady(self, transfers: RingTransfers) -> bool:
        # Each of the ring's first layers in its slot, copied outside any capture.
        return not self._missing_first_layers(transfers)

    def _missing_first_layers(self, transfers: RingTransfers) -> list[int]:
        # The ring's first layers (those a complete forward ends with in their slots) that are not in them now.
        return [p for p in range(_first_layers(transfers)) if not self._holds(transfers, p, capturing=False)]

    @staticmethod
    def _holds(transfers: RingTransfers, position: int, capturing: bool) -> bool:
        # Whether layer `position`'s weights are in (or on their way to) its slot. A copy only recorded in a capture
        # (its event belongs to the graph) put nothing there outside it: after an aborted capture that is a miss.
        layer = transfers.layers[position]
        return transfers.pool.owners[layer.slot] == position and (capturing or not layer.done_in_capture)

    def _join_capture(self, ring: int) -> None:
        # The ring's forward ends: join the copy stream back into the capture, so that the graph ends after its copies.
        # The copies of the next forward's first layers were not recorded (`release` leaves them to `finish`). Until
        # the graph is replayed the slots hold what they held when the capture began, after a replay its last layers:
        # the slots are forgotten, and `finish` copies the first layers after this forward and after each replay.
        # With no more layers than slots nothing moves: if each layer was in its slot when the capture began, it stays
        # there and owns it, with nothing to wait for (its copy landed before the capture).
        if any(r == ring for r, _ in self._captured):
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        steady = self._steady_at_capture.get(ring, False)
        self._forget_capture([ring])
        self._recorded.add(ring)
        transfers = self.rings[ring]
        if steady and not _shares_slots(transfers):
            for layer in transfers.layers:
                layer.done, layer.done_in_capture = None, False
            return
        transfers.pool.owners[:] = [None] * transfers.pool.num_slots

    def _check_capturable(self) -> None:
        if not self._non_blocking:
            raise RuntimeError(
                "hf_prefetch: a CUDA graph cannot capture copies from pageable host memory, and the offloaded weights "
                "could not be pinned. Make pinning possible (see 'Troubleshooting' in docs/getting_started.md) or "
                "run without CUDA graphs (torch.compile mode='default')."
            )

    def start(self) -> None:
        """Fill every slot with its first layer (called once the parameters point at the pool)."""
        for index, transfers in enumerate(self.rings):
            for position in range(min(transfers.pool.num_slots, len(transfers.layers))):
                self.prefetch(index, position)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has landed."""
        if self._cuda:
            self.copy_stream.synchronize()

    def drain(self) -> None:
        """Block the host until every copy and every kernel queued so far have finished (before host storage or a
        slot is rewritten outside the forward: no copy may still read the one, no kernel the other)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self._forget_capture()
        self._settle()

    def load(self, ring: int, position: int) -> None:
        """Copy layer `position` into its slot now, on the compute stream, and make it the slot's owner.

        For work outside the forward (reloading weights): neither a transfer nor a miss is counted.
        """
        self._settle()
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        transfers.pool.owners[layer.slot] = None  # owned once the copy is issued (see prefetch)
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            _copy_all(layer, self._non_blocking)
            _loaded_on(layer, compute, capturing=False, timing=self.timing)
        else:
            _copy_all(layer, self._non_blocking)
        transfers.pool.owners[layer.slot] = position

    def store(self, ring: int, position: int) -> None:
        """Copy the contents of layer `position`'s slot back into its host storage; the layer must own the slot."""
        self._settle()
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if not self._holds(transfers, position, capturing=False):
            raise RuntimeError(f"Layer {position} of ring {ring} does not own slot {layer.slot}: nothing to store.")
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        for host, device in zip(layer.host, layer.device, strict=True):
            host.copy_(device)  # blocking: the host may read or rewrite its storage as soon as this returns

    def refresh(self, ring: int, position: int) -> None:
        """Layer `position`'s host storage was rewritten: copy it again if it owns its slot. See [Note: rewriting
        weights] in docs/design.md."""
        self._settle()
        transfers = self.rings[ring]
        if transfers.pool.owners[transfers.layers[position].slot] == position:
            self.load(ring, position)

    def refill(self) -> None:
        """Host storage was rewritten: forget what every slot holds and copy each ring's first layers again.

        Without it a slot would keep the old bytes of the layer it is tagged with, and that layer would compute with
        them without a miss. See [Note: rewriting weights] in docs/design.md.
        """
        self._settle()
        for transfers in self.rings:
            transfers.pool.owners[:] = [None] * transfers.pool.num_slots
        self.start()
        if self._cuda:  # a CUDA-graph replay, which waits for none of these copies, may come next
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def collect(self) -> None:
        """Wait for the device and fold every pending timing measurement into the counters."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._poll()

    def reset(self) -> None:
        self.collect()
        for transfers in self.rings:
            for layer in transfers.layers:
                layer.counters = LayerCounters()

    def _poll(self) -> None:
        # Completed measurements leave the queue in issue order; the first incomplete one stops the scan.
        while self._pending and self._pending[0].begin.query() and self._pending[0].end.query():
            item = self._pending.popleft()
            seconds = max(item.begin.elapsed_time(item.end) / 1e3, 0.0)  # a stall is negative when the copy won
            setattr(item.counters, item.counter, getattr(item.counters, item.counter) + seconds)

    def _load_now(self, transfers: RingTransfers, position: int) -> None:
        # A miss: the slot holds (or is receiving) another layer's weights, e.g. after a forward interrupted by an
        # exception or a model that skips or repeats layers. Copy on the compute stream so the layer sees its own
        # weights, after any copy into the slot still in flight.
        layer = transfers.layers[position]
        transfers.pool.owners[layer.slot] = None  # see prefetch(): owned only once the copy is fully issued
        layer.counters.misses += 1
        layer.counters.copies += 1
        layer.counters.copied_bytes += layer.nbytes
        if not self._cuda:
            self._copy_on_host(layer)
        else:
            compute = torch.cuda.current_stream(self.device)
            capturing = self._capturing()
            if not capturing or self._captured:  # in a capture the copy stream may be waited on once it joined it
                compute.wait_stream(self.copy_stream)
            if capturing:
                self._check_capturable()
                _copy_all(layer, self._non_blocking, compute)
            elif self.timing:
                begin, end = _timing_event(), _timing_event()
                begin.record(compute)
                _copy_all(layer, self._non_blocking)
                end.record(compute)
                self._pending.append(_Pending(layer.counters, begin, end, "copy_seconds"))
                self._pending.append(_Pending(layer.counters, begin, end, "stall_seconds"))
            else:
                _copy_all(layer, self._non_blocking)
            _loaded_on(layer, compute, capturing, self.timing)
        transfers.pool.owners[layer.slot] = position

    def _begin_compute(self, layer: LayerTransfer) -> None:
        if self._cuda:
            layer.compute_begin = _timing_event()
            layer.compute_begin.record(torch.cuda.current_stream(self.device))
        else:
            layer.compute_begin = time.perf_counter()

    def _end_compute(self, layer: LayerTransfer) -> None:
        begin, layer.compute_begin = layer.compute_begin, None
        if begin is None:  # released without a wait (a forward that skipped the hook's pre-forward)
            return
        if self._cuda:
            end = _timing_event()
            end.record(torch.cuda.current_stream(self.device))
            self._pending.append(_Pending(layer.counters, begin, end, "compute_seconds"))
        else:
            layer.counters.compute_seconds += time.perf_counter() - begin

    def _copy_on_host(self, layer: LayerTransfer) -> None:
        # CPU execution: the copy is synchronous, so all of it is time the forward waits.
        begin = time.perf_counter() if self.timing else 0.0
        _copy_all(layer, non_blocking=False)
        if self.timing:
            seconds = time.perf_counter() - begin
            layer.counters.copy_seconds += seconds
            layer.counters.stall_seconds += seconds


def _shares_slots(transfers: RingTransfers) -> bool:
    # More streamed layers than slots: layers take turns in the slots, so their contents move with every forward.
    return len(transfers.layers) > transfers.pool.num_slots


def _first_layers(transfers: RingTransfers) -> int:
    # How many of a ring's layers are in their slots when a complete forward ends (copied by its last layers).
    return min(transfers.pool.num_slots, len(transfers.layers))


def _loaded_on(layer: LayerTransfer, stream: torch.cuda.Stream, capturing: bool, timing: bool) -> None:
    # The layer's latest copy ran on `stream`: `done` now marks its end. A fresh event, since a pending timing
    # measurement may still hold the old one; a timing one when stalls are measured against it.
    layer.done = _timing_event() if timing and not capturing else torch.cuda.Event()
    layer.done_in_capture = capturing
    layer.done.record(stream)


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _copy_all(layer: LayerTransfer, non_blocking: bool, captured_on: torch.cuda.Stream | None = None) -> None:
    if captured_on is not None:
        for dst, src in zip(layer.device, layer.host, strict=True):
            captured_copy(dst, src, captured_on)
        return
    for dst, src in zip(layer.device, layer.host, strict=True):
        dst.copy_(src, non_blocking=non_blocking)
