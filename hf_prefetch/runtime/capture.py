"""The engine's steps inside a CUDA-graph capture: a copy recorded into the graph, the compute stream's wait on it,
and the join at a ring's last layer. Part of `PrefetchEngine` (engine.py); the per-ring capture state is ring.py's.

[Note: compile and CUDA graphs]
Under torch.compile the hooks call the custom ops of `ops.py`, which call `wait` and `release` with their real
arguments each time the compiled code runs. Under CUDA-graph capture they run once, while the graph is recorded, and
replays run no Python. So, per ring (`RingState` in ring.py):
- Fork: a copy issued in a capture makes the copy stream wait on the capturing stream, which joins the copy stream
  to the capture; its copies become memcpy nodes (`graph_copies.captured_copy`), each followed by a fresh event that
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
- Count: a replay runs no Python, so its copies are counted by its capture: the counters a ring's capture added (in
  Python, between its first `wait` and its join) are kept by the forward's token count (`RingTransfers.recorded`),
  and `settle` adds them for each forward that ran no layer in Python (`python_ran`).
- Abort: a capture that fails while recording never joins. What it left (recorded copies, slots claimed by copies
  that were only recorded) is forgotten when the ring's forward begins in a new capture, at `prepare` and at `drain`.
Limits: the copy stream is joined only at a ring's last layer, so CUDA graphs need the decoder stack captured as one
graph; a graph break inside it fails the capture (`cudaErrorStreamCaptureUnjoined`): compile with mode="default".
"""

from __future__ import annotations

import torch

from .copies import copy_all
from .file_experts import CAPTURE_REFUSED as EXPERTS_REFUSED
from .read_ahead import CAPTURE_REFUSED
from .ring import CopyEvent, RingState, RingTransfers
from .routed import fetch_ahead

__all__ = ["CapturedCopies"]


class CapturedCopies:
    """`PrefetchEngine`'s steps in a capture ([Note: compile and CUDA graphs])."""

    def _record_copy(self, transfers: RingTransfers, position: int, whole: bool) -> None:
        # The copy of layer `position` recorded into the capture under way. The fork makes the copy stream join the
        # capture: its copies become nodes of the graph.
        layer = transfers.layers[position]
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        # A decode still pending on this slot ended: the device synchronised before the capture.
        self._pending_decodes.pop((id(transfers), layer.slot), None)
        with torch.cuda.stream(self.copy_stream):
            self._check_capturable()
            layer.done, layer.event = torch.cuda.Event(), CopyEvent.IN_GRAPH
            transfers.capture.copies.add(position)
            copy_all(layer, self._non_blocking, self.copy_stream, whole)
            fetch_ahead(layer, whole, self._tokens)
            layer.done.record()

    def _wait_in_capture(self, transfers: RingTransfers, position: int) -> None:
        # `wait` in a capture: a ring's capture begins at its first layer (or at the first it records).
        layer = transfers.layers[position]
        read = [p for p, other in enumerate(transfers.layers) if other.reads is not None]
        if read:  # [Note: weights read from files] in read_ahead.py
            raise RuntimeError(CAPTURE_REFUSED.format(layers=f"(ring positions {read[0]}-{read[-1]})"))
        experts = [p for p, other in enumerate(transfers.layers) if other.files is not None]
        if experts:  # [Note: experts read from files] in file_experts.py
            raise RuntimeError(EXPERTS_REFUSED.format(layers=f"(ring positions {experts[0]}-{experts[-1]})"))
        if position == 0 or transfers.state is not RingState.CAPTURING:
            transfers.begin_capture()
        if not transfers.holds(position, True):
            self._load_now(transfers, position)
        elif position in transfers.capture.copies:  # else copied before the capture: landed (see the Note)
            torch.cuda.current_stream(self.device).wait_event(layer.done)

    def _release_in_capture(self, transfers: RingTransfers, position: int) -> None:
        # `release` in a capture: the next forward's first layers are left to `finish`, outside the graph; the ring's
        # last layer joins the copy stream back into the capture.
        layer = transfers.layers[position]
        if layer.next_in_slot >= position:
            self._prefetch(transfers, layer.next_in_slot, True)
        if position == len(transfers.layers) - 1:
            if transfers.capture is not None and transfers.capture.copies:
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)  # the join
            transfers.join_capture()

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
