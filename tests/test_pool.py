"""The static buffer pool (hf_prefetch/pool.py): `num_slots` buffers per distinct key, each its own storage, in the
key's exact layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_prefetch.pool import BufferPool

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
            assert buffer.untyped_storage().nbytes() == _numel(shape) * buffer.element_size()
        with pytest.raises(IndexError):
            pool.buffer(key, num_slots)


@pytest.mark.parametrize("num_slots", [1, 3])
def test_every_buffer_has_its_own_storage(num_slots):
    pool = BufferPool(KEYS, num_slots, CPU)
    buffers = [pool.buffer(key, slot) for key in KEYS for slot in range(num_slots)]
    spans = []
    for buffer in buffers:
        start = buffer.untyped_storage().data_ptr()
        spans.append((start, start + buffer.untyped_storage().nbytes()))
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
    per_slot = sum(_numel(shape) * dtype.itemsize for _, shape, _, dtype in KEYS)
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
