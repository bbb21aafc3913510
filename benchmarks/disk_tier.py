"""Decode with layers read from the checkpoint's files (a host budget below what streams) against the same model with
every streamed layer pinned, and the disk's own direct read speed. GPU only.

An 8B-shaped random bf16 model is built on the GPU (the reference tokens and time) and saved as safetensors in
`--folder` (on the disk to measure), then loaded by `from_pretrained` two more ways, the three measured alternately in
one process: every streamed layer pinned (`max_memory={0: gpu}`), and with `max_memory["cpu"]` a `--host-share` of
the streamed bytes, so that the layers beyond it are read from the files at each copy. bound = max(all-on-GPU
s/token, streamed bytes / pinned H2D peak, file bytes per token / the disk's direct sequential read speed), the disk
measured before the loads and before each pair (`measure_read_gbps`: the first GiB of the largest shard, read by as
many threads as the reader uses, after the page cache was dropped where allowed), the median of those. Prints the
read rate of the file layers during their runs against that speed, how much the process's RSS grew at that load
against the host budget with the staging buffers, and whether the tokens are identical.

    python benchmarks/disk_tier.py [--layers 32] [--gpu-gib 8] [--host-share 0.25] [--pairs 3] [--folder PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, h2d_peak_gbps, save_results  # noqa: E402

import hf_prefetch  # noqa: E402
from hf_prefetch.host.file_reads import measure_read_gbps  # noqa: E402

SHORT, LONG = 4, 16


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def seconds_per_token(model, ids) -> tuple[float, float, torch.Tensor]:
    def run(n):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - begin, out

    t_short, _ = run(SHORT)
    t_long, out = run(LONG)
    return (t_long - t_short) / (LONG - SHORT), t_short + t_long, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gpu-gib", type=float, default=8.0)
    parser.add_argument("--host-share", type=float, default=0.25)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--folder", default="/tmp/hf_prefetch_disk_tier")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    reference = build_model(args.layers, device="cuda")
    if os.path.isfile(os.path.join(args.folder, "config.json")):
        reference.load_state_dict(_loaded(args.folder))
    else:
        begin = time.perf_counter()
        reference.save_pretrained(args.folder, max_shard_size="2GB")
        print(f"saved {args.layers} layers to {args.folder} in {time.perf_counter() - begin:.1f} s", flush=True)
    gc.collect()
    shards = sorted(p for p in os.listdir(args.folder) if p.endswith(".safetensors"))
    largest = max((os.path.join(args.folder, p) for p in shards), key=os.path.getsize)
    disk = []

    def measure_disk() -> None:
        dropped = drop_page_cache()
        disk.append(measure_read_gbps(largest, 2**30))
        print(f"disk: direct sequential read {disk[-1]:.2f} GB/s; page cache dropped: {dropped}", flush=True)

    measure_disk()
    gpu = {0: f"{args.gpu_gib}GiB"}
    streamed = hf_prefetch.plan(args.folder, device="cuda", max_memory=gpu).streamed_bytes_per_forward
    host = int(streamed * args.host_share)
    rss_before = _rss()
    files = hf_prefetch.from_pretrained(args.folder, device="cuda", max_memory={**gpu, "cpu": host})
    rss = _rss() - rss_before  # before the other systems load: the host memory the load with files added
    plan = hf_prefetch.get_state(files).plan
    print(plan, flush=True)
    pinned = hf_prefetch.from_pretrained(args.folder, device="cuda", max_memory=gpu)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    systems = {"all on GPU": reference, "every streamed layer pinned": pinned, "layers read from files": files}
    for model in systems.values():
        seconds_per_token(model, ids)  # warm-up
    samples = {name: [] for name in systems}
    tokens = {}
    links = []
    read_rates = []
    for pair in range(args.pairs):
        links.append(h2d_peak_gbps())
        measure_disk()
        for name, model in systems.items():
            if name != "all on GPU":
                hf_prefetch.reset_stats(model)
            seconds, elapsed, out = seconds_per_token(model, ids)
            samples[name].append(seconds)
            tokens[name] = out
            print(f"pair {pair} {name}: {seconds:.4f} s/token", flush=True)
            if model is files:
                read_rates.append(hf_prefetch.stats(files).read_bytes / elapsed)
    stats = hf_prefetch.stats(files)
    link, disk_gbps = max(links), statistics.median(disk)
    resident_s = statistics.median(samples["all on GPU"])
    read_rate = statistics.median(read_rates)
    rows = []
    for name, model in systems.items():
        s = statistics.median(samples[name])
        moved = 0 if name == "all on GPU" else hf_prefetch.get_state(model).plan.streamed_bytes_per_forward
        from_files = plan.file_bytes if name == "layers read from files" else 0
        bound = max(resident_s, moved / (link * 1e9), from_files / (disk_gbps * 1e9))
        same = torch.equal(tokens[name], tokens["all on GPU"])
        rows.append((name, moved / 1e9, from_files / 1e9, s, bound, s / bound, same))
    print(f"\nlink {link:.1f} GB/s, disk {disk_gbps:.2f} GB/s (direct, median of {len(disk)}: "
          f"{', '.join(f'{g:.2f}' for g in disk)}), {args.layers} layers, medians of {args.pairs}")  # fmt: skip
    print(f"{'system':32} {'GB/token':>9} {'files GB':>9} {'s/token':>8} {'bound':>8} {'x bound':>8}  tokens")
    for name, moved, from_files, s, bound, ratio, same in rows:
        verdict = "reference" if name == "all on GPU" else "identical" if same else "DIFFER"
        print(f"{name:32} {moved:9.2f} {from_files:9.2f} {s:8.4f} {bound:8.4f} {ratio:8.3f}  {verdict}")
    print(f"read from files during the runs: {read_rate / 1e9:.2f} GB/s ({read_rate / 1e9 / disk_gbps:.2f}x the disk)")
    print(f"waited for reads in the last pair: {stats.read_wait_seconds:.2f} s; RSS grew by {rss / 2**30:.2f} GiB at "
          f"that load, host budget {host / 2**30:.2f} GiB (pinned {plan.host_bytes / 2**30:.2f} GiB with the staging "
          f"buffers)")  # fmt: skip
    save_results("disk_tier.json", dict(rows=rows, link=link, disk=disk, rss=rss, host=host))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _loaded(folder: str) -> dict:
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name), device="cuda"))
    return state


if __name__ == "__main__":
    main()
