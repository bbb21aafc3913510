"""Wiring: `dispatch_model` executes an `OffloadPlan` (prefetch) or a `UVAPlan` on a model; `remove_offload` undoes it.

This is the only module that mutates the model: it moves weights into host storage and onto the device, points
streamed parameters at their pool slots (prefetch) or at device views of their host storage (UVA), and attaches and
detaches the hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from accelerate.hooks import SequentialHook, add_hook_to_module, remove_hook_from_module
from torch import nn

from .budget import choose_plan, device_argument, parse_max_memory
from .config import PrefetchConfig
from .engine import LayerTransfer, PrefetchEngine, RingTransfers
from .hooks import PrefetchHook, model_hooks
from .host import HostArena
from .offload_config import OffloadConfig, UVAConfig, resolve_offload
from .ops import register_engine
from .plan import OffloadPlan, ParamSpec
from .pool import BufferPool
from .uva import UVAPlan, make_uva_plan, warn_on_cpu

__all__ = ["dispatch_model", "remove_offload", "get_state", "OffloadState"]

_STATE_ATTR = "_hf_prefetch_state"
_MISSING = object()  # the model had no hf_device_map
_UNSET = object()  # attach() has not set hf_device_map


@dataclass
class OffloadedParam:
    """A streamed parameter: the `nn.Parameter` (pointing at its slot) and the host tensor that holds its value."""

    full_name: str
    param: nn.Parameter
    host: torch.Tensor
    requires_grad: bool


@dataclass
class OffloadState:
    """Everything `dispatch_model` set up on a model; `remove_offload` tears it down. UVA has no engine or hooks."""

    plan: OffloadPlan | UVAPlan
    device: torch.device
    arena: HostArena
    offloaded: list[OffloadedParam]
    engine: PrefetchEngine | None = None
    hooks: list[tuple[nn.Module, PrefetchHook]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    guarded: list[nn.Module] = field(default_factory=list)
    previous_device_map: Any = _UNSET
    timing: bool = False


def get_state(model: nn.Module) -> OffloadState | None:
    """The offload state of a dispatched model, or None."""
    return getattr(model, _STATE_ATTR, None)


def dispatch_model(
    model: nn.Module,
    offload: str | PrefetchConfig | UVAConfig | OffloadConfig = "prefetch",
    *,
    device: str | int | torch.device | None = None,
    config: PrefetchConfig | UVAConfig | None = None,
    layers: str | Sequence[str] | None = None,
    replace: bool = False,
    timing: bool = False,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    **config_fields: Any,
) -> nn.Module:
    """Stream the selected layers' weights from pinned host memory into a static device buffer pool.

    The model keeps working as before (`forward`, `generate()`, `model.device`); streamed parameters point at pool
    slots for good, and a hook on each streamed layer overlaps copying upcoming layers with computing this one.

    Args:
        model (`nn.Module`): A built model (on CPU or GPU) with a layer list, e.g. a transformers model.
        offload (`str` or config): `"prefetch"` or `"uva"` (configured by `config` or its fields as keywords), or a
            `PrefetchConfig`, `UVAConfig` or `OffloadConfig`. For UVA see `hf_prefetch.UVAConfig`.
        device: Execution device. Defaults to the current CUDA device, or `"cpu"` without CUDA (copies are then
            synchronous, everything else is the same).
        config (`PrefetchConfig` or `UVAConfig`, *optional*): The configuration; alternatively pass its fields.
        layers (`str` or list of `str`, *optional*): Path(s) of the layer list(s), e.g. `"model.layers"`. Found
            from `_no_split_modules` when omitted.
        replace (`bool`): Re-dispatch a dispatched model with a new configuration, without reloading it.
        timing (`bool`): Measure copy and stall seconds per layer with CUDA events (see `hf_prefetch.stats`).
        max_memory (`dict` or `"auto"`, *optional*): A memory budget in accelerate's format, e.g.
            `{0: "10GiB", "cpu": "64GiB"}`: the layers to stream are then chosen so that resident weights, the buffer
            pool and `reserve_bytes` fit the GPU's entry with the fewest bytes streamed per forward, strided over the
            layer list, and the pinned bytes fit `"cpu"`. `"auto"` (or a GPU entry `"auto"`) is the device's free
            memory. Replaces `group_size` and `num_in_group`. `hf_prefetch.plan` shows the plan without dispatching.
        reserve_bytes (`int` or `str`, *optional*): Device memory kept free for activations and the KV cache with
            `max_memory`; defaults to 1 GiB (`hf_prefetch.budget.DEFAULT_RESERVE_BYTES`).

    A dispatched model refuses `.to()`, `.cuda()`, `.half()` and other conversions: call `remove_offload` first,
    convert, and dispatch again. Streamed parameters are not trainable (`requires_grad=False` while dispatched).

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
    >>> model = hf_prefetch.dispatch_model(model, device="cpu", group_size=2, num_in_group=1, prefetch_step=1)
    >>> torch.equal(model(ids).logits, expected)
    True
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    config = resolve_offload(offload, config, config_fields)
    uva = isinstance(config, UVAConfig)
    if uva and (timing or max_memory is not None or reserve_bytes is not None):
        raise ValueError("timing, max_memory and reserve_bytes work with offload='prefetch' only, not with 'uva'.")
    max_memory = parse_max_memory(max_memory, reserve_bytes, config, config_fields)
    exec_device = resolve_device(device_argument(max_memory, device))
    state = get_state(model)
    if state is not None and not replace:
        raise ValueError(
            f"{type(model).__name__} is already dispatched with {state.plan.config}. Call "
            "hf_prefetch.remove_offload(model) first, or pass replace=True to re-dispatch with the new config."
        )
    _check_materialized(model)
    # Validated before the old dispatch is undone.
    plan = make_uva_plan(model, config, layers) if uva else choose_plan(model, config, layers, exec_device, max_memory)
    if state is not None:
        _teardown(model, state, target=None)
    # UVA on the CPU leaves every weight where it is: host memory is the device's memory.
    layout = [] if uva and exec_device.type == "cpu" else host_layout(plan)
    arena = HostArena([spec.nbytes for _, _, spec in layout])
    state = OffloadState(plan, exec_device, arena, offloaded=[], timing=timing)
    origin = {name: t.device for name, t in [*model.named_parameters(), *model.named_buffers()]}
    try:
        for index, (layer_path, _, spec) in enumerate(layout):
            param = model.get_parameter(f"{layer_path}.{spec.name}")
            host = arena.view(index, spec.shape, spec.stride, spec.dtype)
            host.copy_(param.data)
            # Drop the original storage now, so a model that starts on the GPU frees it before the pool exists.
            param.data = host
            state.offloaded.append(OffloadedParam(f"{layer_path}.{spec.name}", param, host, param.requires_grad))
        if exec_device.type == "cuda":
            with torch.cuda.device(exec_device):  # registered memory belongs to the current device (UVA views)
                arena.pin()
        if uva:
            _attach_uva(model, state)
        else:
            attach(model, state)
    except BaseException:
        _teardown(model, state, target=None)
        _restore_devices(model, origin)
        raise
    return model


def _restore_devices(model: nn.Module, origin: dict[str, torch.device]) -> None:
    # Roll a failed dispatch back to where every tensor was before it (rollback must not leave a model half-moved).
    for name, param in model.named_parameters():
        if name in origin and param.device != origin[name]:
            param.data = param.data.to(origin[name])
    for name, buffer in model.named_buffers():
        if name in origin and buffer.device != origin[name]:
            module_path, _, leaf = name.rpartition(".")
            model.get_submodule(module_path)._buffers[leaf] = buffer.to(origin[name])


def host_layout(plan: OffloadPlan | UVAPlan) -> list[tuple[str, int, ParamSpec]]:
    """The host arena's entries in order: (layer path, ring index, spec) for every offloaded parameter."""
    return [
        (layer.path, ring_index, spec)
        for ring_index, ring in enumerate(plan.rings)
        for layer in ring.streamed
        for spec in layer.params
    ]


def attach(model: nn.Module, state: OffloadState) -> None:
    """Second half of dispatch: `state.offloaded` hold their values; place the rest, build the pool, hook the layers.

    Also used by the loader, which fills host storage straight from the checkpoint.
    """
    device, plan = state.device, state.plan
    setattr(model, _STATE_ATTR, state)
    offloaded_ids = {id(o.param) for o in state.offloaded}
    _move_tensors(model, device, skip=offloaded_ids)

    by_name = {o.full_name: o for o in state.offloaded}
    rings: list[RingTransfers] = []
    for ring in plan.rings:
        pool = BufferPool([spec.key for layer in ring.streamed for spec in layer.params], ring.num_slots, device)
        transfers = []
        for layer in ring.streamed:
            host, slots = [], []
            for spec in layer.params:
                offloaded = by_name[f"{layer.path}.{spec.name}"]
                slot_buffer = pool.buffer(spec.key, layer.slot)
                offloaded.param.data = slot_buffer
                offloaded.param.requires_grad_(False)  # slot storage is shared between layers: not trainable
                host.append(offloaded.host)
                slots.append(slot_buffer)
            transfers.append(LayerTransfer(host, slots, layer.slot, layer.next_in_slot, layer.offloaded_bytes))
        rings.append(RingTransfers(transfers, pool))
    state.engine = PrefetchEngine(device, rings, pinned=state.arena.pinned, timing=state.timing)
    engine_id = register_engine(state.engine)

    for ring_index, ring in enumerate(plan.rings):
        for position, layer in enumerate(ring.streamed):
            module = model.get_submodule(layer.path)
            hook = PrefetchHook(state.engine, engine_id, ring_index, position)
            add_hook_to_module(module, hook, append=True)
            state.hooks.append((module, hook))
    prepare, finish = model_hooks(state.engine)
    state.handles += [model.register_forward_pre_hook(prepare), model.register_forward_hook(finish)]
    state.handles.append(model._register_state_dict_hook(_host_values_in_state_dict))
    state.handles += _write_through_load_state_dict(model, state)
    state.guarded = _guard_moves(model, [o.full_name for o in state.offloaded])
    state.previous_device_map = getattr(model, "hf_device_map", _MISSING)
    model.hf_device_map = {"": device.index if device.type == "cuda" else "cpu"}
    state.engine.start()


def _attach_uva(model: nn.Module, state: OffloadState) -> None:
    """UVA's second half: each offloaded parameter becomes a device view of its pinned host storage (zero-copy)."""
    setattr(model, _STATE_ATTR, state)
    if state.device.type == "cpu":
        warn_on_cpu(state.plan)
    else:
        mapped = state.arena.map(state.device)  # [Note: UVA lifetime]: its views keep the arena registered
        for index, offloaded in enumerate(state.offloaded):
            host = offloaded.host
            offloaded.param.data = state.arena.view(index, host.shape, host.stride(), host.dtype, base=mapped)
        state.guarded = _guard_moves(model, [o.full_name for o in state.offloaded])
    _move_tensors(model, state.device, skip=set())  # the views are on the device already
    state.previous_device_map = getattr(model, "hf_device_map", _MISSING)
    model.hf_device_map = {"": state.device.index if state.device.type == "cuda" else "cpu"}


def remove_offload(model: nn.Module, device: str | int | torch.device | None = None) -> nn.Module:
    """Undo `dispatch_model`: every weight back on one device, hooks removed, pool and pinned memory freed.

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
    >>> model = hf_prefetch.remove_offload(hf_prefetch.dispatch_model(model, device="cpu"))
    >>> hf_prefetch.get_state(model) is None
    True

    ```
    """
    state = get_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not dispatched by hf_prefetch: nothing to remove.")
    target = state.device if device is None else resolve_device(device)
    _teardown(model, state, target)
    return model


def _teardown(model: nn.Module, state: OffloadState, target: torch.device | None) -> None:
    # With target None, streamed parameters are left holding their host tensors (re-dispatch and rollback).
    if state.engine is not None:
        state.engine.synchronize()
    elif state.device.type == "cuda":
        torch.cuda.synchronize(state.device)  # UVA: no kernel may still read host memory about to be unpinned
    for module, hook in state.hooks:
        _remove_hook(module, hook)
    for handle in state.handles:
        handle.remove()
    for module in state.guarded:
        module.__dict__.pop("_apply", None)
    for offloaded in state.offloaded:
        offloaded.param.data = offloaded.host
        offloaded.param.requires_grad_(offloaded.requires_grad)
    # Drop every reference to the engine and the pool (hooks hold the engine): the pool's memory is reused by the
    # moves below, and a caller still holding `state` keeps nothing alive.
    state.engine = None
    state.hooks = []
    if target is not None:
        _move_tensors(model, target, skip=set())
    if state.previous_device_map is not _UNSET:  # attach() set hf_device_map: restore what was there
        if state.previous_device_map is _MISSING:
            model.__dict__.pop("hf_device_map", None)
        else:
            model.hf_device_map = state.previous_device_map
    state.arena.release()
    state.offloaded = []
    if getattr(model, _STATE_ATTR, None) is state:
        delattr(model, _STATE_ATTR)


def _remove_hook(module: nn.Module, hook: PrefetchHook) -> None:
    current = getattr(module, "_hf_hook", None)
    if current is hook:
        remove_hook_from_module(module)
    elif isinstance(current, SequentialHook) and hook in current.hooks:
        rest = [h for h in current.hooks if h is not hook]
        module._hf_hook = rest[0] if len(rest) == 1 else SequentialHook(*rest)


def _guard_moves(model: nn.Module, streamed_params: list[str]) -> list[nn.Module]:
    # `model.to()`, `.half()`, `.cuda()`, `.float()` ... all go through `nn.Module._apply`, which would swap the
    # streamed parameters' slot tensors for converted copies that no copy ever refreshes. Refuse it on every module
    # that owns or contains a streamed parameter, before anything is converted.
    paths = {""}
    for name in streamed_params:
        parts = name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    guarded = [model.get_submodule(path) for path in sorted(paths)]
    for module in guarded:
        module._apply = _refuse_apply
    return guarded


def _refuse_apply(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "This model is dispatched by hf_prefetch: .to(), .cuda(), .cpu(), .half(), .float() and other conversions "
        "would detach the offloaded weights from their buffer slots or host memory. Call "
        "hf_prefetch.remove_offload(model) first (remove_offload(model, device='cpu') if it does not fit on the GPU), "
        "convert, then dispatch again."
    )


def _host_values_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # A streamed parameter's slot holds whichever layer ran last; its true value lives in host storage.
    state = get_state(module)
    if state is None:
        return
    for offloaded in state.offloaded:
        key = prefix + offloaded.full_name
        if key in state_dict:
            state_dict[key] = offloaded.host


class _Streamed(NamedTuple):
    name: str  # in the module that owns it
    offloaded: OffloadedParam
    slot_buffer: torch.Tensor
    ring: int
    position: int


class _WriteThrough:
    """`load_state_dict` on a module that owns streamed parameters writes their host storage, not their slots.

    Before the module loads, each streamed parameter the state dict names points at its host tensor, so torch's own
    loading (its checks, casts, strict and missing/unexpected keys) writes the true value; after it loaded, the
    parameters point at their slots again and a layer that holds its slot gets the new values copied in. See
    [Note: rewriting weights] in docs/design.md.
    """

    def __init__(self, engine: PrefetchEngine, streamed: list[_Streamed]) -> None:
        self.engine = engine
        self.streamed = streamed
        self.loading: list[_Streamed] = []  # pointed at host storage by `before`, until `after`

    def before(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        loading = [s for s in self.streamed if prefix + s.name in state_dict]
        if loading:
            self.engine.drain()  # no copy may still read the host storage about to be written
        for streamed in loading:
            streamed.offloaded.param.data = streamed.offloaded.host
        self.loading = loading

    def after(self, module: nn.Module, incompatible_keys: Any) -> None:
        loading, self.loading = self.loading, []
        for streamed in loading:
            streamed.offloaded.param.data = streamed.slot_buffer
        for ring, position in dict.fromkeys((s.ring, s.position) for s in loading):
            self.engine.refresh(ring, position)


def _refuse_assign(
    streamed_names: list[str], module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any
) -> None:
    # Registered on every module that contains a streamed parameter, so that a load_state_dict(assign=True) that
    # would reach one fails on entry, before torch has assigned anything.
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name in streamed_names:
        if prefix + name in state_dict:
            raise RuntimeError(
                f"load_state_dict(..., assign=True) would replace the streamed parameter {prefix}{name} by the state "
                "dict's tensor and detach it from its buffer slot. Load in place (assign=False) or use "
                "hf_prefetch.reload_weights(model, state_dict); to assign, call hf_prefetch.remove_offload(model) "
                "first and dispatch again."
            )


def _write_through_load_state_dict(model: nn.Module, state: OffloadState) -> list[Any]:
    handles = []
    under: dict[str, list[str]] = {}  # module path -> the streamed parameters under it, by their names in it
    for offloaded in state.offloaded:
        parts = offloaded.full_name.split(".")
        for depth in range(len(parts)):
            under.setdefault(".".join(parts[:depth]), []).append(".".join(parts[depth:]))
    for path, names in under.items():
        refuse = partial(_refuse_assign, names)
        handles.append(model.get_submodule(path)._register_load_state_dict_pre_hook(refuse, with_module=True))

    by_name = {o.full_name: o for o in state.offloaded}
    owned: dict[nn.Module, list[_Streamed]] = {}
    for ring_index, (ring, transfers) in enumerate(zip(state.plan.rings, state.engine.rings, strict=True)):
        for position, (layer, transfer) in enumerate(zip(ring.streamed, transfers.layers, strict=True)):
            for spec, slot_buffer in zip(layer.params, transfer.device, strict=True):
                module_path, _, name = f"{layer.path}.{spec.name}".rpartition(".")
                streamed = _Streamed(name, by_name[f"{layer.path}.{spec.name}"], slot_buffer, ring_index, position)
                owned.setdefault(model.get_submodule(module_path), []).append(streamed)
    for module, streamed in owned.items():
        write_through = _WriteThrough(state.engine, streamed)
        handles.append(module._register_load_state_dict_pre_hook(write_through.before, with_module=True))
        handles.append(module.register_load_state_dict_post_hook(write_through.after))
    return handles


def _move_tensors(model: nn.Module, device: torch.device, skip: set[int]) -> None:
    for param in model.parameters():
        if id(param) not in skip and param.device != device:
            param.data = param.data.to(device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _check_materialized(model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device: the model has no weights yet. Load it with "
                "hf_prefetch.from_pretrained(path) or hf_prefetch.load_checkpoint_and_dispatch(model, path)."
            )


def _resolve_config(offload: Any, config: PrefetchConfig | None, config_fields: dict[str, Any]) -> PrefetchConfig:
    # The loaders and hf_prefetch.plan run the prefetch backend only.
    resolved = resolve_offload(offload, config, config_fields)
    if isinstance(resolved, UVAConfig):
        raise ValueError(
            "offload='uva' works with hf_prefetch.dispatch_model only (the loaders and hf_prefetch.plan run "
            "prefetch): load the model in host memory (e.g. with transformers), then call "
            "hf_prefetch.dispatch_model(model, offload='uva', cpu_offload_gb=...); hf_prefetch.uva.make_uva_plan "
            "shows the plan."
        )
    return resolved


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The execution device: CUDA when available and not told otherwise, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device; use 'cuda', 'cuda:0', 0 or 'cpu'.") from err
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r}: hf_prefetch executes on 'cuda' or 'cpu' devices only.")
    if not torch.cuda.is_available():
        reason = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA driver or GPU was found"
        raise ValueError(f"device={device!r} but CUDA is not available ({reason}). Pass device='cpu'.")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: there are only {torch.cuda.device_count()} CUDA device(s).")
    return torch.device("cuda", index)
