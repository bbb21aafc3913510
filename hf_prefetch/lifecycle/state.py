"""The state a dispatch leaves on a model (`OffloadState`, `Lifecycle`, `get_state`) and the model's lock.

`OffloadState` is what `dispatch_model` and the loaders set up and what `remove_offload`, `stats`, `reload_weights`
and `sync_from_device` read. It lives here, not in `dispatch`, so that nothing imports `dispatch`. This module knows
no plans' internals, streams or hooks. What a verb checks before it changes anything is checks.py's.
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

from ..config import warn_at_caller
from ..host.offloaded import OffloadedParam
from ..interrupts import deferred_interrupts
from ..planning.offload_plan import format_bytes
from .guards import refuse_deepcopy, refuse_pickle
from .journal import Journal

if TYPE_CHECKING:
    from ..host.arena import HostArena
    from ..planning.offload_plan import OffloadPlan
    from ..runtime.engine import PrefetchEngine
    from .state_dict import WriteThrough

__all__ = ["OffloadState", "Lifecycle", "get_state", "FILES_READ_ONLY"]

FILES_READ_ONLY = (
    "hf_prefetch: the layers {layers} (or their routed experts) are read from the checkpoint's files at each use "
    "(max_memory['cpu'] holds less than what streams): their host storage is those files, so writing weights "
    "(load_state_dict, sync_from_device, weights_in_place) and state_dict() are refused. Nothing was changed. Write "
    "a changed checkpoint to a new folder and pass it to hf_prefetch.reload_weights(model, folder), which reads its "
    "files from then on; read the checkpoint's tensors with safetensors; or give max_memory['cpu'] room for every "
    "streamed layer."
)

STATE_ATTR = "_hf_prefetch_state"


class Lifecycle(Enum):
    """Where a dispatch stands. Only ATTACHED models compute; the others are half-done and finish on the next
    `remove_offload` (or `dispatch_model`), which resumes the journal where it stopped."""

    ATTACHING = "attaching"  # dispatch_model or a loader is changing the model
    ATTACHED = "attached"  # dispatched: hooks, pool and host storage in place
    DETACHING = "detaching"  # remove_offload (or a re-dispatch) is undoing the changes, keeping the weights' values
    ROLLING_BACK = "rolling back"  # a failed dispatch is undoing every change, back to the model as it was given


@dataclass(eq=False, repr=False)
class OffloadState:
    """Everything a dispatch set up on a model. The journal holds every change it made, in order, with its undo.
    Prints as one line (`print(hf_prefetch.get_state(model))`); `print(get_state(model).plan)` shows every layer."""

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
    # The forward gate (gate.ForwardGate: the model's `_call_impl` and `forward` wrapped) and the journal of its
    # arrival: they arrive with the state and leave with it, after everything else was undone (see `attach.begin`), so
    # that a half-done model refuses to compute until the end of its removal. The state holds the gate; the gate and
    # its wrappers hold the state and the gate only weakly.
    gate: Any = None
    gate_hooks: Journal = field(default_factory=Journal)
    write_throughs: list[WriteThrough] = field(default_factory=list)  # completed by the gate before each forward
    # The streamed parameters by the module that owns them, and those `weights_in_place` placed (`WeightsInPlace`,
    # in_place.py); None with the UVA backend.
    in_place: Any = None
    # Seconds per phase of the load that built this dispatch (`LoadTimeline`, loading/filling.py; empty after
    # dispatch_model).
    load_timeline: dict[str, float] = field(default_factory=dict)
    # Mapped host storage stays a file's pages: its copy into private memory before CUDA graphs failed
    # (`private_before_graphs`).
    private_refused: bool = False
    # Placement.READ ([Note: weights read from files] in runtime/read_ahead.py): the host storage of the layers read
    # from the checkpoint's files (their pages, mapped read-only, never pinned), where each parameter read from files
    # lies (`file_reads.FileExtent`; for READ_ROUTED ones, [Note: experts read from files] in
    # runtime/file_experts.py, `file_reads.ExpertRows`), and each ring's reads (`ReadAhead`, `FileExperts`).
    file_arena: HostArena | None = None
    file_extents: dict[str, Any] = field(default_factory=dict)  # full name -> FileExtent or ExpertRows
    reads: list[Any] = field(default_factory=list)
    # While `reload_weights` reads `state_dict()` for names and destinations only, under the model's lock (it hands
    # nothing out): the state-dict hooks then leave host storage as it is (`writable_host_storage`).
    listing: bool = False

    @property
    def reads_files(self) -> bool:
        """Whether parameters are read from the checkpoint's files (layers, or routed experts as picked)."""
        return bool(self.file_extents)

    def private_host_storage(self, keep_files: bool = False) -> None:
        """[Note: mapped host storage] in host/arena.py. Before host storage is written or handed out: streamed weights
        that are still a checkpoint file's pages become private memory (`HostArena.make_writable`), after every copy
        and kernel queued so far. Call under the model's lock. A no-op once done. Refused (RuntimeError, nothing
        changed) once a CUDA graph recorded copies from those pages: page-locking the private pages again would leave
        the graph's copies reading an address the device no longer maps. Refused (RuntimeError) for a dispatch whose
        layers are read from the checkpoint's files, which are those files' pages for good, unless `keep_files`: the
        caller writes no weight read from files (`reload_weights` switches them to new files instead)."""
        if self.reads_files and not keep_files:
            raise RuntimeError(FILES_READ_ONLY.format(layers=self.read_layers()))
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
        """[Note: mapped host storage] in host/arena.py. Before a forward (the gate's): a CUDA model that ran compiled
        code may record CUDA graphs from this call on (torch warms a compiled function up before recording it), whose
        copies must read private pages, never a file's, which could not be replaced under them. Where that copy fails
        (the host's memory), it warns once and the pages stay."""
        engine = self.engine
        if (
            self.reads_files  # CUDA graphs are refused for its layers read from files
            or engine is None
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

    def read_layers(self) -> str:
        """The layers read from the checkpoint's files, for messages."""
        rings = self.plan.rings
        paths = [ly.path for r in rings for ly in r.streamed if ly.read_from_files or ly.experts_from_files]
        return f"{paths[0]} .. {paths[-1]} ({len(paths)} layers)" if len(paths) > 1 else ", ".join(paths)

    def refused_loads(self) -> list[str]:
        """The parameters a `load_state_dict` may not name ([] without layers read from files): every streamed one,
        since a value for any of them writes host storage (`private_host_storage` refuses). Refused where the load
        starts, before torch writes the resident tensors that come first."""
        return [offloaded.param_name for offloaded in self.offloaded] if self.reads_files else []

    def close_reads(self) -> None:
        """End the reads of the layers read from files and unmap their pages (once no copy reads them)."""
        reads, self.reads = self.reads, []
        for read in reads:
            read.close()
        if self.file_arena is not None:
            self.file_arena.release()

    def __repr__(self) -> str:
        plan, layers = self.plan, [layer for ring in self.plan.rings for layer in ring.layers]
        if plan.backend == "uva":
            moved = f"mapped_layers='{sum(1 for layer in layers if layer.mapped)} of {len(layers)}'"
        else:
            moved = f"streamed_layers='{sum(1 for layer in layers if layer.streamed)} of {len(layers)}'"
        return (
            f"OffloadState(backend={plan.backend!r}, lifecycle={self.lifecycle.value!r}, device='{self.device}', "
            f"{moved}, device_bytes='{format_bytes(plan.device_bytes)}', host_bytes='{format_bytes(plan.host_bytes)}')"
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
    # With a Ctrl-C held back: one landing as the `with` block returns, before the guard's release, kept it for good.
    with deferred_interrupts(), _MODEL_LOCKS_GUARD:
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
