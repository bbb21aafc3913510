"""The plan for a memory budget: the streamed layers chosen so that the plan fits it.

`plan_for_budget` is pure, like `make_plan`: the budget comes in as numbers (`memory.MemoryBudget`); `choose_plan`
(choose.py) resolves `max_memory` to them first. This module knows bytes and layer positions; it knows nothing
about streams, hooks or checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from torch import nn

from ..config import PrefetchConfig
from ..host.arena import HostArena
from .file_tier import Stored, experts_eligible, fewest_pinned, file_eligible, pinned_bytes, read_overflow
from .layers import candidate_layers, model_bytes, warn_unroutable
from .memory import MemoryBudget
from .offload_plan import OffloadPlan, format_bytes, host_arena_bytes
from .placements import RingPlan, Source, cache_bytes, expert_row_bytes
from .schedule import forward_seconds
from .selection import offload_params_error, plan_of, ring_plan

__all__ = ["plan_for_budget", "spread"]


class _Costs(NamedTuple):
    """One layer list's layout with its byte counts, computed once for the search over every list's layouts."""

    ring: RingPlan
    offloaded: int
    pinned: int  # its host arena's bytes (`offload_plan.host_arena_bytes`)
    held: int  # device bytes: its pool, and an explicit expert cache (one chosen from the budget takes what is left)
    per_forward: int
    per_token: int


def _costs(ring: RingPlan, explicit_cache: int) -> _Costs:
    held = ring.pool_bytes + cache_bytes((ring,), explicit_cache)
    pinned = host_arena_bytes((ring,))
    return _Costs(ring, ring.offloaded_bytes, pinned, held, ring.bytes_per_forward, ring.bytes_per_token)


def _layouts(ring: list) -> list[set[int]]:
    # The streamed layers' indices tried for one layer list: every count spread evenly (`spread`), and every count
    # spread over all but the first layer, which often holds more than the others (T5's position bias, a model's
    # first dense layers): streaming it adds its extra tensors' buffers to every slot.
    layouts = {frozenset(ring[i].index for i in spread(len(ring), s)): None for s in range(len(ring) + 1)}
    for s in range(len(ring)):
        layouts.setdefault(frozenset(ring[i + 1].index for i in spread(len(ring) - 1, s)), None)
    return [set(layout) for layout in layouts]


def spread(num_layers: int, num_streamed: int) -> list[int]:
    """Indices of `num_streamed` of `num_layers` layers, evenly strided, later layers first.

    The resident layers cut the streamed ones into `num_layers - num_streamed + 1` runs; the runs' lengths differ by
    at most one (the longer ones last), so the longest run is as short as it can be: `ceil(streamed / (resident + 1))`.

    Example:

    ```python
    >>> from hf_prefetch.planning.budget import spread
    >>> spread(8, 4), spread(8, 2), spread(8, 6), spread(16, 4)
    ([1, 3, 5, 7], [3, 7], [0, 1, 3, 4, 6, 7], [3, 7, 11, 15])

    ```
    """
    runs = num_layers - num_streamed + 1
    indices: list[int] = []
    position = 0
    for run in range(runs):
        length = (run + 1) * num_streamed // runs - run * num_streamed // runs
        indices += range(position, position + length)
        position += length + 1  # the resident layer after the run
    return indices


@dataclass(frozen=True)
class _Option:
    rings: tuple[RingPlan, ...]
    device_bytes: int
    streamed_bytes: tuple[int, int]  # per token (decoding), per forward of many tokens
    pinned_bytes: int  # the host arena's size (the rings' arenas add up: each tensor is padded on its own)
    config: PrefetchConfig  # the config the rings were selected under (its offload_params)
    candidates: dict  # layer list path -> CandidateLayers, as selected by `config`


def plan_for_budget(
    model: nn.Module,
    budget: MemoryBudget,
    config: PrefetchConfig | None = None,
    layers: str | Sequence[str] | None = None,
    segment: tuple[range, int] | None = None,
    link_gbps: float | None = None,
    stored: Stored | None = None,
) -> OffloadPlan:
    """The plan that streams the fewest bytes per forward while resident weights, the buffer pool and the reserve fit
    the device budget and the pinned bytes fit the host budget. Pure: the budget comes in as numbers.

    With `config.compute_seconds` and `link_gbps` (the link's speed, all links together), the plan that fits and
    whose forwards take the least time by `schedule.forward_seconds` instead (the fewest bytes among equal times);
    without `link_gbps` (a CPU execution device) the times are checked and the fewest bytes win.

    For each layer list, `s` streamed layers are laid out by `spread` (strided, later layers first, runs of consecutive
    streamed layers no longer than `config.prefetch_step` whenever `s <= prefetch_step * (resident + 1)`); over the
    counts `s` of every list the plan with the fewest bytes streamed per forward that fits is taken (for equal-sized
    layers: the fewest streamed layers). `config.group_size` and `config.num_in_group` are not used.

    Mixture-of-experts models whose experts route (and `offload_params` empty, `routed_experts` not False) are also
    planned streaming only their experts modules' parameters (`offload_params` = those modules' names, e.g.
    `{"experts"}`): a decoded token then moves only its experts' rows, and attention stays resident. Of the two
    selections the plan that moves the fewest bytes per token wins; its config names the selection.

    `stored` (the loaders: how the checkpoint stores each parameter): where no plan that fits the device pins little
    enough for the host budget, the last streamed layers of the fewest-bytes plan stay in the checkpoint's files
    instead (`Placement.READ`, read for every copy; their routed experts `Placement.READ_ROUTED`, read as the router
    picks them: `file_tier.read_overflow`).

    `segment` (pipeline placement, `pipeline.py`): `(layers, other_bytes)` plans only the layers whose indices are in
    `layers` (of a model's one layer list), with `other_bytes` of weights outside the layer list resident beside them.

    Raises:
        `ValueError` when even streaming every layer does not fit the device budget, or when the plans that fit it
        pin more than the host budget; the message gives the numbers and what to change.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import PrefetchConfig
    >>> from hf_prefetch.planning.budget import MemoryBudget, plan_for_budget
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> plan = plan_for_budget(model, MemoryBudget(1_300_000, reserve_bytes=100_000), PrefetchConfig(prefetch_step=2))
    >>> [layer.index for layer in plan.rings[0].streamed], plan.device_bytes <= 1_200_000
    ([1, 4, 7], True)

    ```
    """
    config = config or PrefetchConfig()
    if budget.weights_bytes <= 0:
        raise ValueError(
            f"{budget.source} = {format_bytes(budget.device_bytes)} leaves nothing for weights after "
            f"reserve_bytes = {format_bytes(budget.reserve_bytes)}, kept free for activations and the KV cache. Give "
            "the device more memory, or lower reserve_bytes."
        )
    candidates = _in_segment(candidate_layers(model, config.offload_params, layers), segment)
    # (A pipeline's run that matches nothing streams nothing; `plan_pipeline` checks the whole layer list.)
    if config.offload_params and segment is None and not any(c.matched for r in candidates.values() for c in r):
        raise offload_params_error(model, config.offload_params, list(candidates), "offload_params")
    if segment is None:
        total = model_bytes(model)
    else:
        total = segment[1] + sum(
            model_bytes(model.get_submodule(c.path)) for ring in candidates.values() for c in ring
        )
    compute = None if config.compute_seconds is None else _compute_seconds(config.compute_seconds, candidates)
    explicit_cache = config.expert_cache or 0
    selections = [(config, candidates)]
    experts = _experts_segments(config, candidates)
    if experts:
        only = replace(config, offload_params=experts)
        selections.append((only, _in_segment(candidate_layers(model, experts, layers), segment)))
    options = []
    for chosen, chosen_candidates in selections:
        # Each layer list's layouts with their byte counts, computed once (the product below sums them).
        per_ring = [
            [
                _costs(
                    ring_plan(path, ring, streamed, config.prefetch_step, config.routed_experts, config.compress),
                    explicit_cache,
                )
                for streamed in _layouts(ring)
            ]
            for path, ring in chosen_candidates.items()
        ]
        for combination in itertools.product(*per_ring):
            rings = tuple(costs.ring for costs in combination)
            offloaded = sum(costs.offloaded for costs in combination)
            pinned = sum(costs.pinned for costs in combination)
            device = total - offloaded + sum(costs.held for costs in combination)
            # Decoding (one token, routed experts copy only the experts it uses) first, then a forward of many tokens.
            per_forward = sum(costs.per_forward for costs in combination)
            per_token = sum(costs.per_token for costs in combination)
            streamed = (per_forward if config.routed_max_tokens == 0 else per_token, per_forward)
            options.append(_Option(rings, device, streamed, pinned, chosen, chosen_candidates))

    fits_device = [o for o in options if o.device_bytes <= budget.weights_bytes]
    if not fits_device:
        # The least device memory; of equals, the one that streams most (the message's "even streaming every layer").
        least = min(options, key=lambda o: (o.device_bytes, -o.pinned_bytes))
        raise _device_error(model, budget, config, candidates, total, least)
    fits = [o for o in fits_device if budget.host_bytes is None or o.pinned_bytes <= budget.host_bytes]
    if not fits and stored is not None:
        fits = _read_from_files(fits_device, budget.host_bytes, stored)
    if not fits:
        least = min(fits_device, key=lambda o: o.pinned_bytes)
        raise _host_error(budget, candidates, least, stored, fits_device)
    # Equal bytes: the whole-layer selection (listed first; min keeps the first of equals).
    best = min(fits, key=lambda o: (o.streamed_bytes, o.pinned_bytes, o.device_bytes))
    if compute is not None and link_gbps is not None:
        rate = link_gbps * 1e9
        best = min(
            fits,
            key=lambda o: (
                round(forward_seconds(o.rings, compute, rate), 9),
                o.streamed_bytes,
                o.pinned_bytes,
                o.device_bytes,
            ),
        )
    if any(layer.streamed for ring in best.rings for layer in ring.layers):
        warn_unroutable(best.candidates, config.routed_experts)
    if not any(layer.streamed for ring in best.rings for layer in ring.layers):
        best = replace(best, config=config)  # nothing streams: the selection does not matter
    cached = config.expert_cache
    if cached is None:
        per_expert = expert_row_bytes(best.rings)
        most = max(
            (s.routing.num_experts for r in best.rings for layer in r.streamed for s in layer.routed), default=0
        )
        cached = min(most, (budget.weights_bytes - best.device_bytes) // per_expert) if per_expert else 0
    return plan_of(model, best.config, best.rings, Source.BUDGET, budget, cached_experts=max(0, cached))


def _compute_seconds(pairs: tuple[tuple[str, float], ...], candidates: dict) -> dict[str, float]:
    """`PrefetchConfig.compute_seconds` checked against the layer lists: one time for every layer, no other."""
    compute = dict(pairs)
    paths = [layer.path for ring in candidates.values() for layer in ring]
    missing = [path for path in paths if path not in compute]
    unknown = sorted(set(compute) - set(paths))
    if missing or unknown:
        problem = (
            f"has no time for {len(missing)} layers ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
            if missing
            else f"names {len(unknown)} paths that are no layer of {list(candidates)} ({', '.join(unknown[:4])}"
            f"{', ...' if len(unknown) > 4 else ''})"
        )
        raise ValueError(
            f"PrefetchConfig.compute_seconds {problem}: it needs exactly one time per layer of the layer lists "
            f"{list(candidates)}. Measure them with hf_prefetch.time_layers(model, ...) on the same model."
        )
    return compute


def _in_segment(candidates: dict, segment: tuple[range, int] | None) -> dict:
    # The candidate layers of `segment`'s indices (of the one layer list), or all.
    if segment is None:
        return candidates
    return {path: [c for c in ring if c.index in segment[0]] for path, ring in candidates.items()}


def _experts_segments(config: PrefetchConfig, candidates: dict) -> frozenset[str]:
    """The names of the routable experts modules (their last path segment, e.g. "experts"), when the budget planner
    may stream only them: `offload_params` empty and routing not turned off (`routed_experts=False`, or
    `routed_max_tokens=0`: no forward routes). Empty otherwise. The choice is made before spare memory goes to an
    expert cache (`expert_cache=None`)."""
    if config.offload_params or config.routed_experts is False or config.routed_max_tokens == 0:
        return frozenset()
    return frozenset(
        c.experts.rsplit(".", 1)[-1]
        for ring in candidates.values()
        for layer in ring
        for c in layer.params
        if c.spec.routing is not None and c.experts is not None
    )


def _device_error(model, budget, config, candidates, total, least: _Option) -> ValueError:
    # `least` is the option that needs the least device memory: the message describes that plan, whatever it streams.
    size = format_bytes
    step = config.prefetch_step

    def every_layer(slots: int) -> tuple[int, int, int]:
        # Streaming every layer with `slots` slots: (device bytes, pool bytes, offloaded bytes).
        rings = [
            ring_plan(path, ring, {c.index for c in ring}, slots, config.routed_experts, config.compress)
            for path, ring in candidates.items()
        ]
        pool, offloaded = sum(r.pool_bytes for r in rings), sum(r.offloaded_bytes for r in rings)
        return total - offloaded + pool + cache_bytes(rings, config.expert_cache or 0), pool, offloaded

    pool = sum(ring.pool_bytes for ring in least.rings)
    num_layers = sum(len(ring) for ring in candidates.values())
    num_streamed = sum(len(ring.streamed) for ring in least.rings)
    kept = (
        f"{size(least.device_bytes - pool)} that stays resident (embeddings, head, norms, buffers, shared or "
        "unselected parameters)"
    )
    slots = f"prefetch_step={step} slot{'s' if step > 1 else ''} of one layer"
    every = f"all {num_layers} layers" if num_layers > 1 else "its one layer"
    if num_streamed == num_layers:
        tried = f"even streaming every layer needs {size(least.device_bytes)} on the device: {kept} and a buffer pool"
        tried += f" of {size(pool)} ({slots})."
    else:
        needs, every_pool, freed = every_layer(step)
        if num_streamed == 0:
            tried = (
                f"the least it can take on the device is all of it, {size(least.device_bytes)}, with every layer "
                "resident: streaming cannot help here, since the buffer pool that streamed layers need is at least as "
                f"large as what they free (streaming {every} needs a pool of {size(every_pool)}, "
                f"{slots}, to free {size(freed)}: {size(needs)} in all)."
            )
        else:
            tried = (
                f"the plan that needs the least device memory streams {num_streamed} of {num_layers} layers and needs "
                f"{size(least.device_bytes)}: {kept} and a buffer pool of {size(pool)} ({slots}). Streaming more "
                f"layers does not lower it (streaming {every} needs {size(needs)})."
            )
    lower, one_slot = "", every_layer(1)[0]
    if step > 1 and one_slot < least.device_bytes:  # only where fewer slots help
        lower = f"lower prefetch_step (prefetch_step=1 needs {size(one_slot + budget.reserve_bytes)} in all), "
    return ValueError(
        f"{type(model).__name__} does not fit {budget.source} = {size(budget.device_bytes)}: after "
        f"reserve_bytes = {size(budget.reserve_bytes)} for activations and the KV cache, {size(budget.weights_bytes)} "
        f"is left for weights, but {tried} "
        f"Give the device at least {size(least.device_bytes + budget.reserve_bytes)}, {lower}lower reserve_bytes, or "
        "load the model in a smaller dtype."
        + (
            f" (expert_cache={config.expert_cache} keeps {config.expert_cache} experts of every streamed layer on the "
            "device: lower it, use 0 (no cache, the default), or None to cache what the budget leaves spare.)"
            if config.expert_cache
            else ""
        )
    )


def _read_from_files(options: list[_Option], host_bytes: int, stored: Stored) -> list[_Option]:
    # The fewest-bytes plan that fits the device with its overflow read from files (`file_tier.read_overflow`).
    for option in sorted(options, key=lambda o: (o.streamed_bytes, o.device_bytes)):
        rings = read_overflow(option.rings, host_bytes, stored)
        if rings is not None:
            return [replace(option, rings=rings, pinned_bytes=pinned_bytes(rings))]
    return []


def _host_error(budget, candidates, least: _Option, stored: Stored | None, options: list[_Option]) -> ValueError:
    size = format_bytes
    layer = max(  # the host arena's bytes of a layer's streamable parameters
        HostArena.bytes_for([c.spec.nbytes for c in layer.params if id(c.param) in layer.streamable()])
        for ring in candidates.values()
        for layer in ring
    )
    num_streamed = sum(len(ring.streamed) for ring in least.rings)
    # With layers (or routed experts) read from the checkpoint's files: the least host budget that a plan fitting the
    # device accepts.
    fewest, with_reads = None, None
    if stored is not None:
        fewest, with_reads = min(((fewest_pinned(o.rings, stored), o) for o in options), key=lambda pair: pair[0])
    needed = least.pinned_bytes if fewest is None else min(least.pinned_bytes, fewest)
    with_files = f" ({needed} bytes, the rest read from the checkpoint's files)" if needed < least.pinned_bytes else ""
    return ValueError(
        f"The smallest plan that fits {budget.source} = {size(budget.device_bytes)} streams {num_streamed} layers and "
        f"pins {size(least.pinned_bytes)} of host memory, but max_memory['cpu'] allows {size(budget.host_bytes)}. "
        f"Raise max_memory['cpu'] to at least {size(needed)}{with_files}, or give the device more memory (each layer "
        f"that stays resident pins up to {size(layer)} less)."
        + _files_refused(with_reads or least, budget, stored, fewest)
    )


def _files_refused(option: _Option, budget, stored: Stored | None, fewest: int | None) -> str:
    # Why the streamed layers could not stay in the checkpoint's files instead: `option` is the plan whose reads from
    # files pin the least, `fewest` bytes (the least host budget reading from files accepts).
    if stored is None:
        return (
            " The layers that do not fit can be read from files instead: load the checkpoint with from_pretrained, "
            "or pass dispatch_model an offload_folder to write them to."
        )
    layers = [layer for ring in option.rings for layer in ring.streamed]
    whole = [layer for layer in layers if file_eligible(layer, stored)]
    experts = [layer for layer in layers if not file_eligible(layer, stored) and experts_eligible(layer, stored)]
    if not whole and not experts:
        return (
            " None of its streamed layers can be read from the checkpoint's files: each needs every offloaded tensor "
            "stored in them as the model holds it (same dtype, dense); routed experts of layers "
            "that take turns in a slot, each expert's rows stored as the model holds them."
        )
    parts = (
        [f"staging buffers for layers of up to {format_bytes(max(ly.host_bytes for ly in whole))}"] if whole else []
    )
    parts += ["a host expert cache of one token's picks"] if experts else []
    count = len(whole) + len(experts)
    what = f"up to {count} layer{'s' * (count != 1)}" + (" (or their routed experts)" if experts else "")
    return (
        f" The plan that pins the least with reads from files reads {what} from the checkpoint's files and still "
        "pins more: "
        f"{', '.join(parts)} and the layers (or parts) that cannot be read from files, {format_bytes(fewest)} in all "
        f"(max_memory['cpu'] = {format_bytes(budget.host_bytes)})."
    )
