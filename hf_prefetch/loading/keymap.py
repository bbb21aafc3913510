"""Checkpoint keys -> model tensors: which checkpoint tensors fill which parameter or buffer, and where in it.

Keys are renamed and converted with transformers' own mapping for the architecture (renamed prefixes, experts merged
into one tensor); names, shapes and coverage are validated against the model on the meta device, from the headers
alone. Experts merged by stacking map to regions of the stacked tensor, so their bytes are read straight into place;
other conversions run through transformers on tensors read whole. This module knows names, shapes and transformers'
conversions; it reads no bytes (that is `reader.TensorReader`'s job) and allocates nothing (the loader's).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..formats import prequantized
from ..planning.placements import INNER_SEP
from .checkpoint import Checkpoint, TensorEntry

__all__ = ["KeyMap", "Region", "map_keys", "convert", "filled_names", "region_view"]

logger = logging.getLogger(__name__)

# A region of a destination tensor: the whole tensor (None) or `dest[index]`, optionally narrowed on its first dim.
Region = tuple[int, int | None, int | None] | None


@dataclass
class KeyMap:
    """Which checkpoint tensors fill which model tensor (by canonical name: the first of a tied tensor's names)."""

    model_tensors: dict[str, torch.Tensor]  # canonical name -> the model's (meta) parameter or buffer
    streamed: dict[str, list[tuple[TensorEntry, Region]]] = field(default_factory=dict)
    # Not streamable: (converter, target key, [(source pattern, entry)], {output key: canonical name}).
    converted: list[tuple[Any, str, list[tuple[str, TensorEntry]], dict[str, str]]] = field(default_factory=list)
    duplicates: list[tuple[TensorEntry, str]] = field(default_factory=list)  # tied tensors stored twice
    used_conversions: list[Any] = field(default_factory=list)


def map_keys(model: nn.Module, checkpoint: Checkpoint) -> KeyMap:
    """Map every checkpoint tensor to the model tensor it fills; `ValueError` naming the file and key for a shape
    that does not fit, an unexpected key, or a model tensor that no key fills."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    meta_state = model.state_dict(keep_vars=True)
    canonical: dict[int, str] = {}
    # A pre-quantized parameter's stored tensors (prequantized.checkpoint_parts) fill its parts, named as a plan names
    # them (`weight:absmax`), each read as stored (no renaming, no conversion); the keys its settings were read from
    # when it was built fill nothing, and a tensor under its own name beside its parts is refused.
    parts = prequantized.checkpoint_parts(model)
    stored, consumed = {}, {key for key, part in parts.items() if part is None}
    owners = {part[0].partition(INNER_SEP)[0] for part in parts.values() if part is not None}
    for key in consumed | owners:
        meta_state.pop(key, None)
    for key, part in parts.items():
        if part is not None:  # a tied parameter's parts go by its first name (its second one's entries: duplicates)
            name, tensor = part
            stored[key] = canonical.setdefault(id(tensor), name)
            meta_state[key] = tensor
    for name, tensor in meta_state.items():
        canonical.setdefault(id(tensor), name)
    tensors = {id(tensor): tensor for tensor in meta_state.values()}
    keymap = KeyMap({name: tensors[key] for key, name in canonical.items()})
    model_name = type(model).__name__

    is_hf = isinstance(model, PreTrainedModel)
    # The compressed-tensors quantizer's conversions (FP8 scales reshaped for the row-wise matmul) belong to the
    # mapping; the other quantizers' parts are mapped by formats/prequantized.py.
    quantizer = getattr(model, "hf_quantizer", None)
    if prequantized.quant_method(getattr(quantizer, "quantization_config", None)) != "compressed-tensors":
        quantizer = None
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer) if is_hf else []
    prefix = model.base_model_prefix if is_hf else None
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}

    # As transformers' convert_and_load_state_dict_in_model: rename in natural key order (merged experts stack in it).
    groups: dict[str, tuple[Any, list[tuple[str, TensorEntry]]]] = {}
    unexpected: list[tuple[TensorEntry, str]] = []
    for key in sorted(checkpoint.keys(), key=dot_natural_key):
        if key in consumed:
            continue
        entry = checkpoint[key]
        if key in owners and key not in stored:
            raise ValueError(
                f"{entry.path}: tensor {key!r} is stored beside the quantized parts of the same parameter (keys like "
                f"{[k for k, name in stored.items() if name.startswith(key + ':')][:3]}): which one it holds is "
                "ambiguous. Re-save the checkpoint from the quantized model."
            )
        if key in stored:
            expected = keymap.model_tensors[stored[key]]
            if (entry.dtype, entry.shape) != (expected.dtype, tuple(expected.shape)):
                raise ValueError(
                    f"{entry.path}: tensor {key!r} is {entry.dtype} {list(entry.shape)} but {model_name}'s "
                    f"{stored[key]} is {expected.dtype} {list(expected.shape)}: the checkpoint was quantized with "
                    "other settings than config.json's quantization_config. Re-save it from the quantized model."
                )
            if stored[key] in keymap.streamed:
                keymap.duplicates.append((entry, stored[key]))
            else:
                keymap.streamed[stored[key]] = [(entry, None)]
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], prefix, meta_state)
        if renamed not in meta_state:
            unexpected.append((entry, renamed))
        elif pattern is not None:
            groups.setdefault(renamed, (deepcopy(converter_of[pattern]), []))[1].append((pattern, entry))
        else:
            name = canonical[id(meta_state[renamed])]
            expected = meta_state[renamed].shape
            if entry.shape != tuple(expected):
                fields = "hidden_size, vocab_size, num_key_value_heads, ..."
                if "scale" in renamed.rpartition(".")[2]:  # a quantized weight's scales: one per block
                    fields = "quantization_config.weight_block_size, or " + fields
                raise ValueError(
                    f"{entry.path}: tensor {key!r} has shape {list(entry.shape)} but {model_name}.{renamed} has shape "
                    f"{list(expected)}. The checkpoint was saved for another configuration: check config.json "
                    f"({fields})."
                )
            if name in keymap.streamed:
                keymap.duplicates.append((entry, name))
            else:
                keymap.streamed[name] = [(entry, None)]

    for target_key, (converter, sources) in groups.items():
        _map_conversion(model, keymap, canonical, meta_state, converter, target_key, sources)
    keymap.used_conversions = [m for m in mapping if m.was_used()]

    # Unexpected keys transformers ignores: the model's own patterns, and buffers that became non-persistent.
    ignored = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignored += [r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"]
    unexpected = [(e, r) for e, r in unexpected if not any(re.search(p, r) for p in ignored)]
    # compressed-tensors' FP8 linears quantize their input per row at every forward: the static input scales of an
    # FP8 checkpoint with static activations are not read, as in transformers.
    unused = {
        f"{path}.input_scale" for path, m in model.named_modules() if type(m).__name__ == "CompressedTensorsFP8Linear"
    }
    unexpected = [(e, r) for e, r in unexpected if r not in unused]
    if unexpected:
        entry, renamed = unexpected[0]
        raise ValueError(
            f"{entry.path}: tensor {entry.key!r} (as {renamed!r}) matches no parameter or buffer of {model_name} "
            f"({len(unexpected)} unexpected key(s): {[e.key for e, _ in unexpected[:5]]}). The checkpoint is for "
            "another architecture or configuration: check config.json, or pass model_class= to from_pretrained."
        )
    covered = {id(keymap.model_tensors[name]) for name in filled_names(keymap)}
    kept = [name for name, t in keymap.model_tensors.items() if id(t) not in covered and not t.is_meta]
    missing = [name for name, t in keymap.model_tensors.items() if id(t) not in covered and t.is_meta]
    missing += [f"{n} (a parameter)" for n in kept if isinstance(keymap.model_tensors[n], nn.Parameter)]
    if missing:
        raise ValueError(
            f"The checkpoint at {checkpoint.folder} has no tensor for {model_name}.{missing[0]} ({len(missing)} "
            f"missing: {missing[:5]}). It holds keys like {checkpoint.keys()[:3]}: it was saved from another "
            "architecture or configuration (check config.json), or shards are missing from the index."
        )
    if kept:
        logger.info("Not in the checkpoint, keeping the values the model computed: %s", kept)
    unbuilt = [name for name, buffer in model.named_buffers() if buffer.is_meta and id(buffer) not in covered]
    if unbuilt:
        raise ValueError(
            f"Buffer {unbuilt[0]} of {model_name} is on the meta device and not in the checkpoint, so it cannot be "
            "computed. Build the model under accelerate.init_empty_weights(include_buffers=False) (the default)."
        )
    return keymap


def _map_conversion(model, keymap, canonical, meta_state, converter, target_key, sources) -> None:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    def meta(entry: TensorEntry) -> torch.Tensor:
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    try:  # run the conversion on meta tensors: target names and shapes, no data
        outputs = convert(model, converter, target_key, sources, meta)
    except Exception as err:
        raise ValueError(
            f"Cannot convert checkpoint tensors {[e.key for _, e in sources[:4]]} of {sources[0][1].path.name} into "
            f"{target_key} with {converter.operations}: {err}. The checkpoint does not fit this architecture's "
            "configuration: check config.json (num_experts, intermediate sizes, ...)."
        ) from err
    names: dict[str, str] = {}
    for out_key, value in outputs.items():
        if out_key not in meta_state or tuple(value.shape) != tuple(meta_state[out_key].shape):
            expected = list(meta_state[out_key].shape) if out_key in meta_state else "no such tensor"
            raise ValueError(
                f"Checkpoint tensors {[e.key for _, e in sources[:4]]} convert to {out_key} of shape "
                f"{list(value.shape)}, but {type(model).__name__} has {expected}. Check config.json."
            )
        name = canonical[id(meta_state[out_key])]
        if name in keymap.streamed or any(name in outs.values() for *_, outs in keymap.converted):
            raise ValueError(f"Two checkpoint tensors fill {out_key}: {sources[0][1].key!r} and another. Re-save it.")
        names[out_key] = name

    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    patterns = list(dict.fromkeys(pattern for pattern, _ in sources))
    if list(names) == [target_key] and ops == [(MergeModulelist, 0)] and len(patterns) == 1:
        # Experts stacked on a new first dim: expert i's bytes are exactly dest[i].
        keymap.streamed[target_key] = [(entry, (i, None, None)) for i, (_, entry) in enumerate(sources)]
    elif list(names) == [target_key] and ops == [(MergeModulelist, 0), (Concatenate, 1)]:
        # Stacked per pattern, then concatenated on dim 1 in source-pattern order (gate before up): expert i of the
        # p-th pattern fills rows [offset_p, offset_p + n_p) of dest[i], a contiguous block.
        pieces, offset = [], 0
        for pattern in (p for p in converter.source_patterns if p in patterns):
            of_pattern = [entry for p, entry in sources if p == pattern]
            pieces += [(entry, (i, offset, entry.shape[0])) for i, entry in enumerate(of_pattern)]
            offset += of_pattern[0].shape[0]
        keymap.streamed[target_key] = pieces
    else:
        keymap.converted.append((converter, target_key, sources, names))


def convert(model, converter, target_key, sources, load: Callable[[TensorEntry], torch.Tensor]) -> dict:
    """transformers' `WeightConverter.convert`, fed with tensors from `load` instead of its own file handles."""
    converter = deepcopy(converter)
    for pattern, entry in sources:
        converter.add_tensor(target_key, entry.key, pattern, lambda entry=entry: load(entry))
    outputs = converter.convert(target_key, model=model, config=getattr(model, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in outputs.items()}


def cast_source(reader: Any, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """A conversion's source tensor as transformers hands it to the conversion: floating-point values cast to the
    model's dtype, others (packed integers a conversion decompresses) as stored."""
    tensor = reader.read_tensor(entry)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def filled_names(keymap: KeyMap) -> list[str]:
    """The canonical names of the model tensors the checkpoint fills."""
    return [*keymap.streamed, *(name for *_, outputs in keymap.converted for name in outputs.values())]


def region_view(dest: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of `dest` that `region` names."""
    if region is None:
        return dest
    index, start, length = region
    return dest[index] if start is None else dest[index].narrow(0, start, length)
