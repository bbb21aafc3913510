"""Every change hf_prefetch makes to a model, as a journal of reversible steps.

[Note: the journal]
A dispatch changes a model in many small steps: tensors moved to the device or into host storage, parameters pointed
at buffer slots or mapped views, hooks attached, methods guarded, attributes set. Each step is made through a
`Journal` method, which records how to undo it and then makes it. Steps are of two phases:
- PLACE steps move or recast weights (a parameter into host storage, a resident tensor onto the device, a loaded
  value swapped in). Only a failed dispatch undoes them (`Journal.unwind(Phase.PLACE)`), back to the model as given.
- ATTACH steps wire the dispatch (pointers to slots, hooks, guards, `hf_device_map`). `remove_offload`, a
  re-dispatch, and the collection of a deleted model undo them (`Journal.unwind(Phase.ATTACH)`) and keep the weights'
  values where they are.
Undoing runs the steps newest first, and removes a step from the journal only after its undo completed; every undo is
idempotent. Making a change follows the same rule the other way: its undo is recorded first, and is harmless on a
change that was never made; a change of several steps in code hf_prefetch does not own (accelerate's hooks, torch's
hook registration, `swap_tensors` and its flag) runs with Ctrl-C held back (`deferred_interrupts`), as each undo does.
A KeyboardInterrupt (or any exception) that lands anywhere therefore leaves a journal that the next `remove_offload` or
`dispatch_model` resumes, never a change left unrecorded, a step done twice or skipped.

The journal holds modules by weak reference: the model holds its state, which holds the journal, and a strong
reference back would keep a deleted model, its buffer pool and its pinned memory alive until the cyclic garbage
collector ran. Tensors are held strongly (they do not refer to their modules).

The dispatch's lasting changes (`param.data` assigned, buffers replaced, hooks attached) are made through this
module; changes that last one call are undone by the code that makes them (a `load_state_dict`'s write-through,
state_dict.py; the pre-hooks that hold forwards during a re-dispatch, `attach.forwards_held`). It knows nothing about
plans, streams or checkpoints.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module
from torch import nn

from ..formats import bnb
from ..formats.parts import assign, get_part
from ..interrupts import deferred_interrupts

__all__ = ["Journal", "Phase", "PassThrough", "move_tensors"]


class Phase(Enum):
    PLACE = "place"  # weights moved or recast: undone only when a dispatch fails
    ATTACH = "attach"  # the dispatch's wiring: undone by removal, re-dispatch, failure and collection


@dataclass
class _Step:
    phase: Phase
    undo: Callable[[], None]
    what: str  # for repr and debugging


class Journal:
    """The changes made to one model, in order, each with its undo. See [Note: the journal]."""

    def __init__(self) -> None:
        self._steps: list[_Step] = []

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        return f"Journal({[f'{s.phase.value}: {s.what}' for s in self._steps]})"

    def record(self, phase: Phase, what: str, undo: Callable[[], None]) -> None:
        self._steps.append(_Step(phase, undo, what))

    def unwind(self, down_to: Phase) -> None:
        """Undo the steps newest first: ATTACH steps only (PLACE steps are dropped, their changes kept), or every
        step (`down_to=Phase.PLACE`). Resumable after an interrupt: a step leaves the journal once undone."""
        while self._steps:
            step = self._steps[-1]
            if step.phase is Phase.ATTACH or down_to is Phase.PLACE:
                with deferred_interrupts():
                    step.undo()
            self._steps.pop()

    # --- Tensors ----------------------------------------------------------------------------------------------------

    def point(self, phase: Phase, param: torch.Tensor, tensor: torch.Tensor, what: str, attr: str = "data") -> None:
        """`param.data = tensor` (or another `attr`: a tensor subclass's inner tensor, a tensor of a bitsandbytes
        parameter's quantization state, as `parts.stored_parts` names them); undone by pointing it back."""
        previous = get_part(param, attr)
        self._change(phase, what, lambda: assign(param, attr, previous), lambda: assign(param, attr, tensor))

    def place(self, param: torch.Tensor, tensor: torch.Tensor, what: str, attr: str = "data") -> None:
        """`param.data = tensor` (or another `attr`) for good (its old storage is dropped now); undone by copying
        the value back to the device it was on."""
        origin = get_part(param, attr).device
        self._change(Phase.PLACE, what, lambda: _move(param, origin, attr), lambda: assign(param, attr, tensor))

    def _change(self, phase: Phase, what: str, undo: Callable[[], None], do: Callable[[], None]) -> None:
        # Made, then recorded, with no interrupt in between: a change that fails (torch refusing to swap a tensor
        # subclass's contents) leaves nothing to undo, and one that is made always finds its undo.
        try:
            with deferred_interrupts():
                do()
                self.record(phase, what, undo)
        except RuntimeError as error:
            if "swap" not in str(error):
                raise
            raise ValueError(
                f"{what}: torch refused to swap the contents of this tensor subclass ({error}). hf_prefetch moves a "
                "tensor subclass (torchao) by swapping its contents, as nn.Module.to() does; drop weak references to "
                "the parameter (weakref, some caches), or keep it resident."
            ) from error

    def swap(self, tensor: torch.Tensor, value: torch.Tensor, what: str, phase: Phase = Phase.PLACE) -> None:
        """`torch.utils.swap_tensors(tensor, value)`: every name of a tied tensor sees the new contents."""
        swapped = [False]  # a second swap would redo the change: the undo swaps back only what was swapped

        def undo() -> None:
            if swapped[0]:
                torch.utils.swap_tensors(tensor, value)
                swapped[0] = False

        self.record(phase, what, undo)
        with deferred_interrupts():
            torch.utils.swap_tensors(tensor, value)
            swapped[0] = True

    def move_tensors(self, model: nn.Module, device: torch.device, skip: set[int]) -> None:
        """Every parameter and buffer (but those in `skip`, by id) onto `device`; undone by moving them back."""
        for name, param in model.named_parameters():
            if id(param) not in skip:
                for attr, tensor in _moved_parts(param):
                    if tensor.device != device:
                        self.place(param, tensor.to(device), f"{name} to {device}", attr)
        for module_name, module in model.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in skip and buffer.device != device:
                    self._set_buffer(module, name, buffer.to(device), f"{module_name}.{name} to {device}")

    def _set_buffer(self, module: nn.Module, name: str, value: torch.Tensor, what: str) -> None:
        previous, ref = module._buffers[name], weakref.ref(module)

        def undo() -> None:
            if (owner := ref()) is not None:
                owner._buffers[name] = previous

        self.record(Phase.PLACE, what, undo)
        module._buffers[name] = value

    # --- Modules ----------------------------------------------------------------------------------------------------

    def hook(self, module: nn.Module, hook: ModelHook, what: str) -> None:
        """Attach an accelerate hook (chained after one already there); undone by detaching it alone. A module whose
        hook a removal left passing through (`PassThrough`) gets the new hook in its place, under the forward set on
        top of it, and the undo puts the pass-through back."""
        # The forward accelerate's hook sets on the module, weakly (it holds the module).
        ref, forward = weakref.ref(module), []
        self.record(Phase.ATTACH, what, lambda: _remove_hook(ref(), hook, forward[0] if forward else None))
        with deferred_interrupts():  # add_hook_to_module sets several attributes
            if isinstance(getattr(module, "_hf_hook", None), PassThrough) and hasattr(module, "_old_forward"):
                hook.init_hook(module)
                module._hf_hook = hook
                forward.append(None)
            else:
                add_hook_to_module(module, hook, append=True)
                forward.append(weakref.ref(module.__dict__["forward"]))

    def handle(self, register: Callable[[], Any], what: str) -> None:
        """A torch hook that `register()` adds (`register_*_hook`, returning a handle); undone by `handle.remove()`
        (idempotent). The journal registers it, so that no hook is ever added without the step that removes it."""
        handles: list[Any] = []
        self.record(Phase.ATTACH, what, lambda: [handle.remove() for handle in handles])
        with deferred_interrupts():
            handles.append(register())

    def set_attribute(self, module: nn.Module, name: str, value: Any, what: str) -> None:
        """`module.<name> = value` in the instance's dict; undone by restoring what was there, or nothing. A value set
        since (`model.forward = torch.compile(model.forward)`) is someone else's: it is kept."""
        missing = object()
        previous, ref = module.__dict__.get(name, missing), weakref.ref(module)

        def undo() -> None:
            if (owner := ref()) is None or owner.__dict__.get(name, missing) is not value:
                return
            if previous is missing:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = previous

        self.record(Phase.ATTACH, what, undo)
        module.__dict__[name] = value


def _moved_parts(param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    # What moves a parameter to another device: `data` (a tensor subclass's `data` carries its inner tensors), and
    # for a bitsandbytes 4-bit parameter its quantization state's tensors too, as its own `.to()` moves them (an 8-bit
    # one's scales, which a dispatch keeps on the parameter: `bnb.following_state`).
    if bnb.is_params4bit(param) or bnb.is_int8(param):
        return bnb.storage_parts(param) or [("data", param.data)]
    return [("data", param.data)]


def _move(param: torch.Tensor, device: torch.device, attr: str = "data") -> None:
    tensor = get_part(param, attr)
    if tensor.device != device:
        assign(param, attr, tensor.to(device))


class PassThrough(ModelHook):
    """What a removal leaves as the accelerate hook of a module whose `forward` was set after the dispatch, on top of
    the hook's (diffusers' hooks, `FirstBlockCache`, `apply_layer_skip`): that forward calls accelerate's, which calls
    the module's own forward through this hook unchanged. Removing the hook instead would put the module's own forward
    back and drop the one set on top."""

    def __repr__(self) -> str:
        return "PassThrough()"


def _remove_hook(module: nn.Module | None, hook: ModelHook, installed: weakref.ref | None) -> None:
    # `installed`: the forward accelerate set with the hook (None: the hook took a pass-through's place).
    if module is None:
        return
    current = getattr(module, "_hf_hook", None)
    if current is hook and (installed is None or module.__dict__.get("forward") is not installed()):
        # A forward set on top of accelerate's calls it: the module keeps it, and a hook that changes nothing.
        if hasattr(module, "_old_forward"):
            module._hf_hook = PassThrough()
            return
    if current is hook:
        remove_hook_from_module(module)
        # accelerate puts the class's forward back as the instance attribute `module.forward`, a bound method of the
        # module: a reference cycle that keeps the layer (and its weights) alive after the model is deleted, until the
        # cyclic garbage collector runs. The class's forward needs no attribute.
        forward = module.__dict__.get("forward")
        if getattr(forward, "__self__", None) is module and forward.__func__ is type(module).forward:
            del module.__dict__["forward"]
    elif isinstance(current, SequentialHook) and hook in current.hooks:
        # accelerate has no call that removes one hook of a chain: `remove_hook_from_module` would detach the others
        # too (an AlignDevicesHook moves weights when detached). Keep the rest of the chain as it was.
        rest = [h for h in current.hooks if h is not hook]
        module._hf_hook = rest[0] if len(rest) == 1 else SequentialHook(*rest)


def move_tensors(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer onto `device` for good (the end of a removal: nothing to undo)."""
    for param in model.parameters():
        for attr, _ in _moved_parts(param):
            _move(param, device, attr)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


