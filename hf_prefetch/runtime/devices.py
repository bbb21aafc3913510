"""Pipeline placement at run time: one engine per GPU behind the one interface the hooks call, and the pre-hook that
moves a run's inputs to its GPU."""

from __future__ import annotations

from collections.abc import Sequence

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

    # A ring's calls, on its GPU's engine.
    def prefetch(self, ring: int, position: int) -> None:
        engine, r = self._at(ring)
        engine.prefetch(r, position)

    def wait(self, ring: int, position: int) -> None:
        engine, r = self._at(ring)
        engine.wait(r, position)

    def release(self, ring: int, position: int) -> None:
        engine, r = self._at(ring)
        engine.release(r, position)

    def gather(self, ring: int, position: int, index: torch.Tensor) -> None:
        engine, r = self._at(ring)
        engine.gather(r, position, index)

    def holds(self, ring: int, position: int) -> bool:
        engine, r = self._at(ring)
        return engine.holds(r, position)

    def load(self, ring: int, position: int) -> None:
        engine, r = self._at(ring)
        engine.load(r, position)

    def encode_slot(self, ring: int, position: int) -> dict[int, torch.Tensor]:
        engine, r = self._at(ring)
        return engine.encode_slot(r, position)

    def store(self, ring: int, position: int, encoded: dict[int, torch.Tensor] | None = None) -> None:
        engine, r = self._at(ring)
        engine.store(r, position, encoded)

    def refresh(self, ring: int, position: int) -> None:
        engine, r = self._at(ring)
        engine.refresh(r, position)

    def invalidate(self, ring: int | None = None, position: int | None = None) -> None:
        if ring is None:
            for engine in self.engines:
                engine.invalidate()
            return
        engine, r = self._at(ring)
        engine.invalidate(r, position)

    # Every engine's.
    def prepare(self, tokens: int | None = None) -> None:
        for engine in self.engines:
            engine.prepare(tokens)

    def finish(self) -> None:
        for engine in self.engines:
            engine.finish()

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def synchronize(self) -> None:
        for engine in self.engines:
            engine.synchronize()

    def drain(self) -> None:
        for engine in self.engines:
            engine.drain()

    def refill(self) -> None:
        for engine in self.engines:
            engine.refill()

    def collect(self) -> None:
        for engine in self.engines:
            engine.collect()

    def reset(self) -> None:
        for engine in self.engines:
            engine.reset()
