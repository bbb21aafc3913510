"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`) against the link-only routed
decode. GPU only.

1. The ceiling: 1 GiB of pinned host-to-device copies, and the host's matmuls of one token through expert matrices of
   the shape (1 GiB of them), each alone and then both at once (both read host memory). The host kernels are also
   measured one by one, as the experts module's own forward on the host (transformers' `eager`, `grouped_mm` and
   `batched_mm` implementations, one token, top_k random experts): GB/s of expert bytes each.
2. Decode: a random bf16 model of a gpt-oss-20b or Qwen3-30B-A3B shape, routing at random (tests/routing.py: every
   token's picks independent of the last, chosen on the device), built on the GPU (the reference) and copied; the
   copies are dispatched at a budget of `--budget-share` of the model's bytes (about half the layers stream) as
   - "router only": `PrefetchConfig(recent_experts=False, expert_cache=0)`, the router's picks over the link,
   - "default": `PrefetchConfig()`, the link with the measured recent-experts policy and the spare expert cache,
   - "host": `cpu_experts=True`, every pick of the streamed layers computed on the host,
   - "auto": `cpu_experts="auto"`, a forward's picks split by the speeds measured at dispatch,
   and decode greedily, alternating, `--pairs` times; s/token is `(t(long) - t(short)) / (long - short)`. bound =
   max(all-on-GPU s/token, router-only bytes per token / the concurrent ceiling of step 1, link and host together).
3. Numerics of the host systems against the resident model: greedy-token agreement over `--agree` tokens (the share of
   positions before the first differing token, and of all positions) and the largest logit difference over the steps
   before the first difference; each run twice: tokens and logits bitwise the same or not. The yardsticks: the
   resident model run again (whether the GPU's own decode repeats bitwise), and with transformers' eager experts
   against its batched_mm decode (sums in another order, no host involved).
4. With `--throttle`, a background copy loop shares the link (a consumer link's speed, about half): "router only" and
   an "auto" dispatched while it runs, with the speeds it measured and the count of a token's picks it gives the host.

    python benchmarks/cpu_experts.py --shape gpt-oss-20b --layers 12 [--pairs 2] [--throttle] [--no-default]
        [--no-host]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import h2d_peak_gbps, save_results  # noqa: E402
from moe import build, generate  # noqa: E402
from moe_policy import SHAPES  # noqa: E402

import hf_prefetch  # noqa: E402
from tests.routing import control_routing  # noqa: E402

PROMPT_TOKENS = 16
GIB = 2**30


def ceiling(experts: torch.nn.Module, top_k: int) -> dict:
    """Step 1: link alone, host matmuls alone, both at once; and the experts module's own forward on the host."""
    shapes = [tuple(p.shape[1:]) for p in experts.parameters() if p.dim() == 3]
    per_expert = sum(torch.Size(s).numel() for s in shapes) * 2
    count = max(1, GIB // per_expert)
    matrices = [torch.full(s, 0.01, dtype=torch.bfloat16) for _ in range(count) for s in shapes]
    nbytes = sum(m.numel() for m in matrices) * 2

    def host_once() -> float:
        begin = time.perf_counter()
        for m in matrices:  # one token: x (1, rows) @ m (rows, cols), reads m once
            torch.matmul(torch.ones(1, m.shape[0], dtype=m.dtype), m)
        return time.perf_counter() - begin

    host_once()
    host_alone = nbytes / min(host_once() for _ in range(3)) / 1e9
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dest.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    link_alone = h2d_peak_gbps(GIB)
    stream = torch.cuda.Stream()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record()
        for _ in range(4):
            dest.copy_(pinned, non_blocking=True)
        end.record()
    host_times = [host_once() for _ in range(3)]
    end.synchronize()
    link_beside = 4 * nbytes / (begin.elapsed_time(end) / 1e3) / 1e9
    host_beside = nbytes / statistics.median(host_times) / 1e9
    kernels = {}
    module = copy.deepcopy(experts).cpu()
    hidden_size = experts.config.hidden_size
    hidden = torch.randn(1, hidden_size, dtype=torch.bfloat16)
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        module.config = copy.copy(experts.config)
        module.config._experts_implementation = implementation
        seconds = []
        for trial in range(6):
            index = torch.randperm(module.num_experts, generator=torch.Generator().manual_seed(trial))[:top_k][None]
            weights = torch.full((1, top_k), 1.0 / top_k, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            with torch.no_grad():
                type(module).forward(module, hidden, index, weights)
            seconds.append(time.perf_counter() - t0)
        kernels[implementation] = top_k * per_expert / statistics.median(seconds[1:]) / 1e9
    return dict(
        link_alone=link_alone,
        host_alone=host_alone,
        link_beside=link_beside,
        host_beside=host_beside,
        ceiling=link_beside + host_beside,
        kernels=kernels,
        threads=torch.get_num_threads(),
    )


def measure(model, ids, short: int, long: int) -> tuple[float, float, torch.Tensor]:
    """(s/token, link bytes/token, tokens of the long run) between `short` and `long` new tokens."""
    times, counted, out = [], [], None
    for n in (short, long):
        if hf_prefetch.get_state(model) is not None:
            hf_prefetch.reset_stats(model)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        out = generate(model, ids, n)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
        dispatched = hf_prefetch.get_state(model) is not None
        counted.append(hf_prefetch.stats(model).copied_bytes if dispatched else 0)
    return (times[1] - times[0]) / (long - short), (counted[1] - counted[0]) / (long - short), out


def greedy(model, ids, tokens: int):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip


def agreement(model, want, ids, tokens: int) -> dict:
    """Step 3: greedy tokens and logits against the resident model's (`want`); two runs of `model` bitwise the
    same."""
    got, again = greedy(model, ids, tokens), greedy(model, ids, tokens)
    new_want, new_got = want.sequences[0, ids.shape[1] :], got.sequences[0, ids.shape[1] :]
    same = (new_want == new_got).tolist()
    first = same.index(False) if False in same else len(same)
    largest = max(
        (
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(got.logits[: first + 1], want.logits, strict=False)
        ),
        default=0.0,
    )
    deterministic = torch.equal(got.sequences, again.sequences) and all(
        torch.equal(a, b) for a, b in zip(got.logits, again.logits, strict=True)
    )
    return dict(
        agree_before_first_difference=first / tokens,
        agree_positions=sum(same) / tokens,
        largest_logit_difference=largest,
        deterministic=deterministic,
    )


class Throttle:
    """A background copy loop on its own stream: the link shared, as a slower one. The loop waits on blocking events
    (the thread sleeps until each copy ends): a spinning wait would take one of the host's cores from the experts'
    matmuls, whose threads then all wait for the one that lost its core."""

    def __init__(self, nbytes: int = 256 * 2**20) -> None:
        self.source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dest = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.running = False

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        time.sleep(0.2)
        return self

    def _loop(self) -> None:
        done = torch.cuda.Event(blocking=True)
        while self.running:
            with torch.cuda.stream(self.stream):
                self.dest.copy_(self.source, non_blocking=True)
                self.dest.copy_(self.source, non_blocking=True)  # the next copy queued while this one runs
            done.record(self.stream)
            done.synchronize()

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=32)
    parser.add_argument("--agree", type=int, default=256)
    parser.add_argument("--throttle", action="store_true")
    parser.add_argument(
        "--no-default", action="store_true", help="leave out the default link system (router only is the link's row)"
    )
    parser.add_argument("--no-host", action="store_true", help="leave out cpu_experts=True")
    args = parser.parse_args()
    layers = args.layers or SHAPES[args.shape][2]["num_hidden_layers"]
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  shape {args.shape}, {layers} layers, "
        f"{torch.get_num_threads()} host threads",
        flush=True,
    )
    torch.manual_seed(0)
    reference = build(layers, *SHAPES[args.shape])
    top_k = reference.config.num_experts_per_tok
    experts = next(m for n, m in reference.named_modules() if n.endswith("mlp.experts"))
    limits = ceiling(experts, top_k)
    print(
        f"link alone {limits['link_alone']:.1f} GB/s, host matmuls alone {limits['host_alone']:.1f} GB/s; at once: "
        f"link {limits['link_beside']:.1f} + host {limits['host_beside']:.1f} = {limits['ceiling']:.1f} GB/s "
        f"({limits['ceiling'] / limits['link_alone']:.2f}x the link alone); the experts module's own forward on the "
        "host, one token: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in limits["kernels"].items()),
        flush=True,
    )
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    budget = int(model_bytes * args.budget_share)
    control_routing(reference, "random")
    ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), device="cuda")
    # The comparison the benchmark is for first: each system's rows print as they complete.
    configs = {
        "router only": hf_prefetch.PrefetchConfig(recent_experts=False, expert_cache=0),
        "auto": hf_prefetch.PrefetchConfig(cpu_experts="auto"),
        "default": hf_prefetch.PrefetchConfig(),
        "host": hf_prefetch.PrefetchConfig(cpu_experts=True),
    }

    def dispatched(config):
        model = copy.deepcopy(reference)
        for module in model.modules():  # the copy's own routing control, on the same seeds
            module._forward_pre_hooks.clear()
        control_routing(model, "random", device="cuda")
        hf_prefetch.dispatch_model(model, config, max_memory={0: budget, "cpu": "120GiB"}, reserve_bytes=2**30)
        return model

    models = {}
    if args.no_default:
        del configs["default"]
    if args.no_host:
        del configs["host"]
    for name, config in configs.items():
        begin = time.perf_counter()
        models[name] = dispatched(config)
        plan = hf_prefetch.get_state(models[name]).plan
        compute = plan.host_compute
        print(
            f"{name}: dispatched in {time.perf_counter() - begin:.1f} s; "
            f"{sum(len(ring.streamed) for ring in plan.rings)} of {layers} layers streamed"
            + (
                f"; host share {compute.share:.2f} (measured host {compute.host_gbps:.1f}, link "
                f"{compute.link_gbps:.1f} GB/s)"
                if compute is not None and compute.host_gbps
                else ""
            ),
            flush=True,
        )
        if compute is not None and compute.times:
            print(
                f"{name}: the host's times of one token through 1..{len(compute.times)} experts: "
                + ", ".join(f"{t * 1e3:.2f}" for t in compute.times)
                + f" ms; one expert over the link {compute.row_bytes / (compute.link_gbps * 1e9) * 1e3:.2f} ms; a "
                f"split's synchronisation {compute.sync_seconds * 1e3:.2f} ms; of {top_k} picks the host takes "
                f"{compute.count(top_k)}",
                flush=True,
            )
    for model in (reference, *models.values()):  # first calls: kernels loaded, pinned host buffers allocated
        generate(model, ids, args.short)
    samples = {name: [] for name in models}
    moved, host_rates, tokens, resident_samples = {}, {}, {}, []
    for _ in range(args.pairs):  # the resident model timed in each pair too: one difference of two runs is noisy
        seconds, _, want = measure(reference, ids, args.short, args.long)
        resident_samples.append(seconds)
        print(f"resident (all on the GPU): {seconds:.4f} s/token", flush=True)
        for name, model in models.items():
            seconds, copied, got = measure(model, ids, args.short, args.long)
            samples[name].append(seconds)
            moved[name] = copied
            stats = hf_prefetch.stats(model)
            host_rates[name] = stats.host_bytes / stats.host_seconds / 1e9 if stats.host_seconds else None
            tokens[name] = tokens.get(name, True) and torch.equal(got, want)
            rate = f", host {host_rates[name]:.1f} GB/s" if host_rates[name] else ""
            print(f"{name}: {seconds:.4f} s/token, link {copied / 1e9:.3f} GB/token{rate}", flush=True)
    resident = statistics.median(resident_samples)
    router_bytes = moved["router only"]
    bound = max(resident, router_bytes / (limits["ceiling"] * 1e9))
    best_link = min(statistics.median(samples[name]) for name in ("router only", "default") if name in samples)
    rows = []
    for name in models:
        seconds = statistics.median(samples[name])
        rows.append(
            dict(
                system=name,
                s_per_token=seconds,
                link_gb_per_token=moved[name] / 1e9,
                speedup_vs_best_link=best_link / seconds,
                x_bound=seconds / bound,
                host_gbps=host_rates[name],
                tokens_identical=tokens[name],
            )
        )
    numerics, greedy_want = {}, greedy(reference, ids, args.agree)
    # The resident model against itself: whether the GPU's own decode repeats bitwise (the last column's yardstick).
    numerics["all on the GPU, run again"] = agreement(reference, greedy_want, ids, args.agree)
    for name in [name for name in ("auto", "host") if name in models]:
        numerics[name] = agreement(models[name], greedy_want, ids, args.agree)
        print(f"{name} against the resident model: {numerics[name]}", flush=True)
    # The yardstick: the resident model itself with another of transformers' experts implementations on the GPU
    # (eager against generate's batched_mm), sums in another order with no host involved.
    eager = copy.deepcopy(reference)
    for module in eager.modules():  # the copy's own routing control, on the same seeds
        module._forward_pre_hooks.clear()
    eager.set_experts_implementation("eager")
    control_routing(eager, "random", device="cuda")
    numerics["resident, eager experts"] = agreement(eager, greedy_want, ids, args.agree)
    print(f"resident with eager experts against the resident model: {numerics['resident, eager experts']}", flush=True)
    del eager
    throttled = []
    if args.throttle:
        models.clear()  # their dispatches end as they are collected
        gc.collect()
        torch.cuda.empty_cache()
        with Throttle():
            shared_link = h2d_peak_gbps()
            slow = {"router only": dispatched(configs["router only"]), "auto": dispatched(configs["auto"])}
            times = {name: [] for name in slow}
            for _ in range(args.pairs):
                for name, model in slow.items():
                    times[name].append(measure(model, ids, args.short, args.long)[0])
                    print(f"throttled {name}: {times[name][-1]:.4f} s/token", flush=True)
            chose = hf_prefetch.get_state(slow["auto"]).plan.host_compute
        base = statistics.median(times["router only"])
        for name in slow:
            throttled.append(
                dict(
                    system=name,
                    s_per_token=statistics.median(times[name]),
                    speedup=base / statistics.median(times[name]),
                )
            )
        throttled_note = (
            f"link shared with a background copy: {shared_link:.1f} GB/s; auto measured host {chose.host_gbps:.1f}, "
            f"link {chose.link_gbps:.1f} GB/s and gives the host {chose.count(top_k)} of a token's {top_k} picks"
        )
        print(throttled_note, flush=True)
    print(f"resident (all on the GPU) {resident:.4f} s/token; bound {bound:.4f} s/token")
    print(
        "| system | s/token | link GB/token | speed-up vs best link-only | x bound | host GB/s | tokens = resident |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        host = f"{r['host_gbps']:.1f}" if r["host_gbps"] else "-"
        print(
            f"| {r['system']} | {r['s_per_token']:.4f} | {r['link_gb_per_token']:.3f} | "
            f"{r['speedup_vs_best_link']:.3f} | {r['x_bound']:.3f} | {host} | "
            f"{'identical' if r['tokens_identical'] else 'differ'} |"
        )
    print(f"| numerics over {args.agree} tokens | agree before first difference | agree positions | largest logit "
          "difference (before it) | deterministic |")  # fmt: skip
    print("|---|---:|---:|---:|---|")
    for name, n in numerics.items():
        print(
            f"| {name} | {n['agree_before_first_difference']:.3f} | {n['agree_positions']:.3f} | "
            f"{n['largest_logit_difference']:.4f} | {'yes' if n['deterministic'] else 'NO'} |"
        )
    if throttled:
        print(throttled_note)
        for r in throttled:
            print(f"throttled {r['system']:12} {r['s_per_token']:.4f} s/token ({r['speedup']:.3f}x router only)")
    save_results(
        f"cpu_experts_{args.shape}.json",
        dict(args=vars(args), ceiling=limits, rows=rows, numerics=numerics, throttled=throttled, bound=bound),
    )


if __name__ == "__main__":
    main()
