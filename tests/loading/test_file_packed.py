"""Packed formats read from the checkpoint's files (`Placement.READ`): a layer whose offloaded tensors are stored as
the model holds them is read as stored, whatever they hold. MXFP4 experts streamed whole (`routed_experts=False`) are
read as their blocks and scales, and dequantized in the experts' forward as when they are pinned; routed
(`Placement.READ_ROUTED`), each forward reads the picked experts' blocks and scales, and the experts' forward
dequantizes only those."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.formats import mxfp4
from hf_prefetch.planning.placements import Placement
from tests.models import CUDA, assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, _build, mxfp4_checkpoint

RESERVE = 2**20
ROUTED = PrefetchConfig(offload_params=["experts"])  # routed experts, the rest of each layer resident
WHOLE = PrefetchConfig(prefetch_step=1, routed_experts=False)  # expert tensors streamed whole: read in full


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    # A gpt-oss checkpoint with experts large enough that reading them from files pins less than pinning them (the
    # staging buffers align each tensor to the direct-I/O block), and budgets that pin half of what streams: with the
    # experts streamed whole, and routed.
    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=8,
        intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8,
    )  # fmt: skip
    folder = mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"), model=_build(GptOssForCausalLM, config, 0))
    every = hf_prefetch.plan(folder, PrefetchConfig(group_size=1, prefetch_step=1, routed_experts=False), device="cpu")
    return folder, _half_host(every), _half_host(hf_prefetch.plan(folder, ROUTED, device="cpu"))


def _half_host(plan) -> dict:
    # A budget with the device memory `plan` needs and half the host memory it pins.
    return {0: plan.device_bytes + RESERVE + 4096, "cpu": plan.host_bytes // 2}


def _ids() -> torch.Tensor:
    # A batch of 2: the CPU's one-row matrix-vector kernels round differently at different addresses.
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def test_mxfp4_layers_are_read_from_their_files_packed_and_compute_what_the_pinned_load_does(packed):
    folder, max_memory, _ = packed
    pinned = hf_prefetch.from_pretrained(folder, WHOLE, device="cpu")
    model = hf_prefetch.from_pretrained(folder, WHOLE, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE)
    try:
        plan = hf_prefetch.get_state(model).plan
        read = [layer for ring in plan.rings for layer in ring.streamed if layer.read_from_files]
        assert read and plan.host_bytes <= max_memory["cpu"]
        packed_specs = [s for layer in read for s in layer.offloaded if s.name.endswith(("_blocks", "_scales"))]
        assert packed_specs and all(spec.dtype == torch.uint8 for spec in packed_specs)  # read as stored: packed
        experts = model.get_submodule(f"{read[0].path}.mlp.experts")
        assert mxfp4.dequantizes(experts)
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(pinned, _ids()))
        stats = hf_prefetch.stats(model)
        assert stats.misses == 0
        per_forward = sum(spec.nbytes for layer in read for spec in layer.offloaded)  # as stored: packed
        assert stats.read_bytes > 0 and stats.read_bytes % per_forward == 0  # whole forwards of packed bytes
    finally:
        hf_prefetch.remove_offload(model)
        hf_prefetch.remove_offload(pinned)
    assert torch.equal(model(_ids()).logits, pinned(_ids()).logits)  # removed: the values read back from the files


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_routed_mxfp4_experts_are_read_from_their_files_by_picks_and_compute_what_the_pinned_load_does(packed, device):
    folder, _, max_memory = packed
    pinned = hf_prefetch.from_pretrained(folder, ROUTED, device=device)
    model = hf_prefetch.from_pretrained(folder, ROUTED, device=device, max_memory=max_memory, reserve_bytes=RESERVE)
    try:
        plan = hf_prefetch.get_state(model).plan
        read = [layer for ring in plan.rings for layer in ring.streamed if layer.experts_from_files]
        assert read and plan.host_bytes <= max_memory["cpu"]
        specs = [s for layer in read for s in layer.routed]
        packed_names = {f"{p}_{k}" for p in mxfp4.PROJECTIONS for k in ("blocks", "scales")}
        packed_specs = [s for s in specs if s.name.rpartition(".")[2] in packed_names]
        assert len(packed_specs) == len(packed_names) * len(read)  # with the bf16 biases, by picks
        assert all(s.dtype == torch.uint8 for s in packed_specs)  # read as stored: packed
        assert all(s.placement is Placement.READ_ROUTED for s in specs)
        ids = _ids().to(device)
        for prompt in (ids, ids[:, :1], torch.cat([ids, ids], dim=1)):  # routing forwards, and whole ones
            assert torch.equal(model(prompt).logits, pinned(prompt).logits)
        assert_same_generation(generate_with_logits(model, ids), generate_with_logits(pinned, ids))
        stats = hf_prefetch.stats(model)
        assert stats.misses == 0 and stats.host_cache_misses > 0
        # Only picked experts are read: a miss reads one expert's packed rows of each of the layer's routed tensors.
        expert_bytes = sum(s.nbytes for s in read[0].routed) // read[0].routed[0].routing.num_experts
        assert stats.read_bytes == stats.host_cache_misses * expert_bytes
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
        hf_prefetch.remove_offload(pinned, device="cpu")
    assert torch.equal(model(_ids()).logits, pinned(_ids()).logits)  # removed: the experts read back whole
