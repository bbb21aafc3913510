"""The compressed-weight decoder on the GPU alone: GB/s of decoded output, against a device-to-device copy of the same
output (what the memory allows for moving those bytes once).

8B-shaped tensors (q_proj 4096x4096, k_proj 1024x4096, gate_proj 14336x4096, down_proj 4096x14336) in random bf16
(normal(0, 0.02)) and fp32; each decoded into a preallocated output, median of 20 after warm-up, timed with CUDA
events. Run on a GPU machine:

    PYTHONUNBUFFERED=1 python benchmarks/decoder.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_seconds  # noqa: E402

from hf_prefetch.formats import lossless as codec  # noqa: E402

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336)}


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| tensor | dtype | values MB | encoded/values | decode ms | decode GB/s of output | d2d copy GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for name, shape in SHAPES.items():
            weights = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
            layout = codec.layout_of(dtype, weights.numel())
            encoded = codec.encode(weights, layout).cuda()
            out = torch.empty(shape, dtype=dtype, device="cuda")
            seconds = device_seconds(lambda e=encoded, lay=layout, o=out: codec.decode(e, lay, o))
            assert torch.equal(out.cpu(), weights)
            source = weights.cuda()
            copy = device_seconds(lambda o=out, s=source: o.copy_(s))
            nbytes = weights.numel() * weights.element_size()
            print(
                f"| {name} | {str(dtype).removeprefix('torch.')} | {nbytes / 1e6:.1f} | "
                f"{layout.nbytes / nbytes:.4f} | {seconds * 1e3:.3f} | {nbytes / seconds / 1e9:.0f} | "
                f"{nbytes / copy / 1e9:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
