"""Are routed copies inside CUDA graphs bitwise right? A check on a few layers of the Qwen3-30B-A3B shape. GPU only.

`moe_compiled.py` compares compiled routed tokens with compiled whole-tensor tokens on the 48-layer model; this is the
quicker, finer check (logits at every step): one model of `layers` layers (8 by default) at a budget of 60% of its
bytes, decoded greedily with a static cache (24 tokens, the second of two generate calls) in each of:
routed / whole expert tensors (`routed_max_tokens=0`) x compiled with CUDA graphs ("reduce-overhead") / compiled
without ("default") / eager, and routed compiled a second time from scratch. Pairs that run the same ops must give
identical logits; a race or a stale row shows up as a difference.

    python benchmarks/moe_graph_check.py [layers]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import build  # noqa: E402

import hf_prefetch  # noqa: E402


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    model = build(layers)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")

    def generate(mode):
        cache = StaticCache(config=model.config, max_cache_len=80)
        outs = []
        for _ in range(2):  # the first compiles and records, the second replays
            cache.reset()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    past_key_values=cache,
                    max_new_tokens=24,
                    min_new_tokens=24,
                    do_sample=False,
                    compile_config=CompileConfig(mode=mode) if mode else None,
                    disable_compile=mode is None,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            outs.append(out)
        return outs[-1]

    results = {"resident-eager": generate(None)}
    budget = {0: f"{layers * 1.27 * 0.6:.1f}GiB", "cpu": "120GiB"}
    runs = [
        ("routed-ro", None, "reduce-overhead"),
        ("whole-ro", 0, "reduce-overhead"),
        ("routed-def", None, "default"),
        ("whole-def", 0, "default"),
        ("routed-eager", None, None),
        ("routed-ro2", None, "reduce-overhead"),
    ]
    for name, limit, mode in runs:
        begin = time.perf_counter()
        config = hf_prefetch.PrefetchConfig(prefetch_step=2, expert_cache=0, routed_max_tokens=limit)
        replace = hf_prefetch.get_state(model) is not None
        hf_prefetch.dispatch_model(model, config, max_memory=budget, replace=replace)
        torch._dynamo.reset()
        results[name] = generate(mode)
        engine = hf_prefetch.get_state(model).engine
        print(
            name,
            f"{time.perf_counter() - begin:.1f}s",
            "graphs",
            engine.graphs,
            "misses",
            hf_prefetch.stats(model).misses,
            flush=True,
        )

    def first_difference(a, b) -> str:
        for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
            if not torch.equal(x, y):
                return f"step {step}: max abs {(x.float() - y.float()).abs().max().item():.3g}"
        return "identical"

    pairs = [
        ("routed-ro", "whole-ro"),
        ("routed-def", "whole-def"),
        ("routed-ro", "routed-def"),
        ("whole-ro", "whole-def"),
        ("routed-ro", "routed-ro2"),
        ("routed-eager", "resident-eager"),
    ]
    for a, b in pairs:
        print(a, "vs", b, ":", first_difference(results[a], results[b]))


if __name__ == "__main__":
    main()
