"""Compiled, CUDA-graph decode: everything on the GPU against hf_prefetch with half the layers streamed, both through
transformers' own compile of static-cache decoding (inductor, mode "reduce-overhead").

The two models live side by side on the GPU (the resident one and a dispatched copy) and are measured alternately,
several pairs, medians reported: the machine's speed drifts. bound = max(compiled all-on-GPU s/token, streamed
bytes per token / pinned H2D peak), the peak measured before each pair (the link's rate drifts by a few percent
between moments and machines) and the median taken. Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/compiled.py [--pairs 3] [--layers 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import StaticCache

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, clone_to_cpu, h2d_peak_gbps, save_results, static_decode  # noqa: E402

import hf_prefetch  # noqa: E402

PROMPT_TOKENS = 16
CACHE_TOKENS = PROMPT_TOKENS + 64  # one static cache shape for every run: no recompilation between them


def seconds_per_token(model, ids, cache, compiled: bool, short: int = 8, long: int = 56) -> tuple[float, torch.Tensor]:
    t_short, _ = static_decode(model, ids, cache, short, compiled)
    t_long, out = static_decode(model, ids, cache, long, compiled)
    return (t_long - t_short) / (long - short), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  layers {args.layers}")

    resident = build_model(num_layers=args.layers)
    streamed = hf_prefetch.dispatch_model(
        clone_to_cpu(resident),
        hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2),
        device="cuda",
    )
    streamed_bytes = hf_prefetch.get_state(streamed).plan.streamed_bytes_per_forward
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    caches = {
        name: StaticCache(config=model.config, max_cache_len=CACHE_TOKENS)
        for name, model in (("resident", resident), ("streamed", streamed))
    }
    systems = {
        "all on GPU, compiled + CUDA graphs": (resident, caches["resident"], True),
        "hf_prefetch half streamed (2/1/2), compiled + CUDA graphs": (streamed, caches["streamed"], True),
        "all on GPU, eager": (resident, caches["resident"], False),
        "hf_prefetch half streamed (2/1/2), eager": (streamed, caches["streamed"], False),
    }
    for name, (model, cache, compiled) in systems.items():  # compile, record, warm up
        start = time.perf_counter()
        seconds_per_token(model, ids, cache, compiled)
        print(f"warm-up {name}: {time.perf_counter() - start:.1f} s", flush=True)
    hf_prefetch.reset_stats(streamed)

    runs: dict[str, list[float]] = {name: [] for name in systems}
    tokens = {}
    peaks = []
    for pair in range(args.pairs):
        peaks.append(h2d_peak_gbps())
        print(f"pair {pair} pinned H2D peak: {peaks[-1]:.1f} GB/s", flush=True)
        for name, (model, cache, compiled) in systems.items():
            seconds, out = seconds_per_token(model, ids, cache, compiled)
            runs[name].append(seconds)
            tokens[name] = out
            print(f"pair {pair} {name}: {seconds:.4f} s/token", flush=True)

    peak = statistics.median(peaks)
    print(f"pinned H2D peak, median of {args.pairs}: {peak:.1f} GB/s (min {min(peaks):.1f}, max {max(peaks):.1f})")
    names = list(systems)
    compiled_resident = statistics.median(runs[names[0]])
    eager_resident = statistics.median(runs[names[2]])
    print(f"\ndecode, batch 1, {args.layers} layers of the 8B shape; medians of {args.pairs} pairs")
    print(f"{'system':<58} {'streamed GB':>11} {'s/token':>8} {'bound':>7} {'x bound':>8} {'tokens':>20}")
    rows = []
    for name in names:
        is_streamed = "hf_prefetch" in name
        nbytes = streamed_bytes if is_streamed else 0
        base = compiled_resident if "compiled" in name else eager_resident
        bound = max(base, nbytes / (peak * 1e9))
        value = statistics.median(runs[name])
        reference = names[0] if "compiled" in name else names[2]
        same = "same as all-on-GPU" if torch.equal(tokens[name], tokens[reference]) else "DIFFER"
        rows.append(dict(system=name, streamed=nbytes, s_per_token=value, bound=bound, samples=runs[name]))
        print(f"{name:<58} {nbytes / 1e9:>11.2f} {value:>8.4f} {bound:>7.4f} {value / bound:>8.3f} {same:>20}")
    stats = hf_prefetch.stats(streamed)
    print(f"\nstreamed model after the pairs: {stats.misses} misses")
    # Compiled streamed tokens may differ from compiled all-on-GPU ones in bf16: the ops are fusion boundaries (see
    # docs/design.md). The bitwise reference is the same dispatch with a slot per streamed layer: the same graph,
    # but nothing is copied after dispatch.
    del resident
    torch.cuda.empty_cache()
    still = hf_prefetch.dispatch_model(
        clone_to_cpu(streamed),
        hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=args.layers // 2),
        device="cuda",
    )
    cache = StaticCache(config=still.config, max_cache_len=CACHE_TOKENS)
    seconds_per_token(still, ids, cache, compiled=True)
    _, reference = seconds_per_token(still, ids, cache, compiled=True)
    same = torch.equal(reference, tokens[names[1]])
    print(f"compiled streamed tokens {'identical' if same else 'DIFFER'} to the compiled no-movement dispatch")
    print(f"all on GPU: compiled + CUDA graphs is {eager_resident / compiled_resident:.2f}x faster than eager")
    save_results("compiled.json", {"peak_gbps": peak, "rows": rows})


if __name__ == "__main__":
    main()
