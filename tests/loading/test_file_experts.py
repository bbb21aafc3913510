"""Routed experts read from the checkpoint's files as their routers pick them (`Placement.READ_ROUTED`):
`from_pretrained` of a mixture-of-experts checkpoint with a host budget that cannot pin every streamed layer
([Note: experts read from files] in hf_prefetch/runtime/file_experts.py)."""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_prefetch
from hf_prefetch.host import diskio, file_reads
from hf_prefetch.host.expert_rows import ExpertRows
from hf_prefetch.host.file_reads import FileExtent, StagedReads
from hf_prefetch.planning.placements import INNER_SEP
from hf_prefetch.planning.selection import make_plan
from hf_prefetch.runtime.file_experts import FileExpertLayer, FileExperts
from hf_prefetch.runtime.ring import LayerCounters
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, moe_model

RESERVE = 2**20


def _saved(tmp_path_factory, family: str):
    # A tiny model of `family` saved as transformers saves it (Qwen3 and Mixtral one tensor per expert, gpt-oss fused),
    # transformers' own load of it, and a budget that streams every layer's experts with half the host memory their
    # pinning takes: (folder, reference, max_memory).
    folder = tmp_path_factory.mktemp(family)
    moe_model(family).save_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = range(reference.config.num_hidden_layers)
    every = make_plan(reference, hf_prefetch.PrefetchConfig(offload_params=["experts"]), streamed=layers)
    return folder, reference, {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes // 2}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen3_moe")


def _load(folder, max_memory, **kwargs):
    return hf_prefetch.from_pretrained(folder, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, **kwargs)


def _ids(length: int = 7, seed: int = 1) -> torch.Tensor:
    # A batch of 2: the CPU's matrix-vector kernels (one row) round differently at different addresses, which would
    # make the same weights in other memory differ; two rows do not.
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def loaded_copy(checkpoint, tmp_path):
    """A copy of the checkpoint's folder in `tmp_path` loaded at its budget: (the copy's shard, the model, ids, the
    reference's logits for them)."""
    folder, reference, max_memory = checkpoint
    copied = shutil.copytree(folder, tmp_path / "copy")
    ids = _ids()
    return copied / "model.safetensors", _load(copied, max_memory), ids, _logits(reference, ids)


def _file_layers(model) -> list[str]:
    plan = hf_prefetch.get_state(model).plan
    return [layer.path for ring in plan.rings for layer in ring.streamed if layer.experts_from_files]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_experts_the_host_budget_cannot_pin_are_read_from_their_files_bitwise(tmp_path_factory, family):
    folder, reference, max_memory = _saved(tmp_path_factory, family)
    model = _load(folder, max_memory)
    state = hf_prefetch.get_state(model)
    read = _file_layers(model)
    assert read and state.plan.host_bytes <= max_memory["cpu"]
    assert "experts from files" in str(state.plan) and "read routed" in str(state.plan)
    (experts,) = state.reads
    ring = state.plan.rings[0]
    assert experts.capacity == ring.host_cached_experts and experts.reads.buffer_bytes <= ring.expert_buffer_bytes
    for ids in (_ids(), _ids(1, seed=2), _ids(12, seed=3)):  # whole and routing forwards, rounds past the cache
        assert torch.equal(_logits(model, ids), _logits(reference, ids))
    assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(reference, _ids()))
    stats = hf_prefetch.stats(model)
    assert stats.misses == 0 and stats.host_cache_misses > 0 and stats.read_bytes > 0
    by_path = {layer.path: layer for layer in stats.layers}
    assert all(by_path[path].host_cache_misses > 0 for path in read)
    pinned = [layer for layer in stats.layers if layer.path not in read]
    assert all(layer.host_cache_misses == layer.host_cache_hits == 0 for layer in pinned)
    hf_prefetch.remove_offload(model)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_misses_are_read_once_and_counted_and_hits_read_nothing(qwen3):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    (experts,) = hf_prefetch.get_state(model).reads
    ids = _ids(1, seed=4)
    for _ in range(3):  # the same picks again and again: what the cache keeps of them settles
        _logits(model, ids)
    hf_prefetch.reset_stats(model)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    layers = [t for t in hf_prefetch.get_state(model).engine.rings[0].layers if t.files is not None]
    for transfer in layers:
        c, spec = transfer.counters, experts.layers[transfer.files_layer]
        assert 0 < c.host_cache_hits + c.host_cache_misses <= 2 * reference.config.num_experts_per_tok  # distinct
        assert c.read_bytes == c.host_cache_misses * spec.unit_bytes
    assert sum(t.counters.host_cache_hits for t in layers) > 0


def _cache(tmp_path, num_experts: int, capacity: int, layers: int = 2):
    # A FileExperts over a file holding `layers` layers of `num_experts` experts (one routed tensor of rows of 8
    # bytes each, expert e of layer l filled with l * 100 + e), and each layer's transfer with a slot on the CPU.
    path = tmp_path / "experts.bin"
    rows = [[layer * 100 + e] * 8 for layer in range(layers) for e in range(num_experts)]
    values = torch.tensor(rows, dtype=torch.uint8)
    path.write_bytes(values.numpy().tobytes())
    units, specs, transfers = [], [], []
    for layer in range(layers):
        rows = ExpertRows.whole(FileExtent(path, layer * num_experts * 8, num_experts * 8), num_experts)
        units += [[extent for extent, _ in row] for row in rows.rows]
        specs.append(FileExpertLayer(layer * num_experts, num_experts, (8,), ((((0, 0),),) * num_experts)))
        slot = SimpleNamespace(device=torch.zeros(num_experts, 8, dtype=torch.uint8))
        transfers.append(SimpleNamespace(routed=[slot], counters=LayerCounters(), files_layer=layer))
    experts = FileExperts(StagedReads(units, capacity, pin=False), specs)
    return experts, transfers


def test_each_layer_keeps_its_share_of_the_cache_and_more_picks_than_it_holds_go_in_rounds(tmp_path):
    experts, transfers = _cache(tmp_path, num_experts=8, capacity=4)
    try:
        for picks in ([0, 1], [5, 6]):  # layer 0, then layer 1: a cycle of more picks than the cache holds
            for layer, transfer in enumerate(transfers):
                experts.gather(transfer, torch.tensor(picks), cuda=False)
                for e in picks:
                    assert transfer.routed[0].device[e].tolist() == [layer * 100 + e] * 8
        assert experts.cached(0) == [5, 6] and experts.cached(1) == [5, 6]  # each its share, its most recent
        experts.gather(transfers[0], torch.tensor([[5, 6]]), cuda=False)  # found: nothing read
        assert (transfers[0].counters.host_cache_hits, transfers[0].counters.host_cache_misses) == (2, 4)
        everything = torch.arange(8).flip(0)
        experts.gather(transfers[1], everything, cuda=False)  # 8 picks through 4 buffers: two rounds
        assert transfers[1].routed[0].device[:, 0].tolist() == [100 + e for e in range(8)]
        assert experts.cached(1) == [4, 5, 6, 7] and experts.cached(0) == []  # its own others first, then layer 0's
        assert experts.reads.bytes_read == (2 + 2 + 2 + 2 + 8) * 8
        # Picks out of range (a padding index) are not experts: skipped, not read.
        experts.gather(transfers[0], torch.tensor([-1, 8, 5]), cuda=False)
    finally:
        experts.close()


def test_a_read_error_leaves_no_expert_cached_that_did_not_read_whole(tmp_path, monkeypatch):
    experts, transfers = _cache(tmp_path, num_experts=4, capacity=2, layers=1)
    original, failed = diskio.pread, []

    def failing(fd, out, position):
        if not failed:
            failed.append(position)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return original(fd, out, position)

    monkeypatch.setattr(diskio, "pread", failing)
    try:
        with pytest.raises(OSError, match=r"experts\.bin at byte offset \d+ failed: Input/output"):
            experts.gather(transfers[0], torch.tensor([1]), cuda=False)
        assert experts.cached(0) == []
        experts.gather(transfers[0], torch.tensor([1, 2]), cuda=False)
        assert transfers[0].routed[0].device[1:3, 0].tolist() == [1, 2] and experts.cached(0) == [1, 2]
    finally:
        experts.close()


def test_a_file_changed_under_the_model_fails_the_forward_naming_it_and_the_model_recovers(qwen3, tmp_path):
    shard, model, ids, want = loaded_copy(qwen3, tmp_path)
    assert torch.equal(_logits(model, ids), want)
    stat = os.stat(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a rewrite of the file would
    with pytest.raises(RuntimeError, match=r"model\.safetensors changed on disk"):
        for seed in range(8):  # a forward that finds every pick cached reads nothing
            _logits(model, _ids(seed=seed + 10))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert torch.equal(_logits(model, ids), want) and torch.equal(_logits(model, ids), want)


def test_a_ctrl_c_while_experts_are_read_leaves_the_model_usable(qwen3, monkeypatch):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    ids = _ids()
    want = _logits(reference, ids)
    original, interrupted = file_reads.StagedReads.views, []

    def interrupting(self, layer):
        if not interrupted:
            interrupted.append(layer)
            raise KeyboardInterrupt
        return original(self, layer)

    monkeypatch.setattr(file_reads.StagedReads, "views", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _logits(model, ids)
    assert interrupted and torch.equal(_logits(model, ids), want)
    hf_prefetch.remove_offload(model)
    assert torch.equal(_logits(model, ids), want)


def test_writing_weights_and_state_dict_are_refused_and_change_nothing(qwen3):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    ids = _ids()
    want = _logits(reference, ids)
    refused = r"\(or their routed experts\) are read from the checkpoint's files at each use .* are refused\."
    with pytest.raises(RuntimeError, match=refused):
        model.state_dict()
    with pytest.raises(RuntimeError, match=refused):
        model.load_state_dict({name: torch.zeros_like(t) for name, t in reference.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused first: no advice on the expert tensors it could never write
        with pytest.raises(RuntimeError, match=refused):
            hf_prefetch.sync_from_device(model)
    assert torch.equal(_logits(model, ids), want)
    hf_prefetch.reload_weights(model, folder)  # reads the checkpoint's files again (tests/loading/test_file_reload.py)
    assert torch.equal(_logits(model, ids), want)


def test_a_model_removed_to_another_device_or_kept_for_a_redispatch_has_its_experts_values(qwen3):
    folder, reference, max_memory = qwen3
    model = _load(folder, max_memory)
    hf_prefetch.remove_offload(model, device="cpu")
    experts = model.model.layers[-1].mlp.experts
    assert not experts.gate_up_proj.is_meta
    assert torch.equal(experts.gate_up_proj, reference.model.layers[-1].mlp.experts.gate_up_proj)
    experts.gate_up_proj.data.add_(1)  # private memory, not the files'
    assert not torch.equal(experts.gate_up_proj, reference.model.layers[-1].mlp.experts.gate_up_proj)


def test_a_removal_after_a_file_changed_is_refused_and_leaves_the_model_dispatched(qwen3, tmp_path):
    shard, model, ids, want = loaded_copy(qwen3, tmp_path)
    stat = os.stat(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match=r"model\.safetensors changed on disk"):
        hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is not None
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert torch.equal(_logits(model, ids), want)
    hf_prefetch.remove_offload(model)
    assert torch.equal(_logits(model, ids), want)


def test_dispatch_model_writes_the_experts_it_cannot_pin_to_its_offload_folder(qwen3, tmp_path):
    folder, reference, max_memory = qwen3
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = _ids()
    want = _logits(reference, ids)
    offload = tmp_path / "offload"
    hf_prefetch.dispatch_model(
        model, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE, offload_folder=offload
    )
    state = hf_prefetch.get_state(model)
    read = _file_layers(model)
    assert read and state.plan.host_bytes <= max_memory["cpu"]
    assert sorted(p.name for p in offload.iterdir()) == sorted(f"{path}.safetensors" for path in read)
    for extent in (state.file_extents[f"{read[0]}.mlp.experts.gate_up_proj"].rows[0][0][0],):
        assert extent.path == offload / f"{read[0]}.safetensors"  # the experts' rows in the written file
    for _ in range(2):
        assert torch.equal(_logits(model, ids), want)
    assert hf_prefetch.stats(model).host_cache_misses > 0
    hf_prefetch.remove_offload(model)
    for (name, got), value in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, value), name
    assert torch.equal(_logits(model, ids), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_experts_read_from_files_decode_bitwise_and_cuda_graphs_are_refused(qwen3):
    from transformers import CompileConfig

    folder, reference, max_memory = qwen3
    model = hf_prefetch.from_pretrained(folder, device="cuda", max_memory=max_memory, reserve_bytes=RESERVE)
    try:
        resident = reference.cuda()
        ids = _ids().cuda()
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, ids), generate_with_logits(resident, ids))
        stats = hf_prefetch.stats(model)
        assert stats.misses == 0 and stats.host_cache_misses > 0
        graphs = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
        with pytest.raises(RuntimeError, match=r"a CUDA graph\s+cannot record it"):
            for _ in range(3):
                generate_with_logits(model, ids, **graphs)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
        reference.cpu()
        torch._dynamo.reset()


def test_routed_tensors_of_any_dtype_are_read_by_picks_but_parts_and_unstored_rows_are_not():
    # The experts' forward reads only the picked rows of a routed tensor, whatever it holds (MXFP4 blocks are uint8):
    # what keeps a layer's experts pinned is a tensor stored in parts, or rows the files do not store as the model
    # holds them.
    from hf_prefetch.planning.file_tier import Stored, experts_eligible
    from hf_prefetch.planning.placements import LayerPlan, ParamSpec, Placement, Routing

    routing = Routing("mlp.experts", 4, 2, "top_k_index")

    def eligible(dtype: torch.dtype, name: str = "mlp.experts.w", pieces: int = 1) -> bool:
        spec = ParamSpec(name, (4, 8, 8), (64, 8, 1), dtype, 256 * dtype.itemsize, Placement.ROUTED, routing)
        return experts_eligible(
            LayerPlan("model.layers.0", 0, (spec,), 0, 0, 1), Stored(lambda n: True, lambda n: pieces)
        )

    assert eligible(torch.bfloat16) and eligible(torch.uint8) and eligible(torch.float8_e4m3fn)
    assert not eligible(torch.bfloat16, pieces=0)
    assert not eligible(torch.int8, name=f"mlp.experts.w{INNER_SEP}qdata")
