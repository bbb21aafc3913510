"""Tiny random-weight models built from transformers configs, for tests (nothing is downloaded), and the helpers that
run them and compare what they compute."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# The tiny models' attention sizes and vocabulary (ATTENTION), and all their sizes but the layer count (_TINY).
ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
_TINY = dict(ATTENTION, intermediate_size=128)
# The marks of a parametrized case that needs CUDA: `pytest.param("cuda", marks=CUDA)`.
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tiny_llama(
    num_layers: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    fields = dict(_TINY, num_hidden_layers=num_layers, max_position_embeddings=256)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).to(dtype).eval()


def tiny_qwen2(num_layers: int = 4, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Qwen2ForCausalLM:
    """tiny_llama's sizes in Qwen2, whose q/k/v projections have biases."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_TINY, num_hidden_layers=num_layers)).to(dtype).eval()


def gpu_llama(num_layers: int = 8, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """~90 MB of bf16 weights per layer (180 MB in fp32): a layer's copy (~2 ms) takes far longer than its decode
    step, so a missing wait or fork shows up as wrong tokens on a GPU."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def prompt(batch: int = 2, length: int = 7, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def logits(model: torch.nn.Module, vocab: int = 128) -> torch.Tensor:
    """The model's logits for `prompt(vocab=vocab)`."""
    with torch.no_grad():
        return model(prompt(vocab=vocab)).logits


def llama_and_logits(num_layers: int = 8) -> tuple[LlamaForCausalLM, torch.Tensor, torch.Tensor]:
    """`tiny_llama(num_layers)`, `prompt()` and the model's logits for that prompt."""
    model = tiny_llama(num_layers)
    ids = prompt()
    with torch.no_grad():
        return model, ids, model(ids).logits


def generate_with_logits(model, ids, **kwargs):
    """Greedy (unless kwargs say otherwise) generate of 6 new tokens that returns every step's logits."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=kwargs.pop("attention_mask", torch.ones_like(ids)),
            max_new_tokens=kwargs.pop("max_new_tokens", 6),
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )


def assert_same_generation(got, want) -> None:
    """Tokens and every step's logits bitwise equal."""
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as flat bytes, to compare packed or quantized values bitwise."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def rewrite_checkpoint(folder, change, metadata=None) -> None:
    """A single-file checkpoint's tensors passed through `change(tensors)` (a dict it edits), saved back in place with
    the file's metadata, or with `metadata(kept)` when given."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(folder / "model.safetensors", "pt") as opened:
        kept = opened.metadata()
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata=metadata(kept) if metadata else kept)
