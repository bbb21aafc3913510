"""Layers read from the checkpoint's files at each use (`Placement.READ`): `from_pretrained` with a host budget that
cannot pin every streamed layer ([Note: weights read from files] in hf_prefetch/runtime/read_ahead.py)."""

from __future__ import annotations

import copy
import errno
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_prefetch
from hf_prefetch.host import diskio, file_reads
from hf_prefetch.planning.file_tier import staging_bytes
from hf_prefetch.planning.selection import make_plan
from tests.models import ATTENTION, CUDA, assert_same_generation, generate_with_logits, logits, prompt

RESERVE = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An 8-layer Llama saved in shards, transformers' own load of it, and a budget that streams every layer with
    three quarters of the host memory their pinning takes: (folder, reference, max_memory)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(intermediate_size=128, num_hidden_layers=8, **ATTENTION))
    folder = tmp_path_factory.mktemp("llama8")
    model.save_pretrained(folder, max_shard_size="200KB")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    every = make_plan(reference, hf_prefetch.PrefetchConfig(), streamed=range(8))
    return folder, reference, {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes * 3 // 4}


def _load(folder, max_memory, **kwargs):
    return hf_prefetch.from_pretrained(folder, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, **kwargs)


def _read_layers(model) -> list[str]:
    plan = hf_prefetch.get_state(model).plan
    return [layer.path for ring in plan.rings for layer in ring.streamed if layer.read_from_files]


def test_layers_the_host_budget_cannot_pin_are_read_from_their_files_bitwise(checkpoint):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    state = hf_prefetch.get_state(model)
    read = _read_layers(model)
    assert 0 < len(read) < 8 and read == [f"model.layers.{i}" for i in range(8 - len(read), 8)]  # the last ones
    # Pinned: the arena of the other streamed layers and 3 staging buffers (2 slots and a spare), within the budget;
    # the buffers the reads use are no larger than the plan counted.
    assert state.plan.host_bytes <= max_memory["cpu"]
    (ahead,) = state.reads
    assert 3 * ahead.reads.buffer_bytes <= staging_bytes(state.plan.rings)
    assert state.file_arena is not None and not state.file_arena.pinned
    assert "read from files" in str(state.plan) and f"{len(read)} layers" in str(state.plan)
    assert torch.equal(logits(model), logits(reference))
    assert_same_generation(generate_with_logits(model, prompt()), generate_with_logits(reference, prompt()))
    layers = hf_prefetch.get_state(model).engine.rings[0].layers
    read_bytes = [layer.counters.read_bytes for layer in layers if layer.reads is not None]
    assert len(read_bytes) == len(read) and all(n > 0 for n in read_bytes)
    assert all(layer.counters.read_bytes == 0 for layer in layers if layer.reads is None)
    assert hf_prefetch.stats(model).misses == 0
    hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    got = model.model.layers[7].mlp.up_proj.weight
    got.data.add_(1)  # removed to the CPU, the weights are private memory, no longer the files' pages
    assert not torch.equal(got, reference.model.layers[7].mlp.up_proj.weight)


def test_writing_weights_and_state_dict_are_refused_and_change_nothing(checkpoint):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    want = logits(reference)
    refused = r"read from the checkpoint's files at each use .* are refused\. Nothing was changed"
    with pytest.raises(RuntimeError, match=refused):
        model.state_dict()
    values = {name: torch.zeros_like(t) for name, t in reference.state_dict().items()}
    with pytest.raises(RuntimeError, match=refused):
        model.load_state_dict(values)
    with pytest.raises(RuntimeError, match=refused):
        hf_prefetch.sync_from_device(model)
    assert torch.equal(logits(model), want)
    hf_prefetch.reload_weights(model, folder)  # reads the checkpoint's files again (tests/loading/test_file_reload.py)
    assert torch.equal(logits(model), want)
    hf_prefetch.remove_offload(model)
    assert torch.equal(logits(model), want)


def test_a_file_changed_under_the_model_fails_the_forward_naming_it_and_the_model_recovers(checkpoint, tmp_path):
    folder, reference, max_memory = checkpoint
    copied = shutil.copytree(folder, tmp_path / "copy")
    model = _load(copied, max_memory)
    want = logits(reference)
    assert torch.equal(logits(model), want)
    shard = hf_prefetch.get_state(model).file_extents[f"{_read_layers(model)[0]}.mlp.up_proj.weight"].path
    stat = os.stat(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a rewrite of the shard would
    with pytest.raises(RuntimeError, match=shard.name):
        for _ in range(3):  # reads started before the change were of the file as loaded
            logits(model)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert torch.equal(logits(model), want) and torch.equal(logits(model), want)


def test_a_read_error_mid_forward_names_the_file_and_offset_and_the_next_forward_reads_again(checkpoint, monkeypatch):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    want = logits(reference)
    original, failed = diskio.pread, []

    def failing(fd, out, position):  # the disk's error on the first read
        if not failed:
            failed.append(position)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return original(fd, out, position)

    monkeypatch.setattr(diskio, "pread", failing)
    with pytest.raises(OSError, match=r"of \S+model-\d+-of-\d+\.safetensors at byte offset \d+ failed: Input/output"):
        for _ in range(3):
            logits(model)
    assert failed
    assert torch.equal(logits(model), want) and torch.equal(logits(model), want)


def test_a_ctrl_c_while_a_read_is_waited_for_leaves_the_model_usable(checkpoint, monkeypatch):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    want = logits(reference)
    original, interrupted = file_reads.StagedReads.views, []

    def interrupting(self, layer):
        if not interrupted:
            interrupted.append(layer)
            raise KeyboardInterrupt
        return original(self, layer)

    monkeypatch.setattr(file_reads.StagedReads, "views", interrupting)
    with pytest.raises(KeyboardInterrupt):
        logits(model)
    assert interrupted and torch.equal(logits(model), want)
    assert hf_prefetch.stats(model).misses >= 0  # the model still answers
    hf_prefetch.remove_offload(model)
    assert torch.equal(logits(model), want)


def test_budgets_that_files_cannot_help_are_refused_with_the_reason(checkpoint):
    folder, reference, max_memory = checkpoint
    with pytest.raises(ValueError, match=r"still pins more: staging buffers for layers of up to"):
        _load(folder, {0: max_memory[0], "cpu": 4096})
    # Cast at load (a float32 checkpoint loaded in bfloat16): no tensor is stored as the model holds it.
    half = make_plan(copy.deepcopy(reference).to(torch.bfloat16), hf_prefetch.PrefetchConfig(), streamed=range(8))
    cast = {0: half.device_bytes + RESERVE + 4096, "cpu": half.host_bytes // 2}
    with pytest.raises(ValueError, match=r"None of its streamed layers can be read from the checkpoint's files"):
        _load(folder, cast, dtype=torch.bfloat16)
    # A model in memory has no files to read from, unless given a folder to write them to.
    with pytest.raises(ValueError, match=r"or pass dispatch_model an offload_folder to write them to"):
        hf_prefetch.dispatch_model(
            AutoModelForCausalLM.from_pretrained(folder), device="cpu", max_memory=max_memory, reserve_bytes=RESERVE
        )
    assert hf_prefetch.plan(folder, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE).file_bytes > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_layers_read_from_files_decode_bitwise_and_cuda_graphs_are_refused(checkpoint):
    from transformers import CompileConfig

    folder, reference, max_memory = checkpoint
    model = hf_prefetch.from_pretrained(folder, device="cuda", max_memory=max_memory, reserve_bytes=RESERVE)
    try:
        resident = reference.cuda()
        ids = prompt().cuda()
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, ids), generate_with_logits(resident, ids))
        assert hf_prefetch.stats(model).misses == 0
        graphs = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
        with pytest.raises(RuntimeError, match=r"a CUDA graph cannot record those reads"):
            for _ in range(3):
                generate_with_logits(model, ids, **graphs)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
        reference.cpu()
        torch._dynamo.reset()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_with_compress_the_layers_that_do_not_fit_are_read_plain_and_the_others_kept_compressed(tmp_path, device):
    torch.manual_seed(0)
    config = LlamaConfig(intermediate_size=256, num_hidden_layers=8, **{**ATTENTION, "hidden_size": 128})
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="300KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    compress = hf_prefetch.PrefetchConfig(compress=True)
    every = make_plan(reference, compress, streamed=range(8))
    budget = {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes * 3 // 4}
    model = hf_prefetch.from_pretrained(
        tmp_path, device=device, max_memory=budget, reserve_bytes=RESERVE, offload=compress
    )
    state = hf_prefetch.get_state(model)
    read = set(_read_layers(model))
    compressed = {o.full_name.rsplit(".", 3)[0] for o in state.offloaded if o.layout is not None}
    assert read and compressed and not read & compressed  # the pinned layers compressed, those read plain
    assert "read from the checkpoint's files as stored" in str(state.plan) and state.plan.host_bytes <= budget["cpu"]
    resident = reference.to(device)
    ids = prompt().to(device)
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids), generate_with_logits(resident, ids))
    assert hf_prefetch.stats(model).misses == 0
    hf_prefetch.remove_offload(model, device="cpu")
    for (name, got), want in zip(model.state_dict().items(), reference.cpu().state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_the_statistics_show_what_the_copies_read_from_files(checkpoint):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    logits(model)
    stats = hf_prefetch.stats(model)
    assert stats.read_bytes == sum(layer.read_bytes for layer in stats.layers) > 0
    assert "read MiB" in str(stats) and "read wait ms" in str(stats)
    hf_prefetch.reset_stats(model)
    assert hf_prefetch.stats(model).read_bytes == 0 and "read MiB" not in str(hf_prefetch.stats(model))


def test_dispatch_model_writes_the_layers_it_cannot_pin_to_its_offload_folder(checkpoint, tmp_path):
    folder, reference, max_memory = checkpoint
    model = copy.deepcopy(reference)
    want = logits(reference)
    offloads = tmp_path / "offload"
    hf_prefetch.dispatch_model(
        model, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, offload_folder=offloads
    )
    read = _read_layers(model)
    assert read and sorted(p.name for p in offloads.iterdir()) == sorted(f"{path}.safetensors" for path in read)
    assert torch.equal(logits(model), want)
    assert_same_generation(generate_with_logits(model, prompt()), generate_with_logits(reference, prompt()))
    assert hf_prefetch.stats(model).read_bytes > 0
    with pytest.raises(RuntimeError, match=r"read from the checkpoint's files at each use"):
        model.state_dict()
    hf_prefetch.remove_offload(model)
    assert torch.equal(logits(model), want)
    for (name, got), value in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, value), name
    # Without a "cpu" entry there is nothing to put there; with one that pins everything, it writes nothing.
    with pytest.raises(ValueError, match=r"offload_folder=.* no max_memory\['cpu'\] was given"):
        hf_prefetch.dispatch_model(model, device="cpu", max_memory={0: max_memory[0]}, offload_folder=offloads)
    roomy = {0: max_memory[0], "cpu": 2**30}
    with pytest.warns(UserWarning, match=r"offload_folder=.* holds nothing in this plan"):
        hf_prefetch.dispatch_model(
            model, device="cpu", max_memory=roomy, reserve_bytes=RESERVE, offload_folder=offloads
        )
    assert not _read_layers(model) and torch.equal(logits(model), want)
    hf_prefetch.remove_offload(model)


def test_a_load_naming_a_pinned_streamed_layer_is_refused_before_the_resident_tensors_it_names_are_written(checkpoint):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    want = logits(reference)
    pinned = next(f"model.layers.{i}" for i in range(8) if f"model.layers.{i}" not in _read_layers(model))
    values = {"model.embed_tokens.weight": torch.zeros_like(reference.model.embed_tokens.weight)}
    values[f"{pinned}.mlp.up_proj.weight"] = torch.zeros_like(reference.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(RuntimeError, match=r"are refused\. Nothing was changed"):
        model.load_state_dict(values, strict=False)
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert torch.equal(logits(model), want)
    model.load_state_dict({"model.norm.weight": reference.model.norm.weight.clone()}, strict=False)  # resident: loads
    assert torch.equal(logits(model), want)


def test_a_read_that_cannot_be_queued_fails_the_forward_and_the_next_one_reads_again(checkpoint, monkeypatch):
    folder, reference, max_memory = checkpoint
    model = _load(folder, max_memory)
    want = logits(reference)
    original, failed = ThreadPoolExecutor.submit, []

    def failing(self, *args, **kwargs):  # the second window of a read: no thread can start
        if len(failed) < 2:
            failed.append(True)
            if len(failed) == 2:
                raise RuntimeError("can't start new thread")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", failing)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        logits(model)
    assert torch.equal(logits(model), want) and torch.equal(logits(model), want)


def test_reads_closed_on_their_own_reader_thread_end_there_once_that_read_ends(tmp_path):
    # As the collector runs a deleted model's finalizer wherever it runs next: inside a read ahead, say.
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    reads = file_reads.StagedReads([[file_reads.FileExtent(path, 100, 8000)]], num_buffers=1, pin=False)
    errors, threads = [], []

    def close():
        threads.append(threading.current_thread())
        try:
            reads.close()
        except BaseException as error:
            errors.append(error)

    reads.start(0, buffer=0, before=close)
    deadline = time.monotonic() + 10
    while not threads or threads[0].is_alive() or reads._fds:  # the files closed once the reader's threads ended
        assert time.monotonic() < deadline, (threads, errors)
        time.sleep(0.01)
    assert threads and not errors and not threads[0].is_alive() and not reads._fds
