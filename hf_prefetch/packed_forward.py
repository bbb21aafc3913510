"""compressed-tensors' packed integer linears (format `pack-quantized`: W4A16, W8A16) computing from packed bytes.

transformers loads such a checkpoint compressed, and compressed-tensors decompresses every module once, at the first
forward, into a dense weight that it keeps. A model `from_pretrained` builds keeps the packed tensors instead
(`weight_packed`, `weight_scale`, `weight_zero_point`: at 4 bits about a quarter of bf16's bytes, which is what
streams) and runs compressed-tensors' own decompression of the module at every forward, on the device the forward runs
on, then the matmul of transformers' decompressed module (`F.linear`). The same function on the same tensors gives the
same dense weight, bit for bit. The dense weight lives for one forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install", "use_stored_zero_points", "decompresses"]

_SHAPE = "_hf_prefetch_weight_shape"  # the dense weight's shape, on the host (compressed-tensors' is a tensor)


def install(model: nn.Module) -> int:
    """Make every compressed packed linear of `model` decompress at each forward; how many there are."""
    count = 0
    for module in model.modules():
        status = getattr(module, "quantization_status", None)
        if getattr(status, "value", status) == "compressed" and "weight_packed" in module._parameters:
            setattr(module, _SHAPE, torch.Size((module.out_features, module.in_features)))
            # A partial of a module-level function, not a bound method: pickle and deepcopy rebuild it (a
            # MethodType pickles as a lookup of `_forward` on the module, which has no such attribute).
            module.forward = functools.partial(_forward, module)
            count += 1
    return count


def use_stored_zero_points(model: nn.Module, checkpoint: Any) -> None:
    """Asymmetric packed weights: each zero-point parameter made what the checkpoint stores (packed into int32 words
    along the rows, as compressed-tensors saves it; its preparation of a meta model declares them unpacked)."""
    keys = set(checkpoint.keys())
    for path, module in model.named_modules():
        key = f"{path}.weight_zero_point"
        if decompresses(module) and "weight_zero_point" in module._parameters and key in keys:
            entry = checkpoint[key]
            stored = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
            module.weight_zero_point = nn.Parameter(stored, requires_grad=False)


def decompresses(module: nn.Module) -> bool:
    """Whether `module` computes from its packed tensors at every forward (`install`)."""
    return getattr(module.forward, "func", None) is _forward


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    from compressed_tensors.compressors import PackedQuantizationCompressor

    parts = {name: getattr(self, name, None) for name in ("weight_packed", "weight_scale", "weight_zero_point")}
    parts = {name: value for name, value in parts.items() if value is not None}
    parts["weight_shape"] = getattr(self, _SHAPE)
    weight = PackedQuantizationCompressor.decompress(parts, self.quantization_scheme)["weight"]
    return F.linear(input, weight, self.bias)
