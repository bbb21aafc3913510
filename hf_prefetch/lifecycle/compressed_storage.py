"""Compressed host storage ([Note: compressed streaming] in runtime/decodes.py): a plan's compressed parameters are
encoded once, on the host, in parallel, into an exact-size arena of their own; afterwards their host values are read
and written through the codec (host/offloaded.py).

`compress_arena` runs after the arena was filled with plain values (by `dispatch_model`, or by the loader from a
checkpoint) and before `attach`: it encodes every compressed parameter, allocates the new arena (encoded bytes where
compressed, values elsewhere), and switches the model over in one step, so that an exception or a Ctrl-C before the
switch leaves the plain arena in place and one after it a complete new one. A tensor whose values have more escapes
than its layout holds (`lossless.TooManyEscapes`) stays plain: the plan is changed to say so (and where that leaves
nothing compressed, a warning says that `compress=True` changed nothing; a plan that compresses nothing to begin with
was warned about when it was chosen, `choose.choose_plan`). Host memory peaks at the plain arena plus the encoded one
while it runs.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from torch import nn

from ..config import warn_at_caller
from ..formats import lossless
from ..formats.parts import assign
from ..host.arena import HostArena
from ..host.offloaded import OffloadedParam, host_value
from ..interrupts import deferred_interrupts
from ..planning.offload_plan import OffloadPlan, compresses_nothing
from .journal import Phase
from .state import Lifecycle, OffloadState

__all__ = ["compress_arena"]

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
            if isinstance(result, lossless.TooManyEscapes):
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
    nothing = compresses_nothing(plan) if not encoded else None
    if nothing is not None:  # every tensor the plan compresses stayed plain: compress=True changed nothing
        warn_at_caller(f"PrefetchConfig(compress=True) changes nothing for these weights: {nothing}. Drop it.")
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
                o.param.data = torch.zeros((), dtype=o.layout.dtype).expand(o.param.shape)
            state.journal.record(Phase.ATTACH, f"{o.full_name} given its values back", _own_values(state, o))
        old.release()
    if state.device.type == "cuda":
        with torch.cuda.device(state.device):
            arena.pin()


def _encode_one(value: torch.Tensor, layout: lossless.Layout) -> torch.Tensor | lossless.TooManyEscapes:
    try:
        return lossless.encode(value, layout)
    except lossless.TooManyEscapes as error:
        return error


def _own_values(state: OffloadState, offloaded: OffloadedParam):
    # When the dispatch is undone for the model's sake (a collected model needs no values), the parameter (or inner
    # tensor) gets its values in a tensor of its own: decoded, or copied out of the arena, which a view would keep
    # alive whole, encoded bytes included.
    def undo() -> None:
        if state.lifecycle in (Lifecycle.DETACHING, Lifecycle.ROLLING_BACK):
            value = host_value(offloaded) if offloaded.layout is not None else offloaded.host.clone()
            assign(offloaded.param, offloaded.attr, value)

    return undo


def _layouts(plan: OffloadPlan) -> dict[str, lossless.Layout]:
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
