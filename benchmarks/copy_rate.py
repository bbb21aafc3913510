"""Where a streamed decode's time goes on this machine: the link peak of a fresh pinned buffer against the rate the
copies of the dispatched arena reach, alone and inside decode (from `hf_prefetch.stats` with timing on).

When a run lands above the bound with eager and compiled decode alike, this tells whether the copies themselves ran
slower than the measured peak (the arena's host memory, e.g. on another NUMA node than the peak's buffer) or the copy
engine sat idle. Run on a GPU machine:  python benchmarks/copy_rate.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, decode_seconds_per_token, h2d_peak_gbps  # noqa: E402

import hf_prefetch  # noqa: E402


def arena_copy_gbps(engine, repeats: int = 5) -> float:
    """Copy every streamed layer of ring 0 into its slot on the copy stream, nothing else running: GB/s."""
    ring = engine.rings[0]
    nbytes, seconds = sum(layer.nbytes for layer in ring.layers), []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(engine.copy_stream):
            begin.record()
            for layer in ring.layers:
                for dst, src in zip(layer.device, layer.host, strict=True):
                    dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        seconds.append(begin.elapsed_time(end) / 1e3)
    engine.refill()  # the slots now hold the ring's last layers: copy the first ones back and own them
    torch.cuda.synchronize()
    return nbytes / statistics.median(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    model = build_model()
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda", timing=True
    )
    engine = hf_prefetch.get_state(model).engine
    streamed = hf_prefetch.get_state(model).plan.streamed_bytes_per_forward
    print(f"{'round':>5} {'peak GB/s':>9} {'arena GB/s':>10} {'decode GB/s':>11} {'s/token':>8} {'x bound':>8}")
    for index in range(args.rounds):
        peak = h2d_peak_gbps()
        arena = arena_copy_gbps(engine)
        hf_prefetch.reset_stats(model)
        s_per_token = decode_seconds_per_token(model, ids)
        stats = hf_prefetch.stats(model)
        in_decode = stats.gbps
        ratio = s_per_token / (streamed / (peak * 1e9))
        line = f"{index:>5} {peak:>9.1f} {arena:>10.1f} {in_decode:>11.1f} {s_per_token:>8.4f} {ratio:>8.3f}"
        print(line, flush=True)
    print(f"misses: {hf_prefetch.stats(model).misses}")


if __name__ == "__main__":
    main()
