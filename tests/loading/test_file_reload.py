"""`reload_weights` of a model that reads weights from the checkpoint's files at each use: the tensors read from files
are read from the new checkpoint's files from then on, the others written in place (hf_prefetch/loading/
reload_files.py)."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_prefetch
from hf_prefetch.host import diskio
from hf_prefetch.planning.selection import make_plan
from tests.models import ATTENTION, assert_same_generation, generate_with_logits, logits, prompt
from tests.moe_models import VOCAB, moe_model

RESERVE = 2**20


def _llama(seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(intermediate_size=128, num_hidden_layers=8, **ATTENTION))


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Two 8-layer Llamas of one configuration, saved in shards of different sizes, each as transformers loads it,
    and a budget that streams every layer with three quarters of the host memory their pinning takes:
    (folders, references, max_memory)."""
    folders, references = [], []
    for seed, shard in ((0, "200KB"), (1, "130KB")):
        folder = tmp_path_factory.mktemp(f"llama{seed}")
        _llama(seed).save_pretrained(folder, max_shard_size=shard)
        folders.append(folder)
        references.append(AutoModelForCausalLM.from_pretrained(folder).eval())
    every = make_plan(references[0], hf_prefetch.PrefetchConfig(), streamed=range(8))
    return folders, references, {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes * 3 // 4}


def _load(folder, max_memory, **kwargs):
    return hf_prefetch.from_pretrained(folder, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, **kwargs)


def _read_paths(model) -> set:
    state = hf_prefetch.get_state(model)
    paths = set()
    for where in state.file_extents.values():
        paths |= {e.path for e in where.extents} if hasattr(where, "extents") else {where.path}
    return paths


def _open_fds() -> set[str]:
    return {
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    }


def test_layers_read_from_files_are_read_from_the_new_checkpoint_and_the_old_files_may_go(llamas, tmp_path):
    (first, second), (reference, other), max_memory = llamas
    copied = shutil.copytree(first, tmp_path / "first")
    model = _load(copied, max_memory)
    state = hf_prefetch.get_state(model)
    assert state.reads_files and torch.equal(logits(model), logits(reference))
    hf_prefetch.reload_weights(model, second)
    assert all(path.parent == second for path in _read_paths(model))
    shutil.rmtree(copied)  # nothing of the old checkpoint is read any more, nor mapped
    with open("/proc/self/maps") as maps:
        assert str(copied) not in maps.read()
    assert torch.equal(logits(model), logits(other))
    assert_same_generation(generate_with_logits(model, prompt()), generate_with_logits(other, prompt()))
    assert hf_prefetch.stats(model).misses == 0 and "read from files" in str(state.plan)
    hf_prefetch.reload_weights(model, first if first.exists() else second)  # and back again
    assert torch.equal(logits(model), logits(reference))
    hf_prefetch.reload_weights(model, second)
    hf_prefetch.remove_offload(model)  # the removed model holds the weights last read, from the files last read
    for (name, got), want in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert torch.equal(logits(model), logits(other))


def test_a_checkpoint_replaced_is_read_as_opened_and_one_written_over_fails_until_either_is_reloaded(llamas, tmp_path):
    (first, second), (reference, other), max_memory = llamas
    folder = shutil.copytree(first, tmp_path / "model")
    model = _load(folder, max_memory)
    for shard in folder.glob("*.safetensors"):  # new files in place of the ones being read
        shard.unlink()
    for shard in second.iterdir():
        shutil.copy(shard, folder / shard.name)
    assert torch.equal(logits(model), logits(reference))  # the files it opened, whole
    hf_prefetch.reload_weights(model, folder)
    assert torch.equal(logits(model), logits(other))
    inodes = {shard: shard.stat().st_ino for shard in folder.glob("*.safetensors")}
    reference.save_pretrained(tmp_path / "again", max_shard_size="130KB")  # the same shards' names
    for shard in (tmp_path / "again").glob("model*"):
        with open(folder / shard.name, "wb") as file:  # written over, in place (the index too)
            file.write(shard.read_bytes())
    assert {shard: shard.stat().st_ino for shard in folder.glob("*.safetensors")} == inodes
    with pytest.raises(RuntimeError, match=r"changed on disk since it was opened"):
        for _ in range(3):
            logits(model)
    hf_prefetch.reload_weights(model, folder)  # the changed files are read again
    assert torch.equal(logits(model), logits(reference)) and torch.equal(logits(model), logits(reference))


def test_a_state_dict_for_tensors_read_from_files_is_refused_and_one_for_the_others_is_written(llamas):
    (first, _), (reference, other), max_memory = llamas
    model = _load(first, max_memory)
    want = logits(reference)
    state = hf_prefetch.get_state(model)
    read = next(iter(state.file_extents))
    with pytest.raises(ValueError, match=rf"state_dict\['{read}'\] .* read from the checkpoint's files.* Nothing"):
        hf_prefetch.reload_weights(model, other.state_dict())
    with pytest.raises(ValueError, match=r"has shape \[3\]"):  # refused while it lists the destinations
        hf_prefetch.reload_weights(model, {"model.norm.weight": torch.ones(3)}, strict=False)
    with pytest.raises(RuntimeError, match=r"read from the checkpoint's files at each use .* are refused"):
        model.state_dict()  # still refused after either
    assert torch.equal(logits(model), want)
    written = {k: v for k, v in other.state_dict().items() if k not in state.file_extents}
    hf_prefetch.reload_weights(model, written, strict=False)
    mixed = copy.deepcopy(reference)
    mixed.load_state_dict(written, strict=False)
    assert torch.equal(logits(model), logits(mixed))
    with pytest.raises(ValueError, match=r"process=.* read from the checkpoint's files .* Nothing was written"):
        hf_prefetch.reload_weights(model, first, process=lambda layer: None)
    assert torch.equal(logits(model), logits(mixed))


def test_a_new_checkpoint_that_stores_a_tensor_read_from_files_otherwise_is_refused_before_anything_changes(
    llamas, tmp_path
):
    (first, second), (reference, other), max_memory = llamas
    model = _load(first, max_memory)
    want = logits(reference)
    state = hf_prefetch.get_state(model)
    read = next(iter(state.file_extents))
    halved = tmp_path / "half"
    shutil.copytree(second, halved)
    for shard in halved.glob("*.safetensors"):
        tensors = load_file(shard)
        if read in tensors:
            tensors[read] = tensors[read].half()
            save_file(tensors, shard, metadata={"format": "pt"})
    before, extents = _open_fds(), dict(state.file_extents)
    with pytest.raises(ValueError, match=rf"{read} is read from the checkpoint's files .*torch\.float16.* Nothing"):
        hf_prefetch.reload_weights(model, halved)
    assert state.file_extents == extents and _open_fds() <= before
    assert torch.equal(logits(model), want)


def test_new_files_that_cannot_be_opened_leave_the_model_reading_the_old_ones(llamas, monkeypatch):
    (first, second), (reference, _), max_memory = llamas
    model = _load(first, max_memory)
    want = logits(reference)
    real, opened = diskio.open_for_reads, []

    def failing(path):
        if path.parent == second and opened:
            raise OSError(13, f"Permission denied: {path}")
        opened.append(path)
        return real(path)

    monkeypatch.setattr("hf_prefetch.host.file_reads.open_for_reads", failing)
    before = _open_fds()
    with pytest.raises(OSError, match="Permission denied"):
        hf_prefetch.reload_weights(model, second)
    assert opened and _open_fds() <= before  # what it opened is closed again
    monkeypatch.undo()
    assert all(path.parent == first for path in _read_paths(model))
    assert torch.equal(logits(model), want)


def _moe(tmp_path_factory, family: str):
    # Two tiny models of `family` saved as transformers saves them, their loads, and a budget that reads every
    # layer's experts from files as picked with half the host memory their pinning takes.
    folders, references = [], []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"{family}{seed}")
        moe_model(family, seed=seed).save_pretrained(folder)
        folders.append(folder)
        references.append(AutoModelForCausalLM.from_pretrained(folder).eval())
    layers = range(references[0].config.num_hidden_layers)
    every = make_plan(references[0], hf_prefetch.PrefetchConfig(offload_params=["experts"]), streamed=layers)
    return folders, references, {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes // 2}


def _ids() -> torch.Tensor:
    # Two rows: the CPU's one-row kernels round differently at different addresses.
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # experts stored one by one, and fused
def test_experts_read_from_files_are_read_from_the_new_checkpoint_with_the_cache_emptied(tmp_path_factory, family):
    (first, second), (reference, other), max_memory = _moe(tmp_path_factory, family)
    model = _load(first, max_memory)
    state = hf_prefetch.get_state(model)
    assert any(layer.experts_from_files for ring in state.plan.rings for layer in ring.streamed)
    assert torch.equal(_logits(model), _logits(reference))
    (experts,) = [read for read in state.reads if hasattr(read, "cached")]
    assert any(experts.cached(i) for i in range(len(experts.layers)))
    hf_prefetch.reload_weights(model, second)
    assert not any(experts.cached(i) for i in range(len(experts.layers)))  # nothing of the old files kept
    assert all(path.parent == second for path in _read_paths(model))
    hf_prefetch.reset_stats(model)
    assert torch.equal(_logits(model), _logits(other))
    assert hf_prefetch.stats(model).host_cache_misses > 0
    # A checkpoint of the model's own tensors (experts fused, stored whole): read by expert from there, in the
    # buffers the cache has (the plan's room fits any layout of the same tensors).
    fused = tmp_path_factory.mktemp(f"{family}_fused")
    shutil.copy(first / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, fused / "model.safetensors")
    buffers = experts.reads._arena
    hf_prefetch.reload_weights(model, fused)
    assert experts.reads._arena is buffers and torch.equal(_logits(model), _logits(reference))
    hf_prefetch.remove_offload(model)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_a_model_dispatched_with_an_offload_folder_reads_a_reloaded_checkpoint_s_files(tmp_path_factory, tmp_path):
    (first, second), (reference, other), max_memory = _moe(tmp_path_factory, "qwen3_moe")
    model = copy.deepcopy(reference)
    offload = tmp_path / "offload"
    hf_prefetch.dispatch_model(
        model, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, offload_folder=offload
    )
    assert torch.equal(_logits(model), _logits(reference))
    hf_prefetch.reload_weights(model, second)  # its experts stored one by one: read by expert from there
    assert all(path.parent == second for path in _read_paths(model))
    assert torch.equal(_logits(model), _logits(other))
    hf_prefetch.remove_offload(model)
    for (name, got), want in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_reload_switches_the_files_read_between_decodes(llamas, tmp_path_factory):
    (first, second), (reference, other), max_memory = llamas
    (moe_first, moe_second), (moe_reference, moe_other), moe_memory = _moe(tmp_path_factory, "qwen3_moe")
    ids = prompt().cuda()
    for folders, references, budget in (
        ((first, second), (reference, other), max_memory),
        ((moe_first, moe_second), (moe_reference, moe_other), moe_memory),
    ):
        model = hf_prefetch.from_pretrained(folders[0], device="cuda", max_memory=budget, reserve_bytes=RESERVE)
        try:
            assert hf_prefetch.get_state(model).reads_files
            for folder, want in (
                (folders[1], references[1]),
                (folders[0], references[0]),
                (folders[1], references[1]),
            ):
                hf_prefetch.reload_weights(model, folder)
                resident = want.cuda()
                try:
                    assert_same_generation(generate_with_logits(model, ids), generate_with_logits(resident, ids))
                finally:
                    want.cpu()
            assert hf_prefetch.stats(model).misses == 0
        finally:
            hf_prefetch.remove_offload(model, device="cpu")
