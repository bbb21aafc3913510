"""The transfer engine: the one owner of the copy stream and the copy events.

It moves bytes from host storage into pool slots (`prefetch`), orders the compute stream after them (`wait`) and
hands a slot to its next layer once the current one has run (`release`). It knows layers only as positions in a ring;
it knows nothing about modules, hooks or transformers. The per-ring bookkeeping (slot table, CUDA-graph state,
capture) is `ring.py`'s; this module decides when it changes. The engine's steps inside a CUDA-graph capture
(capture.py), for routed experts (routed.py) and for compressed layers (decodes.py) are parts of its class, each in
its own file with its Note.

[Note: stream ordering]
Two streams: the compute stream (whatever stream is current when a layer runs) and the engine's copy stream (and a
decode stream for compressed layers between forwards: see [Note: compressed streaming] in decodes.py).
- Copy after compute (fork): before each copy the copy stream waits for everything queued so far on the compute
  stream (`copy_stream.wait_stream(compute)`): the slot's previous layer may still be reading it.
- Compute after copy (join): each streamed layer's `done` event is recorded on the copy stream after its copy; its
  pre-forward hook makes the compute stream wait on it (`compute.wait_event(done)`).
- No host synchronisation on the hot path. The host blocks only to tear down or rewrite weights (`drain`,
  `synchronize`) and to read statistics (`collect`).
- Only from page-locked memory: copies are `non_blocking` only when the arena is pinned; a non-blocking copy from
  pageable memory is staged by the driver and is not asynchronous. Without pinning, copies block the host.
- Timing events (`timing=True`) are fresh per copy and read only once `Event.query()` says they completed.

[Note: misses]
A layer whose slot holds another layer's weights when it runs is a miss: after a forward interrupted by an exception
or a KeyboardInterrupt (the remaining post-forward hooks never ran), a model that skips or repeats layers, a layer
called on its own, weights rewritten outside the forward. The engine then loads the layer on the compute stream,
after any copy into the slot still in flight, counts the miss, and the next post-forward hook resumes the cycle. A
layer never computes with another layer's weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .capture import CapturedCopies
from .copies import copy_all, copy_bytes, copy_pairs, loaded_on
from .decodes import CompressedDecodes
from .experts import ExpertCaches, forget_cache
from .ring import CopyEvent, Fill, LayerCounters, LayerTransfer, RingState, RingTransfers
from .routed import BYPASSED, RoutedFills, fetch_ahead, fetched_nothing
from .shared_links import SharedLinks
from .timing import Timings, timing_event

__all__ = ["PrefetchEngine"]


class PrefetchEngine(CapturedCopies, RoutedFills, CompressedDecodes):
    """Copies layer weights from host storage into pool slots ahead of use. On CPU the copies are synchronous.

    With `timing=True`, copy and stall times are measured with CUDA events that are read later, when they have
    completed (polled with `Event.query()`): no host synchronisation is added to the forward.
    """

    def __init__(
        self,
        device: torch.device,
        rings: Sequence[RingTransfers],
        pinned: bool,
        timing: bool = False,
        routed_max_tokens: int = 0,
        links: Sequence[torch.device] = (),
    ) -> None:
        self.device = device
        self.rings = list(rings)
        self.timing = timing
        self._cuda = device.type == "cuda"
        # [Note: stream ordering]: only copies from page-locked memory are asynchronous.
        self._non_blocking = self._cuda and pinned
        # [Note: routed experts] in routed.py: the most tokens a routing forward has (0: never route), and this
        # forward's kind.
        has_routed = any(layer.routed for ring in self.rings for layer in ring.layers)
        # On CUDA routed rows are read through the arena's mapped view, which needs it pinned.
        self.routed_max_tokens = routed_max_tokens if has_routed and (pinned or not self._cuda) else 0
        self.routing = False
        self._tokens: int | None = None  # of the latest forward `prepare`d outside a capture
        self.compiled = False  # compiled code has called the engine (through ops.py)
        self._host_warned = False  # experts meant for the host gathered over the link in a capture or compiled code
        self._caches = ExpertCaches([layer for ring in self.rings for layer in ring.layers])
        # copy_stream: runs every host-to-device weight copy. Ordered after the compute stream by a wait before each
        # copy (the slot may still be read by queued kernels); the compute stream is ordered after it by each layer's
        # `done` event.
        self.copy_stream = torch.cuda.Stream(device) if self._cuda else None
        # decode_stream: decodes compressed layers that hold their slot between forwards (`_decode_held`), each after
        # its copy's `done`. `_pending_decodes` keeps each such decode's end by ring and slot until the next copy into
        # that slot, which waits on it: the layer may leave its slot without running.
        self.decode_stream = torch.cuda.Stream(device) if self._cuda else None
        self._pending_decodes: dict[tuple[int, int], torch.cuda.Event] = {}
        self._timings = Timings(device)
        # [Note: shared links] in shared_links.py: other GPUs copy a share of every layer, joined into its `done`
        # event.
        self._links = (
            SharedLinks(device, links, [copy_pairs(layer, whole=True) for ring in self.rings for layer in ring.layers])
            if links
            else None
        )
        if self._cuda:
            for ring in self.rings:
                for layer in ring.layers:
                    layer.done = torch.cuda.Event()

    @property
    def graphs(self) -> bool:
        """A CUDA-graph capture has recorded (or begun recording) one of the rings: every forward then `prepare`s."""
        return any(ring.state is not RingState.EAGER for ring in self.rings)

    # --- The forward's three steps ---------------------------------------------------------------------------------

    def prefetch(self, ring: int, position: int) -> None:
        """Start copying layer `position` of `ring` into its slot, after all compute queued so far."""
        self._prefetch(self.rings[ring], position, self._capturing())

    def wait(self, ring: int, position: int) -> None:
        """Order the compute stream after layer `position`'s copy; load it now if its slot holds another layer."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        capturing = self._capturing()
        if capturing:
            self._wait_in_capture(transfers, position)
        else:
            transfers.python_ran = True  # no replay: its counts are made here
            if not transfers.holds(position):
                self._load_now(transfers, position)
            elif self._cuda and layer.done is not None:
                compute = torch.cuda.current_stream(self.device)
                if self.timing:
                    ready = timing_event()
                    ready.record(compute)
                    self._timings.add(layer.counters, ready, layer.done, "stall_seconds")
                compute.wait_event(layer.done)  # the join: compute after copy
        layer.gathered = False
        if layer.fill is Fill.ROUTED and not self.routing and layer.routed_whole_in_whole_forwards:
            self._complete(transfers, position, capturing)  # copied for a routing forward, running in a whole one
        self._decode(layer, capturing)
        if self.timing and not capturing:
            self._timings.begin_compute(layer)

    def release(self, ring: int, position: int) -> None:
        """Layer `position` has been queued: hand its slot to the next layer that uses it."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if layer.fill is Fill.ROUTED and not layer.gathered:
            raise RuntimeError(BYPASSED.format(position=position))
        if self._capturing():
            self._release_in_capture(transfers, position)
            return
        if self.timing:
            self._timings.end_compute(layer)
        self._prefetch(transfers, layer.next_in_slot, False)
        if position == len(transfers.layers) - 1:
            transfers.end_forward()

    def _prefetch(self, transfers: RingTransfers, position: int, capturing: bool) -> None:
        layer = transfers.layers[position]
        if transfers.slots.holds(layer.slot, position):
            return  # already there or on its way
        whole = self._whole(layer, position, capturing)
        with transfers.slots.claim(layer.slot, position):  # [Note: slot reuse] in ring.py: owned once issued
            layer.decoded = not layer.decodes
            layer.counters.copies += 1
            layer.counters.copied_bytes += copy_bytes(layer, whole)
            layer.fill = Fill.WHOLE if whole else Fill.ROUTED
            if not self._cuda:
                self._copy_on_host(layer, whole)
                layer.event = CopyEvent.ON_STREAM
                return
            if capturing:
                self._record_copy(transfers, position, whole)
                return
            # The fork: copy after compute (the slot's previous layer may still read it), and after a decode of the
            # slot's staging buffer still pending on the decode stream.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            decoding = self._pending_decodes.pop((id(transfers), layer.slot), None)
            if decoding is not None:
                self.copy_stream.wait_event(decoding)
            with torch.cuda.stream(self.copy_stream):
                if self.timing:
                    self._timings.poll()
                    begin, layer.done, layer.event = timing_event(), timing_event(), CopyEvent.ON_STREAM
                    begin.record()
                    self._timings.add(layer.counters, begin, layer.done, "copy_seconds")
                elif layer.event is not CopyEvent.ON_STREAM or layer.done is None:
                    layer.done, layer.event = torch.cuda.Event(), CopyEvent.ON_STREAM
                if self._links is None:
                    copy_all(layer, self._non_blocking, None, whole)
                    fetch_ahead(layer, whole, self._tokens)
                    layer.done.record()
                    return
                # [Note: shared links] in shared_links.py: the helper GPUs' peer copies into the slot wait on the
                # compute stream as well.
                slot_free = torch.cuda.current_stream(self.device).record_event()
                copy_all(layer, self._non_blocking, None, whole, self._links, slot_free)
                fetch_ahead(layer, whole, self._tokens)
                self._links.land(layer.done, self.copy_stream)

    def _load_now(self, transfers: RingTransfers, position: int) -> None:
        # [Note: misses]: copy on the compute stream, after any copy into the slot still in flight.
        layer = transfers.layers[position]
        capturing = self._capturing()
        whole = self._whole(layer, position, capturing)
        with transfers.slots.claim(layer.slot, position):
            layer.decoded = not layer.decodes
            layer.counters.misses += 1
            layer.counters.copies += 1
            layer.counters.copied_bytes += copy_bytes(layer, whole)
            layer.fill = Fill.WHOLE if whole else Fill.ROUTED
            if not self._cuda:
                self._copy_on_host(layer, whole, fetch=False)
                self._decode(layer, capturing)
                return
            compute = torch.cuda.current_stream(self.device)
            if not capturing:
                self._after_copies(compute)
            elif self._copy_stream_in_capture():
                compute.wait_stream(self.copy_stream)
            fetched_nothing(layer, whole)  # after every copy still in flight, which may fetch for it
            if capturing:
                self._check_capturable()
                copy_all(layer, self._non_blocking, compute, whole)
            elif self.timing:
                begin = self._timings.begin_blocking()
                copy_all(layer, self._non_blocking, None, whole)
                self._timings.end_blocking(layer.counters, begin)
            else:
                copy_all(layer, self._non_blocking, None, whole)
            loaded_on(layer, compute, capturing, self.timing)
            self._decode(layer, capturing)

    # --- Around each forward ---------------------------------------------------------------------------------------

    def prepare(self, tokens: int | None = None) -> None:
        """Before each forward of `tokens` tokens (None: unknown): choose whether it routes experts ([Note: routed
        experts] in routed.py); forget aborted captures; once a CUDA graph has recorded copies, load each ring's first
        layers that are not in their slots and order the compute stream after every copy issued so far; on CUDA, before
        a whole forward, complete first layers copied for routing."""
        if self._capturing():
            return
        self.routing = tokens is not None and 0 < tokens <= self.routed_max_tokens
        self._tokens = tokens
        if self.routing:
            self._caches.before_routing_forward(self._non_blocking)
        else:
            self._caches.before_whole_forward()
        if not self._cuda:
            return
        for transfers in self.rings:
            transfers.settle()  # the previous forward may have been replayed and stopped before its `finish`
            transfers.abort_capture()  # a capture that ended before its join
            transfers.begin_forward(tokens)
            if self.graphs:
                for position in transfers.missing_first_layers():
                    self._load_now(transfers, position)
            if not self.routing:
                # First layers copied for routing, in a whole forward: completed here, outside any graph (a whole
                # graph's replay completes nothing, and one recorded completion would copy on every replay).
                for position in transfers.first_layers_without_routed():
                    self._complete(transfers, position, capturing=False)
        if self.graphs:
            self._after_copies(torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """After each forward, once a CUDA graph has recorded copies: start copying each ring's first layers into
        their slots where a replay (which leaves its last layers there) or a capture did not. Then decode compressed
        layers that hold their slot."""
        if self._capturing():
            return
        if self._cuda and self.graphs:
            for transfers in self.rings:
                transfers.settle()
                for position in transfers.missing_first_layers():
                    self._prefetch(transfers, position, capturing=False)
        self._decode_held()

    # --- Outside the forward ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Fill every slot with its first layer (called once the parameters point at the pool)."""
        for transfers in self.rings:
            for position in range(transfers.num_first):
                self._prefetch(transfers, position, capturing=False)
        self._decode_held()

    def holds(self, ring: int, position: int) -> bool:
        """Whether layer `position`'s weights are in its slot (or on their way), outside a capture."""
        self._settle()
        return self.rings[ring].holds(position)

    def holds_whole(self, ring: int, position: int) -> bool:
        """Whether layer `position`'s slot holds all of its tensors: not so after a copy for a routing forward, whose
        routed tensors hold only the rows their router picked ([Note: routed experts] in routed.py)."""
        return self.rings[ring].layers[position].fill is Fill.WHOLE  # a layer without routed tensors always is

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has landed."""
        if self._cuda:
            self.copy_stream.synchronize()
            self.decode_stream.synchronize()
        if self._links is not None:
            self._links.synchronize()

    def drain(self) -> None:
        """Block the host until every copy and every kernel queued so far have finished (before host storage or a
        slot is rewritten outside the forward: no copy may still read the one, no kernel the other)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        if self._links is not None:
            self._links.synchronize()
        for transfers in self.rings:
            transfers.abort_capture()  # a capture under way would have joined: one that is still open was aborted
        self._settle()

    def invalidate(self, ring: int | None = None, position: int | None = None) -> None:
        """Host storage is about to be rewritten: forget the slot of layer `position` of `ring` (every slot of `ring`
        when `position` is None, of every ring when `ring` is None). Done before the write, so that an interrupt
        anywhere after it leaves a layer that loads its new values
        (a miss), never one that computes with its old ones."""
        self._settle()
        for index, transfers in enumerate(self.rings):
            if ring is None or (index == ring and position is None):
                transfers.slots.forget()
                for layer in transfers.layers:
                    forget_cache(layer)
            elif index == ring:
                transfers.slots.release(transfers.layers[position].slot, position)
                forget_cache(transfers.layers[position])

    def load(self, ring: int, position: int) -> None:
        """Copy layer `position` into its slot now, on the compute stream, and make it the slot's owner.

        For work outside the forward (reloading weights): neither a transfer nor a miss is counted.
        """
        self._settle()
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        with transfers.slots.claim(layer.slot, position):
            layer.decoded = not layer.decodes
            layer.fill = Fill.WHOLE
            if self._cuda:
                compute = torch.cuda.current_stream(self.device)
                self._after_copies(compute)
                copy_all(layer, self._non_blocking, None, whole=True)
                loaded_on(layer, compute, capturing=False, timing=self.timing)
            else:
                copy_all(layer, self._non_blocking, None, whole=True)
            self._decode(layer, capturing=False)

    def _owned_settled(self, ring: int, position: int) -> LayerTransfer:
        # Layer `position` of `ring`, which must own its slot, once every copy and decode issued so far has landed
        # (on CUDA: for the current stream).
        self._settle()
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if not transfers.holds(position):
            raise RuntimeError(f"Layer {position} of ring {ring} does not own slot {layer.slot}: nothing to store.")
        if self._cuda:
            self._after_copies(torch.cuda.current_stream(self.device))
        return layer

    def store(self, ring: int, position: int, encoded: dict[int, torch.Tensor] | None = None) -> None:
        """Copy the contents of layer `position`'s slot back into its host storage; the layer must own the slot.
        `encoded`: what `encode_slot` gave for it (computed here when None)."""
        if encoded is None:
            encoded = self.encode_slot(ring, position)  # every compressed parameter before the first write
        layer = self._owned_settled(ring, position)
        if layer.reads is not None:  # its host storage is the checkpoint's pages, mapped read-only
            raise RuntimeError(f"hf_prefetch: ring position {position} is read from its files: nothing to store into.")
        # Blocking: the host may read or rewrite its storage as soon as this returns. Routed tensors only from a whole
        # slot: a routed one holds copies of host rows, or another layer's. Compressed ones write their encoded bytes.
        staged = {id(item.staged) for item in layer.decodes}
        pairs = list(zip(layer.host, layer.device, strict=True))
        if layer.fill is Fill.WHOLE:
            pairs += [(tensor.host, tensor.device) for tensor in layer.routed]
        for host, device in pairs:
            if id(device) in staged:
                host.copy_(encoded[id(device)])
                device.copy_(host)  # the staging buffer keeps what a later decode (or a replay) reads
            else:
                host.copy_(device)
        forget_cache(layer)  # its host storage holds what the slot held: the cache's rows may be older

    def refresh(self, ring: int, position: int) -> None:
        """Layer `position`'s host storage was rewritten: copy it again if it owns its slot."""
        self._settle()
        forget_cache(self.rings[ring].layers[position])
        if self.rings[ring].holds(position):
            self.load(ring, position)

    def refill(self) -> None:
        """Host storage was rewritten: forget what every slot holds and copy each ring's first layers again.

        Without it a slot would keep the old bytes of the layer it is tagged with, and that layer would compute with
        them without a miss.
        """
        self.invalidate()
        self.start()
        if self._cuda:  # a CUDA-graph replay, which waits for none of these copies, may come next
            self._after_copies(torch.cuda.current_stream(self.device))

    # --- Statistics ------------------------------------------------------------------------------------------------

    def collect(self) -> None:
        """Wait for the device and fold every pending timing measurement and the expert caches' counts into the
        counters."""
        self._timings.collect()
        self._caches.collect()

    def reset(self) -> None:
        self.collect()
        for transfers in self.rings:
            for layer in transfers.layers:
                layer.counters = LayerCounters()

    def _copy_on_host(self, layer: LayerTransfer, whole: bool, fetch: bool = True) -> None:
        # CPU execution: the copy is synchronous, so all of it is time the forward waits. A miss (`fetch` False) has
        # nothing fetched ahead: the gather that follows copies every pick.
        begin = self._timings.begin_blocking() if self.timing else None
        copy_all(layer, False, None, whole, self._links)
        if fetch:
            fetch_ahead(layer, whole, self._tokens)
        else:
            fetched_nothing(layer, whole)
        if begin is not None:
            self._timings.end_blocking(layer.counters, begin)

    # --- Helpers ---------------------------------------------------------------------------------------------------

    def _settle(self) -> None:
        for transfers in self.rings:
            transfers.settle()

    def _after_copies(self, stream: torch.cuda.Stream) -> None:
        # Order `stream` after every copy issued so far, through every link (outside a capture).
        stream.wait_stream(self.copy_stream)
        stream.wait_stream(self.decode_stream)
        if self._links is not None:
            self._links.order_after(stream)
