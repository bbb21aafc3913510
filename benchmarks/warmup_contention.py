"""How long the loader's warm-up thread runs, alone and beside the checkpoint's reads, by the number of reader threads.

The warm-up (`hf_prefetch.warmup.Warmup`: a one-layer twin's `generate()`, which pays the CUDA context, cuBLAS and
kernel loading) runs while the loader reads the checkpoint, and a load ends only when both have. Each variant runs
in a fresh process (the costs are one-time): the 8B-shaped skeleton of `benchmarks/load.py`'s checkpoint on the meta
device, then the warm-up thread started, alone or while N threads read every shard (page cache warm) into fresh host
memory with 16 MiB positional reads, as the loader's host reads do. Prints the warm-up's and the reads' seconds.
Run on a GPU machine after `benchmarks/load.py` wrote its checkpoint:

    PYTHONUNBUFFERED=1 python benchmarks/warmup_contention.py [--dir /tmp/ckpt8b] [--rounds 2]
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


def run(folder: Path, readers: int) -> dict[str, float]:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_prefetch.warmup import Warmup

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    started = time.perf_counter()
    warmup = Warmup(model, torch.device("cuda", 0), spare_bytes=2**40)
    read_s = 0.0
    if readers:
        files = sorted(folder.glob("*.safetensors"))
        buffers = [torch.empty(f.stat().st_size, dtype=torch.uint8) for f in files]
        with ThreadPoolExecutor(readers) as pool:
            pread_files(files, buffers, pool)
        read_s = time.perf_counter() - started
    warmup.join()
    return {"warmup_s": warmup.seconds, "read_s": read_s, "until_both_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt8b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--readers", type=int, nargs="*", default=[0, 16, 8, 4])
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.run is not None:
        print(RESULT_MARK + json.dumps(run(folder, args.run)), flush=True)
        return
    results: dict[int, list[dict[str, float]]] = {n: [] for n in args.readers}
    for round_index in range(args.rounds):
        for readers in args.readers:
            command = [sys.executable, __file__, "--dir", str(folder), "--run", str(readers)]
            child = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT_MARK)]
            if child.returncode or not lines:
                print(f"readers={readers} failed:\n{child.stderr[-2000:]}")
                continue
            result = json.loads(lines[-1].removeprefix(RESULT_MARK))
            results[readers].append(result)
            print(
                f"round {round_index + 1} readers {readers:>2}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in result.items())
            )
    print(f"{'reader threads':>14} {'warm-up s':>10} {'reads s':>8} {'both done s':>12}   (medians)")
    for readers, rows in results.items():
        if rows:
            warm = statistics.median(r["warmup_s"] for r in rows)
            read = statistics.median(r["read_s"] for r in rows)
            both = statistics.median(r["until_both_s"] for r in rows)
            print(f"{readers if readers else 'none':>14} {warm:>10.2f} {read:>8.2f} {both:>12.2f}")


if __name__ == "__main__":
    main()
