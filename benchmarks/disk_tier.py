"""Decode with weights read from the checkpoint's files (a host budget below what streams) against the same model with
every streamed tensor pinned, and the disk's own direct read speed. GPU only.

`--shape 8b` (the default): an 8B-shaped random bf16 model is built on the GPU (the reference tokens and time) and
saved as safetensors in `--folder` (on the disk to measure), then loaded by `from_pretrained` two more ways, the three
measured alternately in one process: every streamed layer pinned (`max_memory={0: gpu}`), and with `max_memory["cpu"]`
a `--host-share` of the streamed bytes, so that the layers beyond it are read from the files at each copy. bound =
max(all-on-GPU s/token, streamed bytes / pinned H2D peak, file bytes per token / the disk's direct sequential read
speed), the disk measured before the loads and before each pair (`measure_read_gbps`: the first GiB of the largest
shard, read by as many threads as the reader uses, after the page cache was dropped where allowed), the median of
those. Prints the read rate of the file layers during their runs against that speed, how much the process's RSS grew
at that load against the host budget with the staging buffers, and whether the tokens are identical.

RSS: the reference runs one forward before the loads (a process's first forward loads CUDA's libraries, which are not
the budget's). For the load with files: the growth of RSS (anonymous, file-backed, shared), its peak during the load
(VmHWM, reset first), the growth once glibc returned freed heap (malloc_trim) and the bytes hf_prefetch page-locked;
for the load with everything pinned: its growth beyond what it page-locked (a load's own bookkeeping).

`--shape qwen3-30b-a3b`: a random bf16 model of the Qwen3-30B-A3B shape (moe.py's; 128 experts, 8 per token; 16
layers: 21.2 GB) is built on the GPU and saved the same way (each expert's tensors on their own, as the Hub's
checkpoint stores them), then loaded with every streamed expert pinned, and with the `--host-share` host budget, so
that the routed experts of the layers beyond it stay in the files: a forward reads from them the experts its router
picked that the host expert cache does not hold. Every experts module picks uniformly at random (tests/routing.py's
"random" regime, the same hooks on the three models: the picks are a function of the hidden states, so the tokens
stay comparable); the router's own picks on a random model repeat with its greedy tokens, and any cache would look
perfect. The prompt has 8 tokens, within the experts' `routed_max_tokens` (12 for this shape), so that the prefill
routes too. Each system runs a generate of a few tokens before the pairs; s/token and the counters per token (link
bytes, bytes read from the files, host expert cache hits and misses: `hf_prefetch.stats`, reset before each
generate) are the differences between a generate of 16 tokens and one of 4, which leaves the prefill out. bound =
max(all-on-GPU s/token, link bytes per token / pinned H2D peak, file bytes per token / the disk's direct sequential
read speed, measured as above). Prints the host expert cache's hit rate against the one uniform picks predict (its
experts over the experts in the files), the misses per token, the read rate of the files while decoding, and the
RSS growth at the load against the host budget. Last, each loaded model is reloaded from its checkpoint
(`reload_weights(model, folder)`: the one reading experts from files switches to the files again instead of writing
them) and decodes once more: the reload's time, and whether the tokens are still the reference's.

    python benchmarks/disk_tier.py [--shape 8b] [--layers 32] [--gpu-gib 8] [--host-share 0.25] [--pairs 3]
        [--folder PATH]
    python benchmarks/disk_tier.py --shape qwen3-30b-a3b [--layers 16] --gpu-gib 6 [--host-share 0.25] [--pairs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import build_model, h2d_peak_gbps, save_results  # noqa: E402
from moe import build, generate  # noqa: E402

import hf_prefetch  # noqa: E402
from hf_prefetch.host.arena import pinned_bytes  # noqa: E402
from hf_prefetch.host.read_speed import measure_read_gbps  # noqa: E402
from hf_prefetch.planning.placements import Storage  # noqa: E402
from tests.routing import control_routing  # noqa: E402

SHORT, LONG = 4, 16
SHAPES = ("8b", "qwen3-30b-a3b")
DEFAULT_LAYERS = {"8b": 32, "qwen3-30b-a3b": 16}
DEFAULT_FOLDERS = {"8b": "/tmp/hf_prefetch_disk_tier", "qwen3-30b-a3b": "/tmp/hf_prefetch_disk_tier_qwen3-30b-a3b"}
MOE_PROMPT_TOKENS = 8
# The counters of `hf_prefetch.stats` counted per decoded token; the host expert cache's are 0 where they do not exist.
COUNTERS = ("copied_bytes", "read_bytes", "host_cache_hits", "host_cache_misses")


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def measure_disk(largest: str, disk: list[float]) -> None:
    dropped = drop_page_cache()
    disk.append(measure_read_gbps(largest, 2**30))
    print(f"disk: direct sequential read {disk[-1]:.2f} GB/s; page cache dropped: {dropped}", flush=True)


def largest_shard(folder: str) -> str:
    shards = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    return max((os.path.join(folder, p) for p in shards), key=os.path.getsize)


def load_both(args):
    """(the largest shard, the disk speeds measured so far, the host budget, the RSS growth of the load with files,
    that model, its plan, the model with every streamed tensor pinned): the two loads of `args.folder`."""
    largest = largest_shard(args.folder)
    disk = []
    measure_disk(largest, disk)
    gpu = {0: f"{args.gpu_gib}GiB"}
    streamed = hf_prefetch.plan(args.folder, device="cuda", max_memory=gpu).streamed_bytes_per_forward
    host = int(streamed * args.host_share)
    _trimmed_rss()  # freed heap returned before the baseline too, so that the trimmed growth is the load's
    before = _memory()
    peak_reset = _reset_peak()
    files = hf_prefetch.from_pretrained(args.folder, device="cuda", max_memory={**gpu, "cpu": host})
    rss = _grown(before, _memory(), peak_reset)  # before the other load: the host memory the load with files added
    rss["trimmed"] = _trimmed_rss() - before["VmRSS"]
    print(_describe(rss), flush=True)
    plan = hf_prefetch.get_state(files).plan
    print(plan, flush=True)
    before = _memory()
    pinned = hf_prefetch.from_pretrained(args.folder, device="cuda", max_memory=gpu)
    after = _memory()
    rss["pinned_load_beyond_locked"] = after["VmRSS"] - before["VmRSS"] - (after["locked"] - before["locked"])
    print(
        f"the load with every streamed tensor pinned: RSS grew {(after['VmRSS'] - before['VmRSS']) / 2**30:.2f} GiB, "
        f"{rss['pinned_load_beyond_locked'] / 2**30:.2f} GiB beyond what it page-locked",
        flush=True,
    )
    return largest, disk, host, rss, files, plan, pinned


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


def decode_counts(model, ids) -> tuple[float, dict[str, float], torch.Tensor]:
    """(s/token, each of COUNTERS per token, tokens of the long run) over the tokens between SHORT and LONG: two
    generates, the statistics of a dispatched model reset before each, whose difference leaves out the prefill."""
    dispatched = hf_prefetch.get_state(model) is not None
    seconds, counts, out = [], [], None
    for n in (SHORT, LONG):
        if dispatched:
            hf_prefetch.reset_stats(model)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        out = generate(model, ids, n)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
        stats = hf_prefetch.stats(model) if dispatched else None
        counts.append({name: getattr(stats, name, 0) for name in COUNTERS})
    per_token = {name: (counts[1][name] - counts[0][name]) / (LONG - SHORT) for name in COUNTERS}
    return (seconds[1] - seconds[0]) / (LONG - SHORT), per_token, out


def host_cache_experts(plan) -> tuple[int, int, int] | None:
    """(experts the host expert cache holds, experts of the layers whose routed experts stay in the files, those
    layers) of `plan`; None for a plan without a host expert cache or without such layers."""
    layers = [layer for ring in plan.rings for layer in ring.streamed if getattr(layer, "experts_from_files", False)]
    if hasattr(plan, "host_cached_experts"):
        cached = plan.host_cached_experts
    elif any(hasattr(ring, "host_cached_experts") for ring in plan.rings):
        cached = sum(ring.host_cached_experts for ring in plan.rings)
    else:
        return None
    if not layers:
        return None
    return cached, sum(layer.routed[0].routing.num_experts for layer in layers), len(layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=SHAPES, default="8b")
    parser.add_argument("--layers", type=int, default=None, help="32 for 8b, 16 for qwen3-30b-a3b")
    parser.add_argument("--gpu-gib", type=float, default=8.0)
    parser.add_argument("--host-share", type=float, default=0.25)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--folder", default=None, help=f"{DEFAULT_FOLDERS['8b']}, with _qwen3-30b-a3b for that shape")
    args = parser.parse_args()
    args.layers = args.layers or DEFAULT_LAYERS[args.shape]
    args.folder = args.folder or DEFAULT_FOLDERS[args.shape]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    if args.shape == "8b":
        dense(args)
    else:
        experts(args)


def dense(args) -> None:
    torch.manual_seed(0)
    reference = build_model(args.layers, device="cuda")
    if os.path.isfile(os.path.join(args.folder, "config.json")):
        reference.load_state_dict(_loaded(args.folder))
    else:
        begin = time.perf_counter()
        reference.save_pretrained(args.folder, max_shard_size="2GB")
        print(f"saved {args.layers} layers to {args.folder} in {time.perf_counter() - begin:.1f} s", flush=True)
    gc.collect()
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    generate(reference, ids, SHORT)  # a process's first forward (CUDA's libraries loaded) before RSS is measured
    largest, disk, host, rss, files, plan, pinned = load_both(args)
    systems = {"all on GPU": reference, "every streamed layer pinned": pinned, "layers read from files": files}
    for model in systems.values():
        seconds_per_token(model, ids)  # warm-up
    samples = {name: [] for name in systems}
    tokens = {}
    links = []
    read_rates = []
    for pair in range(args.pairs):
        links.append(h2d_peak_gbps())
        measure_disk(largest, disk)
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
    print(f"waited for reads in the last pair: {stats.read_wait_seconds:.2f} s")
    print(f"{_describe(rss)}; host budget {host / 2**30:.2f} GiB (pinned {plan.host_bytes / 2**30:.2f} GiB with the "
          "staging buffers)")  # fmt: skip
    save_results("disk_tier.json", dict(rows=rows, link=link, disk=disk, rss=rss, host=host))


def experts(args) -> None:
    torch.manual_seed(0)
    reference = _moe_reference(args.layers, args.folder)
    control_routing(reference, "random")
    top_k = reference.config.num_experts_per_tok
    gc.collect()
    ids = torch.randint(3, 1000, (1, MOE_PROMPT_TOKENS), device="cuda")
    generate(reference, ids, SHORT)  # a process's first forward (CUDA's libraries loaded) before RSS is measured
    largest, disk, host, rss, files, plan, pinned = load_both(args)
    for model in (pinned, files):  # the reference's picks: the same seeds, the same hidden states
        control_routing(model, "random", device="cuda")
    systems = {"all on GPU": reference, "all experts pinned": pinned, "experts from files": files}
    for model in systems.values():
        generate(model, ids, SHORT)  # warm-up: a first forward's one-time costs, the host expert cache filled
    samples = {name: [] for name in systems}
    counts = {name: [] for name in systems}
    identical = dict.fromkeys(systems, True)
    links, want = [], None
    for pair in range(args.pairs):
        links.append(h2d_peak_gbps())
        measure_disk(largest, disk)
        for name, model in systems.items():
            seconds, per_token, out = decode_counts(model, ids)
            if name == "all on GPU":
                want = out
            identical[name] = identical[name] and torch.equal(out, want)
            samples[name].append(seconds)
            counts[name].append(per_token)
            line = f"pair {pair} {name}: {seconds:.4f} s/token"
            if model is files:
                line += (
                    f"; per token {per_token['read_bytes'] / 1e9:.3f} GB read from files, host expert cache "
                    f"{per_token['host_cache_hits']:.1f} hits, {per_token['host_cache_misses']:.1f} misses"
                )
            print(line, flush=True)
    stats = hf_prefetch.stats(files)
    link, disk_gbps = max(links), statistics.median(disk)
    resident_s = statistics.median(samples["all on GPU"])
    rows = []
    for name in systems:
        s = statistics.median(samples[name])
        moved = statistics.median(c["copied_bytes"] for c in counts[name])
        from_files = statistics.median(c["read_bytes"] for c in counts[name])
        hits = sum(c["host_cache_hits"] for c in counts[name])
        looked_up = hits + sum(c["host_cache_misses"] for c in counts[name])
        bound = max(resident_s, moved / (link * 1e9), from_files / (disk_gbps * 1e9))
        rows.append(
            dict(
                system=name,
                s_per_token=s,
                link_gb_per_token=moved / 1e9,
                disk_gb_per_token=from_files / 1e9,
                host_cache_hit_rate=hits / looked_up if looked_up else None,
                bound=bound,
                x_bound=s / bound,
                tokens_identical=identical[name],
            )
        )
    print(f"\nlink {link:.1f} GB/s, disk {disk_gbps:.2f} GB/s (direct, median of {len(disk)}: "
          f"{', '.join(f'{g:.2f}' for g in disk)}), Qwen3-30B-A3B shape ({args.layers} layers), random routing, "
          f"medians of {args.pairs}")  # fmt: skip
    print(
        f"{'system':20} {'s/token':>8} {'link GB/token':>14} {'disk GB/token':>14} {'host cache hit rate':>20} "
        f"{'bound':>8} {'x bound':>8}  tokens"
    )
    for r in rows:
        rate = "-" if r["host_cache_hit_rate"] is None else f"{r['host_cache_hit_rate']:.3f}"
        verdict = "reference" if r["system"] == "all on GPU" else "identical" if r["tokens_identical"] else "DIFFER"
        print(
            f"{r['system']:20} {r['s_per_token']:8.4f} {r['link_gb_per_token']:14.3f} {r['disk_gb_per_token']:14.3f} "
            f"{rate:>20} {r['bound']:8.4f} {r['x_bound']:8.3f}  {verdict}"
        )
    files_row = rows[-1]
    misses = statistics.median(c["host_cache_misses"] for c in counts["experts from files"])
    measured = "-" if files_row["host_cache_hit_rate"] is None else f"{files_row['host_cache_hit_rate']:.3f}"
    predicted = None
    cache = host_cache_experts(plan)
    if cache is not None:
        cached, total, layers = cache
        predicted = min(1.0, cached / total)
        print(
            f"host expert cache: {cached} of the {total} experts of the {layers} layers whose experts are read from "
            f"files; hit rate for uniform picks {predicted:.3f} ({layers * top_k * (1 - predicted):.1f} misses per "
            f"token), measured {measured} ({misses:.1f} misses per token)"
        )
    else:
        print(f"host expert cache hit rate, measured: {measured} ({misses:.1f} misses per token)")
    read_rate = files_row["disk_gb_per_token"] / files_row["s_per_token"]
    print(f"read from files while decoding: {read_rate:.2f} GB/s ({read_rate / disk_gbps:.2f}x the disk)")
    print(f"waited for reads in the last run: {stats.read_wait_seconds:.2f} s")
    print(f"{_describe(rss)}; host budget {host / 2**30:.2f} GiB (pinned {plan.host_bytes / 2**30:.2f} GiB with the "
          "staging buffers and the host expert cache)")  # fmt: skip
    reloads = _reloads({"all experts pinned": pinned, "experts from files": files}, args.folder, ids, want)
    save_results(
        "disk_tier_qwen3-30b-a3b.json",
        dict(
            args=vars(args),
            rows=rows,
            samples=samples,
            counts=counts,
            link=link,
            links=links,
            disk=disk,
            rss=rss,
            host=host,
            predicted_hit_rate=predicted,
            misses_per_token=misses,
            reloads=reloads,
        ),
    )


def _reloads(models: dict, folder: str, ids: torch.Tensor, want: torch.Tensor) -> dict:
    # `reload_weights(model, folder)` of each model from the checkpoint it was loaded from: the time, the bytes it
    # wrote (a model reading experts from files reads those from the files again instead), and whether the decode
    # after it still gives the reference's tokens.
    found = {}
    for name, model in models.items():
        torch.cuda.synchronize()
        begin = time.perf_counter()
        hf_prefetch.reload_weights(model, folder)
        seconds = time.perf_counter() - begin
        written = sum(spec.nbytes for ring in hf_prefetch.get_state(model).plan.rings for layer in ring.layers
                      for spec in layer.offloaded if spec.placement.storage is not Storage.FILE)  # fmt: skip
        _, _, out = decode_counts(model, ids)
        same = torch.equal(out, want)
        found[name] = dict(seconds=seconds, offloaded_written_gb=written / 1e9, tokens_identical=same)
        print(f"reload_weights of {name}: {seconds:.2f} s (streamed tensors written: {written / 1e9:.2f} GB; the rest "
              f"of the model too); tokens after it identical: {same}", flush=True)  # fmt: skip
    return found


def _moe_reference(layers: int, folder: str):
    # The model of `folder` where one was saved there (with as many layers), else one built on the GPU and saved.
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            saved = json.load(f)["num_hidden_layers"]
        if saved != layers:
            raise SystemExit(f"{folder} holds a model of {saved} layers, not {layers}: pass another --folder")
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda").eval()
    model = build(layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {layers} layers, {nbytes / 1e9:.1f} GB", flush=True)
    begin = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="2GB")
    print(f"saved {layers} layers to {folder} in {time.perf_counter() - begin:.1f} s", flush=True)
    return model


_MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def _memory() -> dict[str, int]:
    # The process's memory now, in bytes (/proc/self/status): resident (anonymous, file-backed and shared pages), its
    # peak since the last reset; and the bytes hf_prefetch page-locked.
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in _MEMORY_FIELDS:
                values[name] = int(rest.split()[0]) * 1024
    values["locked"] = pinned_bytes()
    return values


def _reset_peak() -> bool:
    # Linux resets VmHWM to the current RSS when "5" is written to clear_refs.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trimmed_rss() -> int:
    # RSS once glibc has returned the heap freed so far to the system (malloc_trim): what the process still uses.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _memory()["VmRSS"]


def _grown(before: dict[str, int], after: dict[str, int], peak_reset: bool) -> dict[str, int | None]:
    grown = {name: after.get(name, 0) - before.get(name, 0) for name in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    grown["peak"] = after["VmHWM"] - before["VmRSS"] if peak_reset and "VmHWM" in after else None
    grown["locked"] = after["locked"] - before["locked"]
    return grown


def _describe(rss: dict[str, int | None]) -> str:
    gib = 2**30
    peak = "not measured" if rss["peak"] is None else f"{rss['peak'] / gib:.2f} GiB above the RSS before it"
    return (
        f"RSS at the load with files: grew {rss['VmRSS'] / gib:.2f} GiB (anonymous {rss['RssAnon'] / gib:.2f}, "
        f"file-backed {rss['RssFile'] / gib:.2f}, shared {rss['RssShmem'] / gib:.2f}); peak during it {peak}; "
        f"page-locked by hf_prefetch {rss['locked'] / gib:.2f} GiB; grown once freed heap was returned "
        f"(malloc_trim) {rss['trimmed'] / gib:.2f} GiB"
    )


def _loaded(folder: str) -> dict:
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name), device="cuda"))
    return state


if __name__ == "__main__":
    main()
