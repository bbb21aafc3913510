"""Decode under a GPU memory budget: `dispatch_model(max_memory={0: "<b>GiB"})` on the Llama-3.1-8B shape.

For each budget the model starts on the GPU, is dispatched with `max_memory`, and a greedy decode measures the peak of
`torch.cuda.max_memory_allocated` (it must stay within the budget) and s/token (40 minus 8 new tokens). The all-on-GPU
decode is measured right before each budget row (the machine's speed drifts); bound = max(that all-on-GPU s/token,
streamed bytes / measured pinned H2D peak). The plan's own transfer time per forward (`hf_prefetch.plan`, link speed
measured by the plan itself) is compared with the measured s/token. Run on a GPU machine (about 2 minutes on an H100):

    PYTHONUNBUFFERED=1 python benchmarks/budget.py [--budgets 9 12 16] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, h2d_peak_gbps, save_results, timed  # noqa: E402

import hf_prefetch  # noqa: E402

SHORT, LONG = 8, 40  # new tokens of the two generates whose difference gives s/token
PROMPT_TOKENS = 16
GiB = 2**30


def decode(model, ids) -> tuple[float, torch.Tensor]:
    """Seconds per token (generate LONG and SHORT new tokens greedily, divide the difference) and the LONG tokens."""
    mask = torch.ones_like(ids)
    out = {}

    def run(n):
        def generate():
            out[n] = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        return generate

    with torch.no_grad():
        t_short = timed(run(SHORT))
        t_long = timed(run(LONG))
    return (t_long - t_short) / (LONG - SHORT), out[LONG]


def measure_budget(model, ids, budget_gib: int) -> dict:
    max_memory = {0: f"{budget_gib}GiB"}
    preview = hf_prefetch.plan(model, max_memory=max_memory, device="cuda")  # measures the link itself
    hf_prefetch.dispatch_model(model, device="cuda", max_memory=max_memory)
    try:
        plan = hf_prefetch.get_state(model).plan
        assert plan.rings == preview.rings, "hf_prefetch.plan differs from the plan dispatch_model executed"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the streamed weights' old storage: let the reserved peak mean this dispatch
        torch.cuda.reset_peak_memory_stats()
        seconds, tokens = decode(model, ids)
        result = {
            "budget_gib": budget_gib,
            "streamed_layers": sum(len(ring.streamed) for ring in plan.rings),
            "num_layers": sum(len(ring.layers) for ring in plan.rings),
            "longest_run": plan.longest_run,
            "streamed": plan.streamed_bytes_per_forward,
            "device_bytes": plan.device_bytes,
            "peak": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "decode": seconds,
            "plan_link_gbps": preview.link_gbps,
            "plan_seconds": preview.transfer_seconds_per_forward,
            "misses": hf_prefetch.stats(model).misses,
            "tokens": tokens,
        }
    finally:
        hf_prefetch.remove_offload(model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", type=int, nargs="*", default=[9, 12, 16], help="GPU budgets in GiB")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  shape 8b")
    peak_gbps = h2d_peak_gbps()
    print(f"pinned H2D peak: {peak_gbps:.1f} GB/s")
    model = build_model()
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    decode(model, ids)  # warm-up: kernels, cuBLAS workspaces, generation config

    rows: dict[int, list[dict]] = {}
    resident: dict[int, list[float]] = {}
    reference = None
    for round_index in range(args.rounds):
        for budget in args.budgets:
            seconds, tokens = decode(model, ids)  # all on the GPU, right before the budget row
            resident.setdefault(budget, []).append(seconds)
            reference = tokens if reference is None else reference
            rows.setdefault(budget, []).append(measure_budget(model, ids, budget))
            row = rows[budget][-1]
            print(
                f"round {round_index} all on GPU {seconds:.4f} s/token; {budget} GiB: {row['decode']:.4f} s/token, "
                f"{row['streamed_layers']} layers streamed, peak {row['peak'] / GiB:.2f} GiB",
                flush=True,
            )

    print(f"\ndecode, batch 1, {PROMPT_TOKENS}-token prompt, 8b shape bf16; medians of {args.rounds} round(s)")
    header = (
        f"{'budget':>8} {'streamed':>9} {'run':>4} {'streamed GB':>11} {'peak GiB':>8} {'reserved':>8} "
        f"{'s/token':>8} {'bound':>7} {'x bound':>7} {'plan s':>7} {'meas/plan':>9} {'tokens':>9}"
    )
    print(header)
    table, failed = [], False
    for budget, results in rows.items():
        first = results[0]
        s_per_token = statistics.median(r["decode"] for r in results)
        on_gpu = statistics.median(resident[budget])
        bound = max(on_gpu, first["streamed"] / (peak_gbps * 1e9))
        plan_seconds = first["plan_seconds"]
        ratio = f"{s_per_token / plan_seconds:>9.3f}" if plan_seconds else f"{'-':>9}"
        peak = max(r["peak"] for r in results)
        within = peak <= budget * GiB
        same = all(torch.equal(r["tokens"], reference) for r in results)
        failed |= not within or not same or any(r["misses"] for r in results)
        print(
            f"{budget:>4} GiB {first['streamed_layers']:>4} / {first['num_layers']:<2} {first['longest_run']:>4} "
            f"{first['streamed'] / 1e9:>11.2f} {peak / GiB:>8.2f} {first['reserved'] / GiB:>8.2f} "
            f"{s_per_token:>8.4f} {bound:>7.4f} {s_per_token / bound:>7.3f} {plan_seconds:>7.4f} {ratio} "
            f"{'identical' if same else 'DIFFER':>9}" + ("" if within else "  OVER BUDGET")
        )
        table.append(
            {
                **{k: v for k, v in first.items() if k != "tokens"},
                "s_per_token": s_per_token,
                "all_on_gpu": on_gpu,
                "bound": bound,
                "peak": peak,
                "within_budget": within,
                "identical": same,
                "samples": [r["decode"] for r in results],
            }
        )
    links = ", ".join(f"{r['plan_link_gbps']:.1f}" for results in rows.values() for r in results)
    print(f"\nlink speed measured by hf_prefetch.plan: {links} GB/s (benchmark's link peak: {peak_gbps:.1f} GB/s)")
    print("run: longest run of consecutive streamed layers; plan s: plan.transfer_seconds_per_forward")
    save_results("budget_8b.json", {"peak_gbps": peak_gbps, "rows": table})
    if failed:
        sys.exit("a budget row went over its budget, changed the tokens or missed")


if __name__ == "__main__":
    main()
