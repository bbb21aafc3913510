"""Lossless compression of floating-point weights: fewer bytes over the link, the same bits after decoding.

A bf16 (or fp32) weight is a sign bit, an exponent and a mantissa. The mantissa bits of trained or random weights
look random, but their exponents take few values: for normal(0, 0.02) weights the exponent's entropy is about 2.5
bits, and its 15 most common values cover more than 99.9% of the weights. So each weight is stored as
- its sign and mantissa, unchanged (one byte for bf16, three for fp32),
- a 4-bit code: the index of its exponent in a table of the tensor's 15 most common exponents, or 15 (escape),
- for each escape, its position and its exponent (a sparse list, a few per ten thousand weights).
A bf16 tensor takes 12 bits per weight (75% of its size) plus its escapes, an fp32 one 28 (87.5%). fp16's exponent
has 5 bits, so 4-bit codes would save one bit in sixteen: such tensors, and any whose encoding is not at least 10%
smaller, are not encoded (`encode` returns None).

Every code has a fixed width, so decoding is independent per weight: a nibble unpack, a 16-entry table lookup, a
scatter of the escapes and a few bit operations, written here as torch operations that run unchanged on the CPU (the
reference, which CI tests bit for bit) and on a CUDA device, into a given output tensor, with shapes fixed at encoding
time (so a CUDA graph can record them). This module knows tensors only: where encoded tensors live and when they are
decoded is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Encoded", "encode", "decode", "encoded_parts"]

# Bit layout per dtype: (integer view dtype, exponent shift, exponent mask, bytes of sign and mantissa).
_LAYOUTS = {
    torch.bfloat16: (torch.int16, 7, 0xFF, 1),
    torch.float32: (torch.int32, 23, 0xFF, 3),
}
_ESCAPE = 15
_TABLE_SIZE = 15
# Encoding must save at least this share of the bytes, else the tensor is copied as it is.
MIN_SAVING = 0.10


@dataclass(frozen=True)
class Encoded:
    """A tensor's weights as sign-and-mantissa bytes, 4-bit exponent codes and escapes. Every part is a flat tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    table: torch.Tensor  # uint8 (16,): exponent of each code; entry 15 (escape) is 0
    codes: torch.Tensor  # uint8 (ceil(n / 2),): two codes per byte, the even weight's in the low nibble
    sign_mantissa: torch.Tensor  # uint8 (n * k,): k bytes per weight, little-endian
    escape_index: torch.Tensor  # int64 (m,): flat positions of the weights whose exponent is not in the table
    escape_exponent: torch.Tensor  # uint8 (m,)

    @property
    def numel(self) -> int:
        return self.sign_mantissa.numel() // _LAYOUTS[self.dtype][3]

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded form (what crosses the link)."""
        return sum(part.numel() * part.element_size() for part in encoded_parts(self))

    @property
    def raw_bytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def to(self, device: torch.device | str) -> Encoded:
        return Encoded(self.dtype, self.shape, *(part.to(device) for part in encoded_parts(self)))


def encoded_parts(encoded: Encoded) -> tuple[torch.Tensor, ...]:
    """The tensors of an encoded weight, in a fixed order (for host storage and copies)."""
    return (encoded.table, encoded.codes, encoded.sign_mantissa, encoded.escape_index, encoded.escape_exponent)


def encode(tensor: torch.Tensor, min_saving: float | None = MIN_SAVING) -> Encoded | None:
    """The encoded form of `tensor` (any layout; its values in row-major order), or None where encoding does not pay:
    a dtype other than bf16 and fp32, or fewer than `min_saving` of the bytes saved (None: encode whenever the dtype
    allows)."""
    if tensor.dtype not in _LAYOUTS:
        return None
    view_dtype, shift, mask, k = _LAYOUTS[tensor.dtype]
    work = _work_dtype(k)
    bits = tensor.detach().reshape(-1).contiguous().cpu().view(view_dtype).to(work) & ((1 << (8 * k + 8)) - 1)
    n = bits.numel()
    exponent = (bits >> shift) & mask
    counts = torch.bincount(exponent, minlength=256)
    # The 15 most common exponents, ties by value: the table depends on the values alone.
    order = sorted(range(256), key=lambda e: (-int(counts[e]), e))[:_TABLE_SIZE]
    table = torch.zeros(16, dtype=torch.uint8)
    table[: len(order)] = torch.tensor(order, dtype=torch.uint8)
    code_of = torch.full((256,), _ESCAPE, dtype=work)
    code_of[torch.tensor([e for e in order if counts[e] > 0], dtype=torch.int64)] = torch.arange(
        sum(1 for e in order if counts[e] > 0), dtype=work
    )
    code = code_of[exponent]
    escapes = torch.nonzero(code == _ESCAPE).reshape(-1)
    padded = torch.cat([code, code.new_zeros(n % 2)])
    codes = (padded[0::2] | (padded[1::2] << 4)).to(torch.uint8)
    sign = (bits >> (8 * k + 7)) & 1  # the sign bit, above the exponent
    mantissa = bits & ((1 << shift) - 1)
    sign_mantissa_value = (sign << (8 * k - 1)) | mantissa
    sign_mantissa = torch.stack([(sign_mantissa_value >> (8 * i)) & 0xFF for i in range(k)], dim=1).to(torch.uint8)
    encoded = Encoded(
        tensor.dtype,
        tuple(tensor.shape),
        table,
        codes,
        sign_mantissa.reshape(-1),
        escapes,
        exponent[escapes].to(torch.uint8),
    )
    if min_saving is not None and encoded.nbytes > (1 - min_saving) * encoded.raw_bytes:
        return None
    return encoded


def decode(encoded: Encoded, out: torch.Tensor) -> torch.Tensor:
    """Write the decoded weights into `out` (contiguous, `encoded.dtype`, `encoded.shape`, on the parts' device) and
    return it. Only torch operations with shapes fixed by the encoding: the same code decodes on the CPU and on a
    GPU, outside or inside a CUDA-graph capture."""
    view_dtype, shift, mask, k = _LAYOUTS[encoded.dtype]
    if out.dtype != encoded.dtype or tuple(out.shape) != encoded.shape or not out.is_contiguous():
        raise ValueError(
            f"decode: out must be a contiguous {encoded.dtype} tensor of shape {encoded.shape}, not {out.dtype} "
            f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (non-contiguous)'}."
        )
    n = encoded.numel
    if n == 0:
        return out
    work = _work_dtype(k)
    codes = encoded.codes.to(torch.int64)  # indices into the table
    code = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:n]
    exponent = encoded.table.to(work)[code]
    exponent = exponent.index_put((encoded.escape_index,), encoded.escape_exponent.to(work))
    parts = encoded.sign_mantissa.reshape(n, k).to(work)
    sign_mantissa = parts[:, 0]
    for i in range(1, k):
        sign_mantissa = sign_mantissa | (parts[:, i] << (8 * i))
    sign = sign_mantissa >> (8 * k - 1)
    mantissa = sign_mantissa & ((1 << shift) - 1)
    bits = (sign << (8 * k + 7)) | (exponent << shift) | mantissa
    # Into the signed integer view: values with the sign bit set wrap to negative integers of the same bits.
    width = 8 * k + 8
    bits = bits - ((bits >> (width - 1)) << width)
    out.view(view_dtype).view(-1).copy_(bits.to(view_dtype))
    return out


def _work_dtype(k: int) -> torch.dtype:
    # bf16's 16 bits fit int32 (a quarter of int64's temporary memory); fp32's unsigned 32 bits need int64.
    return torch.int32 if k == 1 else torch.int64
