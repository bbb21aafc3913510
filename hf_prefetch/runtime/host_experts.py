"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`): the experts module's own forward
run on its host storage, beside the device's work ([Note: experts on the host]
A streamed layer whose experts compute on the host keeps its routed tensors in host storage as every routed layer
does. When its experts module is called (its `RoutedHook`, eager), the engine's `experts_on_host`:
1. Reads the router's choice, the routing weights and the hidden states into host memory: one synchronisation with
   the compute stream, after the layer's wait.
2. Splits the picked experts, as a function of the forward's picks alone (never of what the device holds, which
   changes from run to run: the same input gives the same output every run of the dispatched model; another
   dispatch measures the host anew and may split differently). With `cpu_experts=True` all of them go
   to the host, in every forward; on a CPU device (no link) too. With `"auto"` beside a GPU, of a forward's n
   distinct picks the host takes the count k that finishes soonest (the plan's `HostCompute.count`): `sync +
   max(host(k), (n - k) * row / link)` against `n * row / link` over the link alone, from the host's times measured
   at planning (`planning/host_compute.measure_host_times`: the experts module's own forward of one token through k
   experts on a twin of it, beside the link's copies, its fixed cost included) and the link's speed measured beside
   them; k = 0 gathers over the link as without cpu_experts. A
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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..planning.host_compute import HOST_IMPLEMENTATION, host_twin
from ..planning.host_split import HostCompute, expected_picks
from ..planning.placements import Routing

__all__ = ["HostExperts", "HostSplit", "locate"]


@dataclass
class HostSplit:
    """One call's host part, computed: its `result`; `host_rows` and `device_rows` are the tokens each side computed
    (`device_rows` None: the device computed none), of the call's `tokens`."""

    result: torch.Tensor | None
    host_rows: torch.Tensor
    device_rows: torch.Tensor | None
    tokens: int


class HostExperts:
    """One experts module whose routed experts compute on the host: its twin on host storage, the plan's
    `HostCompute` that says how many of a forward's picks the host takes, and the host part of the call under way."""

    def __init__(
        self,
        module: nn.Module,
        host_params: dict[str, torch.Tensor],
        compute: HostCompute,
        routing: Routing,
        device: torch.device,
    ) -> None:
        self.forward: Callable[..., torch.Tensor] = type(module).forward
        # Beside a GPU the twin keeps the host's experts implementation ([Note: experts on the host], step 4).
        self.twin = host_twin(module, host_params, HOST_IMPLEMENTATION if device.type != "cpu" else None)
        # The module's parameters as dispatched (each pointing at its slot): one assigned anew since computes with its
        # new value, which host storage does not hold yet ([Note: weights in place]), so the module runs on the device.
        self._dispatched = [(name, param, param.data_ptr()) for name, param in module.named_parameters()]
        self.num_experts = int(module.num_experts)
        self.compute = compute
        self.top_k = routing.top_k  # the router's picks per token (None: unknown, counted as every expert)
        self.row_bytes = sum(t.nbytes for t in host_params.values()) // self.num_experts
        self.pending: HostSplit | None = None

    @property
    def always(self) -> bool:
        """Every pick on the host, in every forward (`cpu_experts=True`)."""
        return self.compute.always

    def count(self, n: int) -> int:
        """Of a forward's n distinct picks, how many the host computes ([Note: experts on the host], step 2)."""
        return self.compute.count(n, self.row_bytes)

    def splits(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens is predicted to compute any pick on the host: False skips the host's
        synchronisation (the picks are then gathered over the link)."""
        if self.always or not self.compute.times:
            return True
        return self.count(expected_picks(self.num_experts, self.top_k, tokens)) > 0

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


def locate(args: tuple, kwargs: dict, index_arg: str) -> tuple[Any, Any, Any]:
    """The experts module's (hidden states, router's choice, routing weights) from its call's arguments."""
    names = ("hidden_states", index_arg)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    index = kwargs.get(index_arg, args[1] if len(args) > 1 else None)
    weights = args[2] if len(args) > 2 else next((v for k, v in kwargs.items() if k not in names), None)
    return hidden, index, weights
