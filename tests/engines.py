"""A transfer engine's per-layer counters, read the same way by the tests that drive an engine directly."""

from __future__ import annotations

from hf_prefetch.runtime.engine import PrefetchEngine
from hf_prefetch.runtime.ring import LayerCounters


def counters(engine: PrefetchEngine, ring: int = 0) -> list[LayerCounters]:
    return [layer.counters for layer in engine.rings[ring].layers]


def copies(engine: PrefetchEngine, ring: int = 0) -> list[int]:
    return [c.copies for c in counters(engine, ring)]


def misses(engine: PrefetchEngine, ring: int = 0) -> int:
    return sum(c.misses for c in counters(engine, ring))
