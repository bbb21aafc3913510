"""Where a streamed MXFP4 decode token's time goes, gpt-oss-20b shape. GPU only.

The checkpoint of `benchmarks/mxfp4.py` (`--layers` layers, experts as MXFP4 blocks and scales) runs four ways,
alternating, `--pairs` times (s/token between generates of 4 and 20 new tokens): streamed with `mxfp4.py`'s config
(every experts module streamed and routed), and all on the GPU three ways: packed, dequantizing the picked experts in
every forward (what the streamed model computes, without the link); with its experts dequantized to bf16 once; and
packed with `dense_weight` made a no-op returning a preallocated tensor (the eager expert loop alone, wrong values:
only its time is read). Then one greedy generate of the streamed and the packed resident models each under
torch.profiler: the CUDA kernels taking most device time and the host calls taking most host time, per decode token.

    PYTHONPATH=. python benchmarks/experiments/mxfp4_time.py [--layers 8] [--pairs 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GptOssConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import h2d_peak_gbps  # noqa: E402
from mxfp4 import (  # noqa: E402
    GPT_OSS_20B,
    bytes_per_token,
    decode,
    dequantized_model,
    generate,
    packed_model,
    write_checkpoint,
)

import hf_prefetch  # noqa: E402
from hf_prefetch.formats import mxfp4  # noqa: E402


def profiled(model, ids, tokens: int, label: str) -> None:
    generate(model, ids, 2)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(model, ids, tokens)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    per = 1e3 / tokens  # microseconds summed over the generate -> ms per token
    device = sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:18]
    print(f"\n{label}: CUDA kernels by device time, ms per token (prefill included)")
    for e in device:
        print(f"  {e.device_time_total / 1e3 * per / 1e3:9.3f}  x{e.count / tokens:7.1f}  {e.key[:110]}")
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:22]
    print(f"{label}: host calls by self CPU time, ms per token")
    for e in host:
        print(f"  {e.self_cpu_time_total / 1e3 * per / 1e3:9.3f}  x{e.count / tokens:7.1f}  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    config = GptOssConfig(**{**GPT_OSS_20B, "num_hidden_layers": args.layers}, dtype="bfloat16")
    folder = Path(tempfile.mkdtemp(prefix="mxfp4-time-"))
    try:
        write_checkpoint(folder, config)
        offload = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=2, offload_params={"experts"}, expert_cache=0)
        models = {
            "streamed, packed": hf_prefetch.from_pretrained(folder, offload, device="cuda"),
            "on the GPU, packed": packed_model(folder, config),
            "on the GPU, bf16": dequantized_model(folder, config).to("cuda"),
            "on the GPU, packed, no dequantization": packed_model(folder, config),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # The last model's dequantization returns a buffer dequantized once, found by its blocks: its expert loop's time
    # alone. Every other model dequantizes as before.
    original = mxfp4.dense_weight
    fixed = {
        getattr(module, f"{proj}_blocks").data_ptr(): original(
            getattr(module, f"{proj}_blocks"), getattr(module, f"{proj}_scales")
        )
        for module in models["on the GPU, packed, no dequantization"].modules()
        if mxfp4.dequantizes(module)
        for proj in mxfp4.PROJECTIONS
    }

    def maybe_fixed(blocks, scales, experts=None):
        found = fixed.get(blocks.data_ptr())
        return found if found is not None else original(blocks, scales, experts)

    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    mxfp4.dense_weight = maybe_fixed
    try:
        timings(models, ids, args.pairs)
    finally:
        mxfp4.dense_weight = original
    profiled(models["streamed, packed"], ids, 12, "streamed, packed")
    profiled(models["on the GPU, packed"], ids, 12, "on the GPU, packed")


def timings(models: dict, ids: torch.Tensor, pairs: int) -> None:
    """Each model's decode of `ids`, alternating, `pairs` times; the streamed model's bytes per token; whether tokens
    agree."""
    for model in models.values():
        generate(model, ids, 2)
    links = [h2d_peak_gbps()]
    seconds: dict[str, list[float]] = {name: [] for name in models}
    tokens = {}
    for pair in range(pairs):
        for name in models if pair % 2 == 0 else reversed(models):
            s, out = decode(models[name], ids)
            seconds[name].append(s)
            tokens[name] = out
            print(f"pair {pair} {name}: {s:.4f} s/token", flush=True)
        links.append(h2d_peak_gbps())
    peak = max(links)
    copied = bytes_per_token(models["streamed, packed"], ids)
    print(f"\nlink peak {peak:.1f} GB/s; streamed bytes per decode token {copied / 1e9:.3f} GB "
          f"-> {copied / peak / 1e9:.4f} s at the peak")  # fmt: skip
    for name, values in seconds.items():
        print(f"{name:<40} {statistics.median(values):.4f} s/token  ({', '.join(f'{v:.4f}' for v in values)})")
    streamed_same = torch.equal(tokens["streamed, packed"], tokens["on the GPU, packed"])
    packed_same = torch.equal(tokens["on the GPU, packed"], tokens["on the GPU, bf16"])
    print(f"tokens: streamed == packed resident: {streamed_same}; packed == bf16 resident: {packed_same}")


if __name__ == "__main__":
    main()
