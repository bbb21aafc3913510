"""The router-only gather (`PrefetchConfig(recent_experts=False, expert_cache=0)`) in one pass against two. GPU only.

One pass: the Triton gather at the router (`experts.gather_looked_up`) reads each picked expert's rows from host
memory (through the mapped view) straight into the slot. Two passes: torch's `index_select` of those rows from the
mapped view into a temporary, then `index_copy_` of it into the slot (`experts.copy_routed_rows`), which the library
used without a cache or recent picks before; here forced by taking a dispatched layer's device counts away. A random
bf16 model of a gpt-oss-20b or Qwen3-30B-A3B shape, every experts module picking at random (tests/routing.py), is
built on the GPU (the reference) and copied twice; both copies are dispatched router only at `--budget-share` of the
model's bytes and decode greedily, alternating with the reference, `--pairs` times: s/token between a generate of
`--short` and one of `--long` new tokens. bound = max(all on the GPU, routed bytes per token / the link's peak).

    PYTHONPATH=. python benchmarks/experiments/router_gather_passes.py --shape gpt-oss-20b --layers 12 [--pairs 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import h2d_peak_gbps  # noqa: E402
from moe import build  # noqa: E402
from moe_policy import PROMPT_TOKENS, SHAPES, measure  # noqa: E402

import hf_prefetch  # noqa: E402
from tests.routing import control_routing  # noqa: E402


def two_passes(model) -> int:
    """Make the dispatched `model`'s router-only gathers torch's two passes; returns how many layers changed."""
    engine = hf_prefetch.get_state(model).engine
    changed = 0
    for transfers in engine.rings:
        for layer in transfers.layers:
            if layer.tallies is not None and layer.cache is None and layer.recent is None:
                layer.tallies = None
                changed += 1
    engine._caches.counted = [layer for layer in engine._caches.counted if layer.tallies is not None]
    return changed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=48)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  {args.shape}, {args.layers} layers")
    torch.manual_seed(0)
    reference = build(args.layers, *SHAPES[args.shape])
    control_routing(reference, "random")
    budget = int(sum(p.numel() * p.element_size() for p in reference.parameters()) * args.budget_share)
    config = hf_prefetch.PrefetchConfig(recent_experts=False, expert_cache=0)
    systems = {"all on the GPU": reference}
    for name in ("one pass", "two passes"):
        model = copy.deepcopy(reference)
        for module in model.modules():  # the copy's own routing control, on the same seeds
            module._forward_pre_hooks.clear()
        control_routing(model, "random", device="cuda")
        hf_prefetch.dispatch_model(model, config, max_memory={0: budget, "cpu": "120GiB"}, reserve_bytes=2**30)
        if name == "two passes":
            print(f"two passes: {two_passes(model)} layers' gathers made torch's", flush=True)
        systems[name] = model
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    for model in systems.values():
        measure(model, ids, 4, 8, False, None)  # warm-up: kernels built and loaded
    samples = {name: [] for name in systems}
    moved, same, want = {}, dict.fromkeys(systems, True), None
    links = []
    for pair in range(args.pairs):
        links.append(h2d_peak_gbps())
        for name, model in systems.items():
            seconds, per_token, out = measure(model, ids, args.short, args.long, False, None)
            want = out if name == "all on the GPU" else want
            same[name] = same[name] and torch.equal(out, want)
            samples[name].append(seconds)
            moved[name] = per_token or 0.0
            print(f"pair {pair} {name}: {seconds:.4f} s/token, {moved[name] / 1e9:.3f} GB/token", flush=True)
    link = max(links)
    resident = statistics.median(samples["all on the GPU"])
    bound = max(resident, moved["one pass"] / (link * 1e9))
    ratios = [b / a for a, b in zip(samples["one pass"], samples["two passes"], strict=True)]
    print(f"\nlink {link:.1f} GB/s; medians of {args.pairs}; two passes over one pass, paired: "
          f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")  # fmt: skip
    print("| system | GB/token | s/token | bound | x bound | tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name in systems:
        s = statistics.median(samples[name])
        verdict = "reference" if name == "all on the GPU" else "identical" if same[name] else "differ"
        print(f"| {name} | {moved[name] / 1e9:.3f} | {s:.4f} | {bound:.4f} | {s / bound:.3f} | {verdict} |")


if __name__ == "__main__":
    main()
