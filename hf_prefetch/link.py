"""The host-to-device link's measured speed, for the plan's transfer-time estimate."""

from __future__ import annotations

import torch

__all__ = ["measure_link_gbps"]


def measure_link_gbps(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Pinned host-to-device copy speed of `device` in GB/s, measured once per process and device, then cached: the
    fastest of `repeats` timed copies of `nbytes` (a weight-sized copy), after two warm-up copies.

    Allocates `nbytes` of pinned host memory and `nbytes` on `device` while it measures; only `hf_prefetch.plan`
    calls it.
    """
    key = (str(device), nbytes)
    if key not in _link_gbps:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        fastest = float("inf")
        with torch.cuda.device(device):
            for attempt in range(repeats + 2):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                dest.copy_(host, non_blocking=True)
                end.record()
                end.synchronize()
                if attempt >= 2:  # the first copies warm up the path
                    fastest = min(fastest, begin.elapsed_time(end) / 1e3)
        _link_gbps[key] = nbytes / fastest / 1e9
    return _link_gbps[key]


_link_gbps: dict[tuple[str, int], float] = {}
