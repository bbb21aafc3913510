"""A dispatched model's lifetime under misuse and bad timing: copies and pickling, forwards from several threads,
freeing by reference counting, interrupts anywhere in the verbs that change a model, backward, the plan's numbers.

Everything runs on the CPU (synchronous copies)."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import sys
import threading
import warnings
import weakref
from contextlib import contextmanager

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig, UVAConfig
from hf_prefetch.host.arena import pinned_bytes
from hf_prefetch.lifecycle.state import Lifecycle
from tests.models import llama_and_logits, prompt, tiny_llama

# 6 layers: layers 1, 3, 5 stream through 2 slots (5 takes 1's slot each forward, 3 holds its own).
SHARED = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)


@pytest.fixture(scope="module")
def six():
    """An undispatched 6-layer Llama (copy it before changing it), its prompt and its logits."""
    return llama_and_logits(6)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _dispatched(model, config=SHARED):
    return hf_prefetch.dispatch_model(model, config, device="cpu")


def _leftovers(model) -> list[str]:
    """What a dispatch left on a model: hooks, the state, guards, hooks of the model itself."""
    found = []
    for name, module in model.named_modules():
        attributes = {"_hf_hook", "_old_forward", "_hf_prefetch_state", "forward", "_apply", "hf_device_map"}
        attributes |= {"__deepcopy__", "__reduce_ex__"}
        found += [f"{name or 'model'}.{a}" for a in sorted(attributes & module.__dict__.keys())]
    if model._forward_pre_hooks or model._forward_hooks or model._state_dict_hooks:
        found.append("hooks on the model")
    return found


# --- copy.deepcopy, pickle, torch.save ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "copy_it",
    [copy.deepcopy, copy.copy, pickle.dumps, lambda model: torch.save(model, io.BytesIO())],
    ids=["deepcopy", "copy", "pickle", "torch.save"],
)
def test_copying_a_dispatched_model_refuses_and_leaves_it_computing(six, copy_it):
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model))
    try:
        before = _logits(model, ids)  # the slots hold other layers now than right after the dispatch
        with pytest.raises(TypeError, match="remove_offload"):
            copy_it(model)
        assert torch.equal(_logits(model, ids), before) and torch.equal(before, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_torch_save_of_a_dispatched_models_state_dict_saves_each_value_alone(six):
    # Streamed values in several dtypes live in one host arena (bf16 weights beside float32 norms): torch.save refuses
    # to save views of one storage in two dtypes, and would write the whole arena for each.
    model = copy.deepcopy(six[0]).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.input_layernorm.float()
    want = copy.deepcopy(model.state_dict())
    model = _dispatched(model)
    try:
        saved = io.BytesIO()
        torch.save(model.state_dict(), saved)
        assert saved.tell() < 1.1 * sum(value.nbytes for value in want.values())
        saved.seek(0)
        loaded = torch.load(saved)
        assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
        assert loaded["model.layers.5.input_layernorm.weight"].dtype == torch.float32
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "copy_it",
    [copy.deepcopy, pickle.dumps, lambda module: torch.save(module, io.BytesIO())],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copying_a_part_of_a_dispatched_model_refuses_or_gives_an_independent_copy(six, copy_it):
    # A plain copy of model.model would hold whatever the slots hold (layer 5's parameters showing layer 1's weights)
    # and hooks that copy into the copied pool, which its parameters do not point at: a silently wrong model. A module
    # that holds streamed layers refuses; a resident one copies, into a module of its own.
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model))
    try:
        _logits(model, ids)
        for path in ["model", "model.layers", "model.layers.5", "model.layers.3.mlp", "model.layers.5.mlp.up_proj"]:
            with pytest.raises(TypeError, match="remove_offload"):
                copy_it(model.get_submodule(path))
        for path in ["model.layers.0", "model.layers.4", "model.embed_tokens", "lm_head"]:
            module = model.get_submodule(path)
            twin = copy.deepcopy(module) if copy_it is copy.deepcopy else pickle.loads(pickle.dumps(module))
            pairs = zip(module.state_dict().items(), twin.state_dict().items(), strict=True)
            for (name, original), (_, value) in pairs:
                assert torch.equal(original, value) and original.data_ptr() != value.data_ptr(), f"{path}.{name}"
            with torch.no_grad():
                for param in twin.parameters():
                    param.zero_()
        assert torch.equal(_logits(model, ids), logits)
    finally:
        hf_prefetch.remove_offload(model)
    copied = copy.deepcopy(model)  # undispatched again: an ordinary copy
    assert torch.equal(_logits(copied, ids), logits) and _leftovers(copied) == []


# --- Forwards from several threads -------------------------------------------------------------------------------

ONE_SLOT = PrefetchConfig(group_size=1, prefetch_step=1)  # every layer streams through one slot


@contextmanager
def _frequent_thread_switches():
    # Switch threads every 10 µs instead of 5 ms, so that two forwards would interleave inside their layers.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _in_threads(work, count: int = 2, timeout: float = 120.0) -> list:
    results: list = [None] * count
    errors: list[BaseException] = []

    def run(index):
        try:
            results[index] = work(index)
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    with _frequent_thread_switches():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a forward never ended: deadlock"
    if errors:
        raise errors[0]
    return results


def test_two_threads_generate_the_tokens_of_one(six):
    model, ids, _ = six
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    model = _dispatched(copy.deepcopy(model), ONE_SLOT)
    try:

        def generate(index):
            with torch.no_grad():
                return [model.generate(ids, **kwargs) for _ in range(12)]

        runs = [tokens for tokens_of_thread in _in_threads(generate) for tokens in tokens_of_thread]
        assert len(runs) == 24 and all(torch.equal(tokens, expected) for tokens in runs)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_two_threads_forward_the_logits_of_one(six):
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model), ONE_SLOT)
    try:
        runs = _in_threads(lambda index: [_logits(model, ids) for _ in range(30)])
        assert all(torch.equal(out, logits) for outs in runs for out in outs)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("error", [IndexError, KeyboardInterrupt])
def test_a_forward_that_raises_does_not_block_another_threads_forward(six, error):
    # torch runs a forward hook registered with always_call=True when the forward raises an Exception, but not for a
    # KeyboardInterrupt (Ctrl-C in the main thread): a gate released only there would stay held and every other
    # thread's forward would hang.
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model), ONE_SLOT)
    mlp = model.model.layers[3].mlp
    try:
        assert "forward" in model.__dict__ and not model._forward_hooks  # the gate is the model's forward
        if error is IndexError:
            with pytest.raises(IndexError):
                _logits(model, torch.full_like(ids, 10_000))  # a token id outside the vocabulary
        else:
            mlp.forward = lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                _logits(model, ids)
            del mlp.forward
        runs = _in_threads(lambda index: _logits(model, ids), timeout=30)
        assert all(torch.equal(out, logits) for out in runs)
        assert torch.equal(_logits(model, ids), logits)  # the raising thread too
    finally:
        mlp.__dict__.pop("forward", None)
        hf_prefetch.remove_offload(model)


def test_a_forward_that_raises_in_one_thread_while_another_computes(six):
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model), ONE_SLOT)
    bad = torch.full_like(ids, 10_000)
    try:

        def work(index):
            outputs = []
            for step in range(20):
                if index == 0 and step % 2:
                    with pytest.raises(IndexError):
                        _logits(model, bad)
                else:
                    outputs.append(_logits(model, ids))
            return outputs

        runs = _in_threads(work, timeout=60)
        assert all(torch.equal(out, logits) for outs in runs for out in outs)
    finally:
        hf_prefetch.remove_offload(model)


# --- A deleted model is freed by reference counting --------------------------------------------------------------


def _everything_of(model) -> dict[str, weakref.ref]:
    # Weak references to the model, each of its modules and tensors, and all a dispatch built for it.
    objects = {"model": model}
    objects |= {f"module {name}": module for name, module in model.named_modules() if name}
    objects |= {f"parameter {name}": param for name, param in model.named_parameters()}
    state = hf_prefetch.get_state(model)
    if state is not None:
        objects |= {"state": state, "arena": state.arena}
        objects |= {f"host storage of {o.full_name}": o.host for o in state.offloaded}
        if state.engine is not None:
            objects["engine"] = state.engine
            objects |= {f"pool {i}": ring.pool for i, ring in enumerate(state.engine.rings)}
    return {name: weakref.ref(obj) for name, obj in objects.items()}


def _forward(model, ids):
    _logits(model, ids)


def _generate(model, ids):
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("then", [None, _forward, _generate], ids=["dispatched", "forward", "generate"])
def test_a_deleted_model_is_freed_by_reference_counting(six, tmp_path, then):
    # A layer that accelerate hooked must leave no reference cycle once its hook is removed (by remove_offload, or by
    # the journal when the model dies): else the layers and their weights live on until the cyclic collector runs.
    model, ids, _ = six
    model.save_pretrained(tmp_path)
    left: dict[str, list[str]] = {}
    for load in ["dispatch_model", "from_pretrained", "uva", "removed"]:
        if load == "from_pretrained":
            dispatched = hf_prefetch.from_pretrained(tmp_path, SHARED, device="cpu")
        elif load == "uva":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # on the CPU, UVA leaves every weight where it is
                dispatched = hf_prefetch.dispatch_model(
                    copy.deepcopy(model), UVAConfig(cpu_offload_gb=1), device="cpu"
                )
        else:
            dispatched = _dispatched(copy.deepcopy(model))
        pinned = pinned_bytes()
        gc.collect()
        gc.disable()
        try:
            if then is not None:
                then(dispatched, ids[:1])
            refs = _everything_of(dispatched)
            if load == "removed":
                hf_prefetch.remove_offload(dispatched)
            del dispatched
            left[load] = [name for name, ref in refs.items() if ref() is not None]
        finally:
            gc.enable()
        assert pinned_bytes() <= pinned
    assert left == {load: [] for load in left}


# --- Interrupts anywhere ---------------------------------------------------------------------------------------------

PACKAGE = os.path.dirname(hf_prefetch.__file__) + os.sep
FOUR = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)  # layers 1 and 3 take turns in one slot


class Interrupts:
    """Raises a KeyboardInterrupt at the N-th 'line' event executed in hf_prefetch's own files, as a Ctrl-C landing
    there would. Inside a `deferred_interrupts` block, where the library holds a real SIGINT back until the block ends,
    it is raised when the block ends: the harness stands in for that context manager (a KeyboardInterrupt raised by a
    trace function is not a signal, so the real one could not hold it back)."""

    def __init__(self, monkeypatch) -> None:
        self.deferring = 0
        self.pending = False
        original = sys.modules["hf_prefetch.lifecycle.journal"].deferred_interrupts
        for name, module in list(sys.modules.items()):
            if name.startswith("hf_prefetch") and getattr(module, "deferred_interrupts", None) is original:
                monkeypatch.setattr(module, "deferred_interrupts", self._deferred)

    @contextmanager
    def _deferred(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
            if not self.deferring and self.pending:
                self.pending = False
                raise KeyboardInterrupt

    def run(self, call, at: int | None = None) -> list[tuple]:
        """Run `call()`, interrupted at the `at`-th line event (never when None). Returns the (code, line) of each line
        event, up to the interrupt."""
        events: list[tuple] = []

        def line(frame, event, arg):
            if event == "line":
                events.append((frame.f_code, frame.f_lineno))
                if len(events) == at:
                    if not self.deferring:
                        raise KeyboardInterrupt  # also ends the tracing
                    self.pending = True
            return line

        self.pending = False
        sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename.startswith(PACKAGE) else None)
        try:
            call()
        finally:
            sys.settrace(None)
        return events


def _interrupt_points(events: list[tuple], changes_from: str | None, every: int) -> list[int]:
    # The first line of every function on the call path; from the first call of `changes_from` on (the first change
    # to the model), the first execution of every line; and every `every`-th event.
    start = (
        0 if changes_from is None else next(i for i, (code, _) in enumerate(events) if code.co_name == changes_from)
    )
    functions, lines, points = set(), set(), []
    for index, (code, line) in enumerate(events):
        if code not in functions or (index >= start and (code, line) not in lines) or index % every == every - 1:
            points.append(index + 1)
        functions.add(code)
        lines.add((code, line))
    return points


def _interrupted_everywhere(monkeypatch, setup, call, check, changes_from=None, every=150):
    """For each interrupt point of `call(model)` on a fresh `setup()`: interrupt it there, then `check(model, at)`."""
    interrupts = Interrupts(monkeypatch)
    call(setup())  # once first: what runs only once per process (a warning, a cache) is not on the path later
    model = setup()  # kept: its collection (the journal's finalizer) is not part of the call
    events = interrupts.run(lambda: call(model))
    points = _interrupt_points(events, changes_from, every)
    interrupted = 0
    for at in points:
        model = setup()
        try:
            interrupts.run(lambda: call(model), at)  # noqa: B023
        except KeyboardInterrupt:
            interrupted += 1
            code, line = events[at - 1] if at <= len(events) else (None, None)
            where = f"interrupt {at} of {len(events)} ({code and code.co_name} line {line})"
            check(model, where)
    assert interrupted == len(points)


def _recovered(model, ids, expected, where, finish=None):
    """An interrupted model is dispatched and computes `expected`, or is half-done and says so; then `finish` (or
    remove_offload) leaves an undispatched model that computes `expected`."""
    state = hf_prefetch.get_state(model)
    if state is not None and state.lifecycle is Lifecycle.ATTACHED:
        assert torch.equal(_logits(model, ids), expected), where
    elif state is not None:
        with pytest.raises(RuntimeError, match="remove_offload"):
            _logits(model, ids)
    if finish is not None:
        finish(model, state)
    elif state is not None:
        hf_prefetch.remove_offload(model)
    assert _leftovers(model) == [], where
    assert not any(param.device.type == "meta" for param in model.parameters())
    assert torch.equal(_logits(model, ids), expected), where


@pytest.fixture
def four():
    """A 4-layer Llama, its prompt and its logits, and another model's state dict; computed on one thread (tiny models
    compute fastest on one, and on a loaded machine several threads spin against each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(4)
    ids = prompt(1, 5)
    yield model, ids, _logits(model, ids), tiny_llama(4, seed=3).state_dict()
    torch.set_num_threads(threads)


def test_an_interrupted_dispatch_is_finished_by_remove_offload_or_a_new_dispatch(four, monkeypatch):
    base, ids, logits, _ = four
    count = iter(range(10**6))

    def setup():  # one model throughout: each interrupted dispatch must leave it as it was (`_recovered` checks it)
        if hf_prefetch.get_state(base) is not None:
            hf_prefetch.remove_offload(base)
        return base

    def again(model, state):  # every other point: dispatch again (which finishes the interrupted one), then remove
        if next(count) % 2:
            return None if state is None else hf_prefetch.remove_offload(model)
        done = state is not None and state.lifecycle is Lifecycle.ATTACHED
        _dispatched(model, FOUR) if not done else hf_prefetch.dispatch_model(model, FOUR, device="cpu", replace=True)
        assert torch.equal(_logits(model, ids), logits)
        hf_prefetch.remove_offload(model)

    _interrupted_everywhere(
        monkeypatch,
        setup,
        lambda model: _dispatched(model, FOUR),
        lambda model, where: _recovered(model, ids, logits, where, again),
        changes_from="begin",
    )


def test_an_interrupted_remove_offload_is_finished_by_remove_offload(four, monkeypatch):
    base, ids, logits, _ = four

    def setup():  # one model throughout: each interrupted removal must leave it as it was (`_recovered` checks it)
        if hf_prefetch.get_state(base) is None:
            _dispatched(base, FOUR)
        _logits(base, ids)  # layer 3 holds the slot
        return base

    _interrupted_everywhere(
        monkeypatch, setup, hf_prefetch.remove_offload, lambda model, where: _recovered(model, ids, logits, where)
    )


@pytest.mark.parametrize("verb", ["load_state_dict", "reload_weights"])
def test_an_interrupted_rewrite_computes_what_state_dict_shows(four, monkeypatch, verb):
    base, ids, _, new = four

    def setup():
        model = _dispatched(copy.deepcopy(base), FOUR)
        _logits(model, ids)
        return model

    def rewrite(model):
        if verb == "load_state_dict":
            model.load_state_dict(new)
        else:
            hf_prefetch.reload_weights(model, new)

    def check(model, where):
        # Some tensors hold their new values, the others their old ones: the model computes what its state dict shows.
        undispatched = copy.deepcopy(base)
        undispatched.load_state_dict(model.state_dict())
        _recovered(model, ids, _logits(undispatched, ids), where)

    _interrupted_everywhere(monkeypatch, setup, rewrite, check)


# --- A Ctrl-C at every point of the paths that open, register or submit something (tests/interrupting.py) ----------

# Two ways to dispatch a 2-layer model: its second layer streamed (saving no device memory, which warns), or both.
TWO_WAYS = [
    PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1),
    PrefetchConfig(group_size=1, prefetch_step=1),
]


@pytest.fixture
def two():
    """A 2-layer Llama, its prompt and its logits, computed on one thread (see `four`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(2)
    ids = prompt(1, 5)
    yield model, ids, _logits(model, ids)
    torch.set_num_threads(threads)


def _computes_or_refuses(model, ids, expected, where) -> None:
    """A model after an interrupt computes `expected`, or is half-done and says so (and `remove_offload` then brings it
    back); no hook that holds forwards back is left on it; a dispatch that follows computes `expected`."""
    state = hf_prefetch.get_state(model)
    if state is not None and state.lifecycle is not Lifecycle.ATTACHED:
        with pytest.raises(RuntimeError, match="remove_offload"):
            _logits(model, ids)
        hf_prefetch.remove_offload(model)
        assert _leftovers(model) == [], where
    assert not [name for name, m in model.named_modules() if m._forward_pre_hooks], where
    assert torch.equal(_logits(model, ids), expected), where
    replace = hf_prefetch.get_state(model) is not None
    hf_prefetch.dispatch_model(model, TWO_WAYS[0], device="cpu", replace=replace)
    assert torch.equal(_logits(model, ids), expected), where


@pytest.mark.filterwarnings("ignore:This dispatch saves no device memory")
def test_a_ctrl_c_anywhere_as_a_dispatch_is_replaced_leaves_no_hook_that_holds_forwards_back(two):
    # A Ctrl-C as the hooks that hold other threads' forwards back during a re-dispatch were removed (as the block
    # that held them ended, after the new gate arrived) left them on the model, refusing every forward for good.
    from hf_prefetch.lifecycle.attach import begin, forwards_held
    from hf_prefetch.lifecycle.detach import detach
    from tests.interrupting import at_every_point

    base, ids, logits = two
    model = hf_prefetch.dispatch_model(copy.deepcopy(base), TWO_WAYS[0], device="cpu")

    def replace(model):
        hf_prefetch.dispatch_model(model, TWO_WAYS[1], device="cpu", replace=True)

    def check(model, where):
        _computes_or_refuses(model, ids, logits, where)

    assert at_every_point(lambda: model, replace, check, [forwards_held, detach, begin], opcodes=True) > 100


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.filterwarnings("ignore:This dispatch saves no device memory")
def test_a_ctrl_c_anywhere_as_from_pretrained_closes_its_reader_leaves_no_descriptor_open(two, tmp_path, monkeypatch):
    # A Ctrl-C as the reader closed (its direct-I/O descriptors swapped out, then closed one by one) left them open for
    # the process's life: no finalizer closed them.
    from hf_prefetch.host.diskio import open_direct
    from hf_prefetch.loading import reader
    from tests.interrupting import at_every_point

    base, ids, logits = two
    base.save_pretrained(tmp_path, max_shard_size="200KB")
    fd = open_direct(next(tmp_path.glob("*.safetensors")))
    if fd is None:  # a file system that refuses O_DIRECT (tmpfs): ordinary descriptors read the same windows
        monkeypatch.setattr(reader, "open_direct", lambda path: os.open(path, os.O_RDONLY))
    else:
        os.close(fd)
    opened, loaded = len(os.listdir("/proc/self/fd")), []

    def load(_):
        loaded.append(hf_prefetch.from_pretrained(tmp_path, TWO_WAYS[0], device="cpu", direct_io=True))

    def check(_, where):
        if len(os.listdir("/proc/self/fd")) != opened:
            gc.collect()  # what a reference cycle kept: closed by its finalizer
        assert len(os.listdir("/proc/self/fd")) == opened, where

    closing = [
        reader.TensorReader.close,
        reader.TensorReader.__exit__,
        getattr(reader, "_close_all", reader.TensorReader.close),
    ]
    assert at_every_point(lambda: None, load, check, closing, opcodes=True) > 10
    assert len(loaded) == 1 and torch.equal(_logits(loaded[0], ids), logits)


# --- UVAConfig(cpu_offload_gb=-0.0) == UVAConfig(cpu_offload_gb=0.0), with equal hashes: covered by
# tests/test_offload_config.py::test_equal_configs_hash_equally.


# --- Backward -----------------------------------------------------------------------------------------------------


def test_backward_through_a_streamed_layer_raises_and_no_grad_forwards_are_unaffected(six):
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model))  # resident parameters keep requires_grad=True
    try:
        out = model(ids).logits
        assert out.requires_grad
        with pytest.raises(RuntimeError, match=r"Backward through model\.layers\.\d, a layer streamed by hf_prefetch"):
            out.sum().backward()
        # Gradients with respect to the inputs need the streamed weights too.
        for param in model.parameters():
            param.requires_grad_(False)
        embeds = model.model.embed_tokens(ids).detach().requires_grad_()
        with pytest.raises(RuntimeError, match="torch.no_grad()"):
            model(inputs_embeds=embeds).logits.sum().backward()
        with torch.no_grad():
            out = model(ids).logits
        assert not out.requires_grad and out.grad_fn is None and torch.equal(out, logits)
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


# --- The plan's numbers -------------------------------------------------------------------------------------------

PLANS = [
    # (layers, group_size, num_in_group, prefetch_step)
    (6, 2, 1, 2),  # streamed 1, 3, 5 in 2 slots: 3 holds its own
    (6, 2, 1, 1),
    (8, 2, 1, 3),  # 4 streamed, 3 slots
    (7, 1, 1, 4),  # every layer, 4 slots: 7 = 4 + 3
    (9, 3, 2, 2),
    (5, 1, 1, 2),
    (6, 3, 1, 1),
    (4, 2, 1, 4),  # fewer streamed layers than prefetch_step: each owns its slot
]


@pytest.mark.parametrize("layers, group_size, num_in_group, prefetch_step", PLANS)
def test_streamed_bytes_per_forward_is_what_a_forward_copies(layers, group_size, num_in_group, prefetch_step):
    model = tiny_llama(layers)
    ids = prompt(1, 4)
    config = PrefetchConfig(group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some of these save no device memory, or cannot hide a copy
        _dispatched(model, config)
    try:
        plan = hf_prefetch.get_state(model).plan
        for _ in range(2):  # warm-up: the slots take their steady rotation
            _logits(model, ids)
        hf_prefetch.reset_stats(model)
        forwards = 5
        for _ in range(forwards - 1):
            _logits(model, ids)
        with torch.no_grad():  # a decode step copies as much as a prefill
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        measured = hf_prefetch.stats(model)
        assert measured.misses == 0
        assert measured.copied_bytes == forwards * plan.streamed_bytes_per_forward
        owners = [layer.path for layer in plan.rings[0].streamed if layer.owns_slot]
        assert [path for path, placement in _placements(plan).items() if placement == "own slot"] == owners
        assert plan.saves_device_memory == (plan.pool_bytes < plan.offloaded_bytes)
    finally:
        hf_prefetch.remove_offload(model)


def _placements(plan) -> dict[str, str]:
    # The placement column of `str(plan)`, by layer path.
    rows = [line.split("  ") for line in str(plan).splitlines() if line.startswith("model.layers.")]
    return {cells[0].strip(): next(cell.strip() for cell in cells[1:] if cell.strip()) for cells in rows}


def test_the_layer_alone_in_its_slot_prints_as_own_slot():
    model = _dispatched(tiny_llama(6))
    try:
        assert _placements(hf_prefetch.get_state(model).plan) == {
            "model.layers.0": "resident",
            "model.layers.1": "streamed",
            "model.layers.2": "resident",
            "model.layers.3": "own slot",
            "model.layers.4": "resident",
            "model.layers.5": "streamed",
        }
    finally:
        hf_prefetch.remove_offload(model)


def test_a_dispatch_whose_pool_is_as_large_as_what_it_offloads_warns():
    with pytest.warns(UserWarning, match="saves no device memory") as caught:
        model = _dispatched(tiny_llama(4))  # layers 1 and 3 in 2 slots: the pool holds both
    assert caught[0].filename == __file__  # at the caller's line
    hf_prefetch.remove_offload(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_prefetch.remove_offload(_dispatched(tiny_llama(6)))  # 3 layers in 2 slots


def test_a_deleted_half_done_model_is_freed_by_reference_counting(six, monkeypatch):
    # A Ctrl-C stops the dispatch once its hooks are attached, a second one its rollback: the model is half-done, with
    # hooked layers (each a reference cycle until its hook is removed) and host storage that nobody released.
    model, ids, _ = six
    model = copy.deepcopy(model)
    attach_prefetch = hf_prefetch.lifecycle.attach._attach_prefetch

    def interrupted(*args):
        attach_prefetch(*args)
        raise KeyboardInterrupt

    def interrupted_rollback(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_prefetch.lifecycle.attach, "_attach_prefetch", interrupted)
    monkeypatch.setattr(hf_prefetch.dispatch, "rollback", interrupted_rollback)
    with pytest.raises(KeyboardInterrupt):
        _dispatched(model)
    monkeypatch.undo()
    assert hf_prefetch.get_state(model).lifecycle is Lifecycle.ATTACHING
    assert hasattr(model.model.layers[1], "_hf_hook")
    gc.collect()
    gc.disable()
    try:
        refs = _everything_of(model)
        del model
        assert [name for name, ref in refs.items() if ref() is not None] == []
    finally:
        gc.enable()


def test_a_forward_set_after_the_dispatch_is_kept_by_remove_offload(six):
    # The gate's `forward` (which releases the gate on a KeyboardInterrupt) is the model's own attribute: wrapping it
    # again after the dispatch, as `model.forward = torch.compile(model.forward)` does, must survive the removal.
    model, ids, logits = six
    model = _dispatched(copy.deepcopy(model))
    gated = model.forward
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return gated(*args, **kwargs)

    model.forward = counted
    assert torch.equal(_logits(model, ids), logits) and calls == [1]
    hf_prefetch.remove_offload(model)
    assert model.forward is counted and torch.equal(_logits(model, ids), logits) and calls == [1, 1]
    del model.forward
    assert _leftovers(model) == []


def test_a_model_collected_inside_a_dispatch_mode_is_undone_outside_it(six):
    # The cyclic collector runs a dead model's finalizer wherever it happens to run, torch.compile's FakeTensorMode
    # included, where the journal's `param.data = ...` would fail and the host storage that `release` frees would be
    # replaced by a fake tensor.
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, _, _ = six
    dispatched = _dispatched(copy.deepcopy(model))
    state = hf_prefetch.get_state(dispatched)
    steps = len(state.journal)
    cycle = [dispatched]
    cycle.append(cycle)  # only the cyclic collector frees it
    del dispatched
    raised = []
    previous = sys.unraisablehook
    sys.unraisablehook = raised.append
    try:
        with FakeTensorMode():
            del cycle
            gc.collect()
    finally:
        sys.unraisablehook = previous
    assert [r.exc_value for r in raised] == []
    assert len(state.journal) < steps  # the attach steps were undone
    assert type(state.arena._buffer) is torch.Tensor and state.arena._buffer.numel() == 0  # a real, empty buffer
