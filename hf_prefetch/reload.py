"""Reloading weights in place: new values into the storage a dispatched model already has, layer by layer.

`reload_weights` writes a checkpoint's or a state dict's values where a dispatched model keeps them: the host storage
of streamed parameters, the device tensors of resident ones. Nothing is allocated, moved or re-pointed, so tensor
identities, the buffer pool and captured CUDA graphs stay valid. `sync_from_device` goes the other way, from a slot to
the host storage of the layer that holds it. This module knows names, destinations and the order in which layers are
written; reading and mapping checkpoints is the job of `checkpoint` and `keymap`, slots and copies the engine's.

[Note: rewriting weights]
Host storage is the truth; a slot is a copy tagged with its owner. Code that rewrites weights outside the forward
keeps it that way: (1) validate the whole source first, so that nothing is written if any of it does not fit; (2)
`engine.drain()`: no copy may still read host storage about to be written, no kernel a slot or resident tensor;
(3) `engine.invalidate()`: every slot forgets its owner before the first write, so that an interrupt anywhere after
leaves layers that load their values from host storage when they run (a miss), never a slot with stale bytes that
claims a layer; (4) write in place, allocating and re-pointing nothing (tensor identities, the pool and captured CUDA
graphs stay valid); (5) `engine.refill()` copies each ring's first layers again, also when writing failed. With
`process`, a streamed layer is loaded into its slot, processed there and stored back (`engine.load`, `engine.store`).
`load_state_dict` follows the same order per module (`hooks.WriteThrough`), and `sync_from_device` stores each slot
into the host storage of the layer that holds it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from .checkpoint import Checkpoint, TensorReader
from .keymap import convert, map_keys, region_view
from .placements import OffloadPlan
from .state import OffloadState, get_state

__all__ = ["reload_weights", "sync_from_device"]

logger = logging.getLogger(__name__)

_REDISPATCH = (
    "reload_weights writes values into the storage the dispatch gave each tensor and cannot change shapes, dtypes "
    "or modules: call hf_prefetch.remove_offload(model), change the model, then dispatch it again (or load the new "
    "checkpoint with hf_prefetch.from_pretrained)."
)


def reload_weights(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    process: Callable[[nn.Module], None] | None = None,
    strict: bool = True,
) -> nn.Module:
    """Write new weights into a dispatched model in place: same tensors, same buffer pool, no stale copies.

    Streamed parameters get their new values in their host storage, resident parameters and buffers in their device
    tensors; then every slot of the pool is refilled from host storage, so the next forward never computes with the
    old weights. Everything is validated before the first byte is written: names, coverage, shapes, dtypes, that each
    value is a dense tensor holding values, and that tied tensors given twice agree. A checkpoint is read straight
    into place, tensor by tensor, like `from_pretrained` reads it (no copy of the whole checkpoint in memory).

    Write weights this way, or with `model.load_state_dict(...)` (which writes through to host storage), and not
    through the parameters (`param.data.copy_(...)`, an optimizer step, merging an adapter): a streamed parameter's
    storage is a slot shared with other layers, and the next copy into it overwrites such writes.

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
            and every key must name one, as in `load_state_dict`. With `False` only the tensors it names are written.
            A checkpoint must always fill every parameter, as for `from_pretrained` (a persistent buffer it lacks
            keeps its value).

    Returns:
        The same model.

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
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    state = _dispatched(model, "reload_weights")
    _check_writable(model)
    started = time.perf_counter()
    if isinstance(source, Mapping):
        values = _StateDictValues(model, source, strict)
    elif isinstance(source, (str, os.PathLike)):
        values = _CheckpointValues(model, source)
    else:
        raise ValueError(
            f"source={type(source).__name__} is neither a checkpoint path nor a state dict; pass a folder, a "
            ".safetensors file, or a mapping of the model's state_dict() names to tensors."
        )
    with values:  # validated: from here on values are written
        layers = _layers(state.plan)
        names_of = _names_by_layer(values.names, layers)
        state.engine.drain()  # no copy may still read host storage, and no kernel a tensor, that is rewritten now
        # Every slot forgotten before the first write: an interrupt anywhere after this leaves layers that load their
        # (new or old, never mixed) values from host storage when they run, never a slot with stale bytes.
        state.engine.invalidate()
        try:
            if process is None:
                values.write(values.names)
            else:
                values.write(names_of.get(None, []))
                for layer in layers:
                    values.write(names_of.get(layer.path, []))
                    _process(model, state, layer, process)
        finally:
            state.engine.refill()  # [Note: rewriting weights]: no slot keeps a layer's old values
    seconds = time.perf_counter() - started
    gb = values.nbytes / 1e9
    logger.info("Reloaded %d tensors: %.2f GB in %.2f s (%.2f GB/s)", len(values.names), gb, seconds, gb / seconds)
    return model


def sync_from_device(model: nn.Module, layers: str | Sequence[str] | None = None) -> list[str]:
    """Copy the contents of the buffer slots back into the host storage of the streamed layers that hold them.

    For code that changed a slot's contents on purpose, through the parameters of the layer that holds the slot: those
    writes are otherwise lost at the slot's next copy. A slot holds one streamed layer at a time, so this only
    makes sense for that layer: with no more streamed layers than slots every layer holds its own; otherwise the
    forward moves them on, and writes through another layer's parameters land in the holder's weights. To change a
    streamed layer's weights in general, use `reload_weights` (with `process`) or `load_state_dict`. Resident
    parameters need no sync: their device tensors are their storage.

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
    state.engine.drain()
    for path in chosen:
        state.engine.store(*streamed[path])
    return chosen


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


def _destinations(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    # Canonical name (the first of a tied tensor's names) -> where its value lives: the host tensor of a streamed
    # parameter (the dispatch's state-dict hook returns it), else the parameter or buffer itself. Every state-dict
    # name -> its canonical name. The same naming as the loader's key map.
    destinations, canonical, first = {}, {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical[name] = first.setdefault(id(tensor), name)
        if canonical[name] == name:
            destinations[name] = tensor
    return destinations, canonical


def _check_writable(model: nn.Module) -> None:
    # Tensors made under torch.inference_mode() can be written only inside it: copy_ would fail at the first one.
    if torch.is_inference_mode_enabled():
        return
    written = [*model.state_dict(keep_vars=True).items(), *model.named_parameters()]  # and the slots they point at
    frozen = list(dict.fromkeys(name for name, tensor in written if tensor.is_inference()))
    if frozen:
        raise ValueError(
            f"{frozen[0]} ({len(frozen)} of the tensors reload_weights writes) is an inference tensor: "
            f"{type(model).__name__} was built or dispatched under torch.inference_mode(), and such tensors can be "
            "written only inside it. Call reload_weights under torch.inference_mode()."
        )


def _check_shape(key: str, shape: Sequence[int], name: str, destination: torch.Tensor) -> None:
    if tuple(shape) != tuple(destination.shape):
        raise ValueError(
            f"{key!r} has shape {list(shape)} but {name} has shape {list(destination.shape)}. {_REDISPATCH}"
        )


def _check_dtype(key: str, dtype: torch.dtype, name: str, destination: torch.Tensor) -> None:
    if dtype != destination.dtype and not (dtype.is_floating_point and destination.dtype.is_floating_point):
        raise ValueError(
            f"{key!r} holds {dtype} values but {name} is {destination.dtype}; values are cast only between "
            f"floating-point dtypes. {_REDISPATCH}"
        )


def _check_value(key: str, value: object, name: str, destination: torch.Tensor) -> None:
    # What `destination.copy_(value)` would fail on halfway through the writes, or cast wrongly.
    where = f"state_dict[{key!r}]"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, not a tensor. Pass {name}'s new value as a tensor.")
    if value.is_meta:
        raise ValueError(
            f"{where} is on the meta device: it has a shape but no values (a model built under init_empty_weights "
            "or on device='meta' has no weights to give). Pass tensors that hold values."
        )
    if value.is_nested:
        shape = list(destination.shape)
        raise ValueError(f"{where} is a nested tensor; {name} takes one dense tensor of shape {shape}: pass one.")
    if value.layout != torch.strided:
        raise ValueError(f"{where} has layout {value.layout}; reload_weights copies dense tensors: pass .to_dense().")
    if type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise ValueError(
            f"{where} is a {type(value).__name__}, a tensor subclass that runs its own operations: copying it into "
            f"{name} is not known to work. Pass a plain tensor: a DTensor's full_tensor(), a quantized tensor's "
            "dequantized values."
        )
    _check_shape(key, value.shape, name, destination)
    _check_dtype(key, value.dtype, name, destination)


def _check_tied(keys: tuple[str, str], values: tuple[torch.Tensor, ...], name: str, destination: torch.Tensor) -> None:
    # Two keys of one tied tensor must hold one value (once cast), as the loader requires of a checkpoint.
    if values[0] is values[1]:
        return
    first, second = (value.to(destination.device, destination.dtype) for value in values)
    if not torch.equal(first, second):
        raise ValueError(
            f"state_dict[{keys[0]!r}] and state_dict[{keys[1]!r}] fill one tensor ({name}: the model ties them) but "
            "hold different values. Pass one of them, or untie the weights and dispatch the model again."
        )


class _WrittenMemory:
    """The memory reload_weights writes: every destination, and the buffer slots that streamed parameters point at.

    A value may share it only by being its own destination (copying it onto itself changes nothing). Any other
    overlap fails in copy_ (another view of its own destination) or reads values that are already overwritten
    (another destination, or a slot, which the refill and `process` rewrite)."""

    def __init__(self, model: nn.Module, destinations: dict[str, torch.Tensor]) -> None:
        self.spans: dict[tuple[torch.device, int], list[tuple[int, int, str]]] = {}
        written = [(name, tensor) for name, tensor in destinations.items()]
        written += [
            (f"the buffer slot that the streamed parameter {name} points at", param)
            for name, param in model.named_parameters()
            if name not in destinations or not _same_memory(param, destinations[name])
        ]
        for what, tensor in written:
            self.spans.setdefault(_storage(tensor), []).append((*_span(tensor), what))

    def check(self, key: str, value: torch.Tensor, own: torch.Tensor) -> None:
        if _same_memory(value, own):
            return
        start, end = _span(value)
        for other_start, other_end, what in self.spans.get(_storage(value), []):
            if start < other_end and other_start < end:
                raise ValueError(
                    f"state_dict[{key!r}] shares memory with {what}, which reload_weights overwrites, without being "
                    "that tensor itself: copying it would fail or read values already overwritten. Pass "
                    "value.clone(), or model.state_dict() for the current weights (it holds a streamed parameter's "
                    "host storage, named_parameters() its slot)."
                )


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    # The addresses [start, end) of the bytes a tensor's elements lie in.
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


class _StateDictValues:
    """New values from a state dict keyed like the model's `state_dict()`."""

    def __init__(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        self.destinations, canonical = _destinations(model)
        memory = _WrittenMemory(model, self.destinations)
        self.values: dict[str, torch.Tensor] = {}
        keys: dict[str, str] = {}  # canonical name -> the key its value came from
        unexpected = [key for key in state_dict if key not in canonical]
        for key, value in state_dict.items():
            if key not in canonical:
                continue
            name = canonical[key]
            _check_value(key, value, name, self.destinations[name])
            memory.check(key, value, self.destinations[name])
            if name in self.values:
                _check_tied((keys[name], key), (self.values[name], value), name, self.destinations[name])
            else:
                self.values[name], keys[name] = value, key
        missing = [name for name in self.destinations if name not in self.values]
        if strict and (missing or unexpected):
            problems = []
            if missing:
                problems.append(f"has no value for {missing[0]} ({len(missing)} missing: {missing[:5]})")
            if unexpected:
                problems.append(
                    f"holds {unexpected[0]!r}, which names no parameter or persistent buffer of "
                    f"{type(model).__name__} ({len(unexpected)} unexpected: {unexpected[:5]})"
                )
            raise ValueError(
                f"reload_weights(strict=True): the state dict {' and '.join(problems)}. Keys are the model's own "
                "state_dict() names; pass strict=False to write only the tensors it names."
            )
        self.names = list(self.values)
        self.nbytes = 0

    def write(self, names: list[str]) -> None:
        with torch.no_grad():
            for name in names:
                self.destinations[name].copy_(self.values[name])
                self.nbytes += self.values[name].nbytes

    def __enter__(self) -> _StateDictValues:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _CheckpointValues:
    """New values from a safetensors checkpoint, mapped and validated by the loader's key map, read into place."""

    def __init__(self, model: nn.Module, path: str | os.PathLike) -> None:
        self.model = model
        self.checkpoint = Checkpoint.open(path)
        self.reader: TensorReader | None = None
        try:
            with _plain_state_dict(model):
                self.keymap = map_keys(model, self.checkpoint)  # checks names, shapes and unexpected keys
            self.destinations, _ = _destinations(model)
            converted = [name for *_, outputs in self.keymap.converted for name in outputs.values()]
            self.names = [*self.keymap.streamed, *converted]
            _check_covered(model, self.checkpoint, list(self.destinations), set(self.names))
            self._check_dtypes()
            self.reader = TensorReader(self.checkpoint)
            self._check_tied_values()
        except BaseException:
            self.__exit__()
            raise

    def _check_dtypes(self) -> None:
        # (checkpoint tensor, the model tensor it fills); a conversion's sources are checked against its first output.
        pairs = [(entry, name) for name, pieces in self.keymap.streamed.items() for entry, _ in pieces]
        for *_, sources, outputs in self.keymap.converted:
            pairs += [(entry, next(iter(outputs.values()))) for _, entry in sources]
        for entry, name in [*pairs, *self.keymap.duplicates]:
            _check_dtype(entry.key, entry.dtype, name, self.destinations[name])

    def _check_tied_values(self) -> None:
        # A tied tensor stored twice must hold one value, as the loader requires (see loader._read_all).
        for entry, name in self.keymap.duplicates:
            first, dtype = self.keymap.streamed[name][0][0], self.destinations[name].dtype
            if not torch.equal(self.reader.read_tensor(entry).to(dtype), self.reader.read_tensor(first).to(dtype)):
                raise ValueError(
                    f"{entry.path}: {entry.key!r} and {first.key!r} fill one tensor ({name}: the config ties them) "
                    "but hold different values. Set tie_word_embeddings=False in config.json."
                )

    @property
    def nbytes(self) -> int:
        return self.reader.bytes_read

    def write(self, names: list[str]) -> None:
        wanted = set(names)
        reads = [
            (entry, region_view(self.destinations[name].detach(), region))
            for name in names
            if name in self.keymap.streamed
            for entry, region in self.keymap.streamed[name]
        ]
        self.reader.load(reads)
        for converter, target_key, sources, outputs in self.keymap.converted:
            if wanted.isdisjoint(outputs.values()):
                continue
            dtype = self.destinations[next(iter(outputs.values()))].dtype  # cast before converting, as transformers
            converted = convert(
                self.model, converter, target_key, sources, lambda e, d=dtype: self.reader.read_tensor(e).to(d)
            )
            with torch.no_grad():
                for out_key, value in converted.items():
                    self.destinations[outputs[out_key]].copy_(value)

    def __enter__(self) -> _CheckpointValues:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.reader is not None:
            self.reader.close()
        self.checkpoint.close()


@contextmanager
def _plain_state_dict(model: nn.Module) -> Iterator[None]:
    """Inside the block, `model.state_dict()` holds plain tensors (a tied tensor's names still share one).

    `map_keys` refuses a checkpoint that lacks a parameter, but a streamed parameter's state-dict value is its plain
    host tensor: it would refuse the missing resident parameters only and silently keep the streamed ones. Shown no
    parameters, it keeps whatever is missing, and `_check_covered` names all of it at once.
    """

    def unflag(module: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
        plain = {id(value): value.detach() for value in state_dict.values()}
        for key, value in state_dict.items():
            state_dict[key] = plain[id(value)]

    handle = model.register_state_dict_post_hook(unflag)
    try:
        yield
    finally:
        handle.remove()


_SHARD = re.compile(r"(?P<prefix>.+)-(?P<index>\d+)-of-(?P<count>\d+)\.safetensors")


def _check_covered(model: nn.Module, checkpoint: Checkpoint, names: list[str], filled: set[str]) -> None:
    # Every parameter, streamed or resident, as from_pretrained requires; a persistent buffer keeps its value there.
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = [name for name in names if name in parameters and name not in filled]
    if not missing:
        return
    shards = _shards_left_out(checkpoint)
    if shards:
        cause = (
            f"Its index names no tensor of {', '.join(shards)}, which would fill them: download the missing "
            "shard(s) and an index that names every shard, or re-save the checkpoint."
        )
    else:
        cause = "It was saved from another architecture or configuration (check config.json), or lost tensors."
    listed = missing if len(missing) <= 100 else [*missing[:100], f"and {len(missing) - 100} more"]
    raise ValueError(
        f"The checkpoint at {checkpoint.folder} has no tensor for {len(missing)} "
        f"parameter{'s' if len(missing) > 1 else ''} of {type(model).__name__}: {listed}. {cause} Nothing was "
        "written."
    )


def _shards_left_out(checkpoint: Checkpoint) -> list[str]:
    # Numbered shards (model-00002-of-00004.safetensors) of the series the checkpoint's files belong to, that hold
    # none of its tensors: the index leaves them out.
    files = {checkpoint[key].path.name for key in checkpoint.keys()}
    series = {(m["prefix"], len(m["index"]), m["count"]) for m in map(_SHARD.fullmatch, files) if m}
    expected = {
        f"{prefix}-{i:0{width}d}-of-{count}.safetensors"
        for prefix, width, count in series
        for i in range(1, int(count) + 1)
    }
    return sorted(expected - files)


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
                f"dtype), but it {'; '.join(problems[:3])}. The layer's tensors were put back. {_REDISPATCH}"
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
            if not _same_memory(value, storage):
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
            if not _same_memory(tensor, storage):
                tensor.data = storage


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
