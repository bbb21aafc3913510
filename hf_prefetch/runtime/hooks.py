"""The hooks that run inside a forward and call the engine. Installing and removing them is the journal's job
(lifecycle/journal.py); what they do is here. Policy lives in the plan and the engine, not here.

- `PrefetchHook` (an accelerate `ModelHook` on each streamed layer): before the layer runs its weights must be in its
  slot (`wait`); after it ran its slot goes to the next layer that uses it (`release`). Under torch.compile both steps
  are the custom ops of `ops.py`, so the decoder stack compiles into one graph. Where torch hooks run around the
  layer's forward, the forward gate's wrapper of its call waits before them and releases after them instead
  (`around_torch_hooks`).
- `RoutedHook` (on the experts module of a layer with routed expert tensors): before it runs, the rows of the experts
  its router picked are copied into the layer's slot (`gather`).
The model's forward gate is lifecycle/gate.py, the state-dict hooks lifecycle/state_dict.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.hooks import ModelHook, SequentialHook
from torch import nn
from torch.nn.modules import module as _torch_modules

from . import ops  # noqa: F401  (registers torch.ops.hf_prefetch)
from .engine import PrefetchEngine
from .host_experts import HostExperts

__all__ = ["PrefetchHook", "RoutedHook", "around_torch_hooks"]


class PrefetchHook(ModelHook):
    """Waits for a streamed layer's weights before its forward and starts the next copy into its slot after it."""

    def __init__(self, engine: PrefetchEngine, engine_id: int, ring: int, position: int, path: str) -> None:
        self.engine = engine
        self.engine_id = engine_id  # the engine's name for the custom ops
        self.ring = ring
        self.position = position
        self.path = path
        self._around = False  # inside `around`: the wait came before the call's torch hooks, the release comes after

    def pre_forward(self, module, *args, **kwargs):
        # transformers sometimes calls `pre_forward(module)` with no inputs: the signature accepts both.
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.wait, self.engine.wait, self, _input_anchor(args, kwargs))
        elif not self._around:
            _eager_step(self.engine.wait, self, "hf_prefetch.wait")
        return args, kwargs

    def post_forward(self, module, output):
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.release, self.engine.release, self, _first_tensor(output))
        else:
            if not self._around:
                _eager_step(self.engine.release, self, "hf_prefetch.release")
            if torch.is_grad_enabled():
                _refuse_backward(output, self.path)
        return output

    def around(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call of the layer (`call`: its `_call_impl`) whose torch forward hooks or pre-hooks run around its
        forward, eager: the wait before them, the release after them, so that a hook reads the layer's own weights
        (released first, its slot would be refilled with the next layer's, or on a GPU be copied into as it reads)."""
        if self._around:  # the layer called again from its own hooks: its weights are in place already
            return call(*args, **kwargs)
        _eager_step(self.engine.wait, self, "hf_prefetch.wait")
        self._around = True
        try:
            output = call(*args, **kwargs)
        finally:
            self._around = False
        _eager_step(self.engine.release, self, "hf_prefetch.release")
        return output

    def __repr__(self) -> str:
        return f"PrefetchHook({self.path}, ring={self.ring}, position={self.position})"


class RoutedHook(ModelHook):
    """On the experts module of a layer with ROUTED parameters: before it runs, the rows of the experts its router
    picked are copied into the layer's slot (`PrefetchEngine.gather`; see [Note: routed experts] in routed.py)."""

    def __init__(
        self,
        engine: PrefetchEngine,
        engine_id: int,
        ring: int,
        position: int,
        path: str,
        index_arg: str,
        host: HostExperts | None = None,
    ):
        self.engine = engine
        self.engine_id = engine_id
        self.ring = ring
        self.position = position
        self.path = path
        self.index_arg = index_arg
        self.host = host  # PrefetchConfig.cpu_experts: the module's twin on host storage

    def pre_forward(self, module, *args, **kwargs):
        index = kwargs.get(self.index_arg, args[1] if len(args) > 1 else None)
        if not isinstance(index, torch.Tensor):
            raise TypeError(
                f"hf_prefetch: the experts module {self.path} was called without the router's choice "
                f"({self.index_arg}, a tensor of expert indices), which its routed weights need; got "
                f"{type(index).__name__}."
            )
        if self.host is not None and not torch.compiler.is_compiling():
            self.host.pending = None  # a call that never reached its post_forward (an exception) left its part behind
        if torch.compiler.is_compiling():
            anchor = _input_anchor(args[:1], {k: v for k, v in kwargs.items() if k != self.index_arg})
            torch.ops.hf_prefetch.gather(anchor, index, self.engine_id, self.ring, self.position)
        elif self.host is not None and self.engine.computes_on_host(self.host) and self.host.as_dispatched(module):
            args, kwargs = self.engine.experts_on_host(
                self.ring, self.position, self.host, self.index_arg, args, kwargs
            )
        else:
            _eager_step(self.engine.gather, self, "hf_prefetch.gather", index)
        return args, kwargs

    def post_forward(self, module, output):
        if self.host is not None and self.host.pending is not None and not torch.compiler.is_compiling():
            output = self.engine.experts_joined(self.ring, self.position, self.host, output)
        return output

    def __repr__(self) -> str:
        return f"RoutedHook({self.path}, ring={self.ring}, position={self.position})"


def around_torch_hooks(module: nn.Module, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A call of a streamed layer (`call`: its `_call_impl`, from the forward gate): where torch forward hooks or
    pre-hooks of its own or global ones run around its forward (a user's `register_forward_hook`), eager, its weights
    are in place for them too (`PrefetchHook.around`). Any other call runs as it is."""
    if (
        not (
            module._forward_hooks
            or module._forward_pre_hooks
            or _torch_modules._global_forward_hooks
            or _torch_modules._global_forward_pre_hooks
        )
        or torch.compiler.is_compiling()
    ):
        return call(*args, **kwargs)
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    prefetch = next((h for h in hooks if isinstance(h, PrefetchHook)), None)
    return call(*args, **kwargs) if prefetch is None else prefetch.around(call, *args, **kwargs)


def _refuse_backward(output: Any, path: str) -> None:
    def refuse(grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"Backward through {path}, a layer streamed by hf_prefetch: its parameters live in buffer slots shared "
            "with other layers and get no gradients. hf_prefetch is for inference: run under torch.no_grad() (or "
            "torch.inference_mode()), or call hf_prefetch.remove_offload(model) before training."
        )

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(refuse)


def _eager_step(step, hook: PrefetchHook | RoutedHook, label: str, *extra: Any) -> None:
    # The engine's step for the hook's layer, named in profiler traces when a profiler is on.
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            step(hook.ring, hook.position, *extra)
    else:
        step(hook.ring, hook.position, *extra)


def _compiled_step(op, step, hook: PrefetchHook, anchor: torch.Tensor | None) -> None:
    if anchor is not None:
        op(anchor, hook.engine_id, hook.ring, hook.position)
    else:  # nothing to order the op by (a layer called without tensor inputs): the engine's step, outside the graph
        _run_outside_graph(step, hook.ring, hook.position)


def _run_outside_graph(step, *args) -> None:
    # A graph break: the step runs in Python on every call of the compiled code.
    outside_graph()(step, *args)


def outside_graph() -> Callable[..., Any]:
    # Made on first use: torch.compiler.disable imports dynamo, which `import hf_prefetch` must not. A dispatch makes
    # it (`ForwardGate.guard`), so that dynamo never traces its making.
    global _outside
    if _outside is None:
        _outside = torch.compiler.disable(lambda step, *args: step(*args))
    return _outside


_outside = None


def _input_anchor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # The tensor the layer's weight reads depend on: its hidden states, else its first tensor input. An anchor the
    # weights do not meet (an attention mask) would not keep the weight reads after the wait.
    hidden = kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) else _first_tensor((args, kwargs))


def _first_tensor(value) -> torch.Tensor | None:
    """The first tensor in a layer's inputs or output (nested in tuples, lists, dicts or a ModelOutput)."""
    return next(_tensors(value), None)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
        return
    if isinstance(value, dict):  # ModelOutput is a dict too
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


# --- state_dict and load_state_dict ------------------------------------------------------------------------------
