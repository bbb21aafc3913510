"""`weights_in_place` (hf_prefetch/lifecycle/in_place.py): the true weights of streamed layers read and written outside
the forward, and streamed parameters assigned anew outside it. Every layer streams through one slot, so a parameter
read outside its layer's forward shows another layer's weights; each case is compared bitwise with the same change on
the model that was never dispatched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

import hf_prefetch
from tests.models import prompt, tiny_llama

# Every layer streams, all through one slot: outside a forward it holds the last layer that ran.
ONE_SLOT = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1)
DOWN = "model.layers.{}.mlp.down_proj.weight"


@pytest.fixture
def models(llama_reference):
    """(reference, dispatched): two copies of the reference Llama, the second dispatched on the CPU through one slot,
    after a forward (the slot holds its last layer); removed after the test."""
    reference = copy.deepcopy(llama_reference.model)
    model = hf_prefetch.dispatch_model(copy.deepcopy(llama_reference.model), ONE_SLOT, device="cpu")
    forward(model, llama_reference.ids)
    yield reference, model
    if hf_prefetch.get_state(model) is not None:
        hf_prefetch.remove_offload(model)


def forward(model, ids):
    with torch.no_grad():
        return model(ids).logits


def assert_same_model(model, reference, ids) -> None:
    """Logits, then the state dict, bitwise."""
    assert torch.equal(forward(model, ids), forward(reference, ids))
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key].cpu(), want[key].cpu()), key  # host values beside a GPU model's


def assert_removed_same(model, reference, ids) -> None:
    hf_prefetch.remove_offload(model)
    assert_same_model(model, reference, ids)


def test_outside_the_block_a_streamed_parameter_shows_another_layer(models):
    reference, model = models
    assert torch.equal(model.get_parameter(DOWN.format(0)), reference.get_parameter(DOWN.format(0)))  # it holds 0
    assert not torch.equal(model.get_parameter(DOWN.format(3)), reference.get_parameter(DOWN.format(3)))


def test_inside_the_block_every_streamed_parameter_holds_its_own_value(models, llama_reference):
    reference, model = models
    with hf_prefetch.weights_in_place(model):
        for name, param in model.named_parameters():
            assert torch.equal(param, reference.get_parameter(name)), name
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)
    assert hf_prefetch.stats(model).misses == 0  # the layer that held the slot got it back


@pytest.mark.parametrize(
    "edit",
    [
        lambda layer: layer.mlp.down_proj.weight.data.mul_(2),  # through `.data`: no version counter moves
        lambda layer: layer.self_attn.q_proj.weight.neg_(),  # in place on the parameter, under no_grad
        lambda layer: setattr(layer.mlp.up_proj.weight, "data", layer.mlp.up_proj.weight.data * 3),
        lambda layer: setattr(layer.mlp.gate_proj, "weight", nn.Parameter(layer.mlp.gate_proj.weight + 1)),
    ],
    ids=["data-in-place", "param-in-place", "data-assigned", "new-parameter"],
)
def test_writes_inside_the_block_reach_forwards_state_dict_and_removal(models, llama_reference, edit):
    reference, model = models
    with torch.no_grad():
        for index in (0, 5):
            edit(reference.model.layers[index])
        with hf_prefetch.weights_in_place(model.model.layers[0], model.model.layers[5]):
            for index in (0, 5):
                edit(model.model.layers[index])
    assert_same_model(model, reference, llama_reference.ids)
    # The streamed parameters stay in the model (an assigned one gave its value).
    assert all(model.get_parameter(o.param_name) is o.param for o in hf_prefetch.get_state(model).offloaded)
    assert_removed_same(model, reference, llama_reference.ids)


@pytest.mark.parametrize("form", ["new-parameter", "data-assigned"])
def test_a_streamed_parameter_assigned_outside_a_block_is_what_state_dict_and_removal_see(
    models, llama_reference, form, tmp_path
):
    reference, model = models
    for target in (reference, model):
        linear = target.model.layers[3].mlp.down_proj
        value = torch.full_like(reference.model.layers[3].mlp.down_proj.weight, 0.25)
        if form == "new-parameter":
            linear.weight = nn.Parameter(value)
        else:
            linear.weight.data = value
    assert torch.equal(forward(model, llama_reference.ids), forward(reference, llama_reference.ids))
    assert_same_model(model, reference, llama_reference.ids)  # state_dict took the value into host storage
    model.save_pretrained(tmp_path)
    saved = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(forward(saved, llama_reference.ids), forward(reference, llama_reference.ids))
    assert_removed_same(model, reference, llama_reference.ids)


@pytest.mark.parametrize("form", ["new-parameter", "data-assigned"])
def test_an_assignment_outside_a_block_is_kept_by_remove_offload_without_a_state_dict(models, llama_reference, form):
    reference, model = models
    for target in (reference, model):
        if form == "new-parameter":
            target.model.layers[6].mlp.up_proj.weight = nn.Parameter(torch.ones(128, 64))
        else:
            target.model.layers[6].mlp.up_proj.weight.data = torch.ones(128, 64)
    assert_removed_same(model, reference, llama_reference.ids)


def test_an_assigned_value_of_another_shape_is_refused_with_the_fix(models, llama_reference):
    _, model = models
    model.model.layers[2].mlp.down_proj.weight = nn.Parameter(torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.down_proj\.weight was given a value of shape \[3, 3\]"):
        model.state_dict()
    with pytest.raises(ValueError, match="remove_offload"):
        hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is not None  # nothing was undone
    model.model.layers[2].mlp.down_proj.weight = nn.Parameter(llama_reference.state[DOWN.format(2)].clone())
    assert torch.equal(forward(model, llama_reference.ids), llama_reference.logits)


def test_an_assigned_value_of_another_dtype_inside_a_block_keeps_the_old_one(models, llama_reference):
    _, model = models
    with pytest.raises(ValueError, match=r"dtype torch\.float16"):
        with hf_prefetch.weights_in_place(model):
            model.model.layers[4].mlp.down_proj.weight.data = torch.zeros(64, 128, dtype=torch.float16)
            model.model.layers[1].mlp.down_proj.weight.data.zero_()  # written all the same
    assert torch.equal(model.state_dict()[DOWN.format(4)], llama_reference.state[DOWN.format(4)])
    assert not model.state_dict()[DOWN.format(1)].any()


def test_state_dict_and_forwards_inside_the_block_see_its_values(models, llama_reference):
    reference, model = models
    with torch.no_grad():
        reference.model.layers[7].mlp.down_proj.weight.mul_(-1)
        with hf_prefetch.weights_in_place(model):
            model.model.layers[7].mlp.down_proj.weight.mul_(-1)
            assert torch.equal(forward(model, llama_reference.ids), forward(reference, llama_reference.ids))
            assert torch.equal(model.state_dict()[DOWN.format(7)], reference.state_dict()[DOWN.format(7)])
            model.model.layers[7].mlp.down_proj.weight.mul_(-1)  # changed again after the state_dict
        reference.model.layers[7].mlp.down_proj.weight.mul_(-1)
    assert_same_model(model, reference, llama_reference.ids)


def test_load_state_dict_inside_the_block_loads_into_place(models, llama_reference):
    reference, model = models
    new = {DOWN.format(2): torch.full((64, 128), 0.5)}
    reference.load_state_dict(new, strict=False)
    with hf_prefetch.weights_in_place(model):
        model.load_state_dict(new, strict=False)
        assert torch.equal(model.get_parameter(DOWN.format(2)), new[DOWN.format(2)])
    assert_same_model(model, reference, llama_reference.ids)


def test_verbs_that_rewrite_host_storage_are_refused_inside_the_block(models, llama_reference):
    _, model = models
    with hf_prefetch.weights_in_place(model.model.layers[1]):
        with pytest.raises(RuntimeError, match="reload_weights inside hf_prefetch.weights_in_place"):
            hf_prefetch.reload_weights(model, llama_reference.state)
        with pytest.raises(RuntimeError, match="sync_from_device inside"):
            hf_prefetch.sync_from_device(model)


def test_remove_offload_inside_the_block_keeps_its_writes(models, llama_reference):
    reference, model = models
    with torch.no_grad():
        reference.model.layers[1].mlp.down_proj.weight.add_(1)
        with hf_prefetch.weights_in_place(model):
            model.model.layers[1].mlp.down_proj.weight.add_(1)
            hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None
    assert_same_model(model, reference, llama_reference.ids)


def test_blocks_nest(models, llama_reference):
    reference, model = models
    with torch.no_grad():
        reference.model.layers[0].mlp.down_proj.weight.mul_(2)
        with hf_prefetch.weights_in_place(model):
            with hf_prefetch.weights_in_place(model.model.layers[0]):
                model.model.layers[0].mlp.down_proj.weight.mul_(2)
            assert torch.equal(model.get_parameter(DOWN.format(0)), reference.get_parameter(DOWN.format(0)))
    assert_same_model(model, reference, llama_reference.ids)


def test_a_compressed_layer_writes_its_encoded_bytes():
    # Projections of 16384 elements and more: large enough to be compressed.
    reference = tiny_llama(4, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    config = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1, compress=True)
    model = hf_prefetch.dispatch_model(copy.deepcopy(reference), config, device="cpu")
    ids = prompt()
    try:
        assert any(o.layout is not None for o in hf_prefetch.get_state(model).offloaded)
        with torch.no_grad():
            reference.model.layers[2].mlp.down_proj.weight.neg_()  # the same exponents: it fits the layout
            with hf_prefetch.weights_in_place(model.model.layers[2]):
                assert torch.equal(model.get_parameter(DOWN.format(2)), -reference.get_parameter(DOWN.format(2)))
                model.model.layers[2].mlp.down_proj.weight.neg_()
        assert_same_model(model, reference, ids)
    finally:
        hf_prefetch.remove_offload(model)


def test_a_module_of_no_dispatched_model_is_left_as_it_is(llama_reference):
    model = copy.deepcopy(llama_reference.model)
    with hf_prefetch.weights_in_place(model):
        model.model.layers[0].mlp.down_proj.weight.data.mul_(2)
    assert torch.equal(model.get_parameter(DOWN.format(0)), 2 * llama_reference.state[DOWN.format(0)])
    with pytest.raises(TypeError, match="weights_in_place takes modules"):
        with hf_prefetch.weights_in_place("model"):
            pass


# --- On a GPU: copies on the device ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_the_block_holds_device_copies_and_writes_what_changed_back(llama_reference):
    reference = copy.deepcopy(llama_reference.model).cuda()
    model = hf_prefetch.dispatch_model(copy.deepcopy(llama_reference.model), ONE_SLOT, device="cuda")
    ids = llama_reference.ids.cuda()
    try:
        forward(model, ids)
        with torch.no_grad(), hf_prefetch.weights_in_place(model):
            for name, param in model.named_parameters():
                assert param.is_cuda and torch.equal(param, reference.get_parameter(name)), name
            reference.model.layers[3].mlp.down_proj.weight.mul_(2)
            model.model.layers[3].mlp.down_proj.weight.mul_(2)
            assert torch.equal(forward(model, ids), forward(reference, ids))
        assert_same_model(model, reference, ids)
        # The forward inside the block found the layer that held the slot forgotten (its weights were in place):
        # one load at its wait, and none after the block, which copied that layer back into the slot.
        assert [layer.misses for layer in hf_prefetch.stats(model).layers] == [1] + [0] * 7
    finally:
        hf_prefetch.remove_offload(model)
    assert_same_model(model, reference, ids)


@pytest.mark.gpu
def test_on_cuda_a_block_that_does_not_fit_is_refused_before_anything_changes(llama_reference, monkeypatch):
    want = forward(copy.deepcopy(llama_reference.model).cuda(), llama_reference.ids.cuda())
    model = hf_prefetch.dispatch_model(copy.deepcopy(llama_reference.model), ONE_SLOT, device="cuda")
    ids = llama_reference.ids.cuda()
    try:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        with pytest.raises(ValueError, match=r"weights_in_place needs .* on cuda:0 .* Nothing was changed"):
            with hf_prefetch.weights_in_place(model):
                pass
        monkeypatch.undo()
        assert torch.equal(forward(model, ids), want)  # the GPU model's own logits (not the CPU's)
    finally:
        hf_prefetch.remove_offload(model)


def test_a_half_done_dispatch_is_refused_and_a_removed_one_is_left_alone(models):
    from hf_prefetch.lifecycle.state import Lifecycle

    _, model = models
    state = hf_prefetch.get_state(model)
    state.lifecycle = Lifecycle.DETACHING  # as an interrupted removal leaves it
    try:
        with pytest.raises(RuntimeError, match=r"half-done .*remove_offload"):
            with hf_prefetch.weights_in_place(model):
                pass
    finally:
        state.lifecycle = Lifecycle.ATTACHED
    hf_prefetch.remove_offload(model)
    with hf_prefetch.weights_in_place(model):  # no dispatch now: the parameters are the model's own
        assert model.get_parameter(DOWN.format(1)).data_ptr() != 0
