"""compressed-tensors' packed integer linears (format `pack-quantized`: W4A16, W8A16) computing from packed bytes.

transformers loads such a checkpoint compressed, and compressed-tensors decompresses every module once, at the first
forward, into a dense weight that it keeps. A model `from_pretrained` builds keeps the packed tensors instead
(`weight_packed`, `weight_scale`, `weight_zero_point`: at 4 bits about a quarter of bf16's bytes, which is what
streams) and runs compressed-tensors' own decompression of the module at every forward, on the device the forward runs
on, then the matmul of transformers' decompressed module (`F.linear`). The same function on the same tensors gives the
same dense weight, bit for bit. The dense weight lives for one forward.

On CUDA, the common case (4-bit, a scale per group, no zero points, bf16 or fp16 scales) decompresses in one Triton
kernel instead of compressed-tensors' chain of small ones: each weight is its nibble minus 8, converted exactly and
multiplied by its scale with one rounding to the scale's dtype, which is what compressed-tensors' torch operations
compute (an int8 made bf16 exactly, a bf16 product rounded once). A GPU test holds the two equal bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install", "use_stored_zero_points", "decompresses", "is_compressed"]

_SHAPE = "_hf_prefetch_weight_shape"  # the dense weight's shape, on the host (compressed-tensors' is a tensor)


def install(model: nn.Module) -> int:
    """Make every compressed packed linear of `model` decompress at each forward; how many there are."""
    count = 0
    for module in model.modules():
        if is_compressed(module) and "weight_packed" in module._parameters:
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


def is_compressed(module: nn.Module) -> bool:
    """Whether compressed-tensors left `module` compressed (its packed tensors in place of a dense weight)."""
    status = getattr(module, "quantization_status", None)
    return getattr(status, "value", status) == "compressed"


def decompresses(module: nn.Module) -> bool:
    """Whether `module` computes from its packed tensors at every forward (`install`)."""
    return getattr(module.forward, "func", None) is _forward


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return F.linear(input, dense_weight(self), self.bias)


def dense_weight(module: nn.Linear) -> torch.Tensor:
    """The dense weight of a packed linear, as compressed-tensors' decompression computes it."""
    packed, scale = module.weight_packed, module.weight_scale
    zero_point = getattr(module, "weight_zero_point", None)
    weights = module.quantization_scheme.weights
    strategy = getattr(weights.strategy, "value", weights.strategy)
    out_features, in_features = getattr(module, _SHAPE)
    fused = (
        packed.is_cuda
        and not torch.compiler.is_compiling()  # compressed-tensors' torch operations trace; the launch would not
        and weights.num_bits == 4
        and strategy == "group"
        and zero_point is None
        and scale.dtype in (torch.bfloat16, torch.float16)
        and in_features % weights.group_size == 0
        and out_features * in_features < 2**31  # the kernel's offsets are 32-bit
        and tuple(packed.shape) == (out_features, in_features // 8)
        and tuple(scale.shape) == (out_features, in_features // weights.group_size)
    )
    launch = _unpack_kernel() if fused else None
    if launch is not None:
        out = torch.empty(out_features, in_features, dtype=scale.dtype, device=packed.device)
        with torch.cuda.device(packed.device):  # Triton launches on the current device's stream
            launch(packed, scale, out, weights.group_size)
        return out
    from compressed_tensors.compressors import PackedQuantizationCompressor

    parts = {"weight_packed": packed, "weight_scale": scale, "weight_shape": getattr(module, _SHAPE)}
    if zero_point is not None:
        parts["weight_zero_point"] = zero_point
    return PackedQuantizationCompressor.decompress(parts, module.quantization_scheme)["weight"]


@functools.cache
def _unpack_kernel():
    """The 4-bit group dequantization as one Triton kernel, or None where Triton is missing (built on first use)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def unpack_int4(packed, scale, out, columns, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, block of columns): weight c of a row is bits 4*(c % 8) .. of word c // 8, minus 8.
        row = tl.program_id(0)
        columns_at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns_at < columns
        words = tl.load(packed + row * (columns // 8) + columns_at // 8, mask=inside, other=0)
        values = ((words >> ((columns_at % 8) * 4)) & 0xF) - 8
        scales = tl.load(scale + row * (columns // GROUP) + columns_at // GROUP, mask=inside, other=0)
        dense = values.to(tl.float32) * scales.to(tl.float32)
        tl.store(out + row * columns + columns_at, dense.to(out.dtype.element_ty), mask=inside)

    block = 1024

    def launch(packed, scale, out, group: int) -> None:
        rows, columns = out.shape
        unpack_int4[(rows, triton.cdiv(columns, block))](packed, scale, out, columns, GROUP=group, BLOCK=block)

    return launch
