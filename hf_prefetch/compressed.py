"""Compressed host storage ([Note: compressed streaming] in engine.py): a plan's compressed parameters are encoded
once, on the host, in parallel, into an exact-size arena of their own; afterwards their host values are read and
written through the codec.

`compress_arena` runs after the arena was filled with plain values (by `dispatch_model`, or by the loader from a
checkpoint) and before `attach`: it encodes every compressed parameter, allocates the new arena (encoded bytes where
compressed, values elsewhere), and switches the model over in one step, so that an exception or a Ctrl-C before the
switch leaves the plain arena in place and one after it a complete new one. A tensor whose values have more escapes
than its layout holds (`codec.TooManyEscapes`) stays plain: the plan is changed to say so. Host memory peaks at the
plain arena plus the encoded one while it runs.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import codec
from .changes import Phase, _assign, deferred_interrupts
from .host import HostArena
from .placements import OffloadPlan
from .state import Lifecycle, OffloadedParam, OffloadState

__all__ = ["compress_arena", "host_value", "encode_for", "write_encoded"]

logger = logging.getLogger("hf_prefetch")


def compress_arena(model: nn.Module, state: OffloadState, progress: bool | None = None) -> None:
    """Encode the plan's compressed parameters (held plainly in `state.arena`) into a new arena, and point the model
    at it. Nothing to do for a plan without compressed parameters."""
    from tqdm.auto import tqdm  # imported here: importing it in Jupyter without ipywidgets warns

    layouts = _layouts(state.plan)
    todo = [(i, o, layouts[o.full_name]) for i, o in enumerate(state.offloaded) if o.full_name in layouts]
    if not todo:
        return
    encoded: dict[int, torch.Tensor] = {}
    plain: list[str] = []
    total = sum(layout.raw_bytes for _, _, layout in todo)
    workers = max(1, min(8, os.cpu_count() or 1))
    disable = not progress if progress is not None else None  # None: tqdm shows it on a terminal only
    # torch's operations release the GIL: tensors are encoded side by side, each on one thread.
    with (
        ThreadPoolExecutor(workers) as pool,
        tqdm(total=total, unit="B", unit_scale=True, desc="Compressing", disable=disable) as bar,
    ):
        futures = [(i, o, pool.submit(_encode_one, o.host, layout)) for i, o, layout in todo]
        for i, o, future in futures:
            result = future.result()
            if isinstance(result, codec.TooManyEscapes):
                plain.append(o.full_name)
                logger.warning(
                    "%s stays uncompressed: %d of its weights have an exponent outside its 15 most common ones, its "
                    "layout holds %d.",
                    o.full_name,
                    result.found,
                    result.capacity,
                )
            else:
                encoded[i] = result
            bar.update(layouts[o.full_name].raw_bytes)
    plan = _without(state.plan, set(plain)) if plain else state.plan
    sizes = [encoded[i].numel() if i in encoded else _nbytes(o.host) for i, o in enumerate(state.offloaded)]
    arena = HostArena(sizes)  # checks the container's memory limit first: the plain arena is still held
    offloaded = []
    for i, o in enumerate(state.offloaded):
        if i in encoded:
            host = arena.view(i, (sizes[i],), (1,), torch.uint8)
            host.copy_(encoded.pop(i))
            offloaded.append(replace(o, host=host, layout=layouts[o.full_name]))
        else:
            host = arena.view(i, o.host.shape, o.host.stride(), o.host.dtype)
            host.copy_(o.host)
            offloaded.append(replace(o, host=host))
    with deferred_interrupts():  # the switch: every parameter, the arena and the plan at once
        old = state.arena
        state.plan, state.arena, state.offloaded = plan, arena, offloaded
        for o in offloaded:
            if o.layout is None:
                state.journal.place(o.param, o.host, f"{o.full_name} into the compressed arena's plain part", o.attr)
            else:
                # The values are in the encoded bytes only: the parameter holds one element (expanded to its shape)
                # until it points at its slot.
                o.param.data = torch.zeros((), dtype=o.layout.dtype).expand(_shape(o))
            state.journal.record(Phase.ATTACH, f"{o.full_name} given its values back", _own_values(state, o))
        old.release()
    if state.device.type == "cuda":
        with torch.cuda.device(state.device):
            arena.pin()


def host_value(offloaded: OffloadedParam) -> torch.Tensor:
    """The value of an offloaded parameter in host memory: its host tensor, or decoded from it (a new tensor)."""
    if offloaded.layout is None:
        return offloaded.host
    value = torch.empty(_shape(offloaded), dtype=offloaded.layout.dtype)
    return codec.decode(offloaded.host, offloaded.layout, value)


def encode_for(offloaded: OffloadedParam, value: torch.Tensor) -> torch.Tensor:
    """`value`'s encoded bytes for `offloaded`'s host storage; raises a ValueError naming the parameter when they do
    not fit its layout. Nothing is written."""
    try:
        return codec.encode(value.detach().to("cpu", offloaded.layout.dtype), offloaded.layout)
    except codec.TooManyEscapes as error:
        raise ValueError(_unencodable(offloaded, error.found)) from None


def refuse_unencodable(
    compressed: dict[str, OffloadedParam], module: nn.Module, state_dict: dict, prefix: str, *args: Any
) -> None:
    """`load_state_dict` pre-hook on every module that contains a compressed parameter (`compressed`: by their names
    in it). On the module `load_state_dict` was called on (prefix ""), before torch writes anything, every new value of
    a compressed parameter is checked against its layout: one that does not fit is refused with nothing written."""
    if prefix:
        return
    for name, offloaded in compressed.items():
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(offloaded.param.shape):
            continue  # torch reports it (or skips it) as it loads
        found = codec.escapes(value.detach().to("cpu", offloaded.layout.dtype))
        if found > offloaded.layout.capacity:
            raise ValueError(_unencodable(offloaded, found))


def _unencodable(offloaded: OffloadedParam, found: int) -> str:
    return (
        f"The new value of {offloaded.full_name} has {found} weights whose exponent is outside its 15 most common "
        f"ones; its compressed host storage holds {offloaded.layout.capacity}. Nothing was written. Dispatch again "
        "(hf_prefetch.remove_offload(model), then dispatch_model) to encode the new values afresh, or dispatch with "
        "PrefetchConfig(compress=False)."
    )


def write_encoded(offloaded: OffloadedParam, encoded: torch.Tensor) -> None:
    offloaded.host.copy_(encoded)


def _encode_one(value: torch.Tensor, layout: codec.Layout) -> torch.Tensor | codec.TooManyEscapes:
    try:
        return codec.encode(value, layout)
    except codec.TooManyEscapes as error:
        return error


def _own_values(state: OffloadState, offloaded: OffloadedParam):
    # When the dispatch is undone for the model's sake (a collected model needs no values), the parameter (or inner
    # tensor) gets its values in a tensor of its own: decoded, or copied out of the arena, which a view would keep
    # alive whole, encoded bytes included.
    def undo() -> None:
        if state.lifecycle in (Lifecycle.DETACHING, Lifecycle.ROLLING_BACK):
            value = host_value(offloaded) if offloaded.layout is not None else offloaded.host.clone()
            _assign(offloaded.param, offloaded.attr, value)

    return undo


def _layouts(plan: OffloadPlan) -> dict[str, codec.Layout]:
    return {
        f"{layer.path}.{spec.name}": spec.compressed
        for ring in plan.rings
        for layer in ring.layers
        for spec in layer.offloaded
        if spec.compressed is not None
    }


def _without(plan: OffloadPlan, names: set[str]) -> OffloadPlan:
    # The plan with the parameters `names` no longer compressed.
    def layer_without(layer):
        params = tuple(replace(p, compressed=None) if f"{layer.path}.{p.name}" in names else p for p in layer.params)
        return replace(layer, params=params)

    rings = tuple(replace(ring, layers=tuple(layer_without(layer) for layer in ring.layers)) for ring in plan.rings)
    return replace(plan, rings=rings)


def _shape(offloaded: OffloadedParam) -> tuple[int, ...]:
    return tuple(offloaded.param.shape)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
