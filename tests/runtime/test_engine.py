"""The transfer engine (hf_prefetch/runtime/engine.py) on the CPU, built directly from rings of small tensors: what
each slot holds after every `wait` and `release`, what is counted, and the calls that rewrite or re-read host storage.

The slot bookkeeping itself (SlotTable, RingState) is tests/runtime/test_ring.py's; CUDA streams and graphs are
tests/test_gpu.py's and tests/test_compile.py's.
"""

from __future__ import annotations

import time

import pytest
import torch

from hf_prefetch.runtime.engine import PrefetchEngine
from hf_prefetch.runtime.pool import BufferPool
from hf_prefetch.runtime.ring import LayerCounters, LayerTransfer, RingTransfers
from tests.engines import copies, counters, misses

CPU = torch.device("cpu")
# Three parameters per layer: two dtypes, one transposed (non-contiguous) layout.
KEYS = [
    ("w", (3, 4), (4, 1), torch.float32),
    ("wt", (4, 3), (1, 4), torch.float64),
    ("i", (5,), (1,), torch.int32),
]


def values(layer: int, version: int = 0) -> list[torch.Tensor]:
    """Layer `layer`'s values, distinct for every layer and every version, in each key's exact layout."""
    out = []
    for index, (_, shape, stride, dtype) in enumerate(KEYS):
        numel = torch.Size(shape).numel()
        value = torch.arange(numel).reshape(shape) + 1000 * layer + 100 * index + 10_000 * version
        out.append(torch.empty_strided(shape, stride, dtype=dtype).copy_(value))
    return out


def slot_plan(num_layers: int, num_slots: int) -> tuple[list[int], list[int]]:
    """Layer k uses slot k % num_slots and hands it to k + num_slots, or to the first layer of the next forward that
    uses the slot ([Note: slot reuse] in ring.py; tests/planning/test_selection.py checks the planner makes the
    same)."""
    slots = [k % num_slots for k in range(num_layers)]
    following = [k + num_slots if k + num_slots < num_layers else k % num_slots for k in range(num_layers)]
    return slots, following


def make_ring(num_layers: int, num_slots: int, offset: int = 0) -> RingTransfers:
    pool = BufferPool(KEYS, num_slots, CPU)
    slots, following = slot_plan(num_layers, num_slots)
    layers = []
    for k in range(num_layers):
        host = values(offset + k)
        nbytes = sum(t.numel() * t.element_size() for t in host)
        device = [pool.buffer(key, slots[k]) for key in KEYS]
        layers.append(LayerTransfer(host, device, slots[k], following[k], nbytes))
    return RingTransfers(layers, pool)


def make_engine(num_layers: int, num_slots: int, timing: bool = False) -> PrefetchEngine:
    engine = PrefetchEngine(CPU, [make_ring(num_layers, num_slots)], pinned=False, timing=timing)
    engine.start()
    return engine


def slot_contents(engine: PrefetchEngine, ring: int, slot: int) -> list[torch.Tensor]:
    pool = engine.rings[ring].pool
    return [pool.buffer(key, slot) for key in KEYS]


def assert_slot_holds(engine: PrefetchEngine, ring: int, slot: int, expected: list[torch.Tensor]) -> None:
    for got, want in zip(slot_contents(engine, ring, slot), expected, strict=True):
        assert got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.equal(got, want)


def run(engine: PrefetchEngine, order: list[int], ring: int = 0, offset: int = 0, version: int = 0) -> None:
    """Run the layers in `order` as their hooks do: wait, compute (check the weights), release."""
    transfers = engine.rings[ring]
    for position in order:
        engine.wait(ring, position)
        slot = transfers.layers[position].slot
        assert_slot_holds(engine, ring, slot, values(offset + position, version))  # never another layer's weights
        engine.release(ring, position)


COMBOS = [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (5, 3), (4, 4), (6, 4), (7, 3), (8, 1)]


@pytest.mark.parametrize("num_layers, num_slots", COMBOS)
def test_each_layer_computes_with_its_own_values_and_copies_follow_the_plan(num_layers, num_slots):
    engine = make_engine(num_layers, num_slots)
    slots, following = slot_plan(num_layers, num_slots)
    users = [slots.count(slot) for slot in slots]  # how many layers take turns in each layer's slot
    first = min(num_layers, num_slots)
    assert copies(engine) == [1 if k < first else 0 for k in range(num_layers)]  # `start` fills every slot once
    for slot in range(first):
        assert_slot_holds(engine, 0, slot, values(slot))

    forwards = 3
    for _ in range(forwards):
        transfers = engine.rings[0]
        for position in range(num_layers):
            engine.wait(0, position)
            assert_slot_holds(engine, 0, slots[position], values(position))
            engine.release(0, position)
            # On the CPU the copy into the slot is done when `release` returns: the slot's next layer is there.
            assert_slot_holds(engine, 0, slots[position], values(following[position]))
            assert engine.holds(0, following[position])
        assert transfers.slots.owners == tuple(range(first))  # each slot holds the next forward's first layer

    # A layer that takes turns in its slot is copied once per forward (the first ones also once by `start`); a layer
    # alone in its slot was copied once by `start` and never again.
    expected = [(1 if k < first else 0) + (forwards if users[k] > 1 else 0) for k in range(num_layers)]
    assert copies(engine) == expected
    per_forward = sum(1 for k in range(num_layers) if users[k] > 1)
    assert sum(expected) == first + forwards * per_forward
    assert misses(engine) == 0
    for layer, count in zip(engine.rings[0].layers, expected, strict=True):
        assert layer.counters.copied_bytes == count * layer.nbytes


# (layers, slots, the layers run in order (forwards concatenated), misses)
UNUSUAL_ORDERS = [
    (4, 2, [0, 1, 3, 0, 1, 2, 3], 1),  # layer 2 skipped: slot 0 keeps it, so layer 0 of the next forward misses
    (4, 2, [0, 1, 1, 2, 3, 0, 1, 2, 3], 1),  # layer 1 repeated: the copy of layer 3 replaced it
    (4, 2, [3, 0, 1, 2, 3], 1),  # a layer called on its own
    (4, 2, [3, 2, 1, 0, 0, 1, 2, 3], 4),  # backwards (3 and 2 miss), then the repeated 0 and 1 find 2 and 3
    (4, 2, [0, 2, 1, 3, 0, 1, 2, 3], 0),  # interleaved so that each slot still sees its layers in turn
    (3, 3, [2, 0, 2, 1, 1, 0], 0),  # every layer alone in its slot: any order, never a miss
    (5, 3, [2, 2, 0, 1, 2, 3, 4], 0),  # layer 2 is alone in slot 2
    (5, 3, [4, 0, 1, 2, 3, 4], 1),
    (2, 1, [1, 1, 1, 0, 1], 3),  # each release of 1 hands the slot back to 0: every repeat misses
]


@pytest.mark.parametrize("num_layers, num_slots, order, expected_misses", UNUSUAL_ORDERS)
def test_a_skipped_or_repeated_layer_is_a_miss_and_still_computes_with_its_own_values(
    num_layers, num_slots, order, expected_misses
):
    engine = make_engine(num_layers, num_slots)
    run(engine, order)  # checks the slot after every wait
    assert misses(engine) == expected_misses
    before = copies(engine)
    run(engine, list(range(num_layers)))  # the cycle has resumed: a complete forward misses nothing
    assert misses(engine) == expected_misses
    slots, _ = slot_plan(num_layers, num_slots)
    shared = [slots.count(s) > 1 for s in slots]
    assert [b - a for a, b in zip(before, copies(engine), strict=True)] == [int(s) for s in shared]


def test_a_miss_is_counted_as_a_copy_of_its_layer():
    engine = make_engine(4, 2)
    engine.wait(0, 3)  # slot 1 holds layer 1
    three = engine.rings[0].layers[3]
    assert (three.counters.copies, three.counters.misses) == (1, 1)
    assert three.counters.copied_bytes == three.nbytes
    assert engine.holds(0, 3) and not engine.holds(0, 1)


def test_rings_are_independent():
    rings = [make_ring(4, 2), make_ring(3, 1, offset=10)]
    engine = PrefetchEngine(CPU, rings, pinned=False)
    engine.start()
    run(engine, [0, 1, 2], ring=1, offset=10)
    assert engine.rings[0].slots.owners == (0, 1) and copies(engine, 0) == [1, 1, 0, 0]
    run(engine, [0, 1, 2, 3], ring=0)
    assert engine.rings[1].slots.owners == (0,) and copies(engine, 1) == [2, 1, 1]
    assert misses(engine, 0) == misses(engine, 1) == 0


def test_invalidate_one_layer_makes_it_load_its_new_values():
    engine = make_engine(4, 2)
    rewritten = values(0, version=1)
    engine.invalidate(0, 0)  # before the host storage is written
    assert not engine.holds(0, 0) and engine.holds(0, 1)
    for host, value in zip(engine.rings[0].layers[0].host, rewritten, strict=True):
        host.copy_(value)
    engine.wait(0, 0)
    assert_slot_holds(engine, 0, 0, rewritten)
    assert misses(engine) == 1
    engine.release(0, 0)
    run(engine, [1, 2, 3])
    assert misses(engine) == 1


def test_invalidate_of_a_layer_that_does_not_own_its_slot_changes_nothing():
    engine = make_engine(4, 2)
    engine.invalidate(0, 2)  # slot 0 holds layer 0
    assert engine.holds(0, 0) and engine.holds(0, 1)
    run(engine, [0, 1, 2, 3])
    assert misses(engine) == 0


def test_invalidate_everything_makes_every_layer_miss_once():
    engine = make_engine(5, 3)
    engine.invalidate()
    assert not any(engine.holds(0, k) for k in range(5))
    run(engine, [0, 1, 2, 3, 4])
    assert misses(engine) == 3  # the first layers; the later ones were copied by the release before them
    run(engine, [0, 1, 2, 3, 4])
    assert misses(engine) == 3


def test_without_invalidate_a_slot_keeps_the_old_bytes():
    # Why `invalidate`, `refill` and `refresh` exist: the engine does not watch host storage.
    engine = make_engine(4, 2)
    for host, value in zip(engine.rings[0].layers[0].host, values(0, version=1), strict=True):
        host.copy_(value)
    engine.wait(0, 0)
    assert_slot_holds(engine, 0, 0, values(0))
    assert misses(engine) == 0


@pytest.mark.parametrize("num_layers, num_slots", [(4, 2), (5, 3), (3, 3), (1, 1)])
def test_refill_copies_every_first_layer_again_without_a_miss(num_layers, num_slots):
    engine = make_engine(num_layers, num_slots)
    run(engine, list(range(num_layers)))
    for k, layer in enumerate(engine.rings[0].layers):
        for host, value in zip(layer.host, values(k, version=1), strict=True):
            host.copy_(value)
    before = copies(engine)
    engine.refill()
    first = min(num_layers, num_slots)
    assert [b - a for a, b in zip(before, copies(engine), strict=True)] == [int(k < first) for k in range(num_layers)]
    for slot in range(first):
        assert_slot_holds(engine, 0, slot, values(slot, version=1))
    run(engine, list(range(num_layers)), version=1)
    assert misses(engine) == 0


def test_refresh_copies_only_a_layer_that_owns_its_slot_and_counts_nothing():
    engine = make_engine(4, 2)
    for k in (0, 2):
        for host, value in zip(engine.rings[0].layers[k].host, values(k, version=1), strict=True):
            host.copy_(value)
    before = [LayerCounters(**vars(c)) for c in counters(engine)]
    engine.refresh(0, 0)
    assert_slot_holds(engine, 0, 0, values(0, version=1))
    engine.refresh(0, 2)  # slot 0 belongs to layer 0: layer 2's new values wait for its own copy
    assert_slot_holds(engine, 0, 0, values(0, version=1))
    assert engine.holds(0, 0) and not engine.holds(0, 2)
    assert counters(engine) == before
    engine.wait(0, 0)
    engine.release(0, 0)  # copies layer 2 now, with its new values
    assert_slot_holds(engine, 0, 0, values(2, version=1))


def test_load_makes_a_layer_the_owner_of_its_slot_without_counting():
    engine = make_engine(4, 2)
    before = [LayerCounters(**vars(c)) for c in counters(engine)]
    engine.load(0, 2)
    assert_slot_holds(engine, 0, 0, values(2))
    assert engine.holds(0, 2) and not engine.holds(0, 0) and engine.holds(0, 1)
    assert counters(engine) == before
    run(engine, [2])  # finds its weights; its release hands slot 0 back to layer 0
    assert misses(engine) == 0
    engine.load(0, 2)
    run(engine, [0, 1, 2, 3])  # layer 0 finds layer 2's weights in its slot
    assert misses(engine) == 1


def test_store_copies_the_slot_back_into_host_storage():
    engine = make_engine(4, 2)
    one = engine.rings[0].layers[1]
    for buffer in one.device:  # the slot's weights changed in place on the device
        buffer.mul_(3)
    engine.store(0, 1)
    for host, value in zip(one.host, values(1), strict=True):
        assert torch.equal(host, value * 3)
    assert_slot_holds(engine, 0, 0, values(0))  # other slots and layers untouched
    assert all(torch.equal(h, v) for h, v in zip(engine.rings[0].layers[3].host, values(3), strict=True))
    with pytest.raises(RuntimeError, match=r"Layer 3 of ring 0 does not own slot 1: nothing to store"):
        engine.store(0, 3)
    assert all(torch.equal(h, v) for h, v in zip(engine.rings[0].layers[3].host, values(3), strict=True))


def test_reset_zeroes_every_counter_and_counting_goes_on():
    engine = make_engine(4, 2, timing=True)
    run(engine, [0, 3, 1, 2, 3])
    assert misses(engine) > 0 and sum(copies(engine)) > 0
    engine.reset()
    assert counters(engine) == [LayerCounters()] * 4
    run(engine, [0, 1, 2, 3])
    assert copies(engine) == [1, 1, 1, 1] and misses(engine) == 0


def test_timing_on_the_cpu_records_copy_stall_and_compute_seconds():
    engine = make_engine(4, 2, timing=True)
    for position in range(4):
        engine.wait(0, position)
        time.sleep(0.001)  # the layer's compute
        engine.release(0, position)
    engine.collect()
    for c in counters(engine):
        assert c.copies > 0 and c.copy_seconds > 0
        assert c.stall_seconds == c.copy_seconds  # a copy on the CPU is synchronous: the forward waits for all of it
        assert c.compute_seconds >= 0.001


def test_without_timing_no_seconds_are_recorded():
    engine = make_engine(4, 2)
    run(engine, [0, 1, 2, 3, 1])
    for c in counters(engine):
        assert c.copies > 0 and (c.copy_seconds, c.stall_seconds, c.compute_seconds) == (0.0, 0.0, 0.0)


def test_a_release_without_its_wait_counts_no_compute_time():
    engine = make_engine(2, 1, timing=True)
    engine.release(0, 0)  # e.g. a forward that skipped the pre-forward hook
    assert counters(engine)[0].compute_seconds == 0.0
    assert_slot_holds(engine, 0, 0, values(1))  # the slot still goes on to the next layer


def test_the_steps_around_a_forward_change_nothing_on_the_cpu():
    engine = make_engine(4, 2)
    run(engine, [0, 1])
    owners, before = engine.rings[0].slots.owners, [LayerCounters(**vars(c)) for c in counters(engine)]
    engine.prepare()
    engine.finish()
    engine.drain()
    engine.synchronize()
    engine.collect()
    assert not engine.graphs
    assert engine.rings[0].slots.owners == owners and counters(engine) == before
    run(engine, [2, 3])
    assert misses(engine) == 0
