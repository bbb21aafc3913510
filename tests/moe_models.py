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
    model.set_experts_implementation(experts_implementation)  # transformers' default is grouped_mm
    return model


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def routed_hooks(model) -> list:
    """The `RoutedHook`s of a dispatched model's experts modules, in module order."""
    from hf_prefetch.runtime.hooks import RoutedHook

    found = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        found += [h for h in getattr(hook, "hooks", [hook]) if isinstance(h, RoutedHook)]
    return found


# The e2m1 values of the 16 nibbles (transformers' FP4_VALUES).
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense projection `(num_experts, columns, rows)` (transformers' layout) as MXFP4 `blocks` (uint8, two nibbles
    a byte, the even column in the low one: `(num_experts, rows, columns // 32, 16)`) and `scales` (uint8 exponents
    biased by 127, one per 32 columns), as gpt-oss checkpoints store it: the OCP MX rule (the exponent of the group's
    largest magnitude less fp4's largest, 2; each value rounded to the nearest fp4 value, at most 6)."""
    rows_first = weight.float().transpose(1, 2)
    experts, rows, columns = rows_first.shape
    groups = rows_first.reshape(experts, rows, columns // 32, 32)
    largest = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = (torch.floor(torch.log2(largest)) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    nibbles = (scaled[..., None] - _FP4).abs().argmin(-1).to(torch.uint8).reshape(experts, rows, columns // 32, 16, 2)
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8).contiguous()


def mxfp4_checkpoint(folder, seed: int = 0, model=None):
    """A tiny gpt-oss checkpoint (of `model` where given, a `GptOssForCausalLM`) as the gpt-oss releases store one:
    the experts' `gate_up_proj` and `down_proj` as MXFP4 blocks and scales (`quantize_mxfp4`), everything else bf16,
    and config.json's quantization_config `{"quant_method": "mxfp4", ...}`."""
    import json

    from safetensors.torch import load_file, save_file

    (moe_model("gpt_oss", seed) if model is None else model).to(torch.bfloat16).save_pretrained(folder)
    tensors = {}
    for key, value in load_file(folder / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = quantize_mxfp4(value)
        else:
            tensors[key] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
