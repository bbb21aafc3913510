"""Mixture-of-experts decode with routed experts against whole expert tensors, Qwen3-30B-A3B shape. GPU only.

A random bf16 model of the Qwen3-30B-A3B shape (48 layers, 128 experts, 8 per token, hidden 2048, moe_intermediate
768: about 61 GB) is built on the GPU, where it fits an 80 GB H100: that run gives the reference tokens and the
all-on-GPU time. It is then dispatched at a GPU budget (max_memory, 24 GiB by default) and decoded twice on the same
dispatch, alternately: with routed experts (a decode forward copies only the experts its token picks) and with routing
off (`routed_max_tokens` 0: every forward copies whole expert tensors, as streaming without routing does).
The bound of each row is `max(all-on-GPU time, bytes copied per token / pinned H2D peak)`, with the bytes read from the
engine's counters. Then the forward time at a few token counts with routing forced on and off (where routing stops
paying: the default `routed_max_tokens`), and prefill of 2048 tokens against its whole-layer transfer bound.

    python benchmarks/moe.py [--budget-gib 24] [--pairs 2] [--layers 48] [--parts decode sweep prefill cache]
        [--cache-shares 0 0.25 0.5] [--cache-budget-gib 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_offload_params_argument, h2d_peak_gbps, save_results, timed  # noqa: E402

import hf_prefetch  # noqa: E402

PARTS = ["decode", "sweep", "prefill", "cache"]
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build(layers: int, config_class=Qwen3MoeConfig, model_class=Qwen3MoeForCausalLM, fields=QWEN3_30B_A3B):
    """A random bf16 model of `fields` (the Qwen3-30B-A3B shape by default) with `layers` layers, on the GPU."""
    config = config_class(**{**fields, "num_hidden_layers": layers})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def generate(model, ids, n: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs
        )


def decode(model, ids, short: int, long: int) -> tuple[float, torch.Tensor]:
    t_short = timed(lambda: generate(model, ids, short))
    out = {}
    t_long = timed(lambda: out.setdefault("tokens", generate(model, ids, long)))
    return (t_long - t_short) / (long - short), out["tokens"]


def copied_bytes(model) -> int:
    return hf_prefetch.stats(model).copied_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--cache-shares", type=float, nargs="*", default=[0.0, 0.25, 0.5])
    parser.add_argument("--cache-budget-gib", type=float, default=None, help="the cache rows' budget (--budget-gib)")
    parser.add_argument("--parts", nargs="*", default=PARTS, choices=PARTS)
    add_offload_params_argument(parser)
    args = parser.parse_args()
    offload_params = frozenset(args.offload_params)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    links = [h2d_peak_gbps()]
    begin = time.perf_counter()
    model = build(args.layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {args.layers} layers, {nbytes / 1e9:.1f} GB, in {time.perf_counter() - begin:.1f} s", flush=True)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    resident_s, reference = decode(model, ids, 4, 20)
    print(f"all on GPU: {resident_s:.4f} s/token", flush=True)
    prefill_ids = torch.randint(3, 1000, (1, 2048), device="cuda")
    with torch.no_grad():
        model(prefill_ids, use_cache=False)
        resident_prefill = statistics.median(timed(lambda: model(prefill_ids, use_cache=False)) for _ in range(3))
    print(f"all on GPU prefill 2048: {resident_prefill:.4f} s", flush=True)

    begin = time.perf_counter()
    budget = {0: f"{args.budget_gib}GiB", "cpu": "120GiB"}
    # No expert cache here (the cache rows below measure it): the budget's spare memory stays unused.
    config = hf_prefetch.PrefetchConfig(prefetch_step=2, expert_cache=0, offload_params=offload_params)
    hf_prefetch.dispatch_model(model, config, max_memory=budget)
    torch.cuda.synchronize()
    state = hf_prefetch.get_state(model)
    plan, engine = state.plan, state.engine
    print(f"dispatched in {time.perf_counter() - begin:.1f} s", flush=True)
    print(plan, flush=True)
    default_limit = engine.routed_max_tokens

    table, ratios, sweep, prefill_row, cache_rows = {}, [], [], {}, []
    if "decode" in args.parts:
        rows: dict[str, list[dict]] = {"routed": [], "whole": []}
        for name in ("routed", "whole"):  # warm-up: a first decode's one-time costs land in no timed difference
            engine.routed_max_tokens = default_limit if name == "routed" else 0
            generate(model, ids, 4)
        for pair in range(args.pairs):
            for name in ("routed", "whole") if pair % 2 == 0 else ("whole", "routed"):
                engine.routed_max_tokens = default_limit if name == "routed" else 0
                links.append(h2d_peak_gbps())
                short, long = (4, 20) if name == "routed" else (2, 8)
                hf_prefetch.reset_stats(model)
                seconds, tokens = decode(model, ids, short, long)
                moved = copied_bytes(model)
                same = torch.equal(tokens, reference[:, : tokens.shape[1]])
                rows[name].append(dict(seconds=seconds, same=same, moved=moved))
                print(
                    f"pair {pair} {name}: {seconds:.4f} s/token, tokens identical {rows[name][-1]['same']}", flush=True
                )
        engine.routed_max_tokens = default_limit

        # Bytes one decode token moves: a prefill of the prompt, then one decode step, counted alone.
        per_token = {}
        for name in ("routed", "whole"):
            engine.routed_max_tokens = default_limit if name == "routed" else 0
            with torch.no_grad():
                out = model(ids, use_cache=True)
                step = out.logits[:, -1:].argmax(-1)
                hf_prefetch.reset_stats(model)
                model(step, past_key_values=out.past_key_values, use_cache=True)
            per_token[name] = copied_bytes(model)
        engine.routed_max_tokens = default_limit

        peak = max(links)
        print(f"\npinned H2D peak: {peak:.1f} GB/s (fastest of {len(links)}: {', '.join(f'{x:.1f}' for x in links)})")
        print(f"decode, batch 1, Qwen3-30B-A3B shape ({args.layers} layers), budget {args.budget_gib:g} GiB")
        print(f"{'system':<34} {'GB/token':>9} {'s/token':>8} {'bound':>8} {'x bound':>8} {'tokens':>9}")
        print(f"{'all on GPU':<34} {0:>9.2f} {resident_s:>8.4f} {resident_s:>8.4f} {1:>8.3f} {'reference':>9}")
        for name, label in (("routed", "hf_prefetch routed experts"), ("whole", "hf_prefetch whole expert tensors")):
            seconds = statistics.median(r["seconds"] for r in rows[name])
            bound = max(resident_s, per_token[name] / (peak * 1e9))
            same = all(r["same"] for r in rows[name])
            table[name] = dict(seconds=seconds, bound=bound, bytes_per_token=per_token[name], identical=same)
            print(
                f"{label:<34} {per_token[name] / 1e9:>9.2f} {seconds:>8.4f} {bound:>8.4f} {seconds / bound:>8.3f} "
                f"{'identical' if same else 'DIFFER':>9}"
            )
        ratios = [w["seconds"] / r["seconds"] for r, w in zip(rows["routed"], rows["whole"], strict=True)]
        print(f"routed speed-up over whole expert tensors (median of paired ratios): {statistics.median(ratios):.2f}x")

    if "sweep" in args.parts:
        print(
            "\nforward of t tokens (batch 1, no cache), routing on against off; default "
            f"routed_max_tokens={default_limit}"
        )
        print(f"{'tokens':>6} {'routed s':>9} {'whole s':>9} {'whole / routed':>15}")
        for t in args.tokens:
            x = torch.randint(3, 1000, (1, t), device="cuda")
            times = {"routed": [], "whole": []}
            with torch.no_grad():
                for _ in range(3):
                    for name in ("routed", "whole"):
                        engine.routed_max_tokens = 10**9 if name == "routed" else 0
                        model(x, use_cache=False)  # the slots' first layers in this mode
                        times[name].append(timed(lambda x=x: model(x, use_cache=False)))
            r, w = statistics.median(times["routed"]), statistics.median(times["whole"])
            sweep.append(dict(tokens=t, routed=r, whole=w))
            print(f"{t:>6} {r:>9.4f} {w:>9.4f} {w / r:>15.2f}", flush=True)
        engine.routed_max_tokens = default_limit

    if "prefill" in args.parts:
        hf_prefetch.reset_stats(model)
        with torch.no_grad():
            model(prefill_ids, use_cache=False)
            prefill = statistics.median(timed(lambda: model(prefill_ids, use_cache=False)) for _ in range(3))
        prefill_bytes = plan.streamed_bytes_per_forward
        prefill_bound = max(resident_prefill, prefill_bytes / (max(links) * 1e9))
        prefill_row = dict(resident=resident_prefill, ours=prefill, bound=prefill_bound)
        print(
            f"\nprefill 2048 tokens: all on GPU {resident_prefill:.4f} s; hf_prefetch {prefill:.4f} s, bound "
            f"{prefill_bound:.4f} s ({prefill_bytes / 1e9:.2f} GB), x bound {prefill / prefill_bound:.3f}"
        )
        print(f"misses: {hf_prefetch.stats(model).misses}")

    if "cache" in args.parts:
        cache_gib = args.cache_budget_gib or args.budget_gib
        cache_budget = {0: f"{cache_gib}GiB", "cpu": "120GiB"}
        if args.cache_shares:
            print(
                f"\nexpert cache at a budget of {cache_gib:g} GiB: decode, batch 1 (the planner streams more "
                "layers to make room)"
            )
            header = (
                f"{'cached experts':>14} {'streamed':>9} {'GB/token':>9} {'hit rate':>9} {'s/token':>8} {'x bound':>8}"
            )
            print(f"{header} {'tokens':>9}")
        for share in args.cache_shares:
            cached = int(share * QWEN3_30B_A3B["num_experts"])
            config = hf_prefetch.PrefetchConfig(prefetch_step=2, expert_cache=cached, offload_params=offload_params)
            try:
                hf_prefetch.dispatch_model(model, config, max_memory=cache_budget, replace=True)
            except ValueError as error:  # a cache too large for the budget: a result, not a crash
                print(f"{cached:>14} does not fit the budget: {str(error)[:160]}")
                continue
            engine = hf_prefetch.get_state(model).engine
            generate(model, ids, 24)  # warm-up: the cache fills and is re-ranked by the picks
            hf_prefetch.reset_stats(model)
            seconds, tokens = decode(model, ids, 4, 20)
            stats = hf_prefetch.stats(model)
            looked_up = stats.cache_hits + stats.cache_misses
            with torch.no_grad():
                out = model(ids, use_cache=True)
                step = out.logits[:, -1:].argmax(-1)
                hf_prefetch.reset_stats(model)
                model(step, past_key_values=out.past_key_values, use_cache=True)
            moved = copied_bytes(model)
            links.append(h2d_peak_gbps())
            bound = max(resident_s, moved / (max(links) * 1e9))
            same = torch.equal(tokens, reference[:, : tokens.shape[1]])
            streamed = sum(len(r.layers) for r in engine.rings)
            hit_rate = stats.cache_hits / looked_up if looked_up else 0.0
            cache_rows.append(dict(cached=cached, seconds=seconds, bytes=moved, hit_rate=hit_rate, identical=same))
            print(
                f"{cached:>14} {streamed:>9} {moved / 1e9:>9.2f} {hit_rate:>9.2f} {seconds:>8.4f} "
                f"{seconds / bound:>8.3f} {'identical' if same else 'DIFFER':>9}",
                flush=True,
            )
    save_results(
        "moe.json",
        dict(
            peak=max(links),
            links=links,
            resident=resident_s,
            table=table,
            ratios=ratios,
            sweep=sweep,
            prefill=prefill_row,
            cache=cache_rows,
        ),
    )


if __name__ == "__main__":
    main()
