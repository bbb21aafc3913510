"""Decode and prefill with prefetch offloading against everything on the GPU, on an 8B-shaped model.

Systems are measured alternately in one process, several rounds, and medians reported, because the lent machine's
speed drifts. Run on a GPU machine:  PYTHONUNBUFFERED=1 python benchmarks/decode.py [--rounds 3] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, decode_seconds_per_token, gib, h2d_peak_gbps, prefill_seconds, timed  # noqa: E402

import hf_prefetch  # noqa: E402

SYSTEMS = {
    "all on GPU": None,
    "hf_prefetch half streamed (2/1/2)": dict(group_size=2, num_in_group=1, prefetch_step=2),
    "hf_prefetch half streamed (2/1/1)": dict(group_size=2, num_in_group=1, prefetch_step=1),
    "hf_prefetch all layers streamed (1/1/2)": dict(group_size=1, num_in_group=1, prefetch_step=2),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048])
    args = parser.parse_args()

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    peak = h2d_peak_gbps()
    print(f"pinned H2D peak (1 GiB): {peak:.1f} GB/s")
    model = build_model(args.layers)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    decode: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    prefill: dict[tuple[str, int], list[float]] = {}
    info: dict[str, dict] = {}
    tokens: dict[str, torch.Tensor] = {}
    for round_index in range(args.rounds):
        for name, fields in SYSTEMS.items():
            if fields is not None:
                hf_prefetch.dispatch_model(model, device="cuda", **fields)
            torch.cuda.synchronize()
            state = hf_prefetch.get_state(model)
            info[name] = {
                "streamed": 0 if state is None else state.plan.streamed_bytes_per_forward,
                "gpu": torch.cuda.memory_allocated(),
            }
            decode[name].append(decode_seconds_per_token(model, ids))
            for length in args.prefill:
                prefill.setdefault((name, length), []).append(prefill_seconds(model, length))
            with torch.no_grad():
                tokens[name] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                              do_sample=False)
            if state is not None:
                info[name]["misses"] = hf_prefetch.stats(model).misses
                hf_prefetch.remove_offload(model)
            print(f"round {round_index} {name}: {decode[name][-1]:.4f} s/token", flush=True)

    resident = statistics.median(decode["all on GPU"])
    rows = []
    print()
    print(f"{'system':<42} {'streamed GB':>11} {'GPU GiB':>8} {'s/token':>8} {'bound':>7} {'x bound':>8} {'tokens':>9}")
    for name in SYSTEMS:
        s_per_token = statistics.median(decode[name])
        bound = max(resident, info[name]["streamed"] / (peak * 1e9))
        same = torch.equal(tokens[name], tokens["all on GPU"])
        rows.append(dict(system=name, streamed=info[name]["streamed"], gpu=info[name]["gpu"], s_per_token=s_per_token,
                         bound=bound, ratio=s_per_token / bound, identical=same, samples=decode[name]))
        print(f"{name:<42} {info[name]['streamed'] / 1e9:>11.2f} {gib(info[name]['gpu']):>8} {s_per_token:>8.4f} "
              f"{bound:>7.4f} {s_per_token / bound:>8.3f} {'identical' if same else 'DIFFER':>9}")
    for length in args.prefill:
        print(f"\nprefill {length} tokens")
        base = statistics.median(prefill[("all on GPU", length)])
        for name in SYSTEMS:
            t = statistics.median(prefill[(name, length)])
            bound = max(base, info[name]["streamed"] / (peak * 1e9))
            print(f"{name:<42} {t:>8.4f} s  bound {bound:.4f}  x bound {t / bound:.3f}  x all-on-GPU {t / base:.2f}")
    print("\nwhere the time goes (timing=True, 32 decode steps)")
    for name, fields in SYSTEMS.items():
        if fields is None:
            continue
        hf_prefetch.dispatch_model(model, device="cuda", timing=True, **fields)
        decode_seconds_per_token(model, ids, short=1, long=2)
        hf_prefetch.reset_stats(model)
        with torch.no_grad():
            per_token = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                                     min_new_tokens=32, do_sample=False)) / 32
        s = hf_prefetch.stats(model)
        print(f"{name:<42} {per_token:.4f} s/token  copy {s.copy_seconds / 32:.4f} s/token at {s.gbps:.1f} GB/s  "
              f"stall {s.stall_seconds / 32:.4f} s/token  misses {s.misses}")
        hf_prefetch.remove_offload(model)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode.json"), "w") as f:
            json.dump({"peak_gbps": peak, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
