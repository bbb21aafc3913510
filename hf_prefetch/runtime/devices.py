"""Pipeline placement at run time: one engine per GPU behind the one interface the hooks call, and the pre-hook that
moves a run's inputs to its GPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["DeviceEngines", "inputs_to"]


def inputs_to(device: torch.device, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook's body: the module's tensor arguments (in tuples, lists and dicts too) on `device`."""
    return _to(args, device), _to(kwargs, device)


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        # Between GPUs a copy is ordered on both devices' current streams: asynchronous for the host, never early.
        return value.to(device, non_blocking=value.device.type == device.type == "cuda")
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to(v, device) for v in value))
    if type(value) in (list, tuple):
        return type(value)(_to(v, device) for v in value)
    if type(value) is dict:
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _on_its_engine(name: str) -> Callable[..., Any]:
    # `PrefetchEngine.<name>(ring, position, ...)` on the engine of the ring's GPU, with the ring's index there.
    def call(self: DeviceEngines, ring: int, position: int, *args: Any, **kwargs: Any) -> Any:
        engine, local = self._at(ring)
        return getattr(engine, name)(local, position, *args, **kwargs)

    call.__name__, call.__qualname__ = name, f"DeviceEngines.{name}"
    return call


def _on_every_engine(name: str) -> Callable[..., None]:
    # `PrefetchEngine.<name>(...)` on every GPU's engine, in plan order.
    def call(self: DeviceEngines, *args: Any, **kwargs: Any) -> None:
        for engine in self.engines:
            getattr(engine, name)(*args, **kwargs)

    call.__name__, call.__qualname__ = name, f"DeviceEngines.{name}"
    return call


class DeviceEngines:
    """One `PrefetchEngine` per GPU of a pipeline placement, behind the interface of one: the rings in plan order, a
    ring's calls routed to its GPU's engine, the calls around a forward to every engine."""

    def __init__(self, engines: Sequence, ring_of: Sequence[tuple[int, int]]) -> None:
        self.engines = list(engines)
        self._ring_of = list(ring_of)  # plan ring -> (engine, its ring there)
        self.rings = [self.engines[e].rings[r] for e, r in self._ring_of]
        self.device = self.engines[0].device
        self.timing = self.engines[0].timing

    @property
    def graphs(self) -> bool:
        return any(engine.graphs for engine in self.engines)

    @property
    def compiled(self) -> bool:
        return any(engine.compiled for engine in self.engines)

    @compiled.setter
    def compiled(self, value: bool) -> None:  # set by the ops of compiled code (ops.wait)
        for engine in self.engines:
            engine.compiled = value

    @property
    def routing(self) -> bool:
        return self.engines[0].routing

    def _at(self, ring: int):
        e, r = self._ring_of[ring]
        return self.engines[e], r

    def invalidate(self, ring: int | None = None, position: int | None = None) -> None:
        if ring is None:
            for engine in self.engines:
                engine.invalidate()
            return
        engine, r = self._at(ring)
        engine.invalidate(r, position)

    # A ring's calls, on its GPU's engine; the calls around a forward, on every engine.
    prefetch = _on_its_engine("prefetch")
    wait = _on_its_engine("wait")
    release = _on_its_engine("release")
    gather = _on_its_engine("gather")
    holds = _on_its_engine("holds")
    load = _on_its_engine("load")
    encode_slot = _on_its_engine("encode_slot")
    store = _on_its_engine("store")
    refresh = _on_its_engine("refresh")
    prepare = _on_every_engine("prepare")
    finish = _on_every_engine("finish")
    start = _on_every_engine("start")
    synchronize = _on_every_engine("synchronize")
    drain = _on_every_engine("drain")
    refill = _on_every_engine("refill")
    collect = _on_every_engine("collect")
    reset = _on_every_engine("reset")
