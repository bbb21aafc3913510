"""`choose_plan` (hf_prefetch/planning/choose.py) says which options of the config change nothing in the plan it
chose: one warning each, at the caller's line, from every verb that plans (here `hf_prefetch.plan`)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.planning.choose import options_unused
from hf_prefetch.planning.offload_plan import OffloadPlan
from hf_prefetch.planning.placements import LayerPlan, ParamSpec, Placement, RingPlan, Routing
from tests.models import tiny_llama
from tests.moe_models import moe_model

ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1)  # layers 1 and 3 share one slot


def _warnings(model, config) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.plan(model, config, device="cpu")
    assert all(w.filename == __file__ for w in caught)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "family, fields, message",
    [
        ("llama", dict(expert_cache=4),
         "PrefetchConfig(expert_cache=4) keeps no expert on the device in this plan: no streamed parameter is routed "
         "(no experts module streams expert by expert). Drop expert_cache."),
        ("mixtral", dict(expert_cache=4, routed_experts=False),
         "PrefetchConfig(expert_cache=4) keeps no expert on the device in this plan: no streamed parameter is routed "
         "(no experts module streams expert by expert). Drop expert_cache."),
        ("mixtral", dict(expert_cache=4, routed_max_tokens=0),
         "PrefetchConfig(expert_cache=4) keeps no expert on the device in this plan: with routed_max_tokens=0 no "
         "forward routes, so a cache would never be read. Drop expert_cache."),
        ("mixtral", dict(expert_cache=4, prefetch_step=2),  # layers 1 and 3 in two slots: each keeps its experts
         "PrefetchConfig(expert_cache=4) keeps no expert on the device in this plan: each routed layer is alone in "
         "its slot, which keeps all of its experts. Drop expert_cache."),
    ],
)  # fmt: skip
def test_an_option_that_changes_nothing_in_the_plan_says_so(family, fields, message):
    model = tiny_llama(4) if family == "llama" else moe_model(family)
    config = PrefetchConfig(**{**ROUTED, **fields})
    assert _warnings(model, config) == [message]


def test_options_that_take_effect_say_nothing():
    model = moe_model("mixtral")
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, expert_cache=4, routed_max_tokens=2), device="cpu")
    assert plan.cache_bytes > 0 and plan.routed_max_tokens == 2
    assert _warnings(model, PrefetchConfig(**ROUTED, expert_cache=4, routed_max_tokens=2)) == []
    assert _warnings(tiny_llama(4), PrefetchConfig(**ROUTED, expert_cache=0)) == []  # 0: no cache asked for


def test_routed_layers_of_several_experts_modules_get_no_cache_and_it_says_so():
    def routed(name, module):
        routing = Routing(module, 4, 2, "top_k_index")
        return ParamSpec(name, (4, 64), (64, 1), torch.float32, 1024, Placement.ROUTED, routing)

    params = (routed("mlp.a.experts.w", "mlp.a.experts"), routed("mlp.b.experts.w", "mlp.b.experts"))
    layers = (LayerPlan("l.0", 0, params, 0, 0, 1), LayerPlan("l.1", 1, params, 1, 0, 0))  # sharing slot 0
    config = PrefetchConfig(prefetch_step=1, expert_cache=2)
    plan = OffloadPlan(config, (RingPlan("l", layers, 1),), 0, cached_experts=2)
    assert plan.routed_bytes and plan.cache_bytes == 0
    assert options_unused(plan) == [
        "PrefetchConfig(expert_cache=2) keeps no expert on the device in this plan: each routed layer is alone in its "
        "slot, which keeps all of its experts, holds the tensors of several experts modules, or reads its experts "
        "from files, none of which get a cache. "
        "Drop expert_cache."
    ]
