"""How long the loader's warm-up thread runs, alone and beside other work, to find what slows it during the reads.

The warm-up (`hf_prefetch.warmup.Warmup`: a one-layer twin's `generate()`, which pays the CUDA context, cuBLAS and
kernel loading) runs while the loader reads the checkpoint, and a load ends only when both have. Each variant runs
in a fresh process (the costs are one-time): the 8B-shaped skeleton of `benchmarks/load.py`'s checkpoint on the meta
device, then the warm-up thread started, alone or beside 16 threads (`--threads`) doing one kind of work:

- `pread`: positional reads of every shard (page cache warm) into fresh host memory, 16 MiB each, as the loader's
  host reads do; `pread-touched`: the same into memory written once before the warm-up starts; `pread-256MiB`: reads
  of 256 MiB (16x fewer returns to Python);
- `touch`: the first write of as much fresh host memory as the checkpoint's size (page faults, no file);
- `populate`: the same memory made present by the kernel instead (`madvise(MADV_POPULATE_WRITE)`, 64 MiB a call,
  no page fault per page); `populate-pread`: that, then the reads of `pread` into it;
- `copy`: copies between host buffers written before (memory bandwidth; the GIL released, no page faults);
- `python`: pure-Python loops (the GIL held), for 2 s.

Prints the warm-up's seconds and the other work's. Run on a GPU machine after `benchmarks/load.py` wrote its
checkpoint:

    PYTHONUNBUFFERED=1 python benchmarks/warmup_contention.py [--dir /tmp/ckpt8b] [--rounds 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import pread_files  # noqa: E402

RESULT_MARK = "RESULT "
VARIANTS = ["none", "pread", "pread-touched", "pread-256MiB", "touch", "populate", "populate-pread", "copy", "python"]
_PYTHON_SECONDS = 2.0
_COPY_BYTES = 2**30  # each thread's buffer of the `copy` variant
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_POPULATE_BYTES = 64 * 2**20


def _populate(buffers, pool: ThreadPoolExecutor) -> None:
    # The pages of each buffer made present and writable by the kernel, a piece per call, from the pool's threads.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")

    def advise(start: int, length: int) -> None:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

    jobs = []
    for buffer in buffers:
        start = -(-buffer.data_ptr() // page) * page
        end = (buffer.data_ptr() + buffer.numel()) // page * page
        jobs += [pool.submit(advise, a, min(_POPULATE_BYTES, end - a)) for a in range(start, end, _POPULATE_BYTES)]
    for job in jobs:
        job.result()


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _prepare(variant: str, folder: Path, threads: int):
    # What the variant needs before the warm-up starts (not timed).
    import torch

    if variant in ("pread", "pread-256MiB", "populate", "populate-pread"):
        return [torch.empty(f.stat().st_size, dtype=torch.uint8) for f in _files(folder)]
    if variant == "pread-touched":
        return [torch.zeros(f.stat().st_size, dtype=torch.uint8) for f in _files(folder)]
    if variant == "copy":
        return [(torch.ones(_COPY_BYTES, dtype=torch.uint8), torch.zeros(_COPY_BYTES, dtype=torch.uint8))
                for _ in range(threads)]  # fmt: skip
    return None


def _beside(variant: str, folder: Path, threads: int, prepared, pool: ThreadPoolExecutor) -> None:
    import torch

    if variant.startswith("populate"):
        _populate(prepared, pool)
        if variant == "populate-pread":
            pread_files(_files(folder), prepared, pool)
    elif variant.startswith("pread"):
        chunk = 256 * 2**20 if variant == "pread-256MiB" else 16 * 2**20
        pread_files(_files(folder), prepared, pool, chunk=chunk)
    elif variant == "touch":
        total = sum(f.stat().st_size for f in _files(folder))
        share = total // threads
        jobs = [pool.submit(lambda: torch.empty(share, dtype=torch.uint8).fill_(1)) for _ in range(threads)]
        for job in jobs:
            job.result()
    elif variant == "copy":
        total = sum(f.stat().st_size for f in _files(folder))
        rounds = max(1, total // (_COPY_BYTES * threads))

        def copy(pair):
            for _ in range(rounds):
                pair[1].copy_(pair[0])

        for job in [pool.submit(copy, pair) for pair in prepared]:
            job.result()
    elif variant == "python":

        def spin():
            end, n = time.perf_counter() + _PYTHON_SECONDS, 0
            while time.perf_counter() < end:
                n += 1
            return n

        for job in [pool.submit(spin) for _ in range(threads)]:
            job.result()


def run(folder: Path, variant: str, threads: int) -> dict[str, float]:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_prefetch.warmup import Warmup

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    prepared = _prepare(variant, folder, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: None, range(threads)))  # the threads exist before the clock starts
        started = time.perf_counter()
        warmup = Warmup(torch.device("cuda", 0))
        warmup.run(model, spare_bytes=2**40)
        beside_s = 0.0
        if variant != "none":
            _beside(variant, folder, threads, prepared, pool)
            beside_s = time.perf_counter() - started
        warmup.join()
    return {"warmup_s": warmup.seconds, "beside_s": beside_s, "until_both_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt8b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.run is not None:
        print(RESULT_MARK + json.dumps(run(folder, args.run, args.threads)), flush=True)
        return
    results: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    for round_index in range(args.rounds):
        for variant in args.variants:
            command = [
                sys.executable,
                __file__,
                "--dir",
                str(folder),
                "--threads",
                str(args.threads),
                "--run",
                variant,
            ]
            child = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT_MARK)]
            if child.returncode or not lines:
                print(f"{variant} failed:\n{child.stderr[-2000:]}")
                continue
            result = json.loads(lines[-1].removeprefix(RESULT_MARK))
            results[variant].append(result)
            print(f"round {round_index + 1} {variant}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
    header = f"{'beside the warm-up':>20} {'warm-up s':>10} {'other work s':>13} {'both done s':>12}"
    print(f"{header}   (medians, {args.threads} threads)")
    for variant, rows in results.items():
        if rows:
            warm = statistics.median(r["warmup_s"] for r in rows)
            other = statistics.median(r["beside_s"] for r in rows)
            both = statistics.median(r["until_both_s"] for r in rows)
            print(f"{variant:>20} {warm:>10.2f} {other:>13.2f} {both:>12.2f}")


if __name__ == "__main__":
    main()
