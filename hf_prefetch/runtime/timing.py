"""The engine's timing (`timing=True`): copy, stall and compute seconds per layer, measured without a host
synchronisation in the forward.

On CUDA each measurement is a pair of events, queued and folded into the layer's counters only once `Event.query()`
says both completed (`poll`, and `collect` after waiting for the device). Events are fresh per measurement, so a late
read never sees a later copy's. On the CPU everything is synchronous and measured with the host clock. This module
knows counters and streams; when a copy or a forward begins is the engine's business.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from .ring import LayerCounters, LayerTransfer

__all__ = ["Timings", "timing_event"]


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class _Pending:
    # A measurement whose events may not have completed yet: `begin` -> `end` on the device, added to `counter`:
    # "copy_seconds" (a copy), "stall_seconds" (compute stream ready -> copy done) or "compute_seconds" (a forward).
    counters: LayerCounters
    begin: torch.cuda.Event
    end: torch.cuda.Event
    counter: str


class Timings:
    """The measurements of one engine on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._pending: deque[_Pending] = deque()

    def add(self, counters: LayerCounters, begin: torch.cuda.Event, end: torch.cuda.Event, *names: str) -> None:
        """Add the device time from `begin` to `end` to each counter in `names`, once both events completed."""
        for name in names:
            self._pending.append(_Pending(counters, begin, end, name))

    def begin_blocking(self) -> torch.cuda.Event | float:
        """Before a copy that holds the compute stream (a miss, a gather, any copy on the CPU): a mark to end with."""
        if not self._cuda:
            return time.perf_counter()
        begin = timing_event()
        begin.record(torch.cuda.current_stream(self.device))
        return begin

    def end_blocking(self, counters: LayerCounters, begin: torch.cuda.Event | float) -> None:
        """After it: all of its time is copy time and stall time alike."""
        self.end_span(counters, begin, "copy_seconds", "stall_seconds")

    def end_span(self, counters: LayerCounters, begin: torch.cuda.Event | float, *names: str) -> None:
        """After work on the compute stream that began at `begin` (`begin_blocking`): its time to each counter."""
        if isinstance(begin, float):
            seconds = time.perf_counter() - begin
            for name in names:
                setattr(counters, name, getattr(counters, name) + seconds)
            return
        end = timing_event()
        end.record(torch.cuda.current_stream(self.device))
        self.add(counters, begin, end, *names)

    def begin_compute(self, layer: LayerTransfer) -> None:
        if self._cuda:
            layer.compute_begin = timing_event()
            layer.compute_begin.record(torch.cuda.current_stream(self.device))
        else:
            layer.compute_begin = time.perf_counter()

    def end_compute(self, layer: LayerTransfer) -> None:
        begin, layer.compute_begin = layer.compute_begin, None
        if begin is None:  # released without a wait (a forward that skipped the hook's pre-forward)
            return
        if self._cuda:
            end = timing_event()
            end.record(torch.cuda.current_stream(self.device))
            self.add(layer.counters, begin, end, "compute_seconds")
        else:
            layer.counters.compute_seconds += time.perf_counter() - begin

    def poll(self) -> None:
        """Fold completed measurements into their counters, in issue order; the first incomplete one stops the scan."""
        while self._pending and self._pending[0].begin.query() and self._pending[0].end.query():
            item = self._pending.popleft()
            seconds = max(item.begin.elapsed_time(item.end) / 1e3, 0.0)  # a stall is negative when the copy won
            setattr(item.counters, item.counter, getattr(item.counters, item.counter) + seconds)

    def collect(self) -> None:
        """Wait for the device and fold every measurement into the counters."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self.poll()
