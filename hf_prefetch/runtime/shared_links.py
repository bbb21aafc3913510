"""Several host links for one model: other GPUs copy a share of every streamed layer and pass it on over the peer link.

Each GPU has its own host-to-device link, and on the machines measured they do not share the host's bandwidth (two
H200s: 55.2 GB/s each alone, 108.4 together; benchmarks/two_links.py). A model that computes on one GPU can therefore
receive its streamed weights through several: the execution device copies the first share of a layer's bytes into its
slot itself, and each other GPU of `links` copies its share from pinned host memory into a staging buffer of its own
and then over the peer link (NVLink: 389 GB/s GPU to GPU) into the slot. Measured with two streams per helper GPU,
layer-sized copies landed at 108.3 GB/s.

[Note: shared links]
A helper GPU has two streams and `STAGES` staging buffers:
- `host_stream` copies its share of a layer from host memory into the next staging buffer, after the peer copy that
  last read that buffer (`freed` event): the helper's link never waits for the peer link.
- `peer_stream` waits for the staging copy (`staged`) and for the slot to be free (`slot_free`, recorded on the
  compute stream when the copy was issued, as the engine's own copy stream waits on it), copies the staging buffer
  into the slot's bytes over the peer link, and records `freed` and `done`.
- `join` (`land`) waits on every helper's `done` and on the engine's copy stream before it records the layer's
  `done` event: the compute stream sees one event per layer, as with one link.
- A copy across devices in torch also orders itself against the current stream of the destination device; here that is
  `barrier`, a stream of the execution device that nothing else uses, so the peer copy waits for nothing else.
Every helper's last `done` is kept (`order_after`): a stream that must come after every copy issued so far (a miss, a
drain) waits on those too, also for a copy whose layer was interrupted before the join.
CUDA graphs do not record shared copies: a capture copies every byte through the execution device's own link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..alignment import LINK_SHARE_ALIGN_BYTES, round_up
from ..planning.links import STAGES, Pair, split_bytes, staged_bytes

__all__ = ["SharedLinks"]


@dataclass
class _Helper:
    device: torch.device
    host_stream: Any  # torch.cuda.Stream on `device` (None on the CPU): host memory -> staging buffer
    peer_stream: Any  # torch.cuda.Stream on `device`: staging buffer -> the slot, over the peer link
    staging: list[torch.Tensor]  # STAGES flat uint8 buffers on `device`
    freed: list[Any] = field(default_factory=lambda: [None] * STAGES)  # per buffer: its last peer copy ended
    done: Any = None  # the last peer copy issued (any buffer)
    next_stage: int = 0
    copied_bytes: int = 0  # bytes this helper's link carried since dispatch


class SharedLinks:
    """The helper GPUs of one engine, their streams and staging buffers. On the CPU (tests) the same pieces are
    copied synchronously through the staging buffers, so the splitting and staging are exercised without CUDA."""

    def __init__(self, device: torch.device, helpers: Sequence[torch.device], layouts: Sequence[Sequence[Pair]]):
        self.device = device
        self.num_links = 1 + len(helpers)
        cuda = device.type == "cuda"
        # The largest share any layer gives a helper: every staging buffer holds one.
        # (A forward that routes experts copies fewer pairs: their ranges are shorter, but cut into more pieces
        # at worst one more per pair, each padded to LINK_SHARE_ALIGN_BYTES.)
        capacity = max(
            (
                staged_bytes(piece) + LINK_SHARE_ALIGN_BYTES * len(pairs)
                for pairs in layouts
                for piece in split_bytes(pairs, self.num_links)[1:]
            ),
            default=0,
        )
        self.helpers = [
            _Helper(
                helper,
                torch.cuda.Stream(helper) if cuda else None,
                torch.cuda.Stream(helper) if cuda else None,
                [torch.empty(capacity, dtype=torch.uint8, device=helper) for _ in range(STAGES)],
            )
            for helper in helpers
        ]
        # barrier: the execution device's current stream during peer copies (see the Note); nothing waits on it.
        self.barrier = torch.cuda.Stream(device) if cuda else None
        # join: waits on the engine's copy stream and every helper's peer copy of a layer, then records its `done`.
        self.join = torch.cuda.Stream(device) if cuda else None

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging buffers, on each helper GPU."""
        return sum(t.numel() for t in self.helpers[0].staging) if self.helpers else 0

    def copy(self, pairs: Sequence[Pair], non_blocking: bool, slot_free: Any = None) -> list[Pair]:
        """Issue every helper's share of `pairs` (on CUDA: after `slot_free`, an event on the compute stream) and
        return the execution device's own share, for the caller to copy."""
        ranges = split_bytes(pairs, self.num_links)
        for helper, pieces in zip(self.helpers, ranges[1:], strict=True):
            if pieces:
                self._copy_through(helper, pieces, non_blocking, slot_free)
        return ranges[0]

    def _copy_through(self, helper: _Helper, pieces: list[Pair], non_blocking: bool, slot_free: Any) -> None:
        stage = helper.next_stage
        helper.next_stage = (stage + 1) % STAGES
        staged, offset = [], 0
        for dst, src in pieces:
            staged.append((dst, helper.staging[stage][offset : offset + dst.numel()], src))
            offset += round_up(dst.numel(), LINK_SHARE_ALIGN_BYTES)
        helper.copied_bytes += sum(dst.numel() for dst, _ in pieces)
        if helper.host_stream is None:  # the CPU: synchronous, through the staging buffer all the same
            for dst, buffer, src in staged:
                buffer.copy_(src)
                dst.copy_(buffer)
            return
        with torch.cuda.stream(helper.host_stream):
            if helper.freed[stage] is not None:
                helper.host_stream.wait_event(helper.freed[stage])
            for _, buffer, src in staged:
                buffer.copy_(src, non_blocking=non_blocking)
            ready = helper.host_stream.record_event()
        with torch.cuda.stream(helper.peer_stream), torch.cuda.stream(self.barrier):
            helper.peer_stream.wait_event(ready)
            if slot_free is not None:
                helper.peer_stream.wait_event(slot_free)
            for dst, buffer, _ in staged:
                dst.copy_(buffer, non_blocking=True)
            helper.freed[stage] = helper.done = helper.peer_stream.record_event()

    def land(self, done: Any, copy_stream: Any) -> None:
        """Record `done` once the layer's copies through every link have landed: the execution device's on
        `copy_stream`, the helpers' last peer copies."""
        self.join.wait_stream(copy_stream)
        self.order_after(self.join)
        done.record(self.join)

    def issued(self) -> list[Any]:
        """Each helper's last peer-copy event (CUDA): what a stream waits on to come after every shared copy."""
        return [helper.done for helper in self.helpers if helper.done is not None]

    def order_after(self, stream: Any) -> None:
        """Make `stream` wait for every shared copy issued so far."""
        for event in self.issued():
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Block the host until every helper's copies have landed."""
        for helper in self.helpers:
            if helper.peer_stream is not None:
                helper.host_stream.synchronize()
                helper.peer_stream.synchronize()
        if self.join is not None:
            self.join.synchronize()
