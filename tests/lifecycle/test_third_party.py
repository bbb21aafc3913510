"""PEFT's merges of a dispatched model (hf_prefetch/lifecycle/third_party.py routes them through `weights_in_place`),
with PEFT itself (a test extra: skipped without it): every layer streams through one slot, so a merge that read the
slot would add a layer's delta to another layer's weights. Each result is compared bitwise with the same calls on the
model that was never dispatched: logits, state dict, and the model after `remove_offload`."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_prefetch
from tests.models import prompt, tiny_llama

peft = pytest.importorskip("peft")

ONE_SLOT = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1)


def lora(model, name: str = "default", seed: int = 7):
    """A LoRA adapter on q_proj and v_proj with random A and B (the same for the same seed), as a PeftModel or added
    to one."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, init_lora_weights=False)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, config)
        return model
    return peft.get_peft_model(model, config, adapter_name=name)


def logits(model):
    with torch.no_grad():
        return model(prompt()).logits


def assert_same(got, want) -> None:
    assert torch.equal(logits(got), logits(want))
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key


@pytest.fixture
def base():
    return tiny_llama(4)


def dispatched(model):
    hf_prefetch.dispatch_model(model, ONE_SLOT, device="cpu")
    logits(model)  # the slot holds the last layer that ran
    return model


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unload_of_an_adapter_added_after_the_dispatch(base, safe_merge):
    want = lora(copy.deepcopy(base)).merge_and_unload(safe_merge=safe_merge)
    model = dispatched(copy.deepcopy(base))
    merged = lora(model).merge_and_unload(safe_merge=safe_merge)
    assert merged is model
    assert_same(model, want)
    hf_prefetch.remove_offload(model)
    assert_same(model, want)


def test_merge_adapter_and_unmerge_adapter_of_a_dispatched_model(base):
    want = lora(copy.deepcopy(base))
    model = dispatched(copy.deepcopy(base))
    got = lora(model)
    for step in ("merge_adapter", "unmerge_adapter", "merge_adapter"):
        getattr(want, step)()
        getattr(got, step)()
        assert torch.equal(logits(got), logits(want)), step
    assert_same(got, want)
    hf_prefetch.remove_offload(model)
    assert_same(got, want)


def test_an_adapter_added_before_the_dispatch_streams_with_its_layer_and_merges(base):
    want = lora(copy.deepcopy(base)).merge_and_unload()
    peft_model = lora(copy.deepcopy(base))
    model = dispatched(peft_model.base_model.model)
    names = {o.full_name for o in hf_prefetch.get_state(model).offloaded}
    assert "model.layers.1.self_attn.q_proj.lora_A.default.weight" in names  # streamed with its layer
    assert peft_model.merge_and_unload() is model
    assert_same(model, want)
    hf_prefetch.remove_offload(model)
    assert_same(model, want)


def test_add_weighted_adapter_over_streamed_adapters_in_weights_in_place(base):
    def combined(model):
        model.add_weighted_adapter(["default", "other"], [0.7, -0.4], "combined", combination_type="linear")
        model.set_adapter("combined")
        return model

    want = combined(lora(lora(copy.deepcopy(base)), "other", seed=8))
    peft_model = lora(lora(copy.deepcopy(base)), "other", seed=8)
    model = dispatched(peft_model.base_model.model)
    with hf_prefetch.weights_in_place(peft_model):
        combined(peft_model)
    assert_same(peft_model, want)
    hf_prefetch.remove_offload(model)
    assert_same(peft_model, want)


def test_the_routed_methods_leave_with_the_dispatch(base):
    model = dispatched(copy.deepcopy(base))
    peft_model = lora(model)
    q_proj = model.model.layers[2].self_attn.q_proj
    assert {"merge", "unmerge"} <= q_proj.__dict__.keys()  # set when PEFT put the tuner layer in
    hf_prefetch.remove_offload(model)
    assert not {"merge", "unmerge"} & q_proj.__dict__.keys()
    want = lora(copy.deepcopy(base))
    want.merge_adapter()
    peft_model.merge_adapter()  # PEFT's own, on the model as it is now
    assert_same(peft_model, want)


@pytest.mark.gpu
def test_merge_and_unload_on_cuda_copies_one_layer_at_a_time(base):
    base = base.cuda()
    want = lora(copy.deepcopy(base)).merge_and_unload()
    model = copy.deepcopy(base)
    hf_prefetch.dispatch_model(model, ONE_SLOT, device="cuda")
    ids = prompt().cuda()
    with torch.no_grad():
        model(ids)
    merged = lora(model).merge_and_unload()
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, want(ids).logits)
    hf_prefetch.remove_offload(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
