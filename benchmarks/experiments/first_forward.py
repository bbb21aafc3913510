"""Where a process's first forward spends its one-time costs (CUDA context, cuBLAS, kernel loading, imports).

Each variant runs in a fresh process: `steps` times each warm-up on its own, in order, then the first and second
forward and generate() of a 2-layer Llama-8B-shaped model (weights uninitialised: only the kernels matter); `direct`
runs that model first, with nothing warmed. The difference between the variants' first forwards is what warming up
beforehand saves. Run on a GPU machine:  python benchmarks/experiments/first_forward.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import LLAMA_8B  # noqa: E402

RESULT_MARK = "RESULT "


def run(variant: str) -> dict[str, float]:
    import torch
    import transformers  # noqa: F401  (imported before timing: every system pays it before its load)

    times: dict[str, float] = {}

    def step(name, fn):
        torch.cuda.synchronize() if torch.cuda.is_initialized() else None
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - started

    step("cuda init", lambda: torch.empty(1, device="cuda"))
    hidden, heads = LLAMA_8B["hidden_size"], LLAMA_8B["num_attention_heads"]
    if variant == "steps":
        x = torch.randn(16, hidden, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(LLAMA_8B["intermediate_size"], hidden, device="cuda", dtype=torch.bfloat16)
        step("first bf16 matmul (cuBLAS)", lambda: torch.nn.functional.linear(x, w1))
        step("matmul, another shape", lambda: torch.nn.functional.linear(x, w2))
        step("matmul, the first shape again", lambda: torch.nn.functional.linear(x, w1))
        q = torch.randn(1, heads, 16, hidden // heads, device="cuda", dtype=torch.bfloat16)
        step("first sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
        step("import torch._dynamo", lambda: __import__("torch._dynamo"))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": 2}, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16).eval()
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.original_inv_freq.to("cuda")
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    with torch.no_grad():
        step("first forward", lambda: model(ids))
        step("second forward", lambda: model(ids))
        generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False)
        step("first generate", lambda: model.generate(ids, **generate))
        step("second generate", lambda: model.generate(ids, **generate))
    return times


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        print(RESULT_MARK + json.dumps(run(sys.argv[2])), flush=True)
        return
    for variant in ("direct", "steps", "direct", "steps"):
        child = subprocess.run([sys.executable, __file__, "--run", variant], capture_output=True, text=True)
        found = [line for line in child.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if not found:
            print(f"{variant} failed:\n{child.stderr[-2000:]}")
            continue
        times = json.loads(found[-1].removeprefix(RESULT_MARK))
        print(f"{variant}: " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in times.items()))


if __name__ == "__main__":
    main()
