"""Checkpoint to first token: hf_prefetch.from_pretrained against transformers' from_pretrained(device_map="auto").

Writes (once, reused afterwards) a bf16 Llama-3.1-8B-shaped checkpoint of random weights in ~5 GB shards, then runs
each system in a fresh subprocess so that its peak host RSS (VmHWM) is its own, with the page cache warm (the
checkpoint read once before) and, with --cold, cold (the checkpoint evicted from the page cache before each run; the
disk's own sequential read speed is measured in the same run with dd, O_DIRECT, 64 MiB blocks). transformers gets the
same GPU budget as hf_prefetch's resident + pool bytes; the rest it offloads to the CPU. Each hf_prefetch row prints
its load timeline and where the time to the first token went. Systems: `hf_prefetch` (the default reads), `"hf_prefetch
copied host"` (`map_files=False`: streamed weights read into a host arena instead of kept in the page cache's pages),
`"hf_prefetch mapped reads"` (CUDA destinations copied from the page cache's pages instead of through bounce
buffers, as reloads do), `"hf_prefetch 8 readers"` (8 reader threads instead of 16), `"hf_prefetch 32MiB spans"`
(mapped reads with spans of that size), `"hf_prefetch late warm-up"`
(the warm-up thread started after the plan, not at the call's first line), `"hf_prefetch device first"` (the reads onto
the GPU submitted before the host's, not interleaved), `"hf_prefetch direct"`, `"hf_prefetch cached"` (`direct_io=True`
/ `False`), `"hf_prefetch previous"` (the package found in `--previous-dir`, say an earlier commit's, for an A/B),
`transformers`.

Run on a GPU machine:  PYTHONUNBUFFERED=1 python benchmarks/load.py [--dir /tmp/ckpt8b] [--rounds 1] [--cold]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get(_PREVIOUS := "HF_PREFETCH_BENCH_PREVIOUS"):  # "hf_prefetch previous": the package found there
    sys.path.insert(0, os.environ[_PREVIOUS])
from common import LLAMA_8B  # noqa: E402

PREFETCH = dict(group_size=2, num_in_group=1, prefetch_step=2)
SHARD_BYTES = 5 * 10**9
PROMPT_TOKENS = 16
RESULT_MARK = "RESULT "


def build_checkpoint(folder: Path, num_layers: int) -> None:
    """Random bf16 weights (std 0.02, norms 1), written shard by shard with safetensors' save_file, plus an index."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if (folder / "COMPLETE").is_file():
        found = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        if found != num_layers:
            sys.exit(f"{folder} holds a {found}-layer checkpoint, not {num_layers}: pass another --dir.")
        print(f"reusing the checkpoint in {folder}")
        return
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": num_layers}, dtype=torch.bfloat16)
    with init_empty_weights():
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if current and size + nbytes > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)

    device = "cuda" if torch.cuda.is_available() else "cpu"  # random numbers are much faster on the GPU
    weight_map, started = {}, time.perf_counter()
    for index, names in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            tensor = torch.empty(shapes[name], dtype=torch.bfloat16, device=device)
            shard[name] = (tensor.fill_(1.0) if "norm" in name else tensor.normal_(0.0, 0.02)).cpu()
            weight_map[name] = file
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        print(f"wrote {file} ({sum(t.nbytes for t in shard.values()) / 1e9:.1f} GB)")
        del shard
    total = sum(math.prod(s) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    (folder / "COMPLETE").write_text("")
    print(f"checkpoint: {total / 1e9:.1f} GB in {time.perf_counter() - started:.0f} s")


def warm_page_cache(folder: Path) -> int:
    buffer, total, started = bytearray(64 * 2**20), 0, time.perf_counter()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    print(f"page cache warmed: {total / 1e9:.1f} GB read in {time.perf_counter() - started:.1f} s")
    return total


def evict(folder: Path) -> str:
    """Drop the checkpoint from the page cache: all clean pages (drop_caches) where allowed, else its own files'."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "drop_caches"
    except OSError:
        for file in folder.glob("*.safetensors"):
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def cached_gb(folder: Path) -> float:
    from hf_prefetch.host.diskio import cached_fraction

    return sum((cached_fraction(f) or 0.0) * f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9


def disk_read_gbps(folder: Path) -> float:
    """The disk's sequential read speed: dd of every shard with O_DIRECT and 64 MiB blocks, one after another."""
    total, seconds = 0, 0.0
    for file in sorted(folder.glob("*.safetensors")):
        started = time.perf_counter()
        subprocess.run(["dd", f"if={file}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True)
        seconds += time.perf_counter() - started
        total += file.stat().st_size
    return total / seconds / 1e9


def gpu_budget_bytes(folder: Path) -> int:
    """hf_prefetch's device bytes (resident + buffer pool) for PREFETCH, planned on a meta model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_prefetch

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return hf_prefetch.planning.selection.make_plan(model, hf_prefetch.PrefetchConfig(**PREFETCH)).device_bytes


def run_system(system: str, folder: Path, budget_gib: int) -> dict:
    """In this (fresh) process: load, generate one token from a 16-token prompt, report."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hf_prefetch").setLevel(logging.INFO)  # the loader's GB/s line, on stderr
    result = {"system": system}
    started = time.perf_counter()
    if system.startswith("hf_prefetch"):
        import hf_prefetch

        print(f"{system}: hf_prefetch from {os.path.dirname(hf_prefetch.__file__)}", file=sys.stderr)

        direct_io = {"hf_prefetch": None, "hf_prefetch direct": True, "hf_prefetch cached": False}.get(system)
        from hf_prefetch.loading import reader

        if system == "hf_prefetch mapped reads" or system.endswith("MiB spans"):  # reads mapped page-cache pages
            from hf_prefetch.loading import filling

            filling._MAPPED_READS = True
        if system.endswith("MiB spans"):  # "hf_prefetch 32MiB spans": mapped reads' spans of that size
            reader._SPAN_BYTES = int(system.split()[1].removesuffix("MiB")) * 2**20
        if system.endswith(" readers"):  # "hf_prefetch 8 readers": that many reader threads
            reader._READERS = int(system.split()[1])
        if system == "hf_prefetch device first":  # the device's reads submitted before the host's, not interleaved
            reader._interleave = lambda lists: [*lists[1], *lists[2], *lists[0]]
        if system == "hf_prefetch late warm-up":  # the warm-up thread started after the plan, not at the first line
            from hf_prefetch.loading import loader, warmup

            class Late(warmup.Warmup):
                def __init__(self, device):
                    self._late = device

                def run(self, model, spare_bytes):
                    super().__init__(self._late)
                    super().run(model, spare_bytes)

                def join(self):
                    if hasattr(self, "_thread"):
                        super().join()

            loader.Warmup = Late
        model = hf_prefetch.from_pretrained(
            folder,
            device="cuda",
            progress=False,
            offload=hf_prefetch.PrefetchConfig(**PREFETCH),
            direct_io=direct_io,
            map_files=False if system == "hf_prefetch copied host" else None,
        )
        state = hf_prefetch.get_state(model)
        result["mapped_host_bytes"] = state.arena.file_bytes  # streamed weights kept in the page cache's pages
        result["timeline"] = dict(state.load_timeline)  # seconds per phase of from_pretrained
        result["pinned_bytes"] = state.arena.nbytes if state.arena.pinned else 0
        result["offloaded_bytes"] = state.plan.offloaded_bytes
    else:
        from transformers import AutoModelForCausalLM

        max_memory = {0: f"{budget_gib}GiB", "cpu": "200GiB"}
        model = AutoModelForCausalLM.from_pretrained(
            folder, device_map="auto", max_memory=max_memory, dtype=torch.bfloat16
        )
        on_cpu = [name for name, device in model.hf_device_map.items() if device in ("cpu", "disk")]
        result["offloaded_bytes"] = sum(
            p.numel() * p.element_size()
            for name, p in model.named_parameters()
            if any(name == m or name.startswith(f"{m}.") for m in on_cpu)
        )
        result["pinned_bytes"] = 0
    torch.cuda.synchronize()
    result["load_s"] = time.perf_counter() - started
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    forward_starts = []
    hook = model.register_forward_pre_hook(lambda *_: forward_starts.append(time.perf_counter()))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    hook.remove()
    result["first_token_s"] = time.perf_counter() - started
    result["first_forward_at_s"] = forward_starts[0] - started  # generate()'s own setup ends here
    # The first forward's one-time costs (kernel loading, cuBLAS handles, allocator growth): a second token, timed.
    again = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    result["second_token_s"] = time.perf_counter() - again
    result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    result["peak_rss_bytes"] = kib * 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt8b")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    parser.add_argument("--systems", nargs="*", default=["hf_prefetch", "transformers"])
    parser.add_argument("--cold-systems", nargs="*", default=["hf_prefetch", "hf_prefetch cached", "transformers"])
    parser.add_argument("--cold", action="store_true", help="also load with the checkpoint evicted from the cache")
    parser.add_argument("--previous-dir", help='a folder holding the hf_prefetch package "hf_prefetch previous" runs')
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the child process for one system
    parser.add_argument("--budget-gib", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.run:
        print(RESULT_MARK + json.dumps(run_system(args.run, folder, args.budget_gib)), flush=True)
        return

    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    build_checkpoint(folder, args.layers)
    checkpoint_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    budget = gpu_budget_bytes(folder)
    budget_gib = math.ceil(budget / 2**30)
    print(f"GPU budget: hf_prefetch resident + pool = {budget / 2**30:.2f} GiB -> max_memory {{0: '{budget_gib}GiB'}}")
    disk = None
    if args.cold:
        how = evict(folder)
        print(f"evicted the checkpoint ({how}): {cached_gb(folder):.2f} GB of it cached")
        disk = disk_read_gbps(folder)
        print(f"disk: dd of every shard, O_DIRECT, 64 MiB blocks: {disk:.2f} GB/s")

    # One discarded run first: a fresh machine's first CUDA process also reads the CUDA libraries from the disk.
    runs = [("hf_prefetch", "prime")] + [(system, "warm") for system in args.systems]
    runs += [(system, "cold") for system in args.cold_systems] if args.cold else []
    rows = []
    for round_index in range(args.rounds):
        for system, cache in runs[round_index > 0 :]:
            if cache == "cold":
                evict(folder)
            else:
                warm_page_cache(folder)
            command = [
                sys.executable,
                __file__,
                "--dir",
                str(folder),
                "--run",
                system,
                "--budget-gib",
                str(budget_gib),
            ]
            env = dict(os.environ)
            if system == "hf_prefetch previous":
                if not args.previous_dir:
                    sys.exit('"hf_prefetch previous" needs --previous-dir')
                env[_PREVIOUS] = str(Path(args.previous_dir).resolve())
            child = subprocess.run(command, capture_output=True, text=True, env=env)
            sys.stderr.write("".join(line + "\n" for line in child.stderr.splitlines() if "hf_prefetch" in line))
            results = [line for line in child.stdout.splitlines() if line.startswith(RESULT_MARK)]
            if child.returncode != 0 or not results:
                print(f"{system} failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
                continue
            row = json.loads(results[-1].removeprefix(RESULT_MARK))
            row.update(cache=cache, cached_after_gb=cached_gb(folder))
            if cache != "prime":
                rows.append(row)

    gib = 2**30
    header = (
        f"{'system':<20} {'cache':<5} {'load s':>7} {'1st token s':>11} {'load GB/s':>9} {'x disk':>6} "
        f"{'peak RSS GiB':>12} {'pinned GiB':>10} {'offloaded GiB':>13} {'GPU peak GiB':>12} {'cached after GB':>15}"
    )
    lines = [
        f"checkpoint {checkpoint_bytes / 1e9:.1f} GB, {PROMPT_TOKENS}-token prompt, 1 new token, "
        f"GPU budget {budget_gib} GiB, {torch.cuda.get_device_name()}"
        + (f", disk (dd, O_DIRECT) {disk:.2f} GB/s" if disk else ""),
        header,
    ]
    for r in rows:
        rate = checkpoint_bytes / r["load_s"] / 1e9
        versus_disk = f"{rate / disk:.2f}" if disk and r["cache"] == "cold" else "-"
        lines.append(
            f"{r['system']:<20} {r['cache']:<5} {r['load_s']:>7.2f} {r['first_token_s']:>11.2f} {rate:>9.2f} "
            f"{versus_disk:>6} {r['peak_rss_bytes'] / gib:>12.2f} {r['pinned_bytes'] / gib:>10.2f} "
            f"{r['offloaded_bytes'] / gib:>13.2f} {r['gpu_peak_bytes'] / gib:>12.2f} {r['cached_after_gb']:>15.2f}"
        )
    for r in rows:
        if "timeline" in r:
            phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in r["timeline"].items())
            setup = r["first_forward_at_s"] - r["load_s"]
            forward = r["first_token_s"] - r["first_forward_at_s"]
            mapped = f"; streamed weights in the page cache's pages: {r['mapped_host_bytes'] / gib:.2f} GiB"
            lines.append(
                f"{r['system']} ({r['cache']}) timeline (s): {phases}; load {r['load_s']:.2f}; generate() until its "
                f"first forward {setup:.2f}, from there to the token {forward:.2f} (the same call again: "
                f"{r['second_token_s']:.2f}){mapped}"
            )
    table = "\n".join(lines)
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "load.log"), "a") as log:
            log.write(table + "\n\n")
        with open(os.path.join(out, "load.json"), "w") as f:
            json.dump({"checkpoint_bytes": checkpoint_bytes, "budget_bytes": budget, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
