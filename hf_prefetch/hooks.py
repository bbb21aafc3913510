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
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("hf_prefetch.wait"):
                self.engine.wait(self.ring, self.position)
        else:
            self.engine.wait(self.ring, self.position)
        return args, kwargs

    def post_forward(self, module, output):
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("hf_prefetch.release"):
                self.engine.release(self.ring, self.position)
        else:
            self.engine.release(self.ring, self.position)
        return output

    def __repr__(self) -> str:
        return f"PrefetchHook(ring={self.ring}, position={self.position})"
