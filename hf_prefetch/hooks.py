"""The accelerate hook on each streamed layer: the only code that runs inside a model's forward.

Before the layer runs its weights must be in its slot (`wait`); after it ran, its slot goes to the next layer that
uses it (`release`). Policy lives in the plan and the engine, not here. Under torch.compile both steps are the custom
ops of `hf_prefetch.ops`, so the decoder stack compiles into one graph.
"""

from __future__ import annotations

import torch
from accelerate.hooks import ModelHook

from . import ops  # noqa: F401  (registers torch.ops.hf_prefetch)
from .engine import PrefetchEngine

__all__ = ["PrefetchHook", "model_hooks"]


class PrefetchHook(ModelHook):
    """Waits for a streamed layer's weights before its forward and starts the next copy into its slot after it."""

    def __init__(self, engine: PrefetchEngine, engine_id: int, ring: int, position: int) -> None:
        self.engine = engine
        self.engine_id = engine_id  # the engine's name for the custom ops
        self.ring = ring
        self.position = position

    def pre_forward(self, module, *args, **kwargs):
        # transformers sometimes calls `pre_forward(module)` with no inputs: the signature accepts both.
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.wait, self.engine.wait, self, _input_anchor(args, kwargs))
        else:
            _eager_step(self.engine.wait, self, "hf_prefetch.wait")
        return args, kwargs

    def post_forward(self, module, output):
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.release, self.engine.release, self, _first_tensor(output))
        else:
            _eager_step(self.engine.release, self, "hf_prefetch.release")
        return output

    def __repr__(self) -> str:
        return f"PrefetchHook(ring={self.ring}, position={self.position})"


def model_hooks(engine: PrefetchEngine):
    """The model's own forward pre-hook and forward hook: `engine.prepare()` before every forward and
    `engine.finish()` after it, outside any compiled graph (under torch.compile each is a graph break at the model's
    entry or exit, so that it runs around each CUDA-graph replay)."""

    def prepare(module, args):
        _outside_any_graph(engine.prepare)

    def finish(module, args, output):
        _outside_any_graph(engine.finish)

    return prepare, finish


def _outside_any_graph(step) -> None:
    if torch.compiler.is_compiling():
        _run_outside_graph(step)
    else:
        step()


def _eager_step(step, hook: PrefetchHook, label: str) -> None:
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            step(hook.ring, hook.position)
    else:
        step(hook.ring, hook.position)


def _compiled_step(op, step, hook: PrefetchHook, anchor: torch.Tensor | None) -> None:
    if anchor is not None:
        op(anchor, hook.engine_id, hook.ring, hook.position)
    else:  # nothing to order the op by (a layer called without tensor inputs): the engine's step, outside the graph
        _run_outside_graph(step, hook.ring, hook.position)


def _run_outside_graph(step, *args) -> None:
    # A graph break. Made on first use: torch.compiler.disable imports dynamo, which `import hf_prefetch` must not.
    global _outside_graph
    if _outside_graph is None:
        _outside_graph = torch.compiler.disable(lambda step, *args: step(*args))
    _outside_graph(step, *args)


_outside_graph = None


def _input_anchor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # The tensor the layer's weight reads depend on: its hidden states, else its first tensor input. An anchor the
    # weights do not meet (an attention mask) would not keep the weight reads after the wait.
    hidden = kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) else _first_tensor((args, kwargs))


def _first_tensor(value) -> torch.Tensor | None:
    """The first tensor in a layer's inputs or output (nested in tuples, lists, dicts or a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):  # ModelOutput is a dict too
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None
