"""What a dispatch costs when nothing streams: the 8B shape all on the GPU, plain and dispatched with a budget it fits.

At `max_memory={0: "16GiB"}` the planner streams no layer, so the dispatched model runs no copy; what remains is the
model's forward pre-hook and `hf_device_map`. Alternates plain and dispatched decode (the model is dispatched and
removed for each sample), several pairs, and prints the median of the paired ratios. Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/dispatch_overhead.py [--pairs 6] [--budget 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, decode_seconds_per_token  # noqa: E402

import hf_prefetch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--budget", type=int, default=16)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    model = build_model()
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    decode_seconds_per_token(model, ids)  # warm-up
    ratios = []
    for pair in range(args.pairs):
        plain = decode_seconds_per_token(model, ids)
        hf_prefetch.dispatch_model(model, device="cuda", max_memory={0: f"{args.budget}GiB"})
        streamed = len(hf_prefetch.get_state(model).plan.rings[0].streamed)
        dispatched = decode_seconds_per_token(model, ids)
        hf_prefetch.remove_offload(model)
        ratios.append(dispatched / plain)
        print(
            f"pair {pair}: plain {plain:.4f} s/token, dispatched ({streamed} layers streamed) {dispatched:.4f}: "
            f"{dispatched / plain:.3f}",
            flush=True,
        )
    print(f"median of {args.pairs} paired ratios dispatched / plain: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
