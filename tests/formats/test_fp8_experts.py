"""Block-wise FP8 fused experts (transformers' `FP8Experts`, what DeepSeek-V3 and Qwen3 FP8 releases load as) stream
packed and routed: the float8 weights and their fp32 block scales are the experts' tensors, copied expert by expert
as stored, and the experts' own forward reads exactly those bytes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.finegrained_fp8 import FP8Experts

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, moe_model

ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)
BLOCK = (32, 32)


def _dequantized_linear(self, input, weight, weight_scale_inv, activation_scale=None):
    # transformers' FP8 matmul needs its hub kernels; the same computation from the same bytes, in torch: each
    # (128 x 128 here 32 x 32) block of the float8 weight times its scale.
    rows, cols = weight.shape
    scale = weight_scale_inv.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return F.linear(input, (weight.float() * scale).to(input.dtype))


def _fp8_model(family: str = "qwen3_moe", seed: int = 0):
    model = moe_model(family, seed).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        experts = FP8Experts(model.config, block_size=BLOCK)
        with torch.no_grad():
            for param in experts.parameters():
                if param.dtype == torch.float8_e4m3fn:
                    param.copy_((torch.randn(param.shape, generator=generator) * 0.5).to(param.dtype))
                else:
                    param.copy_(torch.rand(param.shape, generator=generator) * 0.02 + 0.001)
        layer.mlp.experts = experts
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fp8_experts_stream_packed_and_routed_bitwise(monkeypatch, family):
    monkeypatch.setattr(FP8Experts, "linear", _dequantized_linear)
    model = _fp8_model(family)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    want = generate_with_logits(copy.deepcopy(model), ids)
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED), device="cpu")
    routed = {spec.name: spec for spec in plan.rings[0].layers[1].routed}
    # Both projections and both scale tensors route, in the dtypes the checkpoint stores.
    assert {name.rsplit(".", 1)[-1]: spec.dtype for name, spec in routed.items()} == {
        "gate_up_proj": torch.float8_e4m3fn,
        "gate_up_proj_scale_inv": torch.float32,
        "down_proj": torch.float8_e4m3fn,
        "down_proj_scale_inv": torch.float32,
    }
    experts = model.model.layers[1].mlp.experts
    assert plan.rings[0].layers[1].offloaded_bytes == sum(p.nbytes for p in experts.parameters()) + sum(
        p.nbytes for n, p in model.model.layers[1].named_parameters() if "experts" not in n
    )
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, ids), want)
        stats = hf_prefetch.stats(model)
        assert stats.routed_rows > 0 and stats.misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_fp8_experts_have_no_host_kernel_for_cpu_experts():
    model = _fp8_model()
    with pytest.raises(ValueError, match=r"gate_up_proj is stored as torch.float8_e4m3fn \(FP8\)"):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")
    assert hf_prefetch.get_state(model) is None
