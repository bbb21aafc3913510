"""Wiring: `dispatch_model` executes a plan on a model, `remove_offload` undoes it.

Plan, then execute: the plan says where every parameter goes (`placements.py`); `attach` builds the buffer pool, the
engine and the hooks for it, making every change to the model through the state's journal (`changes.py`), which
removal, re-dispatch, failure and the collection of a deleted model replay. The loader fills host storage from the
checkpoint instead of from the parameters, then calls the same `attach`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .budget import choose_plan, device_argument, parse_max_memory
from .changes import Journal, Phase, deferred_interrupts, move_tensors
from .config import PrefetchConfig, warn_at_caller
from .engine import PrefetchEngine
from .hooks import (
    ForwardGate,
    PrefetchHook,
    Streamed,
    WriteThrough,
    host_values_in_state_dict,
    refuse_apply,
    refuse_assign,
)
from .host import HostArena
from .offload_config import OffloadConfig, UVAConfig, resolve_offload
from .ops import register_engine
from .placements import OffloadPlan, ParamSpec
from .planner import make_uva_plan
from .pool import BufferPool
from .render import format_bytes
from .ring import LayerTransfer, RingTransfers
from .state import (
    STATE_ATTR,
    Lifecycle,
    OffloadedParam,
    OffloadState,
    get_state,
    refuse_deepcopy,
    refuse_pickle,
    refuse_unknown_keywords,
    resolve_device,
)

__all__ = ["dispatch_model", "remove_offload", "attach", "begin", "rollback", "host_layout"]

_warned_on_cpu = False


def dispatch_model(
    model: nn.Module,
    offload: str | PrefetchConfig | UVAConfig | OffloadConfig = "prefetch",
    *,
    device: str | int | torch.device | None = None,
    layers: str | Sequence[str] | None = None,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    timing: bool = False,
    replace: bool = False,
    **unknown: Any,
) -> nn.Module:
    """Stream the selected layers' weights from pinned host memory into a static device buffer pool.

    The model keeps working as before (`forward`, `generate()`, `model.device`); streamed parameters point at pool
    slots for good, and a hook on each streamed layer overlaps copying upcoming layers with computing this one.

    Args:
        model (`nn.Module`): A built model (on CPU or GPU) with a layer list, e.g. a transformers model.
        offload (config or `str`): A `PrefetchConfig` (which layers stream), a `UVAConfig` (which parameters the
            kernels read in place from host memory) or an `OffloadConfig`; `"prefetch"` is `PrefetchConfig()`.
        device: Execution device. Defaults to the current CUDA device, or `"cpu"` without CUDA (copies are then
            synchronous, everything else is the same).
        layers (`str` or list of `str`, *optional*): Path(s) of the layer list(s), e.g. `"model.layers"`. Found
            from `_no_split_modules` when omitted.
        max_memory (`dict` or `"auto"`, *optional*): A memory budget in accelerate's format, e.g.
            `{0: "10GiB", "cpu": "64GiB"}`: the layers to stream are then chosen so that resident weights, the buffer
            pool and `reserve_bytes` fit the GPU's entry with the fewest bytes streamed per forward, strided over the
            layer list, and the pinned bytes fit `"cpu"`. `"auto"` (or a GPU entry `"auto"`) is the device's free
            memory. Replaces the config's `group_size` and `num_in_group`. `hf_prefetch.plan` shows the plan first.
        reserve_bytes (`int` or `str`, *optional*): Device memory kept free for activations and the KV cache with
            `max_memory`; defaults to 1 GiB (`hf_prefetch.budget.DEFAULT_RESERVE_BYTES`).
        timing (`bool`): Measure copy and stall seconds per layer with CUDA events (see `hf_prefetch.stats`).
        replace (`bool`): Re-dispatch a dispatched model with a new configuration, without reloading it.

    A dispatched model refuses `.to()`, `.cuda()`, `.half()` and other conversions, `copy.deepcopy` and pickling: call
    `remove_offload` first. It is for inference: streamed parameters have `requires_grad=False` and a backward through
    a streamed layer raises. Forwards from several threads run one at a time.

    Returns:
        The same model, dispatched.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64)).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> expected = model(ids).logits
    >>> config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
    >>> model = hf_prefetch.dispatch_model(model, config, device="cpu")
    >>> torch.equal(model(ids).logits, expected)
    True
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    refuse_unknown_keywords("dispatch_model", unknown)
    config = resolve_offload(offload)
    uva = isinstance(config, UVAConfig)
    if uva and (timing or max_memory is not None or reserve_bytes is not None):
        raise ValueError("timing, max_memory and reserve_bytes work with the prefetch backend only, not with UVA.")
    max_memory = None if uva else parse_max_memory(max_memory, reserve_bytes, config)
    exec_device = resolve_device(device_argument(max_memory, device))
    state = get_state(model)
    if state is not None and state.lifecycle is not Lifecycle.ATTACHED:
        _finish_interrupted(model, state)  # an interrupted dispatch or removal: complete it first
        state = None
    if state is not None and not replace:
        raise ValueError(
            f"{type(model).__name__} is already dispatched with {state.plan.config}. Call "
            "hf_prefetch.remove_offload(model) first, or pass replace=True to re-dispatch with the new config."
        )
    _check_materialized(model)
    # Validated before the old dispatch is undone.
    plan = make_uva_plan(model, config, layers) if uva else choose_plan(model, config, layers, exec_device, max_memory)
    if state is not None:
        detach(model, state, target=None)
    # UVA on the CPU leaves every weight where it is: host memory is the device's memory.
    layout = [] if uva and exec_device.type == "cpu" else host_layout(plan)
    # Host memory the arena takes back as it fills: each offloaded parameter's original storage, if on the CPU.
    on_host = sum(
        spec.nbytes for path, spec in layout if model.get_parameter(f"{path}.{spec.name}").device.type == "cpu"
    )
    arena = HostArena([spec.nbytes for _, spec in layout], freed_bytes=on_host)
    state = begin(model, plan, exec_device, arena, timing)
    try:
        for index, (layer_path, spec) in enumerate(layout):
            name = f"{layer_path}.{spec.name}"
            param = model.get_parameter(name)
            host = arena.view(index, spec.shape, spec.stride, spec.dtype)
            host.copy_(param.data)
            # Drop the original storage now, so a model that starts on the GPU frees it before the pool exists.
            state.journal.place(param, host, f"{name} into host storage")
            state.offloaded.append(OffloadedParam(name, param, host))
        if exec_device.type == "cuda":
            with torch.cuda.device(exec_device):  # registered memory belongs to the current device (UVA views)
                arena.pin()
        attach(model, state)
    except BaseException:
        rollback(model, state)
        raise
    return model


def host_layout(plan: OffloadPlan) -> list[tuple[str, ParamSpec]]:
    """The host arena's entries in order: (layer path, spec) for every offloaded parameter."""
    return [(layer.path, spec) for ring in plan.rings for layer in ring.layers for spec in layer.offloaded]


def begin(
    model: nn.Module,
    plan: OffloadPlan,
    device: torch.device,
    arena: HostArena,
    timing: bool,
    journal: Journal | None = None,
) -> OffloadState:
    """The first change of every dispatch: the model gets its state (lifecycle ATTACHING), so that from here on an
    interrupt leaves something `remove_offload` can finish. `journal`: changes made before (the loader's casts)."""
    state = OffloadState(plan, device, arena, journal if journal is not None else Journal(), timing=timing)
    gate, hooks = ForwardGate(state), state.gate_hooks
    # The state arrives with its forward gate and leaves with it (`_end`), after everything else was undone: from the
    # first change of a dispatch to the last step of its removal, a forward on the half-done model refuses to run.
    with deferred_interrupts():
        model.__dict__[STATE_ATTR] = state
        # A deleted model is freed by reference counting, dispatched or half-way: its journal is replayed then, which
        # detaches the hooks (an accelerate hook is a reference cycle through its module) and unpins the host
        # storage. See [Note: the journal].
        state.finalizer = weakref.finalize(model, _collected, state)
        hooks.handle(partial(model.register_forward_pre_hook, gate.before), "forward gate (before)")
        hooks.handle(partial(model.register_forward_hook, gate.after, always_call=True), "forward gate (after)")
        hooks.set_attribute(model, "forward", gate.guard(model), "forward gate (interrupts)")
    return state


def attach(model: nn.Module, state: OffloadState) -> None:
    """Second half of a dispatch: `state.offloaded` hold their values in host storage; place the rest, point the
    offloaded parameters at their slots (or mapped views), hook the layers. Also used by the loader."""
    if state.plan.backend == "uva":
        _attach_uva(model, state)
    else:
        _attach_prefetch(model, state)
    journal, device = state.journal, state.device
    journal.set_attribute(model, "hf_device_map", {"": device.index if device.type == "cuda" else "cpu"}, "device map")
    if state.engine is not None:
        state.engine.start()
    state.lifecycle = Lifecycle.ATTACHED
    if not state.plan.saves_device_memory and state.plan.offloaded_bytes:
        warn_at_caller(
            f"This dispatch saves no device memory: its buffer pool ({format_bytes(state.plan.pool_bytes)}) is as "
            f"large as what it offloads ({format_bytes(state.plan.offloaded_bytes)}). Stream more layers than "
            "prefetch_step (or lower prefetch_step), or do not offload."
        )


def _attach_prefetch(model: nn.Module, state: OffloadState) -> None:
    journal, device, plan = state.journal, state.device, state.plan
    by_name = {o.full_name: o for o in state.offloaded}
    journal.move_tensors(model, device, skip={id(o.param) for o in state.offloaded})
    rings: list[RingTransfers] = []
    for ring in plan.rings:
        specs = [spec.key for layer in ring.streamed for spec in layer.offloaded]
        pool = BufferPool(specs, ring.num_slots, device)
        transfers = []
        for layer in ring.streamed:
            host, slots = [], []
            for spec in layer.offloaded:
                offloaded = by_name[f"{layer.path}.{spec.name}"]
                slot_buffer = pool.buffer(spec.key, layer.slot)
                journal.point(
                    Phase.ATTACH, offloaded.param, slot_buffer, f"{offloaded.full_name} to slot {layer.slot}"
                )
                journal.freeze(offloaded.param, f"{offloaded.full_name} frozen")
                host.append(offloaded.host)
                slots.append(slot_buffer)
            transfers.append(LayerTransfer(host, slots, layer.slot, layer.next_in_slot, layer.offloaded_bytes))
        rings.append(RingTransfers(transfers, pool))
    engine = state.engine = PrefetchEngine(device, rings, pinned=state.arena.pinned, timing=state.timing)
    engine_id = register_engine(engine)
    for ring_index, ring in enumerate(plan.rings):
        for position, layer in enumerate(ring.streamed):
            hook = PrefetchHook(engine, engine_id, ring_index, position, layer.path)
            journal.hook(model.get_submodule(layer.path), hook, f"hook on {layer.path}")
    state.write_throughs = _write_through_load_state_dict(model, state)
    _report_host_values(model, state)
    _guard_moves(model, state)


def _report_host_values(model: nn.Module, state: OffloadState) -> None:
    # A `state_dict()` hook on each module that owns a streamed parameter, so that the module's own `state_dict()`
    # (and every module's above it) reports the host value, not the slot (which holds whichever layer ran last).
    owned: dict[str, dict[str, torch.Tensor]] = {}
    for offloaded in state.offloaded:
        module_path, _, name = offloaded.full_name.rpartition(".")
        owned.setdefault(module_path, {})[name] = offloaded.host
    for module_path, hosts in owned.items():
        module, hook = model.get_submodule(module_path), partial(host_values_in_state_dict, hosts)
        state.journal.handle(partial(module._register_state_dict_hook, hook), f"state_dict of {module_path}")


def _attach_uva(model: nn.Module, state: OffloadState) -> None:
    # [Note: UVA lifetime] in host.py: each offloaded parameter becomes a device view of its pinned host storage.
    journal = state.journal
    if state.device.type == "cpu":
        _warn_uva_on_cpu(state.plan)
    else:
        mapped = state.arena.map(state.device)
        for index, offloaded in enumerate(state.offloaded):
            host = offloaded.host
            view = state.arena.view(index, host.shape, host.stride(), host.dtype, base=mapped)
            journal.point(Phase.ATTACH, offloaded.param, view, f"{offloaded.full_name} mapped")
        _guard_moves(model, state)
    journal.move_tensors(model, state.device, skip=set())  # the views are on the device already


def _guard_moves(model: nn.Module, state: OffloadState) -> None:
    # `.to()`, `.half()` ... (`refuse_apply`), `copy.deepcopy` and pickling are refused on every module that owns or
    # contains an offloaded parameter: a copy of `model.model` would hold whatever the slots held, and hooks that copy
    # into buffers it no longer points at.
    paths = {""}
    for offloaded in state.offloaded:
        parts = offloaded.full_name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for path in sorted(paths):
        module, where = model.get_submodule(path), path or "model"
        state.journal.set_attribute(module, "_apply", refuse_apply, f"guard on {where}")
        state.journal.set_attribute(module, "__deepcopy__", refuse_deepcopy, f"deepcopy refused on {where}")
        state.journal.set_attribute(module, "__reduce_ex__", refuse_pickle, f"pickling refused on {where}")


def _write_through_load_state_dict(model: nn.Module, state: OffloadState) -> list[WriteThrough]:
    journal = state.journal
    under: dict[str, list[str]] = {}  # module path -> the streamed parameters under it, by their names in it
    for offloaded in state.offloaded:
        parts = offloaded.full_name.split(".")
        for depth in range(len(parts)):
            under.setdefault(".".join(parts[:depth]), []).append(".".join(parts[depth:]))
    for path, names in under.items():
        refuse = partial(refuse_assign, names)
        register = partial(model.get_submodule(path)._register_load_state_dict_pre_hook, refuse, with_module=True)
        journal.handle(register, f"assign refused on {path or 'model'}")

    by_name = {o.full_name: o for o in state.offloaded}
    owned: dict[nn.Module, list[Streamed]] = {}
    for ring_index, (ring, transfers) in enumerate(zip(state.plan.rings, state.engine.rings, strict=True)):
        for position, (layer, transfer) in enumerate(zip(ring.streamed, transfers.layers, strict=True)):
            for spec, slot_buffer in zip(layer.offloaded, transfer.device, strict=True):
                full_name = f"{layer.path}.{spec.name}"
                module_path, _, name = full_name.rpartition(".")
                streamed = Streamed(name, by_name[full_name], slot_buffer, ring_index, position)
                owned.setdefault(model.get_submodule(module_path), []).append(streamed)
    write_throughs = []
    for module, streamed in owned.items():
        write_through = WriteThrough(state.engine, streamed)
        register = partial(module._register_load_state_dict_pre_hook, write_through.before, with_module=True)
        journal.handle(register, "write")
        journal.handle(partial(module.register_load_state_dict_post_hook, write_through.after), "write-through done")
        write_throughs.append(write_through)
    return write_throughs


def remove_offload(model: nn.Module, device: str | int | torch.device | None = None) -> nn.Module:
    """Undo `dispatch_model`: every weight back on one device, hooks removed, pool and pinned memory freed.

    Also finishes a dispatch or a removal that an interrupt (Ctrl-C) or an error stopped half-way.

    Args:
        model (`nn.Module`): A dispatched model.
        device (*optional*): Where the weights go; defaults to the execution device. Pass `"cpu"` to bring the
            whole model back to host memory (e.g. when it does not fit on the GPU).

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(prefetch_step=1), device="cpu")
    >>> model = hf_prefetch.remove_offload(model)
    >>> hf_prefetch.get_state(model) is None
    True

    ```
    """
    state = get_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not dispatched by hf_prefetch: nothing to remove.")
    if state.lifecycle in (Lifecycle.ATTACHING, Lifecycle.ROLLING_BACK):
        rollback(model, state)
        return model
    if state.lifecycle is Lifecycle.ATTACHED:
        state.target = state.device if device is None else resolve_device(device)
    detach(model, state, state.target)
    return model


def detach(model: nn.Module, state: OffloadState, target: torch.device | None) -> None:
    """Undo the ATTACH steps (the weights keep their values where they are), move everything to `target` (None: leave
    streamed weights in host memory, for a re-dispatch) and release the host storage. Resumable."""
    state.lifecycle, state.target = Lifecycle.DETACHING, target
    _quiesce(state)
    state.journal.unwind(Phase.ATTACH)
    state.engine = None  # drop the pool (hooks held the engine too): its memory is reused by the moves below
    if target is not None:
        move_tensors(model, target)
    _end(model, state)


def rollback(model: nn.Module, state: OffloadState) -> None:
    """Undo every step of a failed dispatch, back to the model as it was given. Resumable."""
    state.lifecycle = Lifecycle.ROLLING_BACK
    _quiesce(state)
    state.journal.unwind(Phase.PLACE)
    state.engine = None
    _end(model, state)


def _finish_interrupted(model: nn.Module, state: OffloadState) -> None:
    if state.lifecycle is Lifecycle.DETACHING:
        detach(model, state, state.target)
    else:
        rollback(model, state)


def _quiesce(state: OffloadState) -> None:
    # No copy may still read host storage about to be released, and (UVA) no kernel may still read host memory.
    if state.engine is not None:
        state.engine.synchronize()
    elif state.device.type == "cuda":
        torch.cuda.synchronize(state.device)


def _end(model: nn.Module, state: OffloadState) -> None:
    with deferred_interrupts():  # the state leaves with its forward gate and its finalizer (see `begin`)
        state.finalizer.detach()
        state.arena.release()
        state.offloaded = []
        state.gate_hooks.unwind(Phase.ATTACH)
        if model.__dict__.get(STATE_ATTR) is state:
            del model.__dict__[STATE_ATTR]


def _collected(state: OffloadState) -> None:
    # The model was deleted while dispatched, or half-way (see `begin`): nothing may read host storage once it is
    # released.
    if state.engine is not None:
        state.engine.synchronize()
    state.journal.unwind(Phase.ATTACH)
    state.arena.release()


def _check_materialized(model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device: the model has no weights yet. Load it with "
                "hf_prefetch.from_pretrained(path) or hf_prefetch.load_checkpoint_and_dispatch(model, path)."
            )


def _warn_uva_on_cpu(plan: OffloadPlan) -> None:
    global _warned_on_cpu
    if not _warned_on_cpu:
        _warned_on_cpu = True
        warn_at_caller(
            f"The UVA backend on the CPU keeps every weight where it is: host memory is the execution device's memory "
            f"(on a GPU, {format_bytes(plan.offloaded_bytes)} would stay in host memory). The model is dispatched "
            "(get_state and remove_offload work) but unchanged."
        )
