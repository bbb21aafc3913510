"""`reload_weights` of a dispatch that reads weights from the checkpoint's files at each use ([Note: weights read from
files] in runtime/read_ahead.py, [Note: experts read from files] in runtime/file_experts.py).

Those weights' host storage is the files themselves, mapped read-only, so a reload does not write it: it reads them
from the new checkpoint's files from then on. `FileSwitch` finds each of them there (stored as the model holds it:
one tensor of its dtype, or an expert's rows), maps the new files and opens them for each ring's reads, before
anything of the dispatch changes; `commit` puts all of it in place at once, once no copy reads the old files. The
new checkpoint's files are then what the model reads: they must stay as they are while it does, like the first ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..host.arena import HostArena
from ..host.expert_rows import ExpertRows
from ..host.file_reads import FileExtent, Retarget
from ..interrupts import deferred_interrupts
from ..lifecycle.state import OffloadState
from ..planning.file_tier import READ, READ_ROUTED
from ..runtime.file_experts import FileExpertLayer, expert_units
from ..runtime.read_ahead import read_extents
from .checkpoint import Checkpoint
from .file_layers import expert_rows, extent_of, file_storage, read_layout, stored_layout, with_read_speed
from .keymap import KeyMap

__all__ = ["FileSwitch"]


class FileSwitch:
    """Everything `state` reads from files, found in the checkpoint of `keymap` and opened there, nothing of the
    dispatch changed yet: each tensor's place in the new files, the mapped pages of those that have host storage,
    each reader's new files (`StagedReads.retarget`) and the disk's speed for the plan. Raises ValueError naming a
    tensor the new checkpoint does not store as the model holds it, and the error of a file that cannot be opened or
    mapped, with everything it opened closed. `commit` reads the new files from then on; `close` drops what was not
    committed."""

    def __init__(self, state: OffloadState, keymap: KeyMap, checkpoint: Checkpoint) -> None:
        self.state = state
        self.arena: HostArena | None = None
        self.readers: list[tuple[Any, Retarget, list[FileExpertLayer] | None]] = []
        hosts = {o.full_name: o.host for o in state.offloaded}
        as_is = stored_layout(keymap).as_is
        self.extents = _stored(state.file_extents, keymap, as_is, checkpoint)
        plan = state.plan
        # The tensors with host storage (the files' mapped pages), in the order the arena holds them: every layer's
        # read from files, and routed experts written whole by dispatch_model(offload_folder=...) that the new
        # checkpoint stores whole too (stored by expert, they keep no host storage: read as picked, as a load's).
        routed = [(p, s) for p, s in read_layout(plan, READ_ROUTED) if not hosts[f"{p}.{s.name}"].is_meta]
        self.mapped = read_layout(plan, READ) + [(p, s) for p, s in routed if as_is(f"{p}.{s.name}")]
        self.unmapped = [f"{p}.{s.name}" for p, s in routed if not as_is(f"{p}.{s.name}")]
        try:
            self.arena, _ = file_storage(self.mapped, keymap, checkpoint)
            readers = iter(state.reads)  # per ring as the dispatch made them: its layers' reads, then its experts'
            for ring in plan.rings:
                if any(layer.read_from_files for layer in ring.streamed):
                    ahead = next(readers)
                    self.readers.append((ahead, ahead.reads.retarget(read_extents(ring, self.extents)), None))
                if any(layer.experts_from_files for layer in ring.streamed):
                    experts = next(readers)
                    units, specs = expert_units(ring, self.extents)
                    if not experts.same_units(specs):
                        raise RuntimeError(f"hf_prefetch: the host expert cache of {ring.path} has other layers now.")
                    self.readers.append((experts, experts.reads.retarget(units), specs))
            self.plan = with_read_speed(plan, self.extents)
        except BaseException:
            self.close()
            raise

    def commit(self) -> None:
        """Read the new files from now on: each reader switched (its reads ended, a host expert cache emptied), the
        host storage of the tensors read from files the new files' pages, the old ones unmapped. Call after
        `engine.drain()` and `engine.invalidate()`, and refill the slots after."""
        state = self.state
        by_name = {o.full_name: o for o in state.offloaded}
        # Everything new made first (nothing below raises once the readers switch): each host tensor's replacement.
        new: dict[int, torch.Tensor] = {}
        for index, (path, spec) in enumerate(self.mapped):
            new[id(by_name[f"{path}.{spec.name}"].host)] = self.arena.view(index, spec.shape, spec.stride, spec.dtype)
        for name in self.unmapped:  # [Note: experts read from files]: no host storage, read whole on a removal
            host = by_name[name].host
            new[id(host)] = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="meta")
        routed = {}
        for ring in state.engine.rings:
            for transfer in ring.layers:
                for i, tensor in enumerate(transfer.routed):
                    if id(tensor.host) in new:  # gathered from the host expert cache, not read: kept true anyway
                        host = new[id(tensor.host)]
                        routed[id(transfer), i] = replace(tensor, host=host, source=host)
        with deferred_interrupts():  # all of it or none of it
            for reader, files, specs in self.readers:
                reader.switch(files) if specs is None else reader.switch(files, specs)
            for offloaded in state.offloaded:
                offloaded.host = new.get(id(offloaded.host), offloaded.host)
            for ring in state.engine.rings:
                for transfer in ring.layers:
                    transfer.host[:] = [new.get(id(host), host) for host in transfer.host]
                    for i, tensor in enumerate(transfer.routed):
                        transfer.routed[i] = routed.get((id(transfer), i), tensor)
            old, state.file_arena = state.file_arena, self.arena
            state.file_extents, state.plan = self.extents, self.plan
            self.arena, self.readers = None, []
            if old is not None:  # its pages are read no more (the journal's views of them are re-pointed on removal)
                old.release(forget_files=True)

    def close(self) -> None:
        """Close what was opened and not committed (a no-op after `commit`)."""
        with deferred_interrupts():
            for _, files, _ in self.readers:
                files.discard()
            self.readers = []
            if self.arena is not None:
                self.arena.release()
                self.arena = None


def _stored(
    extents: dict[str, FileExtent | ExpertRows], keymap: KeyMap, as_is: Callable[[str], bool], checkpoint: Checkpoint
) -> dict[str, FileExtent | ExpertRows]:
    # Where the new checkpoint stores each tensor read from files, as the model holds it (`as_is`: one tensor stored
    # so): a layer's whole, routed experts by expert (or whole); ValueError otherwise.
    found: dict[str, FileExtent | ExpertRows] = {}
    for name, where in extents.items():
        if isinstance(where, ExpertRows):
            rows = expert_rows(keymap, name)
            if rows is None:
                raise ValueError(_not_as_held(name, keymap, checkpoint, "each expert's rows"))
            found[name] = rows
        elif as_is(name):
            found[name] = extent_of(keymap.streamed[name][0][0])
        else:
            raise ValueError(_not_as_held(name, keymap, checkpoint, "one tensor"))
    return found


def _not_as_held(name: str, keymap: KeyMap, checkpoint: Checkpoint, how: str) -> str:
    tensor = keymap.model_tensors[name]
    sources = keymap.streamed.get(name, [])
    if sources:
        stored = ", ".join(f"{entry.key!r} ({entry.dtype}, {list(entry.shape)})" for entry, _ in sources[:4])
        where = f"{sources[0][0].path} stores it as {stored}{' ...' if len(sources) > 4 else ''}"
    else:
        where = f"the checkpoint at {checkpoint.folder} fills it through a conversion of other tensors"
    return (
        f"{name} is read from the checkpoint's files at each use (max_memory['cpu'] holds less than what streams), so "
        f"reload_weights reads it from the new checkpoint's files from then on, which must hold it as the model does "
        f"({how}: {tensor.dtype}, {list(tensor.shape)}, stored as is), but {where}. Save the new weights in the "
        "model's dtypes (model.save_pretrained does), or call hf_prefetch.remove_offload(model) and load the new "
        "checkpoint with hf_prefetch.from_pretrained. Nothing was written."
    )
