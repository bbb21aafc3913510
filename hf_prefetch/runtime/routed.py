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

from ..config import warn_at_caller
from ..planning.host_compute import pick_host_experts, split_inputs
from .experts import copy_routed_rows, count_picks, fetch_recent, gather_looked_up, remember_picks
from .file_experts import CAPTURE_REFUSED as EXPERTS_REFUSED
from .graph_copies import captured_copy
from .host_experts import HostExperts, HostSplit, locate
from .ring import CopyEvent, Fill, LayerTransfer, RingTransfers

__all__ = ["RoutedFills", "BYPASSED", "fetch_ahead", "fetched_nothing"]

ON_THE_LINK = (
    "hf_prefetch: PrefetchConfig(cpu_experts={mode!r}) computes experts on the host only in eager forwards: the host "
    "reads the router's choice, which a CUDA-graph capture or torch.compile's graph cannot. This {where} gathers "
    "them over the link (the same results as cpu_experts=False)."
)

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
        if layer.host_share and (capturing or self.compiled) and not self._host_warned:
            self._host_warned = True
            where = "capture" if capturing else "compiled forward"
            warn_at_caller(ON_THE_LINK.format(mode=True if layer.host_always else "auto", where=where))
        if not transfers.holds(position, capturing):  # the experts module ran without its layer's wait
            self._load_now(transfers, position)
        if layer.files is not None:  # [Note: experts read from files] in file_experts.py, in every forward
            if capturing:
                raise RuntimeError(EXPERTS_REFUSED.format(layers=f"(ring position {position})"))
            begin = self._timings.begin_blocking() if self.timing else None
            layer.files.gather(layer, index, self._cuda)
            if begin is not None:
                self._timings.end_blocking(layer.counters, begin)
            layer.gathered = True
            return
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
        self._copy_picks(layer, index, capturing)

    def _copy_picks(self, layer: LayerTransfer, index: torch.Tensor, capturing: bool) -> None:
        # Recorded in a capture, each replay reads its own router's choice. A gather holds the compute stream for all
        # of its time: copy time and stall time alike.
        begin = self._timings.begin_blocking() if self.timing and not capturing else None
        if layer.tallies is None:
            copy_routed_rows(layer, index)
        else:
            gather_looked_up(layer, index)
        if begin is not None:
            self._timings.end_blocking(layer.counters, begin)

    # --- Experts on the host ([Note: experts on the host] in host_experts.py) -------------------------------------

    def computes_on_host(self, host: HostExperts) -> bool:
        """Whether this call of `host`'s experts module computes on the host: eager, outside a capture, in every
        forward (`cpu_experts=True`) or in forwards that route (`"auto"`)."""
        return (host.always or self.routing) and not self._capturing()

    def experts_on_host(
        self, ring: int, position: int, host: HostExperts, index_arg: str, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """Steps 1-5 of [Note: experts on the host]: the device's picks copied into the slot, the host's part
        computed; returns the arguments of the module's forward on the device."""
        transfers = self.rings[ring]
        layer = transfers.layers[position]
        hidden, index, weights = locate(args, kwargs, index_arg)
        if not (isinstance(hidden, torch.Tensor) and isinstance(weights, torch.Tensor)):
            raise TypeError(
                f"hf_prefetch: the experts module of streamed layer {position} was called without hidden states and "
                "routing weights as tensors, which PrefetchConfig(cpu_experts=...) needs to compute it on the host."
            )
        if not transfers.holds(position):  # the experts module ran without its layer's wait
            self._load_now(transfers, position)
        if layer.fill is Fill.WHOLE and not host.always:  # the slot holds every expert: nothing crosses the link
            self.gather(ring, position, index)
            return args, kwargs
        if not host.splits(index.shape[0]):  # predicted: the link alone is sooner, and no synchronisation is paid
            self.gather(ring, position, index)
            return args, kwargs
        index_h, weights_h, hidden_h = self._read_on_host([index, weights, hidden])
        on_host = pick_host_experts(index_h, host.num_experts, host.count)
        if not on_host:
            self.gather(ring, position, index)
            return args, kwargs
        layer.gathered = True
        if layer.recent is not None:
            remember_picks(layer, index, self.routing)
        host_side, device_side = split_inputs(index_h, weights_h, on_host, host.num_experts)
        flat = [e for e in index_h.reshape(-1).tolist() if 0 <= e < host.num_experts]
        host_picks = [e for e in flat if e in on_host]
        layer.counters.host_picks += len(host_picks)
        layer.counters.host_bytes += len(on_host) * host.row_bytes
        if layer.cache is not None:  # the cache ranks every pick, wherever it computed
            count_picks(layer, torch.tensor(host_picks, device=index.device))
        rows_h, index_hs, weights_hs = host_side
        rows_d, picks = None, None
        hidden_d, index_d, weights_d = hidden[:0], index[:0], weights[:0]
        if device_side is not None:  # on the device before the gather starts: nothing below waits for it
            # Every device pick, a repeated one again, as a gather of the router's choice copies and counts them.
            picks = torch.tensor([e for e in flat if e not in on_host], device=index.device)
            rows_d, index_d, weights_d = (t.to(index.device) for t in device_side)
            hidden_d = hidden if rows_d.numel() == index.shape[0] else hidden.index_select(0, rows_d)
            index_d, weights_d = index_d.to(index.dtype), weights_d.to(weights.dtype)
        split = HostSplit(None, rows_h.to(hidden.device), rows_d, index_h.shape[0])
        if picks is not None:
            # Only the device's own picks cross the link. On CUDA the GPU reads them over the link while the host
            # computes its part.
            self._copy_picks(layer, picks, capturing=False)
        whole = rows_h.numel() == index_h.shape[0]
        split.result, seconds = host.run(hidden_h if whole else hidden_h[rows_h], index_hs, weights_hs)
        layer.counters.host_seconds += seconds
        host.pending = split
        return _replaced(args, kwargs, index_arg, hidden_d, index_d, weights_d)

    def experts_joined(self, ring: int, position: int, host: HostExperts, output: torch.Tensor) -> torch.Tensor:
        """Step 6 of [Note: experts on the host]: the host's result on the device, plus the device's."""
        split, host.pending = host.pending, None
        if split is None:
            return output
        out_h = split.result
        if self._cuda:  # from pinned memory, without the wait for the stream a copy from pageable memory makes
            out_h = torch.empty(out_h.shape, dtype=out_h.dtype, pin_memory=True).copy_(out_h)
            out_h = out_h.to(output.device, non_blocking=True)
        if split.device_rows is None and split.host_rows.numel() == split.tokens:
            return out_h
        result = torch.zeros((split.tokens, *out_h.shape[1:]), dtype=out_h.dtype, device=output.device)
        result.index_copy_(0, split.host_rows, out_h)
        if split.device_rows is not None:
            result.index_add_(0, split.device_rows, output.to(out_h.dtype))  # rows are unique: one add each
        return result

    def _read_on_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # One synchronisation with the compute stream, after the layer's wait.
        if not self._cuda:
            return tensors
        copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        return copies

    def _complete(self, transfers: RingTransfers, position: int, capturing: bool) -> None:
        # A layer copied without its routed tensors runs in a whole forward: copy them now, on the compute stream. It
        # is marked whole only once the copies are issued (an interrupt before that costs one more completion).
        layer = transfers.layers[position]
        if layer.files is not None:  # no host storage to copy from: its gathers read the picks in every forward
            raise RuntimeError(f"hf_prefetch: ring position {position} reads its experts from files, never whole.")
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
        # A copy brings the routed tensors too unless this forward routes or the host computes them in every forward
        # (`host_always`); a layer alone in its slot keeps it whole.
        if not layer.routed or layer.next_in_slot == position:
            return True
        return not self.routing and layer.routed_whole_in_whole_forwards


def _replaced(args: tuple, kwargs: dict, index_arg: str, hidden, index, weights) -> tuple[tuple, dict]:
    # The experts module's call with its three inputs replaced, each where the caller passed it.
    args, kwargs = list(args), dict(kwargs)
    for position, name, value in ((0, "hidden_states", hidden), (1, index_arg, index), (2, None, weights)):
        if len(args) > position:
            args[position] = value
        elif name is not None and name in kwargs:
            kwargs[name] = value
        elif name is None:
            key = next(k for k in kwargs if k not in ("hidden_states", index_arg))
            kwargs[key] = value
    return tuple(args), kwargs


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
