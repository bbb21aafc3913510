"""The lossless weight codec: every bit of every value survives encoding and decoding, on the CPU reference."""

import math

import pytest
import torch

from hf_prefetch.codec import decode, encode, encoded_parts


def _roundtrip(tensor: torch.Tensor):
    encoded = encode(tensor, min_saving=None)
    assert encoded is not None
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    decode(encoded, out)
    view = torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(view), tensor.contiguous().view(view)), "bits differ"
    return encoded


def _all_bits(dtype: torch.dtype) -> torch.Tensor:
    # Every 16-bit pattern (bf16), or every exponent with sign and mantissa patterns (fp32).
    if dtype == torch.bfloat16:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    exponents = torch.arange(256, dtype=torch.int64) << 23
    mantissas = torch.tensor([0, 1, 0x400000, 0x7FFFFF, 0x123456], dtype=torch.int64)
    signs = torch.tensor([0, 1 << 31], dtype=torch.int64)
    bits = (signs[:, None, None] | exponents[None, :, None] | mantissas[None, None, :]).reshape(-1)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_bit_pattern_survives(dtype):
    # Every exponent value, NaN payloads, +-infinity, subnormals, -0.0: most of them escapes here.
    _roundtrip(_all_bits(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 1001])
def test_tiny_and_odd_sizes(dtype, n):
    generator = torch.Generator().manual_seed(n)
    _roundtrip(torch.randn(n, generator=generator).to(dtype))


@pytest.mark.parametrize(
    "values",
    [
        [0.0] * 64,
        [-0.0] * 63,
        [1.5] * 33,
        [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-45, 3.4e38, -1.2e-38] * 5,
    ],
)
def test_special_values(values):
    for dtype in (torch.bfloat16, torch.float32):
        _roundtrip(torch.tensor(values).to(dtype))


def test_nan_payloads_survive():
    payloads = torch.tensor([0x7FC1, 0x7F81, 0xFFFF, 0xFF80 | 0x23], dtype=torch.int32).to(torch.int16)
    _roundtrip(payloads.view(torch.bfloat16).repeat(7))


def test_random_weights_shrink_to_about_three_quarters_of_bf16():
    generator = torch.Generator().manual_seed(0)
    weights = (torch.randn(512, 768, generator=generator) * 0.02).to(torch.bfloat16)
    encoded = _roundtrip(weights)
    ratio = encoded.nbytes / encoded.raw_bytes
    assert 0.75 <= ratio < 0.76  # 12 bits per weight, a table of 16 bytes, a few escapes
    assert encoded.escape_index.numel() < weights.numel() * 1e-3
    fp32 = _roundtrip(weights.float())
    assert 0.875 <= fp32.nbytes / fp32.raw_bytes < 0.885


def test_layouts_other_than_contiguous_encode_their_values_in_row_major_order():
    weights = torch.randn(6, 10).to(torch.bfloat16)
    transposed = weights.t()
    encoded = encode(transposed, min_saving=None)
    out = torch.empty(transposed.shape, dtype=torch.bfloat16)
    assert torch.equal(decode(encoded, out).view(torch.int16), transposed.contiguous().view(torch.int16))


def test_what_does_not_pay_is_not_encoded():
    assert encode(torch.randn(100).half()) is None  # a 5-bit exponent: 4-bit codes save too little
    assert encode(torch.arange(100)) is None  # not floating point
    spread = _all_bits(torch.bfloat16)  # every exponent equally common: most weights escape
    assert encode(spread) is None and encode(spread, min_saving=None) is not None


def test_decode_checks_its_output():
    encoded = encode(torch.randn(4, 4).to(torch.bfloat16), min_saving=None)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor of shape \(4, 4\)"):
        decode(encoded, torch.empty(4, 4))
    with pytest.raises(ValueError, match="non-contiguous"):
        decode(encoded, torch.empty(4, 4, dtype=torch.bfloat16).t())


def test_parts_are_flat_byte_and_index_tensors():
    encoded = encode(torch.randn(8, 9).to(torch.bfloat16), min_saving=None)
    parts = encoded_parts(encoded)
    assert [p.dtype for p in parts] == [torch.uint8, torch.uint8, torch.uint8, torch.int64, torch.uint8]
    assert all(p.dim() == 1 for p in parts)
    assert encoded.nbytes == sum(p.numel() * p.element_size() for p in parts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoding_on_cuda_gives_the_same_bits_inside_a_cuda_graph_too():
    generator = torch.Generator().manual_seed(3)
    weights = (torch.randn(1000, 333, generator=generator) * 0.02).to(torch.bfloat16)
    weights.view(-1)[::97] = torch.tensor(float("nan")).to(torch.bfloat16)
    encoded = encode(weights).to("cuda")
    out = torch.empty(weights.shape, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(decode(encoded, out).cpu().view(torch.int16), weights.view(torch.int16))
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    decode(encoded, out)  # warm-up on the side stream torch.cuda.graph expects
    out.zero_()
    with torch.cuda.graph(graph):
        decode(encoded, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().view(torch.int16), weights.view(torch.int16))
