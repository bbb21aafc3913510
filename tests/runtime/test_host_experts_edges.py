"""Routed experts computed on the host's cores (PrefetchConfig(cpu_experts=...)), beside test_host_experts.py: new
values given to an experts module's parameters, a split whose device part was interrupted, "auto" with an expert cache
or recent experts on a CPU device, what the plan and the warnings say, the counts of a split, and the words of a
refusal."""

import copy
import warnings
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, moe_model, routed_hooks
from tests.routing import control_routing

# Layers 1 and 3 stream, taking turns in one slot; a forward of up to 4 tokens routes.
ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)


def _ids(batch: int = 1, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _dispatch(model, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_prefetch.dispatch_model(model, PrefetchConfig(**{**ROUTED, **fields}), device="cpu")


def _split(model, share: float = 0.5) -> None:
    for hook in routed_hooks(model):
        hook.host.compute = replace(hook.host.compute, share=share)


@pytest.mark.parametrize("mode", [True, "auto"])
@pytest.mark.parametrize("how", ["parameter", "data"])
def test_an_experts_parameter_given_a_new_value_while_dispatched_computes_with_it(mode, how):
    # [Note: weights in place]: a streamed parameter assigned anew outside a block computes with its new value in the
    # forwards before host storage takes it, as with cpu_experts=False: its module then runs on the device (the host's
    # twin reads host storage, which holds the old value).
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    _dispatch(model, cpu_experts=mode)
    try:
        generate_with_logits(model, _ids())
        value = torch.randn(
            reference.model.layers[3].mlp.experts.down_proj.shape, generator=torch.Generator().manual_seed(9)
        )
        with torch.no_grad():
            reference.model.layers[3].mlp.experts.down_proj.copy_(value)
        experts = model.model.layers[3].mlp.experts
        if how == "parameter":
            experts.down_proj = torch.nn.Parameter(value.clone(), requires_grad=False)
        else:
            experts.down_proj.data = value.clone()
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(reference, _ids()))
    finally:
        hf_prefetch.remove_offload(model)


def test_an_interrupted_device_part_of_a_split_leaves_no_host_part_for_a_forward_that_does_not_route():
    # A Ctrl-C in the device's forward of a split (a decode step) leaves its host part behind; the next generate's
    # prefill (6 tokens: it does not route, so it computes nothing on the host) must not add that part to its output.
    clean = moe_model("qwen3_moe")
    model = copy.deepcopy(clean)
    _dispatch(clean, cpu_experts="auto", recent_experts=False)
    _dispatch(model, cpu_experts="auto", recent_experts=False)
    _split(clean)
    _split(model)
    experts = model.model.layers[1].mlp.experts
    forward = experts._old_forward
    calls = {"count": 0}

    def interrupted(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 3:  # the second decode step's device part (the prefill's call is the first)
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    experts._old_forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            generate_with_logits(model, _ids())
        experts._old_forward = forward
        assert_same_generation(generate_with_logits(model, _ids()), generate_with_logits(clean, _ids()))
    finally:
        experts._old_forward = forward
        hf_prefetch.remove_offload(model)
        hf_prefetch.remove_offload(clean)


@pytest.mark.parametrize("fields", [dict(expert_cache=4), dict(recent_experts=True)])
def test_auto_on_the_cpu_is_bitwise_the_resident_model_with_held_experts_too(fields):
    # On a CPU device "auto" computes every pick in one forward of the module, held by an expert cache or a fetch
    # ahead or not: the module's own sums, bitwise the resident model's.
    model = moe_model("qwen3_moe")
    want = generate_with_logits(copy.deepcopy(model), _ids(2, 3))
    _dispatch(model, cpu_experts="auto", **fields)
    try:
        assert_same_generation(generate_with_logits(model, _ids(2, 3)), want)
    finally:
        hf_prefetch.remove_offload(model)


def test_recent_experts_true_with_cpu_experts_true_says_it_changes_nothing():
    # With every pick on the host no layer fetches recent picks: recent_experts=True changes nothing, and says so; the
    # plan does not claim fetches.
    model = moe_model("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts=True, recent_experts=True), device="cpu")
    assert any("recent_experts" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert "fetch the experts they picked" not in str(plan)


def test_expert_cache_with_cpu_experts_true_gives_cpu_experts_as_the_reason():
    # cpu_experts=True keeps no expert cache: the warning about expert_cache names it as the reason.
    model = moe_model("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts=True, expert_cache=4), device="cpu")
    cache = [str(w.message) for w in caught if "expert_cache=4" in str(w.message)]
    assert cache and "cpu_experts" in cache[0], cache


def test_the_plan_counts_what_crosses_the_link_with_cpu_experts_true():
    # The plan's bytes per forward and per token are what a forward copies: with True, never the routed tensors.
    model = moe_model("qwen3_moe")
    _dispatch(model, cpu_experts=True)
    try:
        plan = hf_prefetch.get_state(model).plan
        assert "computed on the host's cores in every forward" in str(plan)
        copied = []
        with torch.no_grad():
            for length in (6, 6, 1, 1):
                model(_ids(length=length))
                copied.append(hf_prefetch.stats(model).copied_bytes)
        assert copied[1] - copied[0] == plan.streamed_bytes_per_forward
        assert copied[3] - copied[2] == plan.streamed_bytes_per_token
    finally:
        hf_prefetch.remove_offload(model)


def test_the_plan_of_auto_with_routed_max_tokens_0_has_no_host_lines():
    # "auto" with routed_max_tokens=0 computes nothing on the host: the warning says so, the plan shows no host line.
    model = moe_model("qwen3_moe")
    config = PrefetchConfig(**{**ROUTED, "routed_max_tokens": 0}, cpu_experts="auto")
    with pytest.warns(UserWarning, match="computes nothing on the host"):
        plan = hf_prefetch.plan(model, config, device="cpu")
    assert "experts on host" not in str(plan)


def test_a_split_counts_every_pick_of_the_device_as_a_routed_pick():
    # LayerStats.routed_picks: "a repeated pick counts again", in a split too: 4 tokens that all pick the same 4
    # experts, some on each side, count 16 picks in all.
    model = moe_model("qwen3_moe")
    control_routing(model, "sticky")
    _dispatch(model, cpu_experts="auto", recent_experts=False)
    _split(model)
    try:
        with torch.no_grad():
            model(_ids(length=6))
            model(_ids(length=6))
            before = hf_prefetch.stats(model).layers[1]
            model(_ids(length=4))  # layer 3 routes: 4 tokens x top_k 4
        after = hf_prefetch.stats(model).layers[1]
        host = after.host_picks - before.host_picks
        device = after.routed_picks - before.routed_picks
        assert host > 0 and host + device == 4 * 4, (host, device)
    finally:
        hf_prefetch.remove_offload(model)


def test_fp64_experts_are_refused_without_calling_them_quantized():
    model = moe_model("qwen3_moe").double()
    with pytest.raises(ValueError, match="float64") as error:
        hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")
    assert hf_prefetch.get_state(model) is None
    # A wider float is no packed format: the fix the error names is a cast.
    assert "quantized" not in str(error.value), str(error.value)


def test_cpu_experts_with_routed_experts_false_names_routed_experts_false():
    # routed_experts=False streams the experts whole: the warning names that option as the reason.
    model = moe_model("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts=True, routed_experts=False), device="cpu")
    host = [str(w.message) for w in caught if "cpu_experts" in str(w.message)]
    assert host and "routed_experts=False" in host[0], host


@pytest.mark.parametrize("mode", [True, "auto"])
def test_compress_leaves_the_routed_experts_plain_so_the_host_computes_from_them(mode):
    # The codec never encodes routed experts (copied row by row): the host reads the same plain tensors it always does.
    model = moe_model("qwen3_moe").to(torch.bfloat16)
    want = generate_with_logits(copy.deepcopy(model), _ids())
    with pytest.warns(UserWarning, match="routed experts, copied row by row"):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=mode, compress=True), device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
        assert hf_prefetch.stats(model).host_picks > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_map_files_true_says_that_a_model_with_routed_experts_keeps_its_streamed_weights_in_host_memory(tmp_path):
    moe_model("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path)
    want = generate_with_logits(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), _ids())
    config = PrefetchConfig(**ROUTED, cpu_experts=True)
    with pytest.warns(UserWarning, match="map_files=True maps nothing in this plan: routed experts' rows") as caught:
        loaded = hf_prefetch.from_pretrained(tmp_path, config, device="cpu", map_files=True, dtype=torch.bfloat16)
    assert any(w.filename == __file__ for w in caught if "map_files" in str(w.message))  # the caller's line
    try:
        assert hf_prefetch.get_state(loaded).arena.file_bytes == 0  # no host tensor is a file's page
        assert_same_generation(generate_with_logits(loaded, _ids()), want)
    finally:
        hf_prefetch.remove_offload(loaded)
