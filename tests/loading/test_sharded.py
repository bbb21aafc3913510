"""A tensor-parallel rank's slices of stored tensors (loading/sharded.py), read from a safetensors file by
`Checkpoint.read` and checked against torch.chunk on every rank of meshes of 2 and 4, without a process group: the
entries and regions must give exactly the rank's local tensor, for a shard on each dimension and for experts stacked
from tensors stored one by one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hf_prefetch.loading.checkpoint import Checkpoint
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


def _entry(tensor: torch.Tensor, folder: Path, key: str = "w"):
    save_file({key: tensor.contiguous()}, folder / f"{key}.safetensors")
    checkpoint = Checkpoint.open(folder / f"{key}.safetensors")
    return checkpoint, checkpoint[key]


def _fill(checkpoint, pieces, local: torch.Tensor) -> None:
    # What the reader does: each piece's bytes into its region of the local tensor.
    for entry, region in pieces:
        out = region_view(local, region)
        assert tuple(out.shape) == entry.shape
        checkpoint.read(entry, out.view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((8, 12), 0), ((8, 12), 1), ((4, 8, 12), 0), ((4, 8, 12), 1), ((4, 8, 12), 2), ((2, 4, 8, 12), 3)],
)
def test_a_ranks_slices_are_its_chunk(shape, dim, size, tmp_path):
    stored = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    checkpoint, entry = _entry(stored, tmp_path)
    with checkpoint:
        for rank in range(size):
            want = stored.chunk(size, dim)[rank]
            local = torch.full_like(want, -1)
            pieces = _local_pieces("w", _param(shape, Shard(dim), size, rank), entry, None)
            _fill(checkpoint, pieces, local)
            assert torch.equal(local, want), (shape, dim, rank)
            assert [piece.nbytes for piece, _ in pieces] == [want.nbytes]  # its own bytes, nothing more


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_stacked_experts_are_read_expert_by_expert(dim, size, tmp_path):
    # Four experts stored one by one (8, 12) stack into (4, 8, 12); a region (i, None, None) is expert i's, and a
    # concatenation's (i, first, length) rows [first, first + length) of it (gate before up).
    experts = [torch.randn(8, 12) for _ in range(4)]
    stacked = torch.stack(experts)
    stored = [_entry(expert, tmp_path, f"e{i}") for i, expert in enumerate(experts)]
    for rank in range(size):
        want = stacked.chunk(size, dim)[rank]
        local = torch.full_like(want, -1)
        param = _param(stacked.shape, Shard(dim), size, rank)
        for index, (checkpoint, entry) in enumerate(stored):
            _fill(checkpoint, _local_pieces("w", param, entry, (index, None, None)), local)
        assert torch.equal(local, want), (dim, rank)
    halves = [_entry(part, tmp_path, f"h{i}{j}") for i, e in enumerate(experts) for j, part in enumerate(e.split(4))]
    for rank in range(size):  # gate and up stored apart, concatenated on load
        want = stacked.chunk(size, 0)[rank]
        local = torch.full_like(want, -1)
        param = _param(stacked.shape, Shard(0), size, rank)
        for number, (checkpoint, entry) in enumerate(halves):
            index, first = divmod(number, 2)
            _fill(checkpoint, _local_pieces("w", param, entry, (index, first * 4, 4)), local)
        assert torch.equal(local, want), rank
    for checkpoint, _ in stored + halves:
        checkpoint.close()


def test_replicated_tensors_are_read_whole_and_packed_shards_are_refused(tmp_path):
    stored = torch.randn(8, 12)
    checkpoint, entry = _entry(stored, tmp_path)
    with checkpoint:
        assert _local_pieces("w", _param(stored.shape, Replicate(), 2, 1), entry, None) == [(entry, None)]
        packed = _StridedShard(0, split_factor=2)  # transformers' packed gate and up: a block of each per rank
        with pytest.raises(ValueError, match=r"w is sharded as .*cannot be read by slices yet. Load the model with"):
            _local_pieces("w", _param(stored.shape, packed, 2, 0), entry, None)


def test_a_slice_of_a_file_truncated_under_it_names_the_file(tmp_path):
    stored = torch.randn(8, 12)
    checkpoint, entry = _entry(stored, tmp_path)
    with checkpoint:
        ((piece, _),) = _local_pieces("w", _param(stored.shape, Shard(1), 2, 1), entry, None)
        assert piece.rows == 8  # one run per row
        with open(entry.path, "r+b") as file:  # the last rows' bytes are gone
            file.truncate(entry.offset + entry.nbytes // 2)
        local = torch.empty(8, 6)
        with pytest.raises(ValueError, match=r"w\.safetensors: the file ended while reading 'w'"):
            checkpoint.read(piece, local.view(-1).view(torch.uint8).numpy())
