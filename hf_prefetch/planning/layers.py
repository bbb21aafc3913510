"""The layer lists of a model and the one walk over their parameters that every planner starts from.

`find_layer_lists` finds the `ModuleList`s of decoder blocks; `candidate_layers` lists each layer's parameters with
their exact layout, whether the name segments select them, and whether they are shared. Pure: reads names, shapes and
dtypes (a meta model is fine); knows nothing about placements, budgets or devices.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..formats import bnb
from ..formats.parts import is_dtensor, stored_parts
from ..formats.prequantized import quant_method
from .placements import INNER_SEP, LayerPlan, ParamSpec, Placement, Routing

__all__ = [
    "find_layer_lists",
    "resolve_layer_lists",
    "segment_matches",
    "candidate_layers",
    "model_bytes",
    "experts_modules",
    "unroutable_modules",
    "warn_unroutable",
]

# The names transformers' experts modules give the argument that holds the router's choice (tokens, top_k).
_INDEX_ARGS = ("top_k_index", "router_indices", "topk_indices", "selected_experts", "routing_indices")


def find_layer_lists(model: nn.Module) -> list[str]:
    """Paths of the `ModuleList`s whose items are all instances of the model's `_no_split_modules` classes; where
    there are none (a model without `_no_split_modules`, or one whose lists hold a wrapper of the named blocks, as
    many diffusers transformers), the lists of at least two blocks of one class with parameters (not torch.nn
    layers) that hold at least an eighth of the model's parameter bytes each.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> find_layer_lists(model)
    ['model.layers']

    ```
    """
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    found = _outermost(model, lambda module: all(type(item).__name__ in block_classes for item in module))
    if not found:
        total = sum(_param_bytes(p) for p in model.parameters())
        found = _outermost(model, lambda module: _is_block_list(module, total))
    if not found:
        named = f"its _no_split_modules classes {sorted(block_classes)}" if block_classes else "blocks"
        raise ValueError(
            f"Found no layer list in {type(model).__name__}: no ModuleList holds only {named}, and none holds two or "
            "more blocks of one class with an eighth of the weights. Pass layers='path.to.list' (or a list of "
            f"paths). ModuleLists in this model: {_describe_module_lists(model)}"
        )
    return found


def _outermost(model: nn.Module, accept) -> list[str]:
    found: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        if accept(module):
            found.append(path)
    return found


def _is_block_list(module: nn.ModuleList, total_bytes: int) -> bool:
    kinds = {type(item) for item in module}
    if len(module) < 2 or len(kinds) != 1:
        return False
    kind = kinds.pop()
    if kind.__module__.startswith("torch."):  # nn.Linear lists, Sequential, ...: parts of a block, not blocks
        return False
    size = sum(_param_bytes(p) for p in module.parameters())
    return size > 0 and size * 8 >= total_bytes


def _describe_module_lists(model: nn.Module) -> str:
    lists = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            kinds = sorted({type(item).__name__ for item in m})
            lists.append(f"{path!r} ({len(m)} x {kinds[0]})" if len(kinds) == 1 else f"{path!r} ({', '.join(kinds)})")
    return ", ".join(lists[:12]) + (f" and {len(lists) - 12} more" if len(lists) > 12 else "") if lists else "none"


def resolve_layer_lists(model: nn.Module, layers: str | Sequence[str] | None) -> list[str]:
    """The layer-list paths to plan: the given ones (checked), or those `find_layer_lists` finds."""
    if layers is None:
        return find_layer_lists(model)
    paths = [layers] if isinstance(layers, str) else list(layers)
    if not paths:
        raise ValueError("layers=[] names no layer list; pass None to find them, or e.g. layers='model.layers'.")
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, nn.ModuleList):
            raise ValueError(
                f"layers={path!r} is not a ModuleList of {type(model).__name__}. "
                f"ModuleLists in this model: {_describe_module_lists(model)}"
            )
    _check_disjoint(paths, [model.get_submodule(path) for path in paths])
    return paths


def _check_disjoint(paths: list[str], lists: list[nn.Module]) -> None:
    # Two lists that share a module would plan its parameters twice (two placements, two host copies, two hooks).
    inside = [{id(module) for module in layer_list.modules()} for layer_list in lists]
    for i, j in itertools.combinations(range(len(paths)), 2):
        if not inside[i] & inside[j]:
            continue
        dropped = i if id(lists[i]) in inside[j] and lists[i] is not lists[j] else j
        if lists[i] is lists[j]:
            how = "the same ModuleList" if paths[i] == paths[j] else "one ModuleList under two names"
        elif id(lists[dropped]) in inside[i + j - dropped]:
            how = f"{paths[dropped]!r} lies inside {paths[i + j - dropped]!r}"
        else:
            how = "they share modules"
        kept = [path for k, path in enumerate(paths) if k != dropped]
        raise ValueError(
            f"layers={paths!r} names {paths[i]!r} and {paths[j]!r}, which overlap ({how}): the layers they share "
            f"would be planned, and their weights kept in host memory, twice. Name each layer list once, e.g. "
            f"layers={kept!r}."
        )


def segment_matches(segments: frozenset[str], name: str) -> bool:
    """Whether a parameter name matches one of the segments on whole dotted parts (empty segments: everything)."""
    if not segments:
        return True
    dotted = f".{name}."
    return any(f".{segment}." in dotted for segment in segments)


# `Candidate.quantized` of a tensor-parallel shard (DTensor) whose local tensor is a tensor subclass: not streamable.
SHARDED = "DTensor"


@dataclass(frozen=True)
class Candidate:
    """One parameter of a layer as the walk found it: its spec (resident) and whether it can leave the device."""

    spec: ParamSpec
    matched: bool  # the segments (offload_params / cpu_offload_params) match its name
    shared: bool  # reachable under more than one name (tied, or a module reused): it cannot live in one slot
    param: Any  # the tensor itself (its identity tells one shared tensor from another)
    # Why the module owning it looks like a mixture-of-experts experts module that cannot be routed (None: it is
    # routable, see `spec.routing`, or no experts module)
    unroutable: str | None = None
    experts: str | None = None  # path inside the layer of the experts module it belongs to
    quantized: str | None = None  # the tensor subclass holding a quantized parameter (not streamable yet)
    replaced: bool = False  # its module's forward may replace its tensor (`bnb.replaced_in_forward`): kept resident


@dataclass(frozen=True)
class CandidateLayer:
    path: str
    index: int
    params: tuple[Candidate, ...]

    @property
    def matched(self) -> bool:
        return any(c.matched for c in self.params)

    def streamable(self) -> set[int]:
        """Ids of the parameters that can stream: matched, and used under this one name only."""
        return {id(c.param) for c in self.params if c.matched and not c.shared and not c.replaced}

    def placed(self, placement: Placement, chosen: set[int], routed: bool | None = False) -> LayerPlan:
        """The layer with the parameters whose ids are in `chosen` given `placement`, the others resident. Unless
        `routed` is False, chosen expert tensors of a routable experts module are ROUTED instead; with `routed=True`
        one of an experts module that cannot be routed is refused (ValueError); with None it keeps `placement` (the
        planner warns, see `unroutable_modules`)."""
        specs = []
        for c in self.params:
            if id(c.param) not in chosen:
                specs.append(c.spec)
                continue
            if c.quantized == SHARDED:
                raise ValueError(
                    f"{self.path}.{c.spec.name} is a DTensor whose local shard is itself a tensor subclass "
                    f"({type(c.param._local_tensor).__name__}), which hf_prefetch cannot stream: it streams the "
                    "shards of tensor-parallel models whose local tensors are dense. Keep these layers resident."
                )
            if placement is Placement.MAPPED and is_dtensor(c.param):
                raise ValueError(
                    f"{self.path}.{c.spec.name.partition(INNER_SEP)[0]} is a DTensor, a shard of a tensor-parallel "
                    "model, which the UVA backend does not map. Stream it with the prefetch backend (PrefetchConfig): "
                    "each rank streams its own shards."
                )
            if c.quantized is not None:
                raise ValueError(
                    f"{self.path}.{c.spec.name} is a quantized tensor ({c.quantized}), which hf_prefetch cannot "
                    "stream or map yet: it streams dense tensors (floating-point, float8 and integer dtypes), "
                    "torchao's tensor subclasses and bitsandbytes' quantized 4-bit and 8-bit parameters "
                    "(load_in_4bit, load_in_8bit; an 8-bit one needs its scales, SCB). Quantize the model first, or "
                    "keep the quantized parameters resident: name only dense ones in offload_params / "
                    "cpu_offload_params, or select layers without them."
                )
            if placement is Placement.MAPPED and c.spec.inner:
                name = c.spec.name.partition(INNER_SEP)[0]
                raise ValueError(
                    f"{self.path}.{name} is stored as several tensors ({type(c.param).__name__}), which the UVA "
                    "backend cannot map: its kernels read tensors that torch or bitsandbytes keep on one device. "
                    "Stream it with the prefetch backend (PrefetchConfig), or keep it resident: name only dense "
                    "parameters in cpu_offload_params."
                )
            kind = placement
            if routed is not False and c.spec.routing is not None:
                kind = Placement.ROUTED
            elif routed is True and c.unroutable is not None:
                raise ValueError(
                    f"{self.path}.{c.spec.name}: {c.unroutable} hf_prefetch streams an experts module expert by "
                    "expert only when it recognises it and its tensors are not shards. Pass "
                    "PrefetchConfig(routed_experts=None) (the default) or "
                    "False to stream its tensors whole in every forward, or leave it out of offload_params."
                )
            specs.append(replace(c.spec, placement=kind))
        return LayerPlan(self.path, self.index, tuple(specs))

    def resident(self) -> LayerPlan:
        return LayerPlan(self.path, self.index, tuple(c.spec for c in self.params))


def candidate_layers(
    model: nn.Module, segments: frozenset[str], layers: str | Sequence[str] | None
) -> dict[str, list[CandidateLayer]]:
    """Every layer of every layer list with its parameters, as every planner sees them (layer list path -> layers)."""
    paths = resolve_layer_lists(model, layers)
    # A parameter reachable under two names (tied, or a module reused) cannot live in one slot: keep it resident.
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    top_k = _experts_per_token(model)
    found: dict[str, list[CandidateLayer]] = {}
    for path in paths:
        found[path] = []
        for index, layer in enumerate(model.get_submodule(path)):
            experts = experts_modules(layer, top_k)
            params = []
            for name, param in layer.named_parameters():
                matched, shared = segment_matches(segments, name), uses[id(param)] > 1
                module_path, _, attr = name.rpartition(".")
                parts = stored_parts(param, layer.get_submodule(module_path))
                if parts is not None:
                    # A tensor subclass (torchao, a DTensor) or a bitsandbytes parameter: its tensors stream
                    # together, each as a dense tensor of its own, never expert by expert (which an experts module
                    # of a tensor-parallel model says: routed_experts=True refuses it, None warns).
                    owner = _owner(name, experts) if is_dtensor(param) else None
                    sharded = "its tensors are tensor-parallel shards (DTensors)." if owner is not None else None
                    for attr, tensor in parts:
                        spec = ParamSpec(
                            f"{name}{INNER_SEP}{attr}",
                            tuple(tensor.shape),
                            _dense_stride(tensor),
                            tensor.dtype,
                            _param_bytes(tensor),
                        )
                        params.append(Candidate(spec, matched, shared, param, sharded, owner))
                    continue
                spec = ParamSpec(name, tuple(param.shape), _dense_stride(param), param.dtype, _param_bytes(param))
                owner = _owner(name, experts)
                routing = experts[owner] if owner is not None and isinstance(experts[owner], Routing) else None
                unroutable = experts[owner] if owner is not None and isinstance(experts[owner], str) else None
                spec = replace(spec, routing=routing)
                quantized = _quantized(param, model)
                replaced = bnb.replaced_in_forward(layer.get_submodule(module_path), attr)
                params.append(Candidate(spec, matched, shared, param, unroutable, owner, quantized, replaced))
            found[path].append(CandidateLayer(f"{path}.{index}", index, tuple(params)))
    return found


def unroutable_modules(candidates: dict[str, list[CandidateLayer]]) -> dict[str, str]:
    """Experts modules whose tensors can stream but not expert by expert: path -> why."""
    found = {}
    for ring in candidates.values():
        for layer in ring:
            for c in layer.params:
                if c.unroutable is not None and c.matched and not c.shared:
                    found.setdefault(f"{layer.path}.{c.experts}", c.unroutable)
    return found


def warn_unroutable(candidates: dict[str, list[CandidateLayer]], routed: bool | None) -> None:
    """With `routed_experts=None`, say which experts modules stream whole because they cannot be routed."""
    if routed is not None:
        return
    found = unroutable_modules(candidates)
    if found:
        from ..config import warn_at_caller

        first, why = next(iter(found.items()))
        warn_at_caller(
            f"{len(found)} experts module{'s' if len(found) > 1 else ''} of this model cannot be streamed expert by "
            f"expert and stream whole tensors in every forward: {why} (first: {first}). Pass "
            "PrefetchConfig(routed_experts=False) to stream every experts module whole without this warning."
        )


def _quantized(param: torch.Tensor, model: nn.Module) -> str | None:
    # A tensor subclass whose bytes are not all in plain inner tensors, or a Parameter subclass carrying quantization
    # state that `stored_parts` does not know (a bitsandbytes Int8Params or Params4bit not quantized yet).
    data = param.data if isinstance(param, nn.Parameter) else param
    if type(param) in (nn.Parameter, torch.Tensor) and type(data) is torch.Tensor:
        return None
    if is_dtensor(data):
        return SHARDED
    method = quant_method(getattr(getattr(model, "config", None), "quantization_config", None))
    name = type(data).__name__ if type(data) is not torch.Tensor else type(param).__name__
    return f"{name}, quantization method {method!r}" if method is not None else name


def experts_modules(layer: nn.Module, top_k: int | None = None) -> dict[str, Routing | str]:
    """The mixture-of-experts experts modules inside `layer`: path -> its `Routing`, or a sentence saying why a
    module that looks like one (named `experts`, or a class named `...Experts`) cannot be routed.

    Routable: an int `num_experts` > 1, every parameter of its own with `num_experts` rows in dimension 0, no
    submodule with parameters, and a forward whose second argument is the router's choice (`top_k_index`, as in
    transformers' `@use_experts_implementation` modules: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss, ...).
    """
    found: dict[str, Routing | str] = {}
    for path, module in layer.named_modules():
        name = path.rsplit(".", 1)[-1]
        # Shared experts (a dense MLP every token uses, e.g. `shared_experts`) are neither: they have no num_experts.
        looks_like = name == "experts" or (
            type(module).__name__.endswith("Experts") and hasattr(module, "num_experts")
        )
        if not looks_like or not path:
            continue
        problem = _unroutable(module)
        if problem is None:
            found[path] = Routing(path, module.num_experts, top_k, _index_arg(module))
        else:
            found[path] = f"the experts module {path!r} ({type(module).__name__}) {problem}."
    return found


def _unroutable(module: nn.Module) -> str | None:
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 2:
        return f"has no int attribute num_experts > 1 (found {experts!r}); expected fused expert tensors"
    if any(next(child.parameters(recurse=True), None) is not None for child in module.children()):
        kinds = sorted({type(child).__name__ for child in module.children()})
        return (
            f"holds its experts as submodules ({', '.join(kinds)}); expected fused tensors with one row per expert "
            "in dimension 0 (transformers >= 5 layout)"
        )
    own = dict(module.named_parameters(recurse=False))
    if not own:
        return "has no parameters of its own"
    for pname, param in own.items():
        if param.dim() < 1 or param.shape[0] != experts:
            return f"has {pname} of shape {tuple(param.shape)}; expected dimension 0 to be num_experts={experts}"
    if _index_arg(module) is None:
        return (
            f"has a forward{_signature(module)} whose second argument is not the router's choice; expected one of "
            f"{list(_INDEX_ARGS)}"
        )
    return None


def _index_arg(module: nn.Module) -> str | None:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names[1] if len(names) > 1 and names[1] in _INDEX_ARGS else None


def _signature(module: nn.Module) -> str:
    try:
        return str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        return "(?)"


def _owner(name: str, experts: dict[str, Any]) -> str | None:
    # The experts module a parameter belongs to (its own parameter, or deeper: refused above).
    for path in experts:
        if name.startswith(f"{path}."):
            return path
    return None


def _experts_per_token(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        value = getattr(source, "num_experts_per_tok", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    # Keep the parameter's own layout when it is dense (a permuted layout changes which kernels run, and so the
    # bits); anything with gaps or overlaps is stored contiguously.
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda dim: dim[1]):
        if size != 1 and stride != expected:
            return tuple(torch.empty(tensor.shape, device="meta").stride())
        expected *= size
    return tuple(tensor.stride())


def _param_bytes(tensor: torch.Tensor, module: nn.Module | None = None) -> int:
    parts = stored_parts(tensor, module)
    if parts is not None:  # stored as several tensors: their bytes (packed values, scales)
        return sum(_param_bytes(t) for _, t in parts)
    return math.prod(tensor.shape) * tensor.element_size()


def model_bytes(model: nn.Module) -> int:
    """All parameters and buffers, each counted once (a parameter with its owner: an 8-bit one's scales are in its
    module's matmul state after a forward)."""
    owned = {id(p): (p, module) for module in model.modules() for p in module.parameters(recurse=False)}
    return sum(_param_bytes(p, module) for p, module in owned.values()) + sum(_param_bytes(b) for b in model.buffers())
