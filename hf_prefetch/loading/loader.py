"""The loader: a safetensors checkpoint -> a dispatched model, every byte read once, straight into its final place.

Offloaded parameters are read into their exact-size host arena slots, resident ones onto the execution device (through
a small ring of pinned staging buffers on CUDA). Which checkpoint key fills which tensor, with transformers' own
renames and conversions, is `keymap`'s job. Every header, key and shape is validated before anything large is
allocated, and a failed load leaves the model as it was given. This module orders the load's steps; the steps
themselves (the arena, the reads, the page-locking, the values installed) are filling.py's, and building the buffer
pool and hooking layers is `attach.attach`'s (lifecycle/attach.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..config import PrefetchConfig
from ..interrupts import deferred_interrupts
from ..lifecycle import attach
from ..lifecycle.checks import refuse_other_offload, refuse_unknown_keywords, resolve_config, resolve_device
from ..lifecycle.compressed_storage import compress_arena
from ..lifecycle.detach import rollback
from ..lifecycle.journal import Journal, Phase
from ..lifecycle.state import get_state, model_lock
from ..planning.choose import choose_plan
from ..planning.file_tier import READ_ROUTED
from ..planning.links import resolve_links
from ..planning.memory import MaxMemory, device_argument, parse_max_memory
from ..planning.pipeline import home_of
from ..planning.ranks import settle
from . import sharded
from .checkpoint import Checkpoint
from .file_layers import expert_storage, file_storage, read_layout, stored_layout, with_read_speed
from .filling import (
    Background,
    LoadTimeline,
    check_direct_io,
    check_fp8_matmuls,
    file_pieces,
    install,
    new_arena,
    offloaded_param,
    pin_on,
    read_all,
)
from .hub import hub_id, local_folder
from .keymap import filled_names, map_keys
from .skeleton import FLOAT8, build_skeleton, checkpoint_folder, set_dtypes
from .warmup import Warmup

__all__ = ["from_pretrained", "load_checkpoint_and_dispatch", "check_building", "set_attention"]

logger = logging.getLogger(__name__)


def from_pretrained(
    path: str | os.PathLike,
    offload: str | PrefetchConfig = "prefetch",
    *,
    device: str | int | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    layers: str | Sequence[str] | None = None,
    model_class: type | None = None,
    progress: bool | None = None,
    timing: bool = False,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    links: str | Sequence[int | str | torch.device] | None = None,
    direct_io: bool | None = None,
    map_files: bool | None = None,
    revision: str | None = None,
    token: bool | str | None = None,
    subfolder: str | None = None,
    attn_implementation: str | dict[str, str] | None = None,
    trust_remote_code: bool = False,
    distributed_config: Any = None,
    device_mesh: Any = None,
    **unknown: Any,
) -> nn.Module:
    """Load a transformers checkpoint straight into a dispatched model, without a full copy in host memory.

    Reads `config.json`, builds the model on the meta device, plans which parameters stream, and reads every
    safetensors shard once: offloaded weights into pinned host memory, the rest onto `device`.

    Args:
        path (`str` or `os.PathLike`): A folder with `config.json` and `model.safetensors` or a sharded
            `model.safetensors.index.json`; or a Hugging Face Hub id (`"org/name"`), whose `config.json`,
            `generation_config.json` and safetensors files (nothing else) are downloaded into huggingface_hub's cache
            unless cached (`HF_HUB_CACHE`, `HF_HUB_OFFLINE`), with its progress bars. An existing folder is never
            looked up on the Hub.
        offload (`PrefetchConfig` or `str`): Which layers stream; `"prefetch"` is `PrefetchConfig()`.
        device: Execution device. Defaults to the current CUDA device, or `"cpu"` without CUDA.
        dtype (`torch.dtype`, *optional*): Floating-point dtype of the weights. Defaults to `config.dtype` (then to
            the checkpoint's), as in transformers' `dtype="auto"`.
        layers (`str` or list of `str`, *optional*): Path(s) of the layer list(s); found when omitted.
        model_class (*optional*): A transformers Auto class or model class. Defaults to `AutoModelForCausalLM`
            (the command line chooses the class that `config.json`'s `architectures` names).
        progress (`bool`, *optional*): Show a progress bar over bytes; by default only on a terminal.
        max_memory, reserve_bytes: Choose the streamed layers to fit a memory budget, as in `dispatch_model`.
        links: Other GPUs whose host links carry a share of every streamed layer, as in `dispatch_model`.
        direct_io (`bool`, *optional*): Read the shards with direct I/O (`O_DIRECT`), around the page cache. By
            default each shard the page cache holds less than half of is read directly (a checkpoint fresh from the
            disk: large reads, and no second copy of the weights in the cache) and the others through the cache.
            `True` reads every shard directly where the file system allows it, `False` none.
        map_files (`bool`, *optional*): Keep streamed weights in the page cache's own pages (the shards mapped
            read-only and page-locked in place) instead of copying them into host memory: no copy and no fresh memory
            at load, and no second copy of them in the page cache. By default, a weight stored as it is loaded (same
            dtype, one tensor) in a shard the page cache holds is mapped; `True` maps such weights of every shard
            (the pages the cache lacks are read as they are locked), `False` none. A plan that streams compressed, has
            routed experts or uses the UVA backend maps nothing (`True` then warns). The first `state_dict()`,
            `load_state_dict`, `reload_weights`, `sync_from_device` or `remove_offload(model, "cpu")` copies them
            into private memory first. Do not write over a shard a model was loaded from while it lives (see
            docs/design.md, [Note: mapped host storage]).
        revision, token, subfolder: For a Hub id, as in transformers' `from_pretrained`: the branch, tag or commit
            (default `"main"`), the access token (default: the one `hf auth login` saved, or `HF_TOKEN`), and the
            folder of the repository the model lies in (`subfolder` also works in a local folder).
        attn_implementation (`str`, *optional*): transformers' attention implementation (`"eager"`, `"sdpa"`, ...),
            set on the model's config as transformers' `from_pretrained(..., attn_implementation=...)` does.
        trust_remote_code (`bool`): Only `False`: the model is built from transformers' own classes, and no code from
            the checkpoint runs.
        distributed_config, device_mesh: Tensor parallelism as in transformers (`DistributedConfig(tp_size=N)`,
            on each of N ranks under `torchrun`): each rank reads only its slices of the checkpoint and streams only
            its shards; `device` defaults to its GPU (`LOCAL_RANK`), `max_memory` is its own budget. See
            docs/design.md, "Tensor-parallel ranks".

    Returns:
        The model, dispatched and in eval mode.

    Example:

    ```python
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=64)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     LlamaForCausalLM(config).save_pretrained(folder)
    ...     config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
    ...     model = hf_prefetch.from_pretrained(folder, config, device="cpu")
    >>> [layer.path for layer in hf_prefetch.get_state(model).plan.rings[0].streamed]
    ['model.layers.1', 'model.layers.3']
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 64])

    ```
    """
    timeline = LoadTimeline()
    refuse_unknown_keywords("from_pretrained", unknown)
    config = resolve_config(offload, "from_pretrained")
    max_memory = parse_max_memory(max_memory, reserve_bytes, config)
    tensor_parallel, device = sharded.prepare(distributed_config, device_mesh, device)  # a rank's: its GPU by default
    exec_device = resolve_device(device_argument(max_memory, device))
    link_indices = resolve_links(links, exec_device)
    check_direct_io(direct_io, map_files)
    check_building(attn_implementation, trust_remote_code)
    # Every argument is checked before anything is downloaded; nothing is loaded before every file is here.
    folder = checkpoint_folder(local_folder(path, revision=revision, token=token, subfolder=subfolder))
    warmup = None
    try:
        # The CUDA context and cuBLAS's handle are made in a thread while the model is built and planned (warmup.py).
        warmup = Warmup(exec_device)
        timeline.mark("device")
        with Checkpoint.open(folder) as checkpoint:
            timeline.mark("open")
            model, torch_dtype = build_skeleton(folder, checkpoint, dtype, model_class)
            if tensor_parallel is not None:
                model = sharded.shard_skeleton(model, *tensor_parallel)
            set_attention(model, attn_implementation)
            if hub_id(path) is not None:
                model.config.name_or_path = path  # as transformers names a model loaded from the Hub
            timeline.mark("skeleton")
            _load(
                model,
                checkpoint,
                config,
                exec_device,
                torch_dtype,
                cast=False,
                layers=layers,
                progress=progress,
                timing=timing,
                max_memory=max_memory,
                links=link_indices,
                timeline=timeline,
                direct_io=direct_io,
                map_files=map_files,
                warmup=warmup,
            )
    finally:
        if warmup is not None:
            warmup.join()  # joined already unless the skeleton failed
    if (folder / "generation_config.json").is_file() and model.can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    timeline.mark("generation config")
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    offload: str | PrefetchConfig = "prefetch",
    *,
    device: str | int | torch.device | None = None,
    dtype: torch.dtype | None = None,
    layers: str | Sequence[str] | None = None,
    progress: bool | None = None,
    timing: bool = False,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    links: str | Sequence[int | str | torch.device] | None = None,
    direct_io: bool | None = None,
    map_files: bool | None = None,
    revision: str | None = None,
    token: bool | str | None = None,
    subfolder: str | None = None,
    **unknown: Any,
) -> nn.Module:
    """Load a checkpoint into a model built on the meta device and dispatch it, like `from_pretrained`.

    Build the model under `accelerate.init_empty_weights()` (which keeps buffers real, so rotary tables and other
    non-persistent buffers are computed as usual). On any error the model is left as it was given.

    Args:
        model (`nn.Module`): The model skeleton, parameters on the meta device.
        checkpoint (`str` or `os.PathLike`): A folder, a `.safetensors` file or a `model.safetensors.index.json`;
            or a Hugging Face Hub id (`"org/name"`), whose safetensors files are downloaded unless cached.
        offload, device, layers, progress, max_memory, reserve_bytes, links, direct_io, map_files, revision, token,
            subfolder: As in `from_pretrained`.
        dtype (`torch.dtype`, *optional*): Cast floating-point parameters to this dtype; by default each parameter
            keeps the model's dtype (the checkpoint's values are cast to it).

    Returns:
        The same model, loaded, dispatched and in eval mode.

    Example:

    ```python
    >>> import tempfile, torch
    >>> from accelerate import init_empty_weights
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=64)
    >>> with init_empty_weights():
    ...     model = LlamaForCausalLM(config)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     LlamaForCausalLM(config).save_pretrained(folder)
    ...     model = hf_prefetch.load_checkpoint_and_dispatch(
    ...         model, folder, hf_prefetch.PrefetchConfig(prefetch_step=1), device="cpu", dtype=torch.bfloat16)
    >>> model.lm_head.weight.dtype, hf_prefetch.get_state(model) is not None
    (torch.bfloat16, True)

    ```
    """
    _refuse_building(unknown)
    refuse_unknown_keywords("load_checkpoint_and_dispatch", unknown)
    config = resolve_config(offload, "load_checkpoint_and_dispatch")
    max_memory = parse_max_memory(max_memory, reserve_bytes, config)
    exec_device = resolve_device(device_argument(max_memory, device))
    link_indices = resolve_links(links, exec_device)
    check_direct_io(direct_io, map_files)
    _refuse_dispatched(model)
    refuse_other_offload(model)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype not in FLOAT8):
        raise ValueError(
            f"dtype={dtype!r} must be a floating-point torch.dtype to compute in, such as torch.bfloat16, or None "
            "(float8 weights keep their dtype under any dtype)."
        )
    checkpoint = local_folder(checkpoint, revision=revision, token=token, subfolder=subfolder, config=False)
    with Checkpoint.open(checkpoint) as opened:
        _load(
            model,
            opened,
            config,
            exec_device,
            dtype,
            cast=True,
            layers=layers,
            progress=progress,
            timing=timing,
            max_memory=max_memory,
            links=link_indices,
            direct_io=direct_io,
            map_files=map_files,
        )
    return model


def check_building(attn_implementation: Any, trust_remote_code: Any) -> None:
    """The arguments that say how a checkpoint's model is built (`from_pretrained`, `plan` of a checkpoint)."""
    if attn_implementation is not None and not isinstance(attn_implementation, str | dict):
        raise ValueError(
            f"attn_implementation={attn_implementation!r} must be the name of one of transformers' attention "
            "implementations, such as 'eager' or 'sdpa' (or a dict of them per sub-config), or None."
        )
    # A name transformers does not know, before a Hub id is downloaded (a kernel on the Hub, 'org/name', is
    # transformers' to check; so is whether the model can use a known one).
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    names = attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]
    unknown = [n for n in names if isinstance(n, str) and "/" not in n and n.removeprefix("paged|") not in known]
    if unknown:
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: transformers has no attention implementation "
            f"{unknown[0]!r}; it has {sorted(known)} (and kernels on the Hub, 'org/name')."
        )
    if trust_remote_code is not False:
        if trust_remote_code is True:
            raise ValueError(
                "trust_remote_code=True is not supported yet: hf_prefetch builds models from transformers' own "
                "classes and runs no code from a checkpoint. Build the model with transformers under "
                "accelerate.init_empty_weights() (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, "
                "trust_remote_code=True), trust_remote_code=True)), then load it with "
                "hf_prefetch.load_checkpoint_and_dispatch(model, path)."
            )
        raise ValueError(f"trust_remote_code={trust_remote_code!r} must be False.")


def set_attention(model: nn.Module, attn_implementation: str | dict[str, str] | None) -> None:
    """transformers' `attn_implementation` set on a model built from a checkpoint, as transformers' `from_pretrained`
    sets it: on its config and its sub-models' (`PreTrainedModel.set_attn_implementation`, which validates it)."""
    if attn_implementation is None:
        return
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is transformers' setting; {type(model).__name__} is not a "
            "transformers model. Drop it, or pass a transformers model_class."
        )
    model.set_attn_implementation(attn_implementation)  # transformers refuses an unknown or unavailable one
    if isinstance(attn_implementation, str) and model.config._attn_implementation != attn_implementation:
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: {type(model).__name__} cannot change its attention once "
            f"built and keeps {model.config._attn_implementation!r}. Load it with transformers "
            "(from_pretrained(path, attn_implementation=..., device_map='cpu')) and pass it to "
            "hf_prefetch.dispatch_model."
        )


def _refuse_building(keywords: dict[str, Any]) -> None:
    # transformers' from_pretrained keywords that build the model: load_checkpoint_and_dispatch is given it built.
    given = [name for name in ("attn_implementation", "trust_remote_code") if name in keywords]
    if given:
        raise TypeError(
            f"load_checkpoint_and_dispatch() got {given[0]}=, which says how a model is built; the model is built "
            "already. Pass it when building the model (from_config(config, attn_implementation=...), or "
            "model.set_attn_implementation(...) before loading), or let hf_prefetch.from_pretrained(path, "
            f"{given[0]}=...) build it."
        )


def _load(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    # Under the model's lock: a dispatch, a removal or a load of the same model in another thread waits, and so do
    # forwards (the model is the caller's with load_checkpoint_and_dispatch).
    with model_lock(model):
        _refuse_dispatched(model)  # again: another thread may have dispatched it since the caller's check
        _load_unlocked(model, *args, **kwargs)


def _refuse_dispatched(model: nn.Module) -> None:
    if get_state(model) is not None:
        raise ValueError(
            f"{type(model).__name__} is already dispatched; call hf_prefetch.remove_offload(model) before loading."
        )


def _load_unlocked(
    model: nn.Module,
    checkpoint: Checkpoint,
    config: PrefetchConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    *,
    cast: bool,
    layers: str | Sequence[str] | None,
    progress: bool | None,
    timing: bool,
    max_memory: MaxMemory | None = None,
    links: tuple[int, ...] = (),
    timeline: LoadTimeline | None = None,
    direct_io: bool | None = None,
    map_files: bool | None = None,
    warmup: Warmup | None = None,
) -> None:
    from transformers import PreTrainedModel

    timeline = timeline if timeline is not None else LoadTimeline()
    if isinstance(model, PreTrainedModel):
        # accelerate's init_empty_weights re-creates a parameter each time one is registered, which unties the
        # weights that __init__ tied; tie them again so that a tied tensor is one parameter (kept resident).
        model.tie_weights()
    check_fp8_matmuls(model, device)
    journal = Journal()
    arena = files = state = pinning = plan = None
    try:
        warmup = warmup if warmup is not None else Warmup(device)
        set_dtypes(model, dtype, cast, journal)
        keymap = sharded.local_shards(model, map_keys(model, checkpoint))  # a tensor-parallel rank's slices
        plan = choose_plan(model, config, layers, device, max_memory, links, stored_layout(keymap))
        timeline.mark("plan")
        # The first forward's one-time costs, paid while the reads run, in device memory the pool gets afterwards.
        warmup.run(model, spare_bytes=plan.gpu_bytes(device.index)[1] if device.type == "cuda" else 0)
        # Everything is validated: allocate the host arena exactly as dispatch_model does, then the resident tensors.
        layout = attach.host_layout(plan)
        # A plan with compressed parameters pins the arena their encoded bytes move into instead (`compress_arena`).
        compressing = plan.compressed_bytes[0] > 0
        pieces = file_pieces(layout, keymap, checkpoint, device, plan, map_files, direct_io, compressing)
        read = read_layout(plan)  # the layers read from the checkpoint's files at each use
        files, extents = file_storage(read, keymap, checkpoint)
        experts = read_layout(plan, READ_ROUTED)  # routed experts read from the files as their routers pick them
        extents |= expert_storage(experts, keymap)
        plan = with_read_speed(plan, extents)
        arena = new_arena(layout, pieces)
        state = attach.begin(model, plan, device, arena, timing, journal)
        state.file_arena, state.file_extents = files, extents
        state.load_timeline = timeline.phases
        dests = {}
        for i, (path, spec) in enumerate(layout):
            dests[f"{path}.{spec.name}"] = arena.view(i, spec.shape, spec.stride, spec.dtype)
        for i, (path, spec) in enumerate(read):
            dests[f"{path}.{spec.name}"] = files.view(i, spec.shape, spec.stride, spec.dtype)
        for path, spec in experts:  # no host storage: [Note: experts read from files] in runtime/file_experts.py
            meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
            dests[f"{path}.{spec.name}"] = meta
        offloaded_names = list(dests)
        home = home_of(plan, device)  # pipeline placement: a layer's resident tensors are read onto its GPU
        for name in filled_names(keymap):
            if name not in dests:
                tensor = keymap.model_tensors[name]
                dests[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=home(name))
        timeline.mark("allocate", device)
        # The arena's page-locking (CUDA only), in a thread while the tensors are installed and the warm-up ends: the
        # reads touched every page (page-locking touched memory is ~10x faster than fresh); an arena that is all
        # file pages is locked while the reads run. Writes meanwhile (the install's parts no tensor filled) do not
        # disturb it; `compress_arena` and `attach`'s copies come after the join, and so does any release of the
        # arena (the error path joins first).
        if device.type == "cuda" and not compressing and arena.file_bytes == arena.nbytes > 0:
            pinning = Background(lambda: pin_on(arena, device))
            pinning.start()
        mapped = {f"{path}.{spec.name}" for (path, spec), piece in zip(layout, pieces, strict=True) if piece}
        mapped |= set(extents)  # left in the files (the layers' and the experts')
        seconds, read = read_all(checkpoint, keymap, dests, model, progress, direct_io, timeline, skip=mapped)
        if device.type == "cuda" and not compressing and pinning is None:
            pinning = Background(lambda: pin_on(arena, device))
            pinning.start()
        install(model, keymap, dests, journal)
        warmup.join()
        if warmup.seconds is not None:
            torch.cuda.empty_cache()  # the twin's blocks: the pool is allocated next, in sizes of its own
            logger.info("The warm-up thread worked %.2f s (its wait for the model left out)", warmup.seconds)
        timeline.mark("warm-up")  # what was left of it after the reads
        if pinning is not None:
            pinning.join()  # on an error or interrupt here, the error path joins it again before any release
            pinning = None
        timeline.mark("pin")  # what was left of it
        state.offloaded = [offloaded_param(model, keymap, name, dests[name]) for name in offloaded_names]
        if compressing:
            compress_arena(model, state, progress)
            timeline.mark("compress")
        attach.attach(model, state)
        settle(model, plan)  # a tensor-parallel rank: every rank attached, or every rank rolls back
        timeline.mark("attach", device)  # the pool, the hooks, and the copies of each ring's first layers
    except BaseException as error:
        # A second Ctrl-C waits for the end of this block: the threads are joined (the arena is released only after
        # its page-locking ended), other ranks learn of it, and the model is rolled back whatever comes meanwhile.
        with deferred_interrupts():
            settle(model, plan, error)
            if warmup is not None:
                warmup.join()
            if pinning is not None:
                pinning.join(raise_error=False)
            if state is not None:
                rollback(model, state)
            else:
                journal.unwind(Phase.PLACE)
                for storage in (arena, files):
                    if storage is not None:
                        storage.release()
        raise
    if isinstance(model, PreTrainedModel):
        model._weight_conversions = keymap.used_conversions  # what save_pretrained reverts, as after from_pretrained
    model.eval()
    arena = state.arena
    gb, pinned_gib = read.bytes_read / 1e9, (arena.nbytes if arena.pinned else 0) / 2**30
    gpu_gib = (plan.device_bytes if device.type == "cuda" else 0) / 2**30
    message = (
        "Loaded %s: read %.2f GB (%.2f GB direct, %.2f GB copied from the page cache by the copy engine) in %.2f s "
        "(%.2f GB/s); pinned host %.2f GiB, GPU %.2f GiB"
    )
    direct_gb, mapped_gb, rate = read.direct_bytes / 1e9, read.mapped_bytes / 1e9, gb / max(seconds, 1e-9)
    logger.info(message, checkpoint.folder, gb, direct_gb, mapped_gb, seconds, rate, pinned_gib, gpu_gib)
