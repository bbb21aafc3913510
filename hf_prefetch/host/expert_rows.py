"""Where a routed tensor's experts lie in the checkpoint's files (`ExpertRows`), for the experts read from files as
their routers pick them ([Note: experts read from files] in runtime/file_experts.py), and reading such a tensor whole
(`read_whole`, for a removal)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..interrupts import deferred_interrupts
from .diskio import read_exactly
from .file_reads import FileExtent, StagedReads

__all__ = ["ExpertRows", "read_whole"]


@dataclass(frozen=True)
class ExpertRows:
    """Where a routed tensor's experts lie in files: `rows[e]`, the pieces of expert e's row (its slice along dimension
    0, `row_bytes` bytes), each an extent and the byte offset in the row where its bytes go; together they cover the
    row exactly."""

    row_bytes: int
    rows: tuple[tuple[tuple[FileExtent, int], ...], ...]

    @classmethod
    def whole(cls, extent: FileExtent, num_experts: int) -> ExpertRows:
        """The rows of a tensor stored whole (as is) at `extent`: one after another."""
        row = extent.nbytes // num_experts
        path, offset = extent.path, extent.offset
        return cls(row, tuple(((FileExtent(path, offset + e * row, row), 0),) for e in range(num_experts)))

    @property
    def extents(self) -> list[FileExtent]:
        return [extent for row in self.rows for extent, _ in row]


def read_whole(rows: ExpertRows, out: torch.Tensor, reader: StagedReads | None = None) -> torch.Tensor:
    """Fill `out` (a dense CPU tensor of the routed parameter's shape) with its bytes from the files (through the
    page cache), checking each read is whole; returns `out`. With `reader`, from the files it opened
    (`StagedReads.reopen`), each checked unchanged once opened and again once read."""
    flat = out.view(-1).view(torch.uint8).numpy()
    files: dict = {}
    try:
        for e, row in enumerate(rows.rows):
            for extent, at in row:
                if extent.path not in files:
                    with deferred_interrupts():  # opened and recorded together: closed below
                        fd = os.open(extent.path, os.O_RDONLY) if reader is None else reader.reopen(extent.path)
                        files[extent.path] = fd
                start = e * rows.row_bytes + at
                read_exactly(files[extent.path], flat[start : start + extent.nbytes], extent.offset, extent.path)
        for path in files if reader is not None else ():  # none changed while it was read
            reader.check_unchanged([path])
    finally:
        for fd in files.values():
            os.close(fd)
    return out
