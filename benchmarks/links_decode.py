"""Decode with the streamed bytes over one host link against over every GPU's link (`links="all"`).

The model computes on GPU 0; with links="all" GPU 1 (and any other) copies an equal share of every streamed layer from
pinned host memory into a staging buffer and on over NVLink into the slot. Both dispatches stream the same layers;
they alternate in one process, several rounds, medians reported. bound = max(all-on-GPU time, streamed bytes /
(per-link pinned H2D peak x links)). Tokens of every row are compared with the all-on-GPU model's. Run on a machine
with two GPUs:

    PYTHONUNBUFFERED=1 python benchmarks/links_decode.py [--shape 8b|32b] [--rounds 3] [--plans half all]
        [--pipeline-gib 6 6]  (also pipeline placement: layers on both GPUs, bound = streamed bytes / one link)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import LLAMA_8B, SHAPES, build_model, h2d_peak_gbps, save_results  # noqa: E402

import hf_prefetch  # noqa: E402

# A Qwen2.5-32B-like shape in Llama form: 64 layers, hidden 5120, 32.8B parameters, 65.5 GB of bf16.
SHAPES.setdefault(
    "32b",
    dict(
        LLAMA_8B,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        vocab_size=152064,
    ),
)
PLANS = {
    "half": dict(config=dict(group_size=2, num_in_group=1, prefetch_step=2)),
    "all": dict(config=dict(group_size=1, num_in_group=1, prefetch_step=2)),
    "budget": dict(config=dict(prefetch_step=2), max_memory_gib=24),
}


def both_links_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """GB/s of each of GPUs 0 and 1 copying `nbytes` from pinned memory at the same time (fastest of `repeats`)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    streams = [torch.cuda.Stream(f"cuda:{d}") for d in (0, 1)]
    best = [0.0, 0.0]
    for _ in range(repeats + 1):
        for d in (0, 1):
            torch.cuda.synchronize(d)
        ends = [torch.cuda.Event(enable_timing=True) for _ in (0, 1)]
        starts = [torch.cuda.Event(enable_timing=True) for _ in (0, 1)]
        for d in (0, 1):
            with torch.cuda.stream(streams[d]):
                starts[d].record()
                dst[d].copy_(host, non_blocking=True)
                ends[d].record()
        for d in (0, 1):
            ends[d].synchronize()
            best[d] = max(best[d], nbytes / (starts[d].elapsed_time(ends[d]) / 1e3) / 1e9)
    return best[0], best[1]


def decode(model, ids, short: int, long: int) -> tuple[float, torch.Tensor]:
    """Seconds per decoded token (`long` minus `short` new tokens, no prefill) and the `long` tokens."""
    mask = torch.ones_like(ids)
    times, out = [], None
    for n in (short, long):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return (times[1] - times[0]) / (long - short), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8b", choices=["8b", "32b"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plans", nargs="*", default=["half", "all"], choices=list(PLANS))
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--pipeline-gib", type=float, nargs=2, help="also pipeline placement at these GPU budgets")
    args = parser.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    torch.cuda.set_device(0)
    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    alone = []
    for d in (0, 1):
        with torch.cuda.device(d):
            alone.append(h2d_peak_gbps())
    together = both_links_gbps()
    print(
        f"pinned H2D peak alone: GPU0 {alone[0]:.1f}, GPU1 {alone[1]:.1f} GB/s; both at once: "
        f"{together[0]:.1f} + {together[1]:.1f} = {sum(together):.1f} GB/s"
    )
    peak = min(alone)

    model = build_model(shape=args.shape)  # on cuda:0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.shape} shape: {weights / 1e9:.2f} GB of bf16 weights")
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    decode(model, ids, 2, 4)  # warm-up: the first generate's one-time costs would shorten the difference below
    resident_times = []
    for _ in range(3):
        seconds, reference = decode(model, ids, args.short, args.long)
        resident_times.append(seconds)
    resident = statistics.median(resident_times)
    print(f"all on GPU 0: {resident:.4f} s/token")

    rows = []
    for name in args.plans:
        spec = PLANS[name]
        config = hf_prefetch.PrefetchConfig(**spec["config"])
        budget = {0: f"{spec['max_memory_gib']}GiB"} if "max_memory_gib" in spec else None
        times: dict[str, list[float]] = {"one link": [], "two links": []}
        same = {}
        streamed = 0
        for round_ in range(args.rounds):
            for system, links in (("one link", None), ("two links", "all")):
                hf_prefetch.dispatch_model(
                    model, config, device="cuda:0", max_memory=budget, links=links, replace=True
                )
                plan = hf_prefetch.get_state(model).plan
                streamed = plan.streamed_bytes_per_forward
                decode(model, ids, 1, 2)  # warm-up of this dispatch
                hf_prefetch.reset_stats(model)
                seconds, out = decode(model, ids, args.short, args.long)
                stats = hf_prefetch.stats(model)
                times[system].append(seconds)
                same[system] = torch.equal(out, reference) and same.get(system, True)
                print(
                    f"round {round_} {name} {system}: {seconds:.4f} s/token, links {plan.links or (0,)}, "
                    f"misses {stats.misses}, {streamed / 1e9:.2f} GB streamed per forward"
                )
        for system, links in (("one link", 1), ("two links", 2)):
            seconds = statistics.median(times[system])
            bound = max(resident, streamed / (peak * 1e9 * links))
            rows.append(
                dict(
                    plan=name,
                    system=system,
                    streamed_gb=streamed / 1e9,
                    s_per_token=seconds,
                    bound=bound,
                    x_bound=seconds / bound,
                    gbps=streamed / seconds / 1e9,
                    identical=same[system],
                )
            )
        ratios = [a / b for a, b in zip(times["one link"], times["two links"], strict=True)]
        rows[-1]["speedup"] = statistics.median(ratios)
        print(
            f"{name}: two links over one, per round {[f'{r:.3f}' for r in ratios]}, median {rows[-1]['speedup']:.3f}"
        )
    if args.pipeline_gib:
        # Pipeline placement: layers in two runs, one per GPU, each streaming what its budget does not hold.
        budget = {0: f"{args.pipeline_gib[0]}GiB", 1: f"{args.pipeline_gib[1]}GiB"}
        config = hf_prefetch.PrefetchConfig(prefetch_step=2)
        times, same, streamed = [], True, 0
        for round_ in range(args.rounds):
            hf_prefetch.dispatch_model(model, config, device="cuda:0", max_memory=budget, replace=True)
            plan = hf_prefetch.get_state(model).plan
            streamed = plan.streamed_bytes_per_forward
            decode(model, ids, 1, 2)  # warm-up of this dispatch
            hf_prefetch.reset_stats(model)
            seconds, out = decode(model, ids, args.short, args.long)
            times.append(seconds)
            same = same and torch.equal(out.to(reference.device), reference)
            per_gpu = [
                round(sum(r.bytes_per_forward for r in plan.rings if r.device == i) / 1e9, 2) for i, _ in plan.gpus
            ]
            print(
                f"round {round_} pipeline {budget}: {seconds:.4f} s/token, streamed per GPU {per_gpu} GB, misses "
                f"{hf_prefetch.stats(model).misses}"
            )
        seconds = statistics.median(times)
        bound = max(resident, streamed / (peak * 1e9))
        rows.append(
            dict(
                plan="pipeline",
                system="2 GPUs",
                streamed_gb=streamed / 1e9,
                s_per_token=seconds,
                bound=bound,
                x_bound=seconds / bound,
                gbps=streamed / seconds / 1e9,
                identical=same,
            )
        )
    hf_prefetch.remove_offload(model)

    print(
        f"\n{args.shape} shape, decode of 1 sequence, {args.long - args.short} tokens timed; peak {peak:.1f} GB/s/link"
    )
    print(
        f"{'plan':<8} {'system':<10} {'GB/fwd':>7} {'s/token':>8} {'bound':>7} {'x bound':>8} {'GB/s':>6} "
        f"{'speed-up':>8} tokens"
    )
    print(
        f"{'-':<8} {'all on GPU':<10} {0:>7.2f} {resident:>8.4f} {resident:>7.4f} {1:>8.3f} {'-':>6} {'-':>8} "
        "reference"
    )
    for r in rows:
        speedup = f"{r['speedup']:.3f}" if "speedup" in r else "-"
        print(
            f"{r['plan']:<8} {r['system']:<10} {r['streamed_gb']:>7.2f} {r['s_per_token']:>8.4f} {r['bound']:>7.4f} "
            f"{r['x_bound']:>8.3f} {r['gbps']:>6.1f} {speedup:>8} {'identical' if r['identical'] else 'DIFFER'}"
        )
    save_results(f"links_decode_{args.shape}.json", dict(alone=alone, together=together, resident=resident, rows=rows))


if __name__ == "__main__":
    main()
