"""Experiment, not a feature: routed decode's recent experts copied by the copy engine, issued by the host. GPU only.

The library fetches each layer's previous picks with a kernel on the copy stream that reads host memory through the
mapped view (about 0.90 of the link), inside the CUDA graph, after the layer's slot is free; between two replays the
link carries only the ring's first layers (benchmarks/moe_profile.py's timeline: about 4 ms a token idle). This script
tries the other way: `finish` queues a copy of the picks (`recent.experts`) back to pinned host memory, and the next
routing forward's `prepare`, once that copy has landed (an event query, never a wait), copies the picked experts that
the cache does not hold into 8 extra rows after each layer's expert-cache rows, with copy-engine copies on the copy
stream, and points the cache's lookup (`slot_of`) at them: the graph's fetch skips them, as it skips cached experts,
and the gather at the router reads them from the device. After its staging, each layer's external CUDA event is
recorded on the copy stream; the gather waits for it (in the graph: a wait node). Variants:

- `off`: nothing staged (the events are recorded all the same): the library as it is.
- `firstN` / `lastN`: the first / last N streamed layers after the ring's first ones; with `-join` (`firstN-join`) the
  compute stream waits for all the staging before the forward instead of each gather for its layer's event.
- `all`: every streamed layer staged; the graph runs beside the copies, each gather after its layer's event.

The staging is Python outside the graph and the rows it writes are the cache's, so one compiled and recorded graph
serves every variant: they alternate in one process, several rounds; each variant's median is reported against the
routed-bytes bound (the picks the cache did not hold, per token, from the library's counters in the `off` runs, over
the fastest link reading) and each pair's ratio to `off`. `--timeline` records CUDA events around each staging and at
each forward's end. The extra rows are not in the plan: a GPU with room to spare.

    PYTHONPATH=. python benchmarks/experiments/moe_staged.py [--rounds 3] [--variants off first4-join all]
        [--modes greedy sampled]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import h2d_peak_gbps, static_decode  # noqa: E402
from moe import build  # noqa: E402

import hf_prefetch  # noqa: E402
import hf_prefetch.runtime.experts as experts_module  # noqa: E402
import hf_prefetch.runtime.routed as routed_module  # noqa: E402

PROMPT_TOKENS = 16
CACHE_TOKENS = PROMPT_TOKENS + 64
EXTRA_ROWS = 8  # top_k of the shape: one token's picks
SHORT, LONG = 8, 40
TIMED = False  # --timeline: CUDA events around each staging and at each forward's end
JOIN = False  # variant "join": the compute stream waits for all staging before the forward (no per-layer events)


_LIBRARY_CACHE = experts_module._expert_cache


def _cache_with_extra_rows(routed, cached_experts, device):
    # The library's cache with EXTRA_ROWS more rows after its own (which stay `capacity`: the experts it holds).
    if cached_experts <= 0:
        return None
    cache = _LIBRARY_CACHE(routed, cached_experts + EXTRA_ROWS, device)
    cache.experts = cache.experts[: min(cached_experts, routed[0].num_experts)]
    return cache


class Staging:
    """The experiment's state: which layers are staged (`layers`), the picks read back, and counts."""

    def __init__(self, engine, candidates: dict[str, list]) -> None:
        self.engine = engine
        self.candidates = candidates  # variant name -> layers
        union = []
        for layers in candidates.values():
            union += [layer for layer in layers if all(layer is not other for other in union)]
        self.union = union
        experts = union[0].recent.experts.numel()
        self.device_picks = torch.empty((len(union), experts), dtype=torch.long, device="cuda")
        self.host_picks = torch.empty((len(union), experts), dtype=torch.long, pin_memory=True)
        self.tables = {id(layer): torch.empty((2, experts), dtype=torch.long, pin_memory=True) for layer in union}
        self.layers: list = []
        # Every layer with a cache, in forward order, each with its event: recorded on the copy stream after its
        # staging (or with none) before each routing forward, waited for by its gather (in a graph: a wait node).
        self.eligible = [layer for ring in engine.rings for layer in ring.layers if layer.cache is not None]
        self.events = {id(layer): torch.cuda.Event(external=True) for layer in self.eligible}
        for event in self.events.values():
            event.record()
        self.read_back: torch.cuda.Event | None = None
        self.staged_rows = 0
        self.timeline: list[tuple[str, torch.cuda.Event]] = []  # ("begin"/"end"/"forward", event) when TIMED
        self.host_seconds = 0.0
        self.staged_forwards = 0
        self.skipped_forwards = 0

    def use(self, variant: str) -> None:
        torch.cuda.synchronize()
        for layer in self.union:  # back to the cache's own lookup
            self._table(layer, [])
            layer.cache.slot_of.copy_(self.tables[id(layer)][0])
        torch.cuda.synchronize()
        self.layers = self.candidates.get(variant, [])
        self.read_back = None

    def _table(self, layer, staged: list[int]) -> None:
        cache = layer.cache
        table = [-1] * cache.slot_of.numel()
        for row, expert in enumerate(cache.experts if cache.valid else []):  # an invalid cache's rows: not found
            table[expert] = row
        self.tables[id(layer)][0].copy_(torch.tensor(table))
        for number, expert in enumerate(staged):
            table[expert] = cache.capacity + number
        self.tables[id(layer)][1].copy_(torch.tensor(table))

    def after_forward(self) -> None:
        engine = self.engine
        if not self.layers or engine._capturing():
            return
        if TIMED:
            self.timeline.append(("forward", torch.cuda.current_stream().record_event(torch.cuda.Event(True))))
        for number, layer in enumerate(self.union):
            self.device_picks[number].copy_(layer.recent.experts)
        self.host_picks.copy_(self.device_picks, non_blocking=True)
        self.read_back = torch.cuda.current_stream().record_event()

    def before_forward(self) -> None:
        engine = self.engine
        if not engine.routing or engine._capturing():
            return
        host_begin = time.perf_counter()
        read_back, self.read_back = self.read_back, None
        ready = self.layers and read_back is not None and read_back.query()
        if self.layers and not ready:
            self.skipped_forwards += 1
        # Every kernel of the previous forward has run (the read-back followed it), and so every copy of the staging
        # before it: the tables' pinned memory and the extra rows are free.
        picks = self.host_picks.tolist() if ready else None
        index = {id(layer): number for number, layer in enumerate(self.union)}
        staged_here = {id(layer) for layer in self.layers} if ready else set()
        compute, copy = torch.cuda.current_stream(), engine.copy_stream
        copy.wait_stream(compute)
        with torch.cuda.stream(copy):
            if TIMED:
                self.timeline.append(("begin", copy.record_event(torch.cuda.Event(True))))
            for layer in self.eligible:  # in forward order: the graph waits for each layer's event at its gather
                cache = layer.cache
                if id(layer) in staged_here and cache.valid:
                    held = set(cache.experts)
                    staged: list[int] = []
                    for expert in picks[index[id(layer)]]:
                        if 0 <= expert < cache.slot_of.numel() and expert not in held and expert not in staged:
                            staged.append(expert)
                            if len(staged) == EXTRA_ROWS:
                                break
                    self._table(layer, staged)
                    cache.slot_of.copy_(self.tables[id(layer)][0], non_blocking=True)  # old staged rows: not found
                    for number, expert in enumerate(staged):
                        for tensor, cached in zip(layer.routed, cache.tensors, strict=True):
                            cached[cache.capacity + number].copy_(tensor.host[expert], non_blocking=True)
                    cache.slot_of.copy_(self.tables[id(layer)][1], non_blocking=True)  # found, once copied
                    self.staged_rows += len(staged)
                self.events[id(layer)].record(copy)
            if TIMED:
                self.timeline.append(("end", copy.record_event(torch.cuda.Event(True))))
        if JOIN:
            compute.wait_stream(copy)
        if staged_here:
            self.staged_forwards += 1
        self.host_seconds += time.perf_counter() - host_begin


def install(engine, staging: Staging) -> None:
    prepare, finish = engine.prepare, engine.finish
    gather = routed_module.gather_looked_up

    def gather_after_staging(layer, index):
        event = staging.events.get(id(layer))
        if event is not None and engine.routing:
            torch.cuda.current_stream().wait_event(event)  # in a capture: a node waiting for the host's record
        gather(layer, index)

    routed_module.gather_looked_up = gather_after_staging

    def staged_prepare(tokens=None):
        prepare(tokens)
        staging.before_forward()

    def staged_finish():
        finish()
        staging.after_forward()

    engine.prepare, engine.finish = staged_prepare, staged_finish


def seconds_per_token(model, ids, cache, sample: bool) -> tuple[float, torch.Tensor]:
    t_short, _ = static_decode(model, ids, cache, SHORT, True, sample)
    t_long, out = static_decode(model, ids, cache, LONG, True, sample)
    return (t_long - t_short) / (LONG - SHORT), out


def _timeline(timeline) -> str:
    # Medians per decode token, ms: previous forward's end -> staging begin -> staging end; staging end -> forward end.
    torch.cuda.synchronize()
    gaps, spans, tails = [], [], []
    last_forward = begin = end = None
    for kind, event in timeline:
        if kind == "forward":
            if begin is not None and end is not None and last_forward is not None:
                gaps.append(last_forward.elapsed_time(begin))
                spans.append(begin.elapsed_time(end))
                tails.append(end.elapsed_time(event))
            last_forward, begin, end = event, None, None
        elif kind == "begin":
            begin = event
        else:
            end = event
    if not spans:
        return "no staging timed"
    med = statistics.median
    return (
        f"{len(spans)} forwards: forward end -> staging begin {med(gaps):.2f} ms, staging {med(spans):.2f} ms, "
        f"staging end -> forward end {med(tails):.2f} ms"
    )


def main() -> None:
    global JOIN, TIMED
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", nargs="*", default=["off", "first4-join", "all"])
    parser.add_argument("--modes", nargs="*", default=["greedy", "sampled"])
    parser.add_argument("--timeline", action="store_true")
    args = parser.parse_args()
    TIMED = args.timeline
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    links = [h2d_peak_gbps()]
    torch.manual_seed(0)
    model = build(args.layers)
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")

    experts_module._expert_cache = _cache_with_extra_rows
    begin = time.perf_counter()
    config = hf_prefetch.PrefetchConfig(expert_cache=None)  # the budget's spare memory as the cache
    hf_prefetch.dispatch_model(model, config, max_memory={0: f"{args.budget_gib}GiB", "cpu": "120GiB"})
    torch.cuda.synchronize()
    state = hf_prefetch.get_state(model)
    engine = state.engine
    streamed = sum(len(ring.layers) for ring in engine.rings)
    print(
        f"dispatched in {time.perf_counter() - begin:.1f} s, {streamed} layers streamed, "
        f"{state.plan.cached_experts} experts cached per layer, {EXTRA_ROWS} extra rows per layer",
        flush=True,
    )
    candidates = {}
    for variant in args.variants:
        if variant == "off":
            continue
        name = variant.removesuffix("-join")
        layers = []
        for ring in engine.rings:
            eligible = [layer for layer in ring.layers[ring.num_first :] if layer.cache is not None]
            if name == "all":
                layers += [layer for layer in ring.layers if layer.cache is not None]
                continue
            where, count = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")) :])
            layers += eligible[:count] if where == "first" else eligible[-count:]
        candidates[variant] = layers
    staging = Staging(engine, candidates)
    install(engine, staging)
    row_bytes = sum(t.nbytes // t.num_experts for t in engine.rings[0].layers[0].routed)

    cache = StaticCache(config=model.config, max_cache_len=CACHE_TOKENS)
    begin = time.perf_counter()
    staging.use("off")
    seconds_per_token(model, ids, cache, False)  # compile, record
    print(f"compiled and recorded in {time.perf_counter() - begin:.1f} s", flush=True)

    results = {}
    for mode in args.modes:
        sample = mode == "sampled"
        samples = {variant: [] for variant in args.variants}
        tokens = {}
        unstaged_bytes = []
        staging.use("off")
        seconds_per_token(model, ids, cache, sample)  # a warm-up (and a compile, if the mode needs one)
        for round_number in range(args.rounds):
            for variant in args.variants:
                JOIN = variant.endswith("-join")
                staging.use(variant)
                links.append(h2d_peak_gbps())
                hf_prefetch.reset_stats(model)
                staging.staged_rows = staging.staged_forwards = staging.skipped_forwards = 0
                staging.timeline, staging.host_seconds = [], 0.0
                seconds, out = seconds_per_token(model, ids, cache, sample)
                if TIMED:
                    host_ms = staging.host_seconds * 1e3 / (SHORT + LONG)
                    print(f"{variant}: {_timeline(staging.timeline)}; host in staging {host_ms:.2f} ms/forward")
                stats = hf_prefetch.stats(model)
                forwards = (SHORT - 1) + (LONG - 1)
                if variant == "off":
                    unstaged_bytes.append((stats.routed_picks - stats.cache_hits) * row_bytes / forwards)
                samples[variant].append(seconds)
                same = tokens.setdefault(variant, out)
                print(
                    f"{mode} round {round_number} {variant}: {seconds:.4f} s/token (link {links[-1]:.1f} GB/s); "
                    f"recent hits {stats.recent_hits / max(stats.routed_picks, 1):.3f}, cache hits "
                    f"{stats.cache_hits / max(stats.routed_picks, 1):.3f}, staged rows/forward "
                    f"{staging.staged_rows / max(staging.staged_forwards, 1):.1f} in {staging.staged_forwards} "
                    f"forwards ({staging.skipped_forwards} skipped), misses {stats.misses}"
                    + ("" if torch.equal(same, out) else "; TOKENS CHANGED between rounds"),
                    flush=True,
                )
        peak = max(links)
        bound = statistics.median(unstaged_bytes) / (peak * 1e9)
        moved = statistics.median(unstaged_bytes) / 1e9
        print(f"\n{mode}: bound {bound:.4f} s/token ({moved:.2f} GB at {peak:.1f} GB/s)")
        print(f"{'variant':<10} {'s/token':>8} {'x bound':>8} {'x off':>7}  pairs (variant/off, per round)  tokens")
        for variant in args.variants:
            median = statistics.median(samples[variant])
            ratios = [s / o for s, o in zip(samples[variant], samples["off"], strict=True)]
            same = "identical to off" if torch.equal(tokens[variant], tokens["off"]) else "DIFFER from off"
            print(
                f"{variant:<10} {median:>8.4f} {median / bound:>8.3f} {statistics.median(ratios):>7.3f}  "
                f"{', '.join(f'{r:.3f}' for r in ratios)}  {same}",
                flush=True,
            )
        results[mode] = dict(bound=bound, samples=samples)
    print(f"pinned H2D peak readings: {', '.join(f'{x:.1f}' for x in links)}")


if __name__ == "__main__":
    main()
