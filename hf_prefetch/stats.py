"""Runtime statistics of a dispatched model: per-layer copies, bytes, copy and stall seconds, misses.

Counting is always on and costs a few integer additions per layer. Seconds need `dispatch_model(..., timing=True)`:
they come from CUDA events read after they completed, so collecting them adds no host synchronisation to the
forward. This module only reads the engine's counters; it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .dispatch import get_state

__all__ = ["TransferStats", "LayerStats", "stats", "reset_stats"]


@dataclass(frozen=True)
class LayerStats:
    path: str
    copies: int
    copied_bytes: int
    misses: int
    copy_seconds: float
    stall_seconds: float
    compute_seconds: float

    @property
    def gbps(self) -> float:
        return self.copied_bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0


@dataclass(frozen=True)
class TransferStats:
    """A snapshot of the transfer counters. `print(stats)` shows a table; Jupyter shows it as HTML."""

    layers: tuple[LayerStats, ...]
    timing: bool

    @property
    def copies(self) -> int:
        return sum(layer.copies for layer in self.layers)

    @property
    def copied_bytes(self) -> int:
        return sum(layer.copied_bytes for layer in self.layers)

    @property
    def misses(self) -> int:
        return sum(layer.misses for layer in self.layers)

    @property
    def copy_seconds(self) -> float:
        return sum(layer.copy_seconds for layer in self.layers)

    @property
    def stall_seconds(self) -> float:
        return sum(layer.stall_seconds for layer in self.layers)

    @property
    def compute_seconds(self) -> float:
        return sum(layer.compute_seconds for layer in self.layers)

    @property
    def gbps(self) -> float:
        """Achieved host-to-device bandwidth while copying (GB/s), 0 without timing."""
        return self.copied_bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for layer in [*self.layers, None]:
            item = layer or self
            name = layer.path if layer else "total"
            timed = (
                f"{item.copy_seconds * 1e3:.2f}",
                f"{item.gbps:.1f}",
                f"{item.stall_seconds * 1e3:.2f}",
                f"{item.compute_seconds * 1e3:.2f}",
            )
            rows.append(
                (
                    name,
                    str(item.copies),
                    f"{item.copied_bytes / 2**20:.1f}",
                    *(timed if self.timing else ("-",) * len(timed)),
                    str(item.misses),
                )
            )
        return rows

    _HEADER = ("layer", "copies", "copied MiB", "copy ms", "GB/s", "stall ms", "compute ms", "misses")

    def __str__(self) -> str:
        rows = [self._HEADER, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._HEADER))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        if not self.timing:
            lines.append("(seconds need dispatch_model(..., timing=True))")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{cell}</th>" for cell in self._HEADER)
        body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in self._rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def stats(model: nn.Module) -> TransferStats:
    """Per-layer transfer statistics of a dispatched model, since dispatch or the last `reset_stats`.

    Reading them waits for the device (outside the forward) so that every timed copy is counted.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64)).eval()
    >>> model = hf_prefetch.dispatch_model(model, device="cpu", group_size=2, num_in_group=1, prefetch_step=1)
    >>> _ = model(torch.tensor([[1, 2, 3]]))
    >>> s = hf_prefetch.stats(model)
    >>> s.copies, s.misses, [layer.path for layer in s.layers]
    (3, 0, ['model.layers.1', 'model.layers.3'])
    >>> model = hf_prefetch.remove_offload(model)

    ```
    """
    engine = _engine(model)
    engine.collect()
    layers = []
    for ring, transfers in zip(get_state(model).plan.rings, engine.rings, strict=True):
        for planned, layer in zip(ring.streamed, transfers.layers, strict=True):
            c = layer.counters
            layers.append(
                LayerStats(
                    planned.path,
                    c.copies,
                    c.copied_bytes,
                    c.misses,
                    c.copy_seconds,
                    c.stall_seconds,
                    c.compute_seconds,
                )
            )
    return TransferStats(tuple(layers), engine.timing)


def reset_stats(model: nn.Module) -> None:
    """Zero the statistics of a dispatched model (e.g. after warm-up)."""
    _engine(model).reset()


def _engine(model: nn.Module):
    state = get_state(model)
    if state is None or state.engine is None:
        raise ValueError(f"{type(model).__name__} is not dispatched by hf_prefetch: it has no transfer statistics.")
    return state.engine
