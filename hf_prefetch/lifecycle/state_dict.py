"""`state_dict()` and `load_state_dict()` of a dispatched model: a streamed parameter's slot holds whichever layer ran
last, so `state_dict` reports host values and `load_state_dict` writes through to host storage. The hooks that do it,
installed by the dispatch (lifecycle/attach.py): host storage made private before it is handed out, one
`load_state_dict` at a time under the model's lock, and a compressed parameter's new value refused before anything is
written when it does not fit its layout."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..formats import lossless
from ..formats.bnb import host_state_dict, is_int8, is_params4bit
from ..formats.parts import set_part, with_inner
from ..host.arena import own_storage
from ..host.offloaded import OffloadedParam, encode_for, host_value, unencodable_error, write_encoded
from ..interrupts import held_in_turns
from ..runtime.engine import PrefetchEngine

__all__ = [
    "host_values_in_state_dict",
    "Streamed",
    "WriteThrough",
    "writable_host_storage",
    "one_load_at_a_time",
    "refuse_unencodable",
]


def host_values_in_state_dict(
    hosts: dict[str, list[OffloadedParam]],
    writable: Callable[[nn.Module], None],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
) -> None:
    """`state_dict()` hook of a module that owns streamed parameters (`hosts`: their names in it, each with its
    tensors): a streamed parameter's slot holds whichever layer ran last; its value is in host storage (decoded where
    compressed; a tensor subclass rebuilt around its inner tensors' host storage). `writable(module)` first: host
    storage that is a file's pages becomes private memory before it is handed out ([Note: mapped host storage] in
    host/arena.py), and the module's values in place or assigned anew reach it ([Note: weights in place] in
    in_place.py)."""
    if any(prefix + name in state_dict for name in hosts):
        writable(module)
    for name, tensors in hosts.items():
        if prefix + name not in state_dict:
            continue
        values = {o.inner: own_storage(host_value(o)) for o in tensors}  # each saved alone (host.own_storage)
        if is_params4bit(tensors[0].param):  # its quantization state's entries too, as Linear4bit saves them
            host_state_dict(tensors[0].param, values, prefix + name, state_dict)
        elif is_int8(tensors[0].param):  # its values, and its scales under the module's key, as Linear8bitLt saves
            state_dict[prefix + name] = values["data"]
            if prefix + "SCB" in state_dict:
                state_dict[prefix + "SCB"] = values["SCB"]
        elif tensors[0].inner is None:
            state_dict[prefix + name] = values[None]
        else:  # a tensor subclass rebuilt around its inner tensors
            state_dict[prefix + name] = with_inner(tensors[0].param, values)


class Streamed(NamedTuple):
    name: str  # in the module that owns it
    offloaded: OffloadedParam
    slot_buffer: torch.Tensor
    ring: int
    position: int


class WriteThrough:
    """`load_state_dict` on a module that owns streamed parameters writes their host storage, not their slots.

    Before the module loads, the layers it will write lose their slots (an interrupt from then on leaves them to load
    their new values, a miss) and each streamed parameter the state dict names points at its host tensor, so torch's
    own loading (its checks, casts, strict and missing/unexpected keys) writes the true value. After it loaded, the
    parameters point at their slots again. If the load is interrupted before that, the next forward completes it
    (`complete`). See [Note: rewriting weights] in loading/reload.py.
    """

    def __init__(
        self,
        engine: PrefetchEngine,
        private_host: Callable[[], None],
        streamed: list[Streamed],
        in_place: Any = None,
    ) -> None:
        self.engine = engine
        self.private_host = private_host  # `OffloadState.private_host_storage`
        self.streamed = streamed
        # The dispatch's `WeightsInPlace`: a parameter assigned anew is taken first; one a `weights_in_place` block
        # placed loads into its value in place, which the block's end writes back.
        self.in_place = in_place
        self.loading: list[Streamed] = []  # pointed at host storage by `before`, until `complete`
        self.held: list[tuple[int, int]] = []  # (ring, position) of the layers that held their slot before

    def before(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        loading = [s for s in self.streamed if prefix + s.name in state_dict]
        if self.in_place is not None and loading:
            self.in_place.adopt(self.in_place.of(module))
            loading = [s for s in loading if id(s.offloaded) not in self.in_place.placed]
        if not loading:
            return
        self.private_host()  # host storage that is a file's pages: private memory first
        self.engine.drain()  # no copy may still read the host storage about to be written
        layers = list(dict.fromkeys((s.ring, s.position) for s in loading))
        self.held += [layer for layer in layers if self.engine.holds(*layer)]
        for layer in layers:
            self.engine.invalidate(*layer)
        self.loading += loading
        for streamed in loading:
            # A compressed parameter loads into a decoded copy, encoded into host storage by `complete`.
            set_part(streamed.offloaded.param, streamed.offloaded.attr, host_value(streamed.offloaded))

    def after(self, module: nn.Module, incompatible_keys: Any) -> None:
        self.complete()

    def complete(self) -> None:
        """Point the parameters of a finished (or interrupted) load back at their slots, after encoding the new
        values of compressed ones into host storage (all of them before the first write: values that do not fit a
        layout leave every one unwritten, and raise). Idempotent: a parameter leaves `loading` only once it points at
        its slot again, so that what an interrupt stopped is done by the next call (the next forward's)."""
        try:
            encoded = [
                (s.offloaded, encode_for(s.offloaded, s.offloaded.param.data))
                for s in self.loading
                if s.offloaded.layout is not None
            ]
            for offloaded, value in encoded:
                write_encoded(offloaded, value)
        finally:
            while self.loading:
                streamed = self.loading[-1]
                set_part(streamed.offloaded.param, streamed.offloaded.attr, streamed.slot_buffer)
                self.loading.pop()
            while self.held:  # copy the new values into the slots the layers held
                self.engine.load(*self.held[-1])
                self.held.pop()


def writable_host_storage(state_ref: weakref.ref, lock: threading.RLock, module: nn.Module | None = None) -> None:
    """Before host storage is handed out (`state_dict` of `module`'s parameters), under the model's `lock`: if any of
    it is still a checkpoint file's pages, turn it into private memory (`OffloadState.private_host_storage`; [Note:
    mapped host storage] in host/arena.py); the values a `weights_in_place` block holds, and those assigned anew, are
    written to it ([Note: weights in place] in in_place.py). A no-op for a state that has ended."""
    state = state_ref()
    if state is None:
        return
    with held_in_turns(lock):
        if state.listing:  # reload_weights lists destinations, and makes host storage private itself
            return
        if state.arena.file_bytes or state.reads_files:
            state.private_host_storage()  # refused for layers read from files (`FILES_READ_ONLY`)
        if state.in_place is not None:
            state.in_place.settle(module)


def one_load_at_a_time(module: nn.Module, lock: threading.RLock) -> Callable[..., Any]:
    """A `load_state_dict` for the instance dict of a module above streamed parameters: the module's own (set on the
    instance before, else the class's) under the model's `lock`, so that the write-through (`WriteThrough`) never runs
    beside a forward, a reload or a re-dispatch in another thread, and whatever leaves the load (an error, a Ctrl-C)
    releases the lock."""
    inner = module.__dict__.get("load_state_dict")
    module_ref = weakref.ref(module)  # the module holds this function

    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        owner = module_ref()
        with held_in_turns(lock):
            if inner is not None:
                return inner(*args, **kwargs)
            return type(owner).load_state_dict(owner, *args, **kwargs)

    functools.update_wrapper(load_state_dict, inner if inner is not None else type(module).load_state_dict)
    return load_state_dict


def refuse_unencodable(
    compressed: dict[str, OffloadedParam], module: nn.Module, state_dict: dict, prefix: str, *args: Any
) -> None:
    """`load_state_dict` pre-hook on every module that contains a compressed parameter (`compressed`: by their names
    in it). On the module `load_state_dict` was called on (prefix ""), before torch writes anything, every new value of
    a compressed parameter is checked against its layout: one that does not fit is refused with nothing written."""
    if prefix:
        return
    for name, offloaded in compressed.items():
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(offloaded.param.shape):
            continue  # torch reports it (or skips it) as it loads
        found = lossless.escapes(value.detach().to("cpu", offloaded.layout.dtype))
        if found > offloaded.layout.capacity:
            raise ValueError(unencodable_error(offloaded, found))
