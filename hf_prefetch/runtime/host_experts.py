"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`): the experts module's own forward
run on its host storage, beside the device's work ([Note: experts on the host]
A streamed layer whose experts compute on the host keeps its routed tensors in host storage as every routed layer
does. When its experts module is called (its `RoutedHook`, eager), the engine's `experts_on_host`:
1. Reads the router's choice, the routing weights and the hidden states into host memory: one synchronisation with
   the compute stream, after the layer's wait.
2. Splits the picked experts, as a function of the forward's picks alone (never of what the device holds, which
   changes from run to run: the same input gives the same output every run). With `cpu_experts=True` all of them go
   to the host, in every forward; on a CPU device (no link) too. With `"auto"` beside a GPU, of a forward's n
   distinct picks the host takes the count k that finishes soonest (`best_host_count`): `sync + max(host(k),
   (n - k) * row / link)` against `n * row / link` over the link alone, from the host's times measured at dispatch
   (`calibrate`: the twin's own forward of one token through k experts, beside the link's copies, its fixed cost
   included) and the link's speed measured beside them; k = 0 gathers over the link as without cpu_experts. A
   forward whose token count is predicted not to gain (`splits`) skips the host's synchronisation altogether. The
   host's picks are those picked by the fewest tokens (ties: the highest index).
3. Starts the copy of the device's picks (only those) into the slot, as a gather does (an expert cache's rows and
   recent experts fetched ahead are used where they hold a pick): on CUDA the GPU reads them over the link while the
   host computes.
4. Computes the host's part on the calling thread: the module's own forward (`type(module).forward`) on a twin of the
   module whose parameters are the host tensors, called with the tokens that picked a host expert. Beside a GPU the
   twin keeps an experts implementation of its own, `HOST_IMPLEMENTATION` where the module takes one (transformers'
   `@use_experts_implementation`): transformers' `generate` switches GPU decoding from grouped_mm to batched_mm,
   which on the host copies every picked expert's weights before it multiplies (measured on the H200 machine's
   host, one token through gpt-oss-20b's experts: grouped_mm 31.6 GB/s, eager 27.7, batched_mm 6.3). On a CPU device
   the twin reads the module's own configuration, whatever generate or the caller sets there. Their other picks
   are replaced by one of the token's host picks with weight 0, so that the forward reads only host experts' weights
   and adds exact zeros for them. On the calling thread, with its thread count: another thread would split torch's
   CPU sums differently (and run a second OpenMP team beside the first).
5. Returns the arguments of the module's forward on the device: the tokens that picked a device expert, their host
   picks replaced the same way by a device pick, so that the device never reads a row that is not the layer's. A
   forward with no device pick runs on zero tokens.
6. After the device's forward (`experts_joined`): copies the host's result to the device (through pinned memory,
   so that the host goes on issuing the next layer's work while the device's part still waits for its copies) and
   adds the device's result to it, row by row.
A module whose parameters were assigned anew since the dispatch (their new values are not in host storage yet:
[Note: weights in place]) runs on the device as with `cpu_experts=False`, and so does a call whose layer's slot
holds every expert (copied whole). A call that did not reach its end (an exception) leaves no part for the next:
each call of the module forgets the last one's first.
The host part is bitwise the module's own forward run on the host on those inputs, every run; with every pick on the
host (`cpu_experts=True`, and on a CPU device where there is no link) it is the module's forward on all of them, so on
a CPU device the result is bitwise today's. A split sums the two parts: not bitwise the resident model's result on
either side (benchmarks/cpu_experts.py reports the difference). In a CUDA-graph capture and under torch.compile the
experts are gathered over the link as before (the split needs the host to read the router's choice), and a warning
says so once.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "HOST_IMPLEMENTATION",
    "HostExperts",
    "HostSplit",
    "host_experts",
    "host_twin",
    "pick_host_experts",
    "host_count",
    "best_host_count",
    "calibrate",
    "split_inputs",
    "locate",
]

HOST_IMPLEMENTATION = "grouped_mm"
"""The experts implementation a twin beside a GPU computes with, where the experts module takes one: of transformers'
three, the fastest measured on the host ([Note: experts on the host], step 4)."""

# transformers' implementations a module with `@use_experts_implementation` takes on the host.
_SETTABLE = ("eager", "grouped_mm", "batched_mm")


@dataclass
class HostSplit:
    """One call's host part, computed: its `result`; `host_rows` and `device_rows` are the tokens each side computed
    (`device_rows` None: the device computed none), of the call's `tokens`."""

    result: torch.Tensor | None
    host_rows: torch.Tensor
    device_rows: torch.Tensor | None
    tokens: int


class HostExperts:
    """One experts module whose routed experts compute on the host: its twin on host storage, its share of the picks
    (1.0 with `always`), and the host part of the call under way."""

    def __init__(
        self,
        module: nn.Module,
        host_params: dict[str, torch.Tensor],
        share: float,
        always: bool,
        beside_gpu: bool,
        top_k: int | None = None,
    ) -> None:
        self.forward: Callable[..., torch.Tensor] = type(module).forward
        self.twin = host_twin(module, host_params, HOST_IMPLEMENTATION if beside_gpu else None)
        # The module's parameters as dispatched (each pointing at its slot): one assigned anew since computes with its
        # new value, which host storage does not hold yet ([Note: weights in place]), so the module runs on the device.
        self._dispatched = [(name, param, param.data_ptr()) for name, param in module.named_parameters()]
        self.num_experts = int(module.num_experts)
        self.share = share
        self.always = always
        self.row_bytes = sum(t.nbytes for t in host_params.values()) // self.num_experts
        self.top_k = top_k  # the router's picks per token (None: unknown, taken as 1)
        self.pending: HostSplit | None = None
        # `"auto"` beside a GPU (`calibrate`): the host's seconds of one token through k = 1, 2, ... experts, one
        # expert's row over the link, and the synchronisation a split costs. None: the count follows `share`.
        self.times: tuple[float, ...] | None = None
        self.link_row_seconds = 0.0
        self.sync_seconds = 0.0

    def count(self, n: int) -> int:
        """Of a forward's n distinct picks, how many the host computes ([Note: experts on the host], step 2)."""
        if self.always:
            return n
        if self.times is None:
            return host_count(n, self.share)
        return best_host_count(n, self.times, self.link_row_seconds, self.sync_seconds)

    def splits(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens is predicted to compute any pick on the host: False skips the host's
        synchronisation (the picks are then gathered over the link)."""
        if self.always or self.times is None:
            return True
        top_k = self.top_k or 1
        # The distinct experts `tokens` independent picks of top_k of num_experts are expected to reach.
        expected = self.num_experts * (1.0 - (1.0 - min(top_k, self.num_experts) / self.num_experts) ** tokens)
        return self.count(max(1, round(expected))) > 0

    def as_dispatched(self, module: nn.Module) -> bool:
        """Whether every parameter of the module is still the one the dispatch pointed at its slot."""
        params = module._parameters
        return all(params.get(name) is param and param.data_ptr() == ptr for name, param, ptr in self._dispatched)

    def run(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The module's own forward on the host, and its seconds."""
        begin = time.perf_counter()
        with torch.no_grad():
            out = self.forward(self.twin, hidden, index, weights)
        return out, time.perf_counter() - begin


def host_experts(
    module: nn.Module,
    host_params: dict[str, torch.Tensor],
    compute: Any,
    device: torch.device,
    measured: dict,
    routing: Any = None,
) -> HostExperts:
    """The `HostExperts` of one experts module under the plan's `compute` (its `HostCompute`: `share`, `always`,
    `link_gbps`) and `routing` (its `Routing`: `top_k`); `"auto"` beside a GPU calibrated (`calibrate`) once per
    module class and parameter shapes in `measured`, whose times the other layers of that shape share."""
    top_k = getattr(routing, "top_k", None)
    host = HostExperts(module, host_params, compute.share, compute.always, device.type != "cpu", top_k)
    link_gbps = compute.link_gbps
    if compute.always or device.type == "cpu" or not link_gbps:
        return host
    key = (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in host_params.items()))
    if key not in measured:
        calibrate(host, device, link_gbps)
        measured[key] = (host.times, host.link_row_seconds, host.sync_seconds)
    host.times, host.link_row_seconds, host.sync_seconds = measured[key]
    return host


def host_twin(module: nn.Module, host_params: dict[str, torch.Tensor], implementation: str | None = None) -> nn.Module:
    """A copy of the experts module (same class, same attributes) whose parameters are the host tensors and whose
    buffers are host copies, with no hooks: the model's module keeps its slot buffers and its hooks. With
    `implementation`, a module that takes one of transformers' experts implementations computes with it, from a
    configuration of its own (a shallow copy); otherwise the twin shares the module's configuration."""
    twin = module.__class__.__new__(module.__class__)
    state = {k: v for k, v in module.__dict__.items() if k not in ("forward", "_hf_hook", "_old_forward")}
    twin.__dict__.update(copy.copy(state))
    for name in list(twin.__dict__):
        if name.startswith("_") and name.endswith("hooks") and isinstance(twin.__dict__[name], dict):
            twin.__dict__[name] = type(twin.__dict__[name])()  # no torch hooks of the model's module
    twin._parameters = {name: nn.Parameter(tensor, requires_grad=False) for name, tensor in host_params.items()}
    twin._buffers = {name: b.detach().to("cpu", copy=True) for name, b in module._buffers.items() if b is not None}
    twin._modules = dict(module._modules)  # parameterless (an activation): experts modules own every parameter
    config = getattr(module, "config", None)
    if implementation is not None and getattr(config, "_experts_implementation", None) in _SETTABLE:
        twin.config = copy.copy(config)
        twin.config._experts_implementation = implementation
    return twin


def pick_host_experts(index: torch.Tensor, num_experts: int, count: Callable[[int], int]) -> set[int]:
    """Which picked experts the host computes ([Note: experts on the host], step 2): of the n distinct experts in
    `index` (a host tensor), `count(n)` of them, those picked by the fewest tokens, ties to the highest index."""
    flat = [e for e in index.reshape(-1).tolist() if 0 <= e < num_experts]
    counts: dict[int, int] = {}
    for expert in flat:
        counts[expert] = counts.get(expert, 0) + 1
    return set(sorted(counts, key=lambda e: (counts[e], -e))[: count(len(counts))])


def host_count(n: int, share: float) -> int:
    """Of n experts, how many the host computes when it reads at `share / (1 - share)` times the link's speed: the k
    whose slower side, `max(k / share, (n - k) / (1 - share))`, is fastest (n * share rounded down or up, whichever
    is; the lower on a tie)."""
    if share >= 1.0 or share <= 0.0:
        return n if share >= 1.0 else 0
    low = int(n * share)
    candidates = [k for k in (low, low + 1) if k <= n]
    return min(candidates, key=lambda k: (max(k / share, (n - k) / (1 - share)), k))


def best_host_count(n: int, times: tuple[float, ...], link_row_seconds: float, sync_seconds: float) -> int:
    """The k of n picked experts that the host computes to finish soonest: `sync + max(host(k), (n - k) * row)`, with
    `host(k)` the measured `times[k - 1]` (extended past them at the last step's cost), against `n * row` over the link
    alone for k = 0; the lower on a tie."""

    def host(k: int) -> float:
        if k <= len(times):
            return times[k - 1]
        step = times[-1] - times[-2] if len(times) > 1 else times[-1]
        return times[-1] + (k - len(times)) * max(step, 0.0)

    def finish(k: int) -> float:
        return n * link_row_seconds if k == 0 else sync_seconds + max(host(k), (n - k) * link_row_seconds)

    return min(range(n + 1), key=lambda k: (finish(k), k)) if times else 0


def calibrate(host: HostExperts, device: torch.device, link_gbps: float, rounds: int = 3) -> None:
    """`"auto"` beside a GPU: measures `host.times` (the twin's own forward of one token through k = 1 .. top_k
    distinct experts, the median of `rounds`, while pinned copies run to `device` as a split's copies do), the link's
    seconds per expert row at `link_gbps`, and the synchronisation a split adds (the router's choice read on the host
    and the split of its picks)."""
    twin, top_k = host.twin, min(host.top_k or 1, host.num_experts)
    param = next(iter(twin.parameters()))
    hidden_size = int(getattr(twin.config, "hidden_size", 0) or 0) if hasattr(twin, "config") else 0
    if not hidden_size:
        return  # a module without a known hidden size: the count follows `share`
    hidden = torch.full((1, hidden_size), 0.5, dtype=param.dtype)
    pinned = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(pinned.shape, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    times, start = [], 0
    with torch.no_grad(), torch.cuda.device(device):
        for k in range(1, top_k + 1):
            seconds = []
            for _ in range(rounds + 1):  # the first round warms the kernels up
                experts = [(start + j) % host.num_experts for j in range(k)]
                start += k  # other experts each round: read from memory, not from the caches
                index = torch.tensor([experts + experts[:1] * (top_k - k)])
                weights = torch.tensor([[1.0 / k] * k + [0.0] * (top_k - k)], dtype=param.dtype)
                with torch.cuda.stream(stream):
                    for _ in range(8):  # the link busy throughout (about 10 ms at 55 GB/s)
                        dest.copy_(pinned, non_blocking=True)
                seconds.append(host.run(hidden, index, weights)[1])
                stream.synchronize()
            times.append(statistics.median(seconds[1:]))
        index = torch.tensor([list(range(top_k))], device=device)
        begin = time.perf_counter()
        for _ in range(rounds):
            torch.cuda.current_stream(device).synchronize()
            index_h = torch.empty(index.shape, dtype=index.dtype, pin_memory=True).copy_(index, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            on_host = pick_host_experts(index_h, host.num_experts, lambda n: n // 2)
            split_inputs(index_h, torch.ones(index_h.shape), on_host, host.num_experts)
        sync = (time.perf_counter() - begin) / rounds
    host.times = tuple(times)
    host.link_row_seconds = host.row_bytes / (link_gbps * 1e9) if link_gbps and math.isfinite(link_gbps) else 0.0
    host.sync_seconds = sync


Side = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def split_inputs(
    index: torch.Tensor, weights: torch.Tensor, on_host: set[int], num_experts: int
) -> tuple[Side | None, Side | None]:
    """For host tensors `index` and `weights` (tokens, top_k): each side's (rows, index, weights), the rows being the
    tokens with a pick on that side, the other side's picks replaced by one of the token's picks on this side with
    weight 0 (None for a side with no pick)."""
    host_mask = torch.zeros_like(index, dtype=torch.bool)
    for expert in on_host:
        host_mask |= index == expert
    valid = (index >= 0) & (index < num_experts)
    device_mask = valid & ~host_mask
    return _side(index, weights, host_mask), _side(index, weights, device_mask)


def _side(index: torch.Tensor, weights: torch.Tensor, mine: torch.Tensor):
    rows = mine.any(dim=-1).nonzero().reshape(-1)
    if rows.numel() == 0:
        return None
    index, weights, mine = index[rows], weights[rows], mine[rows]
    first = mine.to(torch.int8).argmax(dim=-1, keepdim=True)  # a pick of this side in each row
    filler = index.gather(-1, first).expand_as(index)
    return rows, torch.where(mine, index, filler), torch.where(mine, weights, torch.zeros_like(weights))


def locate(args: tuple, kwargs: dict, index_arg: str) -> tuple[Any, Any, Any]:
    """The experts module's (hidden states, router's choice, routing weights) from its call's arguments."""
    names = ("hidden_states", index_arg)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    index = kwargs.get(index_arg, args[1] if len(args) > 1 else None)
    weights = args[2] if len(args) > 2 else next((v for k, v in kwargs.items() if k not in names), None)
    return hidden, index, weights
