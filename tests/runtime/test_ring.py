"""The ring's bookkeeping (hf_prefetch/runtime/ring.py): the slot table, the CUDA-graph state and its transitions,
through the public methods the engine drives, and what the engine makes of them on the CPU (the triggers themselves
need a CUDA capture: tests/test_gpu.py and tests/test_compile.py run them for real)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_prefetch
from hf_prefetch.runtime.pool import BufferPool
from hf_prefetch.runtime.ring import CopyEvent, LayerTransfer, RingState, RingTransfers, SlotTable
from tests.models import prompt, tiny_llama


def _ring(num_layers: int, num_slots: int) -> RingTransfers:
    pool = BufferPool([("w", (2,), (1,), torch.float32)], num_slots, torch.device("cpu"))
    layers = [
        LayerTransfer([torch.zeros(2)], [pool.buffer(("w", (2,), (1,), torch.float32), k % num_slots)], k % num_slots,
                      k + num_slots if k + num_slots < num_layers else k % num_slots, 8)
        for k in range(num_layers)
    ]  # fmt: skip
    return RingTransfers(layers, pool)


def test_a_claim_names_its_layer_only_once_the_copy_was_issued():
    table = SlotTable(2)
    with table.claim(1, 5):
        assert table.owners == (None, None)  # an interrupt here leaves the slot to nobody
    assert table.owners == (None, 5) and table.holds(1, 5)
    with pytest.raises(KeyboardInterrupt), table.claim(1, 7):
        raise KeyboardInterrupt
    assert table.owners == (None, None)
    table.release(0, 3)  # not its owner: nothing changes
    with table.claim(0, 3):
        pass
    table.release(0, 3)
    assert table.owners == (None, None)


@pytest.mark.parametrize("num_layers, num_slots, shares", [(4, 2, True), (2, 2, False), (3, 2, True), (1, 1, False)])
def test_transitions_of_a_ring(num_layers, num_slots, shares):
    ring = _ring(num_layers, num_slots)
    assert ring.state is RingState.EAGER and ring.shares_slots is shares
    for position in range(ring.num_first):
        with ring.slots.claim(ring.layers[position].slot, position):
            pass
    ring.begin_forward(None)
    ring.end_forward()
    ring.settle()
    assert ring.state is RingState.EAGER  # eager rings never change state: the hooks keep the table true
    assert not ring.missing_first_layers()

    ring.begin_capture()
    assert ring.state is RingState.CAPTURING and ring.capture.steady
    ring.join_capture()
    assert ring.state is RingState.SETTLED and ring.capture is None
    if shares:  # the slots will hold whatever a replay leaves: forgotten, `finish` copies the first layers
        assert ring.missing_first_layers() == list(range(ring.num_first))
    else:  # nothing ever moves: each layer keeps its slot, with nothing to wait for
        assert not ring.missing_first_layers()
        assert all(layer.event is CopyEvent.LANDED and layer.done is None for layer in ring.layers)

    for position in ring.missing_first_layers():
        with ring.slots.claim(ring.layers[position].slot, position):
            pass
    ring.begin_forward(None)
    assert ring.state is RingState.IN_FLIGHT
    ring.end_forward()  # the last layer released in Python: the table is true
    assert ring.state is RingState.SETTLED and not ring.missing_first_layers()
    ring.begin_forward(None)
    ring.settle()  # a forward that may have been a replay and never told the table
    assert ring.state is RingState.SETTLED
    assert ring.missing_first_layers() == (list(range(ring.num_first)) if shares else [])


def test_each_replay_counts_what_its_capture_recorded_and_a_forward_run_in_python_counts_itself():
    # A replay runs no Python: the counts its capture made in Python (a copy recorded for layer 2, the rows of 8 picks
    # gathered for layer 3) are added once per forward of that graph's token count that ran no layer in Python.
    ring = _ring(4, 2)
    ring.begin_forward(1)
    ring.begin_capture()
    ring.layers[2].counters.copies += 1
    ring.layers[2].counters.copied_bytes += 8
    ring.layers[3].counters.routed_rows += 8
    ring.join_capture()
    assert ring.recorded == {1: [{}, {}, {"copies": 1, "copied_bytes": 8}, {"routed_rows": 8}]}
    counted = lambda: [(layer.counters.copies, layer.counters.routed_rows) for layer in ring.layers]  # noqa: E731
    assert counted() == [(0, 0), (0, 0), (1, 0), (0, 8)]
    for _ in range(3):  # three replays
        ring.begin_forward(1)
        ring.settle()
    assert counted() == [(0, 0), (0, 0), (4, 0), (0, 32)]
    ring.begin_forward(1)
    ring.python_ran = True  # a forward of the same shape run eagerly (a layer waited in Python) counts itself
    ring.settle()
    ring.begin_forward(7)  # a shape no graph recorded: not a replay of one
    ring.settle()
    ring.begin_forward(1)
    ring.end_forward()  # its last layer released in Python
    ring.settle()
    assert counted() == [(0, 0), (0, 0), (4, 0), (0, 32)]
    ring.begin_capture()
    ring.abort_capture()  # an aborted capture records nothing
    assert list(ring.recorded) == [1]


def test_an_aborted_capture_forgets_the_slots_its_recorded_copies_claimed():
    ring = _ring(4, 2)
    for position in (0, 1):
        with ring.slots.claim(ring.layers[position].slot, position):
            pass
    ring.begin_capture()
    recorded = ring.layers[2]  # release(0) recorded the copy of layer 2 into slot 0
    with ring.slots.claim(recorded.slot, 2):
        recorded.event = CopyEvent.IN_GRAPH
        ring.capture.copies.add(2)
    assert not ring.holds(2) and ring.holds(2, capturing=True) and ring.holds(1)
    ring.abort_capture()
    assert ring.capture is None and ring.state is RingState.SETTLED
    assert ring.slots.owners == (None, 1)


def test_a_replay_that_never_finished_is_settled_before_the_slots_are_trusted():
    # A CUDA-graph replay leaves its ring's last layers in the slots and runs no Python; only `finish` (after it) or
    # the next `prepare` records that. If neither ran (an interrupt between a replay and the model's forward hook),
    # every use of the slot table first forgets the slots of a ring a capture recorded. Simulated on the CPU.
    reference = tiny_llama()
    model = hf_prefetch.dispatch_model(copy.deepcopy(reference), hf_prefetch.PrefetchConfig(), device="cpu")
    engine = hf_prefetch.get_state(model).engine
    ring = engine.rings[0]
    ring.begin_capture()
    ring.join_capture()  # a graph recorded the ring
    engine.load(0, 2)
    engine.load(0, 3)  # what a replay leaves: its last layers in the slots...
    for position in (0, 1):  # ...while the table still names the first layers
        with ring.slots.claim(ring.layers[position].slot, position):
            pass
    ring.begin_forward(None)  # `prepare` ran, the replay ran, `finish` never did
    assert hf_prefetch.sync_from_device(model) == []  # it would store layers 2 and 3 as layers 0 and 1
    assert ring.slots.owners == (None, None)
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    with torch.no_grad():
        assert torch.equal(model(prompt()).logits, reference(prompt()).logits)


def test_a_capture_that_never_joined_is_forgotten_at_drain_and_its_layers_miss():
    model = hf_prefetch.dispatch_model(tiny_llama(), hf_prefetch.PrefetchConfig(), device="cpu")
    engine = hf_prefetch.get_state(model).engine
    ring = engine.rings[0]
    ring.begin_capture()
    recorded = ring.layers[2]
    with ring.slots.claim(recorded.slot, 2):
        recorded.event = CopyEvent.IN_GRAPH
        ring.capture.copies.add(2)
    assert not engine.holds(0, 2) and engine.holds(0, 1)
    engine.drain()
    assert ring.slots.owners[recorded.slot] is None and ring.slots.owners[ring.layers[1].slot] == 1
    with torch.no_grad():
        model(prompt(1, 7))  # layer 0 of the ring misses and loads itself
    assert hf_prefetch.stats(model).misses == 1
