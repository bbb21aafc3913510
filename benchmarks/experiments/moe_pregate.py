"""How well a layer's experts can be predicted before its router runs, on the random Qwen3-30B-A3B-shaped model of
`moe.py` (its widths, fewer layers). CPU only; no library code: a question for the routed experts' fetch-ahead.

Sampled decoding (seeded) of `--tokens` tokens from a 16-token prompt. For each layer and token, the share of the 8
experts the router picked that a predictor names:
- `recent`: the experts the same layer picked for the token before (what `PrefetchConfig.recent_experts` fetches);
- `d1`, `d2`, `d3`: the layer's own router (its post-attention norm, then its gate's top 8) applied to the hidden
  state entering layer L, L-1 or L-2 (pre-gating: known that many layers ahead, before the layer's attention).

    python benchmarks/experiments/moe_pregate.py [--layers 8] [--tokens 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe import QWEN3_30B_A3B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    config = Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": args.layers})
    config._experts_implementation = "eager"
    top_k = config.num_experts_per_tok
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    layers = model.model.layers
    entering: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    picked: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    for number, layer in enumerate(layers):
        layer.register_forward_pre_hook(
            lambda module, args, kwargs, number=number: entering[number].append(
                (args[0] if args else kwargs["hidden_states"])[:, -1].detach().clone()
            ),
            with_kwargs=True,
        )
        layer.mlp.gate.register_forward_hook(
            lambda module, args, out, number=number: picked[number].append(out[2].reshape(-1, top_k)[-1].clone())
        )
    ids = torch.randint(0, config.vocab_size, (1, 16))
    torch.manual_seed(1)
    with torch.no_grad():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
            do_sample=True, top_k=0, top_p=1.0,
        )  # fmt: skip
    steps = range(2, len(picked[0]))  # decode steps with a step before them

    def share(a: torch.Tensor, b: torch.Tensor) -> float:
        return len(set(a.tolist()) & set(b.tolist())) / top_k

    def pregate(layer: int, source: int, step: int) -> torch.Tensor:
        normed = layers[layer].post_attention_layernorm(entering[source][step])
        with torch.no_grad():
            return torch.topk(torch.nn.functional.linear(normed, layers[layer].mlp.gate.weight), top_k).indices[0]

    totals: dict[str, list[float]] = {"recent": [], "d1": [], "d2": [], "d3": []}
    print(f"{'layer':>5} {'recent':>7} {'d1':>6} {'d2':>6} {'d3':>6}")
    for layer in range(len(layers)):
        row = [sum(share(picked[layer][s], picked[layer][s - 1]) for s in steps) / len(steps)]
        totals["recent"].append(row[0])
        for distance in (1, 2, 3):
            source = layer - distance + 1
            if source < 0:
                row.append(None)
                continue
            value = sum(share(picked[layer][s], pregate(layer, source, s)) for s in steps) / len(steps)
            totals[f"d{distance}"].append(value)
            row.append(value)
        print(f"{layer:>5} " + " ".join(f"{v:>6.3f}" if v is not None else f"{'-':>6}" for v in row))
    print("mean over layers: " + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in totals.items() if v))


if __name__ == "__main__":
    main()
