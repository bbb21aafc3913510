"""Streaming quantized models (their packed tensors) against streaming the same layers in bf16.

8B shape, random bf16 weights quantized on the GPU by torchao's `quantize_` (float8 weight-only, int8 weight-only, int4
weight-only with tile packing) or by bitsandbytes (nf4 with double quantization and bf16 compute: every decoder linear
replaced by `Linear4bit`, as transformers' `BitsAndBytesConfig(load_in_4bit=True)` does; `llm_int8`: by
`Linear8bitLt`, as `load_in_8bit=True` does), then moved to the CPU and
dispatched with half and all of the layers streamed. Every system is measured alternately in one process, several
rounds, medians reported (the machine's speed drifts). bound = max(all-on-GPU s/token of the same quantized model,
packed bytes per token / pinned H2D peak); the speed-up over bf16 is the median over rounds of each round's ratio.
Tokens and logits of every streamed system are compared with the same model resident on the GPU. A method that torchao
or the library refuses is reported with its error and skipped. `--accelerate` adds accelerate's offload of the same
quantized model (`accelerate.dispatch_model` with the same layers on "cpu") as a peer row. `--shape 32b --budget-gib
12` instead dispatches one quantized 32B-shaped model with `max_memory={0: "12GiB"}` and reports it against its bound.
`--prefetch-steps 2 3` dispatches each quantized selection once per number of slots (bf16 keeps 2). `fp8` is
transformers' fine-grained FP8 (`FP8Linear`, 128x128 blocks), whose matmul is the hub kernel
`kernels-community/finegrained-fp8`: `--fp8-kernel PATH` loads a local copy of it where nothing can be downloaded.
`ct_fp8` is compressed-tensors FP8 with a scale per row (`CompressedTensorsFP8Linear`, torch's scaled_mm); `ct_w4a16`
compressed-tensors' packed 4-bit weights, decompressed at every forward (hf_prefetch/formats/compressed_tensors.py).
Needs torchao and bitsandbytes (wheels installed with --no-deps). Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/quantized.py [--rounds 3] [--layers 32] [--methods float8,int8,int4,nf4]
    PYTHONUNBUFFERED=1 python benchmarks/quantized.py --shape 32b --budget-gib 12 --methods nf4
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    build_model,
    decode_seconds_per_token,
    h2d_peak_gbps,
    save_results,
    use_local_fp8_kernel,
)

import hf_prefetch  # noqa: E402

SELECTIONS = {"half": dict(group_size=2, num_in_group=1), "all": dict(group_size=1, num_in_group=1)}


def _quantize(model, method: str) -> None:
    """Quantize `model`'s decoder layers in place on its GPU."""
    if method == "nf4":
        _to_nf4(model)
        return
    if method == "llm_int8":
        _to_llm_int8(model)
        return
    if method == "fp8":
        _to_fp8(model)
        return
    if method == "ct_fp8":
        _to_compressed_tensors_fp8(model)
        return
    if method == "ct_w4a16":
        _to_compressed_tensors_w4a16(model)
        return
    from torchao import quantization

    if method == "float8":
        config = quantization.Float8WeightOnlyConfig()
    elif method == "int8":
        config = quantization.Int8WeightOnlyConfig()
    elif method == "int4":
        config = quantization.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    else:
        known = "float8, int8, int4, nf4, llm_int8, fp8, ct_fp8, ct_w4a16"
        raise ValueError(f"--methods: unknown method {method!r}; known: {known}")
    quantization.quantize_(model, config)


def _replace_linears(model, quantized) -> None:
    # Every linear of the decoder layers replaced by `quantized(linear)`, one at a time so that the bf16 weights leave
    # as the quantized ones come.
    from torch import nn

    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if isinstance(linear, nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child, quantized(linear))
                del linear
    torch.cuda.empty_cache()


def _to_nf4(model) -> None:
    # bitsandbytes Linear4bit layers quantized from the bf16 weights on the GPU (nf4, double quantization, bf16
    # compute), as BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True) builds them.
    import bitsandbytes as bnb

    def quantized(linear):
        packed = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=torch.bfloat16,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        packed.weight = bnb.nn.Params4bit(
            linear.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=packed
        ).to(linear.weight.device)
        if linear.bias is not None:
            packed.bias = linear.bias
        return packed

    _replace_linears(model, quantized)


def _to_llm_int8(model) -> None:
    # bitsandbytes Linear8bitLt layers (LLM.int8(), outlier threshold 6.0) quantized from the bf16 weights on the GPU,
    # as BitsAndBytesConfig(load_in_8bit=True) builds them.
    import bitsandbytes as bnb

    def quantized(linear):
        int8 = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=6.0,
            device="meta",
        )
        # What Int8Params.to(cuda) does to a CPU weight, from the GPU copy: int8 rows and their float32 scales.
        values, scales, _ = bnb.functional.int8_vectorwise_quant(linear.weight.data.to(torch.float16))
        int8.weight = bnb.nn.Int8Params(values, requires_grad=False, has_fp16_weights=False, CB=values, SCB=scales)
        if linear.bias is not None:
            int8.bias = linear.bias
        return int8

    _replace_linears(model, quantized)


def _to_fp8(model) -> None:
    # transformers' fine-grained FP8 (`FP8Linear`: float8_e4m3fn weights, float32 scales per 128x128 block), the
    # weights quantized by the op `from_pretrained(quantization_config=FineGrainedFP8Config())` runs.
    from types import SimpleNamespace

    from torch import nn
    from transformers import FineGrainedFP8Config
    from transformers.integrations import finegrained_fp8

    settings = FineGrainedFP8Config(weight_block_size=(128, 128))
    quantize = finegrained_fp8.Fp8Quantize(SimpleNamespace(quantization_config=settings))

    def quantized(linear):
        with torch.device("meta"):
            fp8 = finegrained_fp8.FP8Linear(
                linear.in_features, linear.out_features, block_size=(128, 128), has_bias=linear.bias is not None
            )
        parts = quantize._quantize_one("weight", linear.weight.data)
        fp8.weight = nn.Parameter(parts["weight"], requires_grad=False)
        fp8.weight_scale_inv = nn.Parameter(parts["weight_scale_inv"], requires_grad=False)
        if linear.bias is not None:
            fp8.bias = linear.bias
        return fp8

    _replace_linears(model, quantized)


def _to_compressed_tensors_fp8(model) -> None:
    # compressed-tensors FP8 (LLM Compressor's FP8-dynamic: float8_e4m3fn weights, a scale per output row) as
    # transformers builds it with CompressedTensorsConfig(use_optimized_inference=True): `CompressedTensorsFP8Linear`,
    # a row-wise scaled FP8 matmul, its bf16 checkpoint scales as float32 (1, out_features).
    from torch import nn
    from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear

    top = torch.finfo(torch.float8_e4m3fn).max

    def quantized(linear):
        with torch.device("meta"):
            fp8 = CompressedTensorsFP8Linear(linear.in_features, linear.out_features, has_bias=linear.bias is not None)
        weight = linear.weight.data.float()
        scale = (weight.abs().amax(dim=1, keepdim=True) / top).to(torch.bfloat16).float()
        fp8.weight = nn.Parameter((weight / scale).clamp(-top, top).to(torch.float8_e4m3fn), requires_grad=False)
        fp8.weight_scale = nn.Parameter(scale.reshape(1, -1).contiguous(), requires_grad=False)
        if linear.bias is not None:
            fp8.bias = linear.bias
        return fp8

    _replace_linears(model, quantized)


def _to_compressed_tensors_w4a16(model) -> None:
    # compressed-tensors W4A16 (`pack-quantized`: 4-bit symmetric weights, a bf16 scale per 128, eight to an int32),
    # quantized and packed by compressed-tensors itself, then made to decompress at every forward as
    # `hf_prefetch.from_pretrained` builds such a checkpoint (formats/compressed_tensors.py): bitwise what
    # transformers' once-decompressed model computes (tests/test_compressed_tensors.py).
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    from hf_prefetch.formats import compressed_tensors as packed_forward

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    scheme = QuantizationScheme(targets=["re:model.layers.*_proj"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            groups = module.weight.detach().float().reshape(module.weight.shape[0], -1, 128)
            scale = groups.abs().amax(-1) / 7.5
            module.weight_scale.data = scale.clamp(min=1e-6).to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    remove_dispatch(model, onload_tensors=True)  # the offloading compress_model put on every module
    packed_forward.install(model)
    torch.cuda.empty_cache()


def _reference(model, ids, prompt):
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    return logits, tokens


def _dispatch(resident, label: str, selection: str, ids, prompt, prefetch_step: int = 2):
    """`resident`, copied to the CPU and dispatched with `selection` streamed through `prefetch_step` slots; its logits
    and tokens compared with the resident model's. (model, streamed bytes per token), or None where the copy or the
    dispatch is refused."""
    name = f"{label}, {selection}" + ("" if prefetch_step == 2 else f", {prefetch_step} slots")
    want_logits, want_tokens = _reference(resident, ids, prompt)
    try:
        start = time.perf_counter()
        host = copy.deepcopy(resident).to("cpu")
        config = hf_prefetch.PrefetchConfig(prefetch_step=prefetch_step, **SELECTIONS[selection])
        model = hf_prefetch.dispatch_model(host, config, device="cuda")
        seconds = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - a benchmark reports what is refused and goes on
        print(f"{name}: not dispatched: {type(error).__name__}: {error}")
        return None
    nbytes = hf_prefetch.get_state(model).plan.streamed_bytes_per_token
    logits, tokens = _reference(model, ids, prompt)
    print(
        f"{name}: dispatch {seconds:.1f} s, {nbytes / 1e9:.2f} GB streamed per token; "
        f"logits equal {torch.equal(logits, want_logits)}, tokens equal {torch.equal(tokens, want_tokens)}",
        flush=True,
    )
    return model, nbytes


def _accelerate(resident, selection: str, ids, prompt):
    """accelerate's offload of the same quantized model: `accelerate.dispatch_model` with the layers `selection`
    streams on "cpu" (its hooks copy them to the GPU at each forward), or None where it refuses."""
    from accelerate import dispatch_model

    layers = len(resident.model.layers)
    step = SELECTIONS[selection]["group_size"]
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    device_map |= {f"model.layers.{i}": "cpu" if i % step == step - 1 else 0 for i in range(layers)}
    want_logits, want_tokens = _reference(resident, ids, prompt)
    try:
        model = dispatch_model(copy.deepcopy(resident).to("cpu"), device_map=device_map, main_device=0)
        logits, tokens = _reference(model, ids, prompt)
    except Exception as error:  # noqa: BLE001 - a benchmark reports what is refused and goes on
        print(f"accelerate, {selection}: refused: {type(error).__name__}: {error}", flush=True)
        return None
    print(
        f"accelerate, {selection}: logits equal {torch.equal(logits, want_logits)}, tokens equal "
        f"{torch.equal(tokens, want_tokens)}",
        flush=True,
    )
    return model


def _one_budget(args, ids, prompt) -> None:
    # One quantized model of `--shape` at `--budget-gib`: s/token against its bound.
    dense = build_model(shape=args.shape)
    method = args.methods.split(",")[0]
    _quantize(dense, method)
    resident = dense
    gc.collect()
    torch.cuda.empty_cache()
    want_logits, want_tokens = _reference(resident, ids, prompt)
    host = copy.deepcopy(resident).to("cpu")
    model = hf_prefetch.dispatch_model(host, max_memory={0: f"{args.budget_gib}GiB"}, device="cuda")
    state = hf_prefetch.get_state(model)
    print(state.plan, flush=True)
    nbytes = state.plan.streamed_bytes_per_token
    logits, tokens = _reference(model, ids, prompt)
    print(f"logits equal {torch.equal(logits, want_logits)}, tokens equal {torch.equal(tokens, want_tokens)}")
    print(f"peak GPU memory of the streamed model: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (both models)")
    for system in (resident, model):  # first-call costs before the rounds
        decode_seconds_per_token(system, ids, short=1, long=2)
    runs, peaks, residents = [], [], []
    for r in range(args.rounds):
        peaks.append(h2d_peak_gbps())
        residents.append(decode_seconds_per_token(resident, ids))
        runs.append(decode_seconds_per_token(model, ids))
        print(
            f"round {r}: pinned H2D peak {peaks[-1]:.1f} GB/s; all on GPU {residents[-1]:.4f}, "
            f"streamed {runs[-1]:.4f} s/token",
            flush=True,
        )
    peak, resident_s, seconds = (statistics.median(x) for x in (peaks, residents, runs))
    bound = max(resident_s, nbytes / (peak * 1e9))
    print("\n| system | bytes/token GB | all on GPU s/token | s/token | bound s | x bound |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| {args.shape} {method}, max_memory {args.budget_gib} GiB | {nbytes / 1e9:.2f} | {resident_s:.4f} | "
        f"{seconds:.4f} | {bound:.4f} | {seconds / bound:.3f} |",
        flush=True,
    )
    save_results(f"quantized_{args.shape}.json", dict(peak=peak, seconds=seconds, bound=bound, bytes=nbytes))


def _label(name) -> str:
    return name if isinstance(name, str) else f"{name[0]} ({name[1]} slots)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--methods", default="float8,int8,int4,nf4")
    parser.add_argument("--accelerate", action="store_true", help="add accelerate's offload as a peer row")
    parser.add_argument("--shape", default="8b", choices=["8b", "32b"])
    parser.add_argument("--budget-gib", type=float, default=None, help="one model at this GPU budget instead")
    parser.add_argument(
        "--prefetch-steps", type=int, nargs="+", default=[2], help="slots of the quantized dispatches (bf16: 2)"
    )
    parser.add_argument(
        "--fp8-kernel",
        default=None,
        help="a local copy of the hub kernel kernels-community/finegrained-fp8 (method fp8, without network)",
    )
    args = parser.parse_args()
    if args.fp8_kernel:
        use_local_fp8_kernel(args.fp8_kernel)
    import bitsandbytes
    import torchao

    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  torchao {torchao.__version__}  "
        f"bitsandbytes {bitsandbytes.__version__}  cpus {os.cpu_count()}",
        flush=True,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    prompt = torch.randint(3, 1000, (1, 64), device="cuda")
    if args.budget_gib is not None:
        _one_budget(args, ids, prompt)
        return
    dense = build_model(num_layers=args.layers)
    bf16 = {selection: _dispatch(dense, "bf16", selection, ids, prompt) for selection in SELECTIONS}
    rows = {}
    for method in args.methods.split(","):
        # One method at a time, next to the bf16 systems (GPU memory: the quantized resident and its two dispatches).
        try:
            resident = copy.deepcopy(dense)
            _quantize(resident, method)
        except Exception as error:  # noqa: BLE001 - a benchmark reports what the quantizer refuses and goes on
            print(f"{method}: quantization failed on this machine: {type(error).__name__}: {error}")
            continue
        systems = {
            (selection, step): _dispatch(resident, method, selection, ids, prompt, step)
            for selection in SELECTIONS
            for step in args.prefetch_steps
        }
        systems = {key: system for key, system in systems.items() if system is not None}
        timed = {"resident": resident, **{f"bf16 {s}": bf16[s][0] for s in SELECTIONS}}
        timed.update({key: model for key, (model, _) in systems.items()})
        if args.accelerate:
            peers = {f"accelerate {s}": _accelerate(resident, s, ids, prompt) for s in SELECTIONS}
            timed.update({name: model for name, model in peers.items() if model is not None})
        for model in timed.values():  # each system's first-call costs (kernel loading, allocator) before the rounds
            decode_seconds_per_token(model, ids, short=1, long=2)
        runs = {name: [] for name in timed}
        peaks = []
        for r in range(args.rounds):
            peaks.append(h2d_peak_gbps())
            for name, model in timed.items():
                runs[name].append(decode_seconds_per_token(model, ids))
            line = ", ".join(f"{_label(name)} {runs[name][-1]:.4f}" for name in timed)
            print(f"{method} round {r}: pinned H2D peak {peaks[-1]:.1f} GB/s; s/token: {line}", flush=True)
        peak = statistics.median(peaks)
        resident_s = statistics.median(runs["resident"])
        print(f"\n{method}: pinned H2D peak (median) {peak:.1f} GB/s; all on GPU {resident_s:.4f} s/token")
        print("| system | bytes/token GB | s/token | bound s | x bound | speed-up vs bf16 streamed (its s/token) |")
        print("|---|---:|---:|---:|---:|---:|")
        for (selection, step), (_, nbytes) in systems.items():
            seconds = statistics.median(runs[selection, step])
            bound = max(resident_s, nbytes / (peak * 1e9))
            plain = runs[f"bf16 {selection}"]
            speedup = statistics.median(p / q for p, q in zip(plain, runs[selection, step], strict=True))
            rows[f"{method}, {selection}, {step} slots"] = dict(
                bytes=nbytes, seconds=seconds, bound=bound, speedup=speedup
            )
            print(
                f"| {method}, {selection}, {step} slots | {nbytes / 1e9:.2f} | {seconds:.4f} | {bound:.4f} | "
                f"{seconds / bound:.3f} | {speedup:.2f}x ({statistics.median(plain):.4f}) |",
                flush=True,
            )
            peer = runs.get(f"accelerate {selection}")
            if peer and step == args.prefetch_steps[0]:
                ratio = statistics.median(p / q for p, q in zip(peer, runs[selection, step], strict=True))
                print(
                    f"| accelerate, {method}, {selection} | {nbytes / 1e9:.2f} | {statistics.median(peer):.4f} | "
                    f"{bound:.4f} | {statistics.median(peer) / bound:.3f} | hf_prefetch {ratio:.2f}x faster |",
                    flush=True,
                )
        del systems, timed, resident  # a dispatched model's pool and arena go with it
        gc.collect()
        torch.cuda.empty_cache()
    save_results("quantized.json", dict(peak=peak, rows=rows))


if __name__ == "__main__":
    main()
