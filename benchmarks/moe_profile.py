"""Where a compiled routed-experts decode token's time goes: a kernel timeline of CUDA-graph replays. GPU only.

The model, budget and compile of `moe_compiled.py` (seed 0): first all on the GPU (skip with `--no-resident`), then
dispatched with routed experts and recent experts (the budget's spare memory as the expert cache unless `--no-cache`).
After a compiled warm-up and an unprofiled timing, one `generate` of each runs under torch.profiler. A replay's
kernels are found by its `cudaGraphLaunch`'s correlation id (the stream ids CUPTI gives a graph's kernels are not the
streams it was captured from, so the copy side is told by name: the fetch kernel and host-to-device copies). Printed
per decode token (medians): the host's launch call, the time from it to the graph's first kernel, the graph's span
(the fetch side busy, other kernels busy, nothing running), and the time between one replay's last kernel and the
next one's first (the host's work between tokens, and the eager GPU work the hooks queue then); then the kernels
taking most time, the host calls, and the eager GPU work between replays. The traces are written to $OUT
(chrome://tracing, Perfetto), and `--analyse` prints the same from a trace written before.

    PYTHONPATH=. python benchmarks/moe_profile.py [--budget-gib 24] [--tokens 24] [--no-cache] [--router-only]
    python benchmarks/moe_profile.py --analyse moe_profile_routed.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import static_decode  # noqa: E402
from moe import build  # noqa: E402

import hf_prefetch  # noqa: E402

PROMPT_TOKENS = 16


def _intervals_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _minus(spans: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    # The parts of `spans` (merged) outside `cut` (merged).
    out = []
    for start, end in spans:
        cursor = start
        for c_start, c_end in cut:
            if c_end <= cursor or c_start >= end:
                continue
            if c_start > cursor:
                out.append((cursor, c_start))
            cursor = max(cursor, c_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--no-cache", action="store_true", help="expert_cache=0 (default: the budget's spare memory)")
    parser.add_argument("--router-only", action="store_true", help="recent_experts=False")
    parser.add_argument("--no-resident", action="store_true", help="skip the all-on-GPU model's profile")
    parser.add_argument("--analyse", type=Path, help="only print the analysis of a trace written before (.json.gz)")
    args = parser.parse_args()
    if args.analyse:
        with gzip.open(args.analyse, "rt") as packed:
            analyse(json.load(packed)["traceEvents"])
        return
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    model = build(args.layers)
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    if not args.no_resident:
        profiled("all on GPU", "resident", model, ids, args.tokens)
        torch._dynamo.reset()
    config = hf_prefetch.PrefetchConfig(
        prefetch_step=2, expert_cache=0 if args.no_cache else None, recent_experts=not args.router_only
    )
    hf_prefetch.dispatch_model(model, config, max_memory={0: f"{args.budget_gib}GiB", "cpu": "120GiB"})
    state = hf_prefetch.get_state(model)
    streamed = sum(len(ring.layers) for ring in state.engine.rings)
    print(f"\n{streamed} layers streamed, {state.plan.cached_experts} experts cached per layer", flush=True)
    profiled("hf_prefetch routed experts", "routed", model, ids, args.tokens)


def profiled(title: str, name: str, model, ids: torch.Tensor, tokens: int) -> None:
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_TOKENS + tokens + 8)
    static_decode(model, ids, cache, tokens, True)  # compile and record
    short, _ = static_decode(model, ids, cache, 8, True)
    long, _ = static_decode(model, ids, cache, tokens, True)
    print(f"\n== {title}: {(long - short) / (tokens - 8):.4f} s/token unprofiled", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        static_decode(model, ids, cache, tokens, True)
    trace = Path(os.environ.get("OUT", ".")) / f"moe_profile_{name}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with gzip.open(str(trace) + ".gz", "wt") as packed:
        json.dump({"traceEvents": events}, packed)
    trace.unlink()
    analyse(events)


def analyse(events: list[dict]) -> None:
    """Print where each decode token's time went, from a chrome trace's events (see the module's docstring)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    launches = sorted((e for e in events if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"])
    # A graph's kernels carry its launch's correlation id (the stream ids of a graph's kernels are not the streams
    # it was captured from, so the copy side is told by name: the fetch kernel and host-to-device copies).
    graph_of = {e["args"]["correlation"]: number for number, e in enumerate(launches)}
    graphs = collections.defaultdict(list)
    for e in gpu:
        if e["args"].get("correlation") in graph_of:
            graphs[graph_of[e["args"]["correlation"]]].append(e)
    print(f"GPU events: {len(gpu)}; graph launches: {len(launches)}, with kernels: {len(graphs)}")
    numbers = sorted(graphs)[1:]  # the first replay follows the prefill
    if len(numbers) < 3:
        print("fewer than 3 replays in the trace: nothing to split into tokens")
        return

    def fetching(e: dict) -> bool:
        return e["name"] == "fetch_rows" or "HtoD" in e["name"]

    rows, inside, between = [], collections.Counter(), collections.Counter()
    for number, following in itertools.pairwise(numbers):
        kernels = graphs[number]
        first = min(e["ts"] for e in kernels)
        last = max(e["ts"] + e["dur"] for e in kernels)
        next_first = min(e["ts"] for e in graphs[following])
        fetch = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if fetching(e)])
        other = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not fetching(e)])
        eager = [e for e in gpu if last <= e["ts"] < next_first and e["args"].get("correlation") not in graph_of]
        rows.append(
            dict(
                launch_call=launches[number]["dur"],
                launch_to_first=first - launches[number]["ts"],
                graph=last - first,
                graph_fetch=_length(fetch),
                graph_other=_length(other),
                graph_other_only=_length(_minus(other, fetch)),
                graph_idle=last - first - _length(_intervals_union(fetch + other)),
                between=next_first - last,
                between_busy=_length(_intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in eager])),
            )
        )
        for e in kernels:
            inside[("fetch side" if fetching(e) else "other", e["name"][:60])] += e["dur"]
        for e in eager:
            between[e["name"][:60]] += e["dur"]
    tokens = len(rows)
    print(f"\n{tokens} decode tokens (graph replays); medians per token, ms:")
    notes = dict(
        launch_call="the host's cudaGraphLaunch call",
        launch_to_first="from that call to the graph's first kernel",
        graph="the graph's first kernel to its last",
        graph_fetch="  of which the fetch side busy (fetch kernels, host-to-device copies)",
        graph_other="  of which other kernels busy",
        graph_other_only="  of which other kernels busy and no fetch",
        graph_idle="  of which nothing on the GPU",
        between="the graph's last kernel to the next graph's first",
        between_busy="  of which eager GPU work (the hooks' copies, generate's ops)",
    )
    for key, note in notes.items():
        print(f"  {statistics.median(r[key] for r in rows) / 1e3:8.3f}  {note}")
    print("\nkernels inside the graphs by time per token, ms")
    for (side, name), total in inside.most_common(14):
        print(f"  {total / tokens / 1e3:8.3f}  {side:<10} {name}")
    decode_start, decode_end = launches[numbers[0]]["ts"], launches[numbers[-1]]["ts"]
    host = collections.Counter()
    for e in events:
        if (
            e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")
            and decode_start <= e.get("ts", 0) < decode_end
        ):
            host[e["name"][:60]] += e.get("dur", 0)
    print("\nhost calls during decode by time per token (nested ones counted in each), ms")
    for name, total in host.most_common(14):
        print(f"  {total / tokens / 1e3:8.3f}  {name}")
    print("\neager GPU work between graphs by time per token, ms")
    for name, total in between.most_common(8):
        print(f"  {total / tokens / 1e3:8.3f}  {name}")


if __name__ == "__main__":
    main()
