"""Prefill with half the layers streamed, three ways of timing it, and the slot policy at a forward's start.

A streamed forward ends by copying the next forward's first streamed layers into the slots (the "full ring"). A prefill
timed on its own from a drained device (the device synchronised before and after) then starts with every slot taken:
the copy engine idles until the first streamed layer has computed. This script measures what that costs, and whether
the alternative pays: leaving the last slot free at the end of a forward and starting its copy when the next forward
begins (the "free last slot" row, an experiment patched into the engine here, not a library option).

Timings, each against bound = max(the same timing all on the GPU, streamed bytes per forward / pinned H2D peak):
- single: one forward from a drained device, synchronised after (every copy it started, also those for the next
  forward, inside the timed window);
- loop: 4 forwards back to back, the host reading a logit after each (it waits for the compute stream only), as an
  evaluation loop does;
- first token: one forward with `logits_to_keep=1` from a drained device until the host has the argmax: what a user
  waits for before generate's first token (copies for the next forward may still run).

Systems are measured alternately, several rounds, medians reported. Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/prefill.py [--rounds 3] [--lengths 2048 8192]
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
from common import build_model, decode_seconds_per_token, h2d_peak_gbps, save_results, timed  # noqa: E402

import hf_prefetch  # noqa: E402

HALF = dict(group_size=2, num_in_group=1, prefetch_step=2)
SYSTEMS = ["all on GPU", "hf_prefetch 2/1/2 (full ring)", "hf_prefetch 2/1/2, free last slot (experiment)"]
LOOP = 4


def free_last_slot(model):
    """Experiment: the ring's last layer leaves its slot alone; the next forward starts that copy on entry."""
    engine = hf_prefetch.get_state(model).engine
    ring = engine.rings[0]
    last = len(ring.layers) - 1
    release = engine.release

    def patched_release(index, position):
        if position != last:
            release(index, position)

    engine.release = patched_release
    return model.register_forward_pre_hook(lambda module, args: engine.prefetch(0, ring.layers[last].next_in_slot))


def single(model, ids) -> float:
    return timed(lambda: model(ids, use_cache=False))


def loop(model, ids) -> float:
    def run():
        for _ in range(LOOP):
            model(ids, use_cache=False).logits[0, -1, 0].item()

    return timed(run) / LOOP


def first_token(model, ids) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].argmax().item()
    return time.perf_counter() - start


TIMINGS = {"single": single, "loop": loop, "first token": first_token}


def measure(model, system: str, lengths, repeats: int = 3) -> dict:
    handle = None
    if system != SYSTEMS[0]:
        hf_prefetch.dispatch_model(model, device="cuda", offload=hf_prefetch.PrefetchConfig(**HALF))
        if "free last slot" in system:
            handle = free_last_slot(model)
    result = {}
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(3, 1000, (1, length), device="cuda")
            model(ids, use_cache=False)  # warm-up
            for name, fn in TIMINGS.items():
                result[(length, name)] = statistics.median(fn(model, ids) for _ in range(repeats))
            torch.manual_seed(length)
            check = torch.randint(3, 1000, (1, length), device="cuda")
            result[(length, "logits")] = model(check, use_cache=False, logits_to_keep=1).logits.float().cpu()
    prompt = torch.randint(3, 1000, (1, 16), device="cuda")
    result["decode"] = decode_seconds_per_token(model, prompt)
    if handle is not None:
        handle.remove()
    if system != SYSTEMS[0]:
        result["streamed"] = hf_prefetch.get_state(model).plan.streamed_bytes_per_forward
        result["misses"] = hf_prefetch.stats(model).misses
        hf_prefetch.remove_offload(model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    peak = h2d_peak_gbps()
    print(f"pinned H2D peak: {peak:.1f} GB/s")
    model = build_model()
    runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    for round_index in range(args.rounds):
        for system in SYSTEMS:
            runs[system].append(measure(model, system, args.lengths))
            row = runs[system][-1]
            timings = [(k, v) for k, v in row.items() if isinstance(k, tuple) and k[1] in TIMINGS]
            line = "  ".join(f"{length} {name} {v:.4f}" for (length, name), v in timings)
            print(f"round {round_index} {system}: {line}  decode {row['decode']:.4f}", flush=True)

    med = lambda system, key: statistics.median(r[key] for r in runs[system])  # noqa: E731
    streamed = runs[SYSTEMS[1]][0]["streamed"]
    transfer = streamed / (peak * 1e9)
    table = []
    print(f"\nmedians of {args.rounds} rounds; {streamed / 1e9:.2f} GB streamed per forward: {transfer:.4f} s at peak")
    print(f"{'system':<48} {'length':>6} {'timing':>12} {'seconds':>8} {'bound':>7} {'x bound':>8} {'x all-GPU':>9}")
    for length in args.lengths:
        for name in TIMINGS:
            base = med(SYSTEMS[0], (length, name))
            for system in SYSTEMS:
                value = med(system, (length, name))
                bound = base if system == SYSTEMS[0] else max(base, transfer)
                table.append(dict(system=system, length=length, timing=name, seconds=value, bound=bound))
                print(
                    f"{system:<48} {length:>6} {name:>12} {value:>8.4f} {bound:>7.4f} {value / bound:>8.3f} "
                    f"{value / base:>9.2f}"
                )
    print("\nfree last slot / full ring, median of paired ratios:")
    for key in [(length, name) for length in args.lengths for name in TIMINGS] + ["decode"]:
        ratio = statistics.median(a[key] / b[key] for a, b in zip(runs[SYSTEMS[2]], runs[SYSTEMS[1]], strict=True))
        print(f"  {' '.join(map(str, key)) if isinstance(key, tuple) else key:<24} {ratio:.4f}")
    for system in SYSTEMS[1:]:
        same = all(
            torch.equal(r[(length, "logits")], runs[SYSTEMS[0]][0][(length, "logits")])
            for r in runs[system]
            for length in args.lengths
        )
        misses = [r["misses"] for r in runs[system]]
        print(f"{system}: logits {'identical' if same else 'DIFFER'} to all on GPU, misses per round {misses}")
    print("decode s/token: " + ", ".join(f"{s} {med(s, 'decode'):.4f}" for s in SYSTEMS))
    save_results("prefill.json", {"peak_gbps": peak, "rows": table})


if __name__ == "__main__":
    main()
