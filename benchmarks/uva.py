"""UVA zero-copy against prefetch streaming, with the same bytes kept in host memory: decode and prefill.

The prefetch row streams every 2nd layer (2/1/2, the half-streamed row of decode.py); the UVA row keeps the same number
of bytes in pinned host memory (UVA takes parameters in layer order: the first half of the layers) and its kernels read
them over the bus. Systems alternate in one process, several rounds, and the tables give medians and the median of the
paired UVA / prefetch ratios, because the machine's speed drifts. bound = max(all-on-GPU time, host bytes /
measured pinned H2D peak): each host byte crosses the link at least once per forward, copied or read in place.

Run on a GPU machine (8B shape: about 3 minutes on an H100 80GB; --small: under a minute):

    PYTHONUNBUFFERED=1 python benchmarks/uva.py [--rounds 3] [--prefill 2048] [--small]
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
from common import build_model, decode_seconds_per_token, h2d_peak_gbps, prefill_seconds, save_results  # noqa: E402

import hf_prefetch  # noqa: E402
from hf_prefetch.host.arena import HostArena  # noqa: E402

RESIDENT = "all on GPU"
PREFETCH = "hf_prefetch prefetch, every 2nd layer (2/1/2)"
UVA = "hf_prefetch UVA, same bytes (first half)"
HALF = dict(group_size=2, num_in_group=1, prefetch_step=2)


def zero_copy_read_gbps(nbytes: int = 2**30, repeats: int = 5) -> float:
    """How fast a kernel reads pinned host memory in place: a sum over `nbytes` mapped into the GPU (median)."""
    device = torch.device("cuda", torch.cuda.current_device())
    arena = HostArena([nbytes])
    arena.bytes_view(0, nbytes).fill_(1)
    with torch.cuda.device(device):
        arena.pin()
    values = arena.map(device).view(torch.float32)  # [nbytes / 4] float32 read over the bus
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        values.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del values
    arena.release()
    return nbytes / statistics.median(times[1:]) / 1e9


def dispatch(model, system: str, uva_gb: float) -> float:
    """Dispatch `model` as `system`; returns the seconds it took (host copies, page-locking, mapping)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    if system == PREFETCH:
        hf_prefetch.dispatch_model(model, device="cuda", offload=hf_prefetch.PrefetchConfig(**HALF))
    elif system == UVA:
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=uva_gb), device="cuda")
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model, ids, system: str, uva_gb: float, prefill_lengths, short: int, long: int) -> dict:
    dispatch_seconds = dispatch(model, system, uva_gb)
    state = hf_prefetch.get_state(model)
    result = {
        "host_bytes": 0 if state is None else state.plan.offloaded_bytes,
        "gpu": torch.cuda.memory_allocated(),
        "dispatch": dispatch_seconds,
        "decode": decode_seconds_per_token(model, ids, short=short, long=long),
    }
    for length in prefill_lengths:
        result[f"prefill{length}"] = prefill_seconds(model, length)
    with torch.no_grad():
        result["tokens"] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    if state is not None:
        hf_prefetch.remove_offload(model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048])
    parser.add_argument("--small", action="store_true", help="8 layers of the 8B shape, 2 rounds, 512-token prefill")
    args = parser.parse_args()
    # 8 layers: 4 streamed through 2 slots still copy every forward (with 2 streamed, each would keep its slot).
    num_layers, short, long = (8, 4, 12) if args.small else (None, 8, 40)
    rounds, prefill_lengths = (2, [512]) if args.small else (args.rounds, args.prefill)

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  8B shape, {num_layers or 32} layers")
    peak = h2d_peak_gbps()
    read_peak = zero_copy_read_gbps()
    print(
        f"pinned H2D copy peak (1 GiB): {peak:.1f} GB/s; zero-copy read of pinned memory by a kernel: {read_peak:.1f}"
    )
    model = build_model(num_layers)
    prefetch_plan = hf_prefetch.planning.selection.make_plan(model, hf_prefetch.PrefetchConfig(**HALF))
    uva_gb = prefetch_plan.offloaded_bytes / 2**30  # the bytes the half-streamed row keeps on the host
    ids = torch.randint(3, 1000, (1, 16), device="cuda")

    runs: dict[str, list[dict]] = {RESIDENT: [], PREFETCH: [], UVA: []}
    for round_index in range(rounds):
        # Alternate the order too, so that neither offloaded system always runs right after the resident one.
        order = [RESIDENT, PREFETCH, UVA] if round_index % 2 == 0 else [RESIDENT, UVA, PREFETCH]
        for system in order:
            runs[system].append(measure(model, ids, system, uva_gb, prefill_lengths, short, long))
            row = runs[system][-1]
            prefill = ", ".join(f"prefill {n}: {row[f'prefill{n}']:.4f} s" for n in prefill_lengths)
            print(f"round {round_index} {system}: {row['decode']:.4f} s/token, {prefill}", flush=True)
    assert runs[UVA][0]["host_bytes"] == runs[PREFETCH][0]["host_bytes"], "UVA and prefetch keep different bytes"

    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    reference_tokens = runs[RESIDENT][0]["tokens"]
    resident_decode = med(runs[RESIDENT], "decode")
    print(f"\ndecode, batch 1, 16-token prompt; medians of {rounds} rounds")
    print(
        f"{'system':<46} {'host GB':>8} {'GPU GiB':>8} {'dispatch s':>10} {'s/token':>8} {'bound':>7} {'x bound':>8} "
        f"{'tokens':>9}"
    )
    table = []
    for system, rows in runs.items():
        host_bytes = rows[0]["host_bytes"]
        bound = max(resident_decode, host_bytes / (peak * 1e9))
        decode = med(rows, "decode")
        same = all(torch.equal(r["tokens"], reference_tokens) for r in rows)
        print(
            f"{system:<46} {host_bytes / 1e9:>8.2f} {rows[0]['gpu'] / 2**30:>8.2f} {med(rows, 'dispatch'):>10.2f} "
            f"{decode:>8.4f} {bound:>7.4f} {decode / bound:>8.3f} {'identical' if same else 'DIFFER':>9}"
        )
        entry = dict(system=system, host_bytes=host_bytes, gpu=rows[0]["gpu"], s_per_token=decode, bound=bound)
        entry.update(samples=[r["decode"] for r in rows], identical=same)
        for length in prefill_lengths:
            entry[f"prefill{length}"] = med(rows, f"prefill{length}")
        table.append(entry)
    ratios = {"decode": [u["decode"] / p["decode"] for u, p in zip(runs[UVA], runs[PREFETCH], strict=True)]}
    print(f"UVA / prefetch decode, median of {rounds} paired ratios: {statistics.median(ratios['decode']):.3f}")

    for length in prefill_lengths:
        key = f"prefill{length}"
        resident = med(runs[RESIDENT], key)
        print(f"\nprefill {length} tokens, one forward, use_cache=False")
        for system, rows in runs.items():
            t = med(rows, key)
            bound = max(resident, rows[0]["host_bytes"] / (peak * 1e9))
            print(
                f"{system:<46} {t:>8.4f} s  bound {bound:.4f}  x bound {t / bound:.3f}  "
                f"x all-on-GPU {t / resident:.2f}"
            )
        ratios[key] = [u[key] / p[key] for u, p in zip(runs[UVA], runs[PREFETCH], strict=True)]
        print(
            f"UVA / prefetch prefill {length}, median of {rounds} paired ratios: {statistics.median(ratios[key]):.3f}"
        )

    summary = dict(peak_gbps=peak, zero_copy_read_gbps=read_peak, rows=table, paired_ratios=ratios)
    save_results("uva_small.json" if args.small else "uva_8b.json", summary)


if __name__ == "__main__":
    main()
