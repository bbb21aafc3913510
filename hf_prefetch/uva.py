"""The UVA backend's plan: which parameters stay in pinned host memory, read by the kernels over the bus.

With UVA (unified virtual addressing) a parameter kept in page-locked host memory is handed to the kernels as a CUDA
tensor whose address is that host memory (`HostArena.map`): every kernel that reads it reads it over the bus, with no
copy, no buffer pool, no hooks and no streams. That suits a weight read once per forward (batch-1 decoding: a GEMV
reads each weight once, at link speed) and not one read many times (a long prefill's GEMM reads each weight tile once
per tile of tokens, each time over the bus); see "Which backend" in docs/getting_started.md.

`make_uva_plan` is pure like `make_plan`: it reads names, shapes and dtypes (a meta model is fine) and moves nothing;
`dispatch` executes the plan. This module knows nothing about devices, hooks or the host arena.
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .offload_config import UVAConfig
from .plan import (
    LayerPlan,
    ParamSpec,
    RingPlan,
    _dense_stride,
    _param_bytes,
    _resolve_layer_lists,
    format_bytes,
    model_bytes,
    segment_matches,
)

__all__ = ["UVAPlan", "make_uva_plan"]

_warned_on_cpu = False


@dataclass(frozen=True)
class UVAPlan:
    """What `dispatch_model(offload="uva")` does: the parameters kept in pinned host memory, layer by layer.

    `rings` has one `RingPlan` per layer list, as in `OffloadPlan`; a layer's `params` are its parameters kept in host
    memory (there is no pool: `slot` is None and `num_slots` 0). `print(plan)` shows a table.
    """

    config: UVAConfig
    rings: tuple[RingPlan, ...]
    resident_bytes: int  # weights and buffers on the execution device

    @property
    def offloaded_bytes(self) -> int:
        """Bytes kept in pinned host memory."""
        return sum(ring.offloaded_bytes for ring in self.rings)

    @property
    def pool_bytes(self) -> int:
        """0: UVA reads host memory in place, through no device buffer."""
        return 0

    @property
    def device_bytes(self) -> int:
        """The weights' device footprint (activations and the KV cache come on top)."""
        return self.resident_bytes

    @property
    def streamed_bytes_per_forward(self) -> int:
        """The least that crosses the bus per forward: every host byte once. A GEMM over many tokens reads a weight
        once per tile of tokens, so a long prefill reads several times this."""
        return self.offloaded_bytes

    _HEADER = ("layer", "placement", "resident", "host")

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for ring in self.rings:
            for layer in ring.layers:
                if not layer.params:
                    placement = "resident"
                else:
                    placement = "host" if layer.resident_bytes == 0 else "partly"
                host = format_bytes(layer.offloaded_bytes) if layer.params else "-"
                rows.append((layer.path, placement, format_bytes(layer.resident_bytes), host))
        return rows

    def _totals(self) -> list[tuple[str, str]]:
        num_host = sum(1 for ring in self.rings for layer in ring.layers if layer.params)
        num_layers = sum(len(ring.layers) for ring in self.rings)
        chosen = f"cpu_offload_gb={self.config.cpu_offload_gb:g}"
        if self.config.cpu_offload_params:
            chosen += f", cpu_offload_params={sorted(self.config.cpu_offload_params)}"
        return [
            ("host layers", f"{num_host} of {num_layers} ({chosen})"),
            ("device bytes", f"{format_bytes(self.device_bytes)} (no buffer pool)"),
            ("pinned host bytes", format_bytes(self.offloaded_bytes)),
            ("read per forward", f"{format_bytes(self.streamed_bytes_per_forward)} over the bus, at least"),
        ]

    def __str__(self) -> str:
        rows = [f"{'layer':<32} {'placement':<9} {'resident':>11} {'host':>11}"]
        for path, placement, resident, host in self._rows():
            rows.append(f"{path:<32} {placement:<9} {resident:>11} {host:>11}")
        rows.append("")
        rows += [f"{label:<22} {value}" for label, value in self._totals()]
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{cell}</th>" for cell in self._HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self._rows())
        totals = "".join(f"<tr><th>{label}</th><td>{html.escape(value)}</td></tr>" for label, value in self._totals())
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><table><tbody>{totals}</tbody></table>"
        )

    def __repr__(self) -> str:
        return (
            f"UVAPlan(rings={[r.path for r in self.rings]}, resident_bytes={self.resident_bytes}, "
            f"offloaded_bytes={self.offloaded_bytes})"
        )


def make_uva_plan(model: nn.Module, config: UVAConfig, layers: str | Sequence[str] | None = None) -> UVAPlan:
    """Choose the parameters UVA keeps in host memory. Pure: nothing is moved.

    The parameters of the layer lists are visited in layer order (each layer's in `named_parameters` order); those
    `config.cpu_offload_params` matches are taken while fewer than `config.cpu_offload_gb` GiB are taken, so the last
    one taken may cross the limit. A parameter reachable under two names is taken once.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefetch import UVAConfig
    >>> from hf_prefetch.uva import make_uva_plan
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=30_000 / 2**30, cpu_offload_params={"mlp"}))
    >>> for layer in plan.rings[0].layers:
    ...     print(layer.path, [spec.name for spec in layer.params])
    model.layers.0 ['mlp.gate_proj.weight', 'mlp.up_proj.weight', 'mlp.down_proj.weight']
    model.layers.1 ['mlp.gate_proj.weight']
    model.layers.2 []
    model.layers.3 []
    >>> plan.offloaded_bytes  # 4 matrices of 32 x 64 float32: the 4th crossed 30,000 bytes
    32768

    ```
    """
    paths = _resolve_layer_lists(model, layers)
    limit_bytes = config.cpu_offload_gb * 2**30
    segments = config.cpu_offload_params
    taken_bytes = 0
    matched = False
    seen: set[int] = set()
    rings = []
    for path in paths:
        planned = []
        for index, layer in enumerate(model.get_submodule(path)):
            specs: list[ParamSpec] = []
            layer_bytes = 0
            for name, param in layer.named_parameters():
                layer_bytes += _param_bytes(param)
                if not segment_matches(segments, name):
                    continue
                matched = True
                if taken_bytes < limit_bytes and id(param) not in seen:
                    seen.add(id(param))
                    spec = ParamSpec(name, tuple(param.shape), _dense_stride(param), param.dtype, _param_bytes(param))
                    specs.append(spec)
                    taken_bytes += spec.nbytes
            host_bytes = sum(spec.nbytes for spec in specs)
            planned.append(LayerPlan(f"{path}.{index}", index, tuple(specs), layer_bytes - host_bytes))
        rings.append(RingPlan(path, tuple(planned), num_slots=0))
    if segments and not matched:
        examples = [name for name, _ in model.get_submodule(paths[0])[0].named_parameters()][:6]
        raise ValueError(
            f"cpu_offload_params={set(segments)} matched no parameter in the layers of {paths}; names look like "
            f"{examples}. Segments must match whole dotted parts (e.g. 'mlp' or 'down_proj')."
        )
    return UVAPlan(config, tuple(rings), model_bytes(model) - taken_bytes)


def warn_on_cpu(plan: UVAPlan) -> None:
    """One warning per process: UVA with the CPU as execution device changes nothing."""
    global _warned_on_cpu
    if not _warned_on_cpu:
        _warned_on_cpu = True
        warnings.warn(
            f"offload='uva' on the CPU keeps every weight where it is: host memory is the execution device's memory "
            f"(on a GPU, {format_bytes(plan.offloaded_bytes)} would stay in host memory). The model is dispatched "
            "(get_state and remove_offload work) but unchanged.",
            stacklevel=4,
        )
