"""Undoing a dispatch: `detach` (removal and re-dispatch: the wiring undone, the weights kept where they are or moved
to a target device), `rollback` (a failed dispatch: back to the model as it was given), `finish_interrupted` (either,
resumed after an interrupt), and the undo a deleted model's finalizer runs (`collected`). Each replays the state's
journal ([Note: the journal] in journal.py) and is resumable."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..formats.bnb import settle_int8, unpack_for
from ..formats.parts import assign
from ..host import limits
from ..host.arena import HostArena
from ..host.expert_rows import read_whole
from ..host.offloaded import OffloadedParam
from ..interrupts import deferred_interrupts
from .journal import Phase, move_tensors
from .state import STATE_ATTR, Lifecycle, OffloadState

__all__ = ["detach", "rollback", "finish_interrupted", "collected"]


def detach(model: nn.Module, state: OffloadState, target: torch.device | None) -> None:
    """Undo the ATTACH steps (the weights keep their values where they are), move everything to `target` (None: leave
    streamed weights in host memory, for a re-dispatch) and release the host storage. Resumable."""
    # Routed experts read from files have no host storage: read whole into memory first (a file changed on disk or
    # too little memory refuses the removal, with nothing undone).
    experts = _experts_read(state)
    if target is None or target.type != "cuda":
        # The weights stay in host storage, now the model's: a file's pages become private memory first, before
        # anything is undone (a file changed on disk refuses the removal and leaves the model as it was).
        _quiesce(state)
        state.arena.make_writable()
        if state.file_arena is not None:  # layers read from files: copied into memory (the host's limits checked)
            state.file_arena.make_writable()
    elif state.lifecycle is Lifecycle.ATTACHED:
        state.arena.check_files()  # its pages no longer hold the loaded weights: refused before anything is undone
        if state.file_arena is not None:
            state.file_arena.check_files()
    state.lifecycle, state.target = Lifecycle.DETACHING, target
    try:
        _quiesce(state)
        state.journal.unwind(Phase.ATTACH)
        state.engine = None  # drop the pool (hooks held the engine too): its memory is reused by the moves below
        for offloaded, value in experts:  # its placeholder again: pointed at its values
            offloaded.param.data = value
        for offloaded in state.offloaded:  # read from files: the files read now (a reload may have switched them)
            if offloaded.full_name in state.file_extents and not offloaded.host.is_meta:
                assign(offloaded.param, offloaded.attr, offloaded.host)
        if target is not None:
            move_tensors(model, target)
    except BaseException:
        # Stopped half-way (a GPU out of memory, a Ctrl-C): what did not move lies in host storage the caller may
        # now write, so none of it may stay a file's read-only pages (a write would crash the process).
        _files_writable(state.arena)
        if state.file_arena is not None:
            _files_writable(state.file_arena)
        raise
    if target is not None:
        unpack_for(model, target)  # 4-bit layers repacked for the CPU kernels, moved to a GPU: as .cuda() does
    settle_int8(model)  # 8-bit layers as freshly quantized ones (formats/bnb.py)
    _end(model, state)


def _experts_read(state: OffloadState) -> list[tuple[OffloadedParam, torch.Tensor]]:
    # [Note: experts read from files] in runtime/file_experts.py: each such tensor's values, read whole from the files.
    found = [(o, state.file_extents[o.full_name]) for o in state.offloaded if o.host.is_meta]
    if not found:
        return []
    limits.check_host_memory(sum(o.host.numel() * o.host.element_size() for o, _ in found), limits.host_limits())
    # From the files the model reads (the same where a path was replaced since); one written since refuses it.
    readers = [(set(read.reads.opened_files), read.reads) for read in state.reads]
    values = []
    for offloaded, rows in found:
        value = torch.empty_strided(offloaded.host.shape, offloaded.host.stride(), dtype=offloaded.host.dtype)
        paths = {extent.path for extent in rows.extents}
        reader = next(reads for opened, reads in readers if paths <= opened)  # its ring's: it opened them all
        values.append((offloaded, read_whole(rows, value, reader)))
    return values


def _files_writable(arena: HostArena) -> None:
    # A copy of the files' bytes in private memory where it can be made; where not (the host's memory, a file changed
    # on disk, a second Ctrl-C during the copy), the pages mapped copy-on-write (`HostArena.files_copy_on_write`):
    # writable, no copy, but they follow the file until written. The caller sees the error that stopped the removal
    # (or the second Ctrl-C, chained to it).
    if not arena.file_bytes:
        return
    try:
        arena.make_writable()
    except BaseException as err:
        with deferred_interrupts():
            arena.files_copy_on_write()
        if not isinstance(err, Exception):
            raise


def rollback(model: nn.Module, state: OffloadState) -> None:
    """Undo every step of a failed dispatch, back to the model as it was given. Resumable."""
    state.lifecycle = Lifecycle.ROLLING_BACK
    _quiesce(state)
    state.journal.unwind(Phase.PLACE)
    state.engine = None
    _end(model, state)


def finish_interrupted(model: nn.Module, state: OffloadState) -> None:
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
        state.close_reads()
        # A caller may still hold the state (`get_state`): it must not keep the pool or host storage alive.
        state.offloaded, state.write_throughs, state.engine, state.in_place = [], [], None, None
        state.gate_hooks.unwind(Phase.ATTACH)
        if model.__dict__.get(STATE_ATTR) is state:
            del model.__dict__[STATE_ATTR]


def collected(state: OffloadState) -> None:
    # The model was deleted while dispatched, or half-way (see `begin`): nothing may read host storage once it is
    # released. The collector runs this wherever the last reference went, which may be inside a dispatch mode (a
    # FakeTensorMode while torch.compile traces another model): the undo steps work on real tensors, outside any mode.
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        if state.engine is not None:
            state.engine.synchronize()
        state.journal.unwind(Phase.ATTACH)
        state.gate_hooks.unwind(Phase.ATTACH)  # parts a caller kept (`decoder = model.model`) run ungated again
        state.arena.release()
        state.close_reads()
