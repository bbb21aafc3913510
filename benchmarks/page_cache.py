"""Ways to move a checkpoint that the page cache holds onto the GPU and into pinned host memory. GPU only.

Writes `--files` safetensors files of `--gib` GiB each (bf16, 256 MiB tensors) under `--dir`, reads them once (page
cache warm), then times, alternating the rounds:

- pread from 16 threads into fresh (untouched) host memory: the loader's host path;
- the same into page-locked memory (`torch.empty(pin_memory=True)`), and that allocation's own time;
- the loader's windowed path onto the GPU (`TensorReader` with CUDA destinations: pread into pinned bounce buffers,
  asynchronous copies);
- the files mapped read-only and registered with `cudaHostRegister(cudaHostRegisterReadOnly)`: the registration's
  time, then the copy engine copying straight out of the page cache onto the GPU, and the unregistration;
- page-locking touched anonymous memory (what `HostArena.pin` does), and the GPU-to-pinned copy rate;
- the files mapped private and writable, and page-locked for writing (`cudaHostRegister` with no flags), from one
  thread and from one thread per file: the kernel copies each page out of the page cache as it locks it.

    PYTHONUNBUFFERED=1 python benchmarks/page_cache.py [--dir /tmp/pc] [--files 4] [--gib 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import pread_files  # noqa: E402

from hf_prefetch.loading.checkpoint import Checkpoint  # noqa: E402
from hf_prefetch.loading.reader import TensorReader  # noqa: E402

TENSOR_BYTES = 256 * 2**20
READ_ONLY = 8  # cudaHostRegisterReadOnly
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def write_files(folder: Path, files: int, gib: int) -> list[Path]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = folder / f"shard-{f}.safetensors"
        paths.append(path)
        if path.is_file():
            continue
        tensors = {
            f"t{f}_{i}": torch.full((TENSOR_BYTES // 2,), float(f * 100 + i), dtype=torch.bfloat16)
            for i in range(gib * 2**30 // TENSOR_BYTES)
        }
        save_file(tensors, str(path))
    return paths


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/pc")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.init()
    cudart = torch.cuda.cudart()
    paths = write_files(Path(args.dir), args.files, args.gib)
    warm(paths)
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  {len(paths)} files, {total / 1e9:.2f} GB")
    ro = torch.cuda.get_device_properties(device)
    print(f"cpu count {os.cpu_count()}  device {ro.name}")
    pool = ThreadPoolExecutor(16)
    gpu = torch.empty(total, dtype=torch.uint8, device=device)
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float, nbytes: int = total) -> None:
        results.setdefault(name, []).append(nbytes / seconds / 1e9)
        print(f"  {name:<52} {seconds:7.3f} s  {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)

    for rnd in range(args.rounds):
        print(f"round {rnd + 1}")
        # 1. pread into fresh host memory (first touch inside the reads)
        bufs = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        t = time.perf_counter()
        pread_files(paths, bufs, pool)
        record("pread -> fresh host memory", time.perf_counter() - t)
        # page-locking the touched buffers (HostArena.pin)
        t = time.perf_counter()
        for b in bufs:
            assert int(cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)) == 0
        record("cudaHostRegister of touched anonymous memory", time.perf_counter() - t)
        # 2. pread into them again (touched, pinned)
        t = time.perf_counter()
        pread_files(paths, bufs, pool)
        record("pread -> touched pinned memory", time.perf_counter() - t)
        # D2H into pinned
        torch.cuda.synchronize()
        t = time.perf_counter()
        offset = 0
        for b in bufs:
            b.copy_(gpu[offset : offset + b.numel()], non_blocking=True)
            offset += b.numel()
        torch.cuda.synchronize()
        record("GPU -> pinned (copy engine)", time.perf_counter() - t)
        t = time.perf_counter()
        for b in bufs:
            cudart.cudaHostUnregister(b.data_ptr())
        record("cudaHostUnregister", time.perf_counter() - t)
        del bufs
        # 3. cudaHostAlloc'd memory
        t = time.perf_counter()
        bufs = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
        record("torch.empty(pin_memory=True) allocation", time.perf_counter() - t)
        t = time.perf_counter()
        pread_files(paths, bufs, pool)
        record("pread -> cudaHostAlloc memory", time.perf_counter() - t)
        del bufs
        # 4. the loader's windowed reads onto the GPU
        with Checkpoint.open(paths[0]) as _:
            pass
        t = time.perf_counter()
        offset = 0
        for path in paths:
            with Checkpoint.open(path) as ckpt, TensorReader(ckpt) as reader:
                reads = []
                for key in ckpt.keys():
                    e = ckpt[key]
                    reads.append((e, gpu[offset : offset + e.nbytes].view(torch.bfloat16)))
                    offset += e.nbytes
                reader.load(reads)
        torch.cuda.synchronize()
        record("TensorReader windows -> GPU", time.perf_counter() - t, offset)
        # 5. registered read-only mappings, copy engine straight from the page cache
        for populate in (False, True):
            maps = []
            t = time.perf_counter()
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            for path, size in zip(paths, sizes, strict=True):
                with open(path, "rb") as fh:
                    m = mmap.mmap(fh.fileno(), size, flags=flags, prot=mmap.PROT_READ)
                maps.append(m)
            t_map = time.perf_counter() - t
            label = "populated " if populate else ""
            record(f"mmap {label}(PROT_READ, MAP_SHARED)", t_map)
            addrs = [(view, view.data_ptr()) for view in (torch.frombuffer(m, dtype=torch.uint8) for m in maps)]
            t = time.perf_counter()
            errs = [int(cudart.cudaHostRegister(a, v.numel(), READ_ONLY)) for v, a in addrs]
            t_reg = time.perf_counter() - t
            print(f"  register errors {errs}")
            if any(errs):
                torch.cuda.synchronize()
                break
            record(f"cudaHostRegister(ReadOnly) of {label}mappings", t_reg)
            torch.cuda.synchronize()
            t = time.perf_counter()
            offset = 0
            for view, _ in addrs:
                gpu[offset : offset + view.numel()].copy_(view, non_blocking=True)
                offset += view.numel()
            del view
            torch.cuda.synchronize()
            record(f"registered {label}mapping -> GPU (copy engine)", time.perf_counter() - t)
            print(f"  first bytes equal: {torch.equal(gpu[:4096].cpu(), addrs[0][0][:4096])}")
            t = time.perf_counter()
            for _, a in addrs:
                cudart.cudaHostUnregister(a)
            record(f"cudaHostUnregister of {label}mappings", time.perf_counter() - t)
            del addrs
            for m in maps:
                m.close()
        # 6. private writable mappings page-locked for writing: the kernel copies each page out of the page cache
        # into anonymous memory as it locks it (copy on write), with no page zeroed and no read call: host storage
        # that is the process's own, filled by the registration alone. One file per thread, as many threads as files.
        for threads in (1, len(paths)):
            maps, t = [], time.perf_counter()
            for path, size in zip(paths, sizes, strict=True):
                with open(path, "rb") as fh:
                    maps.append(mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=PROT_RW))
            views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
            t_map = time.perf_counter() - t
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as lockers:
                errs = list(lockers.map(lambda v: int(cudart.cudaHostRegister(v.data_ptr(), v.numel(), 0)), views))
            t_reg = time.perf_counter() - t
            print(f"  register errors {errs}  (mmap {t_map:.3f} s)")
            if any(errs):
                break
            record(f"cudaHostRegister of private mappings, {threads} thread(s)", t_reg)
            torch.cuda.synchronize()
            t = time.perf_counter()
            offset = 0
            for view in views:
                gpu[offset : offset + view.numel()].copy_(view, non_blocking=True)
                offset += view.numel()
            torch.cuda.synchronize()
            record("registered private mapping -> GPU (copy engine)", time.perf_counter() - t)
            first = views[0][:4096].clone()
            views[0][:4096] = 0  # written through the mapping: the file keeps its bytes
            with open(paths[0], "rb") as fh:
                kept = torch.frombuffer(bytearray(fh.read(4096)), dtype=torch.uint8)
            print(f"  equal to the file: {torch.equal(first, kept)}; file unchanged by a write: {bool(kept.any())}")
            for view in views:
                cudart.cudaHostUnregister(view.data_ptr())
            del view, views
            for m in maps:
                m.close()
    print("medians (GB/s):")
    for name, values in results.items():
        print(f"  {name:<52} {statistics.median(values):6.2f}  ({', '.join(f'{x:.2f}' for x in values)})")


if __name__ == "__main__":
    main()
