"""Compressed streaming (PrefetchConfig(compress=True)) against streaming the same layers uncompressed.

8B shape, random bf16 weights (transformers' normal(0, 0.02) initialisation), half and all layers streamed. Systems
are measured alternately in one process, several rounds, medians reported (the machine's speed drifts); the
speed-up is the median over rounds of each round's ratio. bound = max(all-on-GPU s/token, bytes per token / pinned
H2D peak), with each system's own bytes (encoded ones where compressed). Also: decode of 2048-token prefills, the
host's encoding rate, the compression ratio, and from `timing=True` stats the decoder's throughput and its share of
a token's time. Tokens and logits of every system are compared with the all-on-GPU model's. Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/compressed.py [--rounds 3] [--layers 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    build_model,
    clone_to_cpu,
    decode_seconds_per_token,
    h2d_peak_gbps,
    prefill_seconds,
    save_results,
)

import hf_prefetch  # noqa: E402

SELECTIONS = {"half (2/1/2)": dict(group_size=2, num_in_group=1), "all (1/1/2)": dict(group_size=1, num_in_group=1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2048)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  cpus {os.cpu_count()}", flush=True)
    torch.manual_seed(0)
    resident = build_model(num_layers=args.layers)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    prompt = torch.randint(3, 1000, (1, 64), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        reference_logits = resident(prompt).logits
        reference_tokens = resident.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    systems = {}
    for selection, fields in SELECTIONS.items():
        for compress in (False, True):
            name = f"{selection}{', compressed' if compress else ''}"
            start = time.perf_counter()
            model = hf_prefetch.dispatch_model(
                clone_to_cpu(resident),
                hf_prefetch.PrefetchConfig(prefetch_step=2, compress=compress, **fields),
                device="cuda",
            )
            seconds = time.perf_counter() - start
            plan = hf_prefetch.get_state(model).plan
            values, encoded = plan.compressed_bytes
            if compress:
                print(
                    f"dispatch {name}: {seconds:.1f} s; compressed {values / 1e9:.2f} GB of values into "
                    f"{encoded / 1e9:.2f} GB (ratio {encoded / values:.4f}); encoding {values / 1e9 / seconds:.2f} "
                    "GB/s of values (whole dispatch)",
                    flush=True,
                )
            with torch.no_grad():
                same_logits = torch.equal(model(prompt).logits, reference_logits)
                tokens = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
            print(f"{name}: logits equal {same_logits}, tokens equal {torch.equal(tokens, reference_tokens)}")
            systems[name] = (model, plan.streamed_bytes_per_token)
    names = [RESIDENT, *systems]
    runs = {name: [] for name in names}
    prefills = {name: [] for name in systems}
    peaks = []
    for r in range(args.rounds):
        peaks.append(h2d_peak_gbps())
        print(f"round {r} pinned H2D peak {peaks[-1]:.1f} GB/s", flush=True)
        for name in names:
            model = resident if name == RESIDENT else systems[name][0]
            runs[name].append(decode_seconds_per_token(model, ids))
            line = f"round {r} {name}: {runs[name][-1]:.4f} s/token"
            if name != RESIDENT:
                prefills[name].append(prefill_seconds(model, args.prefill, repeats=2))
                line += f", prefill {args.prefill}: {prefills[name][-1]:.3f} s"
            print(line, flush=True)
    peak = statistics.median(peaks)
    resident_s = statistics.median(runs[RESIDENT])
    print(f"\npinned H2D peak (median) {peak:.1f} GB/s; all on GPU {resident_s:.4f} s/token\n")
    print(
        "| system | bytes/token GB | s/token | bound s | ratio to bound | speed-up vs uncompressed | "
        f"prefill {args.prefill} s | prefill vs uncompressed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name, (_, nbytes) in systems.items():
        seconds = statistics.median(runs[name])
        bound = max(resident_s, nbytes / (peak * 1e9))
        plain = name.replace(", compressed", "")
        speedup = prefill_ratio = None
        if plain != name:
            speedup = statistics.median(p / c for p, c in zip(runs[plain], runs[name], strict=True))
            prefill_ratio = statistics.median(c / p for p, c in zip(prefills[plain], prefills[name], strict=True))
        prefill = statistics.median(prefills[name])
        rows[name] = dict(
            bytes=nbytes, seconds=seconds, bound=bound, speedup=speedup, prefill=prefill, prefill_ratio=prefill_ratio
        )
        print(
            f"| {name} | {nbytes / 1e9:.2f} | {seconds:.4f} | {bound:.4f} | {seconds / bound:.3f} | "
            f"{'' if speedup is None else f'{speedup:.3f}x'} | {prefill:.3f} | "
            f"{'' if prefill_ratio is None else f'{prefill_ratio:.3f}'} |"
        )
    # The decoder's own time, from timing stats of a compressed model (added device time on the compute stream).
    for selection in SELECTIONS:
        name = f"{selection}, compressed"
        model = systems[name][0]
        state = hf_prefetch.get_state(model)
        hf_prefetch.remove_offload(model, device="cpu")
        model = hf_prefetch.dispatch_model(model, state.plan.config, device="cuda", timing=True)
        decode_seconds_per_token(model, ids)
        hf_prefetch.reset_stats(model)
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        stats = hf_prefetch.stats(model)
        layers = hf_prefetch.get_state(model).engine.rings[0].layers
        decoded = sum(layer.counters.decoded_bytes for layer in layers)
        decode_s = sum(layer.counters.decode_seconds for layer in layers)
        copy_s = sum(layer.counters.copy_seconds for layer in layers)
        copied = sum(layer.counters.copied_bytes for layer in layers)
        print(
            f"\n{name}, timing on, 16 tokens in {seconds:.3f} s: decoded {decoded / 1e9:.2f} GB in {decode_s:.3f} s "
            f"({decoded / 1e9 / max(decode_s, 1e-9):.0f} GB/s of output, {decode_s / seconds:.1%} of the time); "
            f"copies {copied / 1e9:.2f} GB in {copy_s:.3f} s ({copied / 1e9 / max(copy_s, 1e-9):.1f} GB/s, link busy "
            f"{copy_s / seconds:.1%} of the time)"
        )
        print(stats)
        rows[name]["decoder_gbps"] = decoded / 1e9 / max(decode_s, 1e-9)
        rows[name]["decode_share"] = decode_s / seconds
        rows[name]["link_busy"] = copy_s / seconds
    save_results("compressed.json", dict(peak=peak, resident=resident_s, rows=rows))


RESIDENT = "all on GPU"

if __name__ == "__main__":
    main()
