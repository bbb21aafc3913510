"""Every change hf_prefetch makes to a model, as a journal of reversible steps.

[Note: the journal]
A dispatch changes a model in many small steps: tensors moved to the device or into host storage, parameters pointed
at buffer slots or mapped views, hooks attached, methods guarded, attributes set. Each step is made through a
`Journal` method, which makes the change and records how to undo it. Steps are of two phases:
- PLACE steps move or recast weights (a parameter into host storage, a resident tensor onto the device, a loaded
  value swapped in). Only a failed dispatch undoes them (`Journal.unwind(Phase.PLACE)`), back to the model as given.
- ATTACH steps wire the dispatch (pointers to slots, hooks, guards, `hf_device_map`). `remove_offload`, a
  re-dispatch, and the collection of a deleted model undo them (`Journal.unwind(Phase.ATTACH)`) and keep the weights'
  values where they are.
Undoing runs the steps newest first, and removes a step from the journal only after its undo completed; every undo is
idempotent. A KeyboardInterrupt (or any exception) that lands in the middle therefore leaves a journal that the next
`remove_offload` or `dispatch_model` resumes, never a step done twice or skipped. Real Ctrl-C's are also held back
for the length of each undo (`deferred_interrupts`).

The journal holds modules by weak reference: the model holds its state, which holds the journal, and a strong
reference back would keep a deleted model, its buffer pool and its pinned memory alive until the cyclic garbage
collector ran. Tensors are held strongly (they do not refer to their modules).

This is the only module that assigns `param.data`, replaces buffers or attaches hooks; it knows nothing about plans,
streams or checkpoints.
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module
from torch import nn

__all__ = ["Journal", "Phase", "deferred_interrupts", "move_tensors"]


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

    def point(self, phase: Phase, param: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
        """`param.data = tensor`; undone by pointing it back at the tensor it had."""
        previous = param.data
        param.data = tensor
        self.record(phase, what, lambda: setattr(param, "data", previous))

    def place(self, param: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
        """`param.data = tensor` for good (its old storage is dropped now); undone by copying the value back to the
        device it was on."""
        origin = param.device
        param.data = tensor
        self.record(Phase.PLACE, what, lambda: _move(param, origin))

    def swap(self, tensor: torch.Tensor, value: torch.Tensor, what: str) -> None:
        """`torch.utils.swap_tensors(tensor, value)`: every name of a tied tensor sees the new contents."""
        torch.utils.swap_tensors(tensor, value)
        self.record(Phase.PLACE, what, lambda: torch.utils.swap_tensors(tensor, value))

    def freeze(self, param: nn.Parameter, what: str) -> None:
        """`requires_grad=False` while dispatched (slot storage is shared between layers)."""
        flag = param.requires_grad
        param.requires_grad_(False)

        def undo() -> None:
            # An inference tensor (a model built under torch.inference_mode) takes requires_grad only inside one.
            with torch.inference_mode(param.is_inference()):
                param.requires_grad_(flag)

        self.record(Phase.ATTACH, what, undo)

    def move_tensors(self, model: nn.Module, device: torch.device, skip: set[int]) -> None:
        """Every parameter (but those in `skip`, by id) and buffer onto `device`; undone by moving them back."""
        for name, param in model.named_parameters():
            if id(param) not in skip and param.device != device:
                self.place(param, param.data.to(device), f"{name} to {device}")
        for module_name, module in model.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    self._set_buffer(module, name, buffer.to(device), f"{module_name}.{name} to {device}")

    def _set_buffer(self, module: nn.Module, name: str, value: torch.Tensor, what: str) -> None:
        previous, ref = module._buffers[name], weakref.ref(module)
        module._buffers[name] = value

        def undo() -> None:
            if (owner := ref()) is not None:
                owner._buffers[name] = previous

        self.record(Phase.PLACE, what, undo)

    # --- Modules ----------------------------------------------------------------------------------------------------

    def hook(self, module: nn.Module, hook: ModelHook, what: str) -> None:
        """Attach an accelerate hook (chained after one already there); undone by detaching it alone."""
        add_hook_to_module(module, hook, append=True)
        ref = weakref.ref(module)
        self.record(Phase.ATTACH, what, lambda: _remove_hook(ref(), hook))

    def handle(self, handle: Any, what: str) -> None:
        """A torch hook handle (`register_*_hook`); undone by `handle.remove()` (idempotent)."""
        self.record(Phase.ATTACH, what, handle.remove)

    def set_attribute(self, module: nn.Module, name: str, value: Any, what: str) -> None:
        """`module.<name> = value` in the instance's dict; undone by restoring what was there, or nothing."""
        missing = object()
        previous, ref = module.__dict__.get(name, missing), weakref.ref(module)
        module.__dict__[name] = value

        def undo() -> None:
            if (owner := ref()) is None:
                return
            if previous is missing:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = previous

        self.record(Phase.ATTACH, what, undo)


def _move(param: torch.Tensor, device: torch.device) -> None:
    if param.device != device:
        param.data = param.data.to(device)


def _remove_hook(module: nn.Module | None, hook: ModelHook) -> None:
    if module is None:
        return
    current = getattr(module, "_hf_hook", None)
    if current is hook:
        remove_hook_from_module(module)
    elif isinstance(current, SequentialHook) and hook in current.hooks:
        # accelerate has no call that removes one hook of a chain: `remove_hook_from_module` would detach the others
        # too (an AlignDevicesHook moves weights when detached). Keep the rest of the chain as it was.
        rest = [h for h in current.hooks if h is not hook]
        module._hf_hook = rest[0] if len(rest) == 1 else SequentialHook(*rest)


def move_tensors(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer onto `device` for good (the end of a removal: nothing to undo)."""
    for param in model.parameters():
        _move(param, device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then raise it. In the main thread only (signal handlers can
    be set nowhere else); elsewhere, and when SIGINT is not Python's default handler, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # no signal support in this interpreter
        yield
        return
    if previous is not signal.default_int_handler:
        yield
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt
