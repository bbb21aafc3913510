"""The host-to-device link's measured speed: the one definition the plan's transfer-time estimate and the benchmarks'
bound share.

The link speed is the fastest of `LINK_REPEATS` timed copies of `LINK_BYTES` (256 MiB, the size of a streamed layer's
weights) from pinned host memory to the device, after `LINK_WARMUPS` untimed copies, each timed with CUDA events. The
fastest copy, not the median, because the number is a peak: a copy can be slowed down by something else on the
machine but not sped up, and the bound a benchmark derives from it must be one the link can reach. The link's rate
drifts by a few percent between moments, so a benchmark measures it again (`cached=False`) right next to the runs it
bounds; `hf_prefetch.plan` measures once per process and device and caches the result.
"""

from __future__ import annotations

import torch

__all__ = ["measure_link_gbps"]

LINK_BYTES = 256 * 2**20
"""Bytes per timed copy: weight-sized (a Llama-3.1-8B layer is 436 MB), large enough that launch costs vanish."""

LINK_REPEATS = 5
"""Timed copies per measurement; the fastest one gives the speed."""

LINK_WARMUPS = 2
"""Untimed copies before the timed ones: the first copies of a fresh buffer warm up the path."""


def measure_link_gbps(
    device: torch.device, nbytes: int = LINK_BYTES, repeats: int = LINK_REPEATS, *, cached: bool = True
) -> float:
    """Pinned host-to-device copy speed of `device` in GB/s (1e9 bytes per second): the fastest of `repeats` timed
    copies of `nbytes`, after two warm-up copies (the definition in this module's docstring).

    With `cached=True` (the default, what `hf_prefetch.plan` uses) it is measured once per process, device and
    `nbytes`, and later calls return that value. With `cached=False` it measures now and neither reads nor writes the
    cache: for a benchmark that measures the link next to each run it bounds (`benchmarks/common.py::h2d_peak_gbps`).

    Allocates `nbytes` of pinned host memory and `nbytes` on `device` while it measures.
    """
    if nbytes <= 0 or repeats < 1:
        raise ValueError(f"measure_link_gbps needs nbytes > 0 and repeats >= 1, not {nbytes=} and {repeats=}.")
    if not cached:
        return _fastest_copy_gbps(device, nbytes, repeats)
    key = (str(device), nbytes)
    if key not in _link_gbps:
        _link_gbps[key] = _fastest_copy_gbps(device, nbytes, repeats)
    return _link_gbps[key]


def _fastest_copy_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """One measurement, uncached: `LINK_WARMUPS` untimed copies, then the fastest of `repeats` timed ones."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    fastest = float("inf")
    with torch.cuda.device(device):
        for attempt in range(LINK_WARMUPS + repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dest.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            if attempt >= LINK_WARMUPS:
                fastest = min(fastest, begin.elapsed_time(end) / 1e3)
    return nbytes / fastest / 1e9


_link_gbps: dict[tuple[str, int], float] = {}
