"""The end-to-end demo behind `python -m hf_prefetch.demo`: checkpoint -> streamed model -> the same tokens.

It builds a small random-weight Llama from a `LlamaConfig` (nothing is downloaded), saves it with `save_pretrained` as
a sharded safetensors checkpoint in a temporary folder, loads it with `hf_prefetch.from_pretrained` (every second
layer streamed from host memory), generates greedily, and checks the tokens against the same checkpoint loaded by
plain `transformers.AutoModelForCausalLM`. It prints the plan and the transfer statistics, then removes the offload.
Exits with status 1 when the tokens differ.

The library never imports this module; it only uses the public API.

    python -m hf_prefetch.demo                      # the GPU when there is one, else the CPU
    python -m hf_prefetch.demo --device cpu --layers 12 --tokens 40
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import hf_prefetch

# Small enough to run in seconds on a CPU; 12 shards of at most 2 MB when saved with 8 layers.
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
VOCAB_SIZE = 1024
PROMPT_LENGTH = 8
# The layer selection shown by the demo: layers 1, 3, 5, ... stream, copies start two streamed layers ahead.
CONFIG = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)


def save_checkpoint(folder: Path, num_layers: int, seed: int = 0) -> None:
    """Save a random-weight float32 Llama with `num_layers` layers to `folder` as a sharded safetensors checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        # Larger than the default 0.02, so that greedy decoding varies from token to token instead of repeating one.
        initializer_range=0.1,
        # No end-of-sequence token: greedy generation always produces exactly the requested number of tokens.
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="2MB")


def greedy(model: nn.Module, prompt: torch.Tensor, num_tokens: int, **generate_kwargs) -> torch.Tensor:
    """The `num_tokens` tokens greedy decoding appends to `prompt` (shape `[1, prompt_length]`), as a 1-D tensor."""
    ids = prompt.to(model.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False, **generate_kwargs
        )
    return out[0, prompt.shape[1] :].cpu()


def load_reference(folder: Path, device: str) -> nn.Module:
    """The checkpoint loaded by plain transformers, whole on `device`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).to(device).eval()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hf_prefetch.demo",
        description="Stream every second layer of a small random Llama and check greedy tokens against transformers.",
    )
    parser.add_argument("--device", default=None, help="'cuda', 'cuda:1' or 'cpu' (default: cuda when available)")
    parser.add_argument("--layers", type=int, default=8, help="number of decoder layers (default: 8)")
    parser.add_argument("--tokens", type=int, default=20, help="number of tokens to generate (default: 20)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here; use --device cpu.")
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: need at least 2 layers, so that one of them streams.")
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: generate at least 1 token.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 when hf_prefetch's tokens equal transformers', 1 otherwise)."""
    args = _parse_args(argv)
    prompt = torch.randint(3, VOCAB_SIZE, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    print(f"hf_prefetch {hf_prefetch.__version__}, torch {torch.__version__}, device {args.device}")

    with tempfile.TemporaryDirectory(prefix="hf_prefetch-demo-") as tmp:
        folder = Path(tmp)
        save_checkpoint(folder, args.layers)
        shards = sorted(folder.glob("*.safetensors"))
        print(f"saved a random {args.layers}-layer Llama as {len(shards)} safetensors shards in a temporary folder")

        model = hf_prefetch.from_pretrained(folder, CONFIG, device=args.device, progress=False)
        tokens = greedy(model, prompt, args.tokens)
        compiled = None
        if args.device.startswith("cuda"):
            # With a static cache on CUDA, transformers compiles the decode step (inductor, "reduce-overhead": CUDA
            # graphs); the streamed layers' copies are recorded into the graphs and replayed with them.
            compiled = greedy(model, prompt, args.tokens, cache_implementation="static")
        reference = load_reference(folder, args.device)
        expected = greedy(reference, prompt, args.tokens)
        del reference

    identical = torch.equal(tokens, expected)
    print(f"prompt:       {prompt[0].tolist()}")
    print(f"hf_prefetch:  {tokens.tolist()}")
    print(f"transformers: {expected.tolist()}")
    if compiled is not None:
        print(f"hf_prefetch, compiled + CUDA graphs (cache_implementation='static'): {compiled.tolist()}")
        identical = identical and torch.equal(compiled, expected)
    print(f"identical: {identical}")

    print("\nplan (hf_prefetch.get_state(model).plan):")
    print(hf_prefetch.get_state(model).plan)
    print("\ntransfer statistics (hf_prefetch.stats(model)):")
    print(hf_prefetch.stats(model))
    if not args.device.startswith("cuda"):
        print(
            "(on the CPU the copies are synchronous: every copy is time the forward waits, nothing overlaps. On a GPU "
            "they run on a copy stream while the layers before them compute.)"
        )

    hf_prefetch.remove_offload(model)
    print(f"\nremoved the offload: hf_prefetch.get_state(model) is None -> {hf_prefetch.get_state(model) is None}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
