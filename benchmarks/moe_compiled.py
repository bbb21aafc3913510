"""Mixture-of-experts decode compiled with CUDA graphs: routed experts' gathers recorded in the graphs. GPU only.

The Qwen3-30B-A3B-shaped random bf16 model of `moe.py` (seed 0: every run the same weights and prompt) decodes through
transformers' own compile of static-cache decoding (inductor, mode "reduce-overhead"): first all on the GPU (the
reference tokens and the compiled all-on-GPU time), then dispatched at a GPU budget with routed experts (a decode graph
copies each layer without its experts and gathers the 8 picked experts' rows through the arena's mapped view, reading
the index each replay's router wrote), then with routed experts but without fetching each layer's previous picks ahead
of its router (`recent_experts=False`: only the router's picks cross the link, after the router), then with routing off
(`routed_max_tokens=0`: whole expert tensors, the same ops, so the same fusions: the bitwise reference for the routed
tokens). A CUDA graph replays without Python, so the bytes one token moves are counted on one eager decode step of the
same dispatch. bound = max(compiled all-on-GPU s/token, routed bytes per token / pinned H2D peak), the peak measured
before each run and the fastest reading used; the routed bytes of both routed rows are those of the row without recent
experts (each pick not in the cache, once: fetching a recent expert that is not picked again moves bytes the bound does
not count).

    python benchmarks/moe_compiled.py [--budget-gib 24] [--layers 48] [--runs 3]
    python benchmarks/moe_compiled.py --cache-shares 0 0.25 0.5 --budget-gib 40
    python benchmarks/moe_compiled.py --slots 2 3 4 --default-cache --sample

With `--cache-shares`, the rows are routed experts with an expert cache of each share of the experts (the planner
streams more layers to make room); the bound counts the bytes a token still copies, and the hit rate is the cache's
over the measured runs (random weights tend to repeat their picks: the rate is printed, not assumed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_offload_params_argument, h2d_peak_gbps, save_results, static_decode  # noqa: E402
from moe import build  # noqa: E402

import hf_prefetch  # noqa: E402

PROMPT_TOKENS = 16
CACHE_TOKENS = PROMPT_TOKENS + 64


SAMPLE = False  # --sample: tokens sampled (seeded), so that each token's picks differ from the one before's


def seconds_per_token(model, ids, cache, compiled: bool, short: int, long: int) -> tuple[float, torch.Tensor]:
    t_short, _ = static_decode(model, ids, cache, short, compiled, SAMPLE)
    t_long, out = static_decode(model, ids, cache, long, compiled, SAMPLE)
    return (t_long - t_short) / (long - short), out


def bytes_per_token(model, ids) -> int:
    """Bytes one eager decode step copies (a prefill of the prompt and a first step, which loads an expert cache,
    first, not counted)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        out = model(step, past_key_values=out.past_key_values, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        hf_prefetch.reset_stats(model)
        model(step, past_key_values=out.past_key_values, use_cache=True)
    return hf_prefetch.stats(model).copied_bytes


def measure(name, model, ids, runs: int, short: int, long: int, links: list[float]) -> tuple[list[float], object]:
    cache = StaticCache(config=model.config, max_cache_len=CACHE_TOKENS)
    begin = time.perf_counter()
    seconds_per_token(model, ids, cache, True, short, long)  # compile, record
    print(f"{name}: compiled and recorded in {time.perf_counter() - begin:.1f} s", flush=True)
    samples, tokens = [], None
    for run in range(runs):
        links.append(h2d_peak_gbps())
        seconds, tokens = seconds_per_token(model, ids, cache, True, short, long)
        samples.append(seconds)
        print(f"{name} run {run}: {seconds:.4f} s/token (link {links[-1]:.1f} GB/s)", flush=True)
    return samples, tokens


def _same_prefix(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Runs generate different numbers of tokens (whole expert tensors are slow): compare the common prefix.
    length = min(a.shape[1], b.shape[1])
    return torch.equal(a[:, :length], b[:, :length])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-shares", type=float, nargs="*", default=None)
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample each token (seeded) instead of greedy decoding, and measure only the routed rows: a random "
        "model's greedy tokens repeat, and so do its picks",
    )
    parser.add_argument(
        "--default-cache",
        action="store_true",
        help="routed rows with expert_cache=None (what the budget leaves spare) instead of no cache; the whole-tensor "
        "row keeps none",
    )
    parser.add_argument(
        "--slots",
        type=int,
        nargs="*",
        default=None,
        help="routed rows with recent experts at each number of slots (prefetch_step), the budget grown by one "
        "streamed layer's bytes per slot past 2 (so the cache and the streamed layers stay as they are), and the "
        "router-only row at 2 slots for the bound",
    )
    add_offload_params_argument(parser)
    args = parser.parse_args()
    global SAMPLE
    SAMPLE = args.sample
    offload_params = frozenset(args.offload_params)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    links = [h2d_peak_gbps()]
    torch.manual_seed(0)  # the same weights and prompt in every run: runs of different code compare
    model = build(args.layers)
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")

    resident, reference = measure("all on GPU", model, ids, args.runs, 8, 40, links)
    eager_resident, _ = seconds_per_token(
        model, ids, StaticCache(config=model.config, max_cache_len=CACHE_TOKENS), False, 4, 20
    )
    print(f"all on GPU, eager: {eager_resident:.4f} s/token", flush=True)
    torch._dynamo.reset()

    systems = {}
    cache = None if args.default_cache else 0
    if args.slots:
        variants = [("routed, router only", None, cache, False, 2)] + [
            (f"routed experts, {n} slots", None, cache, True, n) for n in args.slots
        ]
    elif args.cache_shares is None:
        variants = [
            ("routed experts", None, cache, True, 2),
            ("routed, router only", None, cache, False, 2),
            ("whole expert tensors", 0, 0, False, 2),
        ][: 2 if args.sample else 3]  # whole expert tensors: the bitwise reference of the routed rows
    else:
        experts = model.config.num_experts
        variants = [
            (f"routed, cache {int(s * experts)}/{experts}{suffix}", None, int(s * experts), recent, 2)
            for s in args.cache_shares
            for suffix, recent in (("", True), (", router only", False))
        ]
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].mlp.experts.parameters())
    for number, (name, limit, cached, recent, slots) in enumerate(variants):
        begin = time.perf_counter()
        budget = {0: f"{args.budget_gib + (slots - 2) * layer_bytes / 2**30:.4f}GiB", "cpu": "120GiB"}
        config = hf_prefetch.PrefetchConfig(
            prefetch_step=slots,
            expert_cache=cached,
            routed_max_tokens=limit,
            recent_experts=recent,
            offload_params=offload_params,
        )
        try:
            hf_prefetch.dispatch_model(model, config, max_memory=budget, replace=number > 0)
        except ValueError as error:  # a cache too large for the budget: a result, not a crash
            print(f"{name}: does not fit the budget: {str(error)[:200]}", flush=True)
            continue
        torch.cuda.synchronize()
        state = hf_prefetch.get_state(model)
        streamed = sum(len(ring.layers) for ring in state.engine.rings)
        print(
            f"{name}: dispatched in {time.perf_counter() - begin:.1f} s, {streamed} layers streamed, "
            f"{state.plan.cached_experts} experts cached per layer",
            flush=True,
        )
        moved = bytes_per_token(model, ids)
        short, long = (8, 40) if limit is None else (2, 8)
        hf_prefetch.reset_stats(model)
        samples, tokens = measure(name, model, ids, args.runs, short, long, links)
        stats = hf_prefetch.stats(model)
        looked_up = stats.routed_picks
        hit_rate = stats.cache_hits / looked_up if cached != 0 and looked_up else None
        recent_rate = stats.recent_hits / looked_up if recent and looked_up else None
        if hit_rate is not None:
            print(f"{name}: cache hit rate {hit_rate:.3f} over {looked_up} picks", flush=True)
        if recent_rate is not None:
            print(f"{name}: {recent_rate:.3f} of {looked_up} picks found fetched ahead", flush=True)
        systems[name] = dict(
            samples=samples,
            tokens=tokens,
            moved=moved,
            misses=stats.misses,
            hit_rate=hit_rate,
            recent_rate=recent_rate,
            cached=cached,
            recent=recent,
            routing=limit is None,
        )
        torch._dynamo.reset()

    peak = max(links)
    base = statistics.median(resident)
    print(f"\npinned H2D peak: {peak:.1f} GB/s (fastest of {len(links)}: {', '.join(f'{x:.1f}' for x in links)})")
    print(f"decode, batch 1, Qwen3-30B-A3B shape ({args.layers} layers), budget {args.budget_gib:g} GiB, compiled")
    print(f"(inductor reduce-overhead: CUDA graphs), medians of {args.runs} runs")
    print(f"{'system':<34} {'GB/token':>9} {'s/token':>8} {'bound':>8} {'x bound':>8}  tokens")
    print(f"{'all on GPU':<34} {0:>9.2f} {base:>8.4f} {base:>8.4f} {1:>8.3f}  reference")
    rows = {}
    # The routed bytes of a token at each cache size: those of the row that copies only the router's picks.
    picked = {row["cached"]: row["moved"] for row in systems.values() if row["routing"] and not row["recent"]}
    for name, row in systems.items():
        seconds = statistics.median(row["samples"])
        moved = picked.get(row["cached"], row["moved"]) if row["routing"] else row["moved"]
        bound = max(base, moved / (peak * 1e9))
        same = "identical" if _same_prefix(row["tokens"], reference) else "differ from all-on-GPU"
        rows[name] = dict(
            seconds=seconds,
            bound=bound,
            moved=row["moved"],
            samples=row["samples"],
            hit_rate=row["hit_rate"],
            recent_rate=row["recent_rate"],
        )
        print(
            f"{'hf_prefetch ' + name:<34} {row['moved'] / 1e9:>9.2f} {seconds:>8.4f} {bound:>8.4f} "
            f"{seconds / bound:>8.3f}  {same}; misses {row['misses']}"
        )
    if args.slots:
        reference_row = systems["routed, router only"]["tokens"]
        for name, row in systems.items():
            verdict = "identical" if torch.equal(row["tokens"], reference_row) else "DIFFER"
            print(f"{name}: tokens {verdict} to routed, router only")
    elif args.cache_shares is None and not args.sample:
        whole = systems["whole expert tensors"]
        for name in ("routed experts", "routed, router only"):
            routed = systems[name]
            same = _same_prefix(routed["tokens"], whole["tokens"])
            length = min(routed["tokens"].shape[1], whole["tokens"].shape[1]) - PROMPT_TOKENS
            verdict = "identical" if same else "DIFFER"
            print(f"{name}: tokens {verdict} to whole-tensor tokens (the same compiled ops; first {length} tokens)")
            speedup = rows["whole expert tensors"]["seconds"] / rows[name]["seconds"]
            print(f"{name} over whole expert tensors, compiled: {speedup:.2f}x")
        verdict = (
            "identical"
            if torch.equal(systems["routed experts"]["tokens"], systems["routed, router only"]["tokens"])
            else "DIFFER"
        )
        print(f"routed experts: tokens {verdict} to routed, router only (40 tokens)")
    elif args.cache_shares is None:
        same = torch.equal(systems["routed experts"]["tokens"], systems["routed, router only"]["tokens"])
        print(f"routed experts: tokens {'identical' if same else 'DIFFER'} to routed, router only")
    else:
        first, *others = systems.values()
        for name, row in zip(list(systems)[1:], others, strict=True):
            verdict = "identical" if torch.equal(row["tokens"], first["tokens"]) else "DIFFER"
            print(f"{name}: tokens {verdict} to {list(systems)[0]}'s; hit rate {row['hit_rate']}")
    print(f"all on GPU: compiled {base:.4f} s/token, eager {eager_resident:.4f} s/token")
    save_results("moe_compiled.json", dict(peak=peak, links=links, resident=resident, rows=rows))


if __name__ == "__main__":
    main()
