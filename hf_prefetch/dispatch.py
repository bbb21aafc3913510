"""The verbs: `dispatch_model` plans and executes a dispatch on a built model, `remove_offload` undoes it.

Plan, then execute: the plan says where every parameter goes (planning/placements.py); `attach` (lifecycle/attach.py)
builds the buffer pool, the engine and the hooks for it, making every change to the model through the state's journal
(lifecycle/journal.py), which removal, re-dispatch, failure and the collection of a deleted model replay. The loader
fills host storage from the checkpoint instead of from the parameters, then calls the same `attach`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .config import OffloadConfig, PrefetchConfig, UVAConfig, resolve_offload, warn_at_caller
from .formats.parts import get_part
from .host import limits
from .host.arena import HostArena
from .host.expert_rows import ExpertRows
from .host.offloaded import OffloadedParam
from .lifecycle.attach import attach, begin, forwards_held, host_layout, keep_int8_scales
from .lifecycle.checks import refuse_other_offload, refuse_unknown_keywords, resolve_device
from .lifecycle.compressed_storage import compress_arena
from .lifecycle.detach import detach, finish_interrupted, rollback
from .lifecycle.state import Lifecycle, OffloadState, exclusive
from .loading.file_layers import dense_as_is, read_layout, with_read_speed, write_layers
from .planning.choose import choose_plan
from .planning.links import resolve_links
from .planning.memory import MaxMemory, device_argument, parse_max_memory
from .planning.placements import INNER_SEP, ParamSpec, Placement
from .planning.ranks import settle
from .planning.selection import make_uva_plan

__all__ = ["dispatch_model", "remove_offload"]


def dispatch_model(
    model: nn.Module,
    offload: str | PrefetchConfig | UVAConfig | OffloadConfig = "prefetch",
    *,
    device: str | int | torch.device | None = None,
    layers: str | Sequence[str] | None = None,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    links: str | Sequence[int | str | torch.device] | None = None,
    timing: bool = False,
    replace: bool = False,
    offload_folder: str | os.PathLike | None = None,
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
            `max_memory`; defaults to 1 GiB (`hf_prefetch.planning.memory.DEFAULT_RESERVE_BYTES`).
        links (`"all"` or list of GPUs, *optional*): GPUs whose host-to-device links carry a share of every streamed
            layer: each copies its share from pinned host memory into a staging buffer of its own and on over the
            peer link (NVLink) into the slot, so a forward streams at the links' combined speed. May name the
            execution device; `"all"`: every GPU with peer access to it. Their `max_memory` entries, if given, bound
            their staging buffers (`OffloadPlan.staging_bytes`). CUDA graphs copy through the execution device's
            link only. See docs/design.md ("Several host links").
        timing (`bool`): Measure copy and stall seconds per layer with CUDA events (see `hf_prefetch.stats`).
        replace (`bool`): Re-dispatch a dispatched model with a new configuration, without reloading it.
        offload_folder (`str` or path, *optional*): With a `max_memory` whose `"cpu"` entry cannot pin every streamed
            layer: the layers beyond it are written there once, one safetensors file per layer, and read from those
            files before each copy, as `from_pretrained` reads a checkpoint's (docs/api.md, "Layers read from
            files"). The files stay after `remove_offload`.

    A dispatched model refuses `.to()`, `.cpu()`, `.cuda()`, `.half()` and the other conversions that would change its
    tensors (one that changes nothing, such as `.cpu()` of a model dispatched to the CPU, returns the model),
    `copy.deepcopy` and pickling: call `remove_offload` first. It is for inference: a backward through a streamed
    layer raises (streamed parameters keep their `requires_grad`, on which the numbers of aten's matmul depend).
    Forwards from several threads run one at a time.

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
    if uva and (timing or max_memory is not None or reserve_bytes is not None or links is not None):
        raise ValueError(
            "timing, max_memory, reserve_bytes and links work with the prefetch backend only, not with UVA."
        )
    max_memory = None if uva else parse_max_memory(max_memory, reserve_bytes, config)
    if offload_folder is not None and (max_memory is None or max_memory.host_bytes is None):
        raise ValueError(
            f"offload_folder={str(offload_folder)!r} holds the streamed layers that max_memory['cpu'] cannot pin, and "
            "no max_memory['cpu'] was given: pass one (e.g. max_memory={0: '10GiB', 'cpu': '32GiB'}), or drop "
            "offload_folder."
        )
    exec_device = resolve_device(device_argument(max_memory, device))
    link_indices = resolve_links(links, exec_device)
    # The whole dispatch under the model's lock: after any forward or change under way in another thread, and
    # before any that comes meanwhile (a second dispatch of the model finds it dispatched).
    with exclusive(model) as state:
        return _dispatch(
            model, state, config, layers, exec_device, max_memory, link_indices, replace, timing, uva, offload_folder
        )


def _dispatch(
    model: nn.Module,
    state: OffloadState | None,
    config: PrefetchConfig | UVAConfig,
    layers: str | Sequence[str] | None,
    exec_device: torch.device,
    max_memory: MaxMemory | None,
    link_indices: tuple[int, ...],
    replace: bool,
    timing: bool,
    uva: bool,
    offload_folder: str | os.PathLike | None,
) -> nn.Module:
    # From the old forward gate's removal to the new one's arrival, forwards in other threads wait and refuse; the
    # new gate's arrival ends the holds (`begin`).
    with contextlib.ExitStack() as gateless:
        held = []
        finished = state is not None and state.lifecycle is not Lifecycle.ATTACHED
        if finished:
            held.append(gateless.enter_context(forwards_held(model, state.plan)))
            finish_interrupted(model, state)  # an interrupted dispatch or removal: complete it first
            state = None
        if state is not None and not replace:
            raise ValueError(
                f"{type(model).__name__} is already dispatched with {state.plan.config}. Call "
                "hf_prefetch.remove_offload(model) first, or pass replace=True to re-dispatch with the new config."
            )
        refuse_other_offload(model)
        _check_materialized(model)
        # Validated before the old dispatch is undone.
        if uva:
            plan = make_uva_plan(model, config, layers)
        else:
            as_is = dense_as_is(model) if offload_folder is not None else None  # layers it may write to files
            plan = choose_plan(model, config, layers, exec_device, max_memory, link_indices, as_is)
        try:  # a tensor-parallel rank that fails from here on tells the others (ranks.settle), which roll back
            # UVA on the CPU leaves every weight where it is: host memory is the device's memory.
            layout = [] if uva and exec_device.type == "cpu" else host_layout(plan)
            if state is not None:
                _check_replacement_arena(model, state, layout)  # while the old dispatch still stands
            settle(model, plan)  # a tensor-parallel rank: every rank validated before any changes its model
            if state is not None:
                if state.in_place is not None:  # values in place or assigned anew: into host storage, which moves over
                    state.in_place.settle()
                held.append(gateless.enter_context(forwards_held(model, state.plan, plan)))
                detach(model, state, target=None)
            elif finished:  # an interrupted dispatch was finished: the new gate's parts wait and refuse as well
                held.append(gateless.enter_context(forwards_held(model, plan)))
            # Host memory the arena takes back as it fills: each offloaded parameter's original storage, if on the CPU.
            on_host = sum(spec.nbytes for path, spec in layout if _param(model, path, spec).device.type == "cpu")
            arena = HostArena([spec.nbytes for _, spec in layout], freed_bytes=on_host)
            state = begin(model, plan, exec_device, arena, timing, held=held)
        except BaseException as error:
            settle(model, plan, error)
            raise
    try:
        if offload_folder is not None:
            _write_files(model, state, offload_folder)
        keep_int8_scales(model, state.journal)
        for index, (layer_path, spec) in enumerate(layout):
            name, param = f"{layer_path}.{spec.name}", _param(model, layer_path, spec)
            offloaded = OffloadedParam(
                name, param, arena.view(index, spec.shape, spec.stride, spec.dtype), None, spec.inner
            )
            offloaded.host.copy_(get_part(param, offloaded.attr))
            # Drop the original storage now, so a model that starts on the GPU frees it before the pool exists.
            state.journal.place(param, offloaded.host, f"{name} into host storage", offloaded.attr)
            state.offloaded.append(offloaded)
        compress_arena(model, state)  # a plan with compressed parameters: their encoded bytes in a new arena
        if exec_device.type == "cuda":
            with torch.cuda.device(exec_device):  # registered memory belongs to the current device (UVA views)
                state.arena.pin()
        attach(model, state)
        settle(model, plan)  # a tensor-parallel rank: every rank attached, or every rank rolls back
    except BaseException as error:
        settle(model, plan, error)  # a tensor-parallel rank that failed: the others learn it and roll back
        rollback(model, state)
        raise
    return model


def _write_files(model: nn.Module, state: OffloadState, folder: str | os.PathLike) -> None:
    # The layers (or routed experts) the host budget cannot pin, written to `folder`, pointed at those files' pages.
    read = read_layout(state.plan) + read_layout(state.plan, Placement.READ_ROUTED)
    if not read:
        warn_at_caller(
            f"offload_folder={str(folder)!r} holds nothing in this plan: max_memory['cpu'] pins every streamed "
            "layer. Drop offload_folder."
        )
        return
    state.file_arena, state.file_extents = write_layers(model, read, folder)
    for layer_path, spec in read_layout(
        state.plan, Placement.READ_ROUTED
    ):  # stored whole: their rows one after another
        name = f"{layer_path}.{spec.name}"
        state.file_extents[name] = ExpertRows.whole(state.file_extents[name], spec.routing.num_experts)
    state.plan = with_read_speed(state.plan, state.file_extents)
    for index, (layer_path, spec) in enumerate(read):
        name, param = f"{layer_path}.{spec.name}", _param(model, layer_path, spec)
        host = state.file_arena.view(index, spec.shape, spec.stride, spec.dtype)
        state.journal.place(param, host, f"{name} into its file in {folder}")
        state.offloaded.append(OffloadedParam(name, param, host))


def _param(model: nn.Module, layer_path: str, spec: ParamSpec) -> nn.Parameter:
    # The parameter a spec belongs to (for an inner tensor of a tensor subclass: the subclass parameter).
    return model.get_parameter(f"{layer_path}.{spec.name.partition(INNER_SEP)[0]}")


def _check_replacement_arena(model: nn.Module, state, layout) -> None:
    # The old arena is released as its weights move into the new one; weights now resident on the CPU move in too.
    old = {offloaded.full_name for offloaded in state.offloaded}
    on_host = sum(
        spec.nbytes
        for path, spec in layout
        if f"{path}.{spec.name}" not in old and _param(model, path, spec).device.type == "cpu"
    )
    nbytes = HostArena.bytes_for([spec.nbytes for _, spec in layout])
    if nbytes > 0:
        limits.check_host_memory(nbytes, limits.host_limits(), freed_bytes=state.arena.nbytes + on_host)


def remove_offload(model: nn.Module, device: str | int | torch.device | None = None) -> nn.Module:
    """Undo `dispatch_model`: every weight back on one device, hooks removed, pool and pinned memory freed.

    Also finishes a dispatch or a removal that an interrupt (Ctrl-C) or an error stopped half-way: a removal to the
    device it was given, or to `device` when one is passed now (`"cpu"` after the GPU ran out of memory half-way).

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
    with exclusive(model) as state:  # after a forward under way in another thread
        if state is None:
            raise ValueError(f"{type(model).__name__} is not dispatched by hf_prefetch: nothing to remove.")
        if state.lifecycle in (Lifecycle.ATTACHING, Lifecycle.ROLLING_BACK):
            rollback(model, state)
            return model
        if state.lifecycle is Lifecycle.ATTACHED:
            target = state.device if device is None else resolve_device(device)
            _check_removable(model, state)  # before anything is undone
            if state.in_place is not None:  # values in place or assigned anew: into host storage, which stays
                state.in_place.settle()
            state.target = target
        elif device is not None:  # a removal stopped half-way goes where it is told now (its GPU may be full)
            state.target = resolve_device(device)
        detach(model, state, state.target)
    return model


def _check_removable(model: nn.Module, state) -> None:
    # Another offloading mechanism added after the dispatch (accelerate's enable_sequential_cpu_offload) may have put
    # weights on the meta device, keeping their values in its own hooks: moving them would fail half-way.
    name = _first_on_meta(model, skip={id(offloaded.param) for offloaded in state.offloaded})
    if name is not None:
        raise ValueError(
            f"{name} is on the meta device: another offloading mechanism took the weights after hf_prefetch "
            "dispatched this model (accelerate's cpu_offload, e.g. a pipeline's enable_sequential_cpu_offload). "
            "Remove its hooks first (pipe.remove_all_hooks(), or accelerate.hooks.remove_hook_from_module(model, "
            "recurse=True)), which puts the weights back, then call remove_offload. Nothing was undone."
        )


def _first_on_meta(model: nn.Module, skip: frozenset[int] | set[int] = frozenset()) -> str | None:
    # The first parameter or buffer on the meta device (tensors whose id is in `skip` aside), or None.
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return next((name for name, t in tensors if t.device.type == "meta" and id(t) not in skip), None)


def _check_materialized(model: nn.Module) -> None:
    name = _first_on_meta(model)
    if name is not None:
        raise ValueError(
            f"{name} is on the meta device: the model has no weights yet. Load it with "
            "hf_prefetch.from_pretrained(path) or hf_prefetch.load_checkpoint_and_dispatch(model, path)."
        )
