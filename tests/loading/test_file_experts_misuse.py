"""Routed experts read from the checkpoint's files (`Placement.READ_ROUTED`) under misuse: files changed or replaced
under a dispatched model, removals, interrupts ([Note: experts read from files] in
hf_prefetch/runtime/file_experts.py)."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import hf_prefetch
from tests.loading.test_file_experts import RESERVE, _ids, _load, _logits, _saved, loaded_copy


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen3_moe")


def _expert_bytes(shard, layer: int) -> tuple[int, int]:
    # (start, end) in `shard` of expert 0's down_proj of `layer`, stored one tensor per expert.
    from hf_prefetch.loading.checkpoint import Checkpoint

    with Checkpoint.open(shard) as checkpoint:
        entry = checkpoint.entries[f"model.layers.{layer}.mlp.experts.0.down_proj.weight"]
    return entry.offset, entry.offset + entry.nbytes


def _same_as(model, reference) -> None:
    for (name, got), value in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, value), name


def test_a_removal_refuses_experts_files_written_on_disk_and_reads_them_once_restored(qwen3, tmp_path):
    reference = qwen3[1]
    shard, model, ids, want = loaded_copy(qwen3, tmp_path)
    assert torch.equal(_logits(model, ids), want)
    kept, original = shard.read_bytes(), os.stat(shard)
    start, end = _expert_bytes(shard, reference.config.num_hidden_layers - 1)
    with open(shard, "r+b") as file:
        file.seek(start)
        file.write(bytes(end - start))
    with pytest.raises(RuntimeError, match=r"model\.safetensors changed on disk"):
        hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is not None  # nothing undone
    with open(shard, "r+b") as file:
        file.seek(start)
        file.write(kept[start:end])
    os.utime(shard, ns=(original.st_atime_ns, original.st_mtime_ns))
    assert torch.equal(_logits(model, ids), want)
    hf_prefetch.remove_offload(model)
    _same_as(model, reference)


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_removal_reads_the_experts_from_the_files_the_model_opened_where_their_paths_changed(qwen3, tmp_path, how):
    folder, reference, max_memory = qwen3
    copied = shutil.copytree(folder, tmp_path / "copy")
    model = _load(copied, max_memory)
    shard = copied / "model.safetensors"
    start, end = _expert_bytes(shard, reference.config.num_hidden_layers - 1)
    if how == "replaced":  # another checkpoint in its place
        changed = bytearray(shard.read_bytes())
        changed[start:end] = bytes(end - start)
        (tmp_path / "new").write_bytes(changed)
        os.replace(tmp_path / "new", shard)
    else:
        shard.unlink()
    ids = _ids()
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    hf_prefetch.remove_offload(model)
    _same_as(model, reference)


def test_a_host_budget_the_files_cannot_help_names_the_least_one_they_can(qwen3):
    folder, reference, max_memory = qwen3
    refused = {0: max_memory[0], "cpu": 4096}
    with pytest.raises(
        ValueError, match=r"Raise max_memory\['cpu'\] to at least .* \((\d+) bytes, the rest read"
    ) as info:
        hf_prefetch.plan(folder, device="cpu", max_memory=refused, reserve_bytes=RESERVE)
    least = int(re.search(r"\((\d+) bytes, the rest read", str(info.value)).group(1))
    assert "a host expert cache of one token's picks" in str(info.value)
    with pytest.raises(ValueError, match=rf"\({least} bytes"):
        hf_prefetch.plan(folder, device="cpu", max_memory={**refused, "cpu": least - 1}, reserve_bytes=RESERVE)
    plan = hf_prefetch.plan(folder, device="cpu", max_memory={**refused, "cpu": least}, reserve_bytes=RESERVE)
    assert plan.host_bytes <= least
    model = _load(folder, {**refused, "cpu": least})
    ids = _ids(5)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_the_stats_table_shows_the_host_expert_cache(qwen3):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    ids = _ids(1, seed=4)
    for _ in range(3):  # the same picks again: some found in the cache
        _logits(model, ids)
    stats = hf_prefetch.stats(model)
    assert stats.host_cache_hits > 0 and stats.host_cache_misses > 0
    header, *rows = str(stats).splitlines()
    assert header.split()[-6:] == ["host", "cache", "hits", "host", "cache", "misses"]
    total = next(row for row in rows if row.startswith("total"))
    assert total.split()[-2:] == [str(stats.host_cache_hits), str(stats.host_cache_misses)]


def test_a_removal_or_collection_while_an_autograd_graph_holds_the_experts_completes(qwen3):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    ids = _ids()
    kept = model(ids).logits  # grad enabled: the graph holds the parameters
    assert kept.requires_grad and torch.equal(kept.detach(), _logits(reference, ids))
    hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None
    _same_as(model, reference)
    model = _load(folder, max_memory)
    kept = model(ids).logits
    state = hf_prefetch.get_state(model)
    state.finalizer()  # what collecting the model runs
    assert not state.finalizer.alive and not state.reads


def test_cpu_experts_where_every_routed_layer_reads_its_experts_from_files_says_why_it_does_nothing(qwen3):
    folder, reference, max_memory = qwen3
    budget = {**max_memory, "cpu": max_memory["cpu"] // 2}  # too little to pin any layer's experts
    with pytest.warns(UserWarning, match=r"computes nothing on the host.*read from the checkpoint's files.*max_memory"):
        model = _load(folder, budget, offload=hf_prefetch.PrefetchConfig(cpu_experts=True))
    plan = hf_prefetch.get_state(model).plan
    assert plan.host_compute is None
    assert all(layer.experts_from_files for ring in plan.rings for layer in ring.streamed if layer.routed)
    ids = _ids()
    assert torch.equal(_logits(model, ids), _logits(reference, ids))  # over the files, as without cpu_experts
    hf_prefetch.remove_offload(model)
