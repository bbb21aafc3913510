"""Reloading weights in place: new values into the storage a dispatched model already has, layer by layer.

`reload_weights` writes a checkpoint's or a state dict's values where a dispatched model keeps them: the host storage
of streamed parameters, the device tensors of resident ones. Nothing is allocated, moved or re-pointed, so tensor
identities, the buffer pool and captured CUDA graphs stay valid. `sync_from_device` goes the other way, from a slot to
the host storage of the layer that holds it. This module knows names, destinations and the order in which layers are
written; reading and mapping checkpoints is the job of `checkpoint` and `keymap`, slots and copies the engine's.

[Note: rewriting weights]
Host storage is the truth; a slot is a copy tagged with its owner. Code that rewrites weights outside the forward keeps
it that way: (1) validate the whole source first, so that nothing is written if any of it does not fit; (2)
`engine.drain()`: no copy may still read host storage about to be written, no kernel a slot or resident tensor; (3)
`engine.invalidate()`: every slot forgets its owner before the first write, so that an interrupt anywhere after leaves
layers that load their values from host storage when they run (a miss), never a slot with stale bytes that claims a
layer; (4) write in place, allocating and re-pointing nothing (tensor identities, the pool and captured CUDA graphs
stay valid; the one exception, tensors read from the checkpoint's files, is switched to the new checkpoint's files at
once: reload_files.py); (5) `engine.refill()` copies each ring's first layers again, also when writing failed. With
`process`, a streamed layer is loaded into its slot, processed there and stored back (`engine.load`, `engine.store`).
`load_state_dict` follows the same order per module (`WriteThrough`, lifecycle/state_dict.py), and `sync_from_device`
stores each slot into the host storage of the layer that holds it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..config import warn_at_caller
from ..formats.parts import is_dtensor
from ..lifecycle.state import OffloadState, exclusive, get_state
from ..planning.offload_plan import OffloadPlan
from .reload_files import FileSwitch
from .sources import REDISPATCH, CheckpointValues, StateDictValues, check_writable, same_memory

__all__ = ["reload_weights", "sync_from_device"]


logger = logging.getLogger(__name__)


def _exclusive(verb: Callable[..., Any]) -> Callable[..., Any]:
    # The verb runs after any forward under way in another thread, and the forwards that come meanwhile wait for it:
    # a forward must compute with the old weights or the new ones, never a mix (`state.exclusive`).
    # The autograd mode is put back whatever leaves the verb: a Ctrl-C landing where a `with torch.no_grad()` block
    # ends (CPython runs its normal exit outside the block's handler) would leave autograd off for the process.
    @functools.wraps(verb)
    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        enabled = torch.is_grad_enabled()
        try:
            with exclusive(model):
                return verb(model, *args, **kwargs)
        finally:
            torch.set_grad_enabled(enabled)

    return run


@_exclusive
def reload_weights(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    process: Callable[[nn.Module], None] | None = None,
    strict: bool = True,
) -> nn.Module:
    """Write new weights into a dispatched model in place: same tensors, same buffer pool, no stale copies.

    Streamed parameters get their new values in their host storage, resident parameters and buffers in their device
    tensors; then every slot of the pool is refilled from host storage, so the next forward never computes with the old
    weights. Where weights are read from the checkpoint's files at each use (a host budget below what streams), those
    are read from the new checkpoint's files from then on instead: each must be stored there as the model holds it
    (`ValueError` naming it otherwise), and a state dict cannot give them values. Everything is validated before the
    first byte is written: names, coverage, shapes, dtypes, that each value is a dense tensor holding values, and that
    tied tensors given twice agree. A checkpoint is read straight into place, tensor by tensor, like `from_pretrained`
    reads it (no copy of the whole checkpoint in memory).

    Write weights this way, with `model.load_state_dict(...)` (which writes through to host storage), or through the
    parameters inside `hf_prefetch.weights_in_place(model)`, and not through the parameters outside it
    (`param.data.copy_(...)`, an optimizer step): a streamed parameter's storage is a slot shared with other layers,
    and the next copy into it overwrites such writes.

    Args:
        model (`nn.Module`): A dispatched model (`dispatch_model`, `from_pretrained`, `load_checkpoint_and_dispatch`).
        source: A checkpoint (a folder, a `.safetensors` file or a `model.safetensors.index.json`, keys mapped as in
            `from_pretrained`), or a state dict keyed by the model's own `state_dict()` names. Values are cast between
            floating-point dtypes; any other change of dtype, and any change of shape, is an error. A state dict's
            values are dense tensors that hold values (not meta, sparse or nested tensors, nor subclasses such as
            DTensor) and share no memory with the model's tensors, except a value that is its own tensor, as in
            `model.state_dict()` (not `named_parameters()`: a streamed parameter shows a buffer slot).
        process (`Callable[[nn.Module], None]`, *optional*): Called once for each layer of the layer lists, under
            `torch.no_grad()`, once all of the layer's new weights arrived and with them on the execution device (a
            streamed layer is copied into its slot first), e.g. to quantize or repack values. It may change values
            only: in place, or by assigning tensors of the same shape and dtype (their values are copied into the
            original storage, and the original tensors put back). Adding, removing or replacing parameters, buffers or
            submodules otherwise raises `ValueError`. What it leaves is stored (a streamed layer's slot goes back to
            host storage). Tensors outside the layer lists (embeddings, final norm, head) are written, not processed.
            `reload_weights(model, model.state_dict(), process=fn)` applies `fn` to the current weights.
        strict (`bool`, defaults to `True`): For a state dict: every parameter and persistent buffer must have a value
            and every key must name one, as in `load_state_dict`. With `False` only the tensors it names are written;
            the others keep their values. A checkpoint must always fill every parameter, as for `from_pretrained` (a
            persistent buffer it lacks keeps its value): there `strict=False` changes nothing, and a `UserWarning`
            says so.

    Returns:
        The same model. What `load_state_dict(strict=False)` returns as its incompatible keys is told instead: keys
        that name no parameter or persistent buffer (`unexpected_keys`) are written nowhere, and a `UserWarning`
        names them (and says when nothing was written at all, with what the model's keys look like); the tensors
        the state dict has no value for (`missing_keys`) keep theirs, and the `hf_prefetch.loading.reload` logger
        names them at INFO level.

    Raises:
        `ValueError`, and nothing is written, for a model that is not dispatched or whose tensors are inference
        tensors (call it under `torch.inference_mode()` then), a missing or unexpected key, a shape or dtype that does
        not fit, a value that is not a dense tensor holding values or that shares memory with a tensor it writes, and
        tied tensors given two different values. `ValueError` when `process` changes more than values (the layer's
        tensors are put back). An error while writing (a file that cannot be read, `process` failing) leaves some
        layers with their new weights and the others with their old ones, the pool consistent with them: reload
        again.

    Example:

    ```python
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=64)
    >>> model = hf_prefetch.dispatch_model(LlamaForCausalLM(config).eval(),
    ...     hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu")
    >>> new, ids = LlamaForCausalLM(config).eval(), torch.tensor([[1, 2, 3]])
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     new.save_pretrained(folder)
    ...     model = hf_prefetch.reload_weights(model, folder)
    >>> torch.equal(model(ids).logits, new(ids).logits)
    True
    >>> def double_down_proj(layer):
    ...     layer.mlp.down_proj.weight.mul_(2)
    >>> model = hf_prefetch.reload_weights(model, new.state_dict(), process=double_down_proj)
    >>> stored = model.state_dict()["model.layers.1.mlp.down_proj.weight"]  # a streamed layer: its host storage
    >>> torch.equal(stored, 2 * new.model.layers[1].mlp.down_proj.weight)
    True
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:  # a key without the model's "model." prefix
    ...     warnings.simplefilter("always")
    ...     model = hf_prefetch.reload_weights(model, {"norm.weight": torch.ones(32)}, strict=False)
    >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
    reload_weights(strict=False) wrote nothing: the state dict's 1 key names no parameter or persistent buffer of
    LlamaForCausalLM (['norm.weight']; the model's look like ['model.embed_tokens.weight',
    'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight']). Keys are the model's own
    state_dict() names: 'norm.weight' lacks the prefix 'model.' of 'model.norm.weight'.
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    state = _dispatched(model, "reload_weights")
    compressed = [o.full_name for o in state.offloaded if o.layout is not None]
    if compressed:
        instead = "" if state.reads_files else "Use model.load_state_dict(...), which encodes the new values, or "
        raise ValueError(
            f"reload_weights does not write compressed host storage ({compressed[0]} and {len(compressed) - 1} more "
            f"are kept compressed: PrefetchConfig(compress=True)). {instead or 'Call '}hf_prefetch.remove_offload("
            "model), write the weights, and dispatch again. Nothing was written."
        )
    subclassed = list(dict.fromkeys(o.param_name for o in state.offloaded if o.inner is not None))
    if subclassed:
        kind = type(model.get_parameter(subclassed[0])).__name__
        if is_dtensor(model.get_parameter(subclassed[0])):
            raise ValueError(
                f"reload_weights does not write the shards of a tensor-parallel model yet ({subclassed[0]} is a "
                "DTensor). Call model.load_state_dict(...) on every rank with values sharded as the model's (its "
                "state_dict()'s DTensors), which writes each rank's host storage, or "
                "hf_prefetch.remove_offload(model), write the weights, and dispatch again. Nothing was written."
            )
        raise ValueError(
            f"reload_weights does not write parameters stored as several tensors ({subclassed[0]}, of type {kind}, "
            f"and {len(subclassed) - 1} more streamed). Use model.load_state_dict(...) with values of the same "
            "quantization, which writes their tensors in place, or hf_prefetch.remove_offload(model), write the "
            "weights, and dispatch again. Nothing was written."
        )
    if process is not None and state.reads_files:
        raise ValueError(
            f"reload_weights(process=...) stores each processed layer back into its host storage, but the layers "
            f"{state.read_layers()} (or their routed experts) are read from the checkpoint's files at each use, which "
            "are not written. Process the weights, save them as a checkpoint and pass its folder to reload_weights "
            "(without process), or give max_memory['cpu'] room for every streamed layer. Nothing was written."
        )
    started = time.perf_counter()
    try:  # names and destinations only (`OffloadState.listing`): nothing is handed out
        state.listing = True
        check_writable(model)
        values = _values(model, source, strict)
    finally:
        state.listing = False
    with values:  # validated: from here on values are written
        switch = None
        try:
            switch = _file_switch(state, values)  # the new files of the tensors read from files, opened and checked
            written = [name for name in values.names if name not in state.file_extents]
            layers = _layers(state.plan)
            names_of = _names_by_layer(written, layers)
            # Host storage that is a file's pages: private memory first (the files read at each use are switched).
            state.private_host_storage(keep_files=True)
            state.engine.drain()  # no copy may still read host storage, and no kernel a tensor, that is rewritten
            # Every slot forgotten before the first write: an interrupt anywhere after this leaves layers that load
            # their (new or old, never mixed) values from host storage when they run, never a slot with stale bytes.
            state.engine.invalidate()
            try:
                if switch is not None:
                    switch.commit()  # read from the new files from now on
                if process is None:
                    values.write(written)
                else:
                    values.write(names_of.get(None, []))
                    for layer in layers:
                        values.write(names_of.get(layer.path, []))
                        _process(model, state, layer, process)
            finally:
                state.engine.refill()  # [Note: rewriting weights]: no slot keeps a layer's old values
        finally:
            if switch is not None:
                switch.close()
    seconds = time.perf_counter() - started
    gb = values.nbytes / 1e9
    logger.info("Reloaded %d tensors: %.2f GB in %.2f s (%.2f GB/s)", len(values.names), gb, seconds, gb / seconds)
    if isinstance(values, StateDictValues):
        missing = values.missing_keys  # strict=False: the tensors the state dict leaves out keep their values
        if missing:
            logger.info("%d tensors kept their values (strict=False), the first: %s", len(missing), missing[:10])
        unused = values.unused()
        if unused is not None:  # keys that wrote nothing: said, since the call did not do what they asked
            warn_at_caller(unused)
    return model


@_exclusive
def sync_from_device(model: nn.Module, layers: str | Sequence[str] | None = None) -> list[str]:
    """Copy the contents of the buffer slots back into the host storage of the streamed layers that hold them.

    For code that changed a slot's contents on purpose, through the parameters of the layer that holds the slot: those
    writes are otherwise lost at the slot's next copy. A slot holds one streamed layer at a time, so this only
    makes sense for that layer: with no more streamed layers than slots every layer holds its own; otherwise the
    forward moves them on, and writes through another layer's parameters land in the holder's weights. To change a
    streamed layer's weights in general, use `reload_weights` (with `process`) or `load_state_dict`. Resident
    parameters need no sync: their device tensors are their storage. After a forward that routed experts, a layer's
    expert tensors hold only the rows its router picked: such a layer is written back without them, with a warning.

    Args:
        model (`nn.Module`): A dispatched model.
        layers (`str` or list of `str`, *optional*): Paths of streamed layers to sync (each must hold its slot);
            by default every streamed layer that holds its slot.

    Returns:
        The paths of the layers whose host storage was written.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=64)
    >>> model = hf_prefetch.dispatch_model(LlamaForCausalLM(config).eval(),
    ...     hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu")
    >>> with torch.no_grad():
    ...     _ = model.model.layers[3].mlp.up_proj.weight.mul_(0.5)
    >>> hf_prefetch.sync_from_device(model)
    ['model.layers.1', 'model.layers.3']
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    state = _dispatched(model, "sync_from_device")
    streamed: dict[str, tuple[int, int]] = {}  # path -> (ring, position)
    holders: dict[int, dict[int, str]] = {}  # ring -> slot -> path of the layer that holds it
    for ring_index, ring in enumerate(state.plan.rings):
        for position, layer in enumerate(ring.streamed):
            streamed[layer.path] = (ring_index, position)
            if state.engine.holds(ring_index, position):
                holders.setdefault(ring_index, {})[layer.slot] = layer.path
    holding = [path for slots in holders.values() for path in slots.values()]
    if layers is None:
        chosen = [path for path in streamed if path in holding]
    else:
        chosen = [layers] if isinstance(layers, str) else list(layers)
    for path in chosen:
        if path not in streamed:
            raise ValueError(
                f"{path!r} is not a streamed layer of {type(model).__name__}; streamed layers: {list(streamed)[:8]}. "
                "Resident layers need no sync: their parameters are their storage."
            )
        if path not in holding:
            ring_index, position = streamed[path]
            slot = state.plan.rings[ring_index].streamed[position].slot
            holder = holders.get(ring_index, {}).get(slot, "no layer")
            raise ValueError(
                f"{path} does not hold its buffer slot {slot} now ({holder} does): its parameters show another "
                "layer's weights, so nothing of its is on the device to sync. Change a streamed layer's weights with "
                "hf_prefetch.reload_weights(model, source, process=fn) or model.load_state_dict(...) instead."
            )
    state.private_host_storage()  # host storage that is a file's pages: private memory first (refused for files read)
    partial = [path for path in chosen if not state.engine.holds_whole(*streamed[path])]
    if partial:  # written back without those tensors (`engine.store`): said, since an edit of them is lost
        ring, position = streamed[partial[0]]
        names = [spec.name for spec in state.plan.rings[ring].streamed[position].routed]
        warn_at_caller(
            f"sync_from_device writes back {', '.join(partial)} without their expert tensors "
            f"({', '.join(names)}): after a forward that routed (at most routed_max_tokens="
            f"{state.engine.routed_max_tokens} tokens) they hold only the rows the router picked, so their host "
            "values stay and an edit of them is lost. Run a forward of more tokens first (it copies whole layers), or "
            "change expert weights with hf_prefetch.reload_weights(model, source, process=fn)."
        )
    state.engine.drain()
    # Compressed layers are encoded, all of them, before the first write: values that do not fit leave every layer
    # unwritten.
    encoded = [state.engine.encode_slot(*streamed[path]) for path in chosen]
    for path, values in zip(chosen, encoded, strict=True):
        state.engine.store(*streamed[path], values)
    return chosen


def _values(model: nn.Module, source: Any, strict: bool) -> StateDictValues | CheckpointValues:
    # The source's values, validated (nothing written yet).
    if isinstance(source, Mapping):
        return StateDictValues(model, source, strict)
    if isinstance(source, (str, os.PathLike)):
        if not strict:
            warn_at_caller(
                "reload_weights(strict=False) applies to a state dict only: a checkpoint must fill every parameter, "
                "as for from_pretrained, so strict=False changes nothing here. To write some tensors only, pass them "
                "as a state dict (e.g. safetensors.torch.load_file(path) filtered by name) with strict=False."
            )
        return CheckpointValues(model, source)
    raise ValueError(
        f"source={type(source).__name__} is neither a checkpoint path nor a state dict; pass a folder, a "
        ".safetensors file, or a mapping of the model's state_dict() names to tensors."
    )


def _file_switch(state: OffloadState, values: StateDictValues | CheckpointValues) -> FileSwitch | None:
    # Tensors read from the checkpoint's files are not written: a checkpoint's are read from its files from then on.
    read = [name for name in values.names if name in state.file_extents]
    if not read:
        return None
    if isinstance(values, CheckpointValues):
        return FileSwitch(state, values.keymap, values.checkpoint)
    raise ValueError(
        f"state_dict[{read[0]!r}]{f' (and {len(read) - 1} more of its keys)' if len(read) > 1 else ''} is read from "
        "the checkpoint's files at each use (max_memory['cpu'] holds less than what streams), and reload_weights does "
        "not write those files. Save "
        "the new weights as a checkpoint (model.save_pretrained, or safetensors' save_file in the model's dtypes) and "
        "pass its folder, which is read from then on; or leave those keys out with strict=False. Nothing was written."
    )


def _dispatched(model: nn.Module, verb: str) -> OffloadState:
    state = get_state(model)
    if state is None:
        raise ValueError(
            f"{type(model).__name__} is not dispatched by hf_prefetch: {verb} works on dispatched models. On an "
            "ordinary model use model.load_state_dict(...)."
        )
    if state.engine is None:
        raise ValueError(
            f"{verb} works on models dispatched with offload='prefetch'; {type(model).__name__} is dispatched with "
            "the UVA backend. Call hf_prefetch.remove_offload(model), load the new weights into the model and "
            "dispatch it again."
        )
    state.in_place.refuse_inside(verb)
    state.in_place.adopt()  # values assigned anew since the dispatch: into host storage first
    return state


class _Layer(NamedTuple):
    path: str
    ring: int
    position: int | None  # among the ring's streamed layers; None for a resident layer


def _layers(plan: OffloadPlan) -> list[_Layer]:
    layers = []
    for ring_index, ring in enumerate(plan.rings):
        positions = {layer.path: position for position, layer in enumerate(ring.streamed)}
        layers += [_Layer(layer.path, ring_index, positions.get(layer.path)) for layer in ring.layers]
    return layers


def _names_by_layer(names: list[str], layers: list[_Layer]) -> dict[str | None, list[str]]:
    # Tensor names by the layer they belong to; None for tensors outside the layer lists.
    paths = {layer.path for layer in layers}
    grouped: dict[str | None, list[str]] = {}
    for name in names:
        parts = name.split(".")
        prefixes = (".".join(parts[:depth]) for depth in range(1, len(parts)))
        grouped.setdefault(next((p for p in prefixes if p in paths), None), []).append(name)
    return grouped


def _process(model: nn.Module, state: OffloadState, layer: _Layer, process: Callable) -> None:
    module = model.get_submodule(layer.path)
    if layer.position is not None:
        state.engine.load(layer.ring, layer.position)  # its new values into its slot, where its parameters point
    before = _Snapshot(module)
    try:
        with torch.no_grad():
            process(module)
        problems = before.changes()
        if problems:
            raise ValueError(
                f"process({layer.path}) may change values only (in place, or through tensors of the same shape and "
                f"dtype), but it {'; '.join(problems[:3])}. The layer's tensors were put back. {REDISPATCH}"
            )
        before.keep_values()
    finally:
        before.restore()
    if layer.position is not None:
        state.engine.store(layer.ring, layer.position)  # the processed slot back into host storage


class _Snapshot:
    """A layer's submodules, parameters and buffers before `process` ran, with the storage each tensor used."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.modules = dict(layer.named_modules())
        self.tensors = {name: (tensor, tensor.detach()) for name, tensor in _named_tensors(layer)}

    def changes(self) -> list[str]:
        """What `process` changed beyond values."""
        now = dict(self.layer.named_modules())
        problems = [
            f"replaced or removed the submodule {name}" for name, m in self.modules.items() if now.get(name) is not m
        ]
        if problems:
            return problems
        tensors = dict(_named_tensors(self.layer))
        problems = [f"added {name}" for name in tensors.keys() - self.tensors.keys()]
        for name, (_, storage) in self.tensors.items():
            value = tensors.get(name)
            if value is None:
                problems.append(f"removed {name}")
            elif value.shape != storage.shape or value.dtype != storage.dtype:
                problems.append(
                    f"changed {name} from {list(storage.shape)} {storage.dtype} to {list(value.shape)} {value.dtype}"
                )
        return problems

    def keep_values(self) -> None:
        """Copy values that `process` put into new tensors into the original storage."""
        tensors = dict(_named_tensors(self.layer))
        for name, (_, storage) in self.tensors.items():
            value = tensors[name].detach()
            if not same_memory(value, storage):
                storage.copy_(value)

    def restore(self) -> None:
        """Put the original submodules and tensors back, each on its original storage."""
        for name, module in self.modules.items():
            parent, _, leaf = name.rpartition(".")
            if name and self.layer.get_submodule(parent)._modules.get(leaf) is not module:
                setattr(self.layer.get_submodule(parent), leaf, module)
        for name, _ in _named_tensors(self.layer):
            if name not in self.tensors:
                owner, _, leaf = name.rpartition(".")
                self.layer.get_submodule(owner)._parameters.pop(leaf, None)
                self.layer.get_submodule(owner)._buffers.pop(leaf, None)
        for name, (tensor, storage) in self.tensors.items():
            owner, _, leaf = name.rpartition(".")
            module = self.layer.get_submodule(owner)
            mine, other = (
                (module._parameters, module._buffers)
                if isinstance(tensor, nn.Parameter)
                else (module._buffers, module._parameters)
            )
            module.__dict__.pop(leaf, None)
            other.pop(leaf, None)
            mine[leaf] = tensor
            if not same_memory(tensor, storage):
                tensor.data = storage


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]
