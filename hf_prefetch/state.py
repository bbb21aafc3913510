"""The state a dispatch leaves on a model, and the small resolutions every entry point shares.

`OffloadState` is what `dispatch_model` and the loaders set up and what `remove_offload`, `stats`, `reload_weights`
and `sync_from_device` read. It lives here, not in `dispatch`, so that nothing imports `dispatch`. This module knows
no plans' internals, streams or hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .changes import Journal
from .config import PrefetchConfig, warn_at_caller
from .guards import refuse_deepcopy, refuse_pickle
from .offload_config import UVAConfig, resolve_offload
from .packed_forward import decompresses, is_compressed

if TYPE_CHECKING:
    from .codec import Layout
    from .engine import PrefetchEngine
    from .hooks import WriteThrough
    from .host import HostArena
    from .placements import OffloadPlan

__all__ = [
    "OffloadState",
    "Lifecycle",
    "OffloadedParam",
    "get_state",
    "resolve_device",
    "resolve_config",
]

STATE_ATTR = "_hf_prefetch_state"


class Lifecycle(Enum):
    """Where a dispatch stands. Only ATTACHED models compute; the others are half-done and finish on the next
    `remove_offload` (or `dispatch_model`), which resumes the journal where it stopped."""

    ATTACHING = "attaching"  # dispatch_model or a loader is changing the model
    ATTACHED = "attached"  # dispatched: hooks, pool and host storage in place
    DETACHING = "detaching"  # remove_offload (or a re-dispatch) is undoing the changes, keeping the weights' values
    ROLLING_BACK = "rolling back"  # a failed dispatch is undoing every change, back to the model as it was given


@dataclass
class OffloadedParam:
    """A parameter kept in host memory: the `nn.Parameter` and the host tensor that holds its value (with `layout`,
    its encoded bytes: see compressed.py). For a tensor-subclass parameter (torchao's quantized tensors) there is one
    per inner tensor: `inner` names the attribute of `param` that holds it (`full_name` ends in `:inner`)."""

    full_name: str
    param: nn.Parameter
    host: torch.Tensor
    layout: Layout | None = None
    inner: str | None = None

    @property
    def attr(self) -> str:
        """The attribute of `param` through which the model reads this tensor."""
        return self.inner or "data"

    @property
    def param_name(self) -> str:
        """The parameter's name in the model (without the inner tensor's attribute)."""
        return self.full_name.partition(":")[0]


@dataclass(eq=False)
class OffloadState:
    """Everything a dispatch set up on a model. The journal holds every change it made, in order, with its undo."""

    plan: OffloadPlan
    device: torch.device
    arena: HostArena
    journal: Journal
    offloaded: list[OffloadedParam] = field(default_factory=list)
    engine: PrefetchEngine | None = None  # None with the UVA backend (no pool, no copies)
    timing: bool = False
    lifecycle: Lifecycle = Lifecycle.ATTACHING
    target: torch.device | None = None  # where a removal moves the weights (kept while it is DETACHING)
    finalizer: Any = None  # weakref.finalize that replays the journal when the model is collected (set by `begin`)
    # The forward gate (hooks.ForwardGate: the model's `_call_impl` and `forward` wrapped) and the journal of its
    # arrival: they arrive with the state and leave with it, after everything else was undone (see `attach.begin`), so
    # that a half-done model refuses to compute until the end of its removal. The state holds the gate; the gate and
    # its wrappers hold the state and the gate only weakly.
    gate: Any = None
    gate_hooks: Journal = field(default_factory=Journal)
    write_throughs: list[WriteThrough] = field(default_factory=list)  # completed by the gate before each forward
    # Seconds per phase of the load that built this dispatch (`loader.LoadTimeline`; empty after dispatch_model).
    load_timeline: dict[str, float] = field(default_factory=dict)
    # Mapped host storage stays a file's pages: its copy into private memory before CUDA graphs failed (hooks.py).
    private_refused: bool = False

    def private_host_storage(self) -> None:
        """[Note: mapped host storage] Before host storage is written or handed out: streamed weights that are still
        a checkpoint file's pages become private memory (`HostArena.make_writable`), after every copy and kernel
        queued so far. Call under the model's lock. A no-op once done. Refused (RuntimeError, nothing changed) once a
        CUDA graph recorded copies from those pages: page-locking the private pages again would leave the graph's
        copies reading an address the device no longer maps."""
        if not self.arena.file_bytes:
            return
        if self.engine is not None and self.engine.graphs:
            raise RuntimeError(
                "CUDA graphs recorded copies of the streamed weights while they were the checkpoint's own pages "
                "(from_pretrained's map_files), so they cannot become private memory now: writing weights "
                "(load_state_dict, reload_weights, sync_from_device) and state_dict() need that. Capture graphs "
                "through torch.compile (the pages turn private before its graphs record), call "
                "model.state_dict() once before capturing, or load with map_files=False."
            )
        if self.engine is not None:
            self.engine.drain()
        self.arena.make_writable()

    def private_before_graphs(self) -> None:
        """[Note: mapped host storage] Before a forward (the gate's): a CUDA model that ran compiled code may record
        CUDA graphs from this call on (torch warms a compiled function up before recording it), whose copies must
        read private pages, never a file's, which could not be replaced under them. Where that copy fails (the
        host's memory), it warns once and the pages stay."""
        engine = self.engine
        if (
            engine is None
            or not engine.compiled
            or engine.graphs
            or self.device.type != "cuda"
            or self.private_refused
        ):
            return
        try:
            self.private_host_storage()
        except (MemoryError, ValueError, OSError) as err:
            self.private_refused = True
            warn_at_caller(
                f"The streamed weights stay the checkpoint's pages (from_pretrained's map_files): {err} Once CUDA "
                "graphs recorded copies from them, state_dict(), load_state_dict, reload_weights and sync_from_device "
                "are refused. Load with map_files=False to avoid this.",
                past_torch=True,
            )

    def __deepcopy__(self, memo: dict) -> Any:
        refuse_deepcopy(memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickle(protocol)


def get_state(model: nn.Module) -> OffloadState | None:
    """The offload state of a dispatched model, or None.

    Example:

    ```python
    >>> from torch import nn
    >>> import hf_prefetch
    >>> print(hf_prefetch.get_state(nn.Linear(2, 2)))
    None

    ```
    """
    return model.__dict__.get(STATE_ATTR)


_MODEL_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The model's lock: held by each of its forwards (the forward gate) and by each change of its dispatch or its
    weights (`exclusive`, and the loaders), so that across threads they run one at a time; re-entrant in one thread.
    One per model for the model's life, kept outside it (nothing on the model to copy or pickle)."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def exclusive(model: nn.Module) -> Iterator[OffloadState | None]:
    """The model's state (None where it is not dispatched) with the model's lock held until the block ends: a verb
    that removes, replaces or rewrites a dispatch waits for a forward under way in another thread, and the forwards
    and verbs that come meanwhile wait for it."""
    with model_lock(model):
        yield get_state(model)


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The execution device: CUDA when available and not told otherwise, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        # A GPU index names a CUDA device (whose absence is said below), whatever accelerator torch would pick.
        resolved = torch.device("cuda", device) if type(device) is int else torch.device(device)
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


def resolve_config(offload: Any, verb: str) -> PrefetchConfig:
    """The prefetch config of a verb that runs prefetch only (the loaders, `plan` of a folder)."""
    resolved = resolve_offload(offload)
    if isinstance(resolved, UVAConfig):
        raise ValueError(
            f"The UVA backend (offload='uva' or a UVAConfig) works with hf_prefetch.dispatch_model only ({verb} runs "
            "prefetch): load the model in host "
            "memory (e.g. with transformers), then call hf_prefetch.dispatch_model(model, UVAConfig(cpu_offload_gb="
            "...)); hf_prefetch.plan(model, UVAConfig(...)) shows the plan."
        )
    return resolved


_TAKES_DTYPE = {"from_pretrained", "load_checkpoint_and_dispatch", "plan"}


def refuse_unknown_keywords(verb: str, keywords: dict[str, Any]) -> None:
    """A clear error for keywords a verb does not take: config fields, and accelerate's and transformers' names."""
    if not keywords:
        return
    from dataclasses import fields

    given = sorted(keywords)
    hints = []
    for config_class in (PrefetchConfig, UVAConfig):
        names = {f.name for f in fields(config_class)}
        if chosen := [k for k in given if k in names]:
            values = ", ".join(f"{k}={keywords[k]!r}" for k in chosen)
            hints.append(
                f"pass the configuration as an object: {verb}(..., hf_prefetch.{config_class.__name__}({values}))"
            )
    dtype = "is called dtype= here" if verb in _TAKES_DTYPE else f"has no use: {verb} keeps the model's dtypes"
    renames = {
        "device_map": "is called device= here (one execution device; max_memory= gives a budget)",
        "torch_dtype": dtype,
        "config": "is called offload= here (a PrefetchConfig or UVAConfig)",
        "low_cpu_mem_usage": "has no use: hf_prefetch always reads each tensor once into its final place",
    }
    hints += [f"{k}= {renames[k]}" for k in given if k in renames]
    hint = "; ".join(hints) or f"see help(hf_prefetch.{verb}) for the arguments it takes"
    raise TypeError(f"{verb}() got unexpected keyword argument(s) {given}: {hint}.")


def refuse_other_offload(model: nn.Module) -> None:
    """Refuse a model that another offloading mechanism manages: accelerate's `cpu_offload` / `disk_offload` hooks
    (diffusers' `enable_sequential_cpu_offload`), `cpu_offload_with_hook` (`enable_model_cpu_offload`), or diffusers'
    group offloading. Each moves the weights hf_prefetch places, so the two would fight (a `.to()` refused in the
    middle of a pipeline call, or weights on the meta device); or compressed-tensors' decompression hook or
    offloading."""
    _refuse_compressed_tensors(model)
    for name, module in model.named_modules():
        for hook in _accelerate_hooks(module):
            kind = type(hook).__name__
            if kind in ("CpuOffload", "UserCpuOffloadHook") or (kind == "AlignDevicesHook" and hook.offload):
                where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
                raise ValueError(
                    f"{type(model).__name__} is managed by accelerate's CPU offloading ({kind} on {where}: "
                    "enable_model_cpu_offload / enable_sequential_cpu_offload, cpu_offload, disk_offload). "
                    "hf_prefetch places the weights itself. Remove those hooks first (pipe.remove_all_hooks(), or "
                    "accelerate.hooks.remove_hook_from_module(model, recurse=True)), then dispatch."
                )
        registry = getattr(module, "_diffusers_hook", None)
        # Group offloading moves the weights, layerwise casting casts them at every forward (`module.to`).
        moving = [key for key in getattr(registry, "hooks", {}) if "offload" in key or "casting" in key]
        if moving:
            where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
            raise ValueError(
                f"{type(model).__name__} has a diffusers hook that moves or casts its weights ({moving[0]} on "
                f"{where}: group offloading or layerwise casting). hf_prefetch places the weights itself. Dispatch a "
                "model without it (diffusers offers no call that removes it: build or load the model again)."
            )


def _refuse_compressed_tensors(model: nn.Module) -> None:
    # compressed-tensors keeps a model it loaded compressed (`dequantize=False`, transformers' default) until a hook
    # decompresses it at the first forward; that decompression also strips accelerate's hooks (hf_prefetch's) and
    # wraps every module in compressed-tensors' own offloading, which moves the tensors hf_prefetch places.
    modules = list(model.named_modules())
    for name, module in modules:
        if is_compressed(module) and not decompresses(module):
            raise ValueError(
                f"{name!r} ({type(module).__name__}) of {type(model).__name__} still holds compressed-tensors' "
                "compressed weights, which its first forward replaces with decompressed ones. Dispatch it after that "
                "forward and after removing compressed-tensors' offloading "
                "(compressed_tensors.offload.remove_dispatch(model, onload_tensors=True)) to stream the dense "
                "weights; hf_prefetch.from_pretrained streams compressed-tensors FP8 and pack-quantized checkpoints "
                "as stored."
            )
    if getattr(model, "ct_decompress_hook", None) is not None:
        raise ValueError(
            f"{type(model).__name__} carries compressed-tensors' decompression hook (`ct_decompress_hook`), which "
            "runs at its first forward, removes accelerate's hooks (hf_prefetch's among them) and puts "
            "compressed-tensors' offloading in their place. None of its modules is compressed (FP8 loaded with "
            "use_optimized_inference), so it has nothing else to do: remove it first with "
            "model.ct_decompress_hook.remove(); del model.ct_decompress_hook."
        )
    for name, module in modules:
        if type(module._parameters).__module__.startswith("compressed_tensors"):
            where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
            raise ValueError(
                f"{where} of {type(model).__name__} is managed by compressed-tensors' offloading (its decompression "
                "puts it on every module), which moves the tensors hf_prefetch places. Remove it first: "
                "compressed_tensors.offload.remove_dispatch(model, onload_tensors=True)."
            )


def _accelerate_hooks(module: nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])  # a SequentialHook holds several
