"""Streaming torchao-quantized models (their packed inner tensors) against streaming the same layers in bf16.

8B shape, random bf16 weights quantized on the GPU by torchao's `quantize_` (float8 weight-only, int8 weight-only,
int4 weight-only with tinygemm packing), then moved to the CPU and dispatched with half and all of the layers
streamed. Every system is measured alternately in one process, several rounds, medians reported (the lent machine's
speed drifts). bound = max(all-on-GPU s/token of the same quantized model, packed bytes per token / pinned H2D peak);
the speed-up over bf16 is the median over rounds of each round's ratio. Tokens and logits of every streamed system are
compared with the same model resident on the GPU. A method that torchao or the library refuses is reported with its
error and skipped. Needs torchao (a wheel installed with --no-deps). Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/quantized.py [--rounds 3] [--layers 32] [--methods float8,int8,int4]
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
from common import build_model, decode_seconds_per_token, h2d_peak_gbps, save_results  # noqa: E402

import hf_prefetch  # noqa: E402

SELECTIONS = {"half": dict(group_size=2, num_in_group=1), "all": dict(group_size=1, num_in_group=1)}


def _config(method: str):
    from torchao import quantization

    if method == "float8":
        return quantization.Float8WeightOnlyConfig()
    if method == "int8":
        return quantization.Int8WeightOnlyConfig()
    if method == "int4":
        return quantization.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    raise ValueError(f"--methods: unknown method {method!r}; known: float8, int8, int4")


def _reference(model, ids, prompt):
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    return logits, tokens


def _dispatch(resident, label: str, selection: str, ids, prompt):
    """`resident`, copied to the CPU and dispatched with `selection` streamed; its logits and tokens compared with
    the resident model's. (model, streamed bytes per token), or None where the copy or the dispatch is refused."""
    name = f"{label}, {selection}"
    want_logits, want_tokens = _reference(resident, ids, prompt)
    try:
        start = time.perf_counter()
        host = copy.deepcopy(resident).to("cpu")
        config = hf_prefetch.PrefetchConfig(prefetch_step=2, **SELECTIONS[selection])
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--methods", default="float8,int8,int4")
    args = parser.parse_args()
    import torchao

    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  torchao {torchao.__version__}  "
        f"cpus {os.cpu_count()}",
        flush=True,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    prompt = torch.randint(3, 1000, (1, 64), device="cuda")
    dense = build_model(num_layers=args.layers)
    bf16 = {selection: _dispatch(dense, "bf16", selection, ids, prompt) for selection in SELECTIONS}
    rows = {}
    for method in args.methods.split(","):
        # One method at a time, next to the bf16 systems (GPU memory: the quantized resident and its two dispatches).
        try:
            from torchao.quantization import quantize_

            resident = copy.deepcopy(dense)
            quantize_(resident, _config(method))
        except Exception as error:  # noqa: BLE001 - a benchmark reports what torchao refuses and goes on
            print(f"{method}: torchao quantization failed on this machine: {type(error).__name__}: {error}")
            continue
        systems = {selection: _dispatch(resident, method, selection, ids, prompt) for selection in SELECTIONS}
        systems = {selection: system for selection, system in systems.items() if system is not None}
        timed = {"resident": resident, **{f"bf16 {s}": bf16[s][0] for s in SELECTIONS}}
        timed.update({s: model for s, (model, _) in systems.items()})
        runs = {name: [] for name in timed}
        peaks = []
        for r in range(args.rounds):
            peaks.append(h2d_peak_gbps())
            for name, model in timed.items():
                runs[name].append(decode_seconds_per_token(model, ids))
            line = ", ".join(f"{name} {runs[name][-1]:.4f}" for name in timed)
            print(f"{method} round {r}: pinned H2D peak {peaks[-1]:.1f} GB/s; s/token: {line}", flush=True)
        peak = statistics.median(peaks)
        resident_s = statistics.median(runs["resident"])
        print(f"\n{method}: pinned H2D peak (median) {peak:.1f} GB/s; all on GPU {resident_s:.4f} s/token")
        print("| system | bytes/token GB | s/token | bound s | x bound | speed-up vs bf16 streamed (its s/token) |")
        print("|---|---:|---:|---:|---:|---:|")
        for selection, (_, nbytes) in systems.items():
            seconds = statistics.median(runs[selection])
            bound = max(resident_s, nbytes / (peak * 1e9))
            plain = runs[f"bf16 {selection}"]
            speedup = statistics.median(p / q for p, q in zip(plain, runs[selection], strict=True))
            rows[f"{method}, {selection}"] = dict(bytes=nbytes, seconds=seconds, bound=bound, speedup=speedup)
            print(
                f"| {method}, {selection} | {nbytes / 1e9:.2f} | {seconds:.4f} | {bound:.4f} | "
                f"{seconds / bound:.3f} | {speedup:.2f}x ({statistics.median(plain):.4f}) |",
                flush=True,
            )
        del systems, timed, resident  # a dispatched model's pool and arena go with it
        gc.collect()
        torch.cuda.empty_cache()
    save_results("quantized.json", dict(peak=peak, rows=rows))


if __name__ == "__main__":
    main()
