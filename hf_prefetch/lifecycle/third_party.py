"""Other libraries' methods that read or write a streamed layer's weights outside its forward, run through
`weights_in_place` (in_place.py), one module at a time: PEFT's `merge` and `unmerge` of a tuner layer (what
`merge_adapter`, `unmerge_adapter` and `merge_and_unload` call for each of them) and diffusers' `fuse_projections` of
an attention module (what `fuse_qkv_projections` calls). The dispatch sets them on the instances, through the journal:
on the modules of the streamed layers it finds, and on the tuner layers PEFT puts in later (`get_peft_model` of a
dispatched model), found as a walk of the model meets them (`named_modules`, which `modules()`, `parameters()` and
every PEFT entry point call first). Modules are known by what their classes have: neither library is imported here."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..interrupts import held_in_turns
from .in_place import weights_in_place
from .state import Lifecycle, OffloadState

__all__ = ["route_through_in_place"]

# PEFT's tuner layers (`BaseTunerLayer`: `get_base_layer`, `merge`): the methods that merge an adapter into the base
# layer's weights or take it out (MultiheadAttention's unloads and merges at once).
_TUNER_METHODS = ("merge", "unmerge", "unload_and_optionally_merge_module")
_METHODS: dict[type, tuple[str, ...]] = {}  # by module class, what `_methods_of` found


def route_through_in_place(model: nn.Module, state: OffloadState) -> None:
    """At the dispatch: the weight-touching methods of the modules in the streamed layers run in `weights_in_place`,
    and so will those of tuner layers over streamed parameters that a walk of the model meets later."""
    streamed = frozenset(id(offloaded.param) for offloaded in state.offloaded)
    for ring in state.plan.rings:
        for layer in ring.streamed:
            for path, module in model.get_submodule(layer.path).named_modules(prefix=layer.path):
                _route(state, streamed, module, path)
    walk = _routing_walk(model, state, streamed)
    state.journal.set_attribute(model, "named_modules", walk, "tuner layers added later, met by walks of the model")


def _methods_of(cls: type) -> tuple[str, ...]:
    methods = _METHODS.get(cls)
    if methods is None:
        if callable(getattr(cls, "get_base_layer", None)) and callable(getattr(cls, "merge", None)):
            methods = tuple(name for name in _TUNER_METHODS if callable(getattr(cls, name, None)))
        elif callable(getattr(cls, "fuse_projections", None)):  # diffusers' AttentionModuleMixin
            methods = ("fuse_projections",)
        else:
            methods = ()
        _METHODS[cls] = methods
    return methods


def _route(state: OffloadState, streamed: frozenset[int], module: nn.Module, path: str) -> None:
    # The module's weight-touching methods in `weights_in_place`, if it holds streamed parameters and has them.
    methods = [name for name in _methods_of(type(module)) if name not in module.__dict__]
    if not methods or not any(id(param) in streamed for param in module.parameters()):
        return
    for name in methods:
        state.journal.set_attribute(module, name, _in_place(module, name), f"{name} of {path} with weights in place")


def _in_place(module: nn.Module, name: str) -> Callable[..., Any]:
    # `module.<name>` (the class's) inside `weights_in_place(module)`.
    method = getattr(type(module), name)
    module_ref = weakref.ref(module)  # the module holds this function

    def in_place(*args: Any, **kwargs: Any) -> Any:
        owner = module_ref()
        if owner is None:
            raise RuntimeError(f"This {name} belonged to a module that no longer exists.")
        with weights_in_place(owner):
            return method(owner, *args, **kwargs)

    functools.update_wrapper(in_place, method)
    return in_place


def _routing_walk(model: nn.Module, state: OffloadState, streamed: frozenset[int]) -> Callable[..., Iterator]:
    # The model's `named_modules` for its instance dict: the one set before, else the class's, routing each module
    # with weight-touching methods over streamed parameters as it meets it (before the caller sees it).
    inner = model.__dict__.get("named_modules")
    model_ref, state_ref = weakref.ref(model), weakref.ref(state)  # the model holds this function; it the state
    settled = weakref.WeakSet()  # modules with such methods over no streamed parameter: not looked at again

    def named_modules(*args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        owner = model_ref()
        walk = inner(*args, **kwargs) if inner is not None else type(owner).named_modules(owner, *args, **kwargs)
        for name, module in walk:
            methods = _methods_of(type(module))
            if methods and module not in settled and not all(m in module.__dict__ for m in methods):
                current = state_ref()
                if current is not None and current.lifecycle is Lifecycle.ATTACHED:
                    with held_in_turns(current.in_place.lock):
                        _route(current, streamed, module, name)
                    if not any(m in module.__dict__ for m in methods):
                        settled.add(module)
            yield name, module

    functools.update_wrapper(named_modules, inner if inner is not None else type(model).named_modules)
    return named_modules
