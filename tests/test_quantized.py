"""Quantized models whose packed storage is plain tensors stream those bytes: transformers' fine-grained FP8
(`FP8Linear`: a float8_e4m3fn weight and float32 block scales, `weight_scale_inv`). torchao's tensor subclasses stream
their inner tensors (tests/test_torchao.py), bitsandbytes' 4-bit parameters their parts (tests/test_bnb.py).

FP8Linear's matmul runs kernels that transformers downloads (GPU only); on the CPU the tests replace it with a
reference that dequantizes by the block scales and multiplies in the activations' dtype. The library moves bytes and
never looks at them, so what the tests check is that the bytes the forward reads are the model's: logits bitwise equal
to the same FP8 model resident, with the same reference matmul.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import FineGrainedFP8Config, LlamaConfig, LlamaForCausalLM
from transformers.integrations import finegrained_fp8

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import assert_same_generation, bytes_of, generate_with_logits

BLOCK = (128, 128)
STRIDE = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
TRANSFORMERS_FP8_LINEAR = finegrained_fp8.fp8_linear
# The GPU tests run transformers' own FP8 matmul, the hub kernel kernels-community/finegrained-fp8. Where it cannot be
# downloaded, this names a local copy of it (benchmarks/common.py, `use_local_fp8_kernel`).
FP8_KERNEL = os.environ.get("HF_PREFETCH_FP8_KERNEL")


def _reference_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, **_):
    rows, cols = block_size
    scale = weight_scale_inv.repeat_interleave(rows, 0)[: weight.shape[0]]
    scale = scale.repeat_interleave(cols, 1)[:, : weight.shape[1]]
    return F.linear(input, (weight.to(torch.float32) * scale).to(input.dtype), bias)


@pytest.fixture(autouse=True)
def reference_matmul(monkeypatch):
    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _reference_fp8_linear)


def fp8_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    finegrained_fp8.replace_with_fp8_linear(
        model, modules_to_not_convert=["lm_head"], quantization_config=FineGrainedFP8Config(weight_block_size=BLOCK)
    )
    generator = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, finegrained_fp8.FP8Linear):  # built on the meta device: give it values
            weight = torch.randn(module.weight.shape, generator=generator) * 0.5
            module.weight = torch.nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
            scale = torch.rand(module.weight_scale_inv.shape, generator=generator) * 0.05 + 0.01
            module.weight_scale_inv = torch.nn.Parameter(scale)
    return model.eval()


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(seed))


def test_fp8_layers_stream_their_packed_bytes_and_compute_what_the_resident_model_computes():
    model = fp8_llama()
    reference = copy.deepcopy(model)
    layer = model.model.layers[1]
    packed = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert {p.dtype for p in layer.parameters()} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    plan = hf_prefetch.plan(model, STRIDE, device="cpu")
    assert [s.index for s in plan.rings[0].streamed] == [1, 3]
    assert plan.streamed_bytes_per_forward == 2 * packed  # one byte per weight, plus scales and norms
    hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(reference, _ids()))
        stats = hf_prefetch.stats(model)
        assert stats.misses == 0 and stats.copied_bytes == stats.copies * packed
        for name, value in model.state_dict().items():
            want = reference.state_dict()[name]
            assert value.dtype == want.dtype and torch.equal(bytes_of(value), bytes_of(want)), name
    finally:
        hf_prefetch.remove_offload(model)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert got.dtype == want.dtype and torch.equal(bytes_of(got), bytes_of(want)), name


def test_reloading_fp8_weights_writes_packed_values():
    model = fp8_llama()
    other = fp8_llama(seed=7)
    hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    try:
        hf_prefetch.reload_weights(model, other.state_dict())
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(other, _ids()))
        hf_prefetch.sync_from_device(model)  # writes the slots back: the same bytes
        assert torch.equal(
            bytes_of(model.state_dict()["model.layers.3.mlp.down_proj.weight"]),
            bytes_of(other.model.layers[3].mlp.down_proj.weight),
        )
    finally:
        hf_prefetch.remove_offload(model)


def test_a_budget_counts_fp8_layers_by_their_packed_bytes():
    from hf_prefetch.host.arena import padded_bytes
    from hf_prefetch.planning.layers import model_bytes

    model = fp8_llama()
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = model_bytes(model)
    # With one slot, s streamed layers save s - 1 layers' packed bytes: a budget between saving 1 and 2 needs s = 3.
    budget = total - per_layer - per_layer // 2
    config = PrefetchConfig(prefetch_step=1)
    plan = hf_prefetch.plan(model, config, max_memory={0: budget}, reserve_bytes=0, device="cpu")
    # The slot's buffers each start at an aligned offset (pool.py): the pool is one layer's padded bytes.
    slot_bytes = sum(padded_bytes(p.numel() * p.element_size()) for p in model.model.layers[0].parameters())
    assert len(plan.rings[0].streamed) == 3 and plan.device_bytes == total - 3 * per_layer + slot_bytes


def _fp8_checkpoint(folder, **settings) -> LlamaForCausalLM:
    # What a pre-quantized FP8 checkpoint holds: float8 weights and float32 block scales, and its config's
    # quantization_config.
    import json

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = fp8_llama()
    # As transformers' from_pretrained builds it: the rotary tables (not saved) in float32, not cast with the model.
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK), **settings}
    (folder / "config.json").write_text(json.dumps(config))
    return model


def test_from_pretrained_reads_a_pre_quantized_fp8_checkpoint_as_packed_bytes(tmp_path):
    reference = _fp8_checkpoint(tmp_path)
    in_memory = hf_prefetch.plan(copy.deepcopy(reference), STRIDE, device="cpu")
    assert hf_prefetch.plan(tmp_path, STRIDE, device="cpu").streamed_bytes_per_forward == (
        in_memory.streamed_bytes_per_forward
    )
    model = hf_prefetch.from_pretrained(tmp_path, STRIDE, device="cpu")
    try:
        assert isinstance(model.model.layers[1].mlp.down_proj, finegrained_fp8.FP8Linear)
        assert model.config.quantization_config.quant_method == "fp8"
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(reference, _ids()))
        want = reference.state_dict()
        for name, value in model.state_dict().items():
            assert value.dtype == want[name].dtype and torch.equal(bytes_of(value), bytes_of(want[name])), name
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"quant_method": "awq"}, "quant_method = 'awq'"),
        ({"dequantize": True}, "dequantize = True"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt = 'ue8m0'"),
        ({"weight_block_size": "128"}, "weight_block_size must be a tuple of two integers"),
    ],
)
def test_from_pretrained_refuses_quantized_checkpoints_it_cannot_stream_packed(tmp_path, settings, named):
    _fp8_checkpoint(tmp_path, **settings)
    with pytest.raises(ValueError) as error:
        hf_prefetch.from_pretrained(tmp_path, STRIDE, device="cpu")
    message = str(error.value)
    assert named in message and "config.json quantization_config" in message
    if "quant_method" in settings:
        assert "['fp8', 'bitsandbytes', 'torchao', 'compressed-tensors', 'mxfp4']" in message
        assert "dispatch_model" in message and "torchao" in message


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_a_requested_dtype_leaves_the_packed_tensors_as_they_are(tmp_path, dtype):
    # load_checkpoint_and_dispatch(dtype=...) casts the model's floating-point parameters, never float8 weights or
    # their modules' scales: FP8Linear would multiply by unscaled values.
    from accelerate import init_empty_weights

    reference = _fp8_checkpoint(tmp_path)
    with init_empty_weights():
        model = LlamaForCausalLM._from_config(reference.config, dtype=torch.bfloat16)
    settings = FineGrainedFP8Config(weight_block_size=BLOCK)
    finegrained_fp8.replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=settings)
    hf_prefetch.load_checkpoint_and_dispatch(model, tmp_path, STRIDE, device="cpu", dtype=dtype)
    try:
        projection = model.model.layers[1].mlp.down_proj
        assert (projection.weight.dtype, projection.weight_scale_inv.dtype) == (torch.float8_e4m3fn, torch.float32)
        assert model.model.norm.weight.dtype == (dtype or torch.bfloat16)
        if dtype in (None, torch.bfloat16):
            assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(reference, _ids()))
    finally:
        hf_prefetch.remove_offload(model)


def test_a_float8_dtype_is_refused_as_a_dtype_to_compute_in(tmp_path):
    _fp8_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"dtype='float8_e4m3fn' must be a floating-point torch.dtype to compute in"):
        hf_prefetch.from_pretrained(tmp_path, STRIDE, device="cpu", dtype="float8_e4m3fn")


def test_a_block_size_that_does_not_match_the_scales_names_the_setting(tmp_path):
    _fp8_checkpoint(tmp_path, weight_block_size=[64, 64])  # the scales were written for 128 x 128 blocks
    with pytest.raises(
        ValueError, match=r"weight_scale_inv.*check config.json \(quantization_config.weight_block_size"
    ):
        hf_prefetch.from_pretrained(tmp_path, STRIDE, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["from_pretrained", "dispatch_model"])
def test_on_cuda_fp8_layers_stream_through_transformers_kernel_as_the_resident_model_computes(
    tmp_path, monkeypatch, entry
):
    if not torch.cuda.is_available() or not FP8_KERNEL:
        pytest.skip("needs CUDA and HF_PREFETCH_FP8_KERNEL (a local copy of kernels-community/finegrained-fp8)")
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from common import use_local_fp8_kernel

    monkeypatch.setattr(finegrained_fp8, "fp8_linear", TRANSFORMERS_FP8_LINEAR)  # the real matmul, not the reference
    use_local_fp8_kernel(FP8_KERNEL)
    _fp8_checkpoint(tmp_path)
    resident = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda").eval()
    ids = _ids().cuda()
    want = generate_with_logits(resident, ids)
    if entry == "from_pretrained":
        model = hf_prefetch.from_pretrained(tmp_path, STRIDE, device="cuda")
    else:
        model = hf_prefetch.dispatch_model(copy.deepcopy(resident).cpu(), STRIDE, device="cuda")
    assert hf_prefetch.get_state(model).plan.streamed_bytes_per_forward > 0
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids), want)
    stats = hf_prefetch.stats(model)
    assert stats.misses == 0 and stats.copied_bytes > 0
    hf_prefetch.remove_offload(model)
