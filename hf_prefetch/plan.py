"""Planning: model + `PrefetchConfig` -> `OffloadPlan`, a pure description of what streams where.

The planner reads module structure, parameter names, shapes and dtypes (a model on the meta device is fine). It
allocates nothing, copies nothing and never touches CUDA; `dispatch` executes the plan. Which layers stream is the
config's group pattern or an explicit selection (`make_plan(streamed=...)`, which `budget.plan_for_budget` uses).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import PrefetchConfig

if TYPE_CHECKING:
    from .budget import MemoryBudget

__all__ = ["OffloadPlan", "LayerPlan", "RingPlan", "ParamSpec", "find_layer_lists", "make_plan"]

PoolKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class ParamSpec:
    """One offloaded parameter: its name inside the layer and the exact layout its slot buffer needs."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    @property
    def key(self) -> PoolKey:
        # The name is part of the key so that two same-shaped parameters of one layer never share a buffer.
        return (self.name, self.shape, self.stride, self.dtype)


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a layer list: resident (no `params`) or streamed into `slot`."""

    path: str
    index: int
    params: tuple[ParamSpec, ...]
    resident_bytes: int
    slot: int | None = None
    # Position (among the ring's streamed layers) of the layer whose copy starts after this one ran: the next
    # streamed layer, in cyclic order, that uses the same slot. See [Note: slot reuse] in docs/design.md.
    next_in_slot: int | None = None

    @property
    def streamed(self) -> bool:
        return bool(self.params)

    @property
    def offloaded_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


@dataclass(frozen=True)
class RingPlan:
    """The layers of one layer list (`model.layers`, or the encoder's and the decoder's of a seq2seq model).

    Each ring prefetches cyclically through its own streamed layers with its own buffer slots.
    """

    path: str
    layers: tuple[LayerPlan, ...]
    num_slots: int

    @property
    def streamed(self) -> tuple[LayerPlan, ...]:
        return tuple(layer for layer in self.layers if layer.streamed)

    @property
    def offloaded_bytes(self) -> int:
        return sum(layer.offloaded_bytes for layer in self.layers)

    @property
    def pool_bytes(self) -> int:
        sizes: dict[PoolKey, int] = {}
        for layer in self.streamed:
            for spec in layer.params:
                sizes[spec.key] = spec.nbytes
        return sum(sizes.values()) * self.num_slots

    @property
    def streamed_bytes_per_forward(self) -> int:
        # With no more streamed layers than slots every layer keeps its own slot and nothing is copied again.
        return self.offloaded_bytes if len(self.streamed) > self.num_slots else 0

    @property
    def longest_run(self) -> int:
        """The most consecutive streamed layers in this list (a copy hides behind the resident layers around it)."""
        longest = run = 0
        for layer in self.layers:
            run = run + 1 if layer.streamed else 0
            longest = max(longest, run)
        return longest


@dataclass(frozen=True)
class OffloadPlan:
    """What `dispatch_model` will do: resident layers, streamed layers, their slots, and the bytes involved.

    `print(plan)` shows a table; Jupyter renders it as HTML. Bytes: `offloaded_bytes` live in pinned host memory,
    `pool_bytes` is the static GPU buffer pool, `resident_bytes` are the weights and buffers that stay on the execution
    device.
    """

    config: PrefetchConfig
    rings: tuple[RingPlan, ...]
    resident_bytes: int
    # The streamed layers were given (`make_plan(streamed=...)`), so the config's group pattern was not used.
    explicit: bool = False
    # The memory budget the streamed layers were chosen to fit (`budget.plan_for_budget`), if any.
    budget: MemoryBudget | None = None
    # Host-to-device link speed (GB/s) for the transfer time per forward; None leaves that line out.
    link_gbps: float | None = None

    @property
    def offloaded_bytes(self) -> int:
        return sum(ring.offloaded_bytes for ring in self.rings)

    @property
    def pool_bytes(self) -> int:
        return sum(ring.pool_bytes for ring in self.rings)

    @property
    def streamed_bytes_per_forward(self) -> int:
        return sum(ring.streamed_bytes_per_forward for ring in self.rings)

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.pool_bytes

    @property
    def longest_run(self) -> int:
        return max((ring.longest_run for ring in self.rings), default=0)

    @property
    def transfer_seconds_per_forward(self) -> float | None:
        """`streamed_bytes_per_forward` at `link_gbps`: the least time a forward can take; None without a link."""
        return None if self.link_gbps is None else self.streamed_bytes_per_forward / (self.link_gbps * 1e9)

    _HEADER = ("layer", "placement", "resident", "streamed", "slot", "next")

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for ring in self.rings:
            for layer in ring.layers:
                if layer.streamed:
                    nxt = ring.streamed[layer.next_in_slot].index
                    streamed = (format_bytes(layer.offloaded_bytes), str(layer.slot), str(nxt))
                    rows.append((layer.path, "streamed", format_bytes(layer.resident_bytes), *streamed))
                else:
                    rows.append((layer.path, "resident", format_bytes(layer.resident_bytes), "-", "-", "-"))
        return rows

    def _totals(self) -> list[tuple[str, str]]:
        size = format_bytes
        num_streamed = sum(len(ring.streamed) for ring in self.rings)
        num_layers = sum(len(ring.layers) for ring in self.rings)
        config = self.config
        if self.budget is not None:
            chosen = "to fit the budget"
        elif self.explicit:
            chosen = "chosen layers"
        else:
            chosen = f"group_size={config.group_size}, num_in_group={config.num_in_group}"
        chosen += f", prefetch_step={config.prefetch_step}"
        if config.offload_params:
            chosen += f", offload_params={sorted(config.offload_params)}"
        slots = "/".join(str(r.num_slots) for r in self.rings)
        totals = [
            ("streamed layers", f"{num_streamed} of {num_layers}, longest run {self.longest_run} ({chosen})"),
            ("resident bytes", size(self.resident_bytes)),
            ("pool bytes", f"{size(self.pool_bytes)} ({slots} slots)"),
            ("device bytes", f"{size(self.device_bytes)} (resident + pool)"),
        ]
        pinned = size(self.offloaded_bytes)
        if (budget := self.budget) is not None:
            spare = budget.device_bytes - budget.reserve_bytes - self.device_bytes
            reserve = f"{size(budget.reserve_bytes)} reserved for activations and the KV cache"
            totals.append(
                ("device budget", f"{size(budget.device_bytes)} ({budget.source}): {reserve}, {size(spare)} spare")
            )
            if budget.host_bytes is not None:
                pinned += f" of {size(budget.host_bytes)} (max_memory['cpu'])"
        totals.append(("pinned host bytes", pinned))
        totals.append(("streamed per forward", size(self.streamed_bytes_per_forward)))
        if self.link_gbps is not None:
            seconds = self.transfer_seconds_per_forward
            totals.append(("transfer per forward", f"{seconds * 1e3:.2f} ms at {self.link_gbps:.1f} GB/s"))
        return totals

    def __str__(self) -> str:
        rows = [f"{'layer':<32} {'placement':<9} {'resident':>11} {'streamed':>11} {'slot':>4} {'next':>5}"]
        for path, placement, resident, streamed, slot, nxt in self._rows():
            rows.append(f"{path:<32} {placement:<9} {resident:>11} {streamed:>11} {slot:>4} {nxt:>5}")
        rows.append("")
        rows += [f"{label:<22} {value}" for label, value in self._totals()]
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{cell}</th>" for cell in self._HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in self._rows()
        )
        totals = "".join(
            f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" for label, value in self._totals()
        )
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><table><tbody>{totals}</tbody></table>"
        )

    def __repr__(self) -> str:
        return (
            f"OffloadPlan(rings={[r.path for r in self.rings]}, resident_bytes={self.resident_bytes}, "
            f"pool_bytes={self.pool_bytes}, offloaded_bytes={self.offloaded_bytes})"
        )


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB" if abs(num_bytes) >= 2**10 else f"{num_bytes} B"


def find_layer_lists(model: nn.Module) -> list[str]:
    """Paths of the `ModuleList`s whose items are all instances of the model's `_no_split_modules` classes.

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
    found: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        if all(type(item).__name__ in block_classes for item in module):
            found.append(path)
    if not found:
        raise ValueError(
            f"Found no layer list in {type(model).__name__}: no ModuleList holds only its _no_split_modules "
            f"classes {sorted(block_classes)}. Pass layers='path.to.list' (or a list of paths). "
            f"ModuleLists in this model: {_describe_module_lists(model)}"
        )
    return found


def _describe_module_lists(model: nn.Module) -> str:
    lists = [
        f"{path!r} ({len(m)} x {type(m[0]).__name__})"
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0
    ]
    return ", ".join(lists) or "none"


def _resolve_layer_lists(model: nn.Module, layers: str | Sequence[str] | None) -> list[str]:
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
    return paths


def segment_matches(segments: frozenset[str], name: str) -> bool:
    """Whether a parameter name matches one of the segments on whole dotted parts (empty segments: everything)."""
    if not segments:
        return True
    dotted = f".{name}."
    return any(f".{segment}." in dotted for segment in segments)


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    # Keep the parameter's own layout when it is dense (a permuted layout changes which kernels run, and so the
    # bits); anything with gaps or overlaps is stored contiguously.
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda dim: dim[1]):
        if size != 1 and stride != expected:
            return tuple(torch.empty(tensor.shape, device="meta").stride())
        expected *= size
    return tuple(tensor.stride())


def _param_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def make_plan(
    model: nn.Module,
    config: PrefetchConfig,
    layers: str | Sequence[str] | None = None,
    *,
    streamed: Iterable[int] | Mapping[str, Iterable[int]] | None = None,
) -> OffloadPlan:
    """Decide which layers and parameters stream and which buffer slot each uses. Pure: nothing is moved.

    Args:
        model (`nn.Module`): The model; its parameters may be on the meta device.
        config (`PrefetchConfig`): The configuration.
        layers (`str` or list of `str`, *optional*): Path(s) of the layer list(s); found when omitted.
        streamed (*optional*): The layers to stream instead of the config's group pattern (whose `group_size` and
            `num_in_group` are then not used): layer indices, or `{layer list path: indices}` for a model with several
            layer lists (lists left out stream nothing).

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import PrefetchConfig, make_plan
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> plan = make_plan(model, PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2))
    >>> [layer.index for layer in plan.rings[0].streamed]
    [2, 3, 6, 7]
    >>> plan = make_plan(model, PrefetchConfig(prefetch_step=2), streamed=[3, 7])
    >>> [layer.index for layer in plan.rings[0].streamed], plan.longest_run
    ([3, 7], 1)

    ```
    """
    candidates = candidate_layers(model, config, layers)
    if streamed is None:
        g, n = config.group_size, config.num_in_group
        selection = {path: {i for i in range(len(ring)) if i % g >= g - n} for path, ring in candidates.items()}
    else:
        selection = _check_selection(streamed, candidates)
    matched = any(c.matched for path, ring in candidates.items() for c in ring if c.index in selection[path])
    if config.offload_params and not matched:
        raise offload_params_error(model, config, list(candidates))
    rings = tuple(ring_plan(path, ring, selection[path], config.prefetch_step) for path, ring in candidates.items())
    return OffloadPlan(
        config, rings, model_bytes(model) - sum(r.offloaded_bytes for r in rings), explicit=streamed is not None
    )


@dataclass(frozen=True)
class Candidate:
    """One layer as it would be planned if selected: the parameters that would stream, and all its bytes."""

    streamed: LayerPlan  # `params`: what would stream (matching `offload_params`, used under one name only)
    total_bytes: int  # all its parameters
    matched: bool  # `offload_params` matched one of its parameters (even one that has to stay resident)

    @property
    def index(self) -> int:
        return self.streamed.index


def candidate_layers(
    model: nn.Module, config: PrefetchConfig, layers: str | Sequence[str] | None
) -> dict[str, list[Candidate]]:
    """Every layer of every layer list, as it would be planned if selected (layer list path -> its layers)."""
    paths = _resolve_layer_lists(model, layers)
    # A parameter reachable under two names (tied, or a module reused) cannot live in one slot: keep it resident.
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1

    segments = config.offload_params
    candidates: dict[str, list[Candidate]] = {}
    for path in paths:
        candidates[path] = []
        for index, layer in enumerate(model.get_submodule(path)):
            specs: list[ParamSpec] = []
            layer_bytes = 0
            matched = False
            for name, param in layer.named_parameters():
                layer_bytes += _param_bytes(param)
                if segment_matches(segments, name):
                    matched = True
                    if uses[id(param)] == 1:
                        specs.append(
                            ParamSpec(name, tuple(param.shape), _dense_stride(param), param.dtype, _param_bytes(param))
                        )
            offloaded = sum(s.nbytes for s in specs)
            planned = LayerPlan(f"{path}.{index}", index, tuple(specs), layer_bytes - offloaded)
            candidates[path].append(Candidate(planned, layer_bytes, matched))
    return candidates


def ring_plan(path: str, candidates: list[Candidate], selected: set[int], prefetch_step: int) -> RingPlan:
    """The ring of one layer list with the `selected` layers streamed."""
    layers = [
        c.streamed if c.index in selected else LayerPlan(c.streamed.path, c.index, (), c.total_bytes)
        for c in candidates
    ]
    return _assign_slots(path, layers, prefetch_step)


def model_bytes(model: nn.Module) -> int:
    """All parameters and buffers, each counted once."""
    return sum(_param_bytes(p) for p in model.parameters()) + sum(_param_bytes(b) for b in model.buffers())


def offload_params_error(model: nn.Module, config: PrefetchConfig, paths: list[str]) -> ValueError:
    examples = [name for name, _ in model.get_submodule(paths[0])[0].named_parameters()][:6]
    return ValueError(
        f"offload_params={set(config.offload_params)} matched no parameter in the selected layers of {paths}; names "
        f"look like {examples}. Segments must match whole dotted parts (e.g. 'mlp' or 'down_proj')."
    )


def _check_selection(
    streamed: Iterable[int] | Mapping[str, Iterable[int]], candidates: dict[str, list[Candidate]]
) -> dict[str, set[int]]:
    paths = list(candidates)
    if not isinstance(streamed, Mapping):
        if len(paths) > 1:
            raise ValueError(
                f"streamed={streamed!r} is a list of indices, but the model has {len(paths)} layer lists {paths}; "
                f"pass {{path: indices}}, e.g. streamed={{{paths[0]!r}: [1, 3]}}."
            )
        streamed = {paths[0]: streamed}
    selection = {path: set() for path in paths}
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


def _assign_slots(path: str, layers: list[LayerPlan], prefetch_step: int) -> RingPlan:
    streamed_positions = [i for i, layer in enumerate(layers) if layer.streamed]
    n = len(streamed_positions)
    num_slots = min(prefetch_step, n)
    result = list(layers)
    for k, position in enumerate(streamed_positions):
        slot = k % num_slots
        # Next streamed layer after k, cyclically, that uses the same slot: k + num_slots while it exists, else the
        # first layer of the next pass with this slot. Equals (k + prefetch_step) % n when n % prefetch_step == 0.
        next_k = k + num_slots if k + num_slots < n else slot
        layer = layers[position]
        result[position] = LayerPlan(layer.path, layer.index, layer.params, layer.resident_bytes, slot, next_k)
    return RingPlan(path, tuple(result), num_slots)
