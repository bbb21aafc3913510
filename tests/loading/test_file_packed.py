"""Packed formats read from the checkpoint's files (`Placement.READ`): a layer whose offloaded tensors are stored as
the model holds them is read as stored, whatever they hold. MXFP4 experts streamed whole (`routed_experts=False`) are
read as their blocks and scales, and dequantized in the experts' forward as when they are pinned."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.formats import mxfp4
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, _build, mxfp4_checkpoint

RESERVE = 2**20
WHOLE = PrefetchConfig(prefetch_step=1, routed_experts=False)  # expert tensors streamed whole: read in full


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    # A gpt-oss checkpoint with experts large enough that reading them from files pins less than pinning them (the
    # staging buffers align each tensor to the direct-I/O block), and a budget that pins half of what streams.
    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=8,
        intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8,
    )  # fmt: skip
    folder = mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"), model=_build(GptOssForCausalLM, config, 0))
    every = hf_prefetch.plan(folder, PrefetchConfig(group_size=1, prefetch_step=1, routed_experts=False), device="cpu")
    return folder, {0: every.device_bytes + RESERVE + 4096, "cpu": every.host_bytes // 2}


def _ids() -> torch.Tensor:
    # A batch of 2: the CPU's one-row matrix-vector kernels round differently at different addresses.
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def test_mxfp4_layers_are_read_from_their_files_packed_and_compute_what_the_pinned_load_does(packed):
    folder, max_memory = packed
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
