"""The load's part for layers read from the checkpoint's files (`Placement.READ`, planning/file_tier.py): which
parameters may stay there, their host storage (the files' pages, mapped read-only, never pinned), where each lies in
its file, and the disk's direct read speed for the plan."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..host.arena import HostArena
from ..host.file_reads import FileExtent, measure_read_gbps
from ..host.files import FilePiece
from ..planning.file_tier import READ
from ..planning.offload_plan import OffloadPlan
from ..planning.placements import ParamSpec
from .checkpoint import Checkpoint, TensorEntry
from .keymap import KeyMap

__all__ = ["stored_as_is", "dense_as_is", "read_layout", "file_storage", "write_layers", "with_read_speed"]

logger = logging.getLogger(__name__)

_MEASURED_BYTES = 64 * 2**20  # what the load reads to time the disk


def stored_as_is(keymap: KeyMap) -> Callable[[str], bool]:
    """Whether a parameter (its full name) is one checkpoint tensor stored as the model holds it: one source, no
    conversion, the same dtype and bytes, dense, at an offset aligned to its element size."""

    def check(name: str) -> bool:
        sources, tensor = keymap.streamed.get(name, []), keymap.model_tensors.get(name)
        if len(sources) != 1 or sources[0][1] is not None or tensor is None:
            return False
        entry = sources[0][0]
        dense = tensor.stride() == torch.empty(tensor.shape, device="meta").stride()
        size = tensor.element_size()
        same = entry.dtype == tensor.dtype and entry.nbytes == tensor.numel() * size > 0
        return same and dense and not entry.offset % size

    return check


def dense_as_is(model: torch.nn.Module) -> Callable[[str], bool]:
    """For `dispatch_model(..., offload_folder=...)`: whether a parameter can be written to a file and read back as the
    model holds it (a plain dense tensor)."""

    def check(name: str) -> bool:
        param = model.get_parameter(name)
        return type(param.data) is torch.Tensor and param.is_contiguous() and param.numel() > 0 and not param.is_meta

    return check


def read_layout(plan: OffloadPlan) -> list[tuple[str, ParamSpec]]:
    """(layer path, spec) of every parameter read from files, in plan order."""
    return [
        (layer.path, spec)
        for ring in plan.rings
        for layer in ring.layers
        for spec in layer.offloaded
        if spec.placement is READ
    ]


def file_storage(
    layout: list[tuple[str, ParamSpec]], keymap: KeyMap, checkpoint: Checkpoint
) -> tuple[HostArena | None, dict[str, FileExtent]]:
    """The host storage of the parameters read from files (an arena of the files' pages, mapped read-only; None
    without any) and where each lies in its file, by full name."""
    extents = {}
    for path, spec in layout:
        extents[f"{path}.{spec.name}"] = _extent(keymap.streamed[f"{path}.{spec.name}"][0][0])
    return _mapped(layout, extents, checkpoint.fd), extents


def write_layers(
    model: torch.nn.Module, layout: list[tuple[str, ParamSpec]], folder: str | os.PathLike
) -> tuple[HostArena | None, dict[str, FileExtent]]:
    """`dispatch_model(..., offload_folder=folder)`: the parameters of `layout` written once into `folder`, one
    safetensors file per layer (`<layer path>.safetensors`, replaced whole where it exists), and `file_storage`'s
    answer for them."""
    if not layout:
        return None, {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    extents: dict[str, FileExtent] = {}
    for layer in dict.fromkeys(path for path, _ in layout):
        names = [f"{path}.{spec.name}" for path, spec in layout if path == layer]
        target, partial = folder / f"{layer}.safetensors", folder / f".{layer}.safetensors.partial"
        save_file({name: model.get_parameter(name).detach().cpu().contiguous() for name in names}, partial)
        os.replace(partial, target)  # a new file: a model that maps the old one keeps its pages
        with Checkpoint.open(target) as written:  # its header names where each tensor lies
            extents.update({key: _extent(entry) for key, entry in written.entries.items()})
    fds: dict[Path, int] = {}

    def fd(path: Path) -> int:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    try:
        return _mapped(layout, extents, fd), extents
    finally:
        for opened in fds.values():
            os.close(opened)  # the arena keeps descriptors of its own


def _mapped(layout, extents: dict[str, FileExtent], fd) -> HostArena | None:
    # An arena whose every entry is its file's pages (mapped read-only, shared), in `layout`'s order.
    if not layout:
        return None
    pieces = [FilePiece(str(e.path), fd(e.path), e.offset) for e in (extents[f"{p}.{s.name}"] for p, s in layout)]
    return HostArena([spec.nbytes for _, spec in layout], files=pieces)


def _extent(entry: TensorEntry) -> FileExtent:
    return FileExtent(entry.path, entry.offset, entry.nbytes)


def with_read_speed(plan: OffloadPlan, extents: dict[str, FileExtent]) -> OffloadPlan:
    """`plan` with the disk's direct read speed, timed on the largest file that layers are read from."""
    if not extents:
        return plan
    sizes: dict = {}
    for extent in extents.values():
        sizes[extent.path] = sizes.get(extent.path, 0) + extent.nbytes
    path = max(sizes, key=sizes.get)
    gbps = measure_read_gbps(path, _MEASURED_BYTES)
    logger.info("Layers read from files: %s reads at %.2f GB/s", path, gbps)
    return replace(plan, read_gbps=gbps)
