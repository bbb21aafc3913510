"""Streamed weights where code outside the forward can read and write them: `weights_in_place`, and the streamed
parameters given a new value outside it (`WeightsInPlace.adopt`). The methods of other libraries that run through it
on their own are third_party.py's; the state-dict hooks that call it, state_dict.py's.

[Note: weights in place]
A streamed parameter points at its slot, which holds whichever layer of the slot ran last, so code outside the ring's
schedule (PEFT's merges, diffusers' fusions, an edit of a weight) reads or writes another layer's bytes there. Host
storage is the truth ([Note: rewriting weights] in loading/reload.py). `weights_in_place` gives such code the truth,
as FSDP's `summon_full_params` gives it the unsharded parameters:
1. Under the model's lock, for the whole block; host storage private ([Note: mapped host storage] in host/arena.py),
   every copy and kernel done (`drain`), parameters assigned anew before the block taken first (`adopt`).
2. The layers brought into place forget their slots (`invalidate`) before anything can be written: an interrupt from
   there on leaves them to load from host storage when they run (a miss), never a slot that claims stale bytes.
3. Each streamed parameter under the modules points at its true value: its host storage itself on the CPU (a write is
   a write of the truth, nothing is copied), a copy on its ring's device on CUDA (decoded where compressed).
4. At the block's end, and before a `state_dict()` inside it reads host storage, each value is compared with host
   storage by its bytes and what changed is written (encoded where compressed; a value that cannot be written leaves
   its parameter's old value, and raises once the others are written).
   Tensor version counters cannot tell: a write through `param.data` (PEFT's merges) bumps none. A parameter assigned
   anew (`.data = ...`, a new `nn.Parameter`) gives its value, which must keep the shape and dtype; the streamed
   parameter object stays in the model. Then the parameters point at their slots again and the layers that held
   their slots are copied again.
Outside a block, a streamed parameter assigned anew is taken the same way by whatever reads or rewrites host storage
next: `state_dict`, `load_state_dict`, `reload_weights`, `sync_from_device`, `remove_offload` and a re-dispatch
(forwards before that compute with the new value, as the module's own parameter).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..host.offloaded import OffloadedParam, encode_for, host_value, write_encoded
from ..interrupts import deferred_interrupts, held_in_turns
from ..planning.offload_plan import format_bytes
from .state import STATE_ATTR, Lifecycle, OffloadState
from .state_dict import Streamed

__all__ = ["WeightsInPlace", "weights_in_place"]


@dataclass
class _Placed:
    streamed: Streamed
    owner: weakref.ref
    working: torch.Tensor  # where the parameter points inside the block: host storage, or a copy of it


@dataclass
class _Block:
    placed: list[_Placed]  # what this block brought into place (not what an outer block did)
    held: list[tuple[int, int]]  # (ring, position) of those layers that held their slots before it


# Every live dispatch's registry, for `weights_in_place` of a module inside a dispatched model.
_LIVE: weakref.WeakSet[WeightsInPlace] = weakref.WeakSet()


class WeightsInPlace:
    """A dispatch's streamed parameters by the module that owns them, and those a `weights_in_place` block placed.
    See [Note: weights in place]."""

    def __init__(
        self, model: nn.Module, state: OffloadState, lock: threading.RLock, owned: dict[nn.Module, list[Streamed]]
    ) -> None:
        # The model and its state weakly: the state holds this.
        self._model, self._state = weakref.ref(model), weakref.ref(state)
        self.engine = state.engine  # a PrefetchEngine, or DeviceEngines under pipeline placement
        self.lock = lock  # the model's (`state.model_lock`)
        self.owned = [(weakref.ref(module), streamed) for module, streamed in owned.items()]
        self.placed: dict[int, _Placed] = {}  # by the id of the OffloadedParam
        _LIVE.add(self)

    def attached(self) -> bool:
        """Whether the dispatch still stands (a block may outlive it: `remove_offload` inside it)."""
        model, state = self._model(), self._state()
        return (
            model is not None
            and state is not None
            and model.__dict__.get(STATE_ATTR) is state
            and state.lifecycle is Lifecycle.ATTACHED
        )

    def half_done(self) -> bool:
        """Whether the dispatch is still the model's but an interrupt or an error left it half-done."""
        model, state = self._model(), self._state()
        return model is not None and model.__dict__.get(STATE_ATTR) is state and not self.attached()

    def private_host(self) -> None:
        # [Note: mapped host storage] in host/arena.py: before host storage is written.
        state = self._state()
        if state is not None:
            state.private_host_storage()

    def under(self, modules: set[int]) -> list[tuple[weakref.ref, Streamed]]:
        """The streamed parameters owned by the modules whose ids are `modules`."""
        return [(ref, s) for ref, streamed in self.owned if id(ref()) in modules for s in streamed]

    def of(self, module: nn.Module) -> list[tuple[weakref.ref, Streamed]]:
        return self.under({id(module)})

    # --- Blocks -----------------------------------------------------------------------------------------------------

    def place(self, entries: list[tuple[weakref.ref, Streamed]]) -> _Block:
        """Point the streamed parameters of `entries` (those not in place already) at their true values; returns
        them, for `unplace`. Call under the model's lock."""
        self.private_host()
        self.engine.drain()
        self.adopt(entries)
        new = [(ref, s) for ref, s in entries if id(s.offloaded) not in self.placed]
        for _, s in new:
            _check_plain(s.offloaded)
        _check_device_memory([s for _, s in new if not _on_host(s)])
        workings = [s.offloaded.host if _on_host(s) else _device_copy(s) for _, s in new]  # before any change
        layers = list(dict.fromkeys((s.ring, s.position) for _, s in new))
        block = _Block([], [layer for layer in layers if self.engine.holds(*layer)])
        for layer in layers:
            self.engine.invalidate(*layer)
        with deferred_interrupts():
            for (ref, s), working in zip(new, workings, strict=True):
                s.offloaded.param.data = working
                self.placed[id(s.offloaded)] = _Placed(s, ref, working)
                block.placed.append(self.placed[id(s.offloaded)])
        return block

    def unplace(self, block: _Block) -> None:
        """The end of a block: write what changed to host storage, point the parameters at their slots again, copy
        the layers that held their slots into them again."""
        if not self.attached():  # removed or re-dispatched inside the block, which wrote it back first
            for p in block.placed:
                self.placed.pop(id(p.streamed.offloaded), None)
            return
        try:
            self.write_back(block.placed)
        finally:
            with deferred_interrupts():
                for p in block.placed:
                    _put_back(p.owner, p.streamed, p.streamed.slot_buffer)
                    self.placed.pop(id(p.streamed.offloaded), None)
            for layer in block.held:
                self.engine.load(*layer)

    def write_back(self, placed: list[_Placed]) -> None:
        """Write the values of placed parameters that differ from host storage; the parameters stay in place. A value
        that cannot be written (another shape or dtype, a compressed one that does not fit its layout) leaves its
        parameter's host storage as it was and raises once the others are written."""
        self.engine.drain()
        # Forgotten before the first write, also where a forward inside the block copied them into their slots.
        for layer in dict.fromkeys((p.streamed.ring, p.streamed.position) for p in placed):
            self.engine.invalidate(*layer)
        changed = []  # (placed, new value)
        for p in placed:
            value = _assigned(p.owner, p.streamed, p.working)
            if value is None and p.working is not p.streamed.offloaded.host:
                if not _same_bytes(p.working, host_value(p.streamed.offloaded)):
                    value = p.working
            if value is not None:
                changed.append((p, value))
        errors = []
        with deferred_interrupts():
            for p, value in changed:
                try:
                    _write([(p.streamed, value)])
                except ValueError as error:
                    errors.append(str(error))
                    if p.working is not p.streamed.offloaded.host:
                        p.working.copy_(host_value(p.streamed.offloaded))  # its old value, as host storage has it
                else:
                    if value is not p.working and p.working is not p.streamed.offloaded.host:
                        p.working.copy_(value)  # an assigned value, in the block's copy
                _put_back(p.owner, p.streamed, p.working)
        if errors:
            raise ValueError(" ".join(errors))

    # --- Outside blocks ---------------------------------------------------------------------------------------------

    def adopt(self, entries: list[tuple[weakref.ref, Streamed]] | None = None) -> None:
        """Streamed parameters given a new value since the dispatch (`.data = ...`, a new `nn.Parameter` in their
        module) that are not in place: the value written to host storage, the parameter back at its slot. Every value
        is checked before the first write. `entries`: every streamed parameter when None."""
        if entries is None:
            entries = [(ref, s) for ref, streamed in self.owned for s in streamed]
        found = []
        for ref, s in entries:
            if id(s.offloaded) in self.placed or not _plain(s.offloaded):
                continue  # in place (a block's end takes it), or stored as several tensors (left as it is)
            value = _assigned(ref, s, s.slot_buffer)
            if value is not None:
                found.append((ref, s, value))
        if not found:
            return
        self.private_host()
        self.engine.drain()
        layers = list(dict.fromkeys((s.ring, s.position) for _, s, _ in found))
        held = [layer for layer in layers if self.engine.holds(*layer)]
        _check_values([(s, value) for _, s, value in found])
        for layer in layers:
            self.engine.invalidate(*layer)
        _write([(s, value) for _, s, value in found])
        with deferred_interrupts():
            for ref, s, _ in found:
                _put_back(ref, s, s.slot_buffer)
        for layer in held:
            self.engine.load(*layer)

    def settle(self, module: nn.Module | None = None) -> None:
        """Before host storage is read or rewritten (for `module`'s parameters, every one when None): placed values
        written back, assigned ones taken."""
        entries = self.of(module) if module is not None else [(r, s) for r, ss in self.owned for s in ss]
        placed = [self.placed[id(s.offloaded)] for _, s in entries if id(s.offloaded) in self.placed]
        if placed:
            self.private_host()
            self.write_back(placed)
        self.adopt(entries)

    def refuse_inside(self, verb: str) -> None:
        """`verb` rewrites host storage and slots directly: not inside a block."""
        if self.placed:
            raise RuntimeError(
                f"{verb} inside hf_prefetch.weights_in_place(...): the block's parameters point at their true values, "
                f"not at their slots, and its end writes them back over what {verb} writes. Call {verb} after the "
                "block (or write the weights inside it, through the parameters)."
            )


@contextlib.contextmanager
def weights_in_place(*modules: nn.Module) -> Iterator[None]:
    """Bring the true weights of the streamed layers under `modules` into place for the block, and keep what it
    writes.

    A streamed parameter points at a buffer slot that the layers of its slot take turns in, so outside its layer's
    forward it shows whichever layer ran last. Inside the block each streamed parameter of the modules (and of the
    modules inside them) holds its own value: its host storage itself when the model runs on the CPU, a copy on the
    execution device on a GPU. Code may read them, write them in place (`weight.data += delta`, `weight.mul_(2)`) or
    assign new values of the same shape and dtype (`weight.data = ...`, `module.weight = nn.Parameter(...)`). At the
    end of the block every value that changed is written to host storage, so later forwards, `state_dict()`,
    `save_pretrained` and `remove_offload` see it, and the parameters point at their slots again. Use it for code
    that touches weights outside the forward, as FSDP's `summon_full_params`. PEFT's `merge_adapter`,
    `unmerge_adapter`, `merge_and_unload` and diffusers' `fuse_qkv_projections` run through it on their own, one layer
    at a time; PEFT's `add_weighted_adapter` over adapters that stream with their layers needs the block.

    The block holds the model's lock: forwards from other threads wait for its end; a forward inside it computes with
    the values in place. A no-op for modules of no dispatched model, and with the UVA backend (whose parameters read
    their host memory). Blocks nest.

    Args:
        modules (`nn.Module`): A dispatched model, a module of one (a streamed layer, one of its linears), or a module
            that holds dispatched models (a `PeftModel`). On a GPU the true weights of every streamed layer under
            them are copied to the device at once: bring a few layers into place at a time when they do not fit.

    Raises:
        `ValueError` (nothing changed) when the copies do not fit the device's free memory, or for a parameter stored
        as several tensors (bitsandbytes, torchao); `RuntimeError` for a half-done dispatch. At the block's end,
        `ValueError` for an assigned value of another shape or dtype, or a compressed parameter's value that does not
        fit its layout: that parameter keeps its old value, the others are written.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=64)
    >>> model = hf_prefetch.dispatch_model(LlamaForCausalLM(config).eval(),
    ...     hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1), device="cpu")
    >>> host = model.state_dict()["model.layers.2.mlp.down_proj.weight"].clone()
    >>> torch.equal(model.model.layers[2].mlp.down_proj.weight, host)  # its slot holds layer 0 now
    False
    >>> with hf_prefetch.weights_in_place(model.model.layers[2]):
    ...     down = model.model.layers[2].mlp.down_proj.weight
    ...     print(torch.equal(down, host))
    ...     down.data *= 2
    True
    >>> torch.equal(model.state_dict()["model.layers.2.mlp.down_proj.weight"], 2 * host)
    True
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"weights_in_place takes modules; got {type(module).__name__}.")
    ids = {id(m) for module in modules for m in module.modules()}
    found = sorted(((r, r.under(ids)) for r in list(_LIVE)), key=lambda item: id(item[0]))
    found = [(registry, entries) for registry, entries in found if entries]
    with contextlib.ExitStack() as stack:
        for registry, entries in found:
            stack.enter_context(held_in_turns(registry.lock))
            if registry.half_done():
                raise RuntimeError(
                    "weights_in_place: this model's hf_prefetch dispatch is half-done (an interrupt or an error "
                    "stopped it). Call hf_prefetch.remove_offload(model) to finish undoing it."
                )
            if registry.attached():  # else a dispatch that has left the model: nothing of it to bring into place
                stack.callback(registry.unplace, registry.place(entries))  # each ends under its model's lock
        yield


# --- Values ---------------------------------------------------------------------------------------------------------


def _on_host(streamed: Streamed) -> bool:
    # The parameter can point at its host storage itself: the model runs on the CPU and the storage is not encoded.
    return streamed.slot_buffer.device.type == "cpu" and streamed.offloaded.layout is None


def _device_copy(streamed: Streamed) -> torch.Tensor:
    value = host_value(streamed.offloaded)
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=streamed.slot_buffer.device)
    return copy.copy_(value)


def _plain(offloaded: OffloadedParam) -> bool:
    # One tensor, a plain parameter: not a bitsandbytes parameter, nor a tensor subclass's inner tensor (torchao).
    return offloaded.inner is None and type(offloaded.param) is nn.Parameter


def _check_plain(offloaded: OffloadedParam) -> None:
    if not _plain(offloaded):
        raise ValueError(
            f"weights_in_place does not bring {offloaded.param_name} ({type(offloaded.param).__name__}, stored as "
            "several tensors) into place: quantized parameters (bitsandbytes, torchao) stay in their slots. Call "
            "hf_prefetch.remove_offload(model) first, change the weights, and dispatch again. Nothing was changed."
        )


def _check_device_memory(streamed: list[Streamed]) -> None:
    # The device copies of a block, against what each GPU has free (its own and the caching allocator's spare).
    needed: dict[torch.device, int] = {}
    for s in streamed:
        device = s.slot_buffer.device
        needed[device] = needed.get(device, 0) + s.offloaded.param.numel() * s.offloaded.param.element_size()
    for device, nbytes in needed.items():
        if device.type != "cuda":
            continue
        free = torch.cuda.mem_get_info(device)[0]
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if nbytes > free:
            layers = len({(s.ring, s.position) for s in streamed if s.slot_buffer.device == device})
            raise ValueError(
                f"weights_in_place needs {format_bytes(nbytes)} on {device} for the true weights of {layers} streamed "
                f"layers; {format_bytes(free)} is free. Bring fewer into place at a time: one streamed layer (`with "
                "hf_prefetch.weights_in_place(model.model.layers[i]):`) or only the modules the code touches. Nothing "
                "was changed."
            )


def _assigned(ref: weakref.ref, streamed: Streamed, expected: torch.Tensor) -> torch.Tensor | None:
    # The value a streamed parameter was given in its module since it pointed at `expected` (a new parameter, or its
    # `.data` assigned), or None.
    owner = ref()
    if owner is None:
        return None  # the module left the model, and the parameter with it
    param = streamed.offloaded.param
    current = owner._parameters.get(streamed.name)
    if current is not param:
        if not isinstance(current, nn.Parameter):
            raise ValueError(
                f"{streamed.offloaded.param_name}, a streamed parameter, was removed or set to None. A streamed layer "
                "keeps its parameters: call hf_prefetch.remove_offload(model) first, change the module, and dispatch "
                "again."
            )
        return current.detach()
    data = param.data
    return None if _same_tensor(data, expected) else data


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and (a.numel() == 0 or a.data_ptr() == b.data_ptr())
    )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise: -0.0 is not 0.0, and a NaN equals itself.
    a, b = a.detach().to("cpu").contiguous(), b.detach().to("cpu").contiguous()
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _check_values(values: Iterable[tuple[Streamed, torch.Tensor]]) -> None:
    for streamed, value in values:
        offloaded = streamed.offloaded
        dtype = offloaded.host.dtype if offloaded.layout is None else offloaded.layout.dtype
        if tuple(value.shape) != tuple(offloaded.param.shape) or value.dtype != dtype:
            raise ValueError(
                f"{offloaded.param_name} was given a value of shape {list(value.shape)} and dtype {value.dtype}; as a "
                f"streamed parameter it keeps its shape {list(offloaded.param.shape)} and dtype {dtype}, and kept its "
                "old value. To change them, call hf_prefetch.remove_offload(model) first, change the module, and "
                "dispatch again."
            )


def _write(values: list[tuple[Streamed, torch.Tensor]]) -> None:
    # Host storage written with new values: each checked, every compressed one encoded, before the first write.
    _check_values(values)
    encoded = [encode_for(s.offloaded, value) if s.offloaded.layout is not None else None for s, value in values]
    for (streamed, value), codes in zip(values, encoded, strict=True):
        if codes is not None:
            write_encoded(streamed.offloaded, codes)
        elif not _same_tensor(value, streamed.offloaded.host):
            streamed.offloaded.host.copy_(value)


def _put_back(ref: weakref.ref, streamed: Streamed, target: torch.Tensor) -> None:
    # The streamed parameter (with the assigned one's requires_grad) in its module again, pointing at `target`.
    owner, param = ref(), streamed.offloaded.param
    if owner is not None:
        current = owner._parameters.get(streamed.name)
        if current is not param:
            param.requires_grad_(current.requires_grad)
            owner._parameters[streamed.name] = param
    param.data = target
