"""What each rank of a tensor-parallel test group runs (spawned by test_tensor_parallel.py, or launched by torchrun):
transformers' tensor-parallel model as the reference, then the same model dispatched and loaded by hf_prefetch, each
rank checking its own tokens, bytes and errors. A failed check raises in the rank, which fails the test with it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Sizes every tested mesh (2 and 4 ranks) divides: heads, key-value heads, MLP rows and the vocabulary.
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
STRIDE = dict(group_size=1, num_in_group=1, prefetch_step=1)  # every layer streams, through two slots
NEW_TOKENS = 8


def save_llama(folder: Path, num_layers: int = 4, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**SIZES, **overrides}, num_hidden_layers=num_layers, max_position_embeddings=64)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def ids() -> torch.Tensor:
    return torch.randint(3, SIZES["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))


def run(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for `ids()` and its greedy tokens after them (on the CPU)."""
    inputs = ids().to(model.device)
    with torch.no_grad():
        logits = model(inputs).logits
        tokens = model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return logits.cpu(), tokens.cpu()


def main(rank: int, world: int, port: int, folder: str, out: str, device: str = "cpu") -> None:
    """One rank of `world` on the CPU (gloo), or on GPU `rank` (NCCL)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    if device == "cpu":  # transformers' tensor parallelism takes the GPUs where there are some
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
    try:
        results = check_all(Path(folder), rank, world)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def tp_model(folder: Path, world: int):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    tp = DistributedConfig(tp_size=world)
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=tp).eval()


def local_tensors(model) -> dict[str, torch.Tensor]:
    return {name: getattr(p, "_local_tensor", p).detach().clone() for name, p in model.named_parameters()}


def check_all(folder: Path, rank: int, world: int) -> dict:
    from transformers.distributed import DistributedConfig

    import hf_prefetch

    want_logits, want_tokens = run(tp_model(folder / "llama", world))
    results = {"logits": want_logits, "tokens": want_tokens}

    # dispatch_model on transformers' sharded model: every layer streams the rank's shards through two slots.
    model = tp_model(folder / "llama", world)
    before = local_tensors(model)
    model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**STRIDE))
    plan = hf_prefetch.get_state(model).plan
    assert [share.rank for share in plan.ranks] == list(range(world)), plan.ranks
    assert plan.ranks[rank].host_bytes == plan.host_bytes and plan.ranks[rank].device == str(model.device)
    local = sum(getattr(p, "_local_tensor", p).nbytes for name, p in model.named_parameters() if ".layers." in name)
    assert plan.offloaded_bytes == local, (plan.offloaded_bytes, local)  # the rank's shards, not the whole layers
    got = run(model)
    assert torch.equal(got[0], want_logits) and torch.equal(got[1], want_tokens), "dispatch_model differs"
    assert hf_prefetch.stats(model).misses == 0
    hf_prefetch.remove_offload(model)
    assert all(torch.equal(local_tensors(model)[name], value) for name, value in before.items())
    assert type(model.model.layers[1].mlp.down_proj.weight).__name__ == "DTensor"
    assert torch.equal(run(model)[0], want_logits), "remove_offload differs"

    results.update(check_loading(folder, world, want_logits, want_tokens))
    tp = dict(distributed_config=DistributedConfig(tp_size=world))

    # Budget: the rank's share less half a layer's; a pool of two slots then leaves one layer resident.
    sharded = tp_model(folder / "llama", world)
    layer = sum(getattr(p, "_local_tensor", p).nbytes for p in sharded.model.layers[0].parameters())
    budget = {0: hf_prefetch.plan(sharded, hf_prefetch.PrefetchConfig(group_size=10**6)).resident_bytes - layer // 2}
    fitted = hf_prefetch.from_pretrained(folder / "llama", max_memory=budget, reserve_bytes=0, **tp)
    streamed = [layer.index for layer in hf_prefetch.get_state(fitted).plan.rings[0].streamed]
    assert len(streamed) == 3, streamed
    got = run(fitted)
    assert torch.equal(got[0], want_logits) and torch.equal(got[1], want_tokens), "a budget's plan differs"

    # Ranks given different configs: every rank raises, naming the rank, and no model is changed.
    model = tp_model(folder / "llama", world)
    before = local_tensors(model)
    step = 2 if rank == world - 1 else 1
    expect_error(
        lambda: hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**{**STRIDE, "prefetch_step": step})),
        f"rank(s) {world - 1} differ from rank 0 (prefetch_step=1 on rank 0, 2 on rank {world - 1})",
    )
    untouched(model, before, want_logits)
    # The same config on every rank agrees, whatever each process's hashing does to a frozenset's order.
    segments = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    hf_prefetch.plan(model, hf_prefetch.PrefetchConfig(**STRIDE, offload_params=segments))
    # A rank whose budget cannot hold its share: every rank raises, naming it.
    budget = {0: 10_000} if rank == world - 1 else budget
    own = (
        "does not fit max_memory[0]"
        if rank == world - 1
        else f"Rank {world - 1} of the tensor-parallel mesh cannot plan"
    )
    expect_error(lambda: hf_prefetch.dispatch_model(model, max_memory=budget, reserve_bytes=0), own)
    untouched(model, before, want_logits)

    # A rank that fails after every rank planned (its pinned memory full, say): every rank rolls back and raises.
    from hf_prefetch import dispatch
    from hf_prefetch.lifecycle import attach

    def full(*args, **kwargs):
        raise RuntimeError("pinned memory is full")

    failing = "pinned memory is full" if rank == world - 1 else f"Rank {world - 1} of the tensor-parallel mesh failed"
    dispatching = lambda: hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**STRIDE))  # noqa: E731
    for module, name, call in (
        (dispatch, "HostArena", dispatching),  # before the dispatch changes anything
        (dispatch, "attach", dispatching),  # once it has
        (
            attach,
            "attach",
            lambda: hf_prefetch.from_pretrained(folder / "llama", hf_prefetch.PrefetchConfig(**STRIDE), **tp),
        ),
    ):
        kept = getattr(module, name)
        setattr(module, name, full if rank == world - 1 else kept)
        try:
            expect_error(call, failing, RuntimeError if rank == world - 1 else ValueError)
        finally:
            setattr(module, name, kept)
    untouched(model, before, want_logits)
    # A Ctrl-C on one rank while it plans: that rank raises it, the others name it, and no rank waits.
    from hf_prefetch.planning import choose

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    kept = choose._choose
    choose._choose = interrupted if rank == world - 1 else kept
    try:
        planned = (
            f"Rank {world - 1} of the tensor-parallel mesh cannot plan its share, so no rank dispatches: Keyboard"
        )
        last = rank == world - 1
        expect_error(dispatching, "" if last else planned, KeyboardInterrupt if last else ValueError)
    finally:
        choose._choose = kept
    untouched(model, before, want_logits)
    # A re-dispatch that one rank cannot validate: every rank keeps its dispatch, none half-replaced.
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**STRIDE))
    kept = dispatch._check_replacement_arena
    dispatch._check_replacement_arena = full if rank == world - 1 else kept
    try:
        again = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
        replacing = lambda: hf_prefetch.dispatch_model(model, again, replace=True)  # noqa: E731
        expect_error(replacing, failing, RuntimeError if rank == world - 1 else ValueError)
    finally:
        dispatch._check_replacement_arena = kept
    assert hf_prefetch.get_state(model).plan.config == hf_prefetch.PrefetchConfig(**STRIDE)
    assert torch.equal(run(model)[0], want_logits)
    hf_prefetch.remove_offload(model)

    # A mesh that does not divide a sharded dimension.
    uneven = tp_model(folder / "uneven", world)
    expect_error(lambda: hf_prefetch.dispatch_model(uneven), "which its mesh of")
    return results


def check_loading(folder: Path, world: int, want_logits=None, want_tokens=None) -> dict:
    from transformers.distributed import DistributedConfig

    import hf_prefetch

    if want_logits is None:
        want_logits, want_tokens = run(tp_model(folder / "llama", world))
    results = {"logits": want_logits, "tokens": want_tokens}
    # from_pretrained reads only the rank's slices (rows of column-parallel weights, column blocks of row-parallel
    # ones, each a byte range of the stored tensor) straight into its host storage or its resident tensors; by
    # default a slice stored as loaded stays in the page cache's pages (mapped), with map_files=False it is read.
    from hf_prefetch.loading import reader

    config = hf_prefetch.PrefetchConfig(**STRIDE)
    tp = dict(distributed_config=DistributedConfig(tp_size=world))
    got = run(hf_prefetch.from_pretrained(folder / "llama", config, **tp))
    assert torch.equal(got[0], want_logits) and torch.equal(got[1], want_tokens), "from_pretrained differs"
    read, count = [0], reader.TensorReader._count

    def counting(self, nbytes, direct, mapped=False):
        read[0] += nbytes
        count(self, nbytes, direct, mapped)

    reader.TensorReader._count = counting
    try:
        loaded = hf_prefetch.from_pretrained(folder / "llama", config, **tp, map_files=False)
    finally:
        reader.TensorReader._count = count
    share = sum(getattr(p, "_local_tensor", p).nbytes for p in loaded.parameters())
    assert read[0] == share, (read[0], share)
    got = run(loaded)
    assert torch.equal(got[0], want_logits) and torch.equal(got[1], want_tokens), "from_pretrained differs"
    results["read"], results["share"] = read[0], share
    expect_error(lambda: hf_prefetch.reload_weights(loaded, folder / "llama"), "the shards of a tensor-parallel model")
    return results


def expect_error(call, text: str, kind: type = ValueError) -> None:
    try:
        call()
    except kind as error:
        assert text in str(error), f"{text!r} is not in: {error}"
    else:
        raise AssertionError(f"no error (expected one with {text!r})")


def untouched(model, before: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
    import hf_prefetch

    assert hf_prefetch.get_state(model) is None
    assert all(torch.equal(local_tensors(model)[name], value) for name, value in before.items())
    assert torch.equal(run(model)[0], logits)


if __name__ == "__main__":  # under torchrun (python -m torch.distributed.run ... ranks.py FOLDER OUT): the loading
    dist.init_process_group("gloo")
    try:
        results = check_loading(Path(sys.argv[1]), dist.get_world_size())
        torch.save(results, Path(sys.argv[2]) / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()
