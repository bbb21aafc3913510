"""The model's forward gate: one forward at a time across threads, a half-done dispatch refusing to compute, and the
engine's `prepare` / `finish` around each forward, outside any compiled graph; and the pre-hook that holds forwards
back while a dispatch is replaced (`waits_then_refuses`)."""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..interrupts import deferred_interrupts, held_in_turns, take_in_turns
from ..runtime.hooks import outside_graph
from .state import STATE_ATTR, Lifecycle, OffloadState

__all__ = ["ForwardGate", "waits_then_refuses"]

_REPLACED = (
    "Another thread removed or replaced this model's hf_prefetch dispatch while this forward waited for it "
    "(remove_offload, dispatch_model(replace=True)): nothing was computed. Call the model again."
)


def _half_done(state: OffloadState) -> str:
    return (
        f"This model's hf_prefetch dispatch is half-done ({state.lifecycle.value}: an interrupt or an error stopped "
        "it). Call hf_prefetch.remove_offload(model) to finish undoing it, then dispatch again."
    )


def waits_then_refuses(lock: threading.RLock, owner: int) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook for the time a model has no forward gate while thread `owner` replaces its dispatch under
    its `lock` (`attach.forwards_held`): a forward another thread starts then waits for the lock, and then refuses,
    as one that waited in the old gate does (half-done if the replacement stopped half-way). A forward of the owner
    itself (the lock is re-entrant) refuses at once."""

    def wait_then_refuse(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == owner:
            raise RuntimeError(
                "This model's hf_prefetch dispatch is being replaced by this thread (dispatch_model): it cannot run "
                "a forward until the replacement ends."
            )
        with lock:
            state = module.__dict__.get(STATE_ATTR)
        if state is not None and state.lifecycle is not Lifecycle.ATTACHED:
            raise RuntimeError(_half_done(state))
        raise RuntimeError(_REPLACED)

    return wait_then_refuse


class ForwardGate:
    """The model's gate: its `_call_impl` and its `forward`, wrapped (`guard`, set on the module's instance dict for as
    long as the dispatch's state lives, from its first change to the last step of its removal):

    - One forward at a time: a second thread's forward waits for the first to end (the slots hold one forward's
      layers at a time, so interleaved forwards would compute with each other's weights). Re-entrant in one thread.
    - A model whose dispatch or removal was interrupted refuses to compute until `remove_offload` finished it.
    - `engine.prepare()` before and `engine.finish()` after each forward, outside any compiled graph (under
      torch.compile dynamo runs the wrappers in Python and compiles what they wrap, so these run around each call of
      the compiled code, each CUDA-graph replay); pending write-throughs of an interrupted `load_state_dict` are
      completed first.

    A call of the model enters at `_call_impl`, which runs the model's hooks and its forward: whatever they raise, a
    KeyboardInterrupt included, the wrapper's `finally` leaves the gate (torch runs an `always_call` forward hook for
    an Exception only, so a gate made of hooks would stay held after a Ctrl-C in a hook). The forward wrapper gates a
    direct `model.forward(...)`, and a call where the first is bypassed (`model.compile()` before the dispatch); under
    the first it passes through. If the forward wrapper is taken away (accelerate's `remove_hook_from_module` puts back
    the forward it had saved), calls of the model stay gated.

    The parts of the model that run streamed layers (the decoder, a streamed layer) are guarded too (`guard(part,
    name, model)`): inside the gate they pass through; called on their own, they enter as a call of the model would.
    """

    def __init__(self, state: OffloadState, lock: threading.RLock) -> None:
        self._state = weakref.ref(state)  # the state holds the gate (`OffloadState.gate`)
        self._lock = lock  # the model's (`state.model_lock`), shared with the verbs that change the dispatch
        # Per thread: `depth`, `called` (the depth a call wrapper entered at) and `caller` (its module's id).
        self._local = threading.local()

    def guard(
        self,
        module: nn.Module,
        name: str,
        model: nn.Module | None = None,
        around: Callable[..., Any] | None = None,
    ) -> Callable[..., Any]:
        """The gated `name` ("_call_impl" or "_compiled_call_impl": a call of the module; "forward") for the module's
        instance dict: the one set on the instance before, else the class's, between `_enter` and `_leave`. `model`:
        the dispatched model, where `module` is a part of it that holds streamed layers (its decoder, a layer): a call
        of the part inside a forward of the model passes through, one on its own (`model.model(ids)`) enters.
        `around(module, call, *args, **kwargs)`: what runs the gated call (a streamed layer's: `around_torch_hooks`,
        runtime/hooks.py), where it is not the plain call."""
        inner = module.__dict__.get(name)
        # Weak references: the module holds this function, and so may a caller (`model.compile()`, a forward set on top
        # of it) long after the dispatch left; the state holds the gate.
        module_ref, gate_ref, lock = weakref.ref(module), weakref.ref(self), self._lock
        model_ref = weakref.ref(model) if model is not None else module_ref
        part = model is not None
        calls = name != "forward"
        token = id(module)  # which module's call entered (`caller` in the thread's state): a plain int to compare
        run_outside = outside_graph()  # made here, not while dynamo traces the call

        def gated(*args: Any, **kwargs: Any) -> Any:
            owner, top, gate = module_ref(), model_ref(), gate_ref()
            if owner is None or (top is None and not part):
                raise RuntimeError(f"This {name} belonged to a model that no longer exists.")
            # The class's function bound with `partial`, not `__get__`: dynamo, tracing a part's wrapper inside a
            # compiled call, took `type(owner)._call_impl.__get__(owner)` for the instance's attribute (this wrapper).
            wrapped = inner if inner is not None else functools.partial(getattr(type(owner), name), owner)
            if top is None:  # a part kept after its model was collected, which undid the dispatch: nothing to gate
                return wrapped(*args, **kwargs)
            if gate is None or not gate.guards(top):
                # Kept by a caller after its dispatch left (`model.compile()` captured it, a forward set on top of
                # it), or fetched by a call that started just before: a change under way ends first, then it runs
                # under the model's dispatch now, if any (whose `_enter` refuses if it changes again meanwhile).
                with held_in_turns(lock):
                    current = top.__dict__.get(STATE_ATTR)
                    if current is None:
                        return wrapped(*args, **kwargs)
                    gate = current.gate
            # A call of the module enters; what runs under it for the same call (another call wrapper kept by
            # `model.compile()`, then the forward) passes through, the forward marking the call as done; a forward
            # called on its own (directly, or where the call's wrappers were bypassed) enters. A part of the model
            # passes through anywhere inside the gate.
            depth, local = gate.depth(), gate._local.__dict__
            if local.get("called") == depth > 0 and local.get("caller") == token:  # under this module's call
                if not calls:
                    local["called"] = None  # its forward: a call of the model from inside it enters again
                return wrapped(*args, **kwargs)
            if part and depth > 0:
                return wrapped(*args, **kwargs) if around is None else around(owner, wrapped, *args, **kwargs)
            called, caller = local.get("called"), local.get("caller")
            try:
                run_outside(gate._enter, top, _token_count(args, kwargs))
                if calls:
                    local["called"], local["caller"] = gate.depth(), token
                result = wrapped(*args, **kwargs) if around is None else around(owner, wrapped, *args, **kwargs)
                # Left inside the `try` when the call returns, so that a Ctrl-C landing as it leaves is one more the
                # `finally` leaves after (one landing as the `finally` began kept the model's lock for good).
                _leave_call(gate, depth, called, caller, run_outside)
                return result
            finally:
                if gate.depth() > depth or (local.get("called"), local.get("caller")) != (called, caller):
                    _leave_call(gate, depth, called, caller, run_outside)

        functools.update_wrapper(gated, inner if inner is not None else getattr(type(module), name))
        if not calls:
            gated.__signature__ = inspect.signature(module.forward)  # without `self`: generate() reads the arguments
        return gated

    def guards(self, module: nn.Module) -> bool:
        """Whether the gate's dispatch is `module`'s (half-done or not)."""
        state = self._state()
        return state is not None and module.__dict__.get(STATE_ATTR) is state

    def depth(self) -> int:
        """How many forwards of this thread are inside the gate (nested ones included)."""
        return self._local.__dict__.get("depth", 0)

    def _enter(self, module: nn.Module, tokens: int | None = None) -> None:
        # After a forward, or a verb changing the dispatch, in another thread; counted before a Ctrl-C can land.
        take_in_turns(self._lock, lambda: setattr(self._local, "depth", self.depth() + 1))
        try:
            state = self._state()
            if state is None or module.__dict__.get(STATE_ATTR) is not state:
                raise RuntimeError(_REPLACED)
            if state.lifecycle is not Lifecycle.ATTACHED:
                raise RuntimeError(_half_done(state))
            # [Note: mapped host storage] in host/arena.py: never compute with a changed file's pages.
            if state.arena.file_bytes:
                state.arena.check_files()
                state.private_before_graphs()
        except BaseException:
            self._leave(finish=False)  # refused: nothing was prepared
            raise
        try:
            for write_through in state.write_throughs:
                write_through.complete()
            if state.engine is not None:
                state.engine.prepare(tokens)
        except BaseException:
            self._leave(finish=True)
            raise

    def _leave(self, finish: bool) -> None:
        depth = self.depth()
        if depth == 0:
            return
        try:
            state = self._state()
            if finish and depth == 1 and state is not None and state.engine is not None:
                state.engine.finish()
        finally:
            with deferred_interrupts():
                self._local.depth = depth - 1
                self._lock.release()


def _leave_call(gate: ForwardGate, depth: int, called: Any, caller: Any, run_outside: Callable[..., Any]) -> None:
    # The end of a gated call that entered at `depth`: the thread's call marks put back, and the gate left if the
    # call entered it (else `_enter` refused, and left, or raised before taking the lock); with a Ctrl-C held back,
    # which here would leave the gate held. Idempotent.
    with deferred_interrupts():
        local = gate._local.__dict__
        local["called"], local["caller"] = called, caller
        if gate.depth() > depth:
            run_outside(gate._leave, True)


def _token_count(args: tuple, kwargs: dict) -> int | None:
    # The tokens a model's forward computes on (the largest of its id and embedding inputs); None where it has none.
    counts = []
    for position, name in enumerate(("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds")):
        value = kwargs.get(name, args[0] if position == 0 and args else None)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            counts.append(value.numel() // (value.shape[-1] if name.endswith("embeds") else 1))
    return max(counts) if counts else None
