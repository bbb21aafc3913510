"""MXFP4 experts streamed packed against the same experts streamed in bf16, gpt-oss-20b shape. GPU only.

A random gpt-oss-20b-shaped checkpoint (24 layers, 32 experts, 4 per token, hidden 2880: about 13 GB) is written with
its experts as MXFP4 blocks and scales, as the gpt-oss releases store them, and loaded with
`hf_prefetch.from_pretrained`: the packed bytes stream and the experts dequantize on the GPU inside their forward. The
same model with its experts dequantized to bf16 by transformers' own function (`convert_moe_packed_tensors`, what its
load without the hub kernels does: 3.8x the bytes) is built in host memory and dispatched with `dispatch_model`. Both
stream every layer's experts (attention and embeddings resident), routed: a decode forward copies only the rows of
the experts its token picks. They decode alternately; each row's bound is its bytes per decode token (the engine's
counters: a prefill, then one decode step counted alone) over the pinned H2D peak, measured beside each run, or the
same system's decode all on the GPU where that is slower (measured in each pair): for MXFP4 the packed model
dequantizing its picked experts in every forward, for bf16 the dequantized one. The two
must decode the same tokens (the same weights, bit for bit). About 3 minutes on an H200 at 12 layers (host memory:
about 90 GB at 24 layers, and the all-on-GPU model passes through host memory too: use `--layers 12` on a 128 GB
host; at least 3: in two slots a model of two layers copies its experts only once).

    python benchmarks/mxfp4.py [--layers 24] [--pairs 2] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import h2d_peak_gbps, save_results, timed  # noqa: E402

import hf_prefetch  # noqa: E402

GPT_OSS_20B = dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, max_position_embeddings=4096)
PROJECTIONS = ("gate_up_proj", "down_proj")
SYSTEMS = {"mxfp4": "hf_prefetch MXFP4 (packed)", "bf16": "hf_prefetch bf16 (dequantized)"}


def write_checkpoint(folder: Path, config: GptOssConfig, device: str = "cuda") -> None:
    """Random weights, one shard per layer: experts as MXFP4 (random nibbles, scales 2**-9 to 2**-6), the rest bf16."""
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in GptOssForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in shapes.items():
        shard = f"layer-{name.split('.')[2]}.safetensors" if name.startswith("model.layers.") else "rest.safetensors"
        tensors = shards.setdefault(shard, {})
        if name.endswith(PROJECTIONS):
            experts, columns, rows = shape  # transformers' layout; stored with rows first
            blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator, device=device)
            scales = torch.randint(118, 122, (experts, rows, columns // 32), generator=generator, device=device)
            tensors[f"{name}_blocks"] = blocks.to(torch.uint8).cpu()
            tensors[f"{name}_scales"] = scales.to(torch.uint8).cpu()
        elif name.endswith(("norm.weight", "sinks")) or ".bias" in name or name.endswith("_bias"):
            tensors[name] = (torch.ones if "norm" in name else torch.zeros)(shape, dtype=torch.bfloat16)
        else:
            values = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
            tensors[name] = values.cpu()
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    (folder / "config.json").write_text(json.dumps(saved))


def dequantized_model(folder: Path, config: GptOssConfig, device: str = "cuda") -> GptOssForCausalLM:
    """The checkpoint's model in host memory with its experts dequantized (on the GPU, by transformers' function)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = GptOssForCausalLM(config)
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as opened:
            for key in opened.keys():
                if key.endswith("_scales"):
                    continue
                if key.endswith("_blocks"):
                    name = key.removesuffix("_blocks")
                    blocks = opened.get_tensor(key).to(device)
                    scales = opened.get_tensor(f"{name}_scales").to(device)
                    state[name] = convert_moe_packed_tensors(blocks, scales).cpu()
                else:
                    state[key] = opened.get_tensor(key)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def packed_model(folder: Path, config: GptOssConfig, device: str = "cuda") -> GptOssForCausalLM:
    """The checkpoint's model all on `device`, its experts packed and dequantized in every forward (what the streamed
    MXFP4 model computes: `formats.mxfp4.prepare`)."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    from hf_prefetch.formats import mxfp4
    from hf_prefetch.loading.checkpoint import Checkpoint

    with init_empty_weights(include_buffers=False):
        model = GptOssForCausalLM(config)
    with Checkpoint.open(folder) as checkpoint:
        mxfp4.prepare(model, checkpoint)
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard, device=device))
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def generate(model, ids, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )


def decode(model, ids, short: int = 4, long: int = 20) -> tuple[float, torch.Tensor]:
    t_short = timed(lambda: generate(model, ids, short))
    out = {}
    t_long = timed(lambda: out.setdefault("tokens", generate(model, ids, long)))
    return (t_long - t_short) / (long - short), out["tokens"]


def bytes_per_token(model, ids) -> int:
    # A prefill of the prompt, then one decode step counted alone.
    with torch.no_grad():
        out = model(ids, use_cache=True)
        hf_prefetch.reset_stats(model)
        model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return hf_prefetch.stats(model).copied_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=GPT_OSS_20B["num_hidden_layers"])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=None, help="where the checkpoint is written (a temporary one)")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    config = GptOssConfig(**{**GPT_OSS_20B, "num_hidden_layers": args.layers}, dtype="bfloat16")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="mxfp4-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    links = [h2d_peak_gbps()]
    try:
        begin = time.perf_counter()
        write_checkpoint(folder, config)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"wrote {args.layers} layers, {size / 1e9:.1f} GB, in {time.perf_counter() - begin:.1f} s", flush=True)
        # Every layer's experts stream, routed; attention and embeddings stay resident.
        offload = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=2, offload_params={"experts"}, expert_cache=0)
        begin = time.perf_counter()
        models = {"mxfp4": hf_prefetch.from_pretrained(folder, offload, device="cuda")}
        print(f"from_pretrained (MXFP4) in {time.perf_counter() - begin:.1f} s", flush=True)
        begin = time.perf_counter()
        models["bf16"] = hf_prefetch.dispatch_model(dequantized_model(folder, config), offload, device="cuda")
        print(f"bf16 model built and dispatched in {time.perf_counter() - begin:.1f} s", flush=True)
        # All on the GPU: each system's compute time, its bound where the link is faster.
        resident = {"mxfp4": packed_model(folder, config), "bf16": dequantized_model(folder, config).to("cuda")}
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    plans = {name: hf_prefetch.get_state(model).plan for name, model in models.items()}
    print(plans["mxfp4"], flush=True)

    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    rows: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for model in [*models.values(), *resident.values()]:  # the first generate's one-time costs outside every pair
        generate(model, ids, 2)
    resident_seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    resident_tokens = {}
    for pair in range(args.pairs):
        for name in SYSTEMS if pair % 2 == 0 else reversed(SYSTEMS):
            links.append(h2d_peak_gbps())
            seconds, tokens = decode(models[name], ids)
            rows[name].append(dict(seconds=seconds, tokens=tokens))
            print(f"pair {pair} {name}: {seconds:.4f} s/token", flush=True)
        for name in SYSTEMS if pair % 2 == 0 else reversed(SYSTEMS):
            seconds, resident_tokens[name] = decode(resident[name], ids)
            resident_seconds[name].append(seconds)
            print(f"pair {pair} {name}, all on the GPU: {seconds:.4f} s/token", flush=True)
    compute = {name: statistics.median(values) for name, values in resident_seconds.items()}
    per_token = {name: bytes_per_token(model, ids) for name, model in models.items()}
    same = all(torch.equal(a["tokens"], b["tokens"]) for a in rows["mxfp4"] for b in rows["bf16"])
    same = same and all(torch.equal(t, rows["mxfp4"][0]["tokens"]) for t in resident_tokens.values())

    peak = max(links)
    print(f"\npinned H2D peak: {peak:.1f} GB/s (fastest of {len(links)}: {', '.join(f'{x:.1f}' for x in links)})")
    print(f"decode, batch 1, gpt-oss-20b shape ({args.layers} layers), experts streamed and routed")
    print("bound = max(the same system all on the GPU, bytes per token / peak)")
    columns = f"{'GB/token':>9} {'plan GB/token':>14} {'on GPU':>8} {'s/token':>8} {'bound':>8} {'x bound':>8}"
    header = f"{'system':<32} {columns}"
    print(header)
    table = {}
    for name, label in SYSTEMS.items():
        seconds = statistics.median(r["seconds"] for r in rows[name])
        bound = max(compute[name], per_token[name] / (peak * 1e9))
        planned = plans[name].streamed_bytes_per_token
        table[name] = dict(seconds=seconds, bound=bound, bytes_per_token=per_token[name], plan_bytes_per_token=planned)
        print(
            f"{label:<32} {per_token[name] / 1e9:>9.3f} {planned / 1e9:>14.3f} {compute[name]:>8.4f} {seconds:>8.4f} "
            f"{bound:>8.4f} "
            f"{seconds / bound:>8.3f}"
        )
    ratios = [b["seconds"] / m["seconds"] for m, b in zip(rows["mxfp4"], rows["bf16"], strict=True)]
    print(
        f"bf16 bytes / MXFP4 bytes per token: {per_token['bf16'] / per_token['mxfp4']:.2f}x; MXFP4 speed-up "
        f"(median of paired ratios): {statistics.median(ratios):.2f}x; tokens {'identical' if same else 'DIFFER'}"
    )
    save_results(
        "mxfp4.json", dict(peak=peak, links=links, resident=compute, table=table, ratios=ratios, identical=same)
    )


if __name__ == "__main__":
    main()
