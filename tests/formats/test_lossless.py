"""The lossless weight codec: every bit of every value survives encoding and decoding, on the CPU reference."""

import math

import pytest
import torch

from hf_prefetch.formats import lossless as codec
from hf_prefetch.formats.lossless import Layout, TooManyEscapes, decode, encode, escapes, layout_of


def _roundtrip(tensor: torch.Tensor, layout: Layout | None = None, device: str = "cpu") -> Layout:
    # Any number of escapes fits a layout whose list holds one per weight.
    layout = layout or Layout(tensor.dtype, tensor.numel(), max(tensor.numel(), 1))
    encoded = encode(tensor, layout)
    assert encoded.dtype == torch.uint8 and encoded.numel() == layout.nbytes
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    decode(encoded.to(device), layout, out)
    view = torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.cpu().view(view), tensor.contiguous().view(view)), "bits differ"
    return layout


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
    layout = _roundtrip(weights, layout_of(torch.bfloat16, weights.numel()))
    assert 0.75 <= layout.nbytes / layout.raw_bytes < 0.76  # 12 bits per weight, the table, the escape list
    assert escapes(weights) < weights.numel() * 1e-3
    fp32 = _roundtrip(weights.float(), layout_of(torch.float32, weights.numel()))
    assert 0.875 <= fp32.nbytes / fp32.raw_bytes < 0.885


def test_odd_sizes_across_chunks(monkeypatch):
    # The reference works a chunk at a time: sizes around and across chunk borders, odd counts of codes.
    monkeypatch.setattr(codec, "_CHUNK", 64)
    generator = torch.Generator().manual_seed(5)
    for n in (63, 64, 65, 127, 128, 129, 1001):
        for dtype in (torch.bfloat16, torch.float32):
            values = torch.randn(n, generator=generator).to(dtype)
            values[n // 3] = math.inf  # an escape in a later chunk
            _roundtrip(values)


def test_layouts_other_than_contiguous_encode_their_values_in_row_major_order():
    weights = torch.randn(6, 10).to(torch.bfloat16)
    transposed = weights.t()
    _roundtrip(transposed)


def test_the_layout_depends_on_dtype_and_size_only():
    layout = layout_of(torch.bfloat16, 1 << 20)
    assert layout == Layout(torch.bfloat16, 1 << 20, (1 << 20) // 2048 + 16)
    offsets = [layout.escape_index, layout.escape_exponent, layout.codes, layout.sign_mantissa, layout.nbytes]
    assert offsets == sorted(offsets) and all(o % 16 == 0 for o in offsets if o != layout.escape_exponent)


def test_what_does_not_pay_is_not_encoded():
    assert layout_of(torch.float16, 1 << 20) is None  # a 5-bit exponent: 4-bit codes save too little
    assert layout_of(torch.int64, 1 << 20) is None  # not floating point
    assert layout_of(torch.bfloat16, codec.MIN_NUMEL - 1) is None  # a norm: not worth a kernel
    assert layout_of(torch.bfloat16, 2**31) is None  # escape positions are int32


@pytest.mark.parametrize(
    "dtype, numel, why",
    [
        (torch.float16, 1 << 20, "of dtype float16, not bfloat16 or float32"),
        (torch.int64, 1 << 20, "of dtype int64, not bfloat16 or float32"),
        (torch.bfloat16, codec.MIN_NUMEL - 1, f"under the codec's minimum of {codec.MIN_NUMEL} elements"),
        (torch.float32, 2**31, "of 2**31 elements or more"),
        (torch.bfloat16, codec.MIN_NUMEL, None),
        (torch.float32, 1 << 20, None),
    ],
)
def test_what_is_not_encoded_says_why(dtype, numel, why):
    assert codec.not_encoded(dtype, numel) == why
    assert (layout_of(dtype, numel) is None) == (why is not None)


def test_a_layout_that_saves_too_little_is_not_encoded_and_says_so(monkeypatch):
    monkeypatch.setattr(codec, "MIN_SAVING", 0.5)  # bf16 keeps 75% of its bytes: not enough for this saving
    assert codec.not_encoded(torch.bfloat16, 1 << 20) == "that encoding would shrink by less than 50%"
    assert layout_of(torch.bfloat16, 1 << 20) is None


def test_values_with_more_escapes_than_the_layout_holds_are_refused():
    spread = _all_bits(torch.bfloat16).repeat(2)  # every exponent equally common: most weights escape
    layout = layout_of(torch.bfloat16, spread.numel())
    with pytest.raises(TooManyEscapes) as caught:
        encode(spread, layout)
    assert caught.value.found == escapes(spread) > caught.value.capacity == layout.capacity


def test_checks_of_inputs():
    layout = Layout(torch.bfloat16, 16, 16)
    with pytest.raises(ValueError, match="a torch.bfloat16 tensor of 16 elements was expected"):
        encode(torch.randn(16), layout)
    encoded = encode(torch.randn(4, 4).to(torch.bfloat16), layout)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16 tensor of 16 elements"):
        decode(encoded, layout, torch.empty(4, 4))
    with pytest.raises(ValueError, match="non-contiguous"):
        decode(encoded, layout, torch.empty(4, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=f"encoded must be {layout.nbytes} uint8 bytes"):
        decode(encoded[1:], layout, torch.empty(16, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoding_on_cuda_gives_the_same_bits_inside_a_cuda_graph_too(dtype):
    generator = torch.Generator().manual_seed(3)
    weights = (torch.randn(1000, 333, generator=generator) * 0.02).to(dtype)
    weights.view(-1)[::97] = torch.tensor(float("nan")).to(dtype)
    _roundtrip(_all_bits(dtype), device="cuda")
    layout = _roundtrip(weights, layout_of(dtype, weights.numel()), device="cuda")
    encoded = encode(weights, layout).cuda()
    out = torch.empty(weights.shape, dtype=dtype, device="cuda")
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decode(encoded, layout, out)  # warm-up (compiles the kernel) outside the capture
    torch.cuda.synchronize()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(encoded, layout, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().view(view), weights.view(view))
