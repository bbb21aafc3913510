"""The tensors a parameter is stored in: a plain tensor's `data`, a tensor subclass's inner tensors (torchao), a
bitsandbytes parameter's packed bytes and quantization state; each read, pointed elsewhere, or rebuilt by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..interrupts import deferred_interrupts
from . import bnb

__all__ = [
    "is_dtensor",
    "get_part",
    "set_part",
    "assign",
    "stored_parts",
    "with_inner",
    "as_parameter",
    "placeholder_of",
]


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a torch.distributed DTensor (a tensor-parallel shard); torch.distributed is not imported."""
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in type(tensor).__mro__)


def get_part(param: torch.Tensor, name: str) -> torch.Tensor:
    """One of the tensors a parameter is stored in, by the name `stored_parts` gives it (`data` for a plain one)."""
    value: Any = param
    for attr in bnb.attribute_path(param, name):
        value = getattr(value, attr)
    return value


def set_part(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """Point one of the tensors a parameter is stored in at `tensor`: a plain `setattr` on the parameter (or on a
    4-bit parameter's quantization state), which `assign` wraps for a tensor subclass's `data`."""
    *owner, attr = bnb.attribute_path(param, name)
    value: Any = param
    for step in owner:
        value = getattr(value, step)
    setattr(value, attr, tensor)


def stored_parts(param: torch.Tensor, module: nn.Module | None = None) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors a parameter is stored in when it is more than one, (name, tensor): a tensor subclass's inner
    tensors by attribute (torchao), a bitsandbytes 4-bit parameter's packed bytes and quantization state, or an 8-bit
    one's values and scales (found in `module`, its owner, after a forward). None for a plain tensor, and for a
    subclass that holds anything else (a nested subclass, state outside its inner tensors)."""
    if is_traceable_wrapper_subclass(param):
        names, _ = param.__tensor_flatten__()
        inner = [(name, getattr(param, name)) for name in names]
        if is_dtensor(param):  # it also flattens its device mesh, an object the rebuilt tensor keeps (`with_inner`)
            inner = [(name, value) for name, value in inner if isinstance(value, torch.Tensor)]
        if not inner or any(type(tensor) is not torch.Tensor for _, tensor in inner):
            return None
        return inner
    return bnb.storage_parts(param, module)


def with_inner(param: torch.Tensor, inner: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor subclass like `param` made of the tensors `inner` (by attribute): its device follows them."""
    names, context = param.__tensor_flatten__()
    inner = {name: inner[name] if name in inner else getattr(param, name) for name in names}
    return type(param).__tensor_unflatten__(inner, context, param.size(), param.stride())


def assign(param: torch.Tensor, attr: str, tensor: torch.Tensor) -> None:
    # `param.data = tensor`, or an inner tensor's attribute of a tensor subclass. Assigning a tensor subclass's `.data`
    # keeps its inner tensors (its kernels read those) and cannot change its device: its contents are swapped for a
    # parameter made of `tensor` instead, as nn.Module._apply does (the old contents leave with that parameter).
    if attr != "data" or not is_traceable_wrapper_subclass(param):
        set_part(param, attr, tensor)
        return
    value = nn.Parameter(tensor, requires_grad=param.requires_grad) if isinstance(param, nn.Parameter) else tensor
    with deferred_interrupts():
        torch.utils.swap_tensors(param, value)


def as_parameter(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as a tensor of `param`'s class (an `nn.Parameter`) with its attributes, for `torch.utils.swap_tensors`
    with `param`: the way a meta parameter takes real contents (its data cannot be assigned)."""
    swapped = torch.Tensor._make_subclass(type(param), value, param.requires_grad)
    swapped.__dict__.update(param.__dict__)
    return swapped


def placeholder_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter of `param`'s class, shape and dtype that holds no memory (one element, expanded): what a meta
    parameter whose values stay elsewhere (routed experts read from files) is swapped for, so that its data can be
    pointed at other tensors, which torch allows while an autograd graph holds the parameter (a swap it refuses)."""
    return as_parameter(param, torch.zeros((), dtype=param.dtype).expand(param.shape))
