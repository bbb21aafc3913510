"""Decode and prefill with prefetch offloading against everything on the GPU, accelerate and diffusers.

Systems are measured alternately in one process, several rounds, and medians reported, because the machine's
speed drifts. bound = max(all-on-GPU time, streamed bytes / measured pinned H2D peak). Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/decode.py [--rounds 3] [--shape 8b|14b] [--prefill 2048 8192] [--baselines]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    build_model,
    clone_to_cpu,
    decode_seconds_per_token,
    h2d_peak_gbps,
    prefill_seconds,
    save_results,
)

import hf_prefetch  # noqa: E402

RESIDENT = "all on GPU"
HALF = "hf_prefetch half streamed (2/1/2)"
HALF_TIMED = "hf_prefetch half streamed (2/1/2), timing on"
SYSTEMS = {
    RESIDENT: None,
    HALF: dict(group_size=2, num_in_group=1, prefetch_step=2),
    "hf_prefetch half streamed (2/1/1)": dict(group_size=2, num_in_group=1, prefetch_step=1),
    "hf_prefetch all layers streamed (1/1/2)": dict(group_size=1, num_in_group=1, prefetch_step=2),
    HALF_TIMED: dict(group_size=2, num_in_group=1, prefetch_step=2, timing=True),
}
BUDGET_GIB = 9  # the GPU budget of the peer comparison (ANCHORS.md)


def measure_system(model, ids, fields, prefill_lengths) -> dict:
    if fields is not None:
        fields = dict(fields)
        timing = fields.pop("timing", False)
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**fields), device="cuda", timing=timing)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    state = hf_prefetch.get_state(model)
    result = {
        "streamed": 0 if state is None else state.plan.streamed_bytes_per_forward,
        "gpu": torch.cuda.memory_allocated(),
        "decode": decode_seconds_per_token(model, ids),
        "peak": torch.cuda.max_memory_allocated(),
    }
    for length in prefill_lengths:
        result[f"prefill{length}"] = prefill_seconds(model, length)
    with torch.no_grad():
        result["tokens"] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    if state is not None:
        result["misses"] = hf_prefetch.stats(model).misses
        hf_prefetch.remove_offload(model)
    return result


def measure_baseline(model, ids, name) -> dict:
    """accelerate's big-model dispatch at the GPU budget, or diffusers' leaf-level streaming, on a CPU copy."""
    clone = clone_to_cpu(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    if name.startswith("accelerate"):
        from accelerate import dispatch_model, infer_auto_device_map

        device_map = infer_auto_device_map(
            clone, max_memory={0: f"{BUDGET_GIB}GiB", "cpu": "200GiB"}, no_split_module_classes=clone._no_split_modules
        )
        dispatch_model(clone, device_map=device_map, skip_keys=clone._skip_keys_device_placement)
        streamed = sum(
            p.numel() * p.element_size()
            for n, p in clone.named_parameters()
            if any(n.startswith(f"{k}.") or k == "" for k, v in device_map.items() if v == "cpu")
        )
    else:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(clone, onload_device=torch.device("cuda"), offload_type="leaf_level", use_stream=True)
        streamed = sum(p.numel() * p.element_size() for p in clone.parameters())
    torch.cuda.synchronize()
    gpu = torch.cuda.memory_allocated() - before
    result = {"streamed": streamed, "gpu": gpu, "decode": decode_seconds_per_token(clone, ids, short=2, long=10)}
    with torch.no_grad():
        result["tokens"] = clone.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    del clone
    gc.collect()
    torch.cuda.empty_cache()
    return result


def memory_flat_over_decode(model, steps: int = 100) -> tuple[int, int]:
    """memory_allocated() after each of `steps` decode steps with a static cache: (min, max) after the first."""
    from transformers import StaticCache

    hf_prefetch.dispatch_model(model, device="cuda", offload=hf_prefetch.PrefetchConfig(**SYSTEMS[HALF]))
    cache = StaticCache(config=model.config, max_cache_len=steps + 8)
    token = torch.tensor([[5]], device="cuda")
    readings = []
    with torch.no_grad():
        for step in range(steps + 1):
            out = model(token, past_key_values=cache, cache_position=torch.tensor([step], device="cuda"))
            token = out.logits[:, -1:].argmax(-1)
            del out
            readings.append(torch.cuda.memory_allocated())
    hf_prefetch.remove_offload(model)
    return min(readings[1:]), max(readings[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048])
    parser.add_argument("--baselines", action="store_true", help="also accelerate and diffusers (2 pairs)")
    args = parser.parse_args()

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  shape {args.shape}")
    model = build_model(shape=args.shape)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    runs: dict[str, list[dict]] = {}
    links = []  # the link is measured before every round; the bound uses the fastest reading (the link can do that)
    for round_index in range(args.rounds):
        links.append(h2d_peak_gbps())
        print(f"round {round_index} pinned H2D peak: {links[-1]:.1f} GB/s", flush=True)
        for name, fields in SYSTEMS.items():
            runs.setdefault(name, []).append(measure_system(model, ids, fields, args.prefill))
            print(f"round {round_index} {name}: {runs[name][-1]['decode']:.4f} s/token", flush=True)
    baselines = {}
    if args.baselines:
        for pair in range(2):
            runs[RESIDENT].append(measure_system(model, ids, None, []))
            for name in (
                f"accelerate dispatch_model, max_memory {BUDGET_GIB} GiB",
                "diffusers leaf_level, use_stream",
            ):
                try:
                    baselines.setdefault(name, []).append(measure_baseline(model, ids, name))
                    print(f"pair {pair} {name}: {baselines[name][-1]['decode']:.4f} s/token", flush=True)
                except Exception as err:  # a peer failing is a result, not a crash
                    print(f"{name}: failed: {type(err).__name__}: {err}")

    peak = max(links)
    readings = ", ".join(f"{x:.1f}" for x in links)
    print(f"pinned H2D peak: {peak:.1f} GB/s (the fastest of {len(links)} readings: {readings})")
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    resident = med(runs[RESIDENT], "decode")
    reference_tokens = runs[RESIDENT][0]["tokens"]
    table = []
    print(f"\ndecode, batch 1 ({args.shape}); medians of {args.rounds} rounds")
    print(
        f"{'system':<48} {'streamed GB':>11} {'GPU GiB':>8} {'peak GiB':>8} {'s/token':>8} {'bound':>7} "
        f"{'x bound':>8} {'tokens':>9}"
    )
    for name, rows in [*runs.items(), *baselines.items()]:
        s_per_token = med(rows, "decode")
        bound = max(resident, rows[0]["streamed"] / (peak * 1e9))
        same = all(torch.equal(r["tokens"], reference_tokens) for r in rows)
        peak_gib = f"{rows[0]['peak'] / 2**30:.2f}" if "peak" in rows[0] else "-"
        table.append(
            dict(
                system=name,
                streamed=rows[0]["streamed"],
                gpu=rows[0]["gpu"],
                s_per_token=s_per_token,
                bound=bound,
                samples=[r["decode"] for r in rows],
                identical=same,
            )
        )
        print(
            f"{name:<48} {rows[0]['streamed'] / 1e9:>11.2f} {rows[0]['gpu'] / 2**30:>8.2f} {peak_gib:>8} "
            f"{s_per_token:>8.4f} {bound:>7.4f} {s_per_token / bound:>8.3f} {'identical' if same else 'DIFFER':>9}"
        )
    timed_ratio = statistics.median(
        a["decode"] / b["decode"] for a, b in zip(runs[HALF_TIMED], runs[HALF], strict=True)
    )
    print(f"statistics with timing on / off (median of paired ratios): {timed_ratio:.4f}")
    for length in args.prefill:
        base = med(runs[RESIDENT][: args.rounds], f"prefill{length}")
        print(f"\nprefill {length} tokens")
        for name, rows in runs.items():
            t = med(rows[: args.rounds], f"prefill{length}")
            bound = max(base, rows[0]["streamed"] / (peak * 1e9))
            print(f"{name:<48} {t:>8.4f} s  bound {bound:.4f}  x bound {t / bound:.3f}  x all-on-GPU {t / base:.2f}")
    if baselines:
        budget_rows = runs["hf_prefetch half streamed (2/1/1)"]
        ours = med(budget_rows, "decode")
        peak_gib = budget_rows[0]["peak"] / 2**30
        print(f"\nat a {BUDGET_GIB} GiB budget: hf_prefetch (2/1/1, {peak_gib:.2f} GiB peak) {ours:.4f} s/token")
        for name, rows in baselines.items():
            theirs = med(rows, "decode")
            print(f"  {name}: {theirs:.4f} s/token -> hf_prefetch is {theirs / ours:.2f}x faster")
    low, high = memory_flat_over_decode(model)
    print(
        f"\nmemory_allocated over 100 static-cache decode steps (half streamed): min {low} max {high} "
        f"(spread {high - low} bytes)"
    )
    save_results(f"decode_{args.shape}.json", {"peak_gbps": peak, "rows": table})


if __name__ == "__main__":
    main()
