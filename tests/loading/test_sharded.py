"""A tensor-parallel rank's slices of stored tensors (loading/sharded.py), checked against torch.chunk on every rank
of meshes of 2 and 4 without a process group: the byte ranges and regions the reader fills must give exactly the
rank's local tensor, for a shard on each dimension and for experts stacked from tensors stored one by one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hf_prefetch.loading.checkpoint import TensorEntry
from hf_prefetch.loading.keymap import region_view
from hf_prefetch.loading.sharded import _local_pieces


class _Mesh:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self, dim: int = 0) -> int:
        return self._size

    def get_local_rank(self, dim: int = 0) -> int:
        return self._rank


def _param(shape, placement, size, rank):
    return SimpleNamespace(
        shape=torch.Size(shape), ndim=len(shape), placements=(placement,), device_mesh=_Mesh(size, rank)
    )


def _entry(tensor: torch.Tensor, offset: int = 24) -> TensorEntry:
    return TensorEntry("w", Path("model.safetensors"), tensor.dtype, tuple(tensor.shape), offset, tensor.nbytes)


def _fill(stored: torch.Tensor, pieces, local: torch.Tensor, offset: int = 24) -> None:
    # What the reader does: each piece's bytes, from the stored tensor's bytes, into its region of the local tensor.
    raw = stored.contiguous().view(-1).view(torch.uint8)
    for entry, region in pieces:
        start = entry.offset - offset
        values = raw[start : start + entry.nbytes].view(stored.dtype).view(entry.shape)
        region_view(local, region).copy_(values)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    ("shape", "dim"), [((8, 12), 0), ((8, 12), 1), ((4, 8, 12), 0), ((4, 8, 12), 1), ((4, 8, 12), 2)]
)
def test_a_ranks_slices_are_its_chunk(shape, dim, size):
    stored = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    for rank in range(size):
        want = stored.chunk(size, dim)[rank]
        local = torch.full_like(want, -1)
        pieces = _local_pieces("w", _param(shape, Shard(dim), size, rank), _entry(stored), None)
        _fill(stored, pieces, local)
        assert torch.equal(local, want), (shape, dim, rank)
        assert sum(entry.nbytes for entry, _ in pieces) == want.nbytes  # its own bytes, nothing more


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_stacked_experts_are_read_expert_by_expert(dim, size):
    # Four experts stored one by one (8, 12) stack into (4, 8, 12); a region (i, None, None) is expert i's, and a
    # concatenation's (i, first, length) rows [first, first + length) of it (gate before up).
    experts = [torch.randn(8, 12) for _ in range(4)]
    stacked = torch.stack(experts)
    for rank in range(size):
        want = stacked.chunk(size, dim)[rank]
        local = torch.full_like(want, -1)
        param = _param(stacked.shape, Shard(dim), size, rank)
        for index, expert in enumerate(experts):
            _fill(expert, _local_pieces("w", param, _entry(expert), (index, None, None)), local)
        assert torch.equal(local, want), (dim, rank)
    halves = [(expert[:4], expert[4:]) for expert in experts]  # gate and up stored apart, concatenated on load
    for rank in range(size):
        want = stacked.chunk(size, 0)[rank]
        local = torch.full_like(want, -1)
        param = _param(stacked.shape, Shard(0), size, rank)
        for index, (gate, up) in enumerate(halves):
            for first, half in ((0, gate), (4, up)):
                _fill(half, _local_pieces("w", param, _entry(half), (index, first, 4)), local)
        assert torch.equal(local, want), rank


def test_replicated_tensors_are_read_whole_and_packed_shards_are_refused():
    stored = torch.randn(8, 12)
    pieces = _local_pieces("w", _param(stored.shape, Replicate(), 2, 1), _entry(stored), None)
    assert [entry.nbytes for entry, _ in pieces] == [stored.nbytes]
    packed = _StridedShard(0, split_factor=2)  # transformers' packed gate and up: a block of each per rank
    with pytest.raises(ValueError, match=r"w is sharded as .*cannot be read by slices yet. Load the model with"):
        _local_pieces("w", _param(stored.shape, packed, 2, 0), _entry(stored), None)
