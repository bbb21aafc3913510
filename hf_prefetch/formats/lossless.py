"""Lossless compression of floating-point weights: fewer bytes over the link, the same bits after decoding.

A bf16 (or fp32) weight is a sign bit, an exponent and a mantissa. The mantissa bits of trained or random weights
look random, but their exponents take few values: for normal(0, 0.02) weights the exponent's entropy is about 2.5
bits, and its 15 most common values cover more than 99.98% of the weights. So each weight is stored as
- its sign and mantissa, unchanged (one byte for bf16, three for fp32),
- a 4-bit code: the index of its exponent in a table of the tensor's 15 most common exponents, or 15 (escape),
- for each escape, its position and its exponent, in a list of fixed `capacity` (unused entries repeat a harmless
  rewrite of weight 0, see `_pad_escapes`).

Every part has a size fixed by the tensor's dtype and element count alone (`Layout`): a tensor's encoded bytes are
known before its values are, a plan can count them, and new values of the same tensor are written in place, into the
same host memory and the same device staging buffer, which CUDA graphs have recorded (`encode` refuses values with more
escapes than the capacity: `TooManyEscapes`). bf16 takes 12 bits per weight plus its escape list (75.1% of its size),
fp32 28 bits (87.6%). fp16's exponent has 5 bits: 4-bit codes would save one bit in sixteen, so fp16 tensors (and
tensors under `MIN_NUMEL` elements, or of 2**31 elements or more) are not encoded (`layout_of` returns None).

Every code has a fixed width, so decoding is independent per weight: a nibble unpack, a 16-entry table lookup and a
few bit operations, then the escapes' exponents written over. `decode` runs two Triton kernels per tensor on CUDA (the
values, then the escapes), and torch operations in fixed chunks on the CPU (the reference, which CI tests bit
for bit, and CUDA's fallback without Triton). Shapes are fixed by the layout: a CUDA graph records the decode. This
module knows tensors only: where encoded tensors live and when they are decoded is the engine's business.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..alignment import CODEC_PART_ALIGN_BYTES, round_up

__all__ = ["Layout", "TooManyEscapes", "layout_of", "not_encoded", "encode", "decode", "escapes"]

# Bit layout per dtype: (integer view dtype, exponent shift, bytes of sign and mantissa).
_FORMATS = {
    torch.bfloat16: (torch.int16, 7, 1),
    torch.float32: (torch.int32, 23, 3),
}
_ESCAPE = 15
_TABLE_BYTES = 16
# A tensor is encoded only when it saves at least this share of its bytes.
MIN_SAVING = 0.10
# Smaller tensors (norms, biases) are copied as they are: their few bytes do not pay for a kernel launch.
MIN_NUMEL = 16384
# Escapes a layout holds: one per 2048 weights, plus 16 (5 bytes each: 0.12% of bf16's bytes). normal(0, 0.02)
# weights have about one in 6,600: room for new values three times as spread.
_ESCAPES_PER = 2048
_ESCAPES_MIN = 16
# The CPU reference works through this many weights at a time (bounded temporaries); even, so chunks start on a
# whole byte of codes.
_CHUNK = 1 << 22


class TooManyEscapes(ValueError):
    """The values have more weights outside their 15 most common exponents than the layout's escape list holds."""

    def __init__(self, found: int, capacity: int) -> None:
        super().__init__(found, capacity)
        self.found, self.capacity = found, capacity


@dataclass(frozen=True)
class Layout:
    """Where each part of one encoded tensor lies in its flat byte buffer; a function of dtype and numel only."""

    dtype: torch.dtype
    numel: int
    capacity: int  # entries of the escape list

    @property
    def sign_mantissa_bytes(self) -> int:
        return _FORMATS[self.dtype][2]

    @property
    def escape_index(self) -> int:  # offset of the escapes' positions, int32 (capacity,)
        return _TABLE_BYTES

    @property
    def escape_exponent(self) -> int:  # offset of the escapes' exponents, uint8 (capacity,)
        return self.escape_index + 4 * self.capacity

    @property
    def codes(self) -> int:  # offset of the codes, uint8 (ceil(numel / 2),): the even weight's in the low nibble
        return _align(self.escape_exponent + self.capacity)

    @property
    def sign_mantissa(self) -> int:  # offset of the sign-and-mantissa bytes, uint8 (numel * k,), little-endian
        return _align(self.codes + (self.numel + 1) // 2)

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded form (what crosses the link)."""
        return _align(self.sign_mantissa + self.numel * self.sign_mantissa_bytes)

    @property
    def raw_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


def layout_of(dtype: torch.dtype, numel: int) -> Layout | None:
    """The layout of a tensor of `numel` `dtype` values, or None where encoding does not pay or does not apply (see
    `not_encoded` for why)."""
    return _layout(dtype, numel) if not_encoded(dtype, numel) is None else None


def not_encoded(dtype: torch.dtype, numel: int) -> str | None:
    """Why a tensor of `numel` `dtype` values is not encoded (`layout_of` gives None), in words that follow a count of
    tensors ("12 under the codec's minimum of 16384 elements"); None for a tensor that is."""
    if dtype not in _FORMATS:
        return f"of dtype {str(dtype).removeprefix('torch.')}, not bfloat16 or float32"
    if numel < MIN_NUMEL:
        return f"under the codec's minimum of {MIN_NUMEL} elements"
    if numel >= 2**31:
        return "of 2**31 elements or more"
    layout = _layout(dtype, numel)
    if layout.nbytes > (1 - MIN_SAVING) * layout.raw_bytes:
        return f"that encoding would shrink by less than {MIN_SAVING:.0%}"
    return None


def _layout(dtype: torch.dtype, numel: int) -> Layout:
    return Layout(dtype, numel, numel // _ESCAPES_PER + _ESCAPES_MIN)


def escapes(tensor: torch.Tensor) -> int:
    """How many weights of `tensor` have an exponent outside its 15 most common ones."""
    counts = _exponent_counts(_bits(tensor), _FORMATS[tensor.dtype][1])
    return int(counts.sum() - counts.sort(descending=True).values[:_ESCAPE].sum())


def encode(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The encoded bytes of `tensor` (its values in row-major order) as a uint8 CPU tensor of `layout.nbytes`. Raises
    `TooManyEscapes` when its escapes do not fit the layout (nothing is written anywhere)."""
    if tensor.dtype != layout.dtype or tensor.numel() != layout.numel:
        raise ValueError(
            f"encode: a {layout.dtype} tensor of {layout.numel} elements was expected, not {tensor.dtype} with "
            f"{tensor.numel()}."
        )
    view_dtype, shift, k = _FORMATS[layout.dtype]
    bits = _bits(tensor)
    counts = _exponent_counts(bits, shift)
    # The 15 most common exponents, ties by value: the table depends on the values alone.
    order = sorted(range(256), key=lambda e: (-int(counts[e]), e))[:_ESCAPE]
    found = int(counts.sum() - counts[order].sum())
    if found > layout.capacity:
        raise TooManyEscapes(found, layout.capacity)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    out[:_ESCAPE] = torch.tensor(order, dtype=torch.uint8)
    code_of = torch.full((256,), _ESCAPE, dtype=torch.uint8)
    code_of[torch.tensor(order)] = torch.arange(_ESCAPE, dtype=torch.uint8)
    n = layout.numel
    escape_index, escape_exponent = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.uint8)]
    for start in range(0, n, _CHUNK):
        chunk = bits[start : start + _CHUNK]
        exponent = _exponents(chunk, shift)
        code = code_of.index_select(0, exponent.to(torch.int32))
        if found:  # else no weight escapes: no search
            where = torch.nonzero(code == _ESCAPE).reshape(-1)
            escape_index.append(where + start)
            escape_exponent.append(exponent[where].to(torch.uint8))
        code = torch.cat([code, code.new_zeros(code.numel() % 2)])
        codes = layout.codes + start // 2
        out[codes : codes + code.numel() // 2] = code[0::2] | (code[1::2] << 4)
        at = layout.sign_mantissa + start * k
        out[at : at + chunk.numel() * k] = _sign_mantissa(chunk, shift, k).reshape(-1)
    index = torch.cat(escape_index).to(torch.int32)
    exponent = torch.cat(escape_exponent)
    first = int(_exponents(bits[:1], shift)[0]) if n else 0
    index, exponent = _pad_escapes(index, exponent, layout.capacity, first)
    out[layout.escape_index : layout.escape_exponent] = index.view(torch.uint8)
    out[layout.escape_exponent : layout.escape_exponent + layout.capacity] = exponent
    return out


def decode(encoded: torch.Tensor, layout: Layout, out: torch.Tensor) -> torch.Tensor:
    """Write the decoded values of `encoded` (uint8, `layout.nbytes`, on `out`'s device) into `out` (contiguous,
    `layout.dtype`, `layout.numel` elements) and return it. Shapes are fixed by the layout: a CUDA graph records it."""
    if out.dtype != layout.dtype or out.numel() != layout.numel or not out.is_contiguous():
        raise ValueError(
            f"decode: out must be a contiguous {layout.dtype} tensor of {layout.numel} elements, not {out.dtype} "
            f"with {out.numel()}{'' if out.is_contiguous() else ' (non-contiguous)'}."
        )
    if encoded.dtype != torch.uint8 or encoded.numel() != layout.nbytes or encoded.device != out.device:
        raise ValueError(
            f"decode: encoded must be {layout.nbytes} uint8 bytes on {out.device}, not {encoded.numel()} "
            f"{encoded.dtype} on {encoded.device}."
        )
    if layout.numel == 0:
        return out
    view_dtype, shift, k = _FORMATS[layout.dtype]
    bits = out.view(view_dtype).view(-1)
    index = encoded[layout.escape_index : layout.escape_exponent].view(torch.int32)
    exponent = encoded[layout.escape_exponent : layout.escape_exponent + layout.capacity]
    kernel = _kernel() if out.device.type == "cuda" else None
    if kernel is not None:
        kernel(encoded, layout, bits, index, exponent)
        return out
    _decode_chunks(encoded, layout, bits)
    # The escapes' exponents over what the table gave them (code 15: exponent 0).
    index = index.long()
    keep = ~(0xFF << shift)  # as a signed integer: the same bits in int16 and int32
    bits.index_put_((index,), (bits[index] & keep) | (exponent.to(view_dtype) << shift))
    return out


def _decode_chunks(encoded: torch.Tensor, layout: Layout, bits: torch.Tensor) -> None:
    # The reference: torch operations, a fixed chunk at a time (temporaries of a few chunks' size), in the bits'
    # own integer dtype (a shift into the sign bit wraps to the same bits).
    view_dtype, shift, k = _FORMATS[layout.dtype]
    table = encoded[:_TABLE_BYTES].to(view_dtype)  # entry 15 (escape) is 0
    for start in range(0, layout.numel, _CHUNK):
        n = min(_CHUNK, layout.numel - start)
        codes = encoded[layout.codes + start // 2 : layout.codes + (start + n + 1) // 2]
        code = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:n]
        at = layout.sign_mantissa + start * k
        parts = encoded[at : at + n * k].reshape(n, k).to(view_dtype)
        last = parts[:, k - 1]
        value = ((last & 0x80) << (8 * k + 7 - 7)) | (table.index_select(0, code.to(torch.int32)) << shift)
        value |= (last & 0x7F) << (8 * (k - 1))
        for i in range(k - 1):
            value |= parts[:, i] << (8 * i)
        bits[start : start + n] = value


def _pad_escapes(
    index: torch.Tensor, exponent: torch.Tensor, capacity: int, first_exponent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Unused entries rewrite weight 0's exponent with its own value: the same bits whatever order the writes land in,
    # so the list always has `capacity` entries (fixed shapes) and needs no count.
    pad = capacity - index.numel()
    index = torch.cat([index, torch.zeros(pad, dtype=torch.int32)])
    exponent = torch.cat([exponent, torch.full((pad,), first_exponent, dtype=torch.uint8)])
    return index, exponent


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    view_dtype = _FORMATS[tensor.dtype][0]
    return tensor.detach().reshape(-1).contiguous().cpu().view(view_dtype)


def _exponent_counts(bits: torch.Tensor, shift: int) -> torch.Tensor:
    counts = torch.zeros(256, dtype=torch.int64)
    for start in range(0, bits.numel(), _CHUNK):
        counts += torch.bincount(_exponents(bits[start : start + _CHUNK], shift).to(torch.uint8), minlength=256)
    return counts


def _exponents(bits: torch.Tensor, shift: int) -> torch.Tensor:
    # In the bits' own integer dtype: an arithmetic shift of a negative value brings in ones, which the mask drops.
    return (bits >> shift) & 0xFF


def _sign_mantissa(bits: torch.Tensor, shift: int, k: int) -> torch.Tensor:
    # (n, k) bytes: the mantissa's low bits first, the sign in bit 7 of the last byte.
    if k == 1:
        return (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8).reshape(-1, 1)
    wide = bits.to(torch.int64)
    value = (((wide >> 31) & 1) << (8 * k - 1)) | (wide & ((1 << shift) - 1))
    return torch.stack([(value >> (8 * i)) & 0xFF for i in range(k)], dim=1).to(torch.uint8)


def _align(offset: int) -> int:
    return round_up(offset, CODEC_PART_ALIGN_BYTES)


@functools.cache
def _kernel():
    """The decoder as one Triton kernel per tensor, or None where Triton is missing. Built on first use, so that
    importing hf_prefetch imports no Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def decode_values(
        encoded, out, numel, codes_at, sign_mantissa_at, K: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr
    ):
        # One BLOCK of weights: code from its nibble, exponent from the table (code 15 gives 0; the escapes are
        # written over afterwards), sign and mantissa from its K bytes.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        packed = tl.load(encoded + codes_at + offsets // 2, mask=inside, other=0).to(tl.int32)
        code = (packed >> ((offsets & 1) * 4).to(tl.int32)) & 0xF
        exponent = tl.load(encoded + code, mask=inside & (code < 15), other=0).to(tl.int32)
        first = tl.load(encoded + sign_mantissa_at + offsets * K, mask=inside, other=0).to(tl.int32)
        if K == 1:
            value = ((first & 0x80) << 8) | (exponent << SHIFT) | (first & 0x7F)
            tl.store(out + offsets, value.to(tl.int16), mask=inside)
        else:
            second = tl.load(encoded + sign_mantissa_at + offsets * K + 1, mask=inside, other=0).to(tl.int32)
            third = tl.load(encoded + sign_mantissa_at + offsets * K + 2, mask=inside, other=0).to(tl.int32)
            # The sign (bit 7 of the third byte) to bit 31: shifted as int32 it wraps to the same bits.
            value = ((third & 0x80) << 24) | (exponent << SHIFT) | ((third & 0x7F) << 16) | (second << 8) | first
            tl.store(out + offsets, value, mask=inside)

    @triton.jit
    def patch_escapes(index, exponent, out, capacity, SHIFT: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
        # Each escape's exponent over what the table gave it. Unused entries rewrite weight 0 with its own bits.
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = j < capacity
        at = tl.load(index + j, mask=inside, other=0)
        value = tl.load(out + at, mask=inside, other=0).to(tl.int32)
        value = (value & ~(0xFF << SHIFT)) | (tl.load(exponent + j, mask=inside, other=0).to(tl.int32) << SHIFT)
        if K == 1:
            tl.store(out + at, value.to(tl.int16), mask=inside)
        else:
            tl.store(out + at, value, mask=inside)

    block, escape_block = 4096, 1024

    def launch(encoded, layout, bits, index, exponent) -> None:
        _, shift, k = _FORMATS[layout.dtype]
        grid = (triton.cdiv(layout.numel, block),)
        decode_values[grid](
            encoded,
            bits,
            layout.numel,
            layout.codes,
            layout.sign_mantissa,
            K=k,
            SHIFT=shift,
            BLOCK=block,
            num_warps=8,
        )
        grid = (triton.cdiv(layout.capacity, escape_block),)
        patch_escapes[grid](index, exponent, bits, layout.capacity, SHIFT=shift, K=k, BLOCK=escape_block)

    return launch
