"""The load's part for layers read from the checkpoint's files (`Placement.READ`, planning/file_tier.py): which
parameters may stay there, their host storage (the files' pages, mapped read-only, never pinned), where each lies in
its file, and the disk's direct read speed for the plan."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..host.arena import HostArena
from ..host.expert_rows import ExpertRows
from ..host.file_reads import FileExtent
from ..host.files import FilePiece
from ..host.read_speed import measure_read_gbps
from ..planning.file_tier import READ, Stored
from ..planning.offload_plan import OffloadPlan
from ..planning.placements import ParamSpec, Placement
from .checkpoint import Checkpoint, TensorEntry
from .keymap import KeyMap

__all__ = [
    "stored_layout",
    "extent_of",
    "expert_rows",
    "dense_as_is",
    "read_layout",
    "expert_storage",
    "file_storage",
    "write_layers",
    "with_read_speed",
]

logger = logging.getLogger(__name__)

_MEASURED_BYTES = 64 * 2**20  # what the load reads to time the disk


def stored_layout(keymap: KeyMap) -> Stored:
    """How the checkpoint of `keymap` stores each parameter (by full name) for the plan (`file_tier.Stored`)."""

    def as_is(name: str) -> bool:
        sources, tensor = keymap.streamed.get(name, []), keymap.model_tensors.get(name)
        if len(sources) != 1 or sources[0][1] is not None or tensor is None:
            return False
        entry = sources[0][0]
        size = tensor.element_size()
        same = entry.dtype == tensor.dtype and entry.nbytes == tensor.numel() * size > 0
        return same and _dense(tensor) and not entry.offset % size and entry.one_run

    @functools.cache  # the planner asks again for every layer it tries
    def row_pieces(name: str) -> int:
        rows = expert_rows(keymap, name)
        return max(len(row) for row in rows.rows) if rows is not None else 0

    return Stored(as_is, row_pieces)


def expert_rows(keymap: KeyMap, name: str) -> ExpertRows | None:
    """Where each expert's row of parameter `name` (dimension 0 indexes experts) lies in the checkpoint's files, where
    every byte of it is stored as the model holds it: a tensor stored whole as is, or experts stored one by one (in
    parts of the row, as transformers merges `experts.{e}.gate_proj` and `up_proj`); None otherwise."""
    sources, tensor = keymap.streamed.get(name, []), keymap.model_tensors.get(name)
    if not sources or tensor is None or tensor.dim() < 2 or not _dense(tensor) or tensor.numel() == 0:
        return None
    size, num_experts = tensor.element_size(), tensor.shape[0]
    row_bytes = tensor.numel() // num_experts * size
    if any(entry.dtype != tensor.dtype or entry.offset % size or not entry.one_run for entry, _ in sources):
        return None
    if len(sources) == 1 and sources[0][1] is None:
        entry = sources[0][0]
        return ExpertRows.whole(extent_of(entry), num_experts) if entry.nbytes == row_bytes * num_experts else None
    inner = row_bytes // tensor.shape[1]  # bytes of one index of the row's first dimension
    pieces: list[list[tuple[int, FileExtent]]] = [[] for _ in range(num_experts)]
    for entry, region in sources:
        if region is None or region[0] is None or not 0 <= region[0] < num_experts:
            return None
        index, first, length = region  # dest[index], narrowed to `length` rows from `first` (none: whole)
        first, length = (0, tensor.shape[1]) if first is None else (first, length)
        if entry.nbytes != length * inner:
            return None
        pieces[index].append((first * inner, extent_of(entry)))
    rows = []
    for row in pieces:
        row.sort(key=lambda piece: piece[0])
        covered = 0
        for at, extent in row:
            if at != covered:
                return None  # a gap or an overlap: not every byte is stored as the model holds it
            covered += extent.nbytes
        if covered != row_bytes:
            return None
        rows.append(tuple((extent, at) for at, extent in row))
    return ExpertRows(row_bytes, tuple(rows))


def _dense(tensor: torch.Tensor) -> bool:
    return tensor.stride() == torch.empty(tensor.shape, device="meta").stride()


def dense_as_is(model: torch.nn.Module) -> Stored:
    """For `dispatch_model(..., offload_folder=...)`: which parameters can be written to a file and read back as the
    model holds them (plain dense tensors; routed experts among them are written whole, their rows one after
    another)."""

    def check(name: str) -> bool:
        param = model.get_parameter(name)
        return type(param.data) is torch.Tensor and param.is_contiguous() and param.numel() > 0 and not param.is_meta

    return Stored(check, lambda name: int(check(name) and model.get_parameter(name).dim() >= 2))


def read_layout(plan: OffloadPlan, placement: Placement = READ) -> list[tuple[str, ParamSpec]]:
    """(layer path, spec) of every parameter of `placement` (READ: read from files whole; READ_ROUTED: routed experts
    read from files as picked), in plan order."""
    rings = plan.rings
    return [(ly.path, spec) for r in rings for ly in r.layers for spec in ly.offloaded if spec.placement is placement]


def expert_storage(layout: list[tuple[str, ParamSpec]], keymap: KeyMap) -> dict[str, ExpertRows]:
    """Where each expert of the tensors of `layout` (READ_ROUTED ones) lies in the checkpoint's files, by full name."""
    rows = {}
    for path, spec in layout:
        name = f"{path}.{spec.name}"
        found = expert_rows(keymap, name)
        if found is None:  # the plan placed only parameters whose rows `stored_layout` found
            raise RuntimeError(f"{name}: planned to be read from files by expert, but its rows are not stored as is.")
        rows[name] = found
    return rows


def file_storage(
    layout: list[tuple[str, ParamSpec]], keymap: KeyMap, checkpoint: Checkpoint
) -> tuple[HostArena | None, dict[str, FileExtent]]:
    """The host storage of the parameters read from files (an arena of the files' pages, mapped read-only; None
    without any) and where each lies in its file, by full name."""
    extents = {}
    for path, spec in layout:
        extents[f"{path}.{spec.name}"] = extent_of(keymap.streamed[f"{path}.{spec.name}"][0][0])
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
            extents.update({key: extent_of(entry) for key, entry in written.entries.items()})
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


def extent_of(entry: TensorEntry) -> FileExtent:
    """Where checkpoint tensor `entry` lies in its file."""
    return FileExtent(entry.path, entry.offset, entry.nbytes)


def with_read_speed(plan: OffloadPlan, extents: dict[str, FileExtent | ExpertRows]) -> OffloadPlan:
    """`plan` with the disk's direct read speed, timed on the largest file that layers (or experts) are read from."""
    if not extents:
        return plan
    sizes: dict = {}
    for where in extents.values():
        for extent in where.extents if isinstance(where, ExpertRows) else [where]:
            sizes[extent.path] = sizes.get(extent.path, 0) + extent.nbytes
    path = max(sizes, key=sizes.get)
    gbps = measure_read_gbps(path, _MEASURED_BYTES)
    logger.info("Layers read from files: %s reads at %.2f GB/s", path, gbps)
    return replace(plan, read_gbps=gbps)
