"""The static buffer pool (hf_prefetch/runtime/pool.py): `num_slots` buffers per distinct key, in the key's exact
layout, each slot one storage with its buffers at aligned offsets in key order; and `ring.byte_span`, which turns a
layer's copies into one where the slot and the host arena lay its tensors out alike."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_prefetch.alignment import TENSOR_ALIGN_BYTES
from hf_prefetch.host.arena import HostArena, padded_bytes
from hf_prefetch.runtime.pool import BufferPool
from hf_prefetch.runtime.ring import byte_span

CPU = torch.device("cpu")
KEYS = [
    ("self_attn.q_proj.weight", (8, 4), (4, 1), torch.float32),
    ("self_attn.k_proj.weight", (8, 4), (4, 1), torch.float32),  # same layout, another name: its own buffers
    ("mlp.down_proj.weight", (4, 6), (1, 4), torch.bfloat16),  # a transposed layout is kept
    ("experts", (2, 3, 5), (15, 5, 1), torch.float16),
    ("norm.bias", (7,), (1,), torch.int64),
    ("scalar", (), (), torch.float64),
]


def _numel(shape) -> int:
    return torch.Size(shape).numel()


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_one_buffer_per_key_and_slot_in_the_keys_layout(num_slots):
    pool = BufferPool(KEYS, num_slots, CPU)
    assert pool.num_slots == num_slots
    for key in KEYS:
        _, shape, stride, dtype = key
        for slot in range(num_slots):
            buffer = pool.buffer(key, slot)
            assert (tuple(buffer.shape), buffer.stride(), buffer.dtype, buffer.device) == (shape, stride, dtype, CPU)
            # One storage per slot, the buffers in key order at aligned offsets.
            assert buffer.untyped_storage().data_ptr() == pool.buffer(KEYS[0], slot).untyped_storage().data_ptr()
            offset = sum(padded_bytes(_numel(k[1]) * k[3].itemsize) for k in KEYS[: KEYS.index(key)])
            assert buffer.data_ptr() - buffer.untyped_storage().data_ptr() == offset
        with pytest.raises(IndexError):
            pool.buffer(key, num_slots)


@pytest.mark.parametrize("num_slots", [1, 3])
def test_no_two_buffers_overlap(num_slots):
    pool = BufferPool(KEYS, num_slots, CPU)
    buffers = [pool.buffer(key, slot) for key in KEYS for slot in range(num_slots)]
    spans = []
    for buffer in buffers:
        start = buffer.data_ptr()
        spans.append((start, start + buffer.numel() * buffer.element_size()))
    for (a0, a1), (b0, b1) in itertools.combinations(spans, 2):
        assert a1 <= b0 or b1 <= a0  # no two buffers overlap
    # Writing one buffer changes no other.
    for buffer in buffers:
        buffer.zero_()
    pool.buffer(KEYS[0], num_slots - 1).fill_(1)
    assert [bool(b.any()) for b in buffers] == [b is pool.buffer(KEYS[0], num_slots - 1) for b in buffers]


def test_the_same_buffer_is_returned_each_time():
    pool = BufferPool(KEYS, 2, CPU)
    assert pool.buffer(KEYS[2], 1) is pool.buffer(KEYS[2], 1)
    assert pool.buffer(KEYS[2], 1).data_ptr() != pool.buffer(KEYS[2], 0).data_ptr()


@pytest.mark.parametrize("num_slots", [1, 2, 4])
def test_nbytes_counts_every_buffer_once(num_slots):
    per_slot = sum(padded_bytes(_numel(shape) * dtype.itemsize) for _, shape, _, dtype in KEYS)
    assert BufferPool(KEYS, num_slots, CPU).nbytes == num_slots * per_slot
    # A key named twice (two layers with the same parameter) is one set of buffers.
    assert BufferPool(KEYS + KEYS[:2], num_slots, CPU).nbytes == num_slots * per_slot


def test_an_unknown_key_is_an_error():
    pool = BufferPool(KEYS[:1], 2, CPU)
    name, shape, stride, _ = KEYS[0]
    with pytest.raises(KeyError):
        pool.buffer((name, shape, stride, torch.float16), 0)  # same name and shape, another dtype


def test_an_empty_pool():
    pool = BufferPool([], 2, CPU)
    assert pool.nbytes == 0 and pool.num_slots == 2


def _arena_views(arena: HostArena, keys, first: int = 0) -> list[torch.Tensor]:
    return [arena.view(first + i, shape, stride, dtype) for i, (_, shape, stride, dtype) in enumerate(keys)]


@pytest.mark.parametrize("slot", [0, 1])
def test_a_layer_laid_out_alike_on_both_sides_is_one_copy_of_the_same_bytes(slot):
    pool = BufferPool(KEYS[:5], 2, CPU)  # the scalar is left out: a layer of the first five keys
    layers = KEYS[:5] * 2
    arena = HostArena([_numel(shape) * dtype.itemsize for _, shape, _, dtype in layers])
    for index, view in enumerate(_arena_views(arena, layers)):
        view.copy_(torch.arange(view.numel()).reshape(view.shape).to(view.dtype) + index)
    second = _arena_views(arena, KEYS[:5], first=5)  # the second layer of the arena
    device = [pool.buffer(key, slot) for key in KEYS[:5]]
    span = byte_span(device, second)
    assert span is not None
    slot_bytes, host_bytes = span
    assert slot_bytes.dtype == host_bytes.dtype == torch.uint8 and slot_bytes.numel() == host_bytes.numel()
    other = [pool.buffer(key, 1 - slot) for key in KEYS[:5]]
    for buffer in other:
        buffer.fill_(7)
    slot_bytes.copy_(host_bytes)
    assert all(torch.equal(d, h) for d, h in zip(device, second, strict=True))
    assert all(bool((b == 7).all()) for b in other)  # the other slot is untouched


def test_layers_laid_out_otherwise_are_copied_tensor_by_tensor():
    pool = BufferPool(KEYS[:3], 1, CPU)
    arena = HostArena([_numel(shape) * dtype.itemsize for _, shape, _, dtype in KEYS[:3]])
    host, device = _arena_views(arena, KEYS[:3]), [pool.buffer(key, 0) for key in KEYS[:3]]
    assert byte_span(device, host) is not None
    assert byte_span(device[:1], host[:1]) is None  # one tensor: nothing to gain
    assert byte_span([device[0], device[2]], [host[0], host[2]]) is None  # a tensor in between is not the layer's
    assert byte_span(device[::-1], host[::-1]) is None  # another order
    assert byte_span(device, [host[0], host[1].clone(), host[2]]) is None  # another storage
    transposed = torch.empty(4, 8).t()  # dense, but not the host's storage
    assert byte_span([device[0], device[1]], [host[0], transposed]) is None
    assert TENSOR_ALIGN_BYTES == 4096  # what both layouts round to
