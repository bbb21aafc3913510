"""One denoising step of a Flux-12B-shaped transformer: all on the GPU, hf_prefetch at budgets, diffusers' group
offloading. GPU only; needs diffusers (`pip install "hf_prefetch[diffusers]"`).

A random bf16 `FluxTransformer2DModel` of FLUX.1-dev's shape (19 double and 38 single blocks, 24 heads of 128,
guidance embedding; 23.8 GB) runs one step at 1024x1024: 4096 image tokens and 512 text tokens. Rows:
- all on GPU: the reference output and time;
- hf_prefetch with `max_memory` set so that a given share of the weights stays resident (the budget planner picks the
  streamed blocks of both lists), for each `--resident` share; bound `max(all-on-GPU time, streamed bytes / link)`;
- diffusers' `apply_group_offloading` from a CPU copy, `block_level` (one block per group) and `leaf_level`, both with
  `use_stream=True`, bound the same way with all weights streamed.
Systems alternate in one process, `--rounds` times; medians. Every output is compared bit for bit with the all-on-GPU
one. The last line estimates the share of weights that can stream with the copies fully hidden: the all-on-GPU step
time at link speed, over the weights.

    python benchmarks/diffusers_step.py [--resident 0.25 0.5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import h2d_peak_gbps, save_results, timed  # noqa: E402

import hf_prefetch  # noqa: E402

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
IMAGE_TOKENS, TEXT_TOKENS = 4096, 512


def build(config: dict, device: str = "cuda"):
    from diffusers import FluxTransformer2DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def inputs(config: dict, device: str = "cuda") -> dict:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    return dict(
        hidden_states=randn(1, IMAGE_TOKENS, config["in_channels"]),
        encoder_hidden_states=randn(1, TEXT_TOKENS, config["joint_attention_dim"]),
        pooled_projections=randn(1, config["pooled_projection_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], device=device, dtype=torch.bfloat16) if config.get("guidance_embeds") else None,
        img_ids=torch.zeros(IMAGE_TOKENS, 3, device=device),
        txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device),
        return_dict=False,
    )


def step(model, x) -> tuple[float, torch.Tensor]:
    out = {}

    def run():
        with torch.no_grad():
            out["y"] = model(**x)[0]

    run()  # warm-up (and, for hf_prefetch, the slots' first blocks)
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(run)
    return seconds, out["y"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resident", type=float, nargs="*", default=[0.25, 0.5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-diffusers", action="store_true", help="leave out diffusers' group offloading rows")
    args = parser.parse_args()
    from diffusers.hooks import apply_group_offloading

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    model = build(FLUX_DEV)
    x = inputs(FLUX_DEV)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"Flux-dev shape: {total / 1e9:.2f} GB of bf16 weights; {IMAGE_TOKENS} image + {TEXT_TOKENS} text tokens")
    cpu_copy = copy.deepcopy(model).to("cpu") if not args.no_diffusers else None

    rows: dict[str, list[dict]] = {}
    links = []
    reference = None
    for round_index in range(args.rounds):
        links.append(h2d_peak_gbps())
        seconds, y = step(model, x)
        reference = y if reference is None else reference
        rows.setdefault("all on GPU", []).append(
            dict(seconds=seconds, streamed=0, peak=torch.cuda.max_memory_allocated(), same=torch.equal(y, reference))
        )
        for share in args.resident:
            budget = int(share * total) + 2**30  # the resident share, plus reserve_bytes' default 1 GiB
            name = f"hf_prefetch, {share:.0%} of the weights resident"
            plan = hf_prefetch.plan(model, max_memory={0: budget}, device="cuda")
            hf_prefetch.dispatch_model(model, device="cuda", max_memory={0: budget})
            seconds, y = step(model, x)
            peak = torch.cuda.max_memory_allocated()
            misses = hf_prefetch.stats(model).misses
            hf_prefetch.remove_offload(model)
            rows.setdefault(name, []).append(
                dict(
                    seconds=seconds,
                    streamed=plan.streamed_bytes_per_forward,
                    peak=peak,
                    same=torch.equal(y, reference),
                    misses=misses,
                    resident=plan.resident_bytes / total,
                )
            )
        for offload_type in () if args.no_diffusers else ("block_level", "leaf_level"):
            name = f"diffusers group offloading, {offload_type}, use_stream"
            offloaded = copy.deepcopy(cpu_copy)
            kwargs = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
            apply_group_offloading(
                offloaded,
                onload_device=torch.device("cuda"),
                offload_device=torch.device("cpu"),
                offload_type=offload_type,
                use_stream=True,
                **kwargs,
            )
            torch.cuda.empty_cache()
            seconds, y = step(offloaded, x)
            rows.setdefault(name, []).append(
                dict(
                    seconds=seconds,
                    streamed=total,
                    peak=torch.cuda.max_memory_allocated(),
                    same=torch.equal(y, reference),
                )
            )
            del offloaded
        print(
            f"round {round_index}: " + ", ".join(f"{k}: {v[-1]['seconds']:.4f} s" for k, v in rows.items()), flush=True
        )

    peak_link = max(links)
    resident_s = statistics.median(r["seconds"] for r in rows["all on GPU"])
    print(f"\npinned H2D peak: {peak_link:.1f} GB/s (fastest of {len(links)}: {', '.join(f'{v:.1f}' for v in links)})")
    print(f"one denoising step, 1024x1024, batch 1; medians of {args.rounds} rounds")
    print(
        f"{'system':<52} {'resident':>8} {'streamed GB':>11} {'peak GiB':>9} {'s/step':>8} {'bound':>8} "
        f"{'x bound':>8} {'output':>9}"
    )
    table = {}
    for name, samples in rows.items():
        seconds = statistics.median(r["seconds"] for r in samples)
        streamed = samples[0]["streamed"]
        bound = max(resident_s, streamed / (peak_link * 1e9))
        same = all(r["same"] for r in samples)
        peak = max(r["peak"] for r in samples)
        table[name] = dict(seconds=seconds, bound=bound, streamed=streamed, peak=peak, identical=same)
        resident = samples[0].get("resident", 1.0 if streamed == 0 else 0.0)
        print(
            f"{name:<52} {resident:>8.0%} {streamed / 1e9:>11.2f} {peak / 2**30:>9.2f} {seconds:>8.4f} {bound:>8.4f} "
            f"{seconds / bound:>8.3f} {'identical' if same else 'DIFFER':>9}"
        )
    hidden = resident_s * peak_link * 1e9
    share = min(hidden / total, 1)
    print(
        f"copies fully hidden up to about {hidden / 1e9:.1f} GB streamed per step ({share:.0%} of the weights): the "
        "all-on-GPU step time at link speed"
    )
    save_results("diffusers_step.json", dict(links=links, table=table, resident=resident_s))


if __name__ == "__main__":
    main()
