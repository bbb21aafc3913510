"""How long the loader's warm-up thread runs, alone and beside other work, to find what slows it during the reads.

The warm-up (`hf_prefetch.loading.warmup.Warmup`: a one-layer twin's `generate()`, which pays the CUDA context, cuBLAS
and kernel loading) runs while the loader reads the checkpoint, and a load ends only when both have. Each variant runs
in a fresh process (the costs are one-time): the 8B-shaped skeleton of `benchmarks/load.py`'s checkpoint on the meta
device, then the warm-up thread started, alone or beside 16 threads (`--threads`) doing one kind of work:

- `pread`: positional reads of every shard (page cache warm) into fresh host memory, 16 MiB each, as the loader's
  host reads do; `pread-touched`: the same into memory written once before the warm-up starts; `pread-256MiB`: reads
  of 256 MiB (16x fewer returns to Python);
- `touch`: the first write of as much fresh host memory as the checkpoint's size (page faults, no file);
- `populate`: the same memory made present by the kernel instead (`madvise(MADV_POPULATE_WRITE)`, 64 MiB a call,
  no page fault per page); `populate-pread`: that, then the reads of `pread` into it;
- `copy`: copies between host buffers written before (memory bandwidth; the GIL released, no page faults);
- `python`: pure-Python loops (the GIL held), for 2 s;
- `lock-files`: every shard mapped read-only in 64 MiB spans, each page-locked for the device and unlocked again
  (`hf_prefetch.host.arena.lock_read_only`, what a mapped read does before and after its copy), no copy; `lock-once`:
  the same with each shard mapped once, before the spans;
- `mapped-reads`: the loader's device reads (`TensorReader` onto the GPU, every tensor of the checkpoint: mapped
  spans of the page cache's pages, page-locked, copied by the copy engine); `window-reads`: the same through pinned
  bounce buffers (mapping off);
- `copy-once-64MiB`: every shard's bytes onto the GPU, each shard mapped once, its 64 MiB spans page-locked, copied
  and unlocked one by one from 16 threads; `copy-once-256MiB`: spans of 256 MiB; `copy-once-whole`: each shard
  page-locked in one call (a thread per shard), its spans copied, then unlocked; `copy-once-64MiB-keep`: 64 MiB
  spans, every lock undone only after all copies; `copy-populated-64MiB`: as `copy-once-64MiB` with the mappings'
  page tables filled when mapped (`MAP_POPULATE`).

`--alone` runs the other work without the warm-up (the CUDA context made before the clock starts), every variant in
one process, to compare its time beside the warm-up with its time alone.

Prints the warm-up's seconds and the other work's. Run on a GPU machine after `benchmarks/load.py` wrote its
checkpoint:

    PYTHONUNBUFFERED=1 python benchmarks/experiments/warmup_contention.py [--dir /tmp/ckpt8b] [--rounds 2]
        [--variants ...] [--alone]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import pread_files  # noqa: E402

RESULT_MARK = "RESULT "
VARIANTS = [
    "none", "pread", "pread-touched", "pread-256MiB", "touch", "populate", "populate-pread", "copy", "python",
    "lock-files", "lock-once", "mapped-reads", "window-reads", "copy-once-64MiB", "copy-once-256MiB",
    "copy-once-whole", "copy-once-64MiB-keep", "copy-populated-64MiB",
]  # fmt: skip
_LOCK_SPAN = 64 * 2**20
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
    elif variant == "lock-files":
        _lock_files(_files(folder), pool)
    elif variant in ("mapped-reads", "window-reads"):
        _device_reads(variant, _files(folder))
    elif variant.startswith(("copy-once", "copy-populated", "lock-once")):
        _mapped_once(variant, _files(folder), pool)
    elif variant == "python":

        def spin():
            end, n = time.perf_counter() + _PYTHON_SECONDS, 0
            while time.perf_counter() < end:
                n += 1
            return n

        for job in [pool.submit(spin) for _ in range(threads)]:
            job.result()


def _lock_files(files: list[Path], pool: ThreadPoolExecutor) -> None:
    import torch

    from hf_prefetch.host.arena import lock_read_only, unlock
    from hf_prefetch.host.diskio import FileMapping

    def lock(fd: int, start: int, stop: int) -> None:
        mapping = FileMapping(fd, start, stop)
        try:
            with torch.cuda.device(0):
                assert lock_read_only(mapping.address, mapping.nbytes)
                unlock(mapping.address)
        finally:
            mapping.close()

    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        jobs = [
            pool.submit(lock, fd, a, min(a + _LOCK_SPAN, os.fstat(fd).st_size))
            for fd in fds
            for a in range(0, os.fstat(fd).st_size, _LOCK_SPAN)
        ]
        for job in jobs:
            job.result()
    finally:
        for fd in fds:
            os.close(fd)


def _mapped_once(variant: str, files: list[Path], pool: ThreadPoolExecutor) -> None:
    # Each shard mapped read-only once; its spans page-locked (and copied onto the GPU unless `lock-once`) by the
    # pool's threads, on one copy stream; unlocked after each span's copy, or after all of them (`-keep`, `-whole`).
    import mmap

    import torch

    from hf_prefetch.host.arena import lock_read_only, unlock

    span = {"256MiB": 256 * 2**20}.get(variant.rsplit("-", 1)[-1], _LOCK_SPAN)
    whole, keep, copy = variant.endswith("whole"), variant.endswith("keep"), not variant.startswith("lock")
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if "populated" in variant else 0)
    maps = []
    for path in files:
        with open(path, "rb") as fh:
            maps.append(mmap.mmap(fh.fileno(), 0, flags=flags, prot=mmap.PROT_READ))
    views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    out = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8, device="cuda:0") if copy else None
    stream = torch.cuda.Stream(0)
    firsts = [0]
    for view in views:
        firsts.append(firsts[-1] + view.numel())
    locked: list[int] = []

    def copy_span(index: int, start: int, stop: int, lock: bool) -> None:
        view = views[index]
        with torch.cuda.device(0):
            if lock:
                assert lock_read_only(view.data_ptr() + start, stop - start)
            if copy:
                with torch.cuda.stream(stream):
                    out[firsts[index] + start : firsts[index] + stop].copy_(view[start:stop], non_blocking=True)
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                event.synchronize()
            if lock and not keep:
                unlock(view.data_ptr() + start)
            elif lock:
                locked.append(view.data_ptr() + start)

    try:
        if whole:  # a thread per shard locks it whole, then its spans are copied
            for job in [pool.submit(lock_read_only, v.data_ptr(), v.numel()) for v in views]:
                assert job.result()
            locked += [v.data_ptr() for v in views]
        spans = [(i, a, min(a + span, v.numel())) for i, v in enumerate(views) for a in range(0, v.numel(), span)]
        for job in [pool.submit(copy_span, i, a, b, not whole) for i, a, b in spans]:
            job.result()
    finally:
        torch.cuda.synchronize()
        with torch.cuda.device(0):
            for pointer in locked:
                unlock(pointer)
        views.clear()  # the mappings close only once no tensor exports their buffers
        for m in maps:
            m.close()


def _device_reads(variant: str, files: list[Path]) -> None:
    # Every tensor of every shard onto the GPU through the loader's reader (its own 16 threads).
    import torch

    from hf_prefetch.loading import reader as reader_module
    from hf_prefetch.loading.checkpoint import Checkpoint

    if variant == "window-reads":
        reader_module.MAPPED_FROM = 2.0  # no file is cached enough to be mapped
    with Checkpoint.open(files[0].parent) as checkpoint, reader_module.TensorReader(checkpoint) as reader:
        entries = [checkpoint[key] for key in checkpoint.keys()]
        out = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8, device="cuda:0")
        reads, offset = [], 0
        for entry in entries:
            reads.append((entry, out[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)))
            offset += entry.nbytes
        reader.load(reads)
        torch.cuda.synchronize()


def run(folder: Path, variant: str, threads: int, alone: bool = False) -> dict[str, float]:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_prefetch.loading.warmup import Warmup

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    prepared = _prepare(variant, folder, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: None, range(threads)))  # the threads exist before the clock starts
        if alone:
            torch.cuda.init()
            torch.empty(1, device="cuda:0")
            torch.cuda.synchronize()
        started = time.perf_counter()
        warmup = None if alone else Warmup(torch.device("cuda", 0))
        if warmup is not None:
            warmup.run(model, spare_bytes=2**40)
        beside_s = 0.0
        if variant != "none":
            _beside(variant, folder, threads, prepared, pool)
            beside_s = time.perf_counter() - started
        if warmup is not None:
            warmup.join()
    warmup_s = warmup.seconds if warmup is not None else 0.0
    return {"warmup_s": warmup_s, "beside_s": beside_s, "until_both_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt8b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--alone", action="store_true", help="the other work without the warm-up")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.alone:
        for round_index in range(args.rounds):
            for variant in args.variants:
                result = run(folder, variant, args.threads, alone=True)
                print(f"alone, round {round_index + 1} {variant}: {result['beside_s']:.3f} s", flush=True)
        return
    if args.run is not None:
        print(RESULT_MARK + json.dumps(run(folder, args.run, args.threads, args.alone)), flush=True)
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
            ] + (["--alone"] if args.alone else [])
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
