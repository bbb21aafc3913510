"""Tiny random-weight transformers models of many architectures, built from their configs (nothing is downloaded).

Each `Arch` names its transformers classes as strings, so that a row whose class the installed transformers lacks
can be skipped with the reason instead of failing at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

VOCAB = 128

# Shared by the decoder-only configs that spell their sizes the Llama way.
_LLAMA_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)


@dataclass(frozen=True)
class Arch:
    """One architecture: its config and model classes (by name), the config fields, and how to dispatch it."""

    name: str
    config_class: str
    model_class: str
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    offload_params: frozenset[str] = frozenset()
    seq2seq: bool = False

    def missing(self) -> str | None:
        """Why this row cannot run with the installed transformers, or None."""
        absent = [name for name in (self.config_class, self.model_class) if not hasattr(transformers, name)]
        if absent:
            return f"transformers {transformers.__version__} has no {', '.join(absent)}"
        return None

    def build(self, seed: int = 0) -> nn.Module:
        """The model in eval mode, float32, with weights drawn from `torch.manual_seed(seed)`."""
        config = getattr(transformers, self.config_class)(**self.config_kwargs)
        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(config).float().eval()


ARCHS = [
    Arch("llama", "LlamaConfig", "LlamaForCausalLM", _LLAMA_SIZES),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", {**_LLAMA_SIZES, "sliding_window": 4}),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _LLAMA_SIZES),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_SIZES, "head_dim": 16}),
    Arch(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # Alternating sliding-window and global layers; a window shorter than prompt + new tokens so it matters.
        {
            **_LLAMA_SIZES,
            "head_dim": 16,
            "sliding_window": 4,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    Arch(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_LLAMA_SIZES, "head_dim": 16, "sliding_window": 4, "final_logit_softcapping": 30.0},
    ),
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", {**_LLAMA_SIZES, "pad_token_id": 0}),
    # Conv1D weights (stored transposed) and an lm_head tied to the input embedding.
    Arch(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=64, n_layer=8, n_head=4, n_positions=256, vocab_size=VOCAB),
    ),
    Arch(
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, vocab_size=VOCAB),
    ),
    Arch(
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            vocab_size=VOCAB,
            word_embed_proj_dim=64,
            max_position_embeddings=256,
            pad_token_id=1,
        ),
    ),
    Arch(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_LLAMA_SIZES, "num_local_experts": 4, "num_experts_per_tok": 2},
        offload_params=frozenset({"experts"}),
    ),
    Arch(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        # Has a shared expert (`mlp.shared_expert.*`) that must stay resident: "experts" does not match it.
        {
            **_LLAMA_SIZES,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        offload_params=frozenset({"experts"}),
    ),
    Arch(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_LLAMA_SIZES, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
        offload_params=frozenset({"experts"}),
    ),
    Arch(
        "t5",
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            d_model=64,
            d_ff=128,
            d_kv=16,
            num_heads=4,
            num_layers=8,
            num_decoder_layers=8,
            vocab_size=VOCAB,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        seq2seq=True,
    ),
    Arch(
        "bart",
        "BartConfig",
        "BartForConditionalGeneration",
        dict(
            d_model=64,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            encoder_layers=8,
            decoder_layers=8,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=256,
        ),
        seq2seq=True,
    ),
]

ARCHS_BY_NAME = {arch.name: arch for arch in ARCHS}


def prompt(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    """Random token ids in [3, VOCAB): clear of the usual pad/bos/eos ids 0, 1, 2."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def left_padded(lengths: list[int], pad_token_id: int = 0, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` for prompts of the given lengths, left-padded to the longest."""
    ids = prompt(len(lengths), max(lengths), seed)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, ids.shape[1] - length :] = 1
    return ids.masked_fill(mask == 0, pad_token_id), mask
