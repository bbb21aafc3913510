"""Host-to-device bandwidth from different kinds of page-locked host memory, per copy size.

Answers: does memory page-locked with cudaHostRegister (exact size) copy as fast as PyTorch's pinned allocator
(cudaHostAlloc, power-of-two rounded)? Does asking for transparent huge pages help? Does one copy per layer beat
one copy per parameter? Run on a GPU machine:  python benchmarks/link.py
"""

from __future__ import annotations

import mmap
import statistics

import torch

LAYER_PARAMS_MB = [117.4, 117.4, 117.4, 33.6, 33.6, 8.4, 8.4, 0.008, 0.008]  # one Llama-3.1-8B layer, bf16


def registered(nbytes: int, huge: bool) -> torch.Tensor:
    if huge:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        tensor = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
    tensor.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    assert int(err) == 0, err
    return tensor


def time_copies(dst: torch.Tensor, src: torch.Tensor, sizes: list[int], repeats: int = 10) -> float:
    """Median seconds to copy consecutive pieces of the given sizes (one cudaMemcpyAsync each)."""
    stream = torch.cuda.Stream()
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            offset = 0
            for size in sizes:
                dst[offset : offset + size].copy_(src[offset : offset + size], non_blocking=True)
                offset += size
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:])


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    layer = [int(mb * 1e6) // 4096 * 4096 or 8192 for mb in LAYER_PARAMS_MB]
    nbytes = 2**30
    sources = {
        "torch pinned (cudaHostAlloc)": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "torch.empty + cudaHostRegister": registered(nbytes, huge=False),
        "mmap + MADV_HUGEPAGE + cudaHostRegister": registered(nbytes, huge=True),
    }
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    cases = {
        "1 GiB, one copy": [nbytes],
        "436 MB layer, one copy": [sum(layer)],
        "436 MB layer, 9 copies (per parameter)": layer,
        "8 MiB pieces x 64": [8 * 2**20] * 64,
    }
    print(f"{'source':<42} " + " ".join(f"{name:>40}" for name in cases))
    for source_name, src in sources.items():
        cells = []
        for sizes in cases.values():
            seconds = time_copies(dst, src, sizes)
            cells.append(f"{sum(sizes) / seconds / 1e9:>37.1f} GB/s")
        print(f"{source_name:<42} " + " ".join(cells))


if __name__ == "__main__":
    main()
