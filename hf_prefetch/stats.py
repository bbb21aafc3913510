"""Runtime statistics of a dispatched model: per-layer copies, bytes, copy, stall and compute seconds, misses.

Counting is always on and costs a few integer additions per layer. Seconds need `dispatch_model(..., timing=True)`:
they come from CUDA events read after they completed, so collecting them adds no host synchronisation to the
forward. This module only reads the engine's counters; it changes nothing. A snapshot prints (and shows in a REPL) as
a table, renders as HTML in Jupyter, and plots with matplotlib, an optional dependency imported only by
`TransferStats.plot`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .lifecycle.state import get_state

if TYPE_CHECKING:
    from matplotlib.axes import Axes

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
    # Routed experts (Placement.ROUTED, READ_ROUTED): expert rows copied from host memory as the router picked them
    # (each copy once: a repeated pick is copied again, except from files, where a forward copies each expert once),
    # their bytes (part of copied_bytes), and layers copied without their routed tensors that a forward of many
    # tokens completed.
    routed_rows: int = 0
    routed_bytes: int = 0
    completions: int = 0
    # The router's picks in forwards that routed (a repeated pick counts again), wherever each was found.
    routed_picks: int = 0
    # With an expert cache: picks found in it, and read from host memory at the router.
    cache_hits: int = 0
    cache_misses: int = 0
    # Picks found in the slot, fetched with its copy because the layer picked them in its previous forward
    # (PrefetchConfig.recent_experts; the fetched rows count in routed_rows, picked again or not).
    recent_hits: int = 0
    # Rows fetched ahead (in routed_rows), the bytes of one expert's rows, and the measured policy's decision with why
    # (`PrefetchConfig.recent_experts=None`: see hf_prefetch/runtime/expert_policy.py), "-" without recent picks.
    recent_fetched: int = 0
    expert_row_bytes: int = 0
    recent_policy: str = "-"
    recent_decision: str = "-"  # the same in a word: "on", "off", "always"
    recent_hit_rate: float | None = None  # of the rows a fetch brings, the share picked again; None: not measured yet
    # Bytes loaded into the expert cache (in copied_bytes).
    cache_loaded_bytes: int = 0
    # Compressed parameters (PrefetchConfig(compress=True)): values decoded into the slot, the compressed bytes they
    # were decoded from (counted in copied_bytes), how many decodes, and with timing their device time on the compute
    # stream.
    decoded_bytes: int = 0
    compressed_bytes: int = 0
    decodes: int = 0
    decode_seconds: float = 0.0
    # PrefetchConfig.cpu_experts: the router's picks computed on the host's cores, the expert bytes they read there
    # (not over the link), and the host's compute seconds (measured always, in its worker thread).
    host_picks: int = 0
    host_bytes: int = 0
    host_seconds: float = 0.0
    # Layers read from the checkpoint's files (max_memory['cpu'] below what streams): the bytes their copies read
    # from the files, and the seconds the copies waited for those reads (measured always; 0 where the reads ran ahead).
    read_bytes: int = 0
    read_wait_seconds: float = 0.0
    # Routed experts read from the checkpoint's files as picked: a forward's picked experts (once each) found in the
    # host expert cache, and read from the files into it.
    host_cache_hits: int = 0
    host_cache_misses: int = 0

    @property
    def host_cache_hit_rate(self) -> float | None:
        """Of the picked experts read from files or found in the host expert cache, the share found (None: none)."""
        picked = self.host_cache_hits + self.host_cache_misses
        return self.host_cache_hits / picked if picked else None

    @property
    def gbps(self) -> float:
        return self.copied_bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0

    @property
    def recent_wasted_bytes(self) -> int:
        """Bytes of the rows fetched ahead that the router did not pick again: crossed the link for nothing."""
        return max(0, self.recent_fetched - self.recent_hits) * self.expert_row_bytes

    @property
    def recent_saved_bytes(self) -> int:
        """Bytes of the picks found fetched ahead: copies taken off the router's path (they crossed the link too)."""
        return self.recent_hits * self.expert_row_bytes

    @property
    def cache_saved_bytes(self) -> int:
        """Bytes of the picks found in the expert cache: they did not cross the link (loading it did: see
        `cache_loaded_bytes`)."""
        return self.cache_hits * self.expert_row_bytes

    @property
    def compression(self) -> float:
        """Compressed bytes per decoded byte (0.0 before the first decode)."""
        return self.compressed_bytes / self.decoded_bytes if self.decoded_bytes else 0.0


def _summed(name: str) -> property:
    # A total of TransferStats: the layers' `name` added up.
    return property(lambda self: sum(getattr(layer, name) for layer in self.layers), doc=f"LayerStats.{name} summed.")


@dataclass(frozen=True, repr=False)
class TransferStats:
    """A snapshot of the transfer counters. `print(stats)` and a REPL show a table; Jupyter shows it as HTML."""

    layers: tuple[LayerStats, ...]
    timing: bool

    copies = _summed("copies")
    copied_bytes = _summed("copied_bytes")
    misses = _summed("misses")
    routed_rows = _summed("routed_rows")
    routed_bytes = _summed("routed_bytes")
    routed_picks = _summed("routed_picks")
    completions = _summed("completions")
    cache_hits = _summed("cache_hits")
    cache_misses = _summed("cache_misses")
    recent_hits = _summed("recent_hits")
    recent_wasted_bytes = _summed("recent_wasted_bytes")
    cache_saved_bytes = _summed("cache_saved_bytes")
    cache_loaded_bytes = _summed("cache_loaded_bytes")
    decoded_bytes = _summed("decoded_bytes")
    compressed_bytes = _summed("compressed_bytes")
    host_picks = _summed("host_picks")
    host_bytes = _summed("host_bytes")
    host_seconds = _summed("host_seconds")
    read_bytes = _summed("read_bytes")
    read_wait_seconds = _summed("read_wait_seconds")
    host_cache_hits = _summed("host_cache_hits")
    host_cache_misses = _summed("host_cache_misses")
    decodes = _summed("decodes")
    decode_seconds = _summed("decode_seconds")
    copy_seconds = _summed("copy_seconds")
    stall_seconds = _summed("stall_seconds")
    compute_seconds = _summed("compute_seconds")

    @property
    def compression(self) -> float:
        """Compressed bytes per decoded byte over all layers (0.0 before the first decode)."""
        return self.compressed_bytes / self.decoded_bytes if self.decoded_bytes else 0.0

    @property
    def host_cache_hit_rate(self) -> float | None:
        """Of the picked experts read from files or found in the host expert cache, the share found (None: none)."""
        picked = self.host_cache_hits + self.host_cache_misses
        return self.host_cache_hits / picked if picked else None

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
            routed = (
                str(item.routed_rows),
                f"{item.routed_bytes / 2**20:.1f}",
                str(item.completions),
                str(item.cache_hits),
                str(item.cache_misses),
                str(item.recent_hits),
                f"{item.recent_wasted_bytes / 2**20:.1f}",
                f"{item.cache_saved_bytes / 2**20:.1f}",
                _recent_cell(layer) if layer else "-",
            )
            decoded = (
                f"{item.compressed_bytes / 2**20:.1f}",
                f"{item.decoded_bytes / 2**20:.1f}",
                f"{item.compression:.3f}",
                str(item.decodes),
            )
            decoded += (f"{item.decode_seconds * 1e3:.2f}",) if self.timing else ("-",)
            host = (str(item.host_picks), f"{item.host_bytes / 2**20:.1f}", f"{item.host_seconds * 1e3:.2f}")
            read = (f"{item.read_bytes / 2**20:.1f}", f"{item.read_wait_seconds * 1e3:.2f}")
            host_cache = (str(item.host_cache_hits), str(item.host_cache_misses))
            rows.append(
                (
                    name,
                    str(item.copies),
                    f"{item.copied_bytes / 2**20:.1f}",
                    *(timed if self.timing else ("-",) * len(timed)),
                    str(item.misses),
                    *(routed if self._routed else ()),
                    *(decoded if self.decodes else ()),  # compressed layers that decoded
                    *(host if self.host_picks else ()),
                    *(read if self.read_bytes else ()),
                    *(host_cache if self._host_cached else ()),  # experts read from files
                )
            )
        return rows

    _HEADER = ("layer", "copies", "copied MiB", "copy ms", "GB/s", "stall ms", "compute ms", "misses")
    _ROUTED_HEADER = (
        "routed experts",
        "routed MiB",
        "completions",
        "cache hits",
        "cache misses",
        "recent hits",
        "wasted MiB",
        "cache saved MiB",
        "recent",
    )
    _DECODED_HEADER = ("compressed MiB", "decoded MiB", "ratio", "decodes", "decode ms")

    @property
    def _routed(self) -> bool:
        # Routed-experts columns only for a model whose experts were routed (or completed) at least once.
        return bool(self.routed_rows or self.completions or self.cache_hits)

    @property
    def _header(self) -> tuple[str, ...]:
        return (
            self._HEADER
            + (self._ROUTED_HEADER if self._routed else ())
            + (self._DECODED_HEADER if self.decodes else ())
            + (("host picks", "host MiB", "host ms") if self.host_picks else ())
            + (("read MiB", "read wait ms") if self.read_bytes else ())
            + (("host cache hits", "host cache misses") if self._host_cached else ())
        )

    @property
    def _host_cached(self) -> bool:
        # Host expert cache columns only for a model whose experts read from files were picked at least once.
        return bool(self.host_cache_hits or self.host_cache_misses)

    def __str__(self) -> str:
        rows = [self._header, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        if not self.timing:
            lines.append("(seconds need dispatch_model(..., timing=True))")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)  # the table, where a REPL shows the value (`.layers` holds each LayerStats)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{cell}</th>" for cell in self._header)
        body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in self._rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def plot(self, ax: Axes | None = None) -> Axes:
        """Per-layer copy, compute and stall time as grouped bars, in milliseconds (totals, as in the table).

        A copy is hidden when it takes no longer than the compute that runs while it is in flight; the stall bars
        show what was not hidden. Needs matplotlib (`pip install "hf_prefetch[plot]"`) and statistics of a model
        dispatched with `timing=True`.

        Args:
            ax (`matplotlib.axes.Axes`, *optional*): Where to draw. By default a new figure (through pyplot, so that
                Jupyter shows it).

        Returns:
            The `matplotlib.axes.Axes` drawn on; `ax.figure` is its figure.

        Example:

        ```python
        >>> import matplotlib
        >>> matplotlib.use("Agg")  # no window; Jupyter shows the figure inline
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import hf_prefetch
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64)).eval()
        >>> model = hf_prefetch.dispatch_model(
        ...     model, hf_prefetch.PrefetchConfig(prefetch_step=1), device="cpu", timing=True)
        >>> _ = model(torch.tensor([[1, 2, 3]]))
        >>> ax = hf_prefetch.stats(model).plot()
        >>> [bars.get_label() for bars in ax.containers], [label.get_text() for label in ax.get_xticklabels()]
        (['copy', 'compute', 'stall'], ['1', '3'])
        >>> ax.figure.savefig("stats.png")  # doctest: +SKIP
        >>> model = hf_prefetch.remove_offload(model)

        ```
        """
        if not self.timing:
            raise ValueError(
                "These statistics have no seconds to plot: the model was dispatched without timing=True, so only "
                "copies, bytes and misses were counted. Dispatch with timing, e.g. "
                "hf_prefetch.dispatch_model(model, replace=True, timing=True, ...) or "
                "hf_prefetch.from_pretrained(path, timing=True, ...), run the model, then plot "
                "hf_prefetch.stats(model)."
            )
        if ax is None:
            plt = _pyplot()
            width_inches = min(max(6.4, 0.3 * len(self.layers) + 1.5), 16.0)
            _, ax = plt.subplots(figsize=(width_inches, 3.6), layout="constrained")
        labels, list_path = _tick_labels([layer.path for layer in self.layers])
        bar_width = 0.8 / len(_SERIES)
        for i, (name, attribute, color) in enumerate(_SERIES):
            offset = (i - (len(_SERIES) - 1) / 2) * bar_width  # the series side by side, centred on the tick
            x = [position + offset for position in range(len(self.layers))]
            milliseconds = [getattr(layer, attribute) * 1e3 for layer in self.layers]
            ax.bar(x, milliseconds, bar_width, label=name, color=color)
        long_labels = any(len(label) > 3 for label in labels)
        ax.set_xticks(range(len(labels)), labels, rotation=90 if long_labels else 0)
        ax.set_xlabel(f"streamed layer of {list_path}" if list_path else "streamed layer")
        ax.set_ylabel("ms (total)")
        ax.set_title(
            f"copy {self.copy_seconds * 1e3:.2f} ms ({self.gbps:.1f} GB/s), compute {self.compute_seconds * 1e3:.2f} "
            f"ms, stall {self.stall_seconds * 1e3:.2f} ms, {self.misses} miss{'es' if self.misses != 1 else ''}"
            if self.layers
            else "no streamed layers: nothing is copied",
            fontsize="medium",
        )
        ax.margins(y=0.2)  # room above the bars for the legend (bars keep their base at 0)
        ax.legend(ncols=len(_SERIES), loc="upper right")
        return ax


# The bars of `TransferStats.plot`: (legend label, LayerStats attribute in seconds, colour).
_SERIES = (
    ("copy", "copy_seconds", "tab:blue"),
    ("compute", "compute_seconds", "tab:green"),
    ("stall", "stall_seconds", "tab:red"),
)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "TransferStats.plot needs matplotlib, an optional dependency of hf_prefetch: "
            'pip install "hf_prefetch[plot]" (from a clone of the repository: pip install -e ".[plot]"), or '
            "pip install matplotlib."
        ) from err
    return plt


def _tick_labels(paths: list[str]) -> tuple[list[str], str]:
    # ["model.layers.1", "model.layers.3"] -> (["1", "3"], "model.layers"): the dotted parts all paths share are said
    # once, in the axis label. Paths of two layer lists (encoder and decoder) keep what tells them apart.
    parts = [path.split(".") for path in paths]
    shared = 0
    while parts and shared < min(len(p) for p in parts) - 1 and len({p[shared] for p in parts}) == 1:
        shared += 1
    return [".".join(p[shared:]) for p in parts], ".".join(parts[0][:shared]) if parts else ""


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
    >>> model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(prefetch_step=1), device="cpu")
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
            recent = layer.recent.policy if layer.recent is not None else None
            layers.append(
                LayerStats(
                    planned.path,
                    c.copies,
                    c.copied_bytes,
                    c.misses,
                    c.copy_seconds,
                    c.stall_seconds,
                    c.compute_seconds,
                    c.routed_rows,
                    c.routed_bytes,
                    c.completions,
                    c.routed_picks,
                    c.cache_hits,
                    c.cache_misses,
                    c.recent_hits,
                    c.recent_fetched,
                    sum(t.nbytes // t.num_experts for t in layer.routed),
                    recent.describe() if recent is not None else "-",
                    recent.state if recent is not None else "-",
                    recent.hit_rate if recent is not None and recent.decisions else None,
                    c.cache_loaded_bytes,
                    c.decoded_bytes,
                    c.compressed_bytes,
                    c.decodes,
                    c.decode_seconds,
                    c.host_picks,
                    c.host_bytes,
                    c.host_seconds,
                    c.read_bytes,
                    c.read_wait_seconds,
                    c.host_cache_hits,
                    c.host_cache_misses,
                )
            )
    return TransferStats(tuple(layers), engine.timing)


def _recent_cell(layer: LayerStats) -> str:
    # The table's cell: the decision, and once measured the share of fetched rows picked again ("on 97%").
    if layer.recent_hit_rate is None:
        return layer.recent_decision
    return f"{layer.recent_decision} {layer.recent_hit_rate:.0%}"


def reset_stats(model: nn.Module) -> None:
    """Zero the statistics of a dispatched model (e.g. after warm-up)."""
    _engine(model).reset()


def _engine(model: nn.Module):
    state = get_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not dispatched by hf_prefetch: it has no transfer statistics.")
    if state.engine is None:
        raise ValueError(
            f"{type(model).__name__} is dispatched with the UVA backend, which makes no copies (its kernels read host "
            "memory in place): there are no transfer statistics. They exist for offload='prefetch'."
        )
    return state.engine
