"""The accelerate hook on each streamed layer: the only code that runs inside a model's forward.

Before the layer runs its weights must be in its slot (`wait`); after it ran, its slot goes to the next layer that
uses it (`release`). Policy lives in the plan and the engine, not here.
"""

from __future__ import annotations

import torch
from accelerate.hooks import ModelHook

from .engine import PrefetchEngine

__all__ = ["PrefetchHook"]


class PrefetchHook(ModelHook):
    """Waits for a streamed layer's weights before its forward and starts the next copy into its slot after it."""

    def __init__(self, engine: PrefetchEngine, ring: int, position: int) -> None:
        self.engine = engine
        self.ring = ring
        self.position = position

    def pre_forward(self, module, *args, **kwargs):
        # transformers sometimes calls `pre_forward(module)` with no inputs: the signature accepts both.
        _run(self.engine.wait, self.ring, self.position, "hf_prefetch.wait")
        return args, kwargs

    def post_forward(self, module, output):
        _run(self.engine.release, self.ring, self.position, "hf_prefetch.release")
        return output

    def __repr__(self) -> str:
        return f"PrefetchHook(ring={self.ring}, position={self.position})"


def _run(step, ring: int, position: int, label: str) -> None:
    if torch.compiler.is_compiling():
        # Under torch.compile the engine's stream and slot bookkeeping runs eagerly, outside the graph.
        _eager(step, ring, position)
    elif torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            step(ring, position)
    else:
        step(ring, position)


def _eager(step, ring: int, position: int) -> None:
    global _eager_step
    if _eager_step is None:
        _eager_step = torch.compiler.disable(lambda fn, r, p: fn(r, p))
    _eager_step(step, ring, position)


_eager_step = None
