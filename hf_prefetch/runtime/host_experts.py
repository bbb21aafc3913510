"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`): the experts module's own forward
run on its host storage, beside the device's work ([Note: experts on the host]
A streamed layer whose experts compute on the host keeps its routed tensors in host storage as every routed layer
does. When its experts module is called (its `RoutedHook`, eager), the engine's `experts_on_host`:
1. Reads the router's choice, the routing weights and the hidden states into host memory: one synchronisation with
   the compute stream, after the layer's wait (so the device's view of which experts it holds, the expert cache's
   lookup and the recent picks fetched with the copy, is final too).
2. Splits the picked experts: with `cpu_experts=True` all of them go to the host, in every forward; with `"auto"`, in
   a forward that routes, the experts a GPU holds stay there and the others are split by `share`
   (`planning/host_compute.py`): the host takes as many as finish both sides soonest at that ratio of speeds
   (`host_count`), those picked by the fewest tokens (ties: the highest index), a deterministic choice of the picks
   and of what the device holds. On a CPU device nothing is held apart: every pick
   computes in one host forward, the module's own sums.
3. Starts the copy of the device's picks (only those, each once) into the slot, as a gather does: on CUDA the GPU
   reads them over the link while the host computes.
4. Computes the host's part on the calling thread: the module's own forward (`type(module).forward`) on a twin of the
   module whose parameters are the host tensors, called with the tokens that picked a host expert. Their other picks
   are replaced by one of the token's host picks with weight 0, so that the forward reads only host experts' weights
   and adds exact zeros for them. On the calling thread, with its thread count: another thread would split torch's
   CPU sums differently (and run a second OpenMP team beside the first).
5. Returns the arguments of the module's forward on the device: the tokens that picked a device expert, their host
   picks replaced the same way by a device pick, so that the device never reads a row that is not the layer's. A
   forward with no device pick runs on zero tokens.
6. After the device's forward (`experts_joined`): copies the host's result to the device and adds the device's
   result to it, row by row.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["HostExperts", "HostSplit", "host_twin", "pick_host_experts", "host_count", "split_inputs", "locate"]


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

    def __init__(self, module: nn.Module, host_params: dict[str, torch.Tensor], share: float, always: bool) -> None:
        self.forward: Callable[..., torch.Tensor] = type(module).forward
        self.twin = host_twin(module, host_params)
        # The module's parameters as dispatched (each pointing at its slot): one assigned anew since computes with its
        # new value, which host storage does not hold yet ([Note: weights in place]), so the module runs on the device.
        self._dispatched = [(name, param, param.data_ptr()) for name, param in module.named_parameters()]
        self.num_experts = int(module.num_experts)
        self.share = share
        self.always = always
        self.row_bytes = sum(t.nbytes for t in host_params.values()) // self.num_experts
        self.pending: HostSplit | None = None

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


def host_twin(module: nn.Module, host_params: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the experts module (same class, same attributes) whose parameters are the host tensors and whose
    buffers are host copies, with no hooks: the model's module keeps its slot buffers and its hooks."""
    twin = module.__class__.__new__(module.__class__)
    state = {k: v for k, v in module.__dict__.items() if k not in ("forward", "_hf_hook", "_old_forward")}
    twin.__dict__.update(copy.copy(state))
    for name in list(twin.__dict__):
        if name.startswith("_") and name.endswith("hooks") and isinstance(twin.__dict__[name], dict):
            twin.__dict__[name] = type(twin.__dict__[name])()  # no torch hooks of the model's module
    twin._parameters = {name: nn.Parameter(tensor, requires_grad=False) for name, tensor in host_params.items()}
    twin._buffers = {name: b.detach().to("cpu", copy=True) for name, b in module._buffers.items() if b is not None}
    twin._modules = dict(module._modules)  # parameterless (an activation): experts modules own every parameter
    return twin


def pick_host_experts(index: torch.Tensor, held: torch.Tensor | None, num_experts: int, share: float) -> set[int]:
    """Which picked experts the host computes ([Note: experts on the host], step 2): of the n distinct experts in
    `index` (a host tensor) that the device does not hold (`held`, a bool per expert, or None), the number k that
    finishes both sides soonest (`host_count`), those picked by the fewest tokens, ties to the highest index."""
    flat = [e for e in index.reshape(-1).tolist() if 0 <= e < num_experts]
    counts: dict[int, int] = {}
    for expert in flat:
        counts[expert] = counts.get(expert, 0) + 1
    free = [e for e in counts if held is None or not bool(held[e])]
    return set(sorted(free, key=lambda e: (counts[e], -e))[: host_count(len(free), share)])


def host_count(n: int, share: float) -> int:
    """Of n experts, how many the host computes when it reads at `share / (1 - share)` times the link's speed: the k
    whose slower side, `max(k / share, (n - k) / (1 - share))`, is fastest (n * share rounded down or up, whichever
    is; the lower on a tie)."""
    if share >= 1.0 or share <= 0.0:
        return n if share >= 1.0 else 0
    low = int(n * share)
    candidates = [k for k in (low, low + 1) if k <= n]
    return min(candidates, key=lambda k: (max(k / share, (n - k) / (1 - share)), k))


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
