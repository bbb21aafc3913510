"""The values `reload_weights` writes, validated before the first write: a state dict's or a checkpoint's.

`StateDictValues` and `CheckpointValues` each check, on construction, everything that could fail while writing (names,
coverage of every layer, shapes, dtypes, layouts, tied tensors stored twice, memory shared with the destinations),
then write named tensors in place on request. They know names and destinations; the order in which layers are written,
and slots, are `reload.py`'s.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .checkpoint import Checkpoint
from .keymap import cast_source, convert, map_keys, region_view
from .reader import TensorReader

__all__ = ["StateDictValues", "CheckpointValues", "check_writable", "same_memory", "REDISPATCH"]

logger = logging.getLogger("hf_prefetch.loading.reload")

REDISPATCH = (
    "reload_weights writes values into the storage the dispatch gave each tensor and cannot change shapes, dtypes "
    "or modules: call hf_prefetch.remove_offload(model), change the model, then dispatch it again (or load the new "
    "checkpoint with hf_prefetch.from_pretrained)."
)


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


def check_writable(model: nn.Module) -> None:
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
            f"{key!r} has shape {list(shape)} but {name} has shape {list(destination.shape)}. {REDISPATCH}"
        )


def _check_dtype(key: str, dtype: torch.dtype, name: str, destination: torch.Tensor) -> None:
    if dtype != destination.dtype and not (dtype.is_floating_point and destination.dtype.is_floating_point):
        raise ValueError(
            f"{key!r} holds {dtype} values but {name} is {destination.dtype}; values are cast only between "
            f"floating-point dtypes. {REDISPATCH}"
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
            if name not in destinations or not same_memory(param, destinations[name])
        ]
        for what, tensor in written:
            self.spans.setdefault(_storage(tensor), []).append((*_span(tensor), what))

    def check(self, key: str, value: torch.Tensor, own: torch.Tensor) -> None:
        if same_memory(value, own):
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


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _prefix_hint(keys: list[str], names: list[str]) -> str:
    # Keys that are the model's names with a prefix added ("module.", from a wrapper) or taken away ("model.").
    known = set(names)
    for key in keys[:20]:
        for name in names:
            if name.endswith(f".{key}"):
                return f": {key!r} lacks the prefix {name[: -len(key)]!r} of {name!r}"
        _, dot, rest = key.partition(".")
        while dot:
            if rest in known:
                return f": {key!r} is {rest!r} with the prefix {key[: -len(rest)]!r}"
            _, dot, rest = rest.partition(".")
    return ""


class StateDictValues:
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
        # What strict=False leaves unused, as load_state_dict's `_IncompatibleKeys` names it: keys that name nothing,
        # and the tensors (canonical names) the state dict has no value for.
        self.unexpected_keys, self.missing_keys = unexpected, missing
        self.model_name = type(model).__name__

    def unused(self) -> str | None:
        """A sentence on the keys that named nothing, and on whether anything was written at all (None when every
        key named a tensor)."""
        if self.names and not self.unexpected_keys:
            return None
        if not self.names and not self.unexpected_keys:
            return "reload_weights(strict=False) wrote nothing: the state dict is empty."
        keys, hint = self.unexpected_keys, _prefix_hint(self.unexpected_keys, list(self.destinations))
        listed = f"{keys[:5]}{f' and {len(keys) - 5} more' if len(keys) > 5 else ''}"
        name = "names" if len(keys) == 1 else "name"
        if self.names:
            kept = len(self.missing_keys)
            return (
                f"reload_weights(strict=False) wrote {_count(len(self.names), 'tensor')} and ignored "
                f"{_count(len(keys), 'key')} that {name} no parameter or persistent buffer of {self.model_name}: "
                f"{listed}; {_count(kept, 'other tensor')} {'keeps its value' if kept == 1 else 'keep their values'}. "
                f"Keys are the model's own state_dict() names{hint}."
            )
        return (
            f"reload_weights(strict=False) wrote nothing: the state dict's {_count(len(keys), 'key')} {name} no "
            f"parameter or persistent buffer of {self.model_name} ({listed}; the model's look like "
            f"{list(self.destinations)[:3]}). Keys are the model's own state_dict() names{hint}."
        )

    def write(self, names: list[str]) -> None:
        with torch.no_grad():
            for name in names:
                self.destinations[name].copy_(self.values[name])
                self.nbytes += self.values[name].nbytes

    def __enter__(self) -> StateDictValues:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class CheckpointValues:
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
        # A tied tensor stored twice must hold one value, as the loader requires (see filling.read_all).
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
                self.model, converter, target_key, sources, lambda e, d=dtype: cast_source(self.reader, e, d)
            )
            with torch.no_grad():
                for out_key, value in converted.items():
                    self.destinations[outputs[out_key]].copy_(value)

    def __enter__(self) -> CheckpointValues:
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


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
