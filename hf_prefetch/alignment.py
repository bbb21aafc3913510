"""The byte alignments the package relies on, one per purpose, and the one rounding rule they share. A leaf: every
part of the package may import it."""

__all__ = [
    "TENSOR_ALIGN_BYTES",
    "DIRECT_IO_ALIGN_BYTES",
    "LINK_SHARE_ALIGN_BYTES",
    "STAGING_ALIGN_BYTES",
    "CODEC_PART_ALIGN_BYTES",
    "round_up",
]

TENSOR_ALIGN_BYTES = 4096
"""Where each tensor starts in the host arena and in a pool slot, which are laid out alike: valid for any dtype,
DMA-friendly, and a whole O_DIRECT block, so the loader's direct reads land in place."""

DIRECT_IO_ALIGN_BYTES = 4096
"""O_DIRECT wants the file offset, the length and the buffer address aligned to the device's logical block size: 4096
covers every block size in use (512 and 4096)."""

LINK_SHARE_ALIGN_BYTES = 512
"""Where a layer's bytes are cut between several host links, and where each piece starts in a helper GPU's staging
buffer."""

STAGING_ALIGN_BYTES = 256
"""Where each compressed parameter's encoded bytes start in its slot's staging buffer."""

CODEC_PART_ALIGN_BYTES = 16
"""Where each part of an encoded tensor (exponent codes, sign and mantissa bytes, escapes) starts in its bytes."""


def round_up(nbytes: int, multiple: int) -> int:
    """`nbytes` rounded up to a multiple of `multiple`."""
    return -(-nbytes // multiple) * multiple
