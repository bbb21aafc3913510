"""The engine's steps as registered custom ops, so that torch.compile keeps them in the graph and in order.

Under `torch.compile` a hook cannot call the engine directly (dynamo would trace its stream and slot bookkeeping, or
break the graph at every layer). Instead the hook calls `torch.ops.hf_prefetch.wait` and `.release`: opaque to the
compiler, run with their real arguments each time the compiled code runs, and ordered by a data dependency: each op
declares that it mutates an anchor tensor (the layer's input for `wait`, its output for `release`), so every kernel
that reads the anchor afterwards runs after the op, and the op runs after every kernel that wrote it. Under CUDA-graph
capture the ops run once, while the graph is recorded; their copies and event waits become part of the graph. See
[Note: compile and CUDA graphs] in capture.py.

This module only maps an engine id to its engine; it knows nothing about models or hooks.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .engine import PrefetchEngine

__all__ = ["register_engine"]

_engines: weakref.WeakValueDictionary[int, PrefetchEngine] = weakref.WeakValueDictionary()
_next_id = itertools.count()


def register_engine(engine: PrefetchEngine) -> int:
    """Give `engine` an id the ops can name it by (ops take tensors and numbers, not Python objects)."""
    engine_id = next(_next_id)
    _engines[engine_id] = engine
    return engine_id


@torch.library.custom_op("hf_prefetch::wait", mutates_args=("anchor",))
def wait(anchor: torch.Tensor, engine: int, ring: int, position: int) -> None:
    """Order the compute stream after layer `position`'s copy (see `PrefetchEngine.wait`); `anchor` is its input."""
    running = _engines[engine]
    running.compiled = True  # compiled code calls the engine: CUDA graphs may record it from now on
    running.wait(ring, position)


@wait.register_fake
def _(anchor: torch.Tensor, engine: int, ring: int, position: int) -> None:
    return None


@torch.library.custom_op("hf_prefetch::release", mutates_args=("anchor",))
def release(anchor: torch.Tensor, engine: int, ring: int, position: int) -> None:
    """Hand layer `position`'s slot on (see `PrefetchEngine.release`); `anchor` is its output."""
    _engines[engine].release(ring, position)


@release.register_fake
def _(anchor: torch.Tensor, engine: int, ring: int, position: int) -> None:
    return None


# Declared to mutate the router's choice as well as the experts' input: every read of the routed weights in an experts
# forward either meets the hidden states or is indexed by something computed from the choice (`weight[index]`,
# grouped_mm's offsets, the eager loop's experts), so no such read can be scheduled before the rows are copied.
@torch.library.custom_op("hf_prefetch::gather", mutates_args=("anchor", "index"))
def gather(anchor: torch.Tensor, index: torch.Tensor, engine: int, ring: int, position: int) -> None:
    """Copy the routed experts' rows of layer `position` (see `PrefetchEngine.gather`); `anchor` is the experts'
    input, `index` the router's choice."""
    _engines[engine].gather(ring, position, index)


@gather.register_fake
def _(anchor: torch.Tensor, index: torch.Tensor, engine: int, ring: int, position: int) -> None:
    return None
