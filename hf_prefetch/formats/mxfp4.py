"""MXFP4 expert weights (gpt-oss checkpoints, transformers' `quant_method: "mxfp4"`) computing from packed bytes.

A gpt-oss checkpoint stores each experts module's `gate_up_proj` and `down_proj` as `<proj>_blocks` (uint8, two fp4
e2m1 values a byte, the low nibble first: `(num_experts, rows, groups, 16)`) and `<proj>_scales` (uint8 e8m0
exponents biased by 127, one per 32 values: `(num_experts, rows, groups)`): 4.25 bits a weight. Without its hub
kernels (no `kernels` package, or on the CPU) transformers dequantizes them to bf16 once, at load
(`convert_moe_packed_tensors`), into 3.8x the bytes. A model `from_pretrained` builds keeps the packed tensors as the
experts module's parameters instead (what streams; both are expert-major on dimension 0, so routed experts copy them
row by row) and dequantizes them inside the module's forward, on the device it runs on, into the bf16 tensors
transformers' load makes (`(num_experts, groups * 32, rows)`, the module's layout), then runs the module's own forward
on them. A forward with fewer picks than experts dequantizes only the picked experts: the module reads no other
expert's rows, which in a routing forward hold other layers' bytes ([Note: routed experts] in runtime/routed.py). The
dense tensors live for one forward.

The values are transformers' bit for bit. It computes `torch.ldexp(lut[nibble], scale - 127)` in bf16: the exact
product of an fp4 value and a power of two from 2**-127 to 2**128, rounded to bf16. Every such product has at most two
significant bits and a binary exponent from -128 to 130, so it is a bf16 value (a subnormal one below 2**-126) or
overflows to infinity: on CUDA one Triton kernel writes those bits directly, with integer operations only (no float
rounding, no flushed subnormals); on the CPU (and without Triton, or while torch.compile traces the forward) the torch
operations are transformers' own. A GPU test holds the kernel equal to transformers' function for every nibble and
every scale.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

__all__ = ["prepare", "dequantizes", "dense_weight", "PROJECTIONS", "FP4_VALUES"]

EXPERTS = "GptOssExperts"  # the modules transformers' MXFP4 quantizer converts
PROJECTIONS = ("gate_up_proj", "down_proj")
# The e2m1 values of the 16 nibbles, transformers' `FP4_VALUES` (a test holds them equal).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
_PACKED = "_hf_prefetch_mxfp4"  # on a prepared experts module: the projections it holds packed


def prepare(model: nn.Module, checkpoint: Any) -> int:
    """Make each gpt-oss experts projection that `checkpoint` stores as MXFP4 two packed parameters of its module (meta
    tensors, `<proj>_blocks` and `<proj>_scales`, in place of the dense one) and the module dequantize them at every
    forward; how many modules. Every key, dtype and shape is checked first (`ValueError` naming the key, the shape
    found and the one expected); nothing changes on an error."""
    keys = set(checkpoint.keys())
    prefix = getattr(model, "base_model_prefix", "")
    changes = []
    for path, module in model.named_modules():
        if type(module).__name__ != EXPERTS:
            continue
        packed = [proj for proj in PROJECTIONS if _stored(module, proj, path, keys, prefix, checkpoint, model)]
        if packed:
            changes.append((module, packed))
    for module, packed in changes:
        for proj in packed:
            dense = module._parameters.pop(proj)
            blocks, scales = packed_shapes(dense.shape)
            for leaf, shape in ((f"{proj}_blocks", blocks), (f"{proj}_scales", scales)):
                stored = torch.empty(shape, dtype=torch.uint8, device="meta")
                module.register_parameter(leaf, nn.Parameter(stored, requires_grad=False))
        setattr(module, _PACKED, tuple(packed))
        # A partial of a module-level function, not a bound method: pickle and deepcopy rebuild it.
        module.forward = functools.partial(_forward, module)
    return len(changes)


def packed_shapes(dense: torch.Size | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of the blocks and scales of a dense `(num_experts, columns, rows)` projection."""
    experts, columns, rows = dense
    return (experts, rows, columns // GROUP, GROUP // 2), (experts, rows, columns // GROUP)


def _stored(module: nn.Module, proj: str, path: str, keys: set[str], prefix: str, checkpoint: Any, model) -> bool:
    # Whether the checkpoint stores `module.<proj>` as MXFP4 (checked), or dense (False).
    dense = module._parameters.get(proj)
    if dense is None or dense.dim() != 3:
        return False
    name = f"{path}.{proj}"
    found = {leaf: _key(f"{name}_{leaf}", keys, prefix) for leaf in ("blocks", "scales")}
    if found["blocks"] is None and found["scales"] is None:
        if _key(name, keys, prefix) is None:
            raise ValueError(
                f"{checkpoint.folder}: the MXFP4 checkpoint (config.json quantization_config.quant_method 'mxfp4') "
                f"has neither {name}_blocks and {name}_scales nor a dense {name}: shards are missing from the index, "
                "or the checkpoint is for another architecture."
            )
        return False  # stored dense (transformers' modules_to_not_convert): loaded as it is
    blocks_shape, scales_shape = packed_shapes(dense.shape)
    expected = {"blocks": blocks_shape, "scales": scales_shape}
    for leaf, other in (("blocks", "scales"), ("scales", "blocks")):
        if found[leaf] is None:
            raise ValueError(
                f"{checkpoint.folder}: the MXFP4 checkpoint holds {found[other]!r} but not {name}_{leaf} (uint8 "
                f"{list(expected[leaf])}): each MXFP4 projection is stored as its blocks and its scales. The "
                "checkpoint is incomplete: check its shards (model.safetensors.index.json), or download it again."
            )
    if dense.shape[1] % GROUP:
        raise ValueError(
            f"{type(model).__name__}.{name} has shape {list(dense.shape)}: MXFP4 scales 32 values each along "
            f"dimension 1, which is not a multiple of 32. Check config.json (hidden_size, intermediate_size)."
        )
    for leaf in ("blocks", "scales"):
        entry = checkpoint[found[leaf]]
        if entry.dtype != torch.uint8 or tuple(entry.shape) != expected[leaf]:
            what = "two fp4 values a byte" if leaf == "blocks" else "an exponent per 32 values"
            raise ValueError(
                f"{entry.path}: tensor {found[leaf]!r} is {entry.dtype} {list(entry.shape)}, but "
                f"{type(model).__name__}.{name} of shape {list(dense.shape)} stored as MXFP4 needs uint8 "
                f"{list(expected[leaf])} ({what}). The checkpoint was saved for another configuration: check "
                "config.json (hidden_size, intermediate_size, num_local_experts)."
            )
    return True


def _key(name: str, keys: set[str], prefix: str) -> str | None:
    # The checkpoint's key for the model's tensor `name`: as named, or with the base model's prefix added or removed
    # (a base model's checkpoint loaded into a model with a head, and the other way round).
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
    return next((key for key in candidates if key in keys), None)


def dequantizes(module: nn.Module) -> bool:
    """Whether `module` computes from MXFP4 packed tensors at every forward (`prepare`; its forward may be wrapped by
    hooks since)."""
    return bool(getattr(module, _PACKED, ()))


def _forward(self: nn.Module, hidden_states: torch.Tensor, router_indices=None, routing_weights=None):
    # The module's own forward on its dense projections, dequantized for this forward only. With fewer picks than
    # experts (a decode), only the picked experts' rows: a fixed-shape choice, no host synchronisation.
    picks = router_indices if isinstance(router_indices, torch.Tensor) else None
    if picks is not None and picks.numel() >= self.num_experts:
        picks = None
    dense = {
        proj: dense_weight(getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"), picks)
        for proj in getattr(self, _PACKED)
    }
    self.__dict__.update(dense)  # found before nn.Module's __getattr__; the packed tensors stay its parameters
    try:
        return type(self).forward(self, hidden_states, router_indices, routing_weights)
    finally:
        for proj in dense:
            self.__dict__.pop(proj, None)


def dense_weight(blocks: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 projection `(num_experts, groups * 32, rows)` of MXFP4 `blocks` and `scales`, bit for bit what
    transformers' `convert_moe_packed_tensors` computes, on their device. With `experts` (expert indices, any shape;
    out-of-range entries read as the nearest expert) only those experts' rows are computed, the others' left
    uninitialised.

    Example:

    ```python
    >>> import torch
    >>> from hf_prefetch.formats.mxfp4 import dense_weight
    >>> blocks = torch.tensor([[[[0x21] * 16]]], dtype=torch.uint8)  # one expert, one row: 0.5, 1.0, 0.5, ...
    >>> scales = torch.tensor([[[128]]], dtype=torch.uint8)  # times 2 ** (128 - 127)
    >>> dense_weight(blocks, scales)[0, :4, 0]
    tensor([1., 2., 1., 2.], dtype=torch.bfloat16)

    ```
    """
    num_experts, rows, groups, _ = blocks.shape
    kernel = _dequantize_kernel() if blocks.is_cuda and not torch.compiler.is_compiling() else None
    if kernel is not None and blocks.is_contiguous() and scales.is_contiguous():
        picked = torch.arange(num_experts, device=blocks.device) if experts is None else _clamped(experts, num_experts)
        out = torch.empty((num_experts, groups * GROUP, rows), dtype=torch.bfloat16, device=blocks.device)
        with torch.cuda.device(blocks.device):  # Triton launches on the current device's stream
            kernel(blocks, scales, picked, out)
        return out
    if experts is None:
        return _convert(blocks, scales)
    picked = _clamped(experts, num_experts)
    out = torch.empty((num_experts, groups * GROUP, rows), dtype=torch.bfloat16, device=blocks.device)
    # A repeated pick writes the same values twice.
    out.index_copy_(0, picked, _convert(blocks.index_select(0, picked), scales.index_select(0, picked)))
    return out


def _clamped(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    # Out-of-range entries (an expert-parallel sentinel) read no weights in the forward: any row will do.
    return experts.reshape(-1).to(device=experts.device, dtype=torch.long).clamp(0, num_experts - 1).contiguous()


def _convert(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # transformers' `_convert_moe_packed_tensors` (one chunk), operation for operation.
    blocks = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16, device=blocks.device)
    *prefix, groups, width = blocks.shape
    total = math.prod(prefix) * groups
    blocks = blocks.reshape(total, width)
    exponents = exponents.reshape(total, 1)
    out = torch.empty(total, width * 2, dtype=torch.bfloat16, device=blocks.device)
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    out = out.reshape(*prefix, groups, width * 2).view(*prefix, groups * width * 2)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _dequantize_kernel():
    """The dequantization of the picked experts as one Triton kernel, or None where Triton is missing (built on first
    use)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def bf16_bits(nibble, scale):
        # |value| = 2 ** e * (1 + m / 2) for the codes 1..7 (0.5, 1, 1.5, 2, 3, 4, 6): e = code // 2 - 1, m = code %
        # 2 from code 2 on, so its bf16 biased exponent is e + scale: infinite from 255, subnormal at 0 and -1
        # (mantissa (2 + m) << (exponent + 5); the shift clamped where another branch is taken). Code 0 is +-0.
        code = nibble & 7
        mantissa = tl.where(code >= 2, code & 1, 0)
        exponent = (code >> 1) - 1 + scale
        normal = (exponent << 7) | (mantissa << 6)
        subnormal = (2 + mantissa) << tl.minimum(tl.maximum(exponent + 5, 0), 6)
        magnitude = tl.where(exponent >= 255, 0x7F80, tl.where(exponent >= 1, normal, subnormal))
        return ((nibble >> 3) << 15) | tl.where(code == 0, 0, magnitude)

    @triton.jit
    def dequantize_mxfp4(blocks, scales, experts, out, rows, groups, ROWS: tl.constexpr, GROUPS: tl.constexpr):
        # Program (pick, block of rows, block of groups): the 16 bytes of group g of row r hold its columns
        # 32 g .. 32 g + 31, the low nibble first; each times 2 ** (scale - 127) of the group. Read as they lie
        # ([ROWS, GROUPS, 16] bytes), written transposed (out[expert, column, row]: [GROUPS * 32, ROWS] values).
        expert = tl.load(experts + tl.program_id(0)).to(tl.int64)
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        g = tl.program_id(2) * GROUPS + tl.arange(0, GROUPS)
        inside = (r[:, None] < rows) & (g[None, :] < groups)
        group_at = expert * rows * groups + r[:, None] * groups + g[None, :]  # [ROWS, GROUPS]
        byte = tl.load(
            blocks + group_at[:, :, None] * 16 + tl.arange(0, 16)[None, None, :], mask=inside[:, :, None], other=0
        ).to(tl.int32)
        scale = tl.load(scales + group_at, mask=inside, other=0).to(tl.int32)[:, :, None]
        pairs = tl.join(bf16_bits(byte & 0xF, scale), bf16_bits(byte >> 4, scale))  # [ROWS, GROUPS, 16, 2]
        values = tl.trans(tl.reshape(pairs, (ROWS, GROUPS * 32)))
        columns = groups * 32
        k = tl.program_id(2) * GROUPS * 32 + tl.arange(0, GROUPS * 32)
        dest = out + expert * columns * rows + k[:, None] * rows + r[None, :]
        tl.store(dest, values.to(tl.int16), mask=(k[:, None] < columns) & (r[None, :] < rows))

    # [64 rows, 2 groups] a program: 0.74 ms for gpt-oss-20b's 32 gate_up experts on an H200, 0.10 ms for 4 picks
    # (0.65x and 0.56x the time of a kernel computing [64, 64] values in the output's orientation).
    rows_per_program, groups_per_program = 64, 2

    def launch(blocks, scales, experts, out) -> None:
        _, rows, groups, _ = blocks.shape
        grid = (experts.numel(), triton.cdiv(rows, rows_per_program), triton.cdiv(groups, groups_per_program))
        dequantize_mxfp4[grid](
            blocks, scales, experts, out.view(torch.int16), rows, groups, ROWS=rows_per_program,
            GROUPS=groups_per_program,
        )  # fmt: skip

    return launch
