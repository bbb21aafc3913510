"""The engine's steps for routed experts: the rows of the experts a router picked copied into the layer's slot at
the experts module (`gather`), a layer copied for routing completed when it runs whole, and the recent picks
fetched ahead with its copy. Part of `PrefetchEngine` (engine.py); the lookups, the cache and the kernels are
experts.py's.

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
With recent picks (`ring.RecentPicks`), a copy for a routing forward also fetches, on the copy stream after its copies
and before its `done`, the rows of the experts the layer picked in its latest forward (`fetch_recent`), and marks them
`ready`, where the layer's measured policy says it pays (`expert_policy.py`: a flag on the device, so that replays
follow it too; the experts it would fetch are marked and counted either way); `gather` leaves a ready pick alone.
`ready` describes the latest copy of the layer into its slot: each routing copy rewrites it before writing a row, a
miss's routing copy (`_load_now`) clears it, and a whole copy makes every row the layer's own. The picks are recorded
on the compute stream in `gather` (`remember_picks`), so the layer's next copy, which forks from the compute stream
after the layer ran, reads them.
"""

from __future__ import annotations

import torch

from .experts import copy_routed_rows, count_picks, fetch_recent, gather_looked_up, remember_picks
from .graph_copies import captured_copy
from .ring import CopyEvent, Fill, LayerTransfer, RingTransfers

__all__ = ["RoutedFills", "BYPASSED", "fetch_ahead", "fetched_nothing"]

BYPASSED = (
    "hf_prefetch: streamed layer {position} ran while its slot held only the experts its router picked, but its "
    "experts module's forward (whose hook copies them) was not called: something replaced the mixture-of-experts "
    "block's forward (a hub kernel with use_kernels=True, a patched module), so it may have read other experts' "
    "weights. Its output was discarded. Dispatch with PrefetchConfig(routed_experts=False)."
)


class RoutedFills:
    """`PrefetchEngine`'s routed-expert steps ([Note: routed experts])."""

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


def fetch_ahead(layer: LayerTransfer, whole: bool, tokens: int | None) -> None:
    # With a copy for a routing forward, on its stream: the experts the layer picked in its latest forward
    # ([Note: routed experts]). It rewrites `recent.ready`, which must describe this copy, never an older one.
    if not whole and layer.recent is not None:
        fetch_recent(layer, tokens)


def fetched_nothing(layer: LayerTransfer, whole: bool) -> None:
    # With a miss's copy for a routing forward, on its stream: the gather that follows copies every pick, and no row
    # an older copy fetched may be found ready (nor counted as one a fetch would have brought).
    if not whole and layer.recent is not None:
        layer.recent.ready.zero_()
        layer.recent.marked.zero_()
