"""Which ways of compiling static-cache decoding work with transformers, with and without hf_prefetch.

For a small random Llama (fp32, 8 layers, every 2nd streamed when offloaded), each path generates 32 tokens greedily
three times and is compared with eager tokens. Prints one line per (path, model): ok / different tokens / the error.
Run on a GPU machine:  PYTHONUNBUFFERED=1 python benchmarks/compile_paths.py
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_prefetch  # noqa: E402


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def generate(m, ids, **kwargs):
    with torch.no_grad():
        return m.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            cache_implementation="static",
            **kwargs,
        )


def compile_forward(mode: str):
    def setup(m):
        m.forward = torch.compile(m.forward, mode=mode)

    return setup


# name -> (setup of the model, generate kwargs)
PATHS = {
    # transformers compiles the decode step itself (CompileConfig(): inductor, reduce-overhead)
    "generate(cache_implementation='static') [auto compile, reduce-overhead]": (None, {}),
    "generate(..., compile_config=CompileConfig(mode='default'))": (
        None,
        {"compile_config": CompileConfig(mode="default")},
    ),
    "model.forward = torch.compile(model.forward, mode='reduce-overhead')": (
        compile_forward("reduce-overhead"),
        {"disable_compile": True},
    ),
    "model.forward = torch.compile(model.forward)": (compile_forward("default"), {"disable_compile": True}),
}


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    base = model()
    ids = torch.randint(3, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    eager = generate(copy.deepcopy(base).cuda(), ids, disable_compile=True)
    for name, (setup, kwargs) in PATHS.items():
        for offloaded in (False, True):
            torch._dynamo.reset()
            m = copy.deepcopy(base)
            if offloaded:
                hf_prefetch.dispatch_model(
                    m, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda"
                )
            else:
                m = m.cuda()
            label = f"{name:<75} {'hf_prefetch' if offloaded else 'resident':<11}"
            try:
                start = time.perf_counter()
                if setup is not None:
                    setup(m)
                outs = [generate(m, ids, **kwargs) for _ in range(3)]
                seconds = time.perf_counter() - start
                same = all(torch.equal(out, eager) for out in outs)
                print(f"{label} {'ok' if same else 'different tokens'} ({seconds:.1f} s for 3 calls)", flush=True)
            except Exception as err:  # a path failing is the result
                last = traceback.format_exception_only(err)[-1].strip()
                print(f"{label} FAILED: {last[:300]}", flush=True)
            del m
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
