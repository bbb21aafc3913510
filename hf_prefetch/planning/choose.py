"""`choose_plan`: the one entry of planning for the verbs: one GPU's memory budget, several GPUs' pipeline placement,
or the config's group pattern; with several host links, the other GPUs' staging buffers checked against their
`max_memory` entries."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..config import PrefetchConfig, warn_at_caller
from ..formats.bnb import check_layout
from .budget import plan_for_budget
from .file_tier import Stored
from .host_compute import host_unused, plan_host_compute
from .link_speed import measure_link_gbps
from .memory import MaxMemory, resolve_budget, resolve_budgets
from .offload_plan import OffloadPlan, compresses_nothing, format_bytes
from .pipeline import plan_pipeline
from .placements import caches_experts
from .ranks import agree, sharded_mesh
from .selection import make_plan

__all__ = ["choose_plan", "options_unused"]


def choose_plan(
    model: nn.Module,
    config: PrefetchConfig,
    layers: str | Sequence[str] | None,
    device: torch.device,
    max_memory: MaxMemory | None,
    links: tuple[int, ...] = (),
    stored: Stored | None = None,
) -> OffloadPlan:
    """The plan `dispatch_model` and the loaders execute: the config's group pattern, or the plan for a budget; with
    `links` (`links.resolve_links`), the other GPUs whose host links carry a share of every streamed layer. The
    loaders' `stored` lets a one-GPU budget's streamed layers that the host budget cannot pin stay in the
    checkpoint's files (`plan_for_budget`). A tensor-parallel model plans its rank's shards, once every rank of its
    mesh has planned (ranks.py)."""
    mesh = sharded_mesh(model)
    if mesh is not None:
        # Compared by value on every rank (a frozenset's repr, offload_params', changes with each process's hashing);
        # each rank's own block times (compute_seconds), like its max_memory, may differ.
        fingerprint = (replace(config, compute_seconds=None), layers, len(links))
        plan_share = functools.partial(_choose, model, config, layers, device, max_memory, links, stored)
        return agree(mesh, fingerprint, plan_share, device)
    return _choose(model, config, layers, device, max_memory, links, stored)


def _choose(
    model: nn.Module,
    config: PrefetchConfig,
    layers: str | Sequence[str] | None,
    device: torch.device,
    max_memory: MaxMemory | None,
    links: tuple[int, ...],
    stored: Stored | None,
) -> OffloadPlan:
    check_layout(model, device)
    if config.compute_seconds is not None and max_memory is None:
        raise ValueError(
            "PrefetchConfig.compute_seconds chooses among the plans that fit a max_memory budget, and no max_memory "
            "was given: pass max_memory (e.g. max_memory={0: '16GiB'}), or drop compute_seconds."
        )
    helpers = {index: None for index in links[1:]}
    if max_memory is not None and helpers:
        # The other links' entries bound their staging buffers; the execution device's entry plans the layers.
        for index, limit in max_memory.gpus:
            if index in helpers:
                helpers[index] = limit
        max_memory = replace(max_memory, gpus=tuple(e for e in max_memory.gpus if e[0] not in helpers))
    if max_memory is None:
        plan = make_plan(model, config, layers)
    elif len(max_memory.gpus) > 1:
        if helpers:
            raise ValueError(
                f"max_memory names the GPUs {[i for i, _ in max_memory.gpus]} for layers besides links={list(links)}: "
                "placing layers on several GPUs (pipeline placement) and sharing host links do not combine yet. "
                "Give max_memory entries only for the execution device and the GPUs of links=, or drop links=."
            )
        if config.compute_seconds is not None:
            raise ValueError(
                f"PrefetchConfig.compute_seconds plans one GPU's layers, and max_memory names the GPUs "
                f"{[i for i, _ in max_memory.gpus]} (pipeline placement). Drop compute_seconds, or give one GPU."
            )
        plan = plan_pipeline(model, resolve_budgets(max_memory, device, model), config, layers)
    else:
        # Copies overlap compute only on a GPU; on the CPU they are synchronous and the fewest bytes is fastest.
        link = None
        if config.compute_seconds is not None and device.type == "cuda":
            link = measure_link_gbps(device) * max(1, len(links))
        files = stored if not links else None  # a layer read from files goes through one link
        budget = resolve_budget(max_memory, device, model)
        plan = plan_for_budget(model, budget, config, layers, link_gbps=link, stored=files)
    if links:
        plan = replace(plan, links=links)
        for index, limit in helpers.items():
            if limit is not None and plan.staging_bytes > limit:
                raise ValueError(
                    f"max_memory[{index}] = {format_bytes(limit)} cannot hold GPU {index}'s staging buffers for "
                    f"links={list(links)}: {format_bytes(plan.staging_bytes)} ({len(links)} links, each copying "
                    f"1/{len(links)} of the largest streamed layer, twice). Raise that entry or drop the GPU from "
                    "links=."
                )
    plan = plan_host_compute(model, plan, device)
    for unused in options_unused(plan):  # once per dispatch, load or preview
        warn_at_caller(unused)
    return plan


def options_unused(plan: OffloadPlan) -> list[str]:
    """A sentence for each option of the config that changes nothing in `plan` (an option given for nothing says so).
    Where `compress=True` compresses some tensors and not others, the plan lists the plain ones, without a warning."""
    config, unused = plan.config, []
    nothing = compresses_nothing(plan)
    if nothing is not None:
        unused.append(f"PrefetchConfig(compress=True) changes nothing in this plan: {nothing}. Drop compress=True.")
    on_host = plan.host_always
    if config.expert_cache and not plan.cache_bytes:
        why = _nothing_looked_up(plan, on_host, "which needs no cache", "so a cache would never be read")
        if why is None:  # `placements.caches_experts`: a layer that shares its slot, with one experts module's tensors
            alone = all(layer.owns_slot for ring in plan.rings for layer in ring.streamed if layer.routed)
            why = "each routed layer is alone in its slot, which keeps all of its experts"
            if not alone:
                why += ", holds the tensors of several experts modules, or reads its experts from files, none of which"
                why += " get a cache"
        unused.append(
            f"PrefetchConfig(expert_cache={config.expert_cache}) keeps no expert on the device in this plan: {why}. "
            "Drop expert_cache."
        )
    fetching = any(caches_experts(layer) for ring in plan.rings for layer in ring.streamed) and not on_host
    if getattr(config, "recent_experts", None) is True and not (fetching and plan.routed_max_tokens > 0):
        why = _nothing_looked_up(plan, on_host, "so none is fetched", "so no copy fetches picks ahead")
        why = why or "each routed layer is alone in its slot, which keeps all of its experts"
        unused.append(f"PrefetchConfig(recent_experts=True) changes nothing in this plan: {why}. Drop recent_experts.")
    if (host := host_unused(plan)) is not None:
        unused.append(host)
    return unused


def _nothing_looked_up(plan: OffloadPlan, on_host: bool, host_tail: str, idle_tail: str) -> str | None:
    # Why neither an expert cache nor recent experts would be looked up, where the reason is the plan's as a whole
    # (None: the reason is its layers').
    if on_host:
        return f"with cpu_experts=True every pick of the routed layers computes on the host, {host_tail}"
    if not plan.routed_bytes:
        return "no streamed parameter is routed (no experts module streams expert by expert)"
    if plan.routed_max_tokens == 0:
        return f"with routed_max_tokens=0 no forward routes, {idle_tail}"
    return None
