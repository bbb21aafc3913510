"""Executing a plan on a model: the steps `dispatch_model` and the loaders share.

`begin` hangs the state on the model; `attach` builds the buffer pool, the engine and the hooks for the plan and points
the offloaded parameters at their slots or mapped views. Undoing it is detach.py's. Every change goes through the
state's journal (journal.py), which removal, re-dispatch, failure and the collection of a deleted model replay.
This module knows plans and states; reading checkpoints is the loader's job, choosing plans the planner's.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
from accelerate.hooks import AlignDevicesHook
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config import warn_at_caller
from ..formats.bnb import (
    following_state,
    int8_modules,
    is_params4bit,
    plain_save,
    repacks_on_cpu,
)
from ..formats.parts import placeholder_of, with_inner
from ..host.arena import HostArena
from ..host.offloaded import OffloadedParam
from ..interrupts import deferred_interrupts
from ..planning.offload_plan import OffloadPlan, format_bytes, no_saving
from ..planning.pipeline import device_map
from ..planning.pipeline import ring_device as device_of_ring
from ..planning.placements import ParamSpec, Placement, RingPlan, Storage, host_layers, staged_nbytes
from ..runtime.devices import DeviceEngines, inputs_to
from ..runtime.engine import PrefetchEngine
from ..runtime.experts import add_lookups
from ..runtime.file_experts import attach_file_experts
from ..runtime.hooks import PrefetchHook, RoutedHook, around_torch_hooks
from ..runtime.host_experts import HostExperts
from ..runtime.ops import register_engine
from ..runtime.pool import BufferPool
from ..runtime.read_ahead import attach_reads
from ..runtime.ring import Decode, LayerTransfer, RingTransfers, RoutedTensor, byte_span
from .detach import collected
from .gate import ForwardGate, waits_then_refuses
from .guards import (
    CONVERSIONS,
    ancestors,
    refuse_apply,
    refuse_assign,
    refuse_deepcopy,
    refuse_file_writes,
    refuse_pickle,
    unless_nothing_changes,
)
from .in_place import WeightsInPlace
from .journal import Journal, Phase
from .state import FILES_READ_ONLY, STATE_ATTR, Lifecycle, OffloadState, model_lock
from .state_dict import (
    Streamed,
    WriteThrough,
    host_values_in_state_dict,
    one_load_at_a_time,
    refuse_unencodable,
    writable_host_storage,
)
from .third_party import route_through_in_place

__all__ = ["host_layout", "begin", "forwards_held", "attach"]

_warned_on_cpu = False


def host_layout(plan: OffloadPlan) -> list[tuple[str, ParamSpec]]:
    """The host arena's entries in order: (layer path, spec) for every offloaded parameter not read from files."""
    rings, file = plan.rings, Storage.FILE
    return [(ly.path, s) for r in rings for ly in r.layers for s in ly.offloaded if s.placement.storage is not file]


def keep_int8_scales(model: nn.Module, journal: Journal) -> None:
    """Before the host storage is filled: each 8-bit layer in one form, its values and scales named by its parameter
    only (`weight.data`, `weight.SCB`; `weight.CB` and its matmul state's `CB` and `SCB` emptied, where bitsandbytes
    keeps them before and after a first forward), so that no other name keeps alive the storage the dispatch
    replaces. A rollback rebuilds the form it had from the parameter: the undo holds no tensor (formats/bnb.py)."""
    for path, module in int8_modules(model):
        weight, state = module.weight, module.state
        ran = weight.SCB is None and state.SCB is not None  # its first forward moved them into its state
        if weight.SCB is None and not ran:
            continue  # no scales anywhere: not quantized, refused at planning if it streams

        with deferred_interrupts():
            if ran:
                weight.SCB = state.SCB
            weight.CB = state.CB = state.SCB = None
            what = f"{path}: values and scales named by its parameter only"
            journal.record(Phase.PLACE, what, partial(_int8_as_given, weakref.ref(module), ran))


def _int8_as_given(ref: weakref.ref, ran: bool) -> None:
    # Undo of keep_int8_scales, from the parameter (its values back where they were): as bitsandbytes left the layer.
    if (layer := ref()) is not None and ran:
        layer.state.CB, layer.state.SCB, layer.weight.SCB = layer.weight.data, layer.weight.SCB, None
    elif layer is not None:
        layer.weight.CB = layer.weight.data


@contextlib.contextmanager
def forwards_held(model: nn.Module, *plans: OffloadPlan) -> Iterator[Callable[[], None]]:
    """For the caller replacing a model's dispatch under its lock, from the old forward gate's removal to the new one's
    arrival (`begin`): the model and the parts the gates of `plans` cover have no gate then, and a call another thread
    starts meets this pre-hook instead, which waits for the lock and refuses (`gate.waits_then_refuses`). Yields
    `release`, which removes the hooks (idempotent): pass it to `begin`, which calls it as the new gate arrives, with
    interrupts held back, so that no Ctrl-C lands between the two (a hook left on a module would refuse every later
    call); the block's end calls it for the paths that never reach `begin`."""
    hook, handles = waits_then_refuses(model_lock(model), threading.get_ident()), []
    parts = {id(part): part for plan in plans for part, _ in _gated_parts(model, plan)}

    def release() -> None:
        with deferred_interrupts():
            while handles:
                handles[-1].remove()
                handles.pop()

    try:
        with deferred_interrupts():  # inside the `try`: an interrupt held back is raised as the block ends
            for module in [model, *parts.values()]:
                handles.append(module.register_forward_pre_hook(hook, prepend=True))
        yield release
    finally:
        release()


def begin(
    model: nn.Module,
    plan: OffloadPlan,
    device: torch.device,
    arena: HostArena,
    timing: bool,
    journal: Journal | None = None,
    held: Sequence[Callable[[], None]] = (),
) -> OffloadState:
    """The first change of every dispatch: the model gets its state (lifecycle ATTACHING), so that from here on an
    interrupt leaves something `remove_offload` can finish. `journal`: changes made before (the loader's casts).
    `held`: the `release` of each `forwards_held` the new gate ends."""
    state = OffloadState(plan, device, arena, journal if journal is not None else Journal(), timing=timing)
    state.gate = gate = ForwardGate(state, model_lock(model))
    # The state arrives with its forward gate and leaves with it (`_end`), after everything else was undone: from the
    # first change of a dispatch to the last step of its removal, a forward on the half-done model refuses to run.
    with deferred_interrupts():
        model.__dict__[STATE_ATTR] = state
        # A deleted model is freed by reference counting, dispatched or half-way: its journal is replayed then, which
        # detaches the hooks (an accelerate hook is a reference cycle through its module) and unpins the host
        # storage. See [Note: the journal] in journal.py.
        state.finalizer = weakref.finalize(model, collected, state)
        # A streamed layer's call waits before its torch hooks and releases after them (`around_torch_hooks`).
        streamed = {id(model.get_submodule(layer.path)) for ring in plan.rings for layer in ring.streamed}
        # `_compiled_call_impl`: what `model.compile()` before the dispatch made of the class's `_call_impl`, which
        # torch then calls instead.
        for module, names in [(model, ["_call_impl", "forward"]), *_gated_parts(model, plan)]:
            if getattr(module, "_compiled_call_impl", None) is not None:  # `module.compile()` before the dispatch
                names = [*names, "_compiled_call_impl"]
            part_of = model if module is not model else None
            for name in names:
                where = "the model" if part_of is None else type(module).__name__
                around = around_torch_hooks if id(module) in streamed else None
                guarded = gate.guard(module, name, part_of, around)
                state.gate_hooks.set_attribute(module, name, guarded, f"gate of {where} ({name})")
        for release in held:  # the gate takes over from the hooks that held forwards back
            release()
    return state


def _gated_parts(model: nn.Module, plan: OffloadPlan) -> list[tuple[nn.Module, list[str]]]:
    # The parts of the model a caller may call on their own that run streamed layers, with the attributes their gate
    # wraps: the modules holding each ring's layer list (the decoder, an encoder; the list too where it has a forward,
    # which a ModuleList has not), and the streamed layers. Gated like the model, so that `model.model(ids)` computes
    # under the same lock and file checks as `model(ids)`.
    holders = set()
    for ring in plan.rings:
        segments = ring.path.split(".") if ring.path else []
        holders |= {".".join(segments[:end]) for end in range(1, len(segments) + 1)}
    holders = [p for p in sorted(holders) if type(model.get_submodule(p)).forward is not nn.Module.forward]
    layers = [layer.path for ring in plan.rings for layer in ring.streamed if layer.path not in holders]
    parts = [(model.get_submodule(path), ["_call_impl", "forward"]) for path in holders]
    # Not a layer's `forward`: accelerate's hook replaces it on the instance and puts back what it found.
    return parts + [(model.get_submodule(path), ["_call_impl"]) for path in dict.fromkeys(layers)]


def attach(model: nn.Module, state: OffloadState) -> None:
    """Second half of a dispatch: `state.offloaded` hold their values in host storage; place the rest, point the
    offloaded parameters at their slots (or mapped views), hook the layers. Also used by the loader."""
    for path, module in int8_modules(model):  # named by the parameter only (keep_int8_scales, prepare_prequantized)
        state.journal.set_attribute(module, "state", following_state(module), f"matmul state of {path}")
    if state.plan.backend == "uva":
        _attach_uva(model, state)
    else:
        _attach_prefetch(model, state)
    journal, device = state.journal, state.device
    # accelerate's `hf_device_map` under pipeline placement only, where transformers needs it (a pipeline's inputs go
    # to the first GPU, generate's caches to each layer's). On one device `model.device` says it all, and a map would
    # make transformers' `pipeline(..., device=...)` refuse the model and `save_pretrained` warn of offloaded modules.
    if state.plan.gpus:
        mapping = device_map(state.plan, model, device.index if device.type == "cuda" else "cpu")
        mapping = mapping if device.type == "cuda" else dict.fromkeys(mapping, "cpu")
        journal.set_attribute(model, "hf_device_map", mapping, "device map")
    if getattr(model, "hf_device_map", None) is not None:
        _encoder_outputs_on_input_device(model, journal)
    if state.engine is not None:
        state.engine.start()
    state.lifecycle = Lifecycle.ATTACHED
    if (unsaved := no_saving(state.plan)) is not None:
        warn_at_caller(f"This dispatch saves no device memory: {unsaved}")


def _encoder_outputs_on_input_device(model: nn.Module, journal: Journal) -> None:
    # transformers' `generate` gives the encoder of a model with `hf_device_map` a hook that returns its outputs on its
    # inputs' device: set here, through the journal, it leaves with the dispatch (added by `generate`, it would stay).
    get_encoder = getattr(model, "get_encoder", None)
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False) or not callable(get_encoder):
        return
    encoder = get_encoder()
    if isinstance(encoder, nn.Module) and encoder is not model and not hasattr(encoder, "_hf_hook"):
        journal.hook(encoder, AlignDevicesHook(io_same_device=True), "encoder outputs on the inputs' device")


def _attach_prefetch(model: nn.Module, state: OffloadState) -> None:
    journal, device, plan = state.journal, state.device, state.plan
    by_name = {o.full_name: o for o in state.offloaded}
    ring_devices = [device_of_ring(ring, device) for ring in plan.rings]
    skip = {id(o.param) for o in state.offloaded}
    # Pipeline placement: each run of layers onto its GPU first, then everything else onto the execution device.
    for ring, ring_device in zip(plan.rings, ring_devices, strict=True):
        if ring_device != device:
            for layer in ring.layers:
                module = model.get_submodule(layer.path)
                journal.move_tensors(module, ring_device, skip=skip)
                skip |= {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    journal.move_tensors(model, device, skip=skip)
    if device.type == "cpu":  # 4-bit layers keep bitsandbytes' portable kernels, tensors in place (formats/bnb.py)
        for path, module in model.named_modules():
            if repacks_on_cpu(module):
                journal.set_attribute(module, "support_avx512bf16_for_cpu", False, f"CPU kernels of {path}")
    routes = {}  # device -> where its routed rows are gathered from (mapped only where a ring routes)
    # Routing needs the arena mapped on CUDA (pinned); without it no forward routes and a cache would stay unused.
    routable = device.type != "cuda" or state.arena.pinned
    rings: list[RingTransfers] = []
    hosted = {id(layer) for layer in host_layers(plan.rings)}  # PrefetchConfig.cpu_experts's layers
    for ring, ring_device in zip(plan.rings, ring_devices, strict=True):
        specs = [spec.key for layer in ring.streamed for spec in layer.offloaded]
        staging_key = _staging_key(ring)
        pool = BufferPool(specs + [staging_key] * (staging_key is not None), ring.num_slots, ring_device)
        transfers = []
        for layer in ring.streamed:
            host, slots, routed, decodes = [], [], [], []
            staged_at = 0  # where the next compressed parameter's bytes go in the slot's staging buffer
            subclassed: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]] = {}  # their inner slot buffers
            for spec in layer.offloaded:
                offloaded = by_name[f"{layer.path}.{spec.name}"]
                slot_buffer = pool.buffer(spec.key, layer.slot)
                where = f"{offloaded.full_name} to slot {layer.slot}"
                if offloaded.host.is_meta and offloaded.param.is_meta:  # READ_ROUTED: [Note: experts read from files]
                    journal.swap(offloaded.param, placeholder_of(offloaded.param), f"{where}: a placeholder")
                if offloaded.inner is None or not is_traceable_wrapper_subclass(offloaded.param):
                    journal.point(Phase.ATTACH, offloaded.param, slot_buffer, where, offloaded.attr)
                else:  # a tensor subclass is rebuilt around all its inner slot buffers at once, below
                    subclassed.setdefault(id(offloaded.param), (offloaded.param, {}))[1][offloaded.inner] = slot_buffer
                if spec.placement in (Placement.ROUTED, Placement.READ_ROUTED):
                    if ring_device not in routes:  # no forward routes (routed_max_tokens=0): never read
                        routes[ring_device] = _routed_sources(state, ring_device, plan.routed_max_tokens > 0)
                    read = spec.placement is Placement.READ_ROUTED  # gathered from the host expert cache instead
                    source = offloaded.host if read else routes[ring_device](offloaded.host)
                    routed.append(RoutedTensor(offloaded.host, source, slot_buffer, spec.routing.num_experts))
                elif offloaded.layout is not None:  # [Note: compressed streaming] in runtime/decodes.py
                    staging = pool.buffer(staging_key, layer.slot)
                    staged = staging[staged_at : staged_at + offloaded.layout.nbytes]
                    staged_at += staged_nbytes(offloaded.layout)
                    host.append(offloaded.host)
                    slots.append(staged)
                    decodes.append(Decode(offloaded.full_name, staged, slot_buffer.view(-1), offloaded.layout))
                else:
                    host.append(offloaded.host)
                    slots.append(slot_buffer)
            for param, inner in subclassed.values():
                _point_subclass(journal, param, inner, f"{layer.path}: a tensor subclass to slot {layer.slot}")
            nbytes = layer.host_bytes - sum(spec.nbytes for spec in layer.routed)
            transfer = LayerTransfer(host, slots, layer.slot, layer.next_in_slot, nbytes, routed, decodes)
            if not decodes:  # a compressed layer's staged bytes are copied one by one (engine.store tells them apart)
                transfer.span = byte_span(slots, host)
            if (compute := plan.host_compute) is not None and id(layer) in hosted:
                transfer.host_share, transfer.host_always = compute.share, compute.always
            if routable and routed and all(r.device_rows.dim() == 2 for r in routed) and not transfer.host_always:
                add_lookups(transfer, layer, plan, ring_device)
            transfers.append(transfer)
        state.reads += attach_reads(transfers, ring, state.file_extents, ring_device)  # layers read from files
        state.reads += attach_file_experts(transfers, ring, state.file_extents, ring_device)  # experts, as picked
        rings.append(RingTransfers(transfers, pool))
    engine = state.engine = _engines(state, rings, ring_devices)
    engine_id = register_engine(engine)
    if plan.gpus:
        _align_devices(model, state, ring_devices)
    for ring_index, ring in enumerate(plan.rings):
        for position, layer in enumerate(ring.streamed):
            hook = PrefetchHook(engine, engine_id, ring_index, position, layer.path)
            journal.hook(model.get_submodule(layer.path), hook, f"hook on {layer.path}")
            computes = rings[ring_index].layers[position].host_share > 0
            for routing in dict.fromkeys(spec.routing for spec in layer.routed):
                path = f"{layer.path}.{routing.module}"
                module, host = model.get_submodule(path), None
                if computes:  # its twin on host storage: [Note: experts on the host] in runtime/host_experts.py
                    stored = {name: by_name[f"{path}.{name}"].host for name, _ in module.named_parameters()}
                    host = HostExperts(module, stored, plan.host_compute, routing, ring_devices[ring_index])
                hook = RoutedHook(engine, engine_id, ring_index, position, path, routing.index_arg, host)
                journal.hook(module, hook, f"routed-experts hook on {path}")
    state.write_throughs = _write_through_load_state_dict(model, state)
    refuse_file_writes(model, state.refused_loads(), FILES_READ_ONLY.format(layers=state.read_layers()), journal)
    _report_host_values(model, state)
    _guard_moves(model, state)
    route_through_in_place(model, state)  # PEFT's merges, diffusers' fusions: in weights_in_place


def _engines(state: OffloadState, rings: list[RingTransfers], ring_devices: list[torch.device]):
    # One engine, or with pipeline placement one per GPU behind `DeviceEngines`.
    def engine(device: torch.device, its_rings: list[RingTransfers]) -> PrefetchEngine:
        return PrefetchEngine(
            device,
            its_rings,
            pinned=state.arena.pinned,
            timing=state.timing,
            routed_max_tokens=state.plan.routed_max_tokens,
            links=[torch.device("cuda", index) for index in state.plan.links[1:]],
        )

    if not state.plan.gpus:
        return engine(state.device, rings)
    # One engine per GPU of the plan (on the CPU, one per GPU entry all the same), in plan order.
    groups = list(dict.fromkeys(ring.device for ring in state.plan.rings))
    ring_of = [(groups.index(ring.device), 0) for ring in state.plan.rings]
    members: list[list[RingTransfers]] = [[] for _ in groups]
    for r, (group, _) in enumerate(ring_of):
        ring_of[r] = (group, len(members[group]))
        members[group].append(rings[r])
    devices = [ring_devices[[g for g, _ in ring_of].index(group)] for group in range(len(groups))]
    return DeviceEngines([engine(d, m) for d, m in zip(devices, members, strict=True)], ring_of)


def _align_devices(model: nn.Module, state: OffloadState, ring_devices: list[torch.device]) -> None:
    # Pipeline placement: a layer on another GPU receives its inputs there (hidden states, and what the model passes
    # every layer: position embeddings, masks); a module outside the layer list that holds weights receives its inputs
    # on the execution device (the final norm reads the last GPU's hidden states). As accelerate's hooks move them.
    in_rings = set()
    for ring, ring_device in zip(state.plan.rings, ring_devices, strict=True):
        for layer in ring.layers:
            in_rings.add(layer.path)
            if ring_device != state.device:
                hook = partial(inputs_to, ring_device)
                register = partial(model.get_submodule(layer.path).register_forward_pre_hook, hook, with_kwargs=True)
                state.journal.handle(register, f"inputs of {layer.path} to {ring_device}")
    for path, module in model.named_modules():
        inside = any(path == p or path.startswith(p + ".") for p in in_rings)
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if path and owns and not inside:
            register = partial(module.register_forward_pre_hook, partial(inputs_to, state.device), with_kwargs=True)
            state.journal.handle(register, f"inputs of {path} to {state.device}")


def _point_subclass(journal: Journal, param: nn.Parameter, inner: dict[str, torch.Tensor], what: str) -> None:
    # A tensor subclass (torchao) made of its inner tensors' slot buffers, on their device, takes the parameter's
    # place (the kernels read the inner tensors; the subclass's device follows them). See "Parameters stored as
    # several tensors" in docs/design.md.
    journal.point(Phase.ATTACH, param, with_inner(param, inner), what)


def _staging_key(ring: RingPlan):
    # The pool key of the ring's staging buffers (one per slot, for its largest compressed layer), or None.
    return ("[staging]", (ring.staging_bytes,), (1,), torch.uint8) if ring.staging_bytes else None


def _routed_sources(state: OffloadState, device: torch.device, routes: bool):
    # What routed rows are gathered from: on CUDA the arena's mapped (UVA) view, read by the GPU; else host memory.
    if not routes or device.type != "cuda" or not state.arena.pinned:
        return lambda host: host
    with torch.cuda.device(device):
        mapped = state.arena.map(device)
    return lambda host: state.arena.mapped_like(host, mapped)


def _report_host_values(model: nn.Module, state: OffloadState) -> None:
    # A `state_dict()` hook on each module that owns a streamed parameter, so that the module's own `state_dict()`
    # (and every module's above it) reports the host value, not the slot (which holds whichever layer ran last).
    owned: dict[str, dict[str, list[OffloadedParam]]] = {}  # module path -> parameter name -> its tensors
    writable = partial(writable_host_storage, weakref.ref(state), model_lock(model))
    for offloaded in state.offloaded:
        module_path, _, name = offloaded.param_name.rpartition(".")
        owned.setdefault(module_path, {}).setdefault(name, []).append(offloaded)
    for module_path, hosts in owned.items():
        module, hook = model.get_submodule(module_path), partial(host_values_in_state_dict, hosts, writable)
        if any(is_params4bit(tensors[0].param) for tensors in hosts.values()):
            state.journal.set_attribute(module, "_save_to_state_dict", plain_save(module), f"save of {module_path}")
        state.journal.handle(partial(module._register_state_dict_hook, hook), f"state_dict of {module_path}")


def _attach_uva(model: nn.Module, state: OffloadState) -> None:
    # [Note: UVA lifetime] in host/arena.py: each offloaded parameter becomes a device view of its pinned host storage.
    journal = state.journal
    if state.device.type == "cpu":
        _warn_uva_on_cpu(state.plan)
    else:
        mapped = state.arena.map(state.device)
        for index, offloaded in enumerate(state.offloaded):
            host = offloaded.host
            view = state.arena.view(index, host.shape, host.stride(), host.dtype, base=mapped)
            journal.point(Phase.ATTACH, offloaded.param, view, f"{offloaded.full_name} mapped", offloaded.attr)
        _guard_moves(model, state)
    journal.move_tensors(model, state.device, skip=set())  # the views are on the device already


def _guard_moves(model: nn.Module, state: OffloadState) -> None:
    # `.to()`, `.half()` ... that would change a tensor (`refuse_apply`), `copy.deepcopy` and pickling are refused on
    # every module that owns or contains an offloaded parameter: a copy of `model.model` would hold whatever the slots
    # held, and hooks that copy into buffers it no longer points at.
    paths = {""}
    for offloaded in state.offloaded:
        parts = offloaded.full_name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for path in sorted(paths):
        module, where = model.get_submodule(path), path or "model"
        state.journal.set_attribute(module, "_apply", refuse_apply, f"guard on {where}")
        for name in CONVERSIONS:  # a conversion that would change nothing returns the module
            convert = unless_nothing_changes(module, name)
            state.journal.set_attribute(module, name, convert, f"no-op .{name}() of {where}")
        state.journal.set_attribute(module, "__deepcopy__", refuse_deepcopy, f"deepcopy refused on {where}")
        state.journal.set_attribute(module, "__reduce_ex__", refuse_pickle, f"pickling refused on {where}")


def _write_through_load_state_dict(model: nn.Module, state: OffloadState) -> list[WriteThrough]:
    journal = state.journal
    under: dict[str, list[str]] = {}  # module path -> the streamed parameters under it, by their names in it
    for param_name in dict.fromkeys(o.param_name for o in state.offloaded):
        for path, name in ancestors(param_name):
            under.setdefault(path, []).append(name)
    lock = model_lock(model)
    for path, names in under.items():
        module, where = model.get_submodule(path), path or "model"
        refuse = partial(refuse_assign, names)
        register = partial(module._register_load_state_dict_pre_hook, refuse, with_module=True)
        journal.handle(register, f"assign refused on {where}")
        # A load that starts here writes host storage: under the model's lock, as the verbs that rewrite weights do.
        one_load = one_load_at_a_time(module, lock)
        journal.set_attribute(module, "load_state_dict", one_load, f"one load at a time on {where}")
    compressed: dict[str, dict[str, OffloadedParam]] = {}  # module path -> compressed parameters under it, by name
    for offloaded in state.offloaded:
        if offloaded.layout is not None:
            for path, name in ancestors(offloaded.full_name):
                compressed.setdefault(path, {})[name] = offloaded
    for path, params in compressed.items():
        refuse = partial(refuse_unencodable, params)
        register = partial(model.get_submodule(path)._register_load_state_dict_pre_hook, refuse, with_module=True)
        journal.handle(register, f"values checked against their layouts on {path or 'model'}")

    by_name = {o.full_name: o for o in state.offloaded}
    owned: dict[nn.Module, list[Streamed]] = {}
    for ring_index, (ring, transfers) in enumerate(zip(state.plan.rings, state.engine.rings, strict=True)):
        for position, layer in enumerate(ring.streamed):
            for spec in layer.offloaded:
                slot_buffer = transfers.pool.buffer(spec.key, layer.slot)
                offloaded = by_name[f"{layer.path}.{spec.name}"]
                module_path, _, name = offloaded.param_name.rpartition(".")
                streamed = Streamed(name, offloaded, slot_buffer, ring_index, position)
                owned.setdefault(model.get_submodule(module_path), []).append(streamed)
    state.in_place = in_place = WeightsInPlace(model, state, lock, owned)
    write_throughs = []
    for module, streamed in owned.items():
        private = partial(_private_host_storage, weakref.ref(state))
        write_through = WriteThrough(state.engine, private, streamed, in_place)
        register = partial(module._register_load_state_dict_pre_hook, write_through.before, with_module=True)
        journal.handle(register, "write")
        journal.handle(partial(module.register_load_state_dict_post_hook, write_through.after), "write-through done")
        write_throughs.append(write_through)
    return write_throughs


def _private_host_storage(state_ref: weakref.ref) -> None:
    # The state's write-throughs hold this, not the state: no reference cycle keeps a deleted model alive.
    if (state := state_ref()) is not None:
        state.private_host_storage()


def _warn_uva_on_cpu(plan: OffloadPlan) -> None:
    global _warned_on_cpu
    if not _warned_on_cpu:
        _warned_on_cpu = True
        warn_at_caller(
            f"The UVA backend on the CPU keeps every weight where it is: host memory is the execution device's memory "
            f"(on a GPU, {format_bytes(plan.offloaded_bytes)} would stay in host memory). The model is dispatched "
            "(get_state and remove_offload work) but unchanged."
        )
