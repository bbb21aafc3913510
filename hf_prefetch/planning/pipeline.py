"""Pipeline placement planned: a model's layers in consecutive runs on several GPUs, each GPU streaming its own run's
layers.

`max_memory={0: "20GiB", 1: "20GiB", "cpu": ...}` (accelerate's format, without `links`) places the layer list as
accelerate's `device_map` does: layers 0..k-1 on GPU 0, k..n-1 on GPU 1, everything outside the layer list (embeddings,
final norm, head) on the first GPU, the execution device. Each GPU's run is planned against its own budget by the
budget planner (`plan_for_budget` with a segment) and becomes a ring of its own, on its device (`RingPlan.device`),
with its own buffer pool, copy stream and engine (runtime/devices.py). A ring's first layers are copied at the end of
the forward before, so a GPU's first streamed layers are in place while the GPUs before it compute.

This module plans; lifecycle/attach.py changes the model (it moves each run's tensors to its GPU and hooks each layer
to move its inputs there). It knows nothing about streams or slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..config import PrefetchConfig
from .layers import candidate_layers, model_bytes
from .offload_plan import OffloadPlan, format_bytes
from .placements import RingPlan, Source
from .selection import offload_params_error, plan_of

__all__ = ["plan_pipeline", "split_layers", "device_map", "ring_device", "home_of"]


def split_layers(layer_bytes: Sequence[int], capacity: Sequence[int]) -> list[range]:
    """Consecutive runs of layers, one per device, each device's share of the layers' bytes as close as the layers
    allow to its share of `capacity`; every run has at least one layer.

    Example:

    ```python
    >>> from hf_prefetch.planning.pipeline import split_layers
    >>> split_layers([1] * 8, [1, 1]), split_layers([1] * 8, [3, 1]), split_layers([1, 1, 1], [100, 1])
    ([range(0, 4), range(4, 8)], [range(0, 6), range(6, 8)], [range(0, 2), range(2, 3)])

    ```
    """
    n, m = len(layer_bytes), len(capacity)
    total_bytes, total_capacity = sum(layer_bytes), sum(capacity)
    bounds, cumulative, start = [], 0, 0
    for j in range(m - 1):
        target = total_bytes * sum(capacity[: j + 1]) / total_capacity
        end = start + 1
        cumulative += layer_bytes[start]
        # Take layers while that brings the run closer to its target; leave at least one layer for each device after.
        while end < n - (m - 1 - j) and abs(cumulative + layer_bytes[end] - target) < abs(cumulative - target):
            cumulative += layer_bytes[end]
            end += 1
        bounds.append(range(start, end))
        start = end
    bounds.append(range(start, n))
    return bounds


def plan_pipeline(
    model: nn.Module,
    budgets: Sequence[tuple[int, object]],
    config: PrefetchConfig,
    layers: str | Sequence[str] | None,
) -> OffloadPlan:
    """The plan of pipeline placement: `budgets` is each GPU's index and `MemoryBudget`, the execution device first.
    The layer list is split by `split_layers` in proportion to what each budget leaves for weights (the first GPU's
    less the weights outside the layer list); each run is planned by `plan_for_budget` against its GPU's budget."""
    from .budget import plan_for_budget  # budget.py routes multi-GPU budgets here

    candidates = candidate_layers(model, config.offload_params, layers)
    if len(candidates) != 1:
        raise ValueError(
            f"max_memory names {len(budgets)} GPUs, which places consecutive layers of one layer list on each "
            f"(pipeline placement), but {type(model).__name__} has {len(candidates)} layer lists "
            f"({', '.join(candidates)}). "
            "Give max_memory one GPU (other GPUs can still carry streamed bytes: links=[0, 1])."
        )
    ((path, ring),) = candidates.items()
    if config.offload_params and not any(layer.matched for layer in ring):
        raise offload_params_error(model, config.offload_params, [path], "offload_params")
    if len(ring) < len(budgets):
        raise ValueError(
            f"max_memory names {len(budgets)} GPUs but {path} has {len(ring)} layer(s): each GPU needs at least one. "
            "Name fewer GPUs."
        )
    layer_bytes = [model_bytes(model.get_submodule(c.path)) for c in ring]
    other = model_bytes(model) - sum(layer_bytes)
    capacity = []
    for j, (index, budget) in enumerate(budgets):
        left = budget.weights_bytes - (other if j == 0 else 0)
        if left <= 0:
            held = f" and the {format_bytes(other)} outside {path} (embeddings, head, norms)" if j == 0 else ""
            raise ValueError(
                f"{budget.source} = {format_bytes(budget.device_bytes)} leaves nothing for layers after "
                f"reserve_bytes = {format_bytes(budget.reserve_bytes)}{held}. Give GPU {index} more memory, or lower "
                "reserve_bytes."
            )
        capacity.append(left)
    host_bytes = budgets[0][1].host_bytes
    # Each run is planned for its GPU alone; the host budget holds for all of them together (checked below).
    per_gpu = [(index, replace(budget, host_bytes=None)) for index, budget in budgets]

    def plan_run(selection: PrefetchConfig, j: int, run: range) -> OffloadPlan:
        segment = (_indices(ring, run), other if j == 0 else 0)
        return plan_for_budget(model, per_gpu[j][1], selection, layers, segment=segment)

    parts = _repaired(split_layers(layer_bytes, capacity), lambda j, run: plan_run(config, j, run))
    # One selection of parameters for every run (an experts-only plan on one GPU and whole layers on another would
    # need two configs): where the runs chose differently, all are planned with the first run's.
    chosen = parts[0].config
    if any(part.config != chosen for part in parts):
        runs = [range(r.layers[0].index, r.layers[-1].index + 1) for part in parts for r in part.rings]
        parts = _repaired(runs, lambda j, run: plan_run(chosen, j, run))
    rings = tuple(replace(part.rings[0], device=index) for (index, _), part in zip(budgets, parts, strict=True))
    plan = plan_of(model, chosen, rings, Source.BUDGET, budgets[0][1])
    routed = [layer.path for ring in rings[1:] for layer in ring.streamed if layer.routed]
    if routed and plan.routed_max_tokens:
        # Routed rows are read through the arena's mapped view, which torch can only give the device it was pinned
        # under (the execution device).
        raise ValueError(
            f"Pipeline placement would route the experts of {routed[0]} (and {len(routed) - 1} more) on GPU "
            f"{rings[1].device}: routed experts stream only on the execution device for now. Pass "
            "PrefetchConfig(routed_experts=False) to stream their expert tensors whole, or use one GPU (with "
            "links=[0, 1] for the other's host link)."
        )
    if host_bytes is not None and plan.host_bytes > host_bytes:
        raise ValueError(
            f"The GPUs' runs of layers pin {format_bytes(plan.host_bytes)} of host memory in all, more than "
            f"max_memory['cpu'] = {format_bytes(host_bytes)}. Raise max_memory['cpu'] to at least "
            f"{format_bytes(plan.host_bytes)}, or give the GPUs more memory."
        )
    # The expert cache lives where layers route: the runs that have routed layers (the first GPU's).
    cached = [part.cached_experts for part in parts if any(layer.routed for layer in part.rings[0].streamed)]
    return replace(plan, gpus=tuple(budgets), cached_experts=min(cached, default=0))


def _repaired(runs: list[range], plan_run) -> list[OffloadPlan]:
    """Each run planned (`plan_run(j, run)`); where GPU j's run does not fit its budget, the same with that run one
    layer shorter (the layer going to the next run, or the previous for the last), while every run keeps a layer. The
    first error when no split fits."""
    lengths = [len(run) for run in runs]
    first_error, seen = None, set()
    while tuple(lengths) not in seen:  # a split tried before: moving layers goes round in circles
        seen.add(tuple(lengths))
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        parts = []
        for j, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            try:
                parts.append(plan_run(j, range(start, start + n)))
            except ValueError as error:
                first_error = first_error or error
                if lengths[j] <= 1 or len(lengths) == 1:
                    raise first_error from None
                lengths[j] -= 1
                lengths[j + 1 if j + 1 < len(lengths) else j - 1] += 1
                break
        else:
            return parts
    raise first_error


def _indices(ring: list, run: range) -> range:
    # The layer indices of positions `run` of a layer list's candidates.
    return range(ring[run.start].index, ring[run.stop - 1].index + 1)


def ring_device(ring: RingPlan, device: torch.device) -> torch.device:
    """Where a ring's layers live and compute: its GPU with pipeline placement, else the execution `device`. On the CPU
    (planned as if it were each GPU) every ring stays there."""
    return device if ring.device is None or device.type != "cuda" else torch.device("cuda", ring.device)


def home_of(plan: OffloadPlan, device: torch.device):
    """A function from a parameter's or buffer's full name to the device it stays on when resident: its layer's ring's
    device, or the execution `device` for everything outside the layer lists."""
    layers = {layer.path: ring_device(ring, device) for ring in plan.rings for layer in ring.layers}

    def home(name: str) -> torch.device:
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            found = layers.get(".".join(parts[:end]))
            if found is not None:
                return found
        return device

    return home


def device_map(plan: OffloadPlan, model: nn.Module, first: int) -> dict[str, int]:
    """accelerate's `hf_device_map` of a pipeline placement: each layer of the layer list on its ring's GPU, every
    other module on `first` (the modules beside each ancestor of the layer list, named as high up as possible)."""
    path = plan.rings[0].path
    result: dict[str, int] = {}
    parts = path.split(".")
    for depth in range(len(parts)):
        parent = model.get_submodule(".".join(parts[:depth]))
        prefix = ".".join(parts[:depth])
        for name, _ in parent.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if name != parts[depth]:
                result[full] = first
    for ring in plan.rings:
        for layer in ring.layers:
            result[layer.path] = ring.device if ring.device is not None else first
    for name, _ in model.named_parameters(recurse=False):
        result[name] = first
    return result


