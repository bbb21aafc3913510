"""Every hook hf_prefetch installs on a model: the code that runs inside its forward, `state_dict` and
`load_state_dict`. Installing and removing them is `changes.py`'s job; what they do is here.

- `PrefetchHook` (an accelerate `ModelHook` on each streamed layer): before the layer runs its weights must be in its
  slot (`wait`); after it ran its slot goes to the next layer that uses it (`release`). Under torch.compile both steps
  are the custom ops of `ops.py`, so the decoder stack compiles into one graph.
- `RoutedHook` (on the experts module of a layer with routed expert tensors): before it runs, the rows of the experts
  its router picked are copied into the layer's slot (`gather`).
- `ForwardGate` (the model's own `_call_impl` and `forward`, wrapped): one forward at a time, and `engine.prepare()`
  before it and `engine.finish()` after it, outside any compiled graph.
- The state-dict hooks: `state_dict()` reports host values, `load_state_dict()` writes through to them.
Policy lives in the plan and the engine, not here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from accelerate.hooks import ModelHook
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.hf_prefetch)
from .bnb import host_state_dict, is_int8, is_params4bit
from .changes import deferred_interrupts
from .compressed import encode_for, host_value, write_encoded
from .engine import PrefetchEngine
from .host import own_storage
from .layers import set_part, with_inner
from .state import STATE_ATTR, Lifecycle, OffloadedParam, OffloadState

__all__ = [
    "PrefetchHook",
    "RoutedHook",
    "ForwardGate",
    "waits_then_refuses",
    "WriteThrough",
    "one_load_at_a_time",
    "host_values_in_state_dict",
]


class PrefetchHook(ModelHook):
    """Waits for a streamed layer's weights before its forward and starts the next copy into its slot after it."""

    def __init__(self, engine: PrefetchEngine, engine_id: int, ring: int, position: int, path: str) -> None:
        self.engine = engine
        self.engine_id = engine_id  # the engine's name for the custom ops
        self.ring = ring
        self.position = position
        self.path = path

    def pre_forward(self, module, *args, **kwargs):
        # transformers sometimes calls `pre_forward(module)` with no inputs: the signature accepts both.
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.wait, self.engine.wait, self, _input_anchor(args, kwargs))
        else:
            _eager_step(self.engine.wait, self, "hf_prefetch.wait")
        return args, kwargs

    def post_forward(self, module, output):
        if torch.compiler.is_compiling():
            _compiled_step(torch.ops.hf_prefetch.release, self.engine.release, self, _first_tensor(output))
        else:
            _eager_step(self.engine.release, self, "hf_prefetch.release")
            if torch.is_grad_enabled():
                _refuse_backward(output, self.path)
        return output

    def __repr__(self) -> str:
        return f"PrefetchHook({self.path}, ring={self.ring}, position={self.position})"


class RoutedHook(ModelHook):
    """On the experts module of a layer with ROUTED parameters: before it runs, the rows of the experts its router
    picked are copied into the layer's slot (`PrefetchEngine.gather`; see [Note: routed experts] in engine.py)."""

    def __init__(self, engine: PrefetchEngine, engine_id: int, ring: int, position: int, path: str, index_arg: str):
        self.engine = engine
        self.engine_id = engine_id
        self.ring = ring
        self.position = position
        self.path = path
        self.index_arg = index_arg

    def pre_forward(self, module, *args, **kwargs):
        index = kwargs.get(self.index_arg, args[1] if len(args) > 1 else None)
        if not isinstance(index, torch.Tensor):
            raise TypeError(
                f"hf_prefetch: the experts module {self.path} was called without the router's choice "
                f"({self.index_arg}, a tensor of expert indices), which its routed weights need; got "
                f"{type(index).__name__}."
            )
        if torch.compiler.is_compiling():
            anchor = _input_anchor(args[:1], {k: v for k, v in kwargs.items() if k != self.index_arg})
            torch.ops.hf_prefetch.gather(anchor, index, self.engine_id, self.ring, self.position)
        else:
            _eager_step(self.engine.gather, self, "hf_prefetch.gather", index)
        return args, kwargs

    def __repr__(self) -> str:
        return f"RoutedHook({self.path}, ring={self.ring}, position={self.position})"


_REPLACED = (
    "Another thread removed or replaced this model's hf_prefetch dispatch while this forward waited for it "
    "(remove_offload, dispatch_model(replace=True)): nothing was computed. Call the model again."
)


def _half_done(state: OffloadState) -> str:
    return (
        f"This model's hf_prefetch dispatch is half-done ({state.lifecycle.value}: an interrupt or an error stopped "
        "it). Call hf_prefetch.remove_offload(model) to finish undoing it, then dispatch again."
    )


def waits_then_refuses(lock: threading.RLock, owner: int) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook for the time a model has no forward gate while thread `owner` replaces its dispatch under
    its `lock` (`attach.forwards_held`): a forward another thread starts then waits for the lock, and then refuses,
    as one that waited in the old gate does (half-done if the replacement stopped half-way). A forward of the owner
    itself (the lock is re-entrant) refuses at once."""

    def wait_then_refuse(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == owner:
            raise RuntimeError(
                "This model's hf_prefetch dispatch is being replaced by this thread (dispatch_model): it cannot run "
                "a forward until the replacement ends."
            )
        with lock:
            state = module.__dict__.get(STATE_ATTR)
        if state is not None and state.lifecycle is not Lifecycle.ATTACHED:
            raise RuntimeError(_half_done(state))
        raise RuntimeError(_REPLACED)

    return wait_then_refuse


class ForwardGate:
    """The model's gate: its `_call_impl` and its `forward`, wrapped (`guard`, set on the module's instance dict for as
    long as the dispatch's state lives, from its first change to the last step of its removal):

    - One forward at a time: a second thread's forward waits for the first to end (the slots hold one forward's
      layers at a time, so interleaved forwards would compute with each other's weights). Re-entrant in one thread.
    - A model whose dispatch or removal was interrupted refuses to compute until `remove_offload` finished it.
    - `engine.prepare()` before and `engine.finish()` after each forward, outside any compiled graph (under
      torch.compile dynamo runs the wrappers in Python and compiles what they wrap, so these run around each call of
      the compiled code, each CUDA-graph replay); pending write-throughs of an interrupted `load_state_dict` are
      completed first.

    A call of the model enters at `_call_impl`, which runs the model's hooks and its forward: whatever they raise, a
    KeyboardInterrupt included, the wrapper's `finally` leaves the gate (torch runs an `always_call` forward hook for
    an Exception only, and a gate made of hooks stayed held after a Ctrl-C in a hook). The forward wrapper gates a
    direct `model.forward(...)`, and a call where the first is bypassed (`model.compile()` before the dispatch); under
    the first it passes through. If the forward wrapper is taken away (accelerate's `remove_hook_from_module` puts back
    the forward it had saved), calls of the model stay gated.

    The parts of the model that run streamed layers (the decoder, a streamed layer) are guarded too (`guard(part,
    name, model)`): inside the gate they pass through; called on their own, they enter as a call of the model would.
    """

    def __init__(self, state: OffloadState, lock: threading.RLock) -> None:
        self._state = weakref.ref(state)  # the state holds the gate (`OffloadState.gate`)
        self._lock = lock  # the model's (`state.model_lock`), shared with the verbs that change the dispatch
        # Per thread: `depth`, `called` (the depth a call wrapper entered at) and `caller` (its module's id).
        self._local = threading.local()

    def guard(self, module: nn.Module, name: str, model: nn.Module | None = None) -> Callable[..., Any]:
        """The gated `name` ("_call_impl" or "_compiled_call_impl": a call of the module; "forward") for the module's
        instance dict: the one set on the instance before, else the class's, between `_enter` and `_leave`. `model`:
        the dispatched model, where `module` is a part of it that holds streamed layers (its decoder, a layer): a call
        of the part inside a forward of the model passes through, one on its own (`model.model(ids)`) enters."""
        inner = module.__dict__.get(name)
        # Weak references: the module holds this function, and so may a caller (`model.compile()`, a forward set on top
        # of it) long after the dispatch left; the state holds the gate.
        module_ref, gate_ref, lock = weakref.ref(module), weakref.ref(self), self._lock
        model_ref = weakref.ref(model) if model is not None else module_ref
        part = model is not None
        calls = name != "forward"
        token = id(module)  # which module's call entered (`caller` in the thread's state): a plain int to compare
        outside_graph = _outside_graph()  # made here, not while dynamo traces the call

        def gated(*args: Any, **kwargs: Any) -> Any:
            owner, top, gate = module_ref(), model_ref(), gate_ref()
            if owner is None or (top is None and not part):
                raise RuntimeError(f"This {name} belonged to a model that no longer exists.")
            # The class's function bound with `partial`, not `__get__`: dynamo, tracing a part's wrapper inside a
            # compiled call, took `type(owner)._call_impl.__get__(owner)` for the instance's attribute (this wrapper).
            wrapped = inner if inner is not None else functools.partial(getattr(type(owner), name), owner)
            if top is None:  # a part kept after its model was collected, which undid the dispatch: nothing to gate
                return wrapped(*args, **kwargs)
            if gate is None or not gate.guards(top):
                # Kept by a caller after its dispatch left (`model.compile()` captured it, a forward set on top of
                # it), or fetched by a call that started just before: a change under way ends first, then it runs
                # under the model's dispatch now, if any (whose `_enter` refuses if it changes again meanwhile).
                with _held(lock):
                    current = top.__dict__.get(STATE_ATTR)
                    if current is None:
                        return wrapped(*args, **kwargs)
                    gate = current.gate
            # A call of the module enters; what runs under it for the same call (another call wrapper kept by
            # `model.compile()`, then the forward) passes through, the forward marking the call as done; a forward
            # called on its own (directly, or where the call's wrappers were bypassed) enters. A part of the model
            # passes through anywhere inside the gate.
            depth, local = gate.depth(), gate._local.__dict__
            if local.get("called") == depth > 0 and local.get("caller") == token:  # under this module's call
                if not calls:
                    local["called"] = None  # its forward: a call of the model from inside it enters again
                return wrapped(*args, **kwargs)
            if part and depth > 0:
                return wrapped(*args, **kwargs)
            called, caller = local.get("called"), local.get("caller")
            try:
                outside_graph(gate._enter, top, _token_count(args, kwargs))
                if calls:
                    local["called"], local["caller"] = gate.depth(), token
                return wrapped(*args, **kwargs)
            finally:
                with deferred_interrupts():  # a Ctrl-C here would leave the gate held
                    local["called"], local["caller"] = called, caller
                    if gate.depth() > depth:  # else `_enter` refused (and left), or raised before taking the lock
                        outside_graph(gate._leave, True)

        functools.update_wrapper(gated, inner if inner is not None else getattr(type(module), name))
        if not calls:
            gated.__signature__ = inspect.signature(module.forward)  # without `self`: generate() reads the arguments
        return gated

    def guards(self, module: nn.Module) -> bool:
        """Whether the gate's dispatch is `module`'s (half-done or not)."""
        state = self._state()
        return state is not None and module.__dict__.get(STATE_ATTR) is state

    def depth(self) -> int:
        """How many forwards of this thread are inside the gate (nested ones included)."""
        return self._local.__dict__.get("depth", 0)

    def _enter(self, module: nn.Module, tokens: int | None = None) -> None:
        # After a forward, or a verb changing the dispatch, in another thread; counted before a Ctrl-C can land.
        _take(self._lock, lambda: setattr(self._local, "depth", self.depth() + 1))
        try:
            state = self._state()
            if state is None or module.__dict__.get(STATE_ATTR) is not state:
                raise RuntimeError(_REPLACED)
            if state.lifecycle is not Lifecycle.ATTACHED:
                raise RuntimeError(_half_done(state))
            if state.arena.file_bytes:  # [Note: mapped host storage]: never compute with a changed file's pages
                state.arena.check_files()
                state.private_before_graphs()
        except BaseException:
            self._leave(finish=False)  # refused: nothing was prepared
            raise
        try:
            for write_through in state.write_throughs:
                write_through.complete()
            if state.engine is not None:
                state.engine.prepare(tokens)
        except BaseException:
            self._leave(finish=True)
            raise

    def _leave(self, finish: bool) -> None:
        depth = self.depth()
        if depth == 0:
            return
        try:
            state = self._state()
            if finish and depth == 1 and state is not None and state.engine is not None:
                state.engine.finish()
        finally:
            with deferred_interrupts():
                self._local.depth = depth - 1
                self._lock.release()


def _refuse_backward(output: Any, path: str) -> None:
    def refuse(grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"Backward through {path}, a layer streamed by hf_prefetch: its parameters live in buffer slots shared "
            "with other layers and get no gradients. hf_prefetch is for inference: run under torch.no_grad() (or "
            "torch.inference_mode()), or call hf_prefetch.remove_offload(model) before training."
        )

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(refuse)


def _eager_step(step, hook: PrefetchHook | RoutedHook, label: str, *extra: Any) -> None:
    # The engine's step for the hook's layer, named in profiler traces when a profiler is on.
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            step(hook.ring, hook.position, *extra)
    else:
        step(hook.ring, hook.position, *extra)


def _compiled_step(op, step, hook: PrefetchHook, anchor: torch.Tensor | None) -> None:
    if anchor is not None:
        op(anchor, hook.engine_id, hook.ring, hook.position)
    else:  # nothing to order the op by (a layer called without tensor inputs): the engine's step, outside the graph
        _run_outside_graph(step, hook.ring, hook.position)


# How long a wait for the model's lock runs with a Ctrl-C held back, in turns: a Ctrl-C the operating system gave
# another thread only wakes this one when a turn ends.
_TURN_SECONDS = 0.05


def _take(lock: threading.RLock, counted: Callable[[], None]) -> None:
    """Wait for `lock` in turns of `_TURN_SECONDS`, each with a Ctrl-C held back, and once it is taken call `counted`
    (which records that this thread holds it) before a Ctrl-C can land: one raised then leaves a lock its owner
    knows to release."""
    while True:
        with deferred_interrupts():
            if lock.acquire(timeout=_TURN_SECONDS):
                counted()
                return


@contextlib.contextmanager
def _held(lock: threading.RLock) -> Iterator[None]:
    # `lock` held for the block, taken as `_take` takes it and released with a Ctrl-C held back.
    taken: list[bool] = []
    try:
        _take(lock, lambda: taken.append(True))
        yield
    finally:
        if taken:
            with deferred_interrupts():
                lock.release()


def _run_outside_graph(step, *args) -> None:
    # A graph break: the step runs in Python on every call of the compiled code.
    _outside_graph()(step, *args)


def _outside_graph() -> Callable[..., Any]:
    # Made on first use: torch.compiler.disable imports dynamo, which `import hf_prefetch` must not. A dispatch makes
    # it (`ForwardGate.guard`), so that dynamo never traces its making.
    global _outside
    if _outside is None:
        _outside = torch.compiler.disable(lambda step, *args: step(*args))
    return _outside


_outside = None


def _token_count(args: tuple, kwargs: dict) -> int | None:
    # The tokens a model's forward computes on (the largest of its id and embedding inputs); None where it has none.
    counts = []
    for position, name in enumerate(("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds")):
        value = kwargs.get(name, args[0] if position == 0 and args else None)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            counts.append(value.numel() // (value.shape[-1] if name.endswith("embeds") else 1))
    return max(counts) if counts else None


def _input_anchor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # The tensor the layer's weight reads depend on: its hidden states, else its first tensor input. An anchor the
    # weights do not meet (an attention mask) would not keep the weight reads after the wait.
    hidden = kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) else _first_tensor((args, kwargs))


def _first_tensor(value) -> torch.Tensor | None:
    """The first tensor in a layer's inputs or output (nested in tuples, lists, dicts or a ModelOutput)."""
    return next(_tensors(value), None)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
        return
    if isinstance(value, dict):  # ModelOutput is a dict too
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


# --- state_dict and load_state_dict ------------------------------------------------------------------------------


def host_values_in_state_dict(
    hosts: dict[str, list[OffloadedParam]],
    writable: Callable[[], None],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
) -> None:
    """`state_dict()` hook of a module that owns streamed parameters (`hosts`: their names in it, each with its
    tensors): a streamed parameter's slot holds whichever layer ran last; its value is in host storage (decoded where
    compressed; a tensor subclass rebuilt around its inner tensors' host storage). `writable()` first: host storage
    that is a file's pages becomes private memory before it is handed out ([Note: mapped host storage])."""
    if any(prefix + name in state_dict for name in hosts):
        writable()
    for name, tensors in hosts.items():
        if prefix + name not in state_dict:
            continue
        values = {o.inner: own_storage(host_value(o)) for o in tensors}  # each saved alone (host.own_storage)
        if is_params4bit(tensors[0].param):  # its quantization state's entries too, as Linear4bit saves them
            host_state_dict(tensors[0].param, values, prefix + name, state_dict)
        elif is_int8(tensors[0].param):  # its values, and its scales under the module's key, as Linear8bitLt saves
            state_dict[prefix + name] = values["data"]
            if prefix + "SCB" in state_dict:
                state_dict[prefix + "SCB"] = values["SCB"]
        elif tensors[0].inner is None:
            state_dict[prefix + name] = values[None]
        else:  # a tensor subclass rebuilt around its inner tensors
            state_dict[prefix + name] = with_inner(tensors[0].param, values)


class Streamed(NamedTuple):
    name: str  # in the module that owns it
    offloaded: OffloadedParam
    slot_buffer: torch.Tensor
    ring: int
    position: int


class WriteThrough:
    """`load_state_dict` on a module that owns streamed parameters writes their host storage, not their slots.

    Before the module loads, the layers it will write lose their slots (an interrupt from then on leaves them to load
    their new values, a miss) and each streamed parameter the state dict names points at its host tensor, so torch's
    own loading (its checks, casts, strict and missing/unexpected keys) writes the true value. After it loaded, the
    parameters point at their slots again. If the load is interrupted before that, the next forward completes it
    (`complete`). See [Note: rewriting weights] in reload.py.
    """

    def __init__(self, engine: PrefetchEngine, private_host: Callable[[], None], streamed: list[Streamed]) -> None:
        self.engine = engine
        self.private_host = private_host  # `OffloadState.private_host_storage`
        self.streamed = streamed
        self.loading: list[Streamed] = []  # pointed at host storage by `before`, until `complete`
        self.held: list[tuple[int, int]] = []  # (ring, position) of the layers that held their slot before

    def before(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        loading = [s for s in self.streamed if prefix + s.name in state_dict]
        if not loading:
            return
        self.private_host()  # host storage that is a file's pages: private memory first
        self.engine.drain()  # no copy may still read the host storage about to be written
        layers = list(dict.fromkeys((s.ring, s.position) for s in loading))
        self.held += [layer for layer in layers if self.engine.holds(*layer)]
        for layer in layers:
            self.engine.invalidate(*layer)
        self.loading += loading
        for streamed in loading:
            # A compressed parameter loads into a decoded copy, encoded into host storage by `complete`.
            set_part(streamed.offloaded.param, streamed.offloaded.attr, host_value(streamed.offloaded))

    def after(self, module: nn.Module, incompatible_keys: Any) -> None:
        self.complete()

    def complete(self) -> None:
        """Point the parameters of a finished (or interrupted) load back at their slots, after encoding the new
        values of compressed ones into host storage (all of them before the first write: values that do not fit a
        layout leave every one unwritten, and raise). Idempotent."""
        loading, self.loading = self.loading, []
        try:
            encoded = [
                (s.offloaded, encode_for(s.offloaded, s.offloaded.param.data))
                for s in loading
                if s.offloaded.layout is not None
            ]
            for offloaded, value in encoded:
                write_encoded(offloaded, value)
        finally:
            for streamed in loading:
                set_part(streamed.offloaded.param, streamed.offloaded.attr, streamed.slot_buffer)
            while self.held:  # copy the new values into the slots the layers held
                self.engine.load(*self.held[-1])
                self.held.pop()


def writable_host_storage(state_ref: weakref.ref, lock: threading.RLock) -> None:
    """[Note: mapped host storage] Before host storage is handed out (`state_dict`): if any of it is still a
    checkpoint file's pages, turn it into private memory (`OffloadState.private_host_storage`), under the model's
    `lock`. A no-op once done, and for a state that has ended."""
    state = state_ref()
    if state is None or not state.arena.file_bytes:
        return
    with _held(lock):
        state.private_host_storage()


def one_load_at_a_time(module: nn.Module, lock: threading.RLock) -> Callable[..., Any]:
    """A `load_state_dict` for the instance dict of a module above streamed parameters: the module's own (set on the
    instance before, else the class's) under the model's `lock`, so that the write-through (`WriteThrough`) never runs
    beside a forward, a reload or a re-dispatch in another thread, and whatever leaves the load (an error, a Ctrl-C)
    releases the lock."""
    inner = module.__dict__.get("load_state_dict")
    module_ref = weakref.ref(module)  # the module holds this function

    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        owner = module_ref()
        with _held(lock):
            if inner is not None:
                return inner(*args, **kwargs)
            return type(owner).load_state_dict(owner, *args, **kwargs)

    functools.update_wrapper(load_state_dict, inner if inner is not None else type(module).load_state_dict)
    return load_state_dict
