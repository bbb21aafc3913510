"""The hooks (hf_prefetch/runtime/hooks.py): what runs inside a dispatched model's forward, `state_dict` and
`load_state_dict`, observed from outside: the values a layer computes with, the order of the engine's steps, one
forward at a time, and refusals. tests/loading/test_reload.py covers load_state_dict's write-through in depth."""

from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch
from accelerate.hooks import add_hook_to_module, remove_hook_from_module
from torch import nn

import hf_prefetch
from hf_prefetch.lifecycle import journal as changes
from hf_prefetch.runtime.hooks import PrefetchHook

# Streams layers 1, 3, 5, 7 through two slots: slot 0 takes turns between 1 and 5, slot 1 between 3 and 7.
EVERY_SECOND = dict(group_size=2, num_in_group=1, prefetch_step=2)
NEXT_IN_SLOT = {1: 5, 3: 7, 5: 1, 7: 3}


@pytest.fixture
def dispatch(llama_reference):
    """`dispatch(**config)`: a copy of the reference Llama dispatched on the CPU; removed after the test."""
    models = []

    def make(**config):
        model = copy.deepcopy(llama_reference.model)
        models.append(model)
        return hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**config), device="cpu")

    yield make
    for model in models:
        if hf_prefetch.get_state(model) is not None:
            hf_prefetch.remove_offload(model)


def forward(model, ids):
    with torch.no_grad():
        return model(ids).logits


def layer_state(state: dict, index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def assert_layer_holds(layer: nn.Module, values: dict[str, torch.Tensor]) -> None:
    for name, param in layer.named_parameters():
        assert torch.equal(param, values[name]), name


# --- PrefetchHook on its own, with an engine that records its calls --------------------------------------------------


class RecordingEngine:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self, ring: int, position: int) -> None:
        self.log.append(("wait", ring, position))

    def release(self, ring: int, position: int) -> None:
        self.log.append(("release", ring, position))


class Block(nn.Module):
    def __init__(self, log: list, nested: bool = False) -> None:
        super().__init__()
        self.log, self.nested = log, nested
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        self.log.append(("forward",))
        out = self.linear(x)
        return (out, {"aux": out * 2}) if self.nested else out


def hooked_block(nested: bool = False, ring: int = 1, position: int = 3) -> tuple[Block, list]:
    log: list = []
    block = Block(log, nested)
    add_hook_to_module(block, PrefetchHook(RecordingEngine(log), 0, ring, position, "blocks.3"))
    return block, log


def test_prefetch_hook_waits_before_the_layer_and_releases_after_it():
    block, log = hooked_block(ring=1, position=3)
    with torch.no_grad():
        block(torch.ones(2, 4))
        block(x=torch.ones(2, 4))  # inputs as keywords
    assert log == [("wait", 1, 3), ("forward",), ("release", 1, 3)] * 2


def test_prefetch_hook_accepts_a_pre_forward_without_inputs():
    log: list = []
    hook = PrefetchHook(RecordingEngine(log), 0, 0, 2, "blocks.2")
    assert hook.pre_forward(nn.Identity()) == ((), {})  # as transformers calls it at times
    assert log == [("wait", 0, 2)]


def test_prefetch_hook_steps_are_labelled_in_the_profiler():
    block, log = hooked_block()
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        block(torch.ones(2, 4))
    names = [event.name for event in profile.events()]
    assert "hf_prefetch.wait" in names and "hf_prefetch.release" in names
    assert names.index("hf_prefetch.wait") < names.index("hf_prefetch.release")


@pytest.mark.parametrize("nested", [False, True])
def test_a_backward_through_a_streamed_layer_is_refused(nested):
    block, _ = hooked_block(nested=nested)
    output = block(torch.ones(2, 4))
    tensors = [output[0], output[1]["aux"]] if nested else [output]
    for tensor in tensors:
        with pytest.raises(RuntimeError, match=r"Backward through blocks\.3, a layer streamed by hf_prefetch"):
            tensor.sum().backward(retain_graph=True)


def test_no_backward_refusal_without_gradients():
    block, _ = hooked_block()
    block.linear.requires_grad_(False)
    x = torch.ones(2, 4, requires_grad=True)
    with torch.no_grad():
        assert not block(x).requires_grad
    remove_hook_from_module(block)
    block(x).sum().backward()  # nothing left behind by the hook
    assert x.grad is not None


# --- PrefetchHook in a dispatched model ---------------------------------------------------------------------------


def test_a_streamed_layer_computes_with_its_own_weights_and_hands_its_slot_on_after(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    layers = model.model.layers
    seen = []

    def inside(index):  # runs inside the layer's forward, after the hook's wait
        def hook(module, args):
            assert_layer_holds(layers[index], layer_state(llama_reference.state, index))
            seen.append(("inside", index))

        return hook

    def after(index):  # runs on the layer after it, once the layer and its own hooks ran and its release refilled
        def hook(module, args):
            following = layer_state(llama_reference.state, NEXT_IN_SLOT[index])
            assert_layer_holds(layers[index], following)  # the slot holds the next layer that uses it
            seen.append(("after", index))

        return hook

    handles = []
    for index in NEXT_IN_SLOT:
        handles.append(layers[index].self_attn.register_forward_pre_hook(inside(index)))
        after_it = layers[index + 1] if index + 1 < len(layers) else model.model.norm
        handles.append(after_it.register_forward_pre_hook(after(index)))
    try:
        for _ in range(2):
            assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [(where, i) for i in (1, 3, 5, 7) for where in ("inside", "after")] * 2
    assert hf_prefetch.stats(model).misses == 0


def _recorder(seen: list, layers: list):
    # A torch hook that keeps what a layer of `layers` computes with when it runs: its down_proj weight.
    def record(module, args, *output):
        if any(module is layer for layer in layers):
            seen.append((layers.index(module), bool(output), module.mlp.down_proj.weight.detach().clone()))

    return record


@pytest.mark.parametrize("where", ["layer", "global"])
def test_torch_hooks_around_a_streamed_layer_see_its_own_weights(dispatch, llama_reference, where):
    # One slot for every layer: released before its forward hooks ran, a layer's slot would hold the next one.
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    model = dispatch(group_size=1, prefetch_step=1)
    reference = copy.deepcopy(llama_reference.model)
    seen: dict[str, list] = {"got": [], "want": []}
    handles = []
    for key, target in (("got", model), ("want", reference)):
        layers = list(target.model.layers)
        record = _recorder(seen[key], layers)
        if where == "layer":
            for layer in layers:
                handles += [layer.register_forward_pre_hook(record), layer.register_forward_hook(record)]
        else:
            handles += [register_module_forward_pre_hook(record), register_module_forward_hook(record)]
    try:
        for _ in range(2):
            assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
            forward(reference, llama_reference.ids)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen["got"]) == len(seen["want"]) == 2 * 2 * 8
    for (index, post, got), (_, _, want) in zip(seen["got"], seen["want"], strict=True):
        assert torch.equal(got, want), (index, "forward hook" if post else "pre-hook")
    assert hf_prefetch.stats(model).misses == 0


@pytest.mark.gpu
def test_on_cuda_a_forward_hook_reads_its_layer_before_the_next_copy_lands():
    # Layers of ~90 MB, all through one slot: a release before the hook would start the next layer's copy into the
    # slot while the hook's kernels read it.
    from tests.models import gpu_llama

    reference = gpu_llama(4).cuda()
    config = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1)
    model = hf_prefetch.dispatch_model(copy.deepcopy(reference), config, device="cuda")
    sums: dict[str, list] = {"got": [], "want": []}

    def record(into):
        def hook(module, args, output):
            into.append(module.mlp.down_proj.weight.float().square().sum())  # queued, no host synchronisation

        return hook

    handles = [layer.register_forward_hook(record(sums["got"])) for layer in model.model.layers]
    handles += [layer.register_forward_hook(record(sums["want"])) for layer in reference.model.layers]
    ids = torch.arange(16, device="cuda").view(1, 16)
    try:
        for _ in range(3):
            forward(model, ids)
            forward(reference, ids)
    finally:
        for handle in handles:
            handle.remove()
        hf_prefetch.remove_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(sums["got"], sums["want"], strict=True))


# --- ForwardGate ----------------------------------------------------------------------------------------------------


def test_a_forward_inside_a_forward_of_the_same_thread_does_not_deadlock(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    ids = llama_reference.ids
    inner = []

    def nested_forward(module, args, output):
        if not inner:
            inner.append(None)
            inner[0] = model(ids).logits  # the model's own gate, re-entered from inside a streamed layer

    handle = model.model.layers[3].register_forward_hook(nested_forward)
    result = {}

    def outer():
        with torch.no_grad():
            result["logits"] = model(ids).logits

    try:
        thread = threading.Thread(target=outer, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the nested forward deadlocked"
    finally:
        handle.remove()
    # The nested forward moved every slot under the outer one: the outer forward's later layers still compute with
    # their own weights.
    assert torch.equal(inner[0], llama_reference.logits)
    assert torch.equal(result["logits"], llama_reference.logits)
    assert torch.equal(forward(model, ids), llama_reference.logits)


def test_a_second_threads_forward_waits_for_the_first(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    ids = llama_reference.ids
    second_result = {}

    def second():
        with torch.no_grad():
            second_result["logits"] = model(ids).logits

    state = {}

    def start_second_inside_the_first(module, args, output):
        if "thread" not in state:
            state["thread"] = threading.Thread(target=second, daemon=True)
            state["thread"].start()
            state["thread"].join(timeout=0.5)
            state["blocked"] = state["thread"].is_alive()  # it is waiting at the gate

    handle = model.model.layers[3].register_forward_hook(start_second_inside_the_first)
    try:
        assert torch.equal(forward(model, ids), llama_reference.logits)
    finally:
        handle.remove()
    state["thread"].join(timeout=30)
    assert state["blocked"] and not state["thread"].is_alive()
    assert torch.equal(second_result["logits"], llama_reference.logits)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_forward_left_by_an_exception_or_a_ctrl_c_opens_the_gate_for_other_threads(dispatch, llama_reference, error):
    # torch runs the model's `always_call` forward hook for an Exception only: a KeyboardInterrupt must not leave the
    # gate closed, or every other thread's forward would wait for good.
    model = dispatch(**EVERY_SECOND)
    ids = llama_reference.ids

    def interrupt(module, args):
        raise error("stopped")

    handle = model.model.layers[3].mlp.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(error, match="stopped"):
            forward(model, ids)
    finally:
        handle.remove()
    result = {}

    def other():
        result["logits"] = forward(model, ids)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the gate stayed closed after the interrupted forward"
    assert torch.equal(result["logits"], llama_reference.logits)
    assert torch.equal(forward(model, ids), llama_reference.logits)


@pytest.mark.parametrize("where", ["pre-hook registered after the dispatch", "forward hook registered before it"])
def test_a_ctrl_c_in_a_hook_of_the_model_itself_leaves_the_gate_open(llama_reference, where):
    # Hooks of the model run outside its gate (the gate is its forward): torch skips the `always_call` forward hooks
    # for a KeyboardInterrupt, and for any error in a pre-hook after the gate's, so a gate made of hooks would stay
    # held.
    def interrupt(*args):
        raise KeyboardInterrupt

    model = copy.deepcopy(llama_reference.model)
    if where.startswith("forward hook"):
        handle = model.register_forward_hook(interrupt)
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    else:
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
        handle = model.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            forward(model, llama_reference.ids)
        handle.remove()
        assert torch.equal(_in_another_thread(model, llama_reference.ids), llama_reference.logits)
    finally:
        handle.remove()
        hf_prefetch.remove_offload(model)


def test_a_ctrl_c_just_after_the_gate_takes_its_lock_leaves_it_open(dispatch, llama_reference):
    # A Ctrl-C that arrives while a forward waits for the lock is raised as soon as the wait returns: between taking
    # the lock and counting it, it left the lock held for good. Simulated: the signal arrives as the lock is taken.
    import _thread

    model = dispatch(**EVERY_SECOND)
    gate = hf_prefetch.get_state(model).gate
    lock = gate._lock

    class InterruptedAsTaken:
        def acquire(self, *args, **kwargs):
            taken = lock.acquire(*args, **kwargs)
            if taken:
                gate._lock = lock  # once
                _thread.interrupt_main()  # as SIGINT: Python's handler runs at the next bytecode
            return taken

        def release(self):
            lock.release()

    gate._lock = InterruptedAsTaken()
    with pytest.raises(KeyboardInterrupt):
        forward(model, llama_reference.ids)
    assert not lock._is_owned()
    assert torch.equal(_in_another_thread(model, llama_reference.ids), llama_reference.logits)


def _in_another_thread(model, ids) -> torch.Tensor:
    # A forward's logits from a new thread, which must not wait for good at the gate.
    result = {}
    thread = threading.Thread(target=lambda: result.update(logits=forward(model, ids)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the gate stayed closed"
    return result["logits"]


def _beside_a_paused_forward(model, ids, second_call) -> tuple[bool, dict]:
    # Thread "first" runs a forward of `model` and pauses inside it (before layer 5's MLP); meanwhile `second_call()`
    # runs in another thread. Returns whether that call was still waiting after 0.5 s, and both results.
    inside, go, results = threading.Event(), threading.Event(), {}

    def pause(module, args):
        if threading.current_thread().name == "first":
            inside.set()
            go.wait(30)

    def second():
        with torch.no_grad():
            results["second"] = second_call()

    handle = model.model.layers[5].mlp.register_forward_pre_hook(pause)
    try:
        first = threading.Thread(target=lambda: results.update(first=forward(model, ids)), name="first")
        first.start()
        assert inside.wait(30)
        other = threading.Thread(target=second)
        other.start()
        other.join(timeout=0.5)
        waited = other.is_alive()
        go.set()
        first.join(timeout=30)
        other.join(timeout=30)
    finally:
        handle.remove()
    return waited, results


def test_the_gate_holds_when_accelerate_puts_back_the_forward_it_saved(llama_reference):
    # accelerate's remove_hook_from_module restores the forward it saved when its hook was added (before the dispatch),
    # dropping the forward wrapper: calls of the model stay gated (`_call_impl`); a direct forward is then ungated, as
    # for any hook.
    from accelerate.hooks import ModelHook

    model = copy.deepcopy(llama_reference.model)
    add_hook_to_module(model, ModelHook())
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    engine = hf_prefetch.get_state(model).engine
    prepared = []
    prepare = engine.prepare
    engine.prepare = lambda tokens=None: (prepared.append(tokens), prepare(tokens))[1]
    try:
        remove_hook_from_module(model)
        ids = llama_reference.ids
        waited, results = _beside_a_paused_forward(model, ids, lambda: model(ids).logits)
        assert waited, "the second thread's forward ran beside the first"
        assert torch.equal(results["first"], llama_reference.logits)
        assert torch.equal(results["second"], llama_reference.logits)
        assert len(prepared) == 2  # once per forward
    finally:
        hf_prefetch.remove_offload(model)


def test_a_direct_forward_call_is_gated(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    ids = llama_reference.ids
    waited, results = _beside_a_paused_forward(model, ids, lambda: model.forward(ids).logits)
    assert waited, "a direct forward ran beside another thread's forward"
    assert torch.equal(results["first"], llama_reference.logits)
    assert torch.equal(results["second"], llama_reference.logits)


def _layer_inputs(reference, index: int):
    # A streamed layer's inputs, as the decoder gives them, and what the unmodified layer makes of them.
    hidden = torch.randn(1, 7, reference.config.hidden_size, generator=torch.Generator().manual_seed(index))
    embeddings = reference.model.rotary_emb(hidden, torch.arange(7)[None])
    with torch.no_grad():
        expected = reference.model.layers[index](hidden, position_embeddings=embeddings)
    return hidden, embeddings, expected


@pytest.mark.parametrize("part", ["decoder", "decoder's forward", "streamed layer"])
def test_a_part_of_the_model_called_on_its_own_is_gated(dispatch, llama_reference, part):
    # `model.model(ids)` (embeddings, a pipeline's own loop) runs streamed layers outside any call of the model: it
    # waits for another thread's forward like a call of the model, and computes the unmodified model's values.
    model, reference = dispatch(**EVERY_SECOND), llama_reference.model
    ids = llama_reference.ids
    if part == "streamed layer":
        hidden, embeddings, expected = _layer_inputs(reference, 3)
        call = lambda: model.model.layers[3](hidden, position_embeddings=embeddings)  # noqa: E731
    else:
        with torch.no_grad():
            expected = reference.model(ids).last_hidden_state
        decoder = model.model if part == "decoder" else model.model.forward
        call = lambda: decoder(ids).last_hidden_state  # noqa: E731
    waited, results = _beside_a_paused_forward(model, ids, call)
    assert waited, f"a call of the {part} ran beside another thread's forward"
    assert torch.equal(results["first"], llama_reference.logits)
    assert torch.equal(results["second"], expected)
    with torch.no_grad():
        assert torch.equal(call(), expected)  # on its own in this thread: prepared and finished like a forward
    assert torch.equal(forward(model, ids), llama_reference.logits)


def test_the_parts_gates_pass_through_inside_a_forward_and_leave_with_the_dispatch(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    prepared = []
    engine = hf_prefetch.get_state(model).engine
    real_prepare = engine.prepare
    engine.prepare = lambda *args: prepared.append(args) or real_prepare(*args)
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
    assert len(prepared) == 1  # the decoder and its streamed layers passed through the model's gate
    gated = [model.model, *(model.model.layers[i] for i in (1, 3, 5, 7))]
    assert all("_call_impl" in part.__dict__ for part in gated)
    assert "_call_impl" not in model.model.layers[0].__dict__  # resident: no gate
    hf_prefetch.remove_offload(model)
    assert not any(name in part.__dict__ for part in gated for name in ("_call_impl", "forward"))
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)


def test_the_model_called_inside_a_call_of_its_decoder_is_prepared_as_a_forward_of_its_own(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    engine, prepared, inner = hf_prefetch.get_state(model).engine, [], []
    real_prepare = engine.prepare
    engine.prepare = lambda tokens=None: prepared.append(tokens) or real_prepare(tokens)
    ids = llama_reference.ids

    def call_the_model(module, args, output):
        if not inner:
            inner.append(None)  # once: the call below runs this layer too
            inner[0] = forward(model, ids)

    handle = model.model.layers[1].register_forward_hook(call_the_model)
    try:
        with torch.no_grad():
            hidden = model.model(ids[:, :3]).last_hidden_state
    finally:
        handle.remove()
    assert prepared == [ids[:, :3].numel(), ids.numel()]  # the decoder's call, then the model's inside it
    assert torch.equal(inner[0], llama_reference.logits)
    with torch.no_grad():
        assert torch.equal(hidden, llama_reference.model.model(ids[:, :3]).last_hidden_state)


def test_parts_kept_after_their_model_was_deleted_run_ungated(llama_reference):
    model = copy.deepcopy(llama_reference.model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    decoder, decoder_forward, layer = model.model, model.model.forward, model.model.layers[3]
    state = weakref.ref(hf_prefetch.get_state(model))
    del model
    assert state() is None
    assert not any(name in part.__dict__ for part in (decoder, layer) for name in ("_call_impl", "forward"))
    ids = llama_reference.ids
    with torch.no_grad():
        expected = llama_reference.model.model(ids).last_hidden_state
        assert torch.equal(decoder(ids).last_hidden_state, expected)
        assert torch.equal(decoder_forward(ids).last_hidden_state, expected)  # the gate's wrapper, kept: ungated


def _called_while_the_arena_is_made(monkeypatch, call) -> dict:
    # Runs `call` in a thread once the next dispatch makes its host arena (after the old gate left, before the new
    # one's `begin`): "waited" says whether it still waited at its hook 0.5 s later, "error" what it raised.
    from hf_prefetch import dispatch as dispatch_module

    in_window, outcome = threading.Event(), {}

    class Paused(dispatch_module.HostArena):
        def __init__(self, *args, **kwargs):
            in_window.set()
            caller.join(timeout=0.5)
            outcome["waited"] = caller.is_alive()
            super().__init__(*args, **kwargs)

    def run():
        in_window.wait(30)
        try:
            with torch.no_grad():
                call()
            outcome["error"] = None
        except RuntimeError as err:
            outcome["error"] = str(err)

    monkeypatch.setattr(dispatch_module, "HostArena", Paused)
    caller = outcome["thread"] = threading.Thread(target=run)
    caller.start()
    return outcome


def test_a_part_called_while_another_thread_replaces_the_dispatch_waits_and_refuses(llama_reference, monkeypatch):
    # Between the old gate's removal and the new one's arrival, a call of the decoder meets the same refusal as a
    # call of the model; it ran ungated while the new dispatch re-pointed its parameters (wrong values).

    model = copy.deepcopy(llama_reference.model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    outcome = _called_while_the_arena_is_made(monkeypatch, lambda: model.model(llama_reference.ids))
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=2), device="cpu", replace=True)
    outcome["thread"].join(timeout=30)
    assert outcome["waited"] and "removed or replaced" in outcome["error"]
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
    hf_prefetch.remove_offload(model)


def test_a_layer_only_the_next_plan_streams_waits_and_refuses_while_a_dispatch_finishes_a_half_done_one(
    dispatch, llama_reference, monkeypatch
):
    # A dispatch that first finishes an interrupted removal: between that and the new gate's arrival, layer 0 (which
    # only the new plan streams, so the old plan's parts do not cover it) has no gate; called on its own it meets the
    # same refusal as a call of the model, instead of running while its parameters are re-pointed.

    model = dispatch(**EVERY_SECOND)
    _interrupt_the_removal(model, monkeypatch)
    hidden, embeddings, expected = _layer_inputs(llama_reference.model, 0)
    call = lambda: model.model.layers[0](hidden, position_embeddings=embeddings)  # noqa: E731
    outcome = _called_while_the_arena_is_made(monkeypatch, call)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=1), device="cpu")
    outcome["thread"].join(timeout=30)
    assert outcome["waited"] and "removed or replaced" in outcome["error"]
    assert any(
        layer.path == "model.layers.0" for ring in hf_prefetch.get_state(model).plan.rings for layer in ring.streamed
    )
    with torch.no_grad():
        assert torch.equal(model.model.layers[0](hidden, position_embeddings=embeddings), expected)
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)


def test_a_kept_forward_of_a_deleted_model_says_so(llama_reference):
    model = copy.deepcopy(llama_reference.model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    kept = model.forward
    del model
    with pytest.raises(RuntimeError, match="belonged to a model that no longer exists"):
        kept(llama_reference.ids)


def test_a_forward_kept_after_the_removal_runs_ungated_and_keeps_nothing_alive(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    kept = model.forward  # the gate, as a forward set on top of it would keep it
    state = weakref.ref(hf_prefetch.get_state(model))
    gate = weakref.ref(hf_prefetch.get_state(model).gate)
    hf_prefetch.remove_offload(model)
    assert state() is None and gate() is None  # no cycle: freed by reference counting
    with torch.no_grad():
        assert torch.equal(kept(llama_reference.ids).logits, llama_reference.logits)


def test_prepare_runs_before_every_forward_and_finish_after_the_outermost(dispatch, llama_reference, monkeypatch):
    model = dispatch(**EVERY_SECOND)
    engine = hf_prefetch.get_state(model).engine
    log = []
    for name in ("prepare", "finish"):
        step = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, step=step, name=name: (log.append(name), step(*a))[1])
    forward(model, llama_reference.ids)
    assert log == ["prepare", "finish"]

    def nested_forward(module, args, output):
        if len(log) < 4:
            log.append("nested")
            model(llama_reference.ids)

    handle = model.model.layers[3].register_forward_hook(nested_forward)
    try:
        forward(model, llama_reference.ids)
    finally:
        handle.remove()
    assert log[2:] == ["prepare", "nested", "prepare", "finish"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_prepare_leaves_the_gate_open(dispatch, llama_reference, monkeypatch, error):
    model = dispatch(**EVERY_SECOND)
    engine = hf_prefetch.get_state(model).engine

    def fail(tokens=None):
        raise error("prepare failed")

    monkeypatch.setattr(engine, "prepare", fail)
    with pytest.raises(error, match="prepare failed"):
        forward(model, llama_reference.ids)
    monkeypatch.undo()
    result = {}
    thread = threading.Thread(target=lambda: result.update(logits=forward(model, llama_reference.ids)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the failed forward left the gate closed"
    assert torch.equal(result["logits"], llama_reference.logits)


def _interrupt_the_removal(model, monkeypatch) -> None:
    # A Ctrl-C while remove_offload detaches the second streamed layer's hook: the dispatch is left half-done.
    detach_hook, calls = changes.remove_hook_from_module, []

    def interrupted(module, *args, **kwargs):
        calls.append(module)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return detach_hook(module, *args, **kwargs)

    monkeypatch.setattr(changes, "remove_hook_from_module", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.remove_offload(model)
    monkeypatch.undo()


def test_a_half_done_removal_refuses_to_compute_until_it_is_finished(dispatch, llama_reference, monkeypatch):
    model = dispatch(**EVERY_SECOND)
    ids = llama_reference.ids
    _interrupt_the_removal(model, monkeypatch)
    refused = (
        r"dispatch is half-done \(detaching: an interrupt or an error stopped it\)\. Call hf_prefetch\.remove_offload"
    )
    with pytest.raises(RuntimeError, match=refused):
        forward(model, ids)
    errors = []

    def other():  # refused too, at once: the refusal holds no lock
        try:
            forward(model, ids)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(errors) == 1
    hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert torch.equal(forward(model, ids), llama_reference.logits)


# --- state_dict and load_state_dict ----------------------------------------------------------------------------------


def test_state_dict_reports_host_values_even_inside_a_forward(dispatch, llama_reference):
    model = dispatch(group_size=2, num_in_group=1, prefetch_step=1)  # every streamed layer shares one slot
    seen = []

    def check(module, args, output):
        current = model.state_dict(prefix="p.")
        assert list(current) == [f"p.{key}" for key in llama_reference.state]
        for key, value in llama_reference.state.items():
            assert torch.equal(current[f"p.{key}"], value), key
        seen.append(True)

    handle = model.model.layers[3].register_forward_hook(check)  # slot 0 holds layer 5 now
    try:
        forward(model, llama_reference.ids)
    finally:
        handle.remove()
    assert seen == [True]


@pytest.mark.parametrize("path", ["model.layers.3", "model"])
def test_state_dict_of_a_submodule_reports_host_values(dispatch, llama_reference, path):
    model = dispatch(group_size=2, num_in_group=1, prefetch_step=1)
    forward(model, llama_reference.ids)  # slot 0 holds layer 1 again
    expected = llama_reference.model.get_submodule(path).state_dict()
    current = model.get_submodule(path).state_dict()
    assert current.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(current[key], value), key


def test_an_interrupted_load_state_dict_is_completed_by_the_next_forward(dispatch, llama_reference):
    model = dispatch(group_size=2, num_in_group=1, prefetch_step=1)
    forward(model, llama_reference.ids)
    layers = model.model.layers
    slot = layers[1].mlp.up_proj.weight.data_ptr()
    assert layers[3].mlp.up_proj.weight.data_ptr() == slot
    expected = copy.deepcopy(llama_reference.model)
    torch.manual_seed(1)
    new = {key: torch.randn_like(value) for key, value in llama_reference.state.items()}

    def interrupt(module, state_dict, prefix, *args):
        raise KeyboardInterrupt  # Ctrl-C inside load_state_dict, after the write-through's own pre-hook

    for m in (model, expected):
        handle = m.model.layers[3].mlp.up_proj.register_load_state_dict_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            m.load_state_dict(new)
        handle.remove()
    # Torch wrote every tensor before layer 3's up_proj; layer 3's up_proj points at its host storage until the
    # next forward completes the load.
    assert layers[3].mlp.up_proj.weight.data_ptr() != slot
    assert torch.equal(forward(model, llama_reference.ids), forward(expected, llama_reference.ids))
    assert layers[3].mlp.up_proj.weight.data_ptr() == slot == layers[1].mlp.up_proj.weight.data_ptr()
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(forward(model, llama_reference.ids), forward(expected, llama_reference.ids))


def test_load_state_dict_writes_through_to_the_next_forward_and_the_state_dict(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    forward(model, llama_reference.ids)
    expected = copy.deepcopy(llama_reference.model)
    torch.manual_seed(2)
    new = {key: torch.randn_like(value) for key, value in layer_state(llama_reference.state, 5).items()}
    for m in (model, expected):
        m.model.layers[5].load_state_dict(new)  # layer 5 does not hold its slot now (layer 1 does)
    assert torch.equal(forward(model, llama_reference.ids), forward(expected, llama_reference.ids))
    for key, value in new.items():
        assert torch.equal(model.state_dict()[f"model.layers.5.{key}"], value), key
    assert hf_prefetch.stats(model).misses == 0


def test_load_state_dict_with_assign_of_resident_tensors_only_is_allowed(dispatch, llama_reference):
    model = dispatch(**EVERY_SECOND)
    expected = copy.deepcopy(llama_reference.model)
    new = {"model.norm.weight": torch.full((64,), 0.5), "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64)}
    for m in (model, expected):
        m.load_state_dict(new, strict=False, assign=True)
    assert model.model.norm.weight.data_ptr() == new["model.norm.weight"].data_ptr()  # assigned, not copied
    assert torch.equal(forward(model, llama_reference.ids), forward(expected, llama_reference.ids))
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace the streamed parameter model\.layers\.1\."):
        model.load_state_dict({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}, strict=False, assign=True)
    assert torch.equal(forward(model, llama_reference.ids), forward(expected, llama_reference.ids))


# Modules that own or contain a streamed parameter refuse conversions; the others (a resident layer) do not.
MOVES = [
    ("", True),
    ("model", True),
    ("model.layers", True),
    ("model.layers.1", True),
    ("model.layers.1.mlp", True),
    ("model.layers.1.mlp.up_proj", True),
    ("model.layers.0", False),
    ("model.norm", False),
    ("lm_head", False),
]


CONVERSIONS = [
    lambda m: m.half(),
    lambda m: m.double(),
    lambda m: m.to(torch.float64),
    lambda m: m.to("meta"),
]
# On a CPU dispatch of a float32 model these change no tensor: they return the module, as nn.Module's do.
UNCHANGING = [lambda m: m.cpu(), lambda m: m.float(), lambda m: m.to("cpu", torch.float32)]


@pytest.mark.parametrize("path, refused", MOVES, ids=[p or "model" for p, _ in MOVES])
def test_conversions_are_refused_where_a_streamed_parameter_lives(dispatch, llama_reference, path, refused):
    model = dispatch(**EVERY_SECOND)
    if refused:
        for convert in CONVERSIONS:
            with pytest.raises(
                RuntimeError, match=r"dispatched by hf_prefetch: \.to\(\), .*remove_offload\(model\) first"
            ):
                convert(model.get_submodule(path))
        for convert in UNCHANGING:
            module = model.get_submodule(path)
            assert convert(module) is module
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
    else:  # converted as in an ordinary model
        module = model.get_submodule(path)
        module.double()
        assert {p.dtype for p in module.parameters()} == {torch.float64}
        module.float()
        assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)


@pytest.mark.parametrize("then", ["replace", "remove and dispatch"])
def test_a_model_compiled_after_the_dispatch_survives_a_redispatch(llama_reference, then):
    # nn.Module.compile() captures the gate's `_call_impl`; after the dispatch changes, that kept wrapper runs under
    # the model's new gate (it refused every call before).
    model = copy.deepcopy(llama_reference.model)
    config = hf_prefetch.PrefetchConfig(**EVERY_SECOND)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    model.compile(backend="eager")
    try:
        assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
        other = hf_prefetch.PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2)
        if then == "replace":
            hf_prefetch.dispatch_model(model, other, device="cpu", replace=True)
        else:
            hf_prefetch.remove_offload(model)
            assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
            hf_prefetch.dispatch_model(model, other, device="cpu")
        engine, calls = hf_prefetch.get_state(model).engine, []
        prepare = engine.prepare
        engine.prepare = lambda tokens=None: (calls.append(tokens), prepare(tokens))[1]
        assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
        assert len(calls) == 1  # gated once
    finally:
        if hf_prefetch.get_state(model) is not None:
            hf_prefetch.remove_offload(model)
        torch._dynamo.reset()


def test_a_model_compiled_before_the_dispatch_stays_gated_without_its_forward_wrapper(llama_reference):
    # model.compile() before the dispatch: torch calls its compiled `_call_impl`, not the instance's; and accelerate
    # then puts back the forward it saved. The compiled call is gated too.
    from accelerate.hooks import ModelHook

    model = copy.deepcopy(llama_reference.model)
    model.compile(backend="eager")
    add_hook_to_module(model, ModelHook())
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**EVERY_SECOND), device="cpu")
    try:
        remove_hook_from_module(model)
        lock, held = hf_prefetch.get_state(model).gate._lock, []
        handle = model.model.layers[0].register_forward_hook(lambda *args: held.append(lock._is_owned()))
        assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
        handle.remove()
        assert held == [True]
    finally:
        hf_prefetch.remove_offload(model)
        torch._dynamo.reset()
