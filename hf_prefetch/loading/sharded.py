"""Tensor-parallel loading: `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` on every rank.

The skeleton is sharded on the meta device by transformers' own tensor parallelism (its plan for the architecture,
its forward hooks and collectives), so its sharded parameters are DTensors whose local tensors are meta. Each rank
then reads only its own slices of the checkpoint's tensors, straight into its pinned host storage or onto its GPU: a
slice is one or more contiguous byte ranges of the stored tensor (its rows on the sharded dimension, for each index of
the dimensions before it), a `TensorEntry` of `rows` runs that `Checkpoint.read` reads run by run. No rank holds more
than its share, even briefly.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..formats.parts import is_dtensor
from ..planning.placements import INNER_SEP
from .checkpoint import TensorEntry
from .keymap import KeyMap, Region

__all__ = ["prepare", "shard_skeleton", "local_shards"]

LOCAL = "_local_tensor"  # the DTensor's part that holds a rank's shard (formats/parts.py)
_TRANSFORMERS = "transformers' from_pretrained(..., distributed_config=...) and pass it to hf_prefetch.dispatch_model"


def prepare(distributed_config: Any, device_mesh: Any, device: Any) -> tuple[tuple[Any, Any] | None, Any]:
    """transformers' tensor-parallel setup for `distributed_config` (and a user's `device_mesh`): ((the config, the
    mesh), `device`, or this rank's device where it is None: `LOCAL_RANK`'s GPU); (None, `device`) without a
    distributed config. `ValueError` for what rank-local streaming does not take (FSDP, pipeline parallelism, a mesh
    without a distributed config)."""
    if distributed_config is None:
        if device_mesh is not None:
            raise ValueError(
                "device_mesh= shards the model only with distributed_config= as well: pass "
                "distributed_config=DistributedConfig(tp_size=N) beside it, as in transformers' from_pretrained."
            )
        return None, device
    from transformers import PreTrainedModel
    from transformers.distributed import DistributedConfig

    if isinstance(distributed_config, dict):
        distributed_config = DistributedConfig.from_dict(distributed_config)
    if not isinstance(distributed_config, DistributedConfig):
        raise ValueError(
            f"distributed_config={distributed_config!r} must be a transformers DistributedConfig (or its dict), e.g. "
            "DistributedConfig(tp_size=2)."
        )
    others = {"fsdp_size": distributed_config.fsdp_size, "pp_size": distributed_config.pp_size}
    if not (distributed_config.tp_size or 1) > 1 or any((size or 1) > 1 for size in others.values()):
        raise ValueError(
            f"distributed_config={distributed_config!r}: hf_prefetch streams each rank's shards of a tensor-parallel "
            "model, so tp_size must be > 1 and fsdp_size and pp_size 1. Pass DistributedConfig(tp_size=N) with N the "
            "number of ranks (torchrun's world size)."
        )
    distributed_config, rank_device, mesh = PreTrainedModel.prepare_distribute_model(
        distributed_config, device_mesh=device_mesh
    )
    return (distributed_config, mesh), torch.device(rank_device) if device is None else device


def shard_skeleton(model: nn.Module, distributed_config: Any, mesh: Any) -> nn.Module:
    """The meta skeleton sharded as transformers shards it: DTensor placeholders and the tensor-parallel forwards."""
    return type(model).maybe_distribute_model(model, distributed_config, mesh)


def local_shards(model: nn.Module, keymap: KeyMap) -> KeyMap:
    """`keymap` with each DTensor parameter filled through its local tensor (`name:_local_tensor`) from the byte
    ranges of its stored tensors that are this rank's. `ValueError` naming the parameter for what cannot be read by
    slices (a tensor transformers converts on load, experts stacked and sharded inside an expert)."""
    names = [name for name, tensor in keymap.model_tensors.items() if is_dtensor(tensor)]
    if not names:
        return keymap
    sharded = set(names)
    for _, target, _, outputs in keymap.converted:
        if sharded & set(outputs.values()):
            raise ValueError(
                f"{target} of this checkpoint is converted by transformers as it loads (its stored tensors are "
                "merged or reshaped), and a converted tensor cannot be read by slices on each rank yet. Load the "
                f"model with {_TRANSFORMERS}, which streams each rank's shards."
            )
    for entry, name in keymap.duplicates:
        if name in sharded:
            raise ValueError(
                f"{entry.path}: {entry.key!r} stores the tensor-parallel parameter {name} a second time (tied "
                "weights saved twice), which cannot be read by slices. Re-save the checkpoint with tied weights once."
            )
    streamed, tensors = dict(keymap.streamed), dict(keymap.model_tensors)
    for name in names:
        param = tensors.pop(name)
        local = getattr(param, LOCAL)
        sources = streamed.pop(name, [])
        pieces = [piece for entry, region in sources for piece in _local_pieces(name, param, entry, region)]
        streamed[f"{name}{INNER_SEP}{LOCAL}"] = pieces
        tensors[f"{name}{INNER_SEP}{LOCAL}"] = local
    return replace(keymap, streamed=streamed, model_tensors=tensors)


def _local_pieces(name: str, param: Any, entry: TensorEntry, region: Region) -> list[tuple[TensorEntry, Region]]:
    # The part of `entry` that fills this rank's local tensor, with the region of the local tensor it fills.
    from torch.distributed.tensor import Replicate, Shard

    packed = [p for p in param.placements if type(p) not in (Shard, Replicate)]
    if packed:  # transformers' packed shards (_StridedShard: a rank's block of each of gate and up)
        raise ValueError(
            f"{name} is sharded as {packed[0]!r}, whose rank's rows are not one block of the stored tensor, which "
            f"cannot be read by slices yet. Load the model with {_TRANSFORMERS}."
        )
    shards = [(i, p.dim % param.ndim) for i, p in enumerate(param.placements) if type(p) is Shard]
    if not shards:  # replicated: the whole tensor
        return [(entry, region)]
    ((mesh_dim, dim),) = shards
    mesh = param.device_mesh
    size, coordinate = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    rows = param.shape[dim] // size
    start = coordinate * rows
    if region is None:
        return [(_slice(entry, dim, start, rows), None)]
    index, first, length = region
    if dim == 0:  # experts stacked on dimension 0 and sharded on it: the rank's experts, whole
        if not start <= index < start + rows:
            return []
        return [(entry, (index - start, first, length))]
    if first is not None:
        raise ValueError(
            f"{name} concatenates stored tensors inside each expert and is sharded inside an expert (dimension "
            f"{dim}), which cannot be read by slices yet. Load the model with {_TRANSFORMERS}."
        )
    return [(_slice(entry, dim - 1, start, rows), region)]  # expert `index`'s own tensor, sliced alike


def _slice(entry: TensorEntry, dim: int, start: int, rows: int) -> TensorEntry:
    # Rows [start, start + rows) of dimension `dim`: for each index of the dimensions before it, one run of bytes.
    shape = entry.shape
    inner = math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
    runs = math.prod(shape[:dim])
    local = (*shape[:dim], rows, *shape[dim + 1 :])
    offset = entry.offset + start * inner
    return replace(
        entry, shape=local, offset=offset, nbytes=runs * rows * inner, rows=runs, row_stride=shape[dim] * inner
    )
