"""Tiny random-weight mixture-of-experts models of the families transformers implements with fused expert tensors."""

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 128
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=4)


def _build(cls, config, seed: int):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random routers: every token picks a different set of experts
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                param.normal_(0, 1.0)
    return model


def moe_model(family: str, seed: int = 0, experts_implementation: str = "eager"):
    if family == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
        model = _build(MixtralForCausalLM, config, seed)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(
            **COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=12,
            num_experts_per_tok=3,
        )
        model = _build(Qwen2MoeForCausalLM, config, seed)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4
        )
        model = _build(Qwen3MoeForCausalLM, config, seed)
    elif family == "olmoe":
        config = OlmoeConfig(**COMMON, intermediate_size=32, num_experts=16, num_experts_per_tok=4)
        model = _build(OlmoeForCausalLM, config, seed)
    elif family == "deepseek_v3":
        config = DeepseekV3Config(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=VOCAB,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
        model = _build(DeepseekV3ForCausalLM, config, seed)
    elif family == "gpt_oss":
        config = GptOssConfig(
            **COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8
        )
        model = _build(GptOssForCausalLM, config, seed)
    else:
        raise ValueError(family)
    if experts_implementation != "eager":
        model.set_experts_implementation(experts_implementation)
    return model


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
