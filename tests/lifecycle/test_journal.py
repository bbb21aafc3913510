"""The journal of model changes (hf_prefetch/lifecycle/journal.py) on small modules: each step and its undo, the two
phases, resuming an interrupted unwind, weak references to modules, and Ctrl-C held back around each undo."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from torch import nn

from hf_prefetch.interrupts import deferred_interrupts
from hf_prefetch.lifecycle.journal import Journal, Phase


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor([2.0]))
        self.second.register_buffer("offset", torch.ones(2))
        self.second.register_buffer("empty", None)

    def forward(self, x):
        return self.second(self.first(x) * self.scale) + self.second.offset


class AddOne(ModelHook):
    def post_forward(self, module, output):
        return output + 1


class Double(ModelHook):
    def post_forward(self, module, output):
        return output * 2


X = torch.ones(1, 3)


def snapshot(module: nn.Module) -> dict:
    """Every tensor's identity, address and value, every flag and attribute a step may change."""
    return {
        "params": [(n, id(p), p.data_ptr(), p.device, p.dtype, p.requires_grad, p.clone()) for n, p in
                   module.named_parameters()],
        "buffers": [(n, id(b), b.device) for n, b in module.named_buffers()],
        "dicts": [sorted(m.__dict__) for m in module.modules()],
        "hooks": [getattr(m, "_hf_hook", None) for m in module.modules()],
        "attributes": [
            (m.training, m.__dict__.get("hf_device_map"), m.__dict__.get("_apply"), m.__dict__.get("forward"))
            for m in module.modules()
        ],
        "output": None if any(b.is_meta for b in module.buffers()) else module(X).detach().clone(),
    }  # fmt: skip


def assert_same(before: dict, after: dict, addresses: bool = True) -> None:
    for (n, *ids, v0), (_, *ids1, v1) in zip(before["params"], after["params"], strict=True):
        if not addresses:
            del ids[1], ids1[1]
        assert ids == ids1 and torch.equal(v0, v1), n
    assert before["buffers"] == after["buffers"]
    assert before["dicts"] == after["dicts"] and before["hooks"] == after["hooks"]
    assert before["attributes"] == after["attributes"]
    assert (before["output"] is None) == (after["output"] is None)
    assert before["output"] is None or torch.equal(before["output"], after["output"])


# --- each step, done and undone -------------------------------------------------------------------------------------


def step_point(journal: Journal, net: Net) -> None:
    journal.point(Phase.ATTACH, net.first.weight, torch.zeros(4, 3), "first.weight to a slot")
    assert torch.equal(net.first.weight, torch.zeros(4, 3))


def step_place(journal: Journal, net: Net) -> None:
    journal.place(net.first.weight, net.first.weight.data.clone(), "first.weight into host storage")


def step_swap(journal: Journal, net: Net) -> None:
    journal.swap(net.second.weight, nn.Parameter(torch.full((2, 4), 3.0)), "second.weight loaded")
    assert torch.equal(net.second.weight, torch.full((2, 4), 3.0))


def step_hook(journal: Journal, net: Net) -> None:
    journal.hook(net.first, AddOne(), "hook on first")
    assert isinstance(net.first._hf_hook, AddOne)


def step_handle(journal: Journal, net: Net) -> None:
    journal.handle(lambda: net.register_forward_hook(lambda module, args, output: output * 0), "zeroing hook")
    assert not net(X).any()


def step_new_attribute(journal: Journal, net: Net) -> None:
    journal.set_attribute(net, "hf_device_map", {"": "cpu"}, "device map")
    assert net.hf_device_map == {"": "cpu"}


def step_replaced_attribute(journal: Journal, net: Net) -> None:
    journal.set_attribute(net.second, "training", False, "eval")
    assert not net.second.training


def step_guard(journal: Journal, net: Net) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    journal.set_attribute(net, "_apply", refuse, "guard")
    with pytest.raises(RuntimeError, match="refused"):
        net.double()


def step_move_buffers(journal: Journal, net: Net) -> None:
    journal.move_tensors(net, torch.device("meta"), skip={id(p) for p in net.parameters()})
    assert net.scale.is_meta and net.second.offset.is_meta and net.second.empty is None
    assert not any(p.is_meta for p in net.parameters())


STEPS = {
    "point": (step_point, Phase.ATTACH),
    "place": (step_place, Phase.PLACE),
    "swap": (step_swap, Phase.PLACE),
    "hook": (step_hook, Phase.ATTACH),
    "handle": (step_handle, Phase.ATTACH),
    "new-attribute": (step_new_attribute, Phase.ATTACH),
    "replaced-attribute": (step_replaced_attribute, Phase.ATTACH),
    "guard": (step_guard, Phase.ATTACH),
    "move-buffers": (step_move_buffers, Phase.PLACE),
}


@pytest.mark.parametrize("name", STEPS)
def test_each_step_is_undone_exactly(name):
    step, phase = STEPS[name]
    net = Net()
    before = snapshot(net)
    journal = Journal()
    step(journal, net)
    assert len(journal) == (2 if name == "move-buffers" else 1)
    assert phase.value in repr(journal)
    journal.unwind(Phase.PLACE)
    assert len(journal) == 0
    # A place drops the old storage for good: its undo brings the value back to its device, at a new address.
    addresses = name != "place"
    assert_same(before, snapshot(net), addresses)
    journal.unwind(Phase.PLACE)  # nothing left to undo
    assert_same(before, snapshot(net), addresses)


@pytest.mark.parametrize("name", STEPS)
def test_unwinding_attach_steps_keeps_the_place_steps_changes(name):
    step, phase = STEPS[name]
    net = Net()
    before = snapshot(net)
    journal = Journal()
    step(journal, net)
    changed = snapshot(net)
    journal.unwind(Phase.ATTACH)
    assert len(journal) == 0  # PLACE steps are dropped, their changes kept
    assert_same(changed if phase is Phase.PLACE else before, snapshot(net))


def test_steps_are_undone_newest_first():
    net = Net()
    before = snapshot(net)
    journal = Journal()
    for step, _ in STEPS.values():
        step(journal, net)
    journal.unwind(Phase.PLACE)
    assert_same(before, snapshot(net), addresses=False)


def test_a_place_keeps_the_parameter_object_and_drops_the_old_storage():
    # On the CPU only: the undo's move back to another device (a GPU) is tests/test_gpu.py's.
    net = Net()
    param, old = net.first.weight, net.first.weight.data
    journal = Journal()
    journal.place(param, torch.ones(4, 3), "first.weight into host storage")
    assert net.first.weight is param and torch.equal(param, torch.ones(4, 3))
    assert param.data_ptr() != old.data_ptr()
    journal.unwind(Phase.PLACE)
    assert net.first.weight is param and torch.equal(param, torch.ones(4, 3)) and param.device.type == "cpu"


def test_move_tensors_records_only_what_moves():
    net = Net()
    journal = Journal()
    journal.move_tensors(net, torch.device("cpu"), skip=set())
    assert len(journal) == 0  # everything is there already
    skipped = {id(p) for p in net.parameters()}
    journal.move_tensors(net, torch.device("meta"), skip=skipped)
    assert len(journal) == 2 and all(b.is_meta for b in net.buffers())  # two buffers (None is no buffer)
    assert not any(p.is_meta for p in net.parameters())


def test_a_swap_is_seen_under_every_name_of_a_tied_tensor():
    net = Net()
    net.tied = nn.Linear(4, 2)
    net.tied.weight = net.second.weight
    journal = Journal()
    journal.swap(net.second.weight, nn.Parameter(torch.full((2, 4), 7.0)), "loaded")
    assert torch.equal(net.tied.weight, torch.full((2, 4), 7.0)) and net.tied.weight is net.second.weight
    journal.unwind(Phase.PLACE)
    assert torch.equal(net.tied.weight, Net().second.weight)


def test_undoing_a_hook_keeps_the_other_hooks_of_its_chain():
    net = Net()
    plain = net.first(X).detach()
    add_hook_to_module(net.first, AddOne())
    journal = Journal()
    ours = Double()
    journal.hook(net.first, ours, "ours")
    assert torch.equal(net.first(X), (plain + 1) * 2)
    journal.unwind(Phase.ATTACH)
    assert isinstance(net.first._hf_hook, AddOne) and torch.equal(net.first(X), plain + 1)

    # Ours first, another hook chained after it: undoing ours keeps the other one.
    net = Net()
    journal = Journal()
    journal.hook(net.first, ours, "ours")
    add_hook_to_module(net.first, AddOne(), append=True)
    journal.unwind(Phase.ATTACH)
    assert isinstance(net.first._hf_hook, AddOne) and torch.equal(net.first(X), plain + 1)


# --- interrupted unwinds ---------------------------------------------------------------------------------------------


def test_an_unwind_interrupted_by_an_error_resumes_where_it_stopped():
    net = Net()
    before = snapshot(net)
    journal = Journal()
    step_point(journal, net)
    step_new_attribute(journal, net)
    undos = []
    failures = [RuntimeError("undo failed")]

    def flaky_undo():
        undos.append("flaky")
        if failures:
            raise failures.pop()

    journal.record(Phase.ATTACH, "flaky", flaky_undo)
    step_hook(journal, net)
    step_replaced_attribute(journal, net)
    with pytest.raises(RuntimeError, match="undo failed"):
        journal.unwind(Phase.ATTACH)
    # The newer steps were undone and left the journal; the failed one and the older ones are still there.
    assert len(journal) == 3 and undos == ["flaky"]
    assert net.second.training and not hasattr(net.first, "_hf_hook")
    assert net.hf_device_map == {"": "cpu"} and not net.first.weight.any()
    journal.unwind(Phase.ATTACH)
    assert len(journal) == 0 and undos == ["flaky", "flaky"]
    assert_same(before, snapshot(net))


def test_an_unwind_interrupted_by_a_keyboard_interrupt_resumes_where_it_stopped():
    journal = Journal()
    undone = []
    interrupts = [KeyboardInterrupt()]

    def undo(name):
        def run():
            if name == "b" and interrupts:
                raise interrupts.pop()
            undone.append(name)

        return run

    for name in "abc":
        journal.record(Phase.ATTACH, name, undo(name))
    with pytest.raises(KeyboardInterrupt):
        journal.unwind(Phase.PLACE)
    assert undone == ["c"] and len(journal) == 2
    journal.unwind(Phase.PLACE)
    assert undone == ["c", "b", "a"] and len(journal) == 0


# --- weak references -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_accelerate_hook", [False, True])
def test_a_journal_does_not_keep_a_deleted_module_alive(with_accelerate_hook):
    net = Net()
    journal = Journal()
    step_new_attribute(journal, net)
    step_guard(journal, net)
    step_handle(journal, net)
    step_point(journal, net)
    step_move_buffers(journal, net)
    if with_accelerate_hook:
        step_hook(journal, net)  # accelerate's hook makes a cycle through the module: freed by the collector
    refs = [weakref.ref(module) for module in net.modules()]
    gc.disable()
    try:
        del net
        if with_accelerate_hook:
            gc.collect()
        assert [ref() for ref in refs] == [None] * 3  # freed by reference counting alone without a cycle
    finally:
        gc.enable()
    journal.unwind(Phase.PLACE)  # undoing changes to a module that is gone does nothing, and does not fail
    assert len(journal) == 0


# --- deferred_interrupts ------------------------------------------------------------------------------------------


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (the one deferred_interrupts defers), restored after the test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_and_wait() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(50):  # let the handler run (a KeyboardInterrupt would be raised here without the deferral)
        time.sleep(0.001)


def test_a_sigint_inside_the_block_is_raised_when_the_block_ends(default_sigint):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            _sigint_and_wait()
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_sigint_no_interrupt(default_sigint):
    with deferred_interrupts():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_during_an_undo_lets_the_undo_finish_and_keeps_the_step_to_resume(default_sigint):
    journal = Journal()
    halves = []

    def undo():
        halves.append("first half")
        _sigint_and_wait()
        halves.append("second half")

    journal.record(Phase.ATTACH, "interrupted", undo)
    with pytest.raises(KeyboardInterrupt):
        journal.unwind(Phase.ATTACH)
    assert halves == ["first half", "second half"]  # never half an undo
    assert len(journal) == 1  # the next unwind runs the (idempotent) undo again
    journal.record(Phase.ATTACH, "newer", lambda: halves.append("newer"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second Ctrl-C this time
    journal.unwind(Phase.ATTACH)
    assert len(journal) == 0 and halves[2] == "newer"


def test_outside_the_main_thread_the_block_runs_as_it_is(default_sigint):
    seen = []

    def worker():
        with deferred_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_a_custom_sigint_handler_gets_the_sigint_when_the_block_ends():
    # A program's own handler (one that cleans up and raises, or only counts) would otherwise let a Ctrl-C land in
    # the middle of the block: it is held back too, then handed to that handler once.
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                _sigint_and_wait()
                assert calls == []  # held back
        assert calls == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_interrupts():
            _sigint_and_wait()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# --- a forward set on top of the journal's hook ----------------------------------------------------------------------


def test_a_forward_set_on_top_of_a_hook_is_kept_by_its_undo_and_by_a_later_hook():
    from hf_prefetch.lifecycle.journal import PassThrough

    net, journal = Net(), Journal()
    plain = net.first(X).detach().clone()
    journal.hook(net.first, AddOne(), "hook on first")
    below = net.first.forward
    net.first.forward = lambda x: below(x) * 3  # set after the hook, calling its forward (as diffusers' hooks do)
    assert torch.equal(net.first(X), (plain + 1) * 3)
    journal.unwind(Phase.ATTACH)
    assert isinstance(net.first._hf_hook, PassThrough)  # the hook's forward stays, passing through
    assert torch.equal(net.first(X), plain * 3)
    journal.hook(net.first, Double(), "hook on first again")  # in the pass-through's place, under the forward on top
    assert torch.equal(net.first(X), plain * 2 * 3)
    journal.unwind(Phase.ATTACH)
    assert isinstance(net.first._hf_hook, PassThrough) and torch.equal(net.first(X), plain * 3)


def test_without_a_forward_on_top_the_undo_of_a_hook_leaves_nothing():
    net, journal = Net(), Journal()
    before = snapshot(net)
    journal.hook(net.first, AddOne(), "hook on first")
    journal.unwind(Phase.ATTACH)
    assert_same(before, snapshot(net))
    assert not hasattr(net.first, "_hf_hook") and not hasattr(net.first, "_old_forward")
