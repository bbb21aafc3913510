"""What a module of a dispatched model refuses, set on its instance by the dispatch (`attach._guard_moves`,
`attach`'s `load_state_dict` pre-hooks) and by `OffloadState` itself: conversions and moves (`_apply`, with the
conversions that change nothing let through), copies and pickling, `load_state_dict(assign=True)`. Each refuses
before anything changes, with the fix in its message. This module knows nothing about the dispatch's state.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "ancestors",
    "refuse_file_writes",
    "CONVERSIONS",
    "refuse_apply",
    "unless_nothing_changes",
    "refuse_deepcopy",
    "refuse_pickle",
    "refuse_assign",
]

# The conversions of a module that holds offloaded parameters that return it as it is when they would change none of
# its tensors: `.to("cpu")` and `.cpu()` of a model dispatched to the CPU, a model's own
# `self.classifier.to(self.dtype)` in every forward (as SwitchTransformers' router does). Any other call goes on to
# nn.Module's, whose `_apply` is `refuse_apply`.
CONVERSIONS = ("to", "cpu", "cuda", "half", "float", "double", "bfloat16")
_DTYPES = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}


def unless_nothing_changes(module: nn.Module, name: str) -> Callable[..., nn.Module]:
    """The conversion `name` (one of `CONVERSIONS`) of a module that holds offloaded parameters, for its instance
    dict: a call that would change none of its tensors returns the module; any other goes on to nn.Module's (refused
    by `refuse_apply`)."""
    module_ref = weakref.ref(module)  # the module holds this function
    convert = getattr(nn.Module, name)

    def unless_unchanged(*args: Any, **kwargs: Any) -> nn.Module:
        owner = module_ref()
        if owner is None:  # kept by a caller after its module was collected
            raise RuntimeError(f"This .{name}() belonged to a module that no longer exists.")
        if name == "to":
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            unchanged = memory_format is None and _converts_nothing(owner, device, dtype, complex_too=True)
        elif name == "cuda":
            device = _bound(convert, args, kwargs).get("device")
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
            unchanged = _converts_nothing(owner, device, None)
        else:  # .cpu(), or a floating-point dtype (complex tensors keep theirs, as nn.Module's do)
            _bound(convert, args, kwargs)  # its arguments checked as nn.Module's would
            unchanged = _converts_nothing(owner, torch.device("cpu") if name == "cpu" else None, _DTYPES.get(name))
        return owner if unchanged else convert(owner, *args, **kwargs)

    functools.update_wrapper(unless_unchanged, convert)
    return unless_unchanged


def _bound(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    # The arguments of a call of nn.Module's `function` without `self`, by name; a TypeError as its own call raises.
    return inspect.signature(function).bind(None, *args, **kwargs).arguments


def _converts_nothing(
    module: nn.Module, device: torch.device | None, dtype: torch.dtype | None, complex_too: bool = False
) -> bool:
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    if device is not None and device.type == "cuda" and device.index is None:
        if any(tensor.device.type != "cuda" for tensor in tensors):
            return False
        device = torch.device("cuda", torch.cuda.current_device())  # what `.to("cuda")` moves to
    for tensor in tensors:
        if device is not None and tensor.device != device:
            return False
        converted = tensor.is_floating_point() or (complex_too and tensor.is_complex())
        if dtype is not None and converted and tensor.dtype != dtype:
            return False
    return True


def refuse_apply(*args: Any, **kwargs: Any) -> None:
    """Set as `_apply` on every module that owns or contains an offloaded parameter: `model.to()`, `.half()`,
    `.cuda()`, `.float()` ... all go through `nn.Module._apply`, which would swap the parameters' slot tensors (or
    mapped views) for converted copies that no copy ever refreshes. It refuses before anything is converted."""
    raise RuntimeError(
        "This model is dispatched by hf_prefetch: .to(), .cuda(), .cpu(), .half(), .float() and other conversions "
        "would detach the offloaded weights from their buffer slots or host memory. Call "
        "hf_prefetch.remove_offload(model) first (remove_offload(model, device='cpu') if it does not fit on the GPU), "
        "convert, then dispatch again."
    )


# Also set as `__deepcopy__` and `__reduce_ex__` on every module that owns or contains an offloaded parameter (both are
# looked up on the instance), so that copying a part of a dispatched model (`model.model`, a streamed layer) refuses
# too: its copy would hold the slots' current contents and hooks that copy into buffers it no longer points at.
def refuse_deepcopy(memo: Any) -> Any:
    raise TypeError(
        "copy.deepcopy of a model dispatched by hf_prefetch, or of a module of it that holds offloaded parameters, is "
        "not supported: its streamed parameters share buffer slots and host storage with the original. Call "
        "hf_prefetch.remove_offload(model) (or remove_offload(model, device='cpu')) first, copy, then dispatch each "
        "model."
    )


def refuse_pickle(protocol: Any) -> Any:
    raise TypeError(
        "A model dispatched by hf_prefetch, or a module of it that holds offloaded parameters, cannot be pickled or "
        "copied (torch.save(model), pickle.dumps(model), copy.copy, multiprocessing): its streamed parameters point "
        "at buffer slots shared between layers. Save the weights with model.save_pretrained(folder) or "
        "torch.save(model.state_dict(), path) (both read host storage), or call "
        "hf_prefetch.remove_offload(model, device='cpu') first."
    )


def refuse_assign(
    streamed_names: list[str], module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any
) -> None:
    """`load_state_dict` pre-hook on every module that contains a streamed parameter: `assign=True` would swap the
    parameter out of its slot, so it fails on entry, before torch has assigned anything."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name in streamed_names:
        if prefix + name in state_dict:
            raise RuntimeError(
                f"load_state_dict(..., assign=True) would replace the streamed parameter {prefix}{name} by the state "
                "dict's tensor and detach it from its buffer slot. Load in place (assign=False) or use "
                "hf_prefetch.reload_weights(model, state_dict); to assign, call hf_prefetch.remove_offload(model) "
                "first and dispatch again."
            )


def refuse_file_writes(model: nn.Module, names: list[str], message: str, journal: Any) -> None:
    """[Note: weights read from files] in runtime/read_ahead.py: a `load_state_dict` pre-hook on every module above a
    parameter whose writes are refused (`names`: full names, every streamed one of a dispatch with layers read from
    the checkpoint's files), so that a load that gives one of them a value fails on entry, with `message`, before
    torch writes anything."""
    under: dict[str, list[str]] = {}
    for full in names:
        for path, name in ancestors(full):
            under.setdefault(path, []).append(name)
    for path, inside in under.items():
        hook = functools.partial(_refuse_file_values, inside, message)
        register = functools.partial(model.get_submodule(path)._register_load_state_dict_pre_hook, hook, True)
        journal.handle(register, f"writes of weights read from files refused on {path or 'model'}")


def _refuse_file_values(names: list[str], message: str, module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    if any(prefix + name in state_dict for name in names):
        raise RuntimeError(message)


def ancestors(param_name: str) -> list[tuple[str, str]]:
    """(module path, the parameter's name in it) for every module above the parameter, the model ("") first."""
    parts = param_name.split(".")
    return [(".".join(parts[:depth]), ".".join(parts[depth:])) for depth in range(len(parts))]
