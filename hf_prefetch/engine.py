"""The transfer engine: the one owner of the copy stream and the copy events.

It moves bytes from host storage into pool slots (`prefetch`), orders the compute stream after them (`wait`) and
hands a slot to its next layer once the current one has run (`release`). It knows layers only as positions in a ring;
it knows nothing about modules, hooks or transformers. The per-ring bookkeeping (slot table, CUDA-graph state,
capture) is `ring.py`'s; this module decides when it changes.

[Note: stream ordering]
Two streams: the compute stream (whatever stream is current when a layer runs) and the engine's copy stream (and a
decode stream for compressed layers between forwards: see [Note: compressed streaming]).
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

[Note: compile and CUDA graphs]
Under torch.compile the hooks call the custom ops of `ops.py`, which call `wait` and `release` with their real
arguments each time the compiled code runs. Under CUDA-graph capture they run once, while the graph is recorded, and
replays run no Python. So, per ring (`RingState` in ring.py):
- Fork: a copy issued in a capture makes the copy stream wait on the capturing stream, which joins the copy stream
  to the capture; its copies become memcpy nodes (`driver.captured_copy`), each followed by a fresh event that
  belongs to the graph (`CopyEvent.IN_GRAPH`).
- Wait: for a copy recorded in the same capture the compute stream waits on its event (a graph edge). A copy issued
  before the capture (each ring's first layers) is not waited for: an event recorded outside a capture cannot be
  waited on inside it. It has landed: torch.cuda.graph and inductor's CUDA graphs synchronise before capturing, and
  before every later forward `prepare` orders the compute stream after every copy issued so far.
- Join: after its last layer's `release` each ring joins the copy stream back into the capture (CUDA requires a
  capture to join every stream it forked), so the graph ends after its copies.
- Finish: the copies of the next forward's first layers are not recorded: a graph ends only when every copy it
  started landed, which would keep the copy engine idle through the host's work between replays. A forward hook on
  the model runs `finish` after every forward, outside any graph: it copies each ring's first layers that are not in
  their slots, so the copy engine works through the host's gap.
- Settle: a replay leaves its ring's last layers in the slots without telling the table. A recorded ring's table is
  trusted only once its last layer released in Python since `prepare` (`RingState.SETTLED`); otherwise
  (`IN_FLIGHT`) `settle` forgets the slots that take turns. It runs in `finish`, in `prepare` and before every use of
  the table outside a forward (`holds`, `store`, `refresh`, `load`, `drain`): `finish` may never run, if an
  exception or a KeyboardInterrupt lands between a replay and the model's forward hook.
- Abort: a capture that fails while recording never joins. What it left (recorded copies, slots claimed by copies
  that were only recorded) is forgotten when the ring's forward begins in a new capture, at `prepare` and at `drain`.
Limits: the copy stream is joined only at a ring's last layer, so CUDA graphs need the decoder stack captured as one
graph; a graph break inside it fails the capture (`cudaErrorStreamCaptureUnjoined`): compile with mode="default".

[Note: routed experts]
A ROUTED parameter (an expert tensor: dimension 0 indexes experts) sits in its layer's slot like any streamed one,
but a forward of few tokens needs only the experts its router picks. Each forward is one of two kinds, chosen in
`prepare` from its token count (`routing`: at most `routed_max_tokens` tokens):
- Routing: a layer's copy brings every tensor but the routed ones (`Fill.ROUTED`). When the experts module runs, its
  hook calls `gather` with the router's choice: on the compute stream, after the layer's `wait`, the rows of the
  chosen experts are read from host memory (on CUDA through the arena's mapped view, by the GPU: no host
  synchronisation, fixed shapes) and written into the same rows of the slot. The experts' forward then runs
  unchanged on the slot with the router's own indices: the rows it reads are exactly the host's, the rows it does
  not read may hold another layer's experts. Repeated experts (several tokens picking one) are copied once per pick.
- Whole: copies bring every tensor (`Fill.WHOLE`), as for STREAMED parameters; `gather` has nothing to do.
A layer copied in one kind may run in the other (the next forward's first layers are copied at the end of the one
before): a `Fill.ROUTED` layer in a whole forward is completed by copying its routed tensors whole (a completion; by
`prepare` for a ring's first layers on CUDA, by `wait` otherwise), and outside a capture `gather` finds a
`Fill.WHOLE` layer complete. A layer that owns its slot is always copied whole.
`store` writes back routed tensors only from a whole slot: the rows of a routed one are copies of host memory, or
stale.
CUDA graphs: a graph is recorded for one input shape, so for one token count: its kind is fixed (`routing` is a
function of the token count and of `routed_max_tokens`, which does not change after dispatch), and replays run no
Python:
- A routing graph records each layer's copy without its routed tensors and its gather: index_select through the
  mapped view, reading the index the replay's router wrote, so every replay copies its own picks. Its first layers
  are copied outside the graph (`finish`, `prepare`) and may be whole or routed-only at a replay: the graph gathers
  their rows either way (a whole slot gets its own rows again).
- A whole graph records whole copies. Its first layers may have been copied for routing (by `finish` after a
  routing forward): `prepare`, which knows the next forward's token count, completes them before it runs.
With an expert cache (`ring.ExpertCache`), `gather` copies each pick from the cache's row when the cache holds it
and from host memory otherwise, looked up on the device (`slot_of`), so it needs no host synchronisation and CUDA
graphs record it like the plain gather. The cache's rows change only in `prepare`, outside any forward and any
capture, on the compute stream: after every kernel of the previous forward, before any of the next (replays
included) read them. A row's lookup entry is cleared before its new values are copied and set after: no kernel finds a
row that holds another expert. `invalidate`, `store` and `refresh` (host rewritten) clear every entry at once and the
next routing forward's `prepare` loads the cache again.
With recent picks (`ring.RecentPicks`), a copy for a routing forward also fetches, on the copy stream after its
copies and before its `done`, the rows of the experts the layer picked in its latest forward (`fetch_recent`), and
marks them `ready`; `gather` leaves a ready pick alone. `ready` describes the latest copy of the layer into its slot:
each routing copy rewrites it before writing a row, a miss's routing copy (`_load_now`) clears it, and a whole copy
makes every row the layer's own. The picks are recorded on the compute stream in `gather` (`remember_picks`), so the
layer's next copy, which forks from the compute stream after the layer ran, reads them.

[Note: compressed streaming]
A compressed parameter (`ParamSpec.compressed`; see codec.py) keeps its encoded bytes in host memory. Its copy is an
ordinary copy of those bytes, on the copy stream like every other, into the slot's staging buffer (one per slot, a
pool buffer like the others), and the layer's `wait` decodes them into the slot buffer on the compute stream, after
the compute stream waited on `done` and before the layer's kernels. So:
- The slot buffer is written only on the compute stream, after every kernel of the layer that used the slot before
  (stream order): the same guarantee a copy gets from its fork. Between forwards (below) it is written on the decode
  stream after the layer's copy, whose fork gave that guarantee already.
- The staging buffer is rewritten only by the next copy into the slot, which forks from the compute stream after the
  layer released, so after its decode.
- The link never waits for a decode: copies keep their stream to themselves, and with two or more slots the copy of
  the next layer in a slot is queued behind the other slots' copies long before the link reaches it. Decoding costs
  compute-stream time instead (`decode_seconds`), which batch-1 decode has to spare while it waits on the link.
- `decoded` says whether the slot holds the values of its latest copy: cleared when a copy is issued, set by the
  decode. A miss and `load` decode at once, and `start` and `finish` decode every layer that holds its slot (on
  CUDA on a third stream, the decode stream, behind the layer's copy, recording `done` again after the decode; the
  next copy into the slot waits on that decode as well): between forwards a parameter shows its layer's values once
  its copy is done, as uncompressed. `store` encodes the slot's values back into host storage (`encode_slot`: every
  parameter before the first write) and the staging buffer. In a capture the decode is recorded at every wait,
  whatever `decoded` says, so each replay decodes what the copies before it brought.
Layers that own their slot are copied once and are not compressed; routed and mapped tensors are never compressed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .changes import deferred_interrupts
from .codec import TooManyEscapes, decode, encode
from .driver import captured_copy
from .experts import (
    ExpertCaches,
    copy_routed_rows,
    count_picks,
    fetch_recent,
    forget_cache,
    gather_looked_up,
    remember_picks,
)
from .links import SharedLinks
from .ring import CopyEvent, Fill, LayerCounters, LayerTransfer, RingState, RingTransfers
from .timing import Timings, timing_event

__all__ = ["PrefetchEngine"]


class PrefetchEngine:
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
        # [Note: routed experts]: the most tokens a routing forward has (0: never route), and this forward's kind.
        has_routed = any(layer.routed for ring in self.rings for layer in ring.layers)
        # On CUDA routed rows are read through the arena's mapped view, which needs it pinned.
        self.routed_max_tokens = routed_max_tokens if has_routed and (pinned or not self._cuda) else 0
        self.routing = False
        self._tokens: int | None = None  # of the latest forward `prepare`d outside a capture
        self.compiled = False  # compiled code has called the engine (through ops.py)
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
        # [Note: shared links] in links.py: other GPUs copy a share of every layer, joined into its `done` event.
        self._links = (
            SharedLinks(device, links, [_pairs(layer, whole=True) for ring in self.rings for layer in ring.layers])
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

    # --- The forward's three steps ----------------------------------------------------------------------------------

    def prefetch(self, ring: int, position: int) -> None:
        """Start copying layer `position` of `ring` into its slot, after all compute queued so far."""
        self._prefetch(self.rings[ring], position, self._capturing())

    def wait(self, ring: int, position: int) -> None:
        """Order the compute stream after layer `position`'s copy; load it now if its slot holds another layer."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        capturing = self._capturing()
        if capturing and (position == 0 or transfers.state is not RingState.CAPTURING):
            transfers.begin_capture()
        if not transfers.holds(position, capturing):
            self._load_now(transfers, position)
        elif capturing:
            if position in transfers.capture.copies:  # else copied before the capture: landed (see the Note)
                torch.cuda.current_stream(self.device).wait_event(layer.done)
        elif self._cuda and layer.done is not None:
            compute = torch.cuda.current_stream(self.device)
            if self.timing:
                ready = timing_event()
                ready.record(compute)
                self._timings.add(layer.counters, ready, layer.done, "stall_seconds")
            compute.wait_event(layer.done)
        layer.gathered = False
        if layer.fill is Fill.ROUTED and not self.routing:
            self._complete(transfers, position, capturing)  # copied for a routing forward, running in a whole one
        self._decode(layer, capturing)
        if self.timing and not capturing:
            self._timings.begin_compute(layer)

    def release(self, ring: int, position: int) -> None:
        """Layer `position` has been queued: hand its slot to the next layer that uses it."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        capturing = self._capturing()
        if layer.fill is Fill.ROUTED and not layer.gathered:
            raise RuntimeError(_BYPASSED.format(position=position))
        if self.timing and not capturing:
            self._timings.end_compute(layer)
        if not (capturing and layer.next_in_slot < position):
            # In a capture the next forward's first layers are left to `finish`, outside the graph.
            self._prefetch(transfers, layer.next_in_slot, capturing)
        if position == len(transfers.layers) - 1:
            if capturing:
                if transfers.capture is not None and transfers.capture.copies:
                    torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)  # the join
                transfers.join_capture()
            else:
                transfers.end_forward()

    def _prefetch(self, transfers: RingTransfers, position: int, capturing: bool) -> None:
        layer = transfers.layers[position]
        if transfers.slots.holds(layer.slot, position):
            return  # already there or on its way
        whole = self._whole(layer, position, capturing)
        with transfers.slots.claim(layer.slot, position):  # [Note: slot reuse]: owned once the copy is issued
            layer.decoded = not layer.decodes
            layer.counters.copies += 1
            layer.counters.copied_bytes += _nbytes(layer, whole)
            layer.fill = Fill.WHOLE if whole else Fill.ROUTED
            if not self._cuda:
                self._copy_on_host(layer, whole)
                layer.event = CopyEvent.ON_STREAM
                return
            # In a capture this fork makes the copy stream join it: its copies become nodes of the graph.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            decoding = self._pending_decodes.pop((id(transfers), layer.slot), None)
            if decoding is not None and not capturing:  # before a capture the device synchronises: it has ended
                self.copy_stream.wait_event(decoding)  # it may still read the staging buffer and write the slot
            with torch.cuda.stream(self.copy_stream):
                if capturing:
                    self._check_capturable()
                    layer.done, layer.event = torch.cuda.Event(), CopyEvent.IN_GRAPH
                    transfers.capture.copies.add(position)
                elif self.timing:
                    self._timings.poll()
                    begin, layer.done, layer.event = timing_event(), timing_event(), CopyEvent.ON_STREAM
                    begin.record()
                    self._timings.add(layer.counters, begin, layer.done, "copy_seconds")
                elif layer.event is not CopyEvent.ON_STREAM or layer.done is None:
                    layer.done, layer.event = torch.cuda.Event(), CopyEvent.ON_STREAM
                if capturing or self._links is None:
                    _copy_all(layer, self._non_blocking, self.copy_stream if capturing else None, whole)
                    _fetch_ahead(layer, whole, self._tokens)
                    layer.done.record()
                    return
                # [Note: shared links]: the helpers' peer copies into the slot wait on the compute stream as well.
                slot_free = torch.cuda.current_stream(self.device).record_event()
                _copy_all(layer, self._non_blocking, None, whole, self._links, slot_free)
                _fetch_ahead(layer, whole, self._tokens)
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
            layer.counters.copied_bytes += _nbytes(layer, whole)
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
            _fetched_nothing(layer, whole)  # after every copy still in flight, which may fetch for it
            if capturing:
                self._check_capturable()
                _copy_all(layer, self._non_blocking, compute, whole)
            elif self.timing:
                begin = self._timings.begin_blocking()
                _copy_all(layer, self._non_blocking, None, whole)
                self._timings.end_blocking(layer.counters, begin)
            else:
                _copy_all(layer, self._non_blocking, None, whole)
            _loaded_on(layer, compute, capturing, self.timing)
            self._decode(layer, capturing)

    # --- Compressed parameters ([Note: compressed streaming]) ------------------------------------------------------

    def _decode(self, layer: LayerTransfer, capturing: bool) -> None:
        # On the current (compute) stream, ordered after the layer's copy by the caller. In a capture it is recorded
        # whatever `decoded` says: a replay decodes what the copies before it brought into the staging buffer.
        if layer.decoded and not capturing:
            return
        begin = self._timings.begin_blocking() if self.timing and not capturing else None
        for item in layer.decodes:
            decode(item.staged, item.layout, item.out)
        if capturing:
            return
        layer.decoded = True
        layer.counters.decodes += 1
        layer.counters.decoded_bytes += sum(item.layout.raw_bytes for item in layer.decodes)
        layer.counters.compressed_bytes += sum(item.layout.nbytes for item in layer.decodes)
        if begin is not None:
            self._timings.end_span(layer.counters, begin, "decode_seconds")

    # --- Routed experts ([Note: routed experts]) ---------------------------------------------------------------------

    def gather(self, ring: int, position: int, index: torch.Tensor) -> None:
        """Before layer `position`'s experts module runs: copy the rows of the experts `index` names (the router's
        choice, any shape) into its slot, on the compute stream, unless the slot holds the whole layer (in a routing
        capture a layer whose slot takes turns gathers even then); in a whole forward, complete the layer."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        if not layer.routed:
            return
        capturing = self._capturing()
        if not transfers.holds(position, capturing):  # the experts module ran without its layer's wait
            self._load_now(transfers, position)
        layer.gathered = True
        if layer.recent is not None:  # for the layer's next copy (read on the copy stream, which forks later)
            remember_picks(layer, index, self.routing)
        # In a routing capture a layer whose slot takes turns gathers even when whole: a first layer (copied before
        # the capture) may be whole now and copied for routing before a replay.
        if layer.fill is Fill.WHOLE and not (capturing and self.routing and layer.next_in_slot != position):
            if layer.cache is not None:
                count_picks(layer, index)
            return
        if not self.routing:
            if layer.cache is not None:
                count_picks(layer, index)  # a prefill's picks rank the cache for the decode after it
            self._complete(transfers, position, capturing)
            return
        # Recorded in a capture, each replay reads its own router's choice. A gather holds the compute stream for all
        # of its time: copy time and stall time alike.
        begin = self._timings.begin_blocking() if self.timing and not capturing else None
        if layer.tallies is None:
            copy_routed_rows(layer, index)
        else:
            gather_looked_up(layer, index)
        if begin is not None:
            self._timings.end_blocking(layer.counters, begin)

    def _complete(self, transfers: RingTransfers, position: int, capturing: bool) -> None:
        # A layer copied without its routed tensors runs in a whole forward: copy them now, on the compute stream. It
        # is marked whole only once the copies are issued (an interrupt before that costs one more completion).
        layer = transfers.layers[position]
        layer.counters.completions += 1
        layer.counters.copied_bytes += sum(t.nbytes for t in layer.routed)
        if not self._cuda:
            for tensor in layer.routed:
                tensor.device.copy_(tensor.host)
            layer.fill = Fill.WHOLE
            return
        compute = torch.cuda.current_stream(self.device)
        if capturing:
            # Recorded only: outside the graph the slot still lacks the routed tensors. Like a copy recorded in the
            # capture, the layer's slot is released if the capture aborts, and forgotten at its join.
            self._check_capturable()
            for tensor in layer.routed:
                captured_copy(tensor.device, tensor.host, compute)
            layer.done, layer.event = torch.cuda.Event(), CopyEvent.IN_GRAPH
            layer.done.record(compute)
            transfers.capture.copies.add(position)
            layer.fill = Fill.WHOLE
            return
        self._after_copies(compute)  # after any copy into the slot still in flight
        for tensor in layer.routed:
            tensor.device.copy_(tensor.host, non_blocking=self._non_blocking)
        layer.fill = Fill.WHOLE

    def _whole(self, layer: LayerTransfer, position: int, capturing: bool) -> bool:
        # A copy brings the routed tensors too unless this forward routes; a layer alone in its slot keeps it whole.
        return not layer.routed or not self.routing or layer.next_in_slot == position

    # --- Around each forward ---------------------------------------------------------------------------------------

    def prepare(self, tokens: int | None = None) -> None:
        """Before each forward of `tokens` tokens (None: unknown): choose whether it routes experts ([Note: routed
        experts]); forget aborted captures; once a CUDA graph has recorded copies, load each ring's first layers that
        are not in their slots and order the compute stream after every copy issued so far; on CUDA, before a whole
        forward, complete first layers copied for routing."""
        if self._capturing():
            return
        self.routing = tokens is not None and 0 < tokens <= self.routed_max_tokens
        self._tokens = tokens
        if self.routing:
            self._caches.before_routing_forward(self._non_blocking)
        if not self._cuda:
            return
        for transfers in self.rings:
            transfers.settle()  # the previous forward may have been replayed and stopped before its `finish`
            transfers.abort_capture()  # a capture that ended before its join
            transfers.begin_forward()
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

    def _decode_held(self) -> None:
        # Between forwards a layer that holds its slot shows its values, compressed or not: a parameter read or edited
        # there (sync_from_device writes such edits back) must not be its undecoded slot. On CUDA the decode is queued
        # on the decode stream behind its copy (the host, the compute stream and the other copies go on: the next
        # forward's first layers keep landing while the host prepares it) and `done` is recorded again after it, so
        # whatever waits for the copy (a forward, a miss, `torch.cuda.synchronize()`) also waits for the values, as
        # uncompressed. A replay, which runs no Python, decodes again what its copies brought.
        for transfers in self.rings:
            for position, layer in enumerate(transfers.layers):
                if layer.decoded or not transfers.holds(position):
                    continue
                if not self._cuda:
                    self._decode(layer, capturing=False)
                    continue
                if layer.event is not CopyEvent.ON_STREAM or layer.done is None:
                    continue  # copied inside a graph (whose replay decodes it) or landed for good (never compressed)
                # All or nothing under an interrupt: a layer marked decoded whose `done` did not yet follow the
                # decode would compute while the decode still writes its slot.
                with deferred_interrupts(), torch.cuda.stream(self.decode_stream):
                    self.decode_stream.wait_event(layer.done)  # the copy, through every link
                    decoded = timing_event() if self.timing else torch.cuda.Event()  # a stall is timed against it
                    self._decode(layer, capturing=False)
                    decoded.record(self.decode_stream)
                    layer.done = decoded
                    self._pending_decodes[id(transfers), layer.slot] = decoded

    # --- Outside the forward ----------------------------------------------------------------------------------------

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
        routed tensors hold only the rows their router picked ([Note: routed experts])."""
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
                _copy_all(layer, self._non_blocking, None, whole=True)
                _loaded_on(layer, compute, capturing=False, timing=self.timing)
            else:
                _copy_all(layer, self._non_blocking, None, whole=True)
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

    def encode_slot(self, ring: int, position: int) -> dict[int, torch.Tensor]:
        """The encoded bytes of the compressed parameters of layer `position`'s slot (by id of their staging view),
        for `store`; ValueError, naming the parameter, for values that do not fit their layout. Writes nothing."""
        layer = self._owned_settled(ring, position)
        self._decode(layer, capturing=False)
        encoded = {}
        for item in layer.decodes:
            try:
                encoded[id(item.staged)] = encode(item.out.cpu(), item.layout)
            except TooManyEscapes as error:
                message = _TOO_MANY_ESCAPES.format(name=item.name, found=error.found, capacity=error.capacity)
                raise ValueError(message) from None
        return encoded

    def store(self, ring: int, position: int, encoded: dict[int, torch.Tensor] | None = None) -> None:
        """Copy the contents of layer `position`'s slot back into its host storage; the layer must own the slot.
        `encoded`: what `encode_slot` gave for it (computed here when None)."""
        if encoded is None:
            encoded = self.encode_slot(ring, position)  # every compressed parameter before the first write
        layer = self._owned_settled(ring, position)
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

    # --- Statistics -------------------------------------------------------------------------------------------------

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
        _copy_all(layer, False, None, whole, self._links)
        if fetch:
            _fetch_ahead(layer, whole, self._tokens)
        else:
            _fetched_nothing(layer, whole)
        if begin is not None:
            self._timings.end_blocking(layer.counters, begin)

    # --- Helpers ----------------------------------------------------------------------------------------------------

    def _settle(self) -> None:
        for transfers in self.rings:
            transfers.settle()

    def _after_copies(self, stream: torch.cuda.Stream) -> None:
        # Order `stream` after every copy issued so far, through every link (outside a capture).
        stream.wait_stream(self.copy_stream)
        stream.wait_stream(self.decode_stream)
        if self._links is not None:
            self._links.order_after(stream)

    def _capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _copy_stream_in_capture(self) -> bool:
        # A copy recorded in the capture under way joined the copy stream to it: it may be waited on.
        return any(r.capture is not None and r.capture.copies for r in self.rings)

    def _check_capturable(self) -> None:
        if not self._non_blocking:
            raise RuntimeError(
                "hf_prefetch: a CUDA graph cannot capture copies from pageable host memory, and the offloaded weights "
                "could not be pinned. Make pinning possible (see 'Troubleshooting' in docs/getting_started.md) or "
                "run without CUDA graphs (torch.compile mode='default')."
            )


def _loaded_on(layer: LayerTransfer, stream: torch.cuda.Stream, capturing: bool, timing: bool) -> None:
    # The layer's latest copy ran on `stream`: `done` now marks its end. A fresh event, since a pending timing
    # measurement may still hold the old one; a timing one when stalls are measured against it.
    layer.done = timing_event() if timing and not capturing else torch.cuda.Event()
    layer.event = CopyEvent.IN_GRAPH if capturing else CopyEvent.ON_STREAM
    layer.done.record(stream)


_TOO_MANY_ESCAPES = (
    "The value of {name} in its slot has {found} weights whose exponent is outside its 15 most common ones; its "
    "compressed host storage holds {capacity}. Nothing was written. Dispatch again (hf_prefetch.remove_offload, then "
    "dispatch_model) to encode the values afresh, or dispatch with PrefetchConfig(compress=False)."
)

_BYPASSED = (
    "hf_prefetch: streamed layer {position} ran while its slot held only the experts its router picked, but its "
    "experts module's forward (whose hook copies them) was not called: something replaced the mixture-of-experts "
    "block's forward (a hub kernel with use_kernels=True, a patched module), so it may have read other experts' "
    "weights. Its output was discarded. Dispatch with PrefetchConfig(routed_experts=False)."
)


def _fetch_ahead(layer: LayerTransfer, whole: bool, tokens: int | None) -> None:
    # With a copy for a routing forward, on its stream: the experts the layer picked in its latest forward
    # ([Note: routed experts]). It rewrites `recent.ready`, which must describe this copy, never an older one.
    if not whole and layer.recent is not None:
        fetch_recent(layer, tokens)


def _fetched_nothing(layer: LayerTransfer, whole: bool) -> None:
    # With a miss's copy for a routing forward, on its stream: the gather that follows copies every pick, and no row
    # an older copy fetched may be found ready.
    if not whole and layer.recent is not None:
        layer.recent.ready.zero_()


def _nbytes(layer: LayerTransfer, whole: bool) -> int:
    return layer.nbytes + (sum(t.nbytes for t in layer.routed) if whole else 0)


def _pairs(layer: LayerTransfer, whole: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # (slot, host) of every tensor a copy brings (one byte range where they lie so): the routed ones only when whole.
    pairs = [layer.span] if layer.span is not None else list(zip(layer.device, layer.host, strict=True))
    if whole:
        pairs += [(tensor.device, tensor.host) for tensor in layer.routed]
    return pairs


def _copy_all(
    layer: LayerTransfer,
    non_blocking: bool,
    captured_on: torch.cuda.Stream | None = None,
    whole: bool = True,
    links: SharedLinks | None = None,
    slot_free: torch.cuda.Event | None = None,
) -> None:
    pairs = _pairs(layer, whole)
    if links is not None:  # the helpers' shares are issued; the execution device copies the rest
        pairs = links.copy(pairs, non_blocking, slot_free)
    if captured_on is not None:
        for dst, src in pairs:
            captured_copy(dst, src, captured_on)
        return
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)
