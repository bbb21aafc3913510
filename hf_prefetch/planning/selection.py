"""Planning: model + config -> `OffloadPlan`, a pure description of where every parameter of the layer lists lives.

`make_plan` streams the layers of the config's stride pattern or an explicit selection (the budget planner's), and
assigns each streamed layer its slot; `make_uva_plan` maps parameters in layer order up to a size. Both start from
the one walk over candidate parameters (`layers.candidate_layers`). The planner allocates nothing, copies nothing and
never touches CUDA; `dispatch` executes the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from ..config import PrefetchConfig, UVAConfig
from .layers import CandidateLayer, candidate_layers, model_bytes, warn_unroutable
from .offload_plan import OffloadPlan
from .placements import Placement, RingPlan, Source, compressed_layout

if TYPE_CHECKING:
    from .memory import MemoryBudget

__all__ = ["make_plan", "make_uva_plan", "ring_plan", "plan_of", "offload_params_error"]


def make_plan(
    model: nn.Module,
    config: PrefetchConfig,
    layers: str | Sequence[str] | None = None,
    *,
    streamed: Iterable[int] | Mapping[str, Iterable[int]] | None = None,
    source: Source | None = None,
    budget: MemoryBudget | None = None,
) -> OffloadPlan:
    """Decide which layers and parameters stream and which buffer slot each uses. Pure: nothing is moved.

    Args:
        model (`nn.Module`): The model; its parameters may be on the meta device.
        config (`PrefetchConfig`): The configuration.
        layers (`str` or list of `str`, *optional*): Path(s) of the layer list(s); found when omitted.
        streamed (*optional*): The layers to stream instead of the config's group pattern (whose `group_size` and
            `num_in_group` are then not used): layer indices, or `{layer list path: indices}` for a model with several
            layer lists (lists left out stream nothing).
        source, budget: Where an explicit selection came from (the budget planner passes `Source.BUDGET` and its
            budget); defaults to `Source.EXPLICIT` with `streamed`, `Source.STRIDE` without.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import PrefetchConfig
    >>> from hf_prefetch.planning.selection import make_plan
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> plan = make_plan(model, PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2))
    >>> [layer.index for layer in plan.rings[0].streamed], plan.source.value
    ([2, 3, 6, 7], 'stride')
    >>> plan = make_plan(model, PrefetchConfig(prefetch_step=2), streamed=[3, 7])
    >>> [layer.index for layer in plan.rings[0].streamed], plan.longest_run, plan.source.value
    ([3, 7], 1, 'explicit')

    ```
    """
    candidates = candidate_layers(model, config.offload_params, layers)
    if streamed is None:
        g, n = config.group_size, config.num_in_group
        selection = {path: {i for i in range(len(ring)) if i % g >= g - n} for path, ring in candidates.items()}
    else:
        selection = _check_selection(streamed, candidates)
    matched = any(
        layer.matched for path, ring in candidates.items() for layer in ring if layer.index in selection[path]
    )
    if config.offload_params and not matched:
        raise offload_params_error(model, config.offload_params, list(candidates), "offload_params")
    rings = tuple(
        ring_plan(path, ring, selection[path], config.prefetch_step, config.routed_experts, config.compress)
        for path, ring in candidates.items()
    )
    if any(layer.streamed for ring in rings for layer in ring.layers):
        warn_unroutable(candidates, config.routed_experts)
    if source is None:
        source = Source.STRIDE if streamed is None else Source.EXPLICIT
    return plan_of(model, config, rings, source, budget)


def plan_of(
    model: nn.Module,
    config: PrefetchConfig | UVAConfig,
    rings: tuple[RingPlan, ...],
    source: Source,
    budget: MemoryBudget | None = None,
    cached_experts: int | None = None,
) -> OffloadPlan:
    """The plan of `rings`: everything that is not offloaded (outside the layer lists too) is resident; the expert
    cache holds the config's `expert_cache` experts per routed layer, or `cached_experts` (the budget planner's)."""
    offloaded = sum(ring.offloaded_bytes for ring in rings)
    if cached_experts is None:
        cached_experts = getattr(config, "expert_cache", None) or 0
    plan = OffloadPlan(config, rings, model_bytes(model) - offloaded, source, budget, cached_experts=cached_experts)
    if plan.cached_experts and plan.routed_max_tokens == 0:  # no forward routes: a cache would never be read
        plan = dataclasses.replace(plan, cached_experts=0)
    return plan


def ring_plan(
    path: str,
    layers: list[CandidateLayer],
    selected: set[int],
    prefetch_step: int,
    routed: bool | None = None,
    compress: bool = False,
) -> RingPlan:
    """The ring of one layer list with the movable parameters of the `selected` layers streamed (expert tensors
    ROUTED where `routed`), and its slots. With `compress`, the STREAMED parameters of layers that take turns in a
    slot are kept compressed where the codec saves bytes on them (a layer alone in its slot is copied once)."""
    planned = [
        layer.placed(Placement.STREAMED, layer.streamable(), routed) if layer.index in selected else layer.resident()
        for layer in layers
    ]
    streamed_at = [i for i, layer in enumerate(planned) if layer.streamed]
    n = len(streamed_at)
    num_slots = min(prefetch_step, n)
    for k, i in enumerate(streamed_at):
        slot = k % num_slots
        # [Note: slot reuse] in runtime/ring.py: the next streamed layer after k, cyclically, that uses the same slot:
        # k + num_slots while it exists, else the first layer of the next pass with this slot (k itself when it is
        # alone there).
        next_k = k + num_slots if k + num_slots < n else slot
        planned[i] = replace(planned[i], position=k, slot=slot, next_in_slot=next_k)
        if compress and next_k != k:
            params = tuple(replace(p, compressed=compressed_layout(p)) for p in planned[i].params)
            planned[i] = replace(planned[i], params=params)
    return RingPlan(path, tuple(planned), num_slots)


def make_uva_plan(model: nn.Module, config: UVAConfig, layers: str | Sequence[str] | None = None) -> OffloadPlan:
    """Choose the parameters UVA keeps in host memory (`Placement.MAPPED`). Pure: nothing is moved.

    The parameters of the layer lists are visited in layer order (each layer's in `named_parameters` order); those
    `config.cpu_offload_params` matches are taken while fewer than `config.cpu_offload_gb` GiB are taken, so the last
    one taken may cross the limit. A parameter reachable under two names is taken once (all its names see the
    mapping).

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import UVAConfig
    >>> from hf_prefetch.planning.selection import make_uva_plan
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=30_000 / 2**30, cpu_offload_params={"mlp"}))
    >>> for layer in plan.rings[0].layers:
    ...     print(layer.path, [spec.name for spec in layer.offloaded])
    model.layers.0 ['mlp.gate_proj.weight', 'mlp.up_proj.weight', 'mlp.down_proj.weight']
    model.layers.1 ['mlp.gate_proj.weight']
    model.layers.2 []
    model.layers.3 []
    >>> plan.offloaded_bytes  # 4 matrices of 32 x 64 float32: the 4th crossed 30,000 bytes
    32768

    ```
    """
    candidates = candidate_layers(model, config.cpu_offload_params, layers)
    if config.cpu_offload_params and not any(layer.matched for ring in candidates.values() for layer in ring):
        raise offload_params_error(model, config.cpu_offload_params, list(candidates), "cpu_offload_params")
    limit_bytes = config.cpu_offload_gb * 2**30
    taken_bytes = 0
    taken: set[int] = set()
    rings = []
    for path, ring in candidates.items():
        planned = []
        for layer in ring:
            chosen = set()
            for candidate in layer.params:
                if candidate.matched and taken_bytes < limit_bytes and id(candidate.param) not in taken:
                    chosen.add(id(candidate.param))
                    taken.add(id(candidate.param))
                    taken_bytes += candidate.spec.nbytes
            planned.append(layer.placed(Placement.MAPPED, chosen))
        rings.append(RingPlan(path, tuple(planned), num_slots=0))
    return plan_of(model, config, tuple(rings), Source.SIZE)


def offload_params_error(model: nn.Module, segments: frozenset[str], paths: list[str], field: str) -> ValueError:
    examples = [name for name, _ in model.get_submodule(paths[0])[0].named_parameters()][:6]
    return ValueError(
        f"{field}={set(segments)} matched no parameter in the selected layers of {paths}; names look like "
        f"{examples}. Segments must match whole dotted parts (e.g. 'mlp' or 'down_proj')."
    )


def _check_selection(
    streamed: Iterable[int] | Mapping[str, Iterable[int]], candidates: dict[str, list[CandidateLayer]]
) -> dict[str, set[int]]:
    paths = list(candidates)
    if not isinstance(streamed, Mapping):
        if len(paths) > 1:
            raise ValueError(
                f"streamed={streamed!r} is a list of indices, but the model has {len(paths)} layer lists {paths}; "
                f"pass {{path: indices}}, e.g. streamed={{{paths[0]!r}: [1, 3]}}."
            )
        streamed = {paths[0]: streamed}
    selection: dict[str, set[int]] = {path: set() for path in paths}
    for path, indices in streamed.items():
        if path not in candidates:
            raise ValueError(f"streamed names the layer list {path!r}, which is not one of {paths}.")
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(candidates[path]):
                raise ValueError(
                    f"streamed[{path!r}] holds {index!r}; layer indices of {path} are ints from 0 to "
                    f"{len(candidates[path]) - 1}."
                )
            selection[path].add(index)
    return selection
