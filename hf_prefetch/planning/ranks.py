"""Tensor-parallel models: parameters that are torch.distributed DTensors, sharded over a device mesh as transformers'
tensor parallelism (`distributed_config`, `tp_plan`) or a user's `DeviceMesh` leaves them. Each rank plans, pins and
streams only its own shards: a DTensor's local tensor is one of its parameter's parts (`weight:_local_tensor`,
formats/parts.py), so the planner, the pool and the engine see the rank's bytes and nothing else, and the collectives
the tensor-parallel forward inserts run as before.

Every rank of the mesh dispatches (or plans, or loads) the same model with the same config: `agree` runs the plan on
each rank, then one collective tells every rank whether the configs match and whether every rank could plan its
share, so that all of them raise, or none does, before anything moves. Rank 0's plan lists every rank's share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..formats.parts import is_dtensor
from .placements import format_bytes

__all__ = ["RankShare", "RankFailed", "sharded_mesh", "agree", "settle", "rank_totals"]


@dataclass(frozen=True)
class RankShare:
    """One rank's share of a tensor-parallel plan, in bytes: its device's resident weights and pool, its pinned host
    memory and what its link copies per forward."""

    rank: int
    device: str
    resident_bytes: int
    pool_bytes: int
    host_bytes: int
    streamed_bytes_per_forward: int


def sharded_mesh(model: nn.Module) -> Any | None:
    """The device mesh of `model`'s DTensor parameters and buffers, or None where it has none. `ValueError` for what
    rank-local streaming cannot take: several meshes, a mesh of more than one dimension, a partial placement, or a
    mesh whose size does not divide a sharded dimension (ranks would hold shards of different sizes)."""
    mesh, first = None, None
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if not is_dtensor(tensor):
            continue
        from torch.distributed.tensor import Shard  # (a DTensor's module is loaded already)

        if mesh is None:
            mesh, first = tensor.device_mesh, name
        elif tensor.device_mesh != mesh:
            raise ValueError(
                f"{name} is sharded over the device mesh {tensor.device_mesh}, and {first} over {mesh}: hf_prefetch "
                "streams a tensor-parallel model whose tensors share one mesh. Shard the model over one mesh."
            )
        if mesh.ndim != 1:
            raise ValueError(
                f"{name} is sharded over a {mesh.ndim}-dimensional device mesh ({mesh}); hf_prefetch streams the "
                "shards of a one-dimensional tensor-parallel mesh. Use tensor parallelism alone "
                "(DistributedConfig(tp_size=N))."
            )
        for placement in tensor.placements:
            if placement.is_partial():
                raise ValueError(
                    f"{name} has a partial placement ({placement}): its values are not stored but pending a "
                    "reduction. Stream a model whose parameters are sharded or replicated."
                )
            if type(placement) is Shard:  # (transformers' packed shards, _StridedShard, hold blocks of their own)
                dim = placement.dim % tensor.ndim
                if tensor.shape[dim] % mesh.size():
                    raise ValueError(
                        f"{name} has {tensor.shape[dim]} rows in dimension {dim}, which its mesh of {mesh.size()} "
                        f"ranks does not divide: the ranks would hold shards of different sizes. Choose a tensor-"
                        f"parallel size (tp_size) that divides {tensor.shape[dim]}."
                    )
    return mesh


def agree(mesh: Any, fingerprint: Any, make: Callable[[], Any], device: torch.device) -> Any:
    """`make()`'s plan on this rank, once every rank of `mesh` has planned: one `all_gather_object` carries each
    rank's `fingerprint` (its config), its share, or the error its planning raised. Every rank raises if the
    fingerprints differ (naming the ranks that differ from the first) or if any rank's planning failed (naming the
    rank: its own error on that rank); otherwise the plan comes back with every rank's share in `plan.ranks`."""
    import dataclasses

    import torch.distributed as dist

    group = mesh.get_group()
    error: BaseException | None = None
    plan = None
    try:
        plan = make()
    except BaseException as err:  # raised once every rank knows (the others would wait in the next collective)
        error = err
    share = None if plan is None else _share(plan, dist.get_rank(), device)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    own = (dist.get_rank(), fingerprint, share, None if error is None else f"{type(error).__name__}: {error}")
    dist.all_gather_object(gathered, own, group)
    first_rank, first_print = gathered[0][0], gathered[0][1]
    differ = [(rank, other) for rank, other, _, _ in gathered if other != first_print]
    if differ:
        ranks = ", ".join(str(rank) for rank, _ in differ)
        raise ValueError(
            f"The ranks of the tensor-parallel mesh dispatch with different settings: rank(s) {ranks} differ from "
            f"rank {first_rank} ({_difference(first_print, differ[0][1], first_rank, differ[0][0])}). Every rank must "
            "pass the same config and layers (max_memory may differ: it is each rank's own budget). Nothing was "
            "dispatched on any rank."
        )
    failed = [(rank, message) for rank, _, _, message in gathered if message is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise ValueError(
            f"Rank {rank} of the tensor-parallel mesh cannot plan its share, so no rank dispatches: {message}"
        )
    return dataclasses.replace(plan, ranks=tuple(share for _, _, share, _ in gathered))


class RankFailed(ValueError):
    """Another rank of the tensor-parallel mesh failed to dispatch its share after every rank had planned: this rank's
    dispatch is undone as well."""


def settle(model: nn.Module, plan: Any, error: BaseException | None = None) -> None:
    """The end of a tensor-parallel rank's dispatch or load, or of a dispatch's validation (`plan.ranks`; nothing
    otherwise): one collective tells every rank whether every rank got there (`error` None) or failed after planning
    (`error`: a full pinned memory, an interrupt). Raises `RankFailed` naming the first failed rank where this rank
    got there and another did not, so that the caller rolls its dispatch back as after an error of its own; nothing
    where this rank failed (the caller raises its own error), nor for that `RankFailed` itself."""
    if plan is None or not plan.ranks or isinstance(error, RankFailed):
        return
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    try:
        group = sharded_mesh(model).get_group()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (dist.get_rank(), mine), group)
    except Exception as failure:
        if error is None:  # (a RankFailed: the caller rolls back without a second collective)
            raise RankFailed(
                f"The ranks of the tensor-parallel mesh could not confirm the dispatch: {failure}"
            ) from failure
        return  # this rank's own error is the one to raise
    failed = [(rank, message) for rank, message in gathered if message is not None]
    if error is None and failed:
        rank, message = failed[0]
        raise RankFailed(
            f"Rank {rank} of the tensor-parallel mesh failed to dispatch its share ({message}), so this rank's "
            "dispatch is undone as well."
        )


def rank_totals(ranks: tuple[RankShare, ...]) -> list[tuple[str, str]]:
    """The plan's lines for each rank of a tensor-parallel mesh (its own plan shows its own bytes above them)."""
    size = format_bytes
    return [
        (
            f"rank {r.rank} ({r.device})",
            f"resident {size(r.resident_bytes)}, pool {size(r.pool_bytes)}, pinned host {size(r.host_bytes)}, "
            f"streams {size(r.streamed_bytes_per_forward)} per forward",
        )
        for r in ranks
    ]


def _share(plan: Any, rank: int, device: torch.device) -> RankShare:
    return RankShare(
        rank, str(device), plan.resident_bytes, plan.pool_bytes, plan.host_bytes, plan.streamed_bytes_per_forward
    )


def _difference(first: Any, other: Any, first_rank: int, other_rank: int) -> str:
    # What differs between two ranks' (config, layers, number of links): the config's fields by name.
    import dataclasses

    names = ("config", "layers", "links")
    found = []
    for name, a, b in zip(names, first, other, strict=True):
        if a == b:
            continue
        if name == "config" and type(a) is type(b) and dataclasses.is_dataclass(a):
            for field in dataclasses.fields(a):
                x, y = getattr(a, field.name), getattr(b, field.name)
                if x != y:
                    found.append(f"{field.name}={_short(x)} on rank {first_rank}, {_short(y)} on rank {other_rank}")
        else:
            found.append(f"{name} {_short(a)} on rank {first_rank}, {_short(b)} on rank {other_rank}")
    return "; ".join(found)


def _short(value: Any) -> str:
    if isinstance(value, frozenset | set):
        value = sorted(value, key=repr)
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
