"""The recent-experts policy on routing the benchmark controls: the default against the router's own picks. GPU only.

A random bf16 model of a gpt-oss-20b or Qwen3-30B-A3B shape is built on the GPU (the reference: all on the GPU) and
copied twice more; the three are dispatched at one budget (`--budget-share` of the model's bytes) with different
configs and stay dispatched, so that the systems alternate inside each routing regime, `--pairs` times:
- "router only": `PrefetchConfig(recent_experts=False, expert_cache=0)`: only the router's picks cross the link,
- "default": `PrefetchConfig()`: recent experts measured per layer, and the expert cache the budget leaves spare,
- "cache N": `PrefetchConfig(expert_cache=top_k)`: a cache the user sets (the planner streams more to make room).
Every experts module picks by a regime of tests/routing.py (random, sticky, skewed, drifting, and "mixed": each layer
its own), a function of the hidden states chosen on the device, so one compile serves every regime. Decoding is greedy;
a row's s/token is the median time of one generate's tokens from `--short` to `--long` (eager; compiled:
`(t(long) - t(short)) / (long - short)` of two generates), so a policy's first window (`expert_policy.WINDOW` tokens
after the prefill) is outside it, and the median of its pairs; "time / router only" is the median of the pairs' ratios
to router only; its bytes per token are the engine's counters over the same tokens.
`--profile` ends with torch.profiler's host time per token of each system on sticky routing, by operation.
bound = max(all-on-GPU s/token, router-only bytes per token (all it copies) / pinned H2D peak), the peak
measured before each row and the fastest used. With `--compiled`, transformers' compile of static-cache decoding
(inductor "reduce-overhead": CUDA graphs); the bytes of a replayed token are not counted by Python, so they are counted
on one eager generate of the same dispatch; every model is compiled before the first row, and since the gathers
change inductor's fusions, compiled tokens are compared with router only's first run (its later runs too).

    python benchmarks/moe_policy.py --shape gpt-oss-20b --layers 12 [--compiled] [--pairs 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LogitsProcessorList,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    StaticCache,
)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import h2d_peak_gbps, save_results, static_decode  # noqa: E402
from moe import build, generate  # noqa: E402

import hf_prefetch  # noqa: E402
from tests.routing import control_routing  # noqa: E402

SHAPES = {
    "gpt-oss-20b": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
            sliding_window=128, max_position_embeddings=4096, tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
            vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False,
        ),
    ),
}  # fmt: skip
REGIMES = {
    "random": "random",
    "sticky": "sticky",
    "skewed": "skewed",
    "drifting": "drifting",
    "mixed": ["sticky", "random", "skewed", "drifting"],
}
PROMPT_TOKENS = 16


class _TokenClock:
    """A logits processor (called once per generated token, after its forward): the time each token's forward ended,
    and the engine's copied bytes at token `short` and at the last one."""

    def __init__(self, model, short: int, long: int) -> None:
        self.model, self.short, self.long = model, short, long
        self.times: list[float] = []
        self.bytes: list[int] = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if len(self.times) - 1 in (self.short, self.long - 1) and hf_prefetch.get_state(self.model) is not None:
            self.bytes.append(hf_prefetch.stats(self.model).copied_bytes)
        return scores


def measure(model, ids, short: int, long: int, compiled: bool, cache) -> tuple[float, float | None, torch.Tensor]:
    """(s/token, bytes/token or None where replays are not counted, tokens of the run) over the tokens from `short`
    to `long`, past the prefill and the policy's first window. Eager: one generate, the median of its tokens' times
    (a host-bound decode stalls now and then; a median of many tokens does not follow one stall) and the bytes
    copied over the same tokens. Compiled: the difference of two generates (replays run no Python to time them)."""
    if hf_prefetch.get_state(model) is not None:
        hf_prefetch.reset_stats(model)  # the row's counts (misses) are this measure's
    if compiled:
        times = []
        for n in (short, long):
            seconds, out = static_decode(model, ids, cache, n, True)
            times.append(seconds)
        return (times[1] - times[0]) / (long - short), None, out
    clock = _TokenClock(model, short, long)
    out = generate(model, ids, long, logits_processor=LogitsProcessorList([clock]))
    steps = [b - a for a, b in zip(clock.times[short:-1], clock.times[short + 1 :], strict=True)]
    per_token = (clock.bytes[1] - clock.bytes[0]) / len(steps) if len(clock.bytes) == 2 else 0.0
    return statistics.median(steps), per_token, out


def eager_bytes_per_token(model, ids, short: int, long: int) -> float:
    _, per_token, _ = measure(model, ids, short, long, False, None)
    return per_token


def profile_host(models: dict, controls: dict, ids: torch.Tensor, tokens: int, top: int = 12) -> None:
    """Each system's host time per decoded token on sticky routing, by operation (torch.profiler's self CPU time of
    one eager generate, the prefill included), the busiest `top` operations."""
    from torch.profiler import ProfilerActivity, profile

    for name, model in models.items():
        controls[name].set("sticky")
        generate(model, ids, tokens)  # the policy's windows settle on sticky routing first
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, ids, tokens)
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events) / 1e3 / tokens
        print(f"host time of {name} on sticky routing: {total:.2f} ms per token (profiled), busiest operations:")
        for e in events[:top]:
            print(
                f"  {e.key[:60]:60} {e.self_cpu_time_total / 1e3 / tokens:8.3f} ms/token  "
                f"{e.count / tokens:6.1f} calls/token"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--budget-share", type=float, default=0.5, help="max_memory[0] as a share of the model")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=48)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES))
    args = parser.parse_args()
    if args.long - args.short < 2:
        parser.error(
            f"--long ({args.long}) must exceed --short ({args.short}) by at least 2: the tokens between are timed"
        )
    layers = args.layers or SHAPES[args.shape][2]["num_hidden_layers"]
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  shape {args.shape}, {layers} layers",
        flush=True,
    )
    torch.manual_seed(0)
    reference = build(layers, *SHAPES[args.shape])
    top_k = reference.config.num_experts_per_tok
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    budget = int(model_bytes * args.budget_share)
    control = control_routing(reference, "random")
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    cache_len = PROMPT_TOKENS + args.long + 8

    configs = {
        "router only": hf_prefetch.PrefetchConfig(recent_experts=False, expert_cache=0),
        "default": hf_prefetch.PrefetchConfig(),
        f"cache {top_k}": hf_prefetch.PrefetchConfig(expert_cache=top_k),
    }
    models, controls = {}, {}
    for name, config in configs.items():
        model = copy.deepcopy(reference)
        for module in model.modules():  # the copy's own routing control, on the same seeds
            module._forward_pre_hooks.clear()
        controls[name] = control_routing(model, "random", device="cuda")
        begin = time.perf_counter()
        hf_prefetch.dispatch_model(model, config, max_memory={0: budget, "cpu": "120GiB"}, reserve_bytes=2**30)
        plan = hf_prefetch.get_state(model).plan
        print(
            f"{name}: dispatched in {time.perf_counter() - begin:.1f} s; "
            f"{sum(len(ring.streamed) for ring in plan.rings)} layers streamed, "
            f"{plan.cached_experts} experts cached per layer",
            flush=True,
        )
        models[name] = model
    caches = {name: StaticCache(config=reference.config, max_cache_len=cache_len) for name in [*models, "resident"]}

    if args.compiled:  # every model's compile (one serves every regime) before any timing
        for name, model in {"resident": reference, **models}.items():
            static_decode(model, ids, caches[name], args.long, True)
    links = [h2d_peak_gbps()]
    results = []
    for regime in args.regimes:
        control.set(REGIMES[regime])
        for c in controls.values():
            c.set(REGIMES[regime])
        resident, _, want = measure(reference, ids, args.short, args.long, args.compiled, caches["resident"])
        samples = {name: [] for name in models}
        moved, tokens = {}, {}
        for pair in range(args.pairs):
            for name, model in models.items():
                links.append(h2d_peak_gbps())
                seconds, copied, got = measure(model, ids, args.short, args.long, args.compiled, caches[name])
                samples[name].append(seconds)
                if args.compiled and name == "router only" and pair == 0:
                    # Compiled, the gathers change inductor's fusions: router only's first run is the reference.
                    want = got
                tokens[name] = tokens.get(name, True) and torch.equal(got, want)  # every pair's
                if copied is not None:
                    moved[name] = copied
        if args.compiled:
            moved = {name: eager_bytes_per_token(model, ids, args.short, args.long) for name, model in models.items()}
        link = max(links)
        bound = max(resident, moved["router only"] / (link * 1e9))
        for name in models:
            seconds = statistics.median(samples[name])
            # The median of the pairs' ratios: a host-bound eager decode drifts between pairs more than it differs
            # between systems within one.
            ratios = [t / r for t, r in zip(samples[name], samples["router only"], strict=True)]
            layers_stats = hf_prefetch.stats(models[name]).layers
            policy = ", ".join(sorted({layer.recent_decision for layer in layers_stats}))
            row = dict(
                regime=regime,
                system=name,
                gb_per_token=moved[name] / 1e9,
                bytes_vs_router=moved[name] / moved["router only"],
                s_per_token=seconds,
                vs_router=statistics.median(ratios),
                pair_ratios=ratios,
                x_bound=seconds / bound,
                tokens_identical=tokens[name],
                recent=policy,
                misses=hf_prefetch.stats(models[name]).misses,
            )
            results.append(row)
            print(
                f"{regime:9} {name:12} {row['gb_per_token']:.3f} GB/token ({row['bytes_vs_router']:.3f}x router) "
                f"{seconds:.4f} s/token ({row['vs_router']:.3f}x router, {row['x_bound']:.3f}x bound) "
                f"tokens {'identical' if tokens[name] else 'DIFFER'}; recent {policy}; resident {resident:.4f}",
                flush=True,
            )
    if args.profile:
        profile_host({"all on GPU": reference, **models}, {"all on GPU": control, **controls}, ids, args.long)
    print(f"link {max(links):.1f} GB/s (fastest of {len(links)})")
    print("| regime | system | GB/token | bytes / router only | s/token | time / router only | x bound | tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r['regime']} | {r['system']} | {r['gb_per_token']:.3f} | {r['bytes_vs_router']:.3f} | "
            f"{r['s_per_token']:.4f} | {r['vs_router']:.3f} | {r['x_bound']:.3f} | "
            f"{'identical' if r['tokens_identical'] else 'differ'} |"
        )
    save_results(
        f"moe_policy_{args.shape}{'_compiled' if args.compiled else ''}.json", dict(args=vars(args), rows=results)
    )


if __name__ == "__main__":
    main()
