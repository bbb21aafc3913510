"""A second thread: the verbs that change a dispatch or its weights wait for a forward under way in another thread,
and the forwards that come meanwhile wait for them (`state.exclusive`, the forward gate's lock)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.lifecycle.state import exclusive
from tests.models import tiny_llama
from tests.moe_models import moe_model

CONFIG = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
OTHER = PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2)  # what a re-dispatch in a thread gives
EXPERTS = PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2, offload_params={"experts"})
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _models(kind: str):
    # The model, a second one with other weights, and the config that streams them.
    if kind == "llama":
        return tiny_llama(4, seed=0), tiny_llama(4, seed=1000), CONFIG
    return moe_model("qwen3_moe", 0), moe_model("qwen3_moe", 1000), EXPERTS


def _in_the_middle_of_a_forward(model, verb) -> tuple[torch.Tensor, list]:
    # A forward of `model` that, halfway (before its third layer), starts `verb` in another thread and gives it 0.5 s:
    # the verb must still be waiting when the forward goes on. Returns the forward's logits and the verb's outcome.
    outcome, threads = [], []

    def run():
        try:
            outcome.append(verb())
        except Exception as err:  # reported to the test
            outcome.append(err)

    def halfway(module, args):
        if not threads:
            threads.append(threading.Thread(target=run, daemon=True))
            threads[0].start()
            threads[0].join(timeout=0.5)
            assert threads[0].is_alive(), f"the verb did not wait for the forward: {outcome}"

    handle = model.model.layers[2].register_forward_pre_hook(halfway)
    try:
        logits = _logits(model)
    finally:
        handle.remove()
    threads[0].join(timeout=60)
    assert not threads[0].is_alive()
    return logits, outcome


def _recorder(outcome: dict):
    # `run(name, call)` for a thread: the call's result, or its exception, into `outcome[name]`.
    def run(name, call):
        try:
            outcome[name] = call()
        except Exception as err:  # reported to the test
            outcome[name] = err

    return run


def _started(run, name, call) -> threading.Thread:
    thread = threading.Thread(target=run, args=(name, call))
    thread.start()
    return thread


def _redispatching(model, outcome: dict):
    # A thread re-dispatching `model` with OTHER (its outcome in `outcome["dispatch"]`), and the recorder for more.
    run = _recorder(outcome)
    replace = lambda: hf_prefetch.dispatch_model(model, OTHER, device="cpu", replace=True)  # noqa: E731
    return run, _started(run, "dispatch", replace)


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_reload_weights_waits_for_a_forward_under_way_and_the_forward_keeps_the_old_weights(kind):
    model, other, config = _models(kind)
    old, new = _logits(copy.deepcopy(model)), _logits(other)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        reload = lambda: hf_prefetch.reload_weights(model, other.state_dict())  # noqa: E731
        got, outcome = _in_the_middle_of_a_forward(model, reload)
        assert outcome == [model]
        assert torch.equal(got, old)  # computed wholly with the old weights
        assert torch.equal(_logits(model), new)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_a_redispatch_and_a_removal_wait_for_a_forward_under_way(kind):
    model, _, config = _models(kind)
    want = _logits(copy.deepcopy(model))
    hf_prefetch.dispatch_model(model, config, device="cpu")
    other = PrefetchConfig(group_size=2, num_in_group=2, prefetch_step=1, offload_params=config.offload_params)
    redispatch = lambda: hf_prefetch.dispatch_model(model, other, device="cpu", replace=True)  # noqa: E731
    got, outcome = _in_the_middle_of_a_forward(model, redispatch)
    assert outcome == [model] and torch.equal(got, want)
    assert hf_prefetch.get_state(model).plan.config == other and torch.equal(_logits(model), want)
    got, outcome = _in_the_middle_of_a_forward(model, lambda: hf_prefetch.remove_offload(model))
    assert outcome == [model] and torch.equal(got, want)
    assert hf_prefetch.get_state(model) is None and torch.equal(_logits(model), want)


def test_sync_from_device_waits_for_a_forward_under_way():
    model = tiny_llama(4)
    want = _logits(copy.deepcopy(model))
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    try:
        got, outcome = _in_the_middle_of_a_forward(model, lambda: hf_prefetch.sync_from_device(model))
        assert torch.equal(got, want) and outcome == [["model.layers.1"]]  # the layer that holds the slot then
        assert torch.equal(_logits(model), want)
    finally:
        hf_prefetch.remove_offload(model)


def test_a_forward_that_waited_for_a_removal_says_so_and_computes_nothing():
    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    outcome = []

    def forward():
        try:
            outcome.append(_logits(model))
        except RuntimeError as err:
            outcome.append(err)

    with exclusive(model):  # a verb under way in this thread: the other thread's forward waits for it
        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()
        hf_prefetch.remove_offload(model)
    thread.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert "Another thread removed or replaced this model's hf_prefetch dispatch" in str(outcome[0])


def test_two_removals_at_once_remove_once_and_the_other_says_nothing_is_dispatched():
    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    outcome, barrier = [], threading.Barrier(2)

    def remove():
        barrier.wait()
        try:
            outcome.append(hf_prefetch.remove_offload(model))
        except ValueError as err:
            outcome.append(err)

    threads = [threading.Thread(target=remove, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(result is model for result in outcome) == 1
    errors = [result for result in outcome if isinstance(result, ValueError)]
    assert len(errors) == 1 and "is not dispatched by hf_prefetch: nothing to remove" in str(errors[0])
    assert hf_prefetch.get_state(model) is None


def test_forwards_and_removals_wait_for_a_redispatch_to_end(monkeypatch):
    # The new dispatch's state is on the model before its attach ends: nothing may use it before.
    from hf_prefetch import dispatch

    model = tiny_llama(4)
    want = _logits(copy.deepcopy(model))
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    attaching, go = threading.Event(), threading.Event()
    attach = dispatch.attach

    def slow_attach(*args):
        attaching.set()
        go.wait(30)
        return attach(*args)

    monkeypatch.setattr(dispatch, "attach", slow_attach)
    outcome = {}
    run, redispatch = _redispatching(model, outcome)
    assert attaching.wait(30)
    others = [
        threading.Thread(target=run, args=("forward", lambda: _logits(model))),
        threading.Thread(target=run, args=("remove", lambda: hf_prefetch.remove_offload(model))),
    ]
    for thread in others:
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # waiting for the re-dispatch
    go.set()
    for thread in [redispatch, *others]:
        thread.join(timeout=60)
    assert outcome["dispatch"] is model and outcome["remove"] is model and hf_prefetch.get_state(model) is None
    # The forward ran after the re-dispatch, before or after the removal (the lock takes no turns): with the new
    # dispatch, or it found it removed and computed nothing.
    forward = outcome["forward"]
    assert (isinstance(forward, torch.Tensor) and torch.equal(forward, want)) or (
        isinstance(forward, RuntimeError) and "Another thread removed or replaced" in str(forward)
    )


@pytest.mark.parametrize("half_done", [False, True], ids=["attached", "interrupted"])
def test_a_forward_between_the_old_gate_and_the_new_one_waits_and_computes_nothing(monkeypatch, half_done):
    # A re-dispatch removes the old forward gate (detach, or finishing an interrupted dispatch) before `begin` brings
    # the new one: a forward started by another thread in between meets neither, and must not run on weights in
    # transit.
    from hf_prefetch import dispatch
    from hf_prefetch.lifecycle.state import Lifecycle

    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    if half_done:
        hf_prefetch.get_state(model).lifecycle = Lifecycle.DETACHING  # as an interrupted removal leaves it
    between, go = threading.Event(), threading.Event()

    class PausedArena(dispatch.HostArena):  # built after the old gate left, before the new one comes
        def __init__(self, *args, **kwargs):
            between.set()
            go.wait(30)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(dispatch, "HostArena", PausedArena)
    outcome = {}
    run, redispatch = _redispatching(model, outcome)
    assert between.wait(30)
    assert hf_prefetch.get_state(model) is None  # the old dispatch is gone, the new one not begun
    forward = _started(run, "forward", lambda: _logits(model))
    forward.join(timeout=0.5)
    assert forward.is_alive()  # waiting for the re-dispatch
    go.set()
    for thread in (redispatch, forward):
        thread.join(timeout=60)
    assert outcome["dispatch"] is model and hf_prefetch.get_state(model).plan.config == OTHER
    assert isinstance(outcome["forward"], RuntimeError)
    assert "Another thread removed or replaced" in str(outcome["forward"])
    assert not model._forward_pre_hooks and "forward" in model.__dict__  # the hold's hook gone, the new gate there
    hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("then", ["redispatched", "removed"])
def test_the_old_gate_called_during_a_change_waits_for_it(monkeypatch, then):
    # A call that fetched the model's forward (the gate) just before another thread began to replace or remove the
    # dispatch reaches it after that thread took it away: it must wait for the change (never run on weights in
    # transit), then run under the model's new dispatch, or run the restored model if none is.
    from hf_prefetch.lifecycle import detach

    model = tiny_llama(4)
    want = _logits(model)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    old_gate = model.forward  # as `_call_impl` fetched it
    between, go = threading.Event(), threading.Event()
    end = detach._end

    def paused_end(model_, state):  # the old gate and state are gone at its end; the weights may still move after
        end(model_, state)
        between.set()
        go.wait(30)

    monkeypatch.setattr(detach, "_end", paused_end)
    outcome = {}
    run = _recorder(outcome)
    if then == "redispatched":
        change = _started(run, "change", lambda: hf_prefetch.dispatch_model(model, OTHER, device="cpu", replace=True))
    else:
        change = _started(run, "change", lambda: hf_prefetch.remove_offload(model))
    assert between.wait(30)
    forward = _started(run, "forward", lambda: old_gate(IDS).logits)
    forward.join(timeout=0.5)
    assert forward.is_alive()  # waiting for the change
    go.set()
    for thread in (change, forward):
        thread.join(timeout=60)
    assert outcome["change"] is model
    assert torch.equal(outcome["forward"], want)
    if then == "redispatched":
        monkeypatch.undo()
        hf_prefetch.remove_offload(model)


def test_a_forward_held_by_a_redispatch_that_stops_half_way_says_it_is_half_done(monkeypatch):
    # The hold comes before the old gate leaves (detach's last step): a forward that waited in it for a re-dispatch
    # that an interrupt stopped in the middle of detach is told the model is half-done, not that it was replaced.
    from hf_prefetch.lifecycle import detach

    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    detaching, go = threading.Event(), threading.Event()
    quiesce = detach._quiesce

    def interrupted_quiesce(state):
        if state.lifecycle.value == "detaching":
            detaching.set()
            go.wait(30)
            raise KeyboardInterrupt
        return quiesce(state)

    monkeypatch.setattr(detach, "_quiesce", interrupted_quiesce)
    outcome = {}

    def redispatch():
        try:
            hf_prefetch.dispatch_model(model, OTHER, device="cpu", replace=True)
        except KeyboardInterrupt as err:
            outcome["dispatch"] = err

    thread = threading.Thread(target=redispatch)
    thread.start()
    assert detaching.wait(30)
    run = _recorder(outcome)
    forward = _started(run, "forward", lambda: _logits(model))
    forward.join(timeout=0.5)
    assert forward.is_alive()
    go.set()
    for waiting in (thread, forward):
        waiting.join(timeout=60)
    assert isinstance(outcome["dispatch"], KeyboardInterrupt)
    assert isinstance(outcome["forward"], RuntimeError) and "is half-done (detaching" in str(outcome["forward"])
    monkeypatch.undo()
    hf_prefetch.remove_offload(model)
    assert not model._forward_pre_hooks  # neither the hold nor a gate is left


def test_a_forward_of_the_redispatching_thread_itself_is_refused_as_such(monkeypatch):
    from hf_prefetch import dispatch

    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    refused = []

    class ForwardingArena(dispatch.HostArena):  # runs in the gap, in the re-dispatching thread
        def __init__(self, *args, **kwargs):
            try:
                _logits(model)
            except RuntimeError as err:
                refused.append(str(err))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(dispatch, "HostArena", ForwardingArena)
    hf_prefetch.dispatch_model(model, OTHER, device="cpu", replace=True)
    assert len(refused) == 1 and "being replaced by this thread" in refused[0]
    assert torch.equal(_logits(model), _logits(tiny_llama(4)))
    hf_prefetch.remove_offload(model)


def test_an_interrupt_while_the_hold_is_registered_leaves_no_hook_behind():
    # A Ctrl-C (SIGINT) arriving just after torch registered the hold's hook, before its handle was kept.
    import signal

    model = tiny_llama(4)
    want = _logits(copy.deepcopy(model))
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    register, calls = model.register_forward_pre_hook, []

    def register_then_interrupt(*args, **kwargs):
        handle = register(*args, **kwargs)
        if not calls:
            calls.append(handle)
            signal.raise_signal(signal.SIGINT)
        return handle

    model.register_forward_pre_hook = register_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            hf_prefetch.dispatch_model(model, OTHER, device="cpu", replace=True)
    finally:
        del model.register_forward_pre_hook
    assert calls and hf_prefetch.get_state(model).plan.config == CONFIG  # interrupted before the old one was undone
    assert torch.equal(_logits(model), want)
    hf_prefetch.remove_offload(model)
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("on", ["model", "layer"])
def test_load_state_dict_waits_for_a_forward_under_way(on):
    # load_state_dict writes the host storage of streamed parameters (and drops their layers' slots): beside a forward
    # in another thread it would change weights under it. Called on the model or on a module inside it.
    model, other, config = _models("llama")
    old, new = _logits(copy.deepcopy(model)), _logits(other)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        if on == "model":
            load = lambda: model.load_state_dict(other.state_dict())  # noqa: E731
        else:
            layer = model.model.layers[1]  # streamed
            layer_weights = other.model.layers[1].state_dict()
            load = lambda: layer.load_state_dict(layer_weights)  # noqa: E731
        got, outcome = _in_the_middle_of_a_forward(model, load)
        assert torch.equal(got, old)  # computed wholly with the old weights
        assert len(outcome) == 1 and not isinstance(outcome[0], Exception)
        if on == "model":
            assert torch.equal(_logits(model), new)
        else:
            written = model.model.layers[1].state_dict()["mlp.up_proj.weight"]  # host storage
            assert torch.equal(written, layer_weights["mlp.up_proj.weight"])
        # A load that fails (a shape that does not fit) leaves the lock free for the next forward in another thread.
        with pytest.raises(RuntimeError, match="size mismatch"):
            model.load_state_dict({"lm_head.weight": torch.zeros(3, 3)}, strict=False)
        thread = threading.Thread(target=_logits, args=(model,), daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        hf_prefetch.remove_offload(model)
    assert "load_state_dict" not in model.__dict__ and "load_state_dict" not in model.model.layers[1].__dict__
