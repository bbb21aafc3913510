"""Planning: model + `PrefetchConfig` -> `OffloadPlan`, a pure description of what streams where.

The planner reads module structure, parameter names, shapes and dtypes (a model on the meta device is fine). It
allocates nothing, copies nothing and never touches CUDA; `dispatch` executes the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import PrefetchConfig

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


@dataclass(frozen=True)
class OffloadPlan:
    """What `dispatch_model` will do: resident layers, streamed layers, their slots, and the bytes involved.

    `print(plan)` shows a table. Bytes: `offloaded_bytes` live in pinned host memory, `pool_bytes` is the static GPU
    buffer pool, `resident_bytes` are the weights and buffers that stay on the execution device.
    """

    config: PrefetchConfig
    rings: tuple[RingPlan, ...]
    resident_bytes: int

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

    def __str__(self) -> str:
        rows = [f"{'layer':<32} {'placement':<9} {'offloaded':>11} {'slot':>4} {'next':>5}"]
        for ring in self.rings:
            for layer in ring.layers:
                if layer.streamed:
                    nxt = ring.streamed[layer.next_in_slot].index
                    rows.append(
                        f"{layer.path:<32} {'streamed':<9} {_mib(layer.offloaded_bytes):>11} {layer.slot:>4} {nxt:>5}"
                    )
                else:
                    rows.append(f"{layer.path:<32} {'resident':<9} {'-':>11} {'-':>4} {'-':>5}")
        num_streamed = sum(len(ring.streamed) for ring in self.rings)
        num_layers = sum(len(ring.layers) for ring in self.rings)
        rows += [
            "",
            f"streamed layers        {num_streamed} of {num_layers} ({self.config})",
            f"resident bytes         {_mib(self.resident_bytes)}",
            f"pool bytes             {_mib(self.pool_bytes)} ({'/'.join(str(r.num_slots) for r in self.rings)} slots)",
            f"pinned host bytes      {_mib(self.offloaded_bytes)}",
            f"streamed per forward   {_mib(self.streamed_bytes_per_forward)}",
            f"device bytes           {_mib(self.device_bytes)}",
        ]
        return "\n".join(rows)

    def __repr__(self) -> str:
        return (
            f"OffloadPlan(rings={[r.path for r in self.rings]}, resident_bytes={self.resident_bytes}, "
            f"pool_bytes={self.pool_bytes}, offloaded_bytes={self.offloaded_bytes})"
        )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


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


def make_plan(model: nn.Module, config: PrefetchConfig, layers: str | Sequence[str] | None = None) -> OffloadPlan:
    """Decide which layers and parameters stream and which buffer slot each uses. Pure: nothing is moved.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import PrefetchConfig, make_plan
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> plan = make_plan(model, PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2))
    >>> [layer.index for layer in plan.rings[0].streamed]
    [2, 3, 6, 7]

    ```
    """
    paths = _resolve_layer_lists(model, layers)
    # A parameter reachable under two names (tied, or a module reused) cannot live in one slot: keep it resident.
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1

    segments = config.offload_params
    rings: list[RingPlan] = []
    matched_any = False
    for path in paths:
        layer_list = model.get_submodule(path)
        planned: list[LayerPlan] = []
        for index, layer in enumerate(layer_list):
            layer_path = f"{path}.{index}"
            selected = index % config.group_size >= config.group_size - config.num_in_group
            specs: list[ParamSpec] = []
            layer_bytes = 0
            for name, param in layer.named_parameters():
                layer_bytes += _param_bytes(param)
                if selected and segment_matches(segments, name):
                    matched_any = True
                    if uses[id(param)] == 1:
                        specs.append(
                            ParamSpec(name, tuple(param.shape), _dense_stride(param), param.dtype, _param_bytes(param))
                        )
            offloaded = sum(s.nbytes for s in specs)
            planned.append(LayerPlan(layer_path, index, tuple(specs), layer_bytes - offloaded))
        rings.append(_assign_slots(path, planned, config.prefetch_step))

    if segments and not matched_any:
        examples = [name for name, _ in model.get_submodule(paths[0])[0].named_parameters()][:6]
        raise ValueError(
            f"offload_params={set(segments)} matched no parameter in the selected layers of {paths}; names look like "
            f"{examples}. Segments must match whole dotted parts (e.g. 'mlp' or 'down_proj')."
        )

    total_bytes = sum(_param_bytes(p) for p in model.parameters()) + sum(_param_bytes(b) for b in model.buffers())
    offloaded = sum(ring.offloaded_bytes for ring in rings)
    return OffloadPlan(config, tuple(rings), total_bytes - offloaded)


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
