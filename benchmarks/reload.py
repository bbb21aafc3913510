"""Reload time for the 8B shape: hf_prefetch.reload_weights from a checkpoint into a dispatched model, in place.

Builds a random bf16 Llama-3.1-8B-shaped model on the GPU and dispatches it (group_size=2, num_in_group=1,
prefetch_step=2), writes (once, reused afterwards) a checkpoint of other random weights with benchmarks/load.py's
builder and warms the page cache, then times `reload_weights(model, folder)`, with and without a per-layer `process`
callback (a no-op: the cost of bringing each streamed layer into its slot and storing it back). Checks that the
reloaded model generates the same tokens as a fresh `from_pretrained` of the checkpoint, and that the tensors and the
buffer pool are the ones the dispatch made. Under 2 minutes on an H100 (most of it writing the 16 GB checkpoint once).
Run on a GPU machine:  PYTHONUNBUFFERED=1 python benchmarks/reload.py [--dir /tmp/ckpt8b] [--layers 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import LLAMA_8B, build_model, timed  # noqa: E402
from load import PREFETCH, build_checkpoint, warm_page_cache  # noqa: E402

import hf_prefetch  # noqa: E402

NEW_TOKENS = 8


def identities(model: torch.nn.Module) -> list:
    state = hf_prefetch.get_state(model)
    tensors = [(id(t), t.data_ptr()) for t in [*model.parameters(), *model.buffers()]]
    return [tensors, [o.host.data_ptr() for o in state.offloaded], [id(r.pool) for r in state.engine.rings]]


def generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt8b")
    parser.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    args = parser.parse_args()
    folder = Path(args.dir)
    device = torch.cuda.get_device_name()
    print(f"GPU: {device}  torch {torch.__version__}")
    build_checkpoint(folder, args.layers)
    checkpoint_bytes = warm_page_cache(folder)

    model = hf_prefetch.dispatch_model(
        build_model(args.layers), device="cuda", offload=hf_prefetch.PrefetchConfig(**PREFETCH)
    )
    torch.cuda.synchronize()
    ids = torch.randint(3, 1000, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    generate(model, ids)  # the slots hold whatever a generate left in them
    before = identities(model)

    rows = []
    for label, process in [("reload_weights", None), ("reload_weights", None), ("+ process (no-op)", lambda _: None)]:
        seconds = timed(lambda process=process: hf_prefetch.reload_weights(model, folder, process=process))
        rows.append((label, seconds))
    tokens = generate(model, ids)
    same_tensors = identities(model) == before

    started = time.perf_counter()
    fresh = hf_prefetch.from_pretrained(
        folder, device="cuda", progress=False, offload=hf_prefetch.PrefetchConfig(**PREFETCH)
    )
    torch.cuda.synchronize()
    rows.append(("from_pretrained (fresh)", time.perf_counter() - started))
    tokens_equal = torch.equal(tokens, generate(fresh, ids))

    plan = hf_prefetch.get_state(model).plan
    lines = [
        f"{args.layers}-layer 8B shape, checkpoint {checkpoint_bytes / 1e9:.1f} GB (page cache warm), {PREFETCH}, "
        f"pinned host {plan.offloaded_bytes / 2**30:.2f} GiB, {device}",
        f"{'what':<24} {'seconds':>7} {'GB/s':>6}",
        *(f"{label:<24} {s:>7.2f} {checkpoint_bytes / s / 1e9:>6.2f}" for label, s in rows),
        f"tokens equal to the fresh load: {tokens_equal}; same tensors and pool after reloading: {same_tensors}",
    ]
    table = "\n".join(lines)
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "reload.log"), "a") as log:
            log.write(table + "\n\n")
    if not (tokens_equal and same_tensors):
        sys.exit("FAILED: the reloaded model differs from a fresh load")


if __name__ == "__main__":
    main()
