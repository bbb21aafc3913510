"""Pipeline placement (hf_prefetch/planning/pipeline.py): a `max_memory` naming several GPUs puts consecutive runs of
layers on each. On the CPU every GPU entry is planned for as if the CPU were that GPU, and executed there: one engine
per entry behind `DeviceEngines`, the hooks that move inputs, `hf_device_map`, all bitwise against the unmodified
model. Real GPUs: tests/test_gpu.py (two GPUs)."""

from __future__ import annotations

import pytest
import torch

import hf_prefetch
from hf_prefetch.planning.memory import parse_max_memory, resolve_budgets
from hf_prefetch.planning.offload_plan import format_bytes
from hf_prefetch.planning.pipeline import split_layers
from hf_prefetch.runtime.devices import DeviceEngines
from tests.models import tiny_llama

CPU = torch.device("cpu")
# The tiny Llama: 8 layers of 144.5 KiB (fp32), 64.3 KiB outside them.
TWO = {0: 500_000, 1: 900_000, "cpu": "1GiB"}
RESERVE = 10_000


@pytest.mark.parametrize(
    "layer_bytes, capacity, expected",
    [
        ([1] * 8, [1, 1], [(0, 4), (4, 8)]),
        ([1] * 8, [3, 1], [(0, 6), (6, 8)]),
        ([1] * 3, [100, 1], [(0, 2), (2, 3)]),  # every GPU gets a layer
        ([1] * 3, [1, 1, 1], [(0, 1), (1, 2), (2, 3)]),
        ([5, 1, 1, 1, 1, 1], [1, 1], [(0, 1), (1, 6)]),
        ([1] * 10, [1, 2, 2], [(0, 2), (2, 6), (6, 10)]),
    ],
)
def test_layers_split_into_consecutive_runs_in_proportion(layer_bytes, capacity, expected):
    runs = split_layers(layer_bytes, capacity)
    assert [(r.start, r.stop) for r in runs] == expected


def test_the_plan_puts_consecutive_layers_on_each_gpu_within_its_budget():
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    plan = hf_prefetch.plan(model, max_memory=TWO, reserve_bytes=RESERVE, device="cpu", link_gbps=50)
    assert [index for index, _ in plan.gpus] == [0, 1]
    assert [ring.device for ring in plan.rings] == [0, 1]
    indices = [[layer.index for layer in ring.layers] for ring in plan.rings]
    assert indices[0] + indices[1] == list(range(8)) and all(indices)
    for index, budget in plan.gpus:
        resident, pool = plan.gpu_bytes(index)
        assert resident + pool <= budget.weights_bytes
    assert sum(plan.gpu_bytes(i)[0] for i, _ in plan.gpus) == plan.resident_bytes
    assert plan.streamed_bytes_per_forward > 0  # GPU 0's budget forces streaming
    text = str(plan)
    assert "cuda:0                 layers 0-" in text and "(max_memory[1])" in text
    assert "device budget" not in text


def test_a_pipeline_dispatch_on_the_cpu_is_bitwise_and_undone_by_removal():
    model = tiny_llama(num_layers=8)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=12, do_sample=False)
    hf_prefetch.dispatch_model(model, max_memory=TWO, reserve_bytes=RESERVE, device="cpu")
    try:
        state = hf_prefetch.get_state(model)
        assert isinstance(state.engine, DeviceEngines) and len(state.engine.engines) == 2
        assert set(model.hf_device_map.values()) == {"cpu"}
        assert {f"model.layers.{i}" for i in range(8)} <= set(model.hf_device_map)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).logits, logits)
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), tokens)
        stats = hf_prefetch.stats(model)
        assert stats.misses == 0 and stats.copied_bytes > 0
        # New weights written through load_state_dict reach the streamed layers of either engine.
        new = {k: v + 1 for k, v in model.state_dict().items() if k.startswith("model.layers.")}
        model.load_state_dict(new, strict=False)
        with torch.no_grad():
            changed = model(ids).logits
        assert not torch.equal(changed, logits)
    finally:
        hf_prefetch.remove_offload(model)
    assert not hasattr(model, "hf_device_map")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, changed)


def test_from_pretrained_places_a_pipeline_too(tmp_path):
    model = tiny_llama(num_layers=8)
    model.save_pretrained(tmp_path)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = model(ids).logits
    loaded = hf_prefetch.from_pretrained(tmp_path, max_memory=TWO, reserve_bytes=RESERVE, device="cpu")
    try:
        assert [ring.device for ring in hf_prefetch.get_state(loaded).plan.rings] == [0, 1]
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, expected)
    finally:
        hf_prefetch.remove_offload(loaded)


@pytest.mark.parametrize(
    "max_memory, message",
    [
        ({0: 70_000, 1: "1GiB"}, r"max_memory\[0\] = 68.4 KiB leaves nothing for layers .* outside model.layers"),
        ({0: "1GiB", 1: RESERVE}, r"max_memory\[1\] = 9.8 KiB leaves nothing for layers"),
        ({i: "1GiB" for i in range(9)}, "names 9 GPUs but model.layers has 8 layer"),
        ({0: "1GiB", "cuda": "1GiB"}, "name every GPU by its index"),
        ({0: "1GiB", 1: "auto"}, r"max_memory\[1\]='auto' measures a CUDA device's free memory"),
    ],
)
def test_a_pipeline_that_cannot_be_planned_is_refused_and_nothing_is_dispatched(max_memory, message):
    model = tiny_llama(num_layers=8)
    with pytest.raises(ValueError, match=message):
        hf_prefetch.dispatch_model(model, max_memory=max_memory, reserve_bytes=RESERVE, device="cpu")
    assert hf_prefetch.get_state(model) is None and all(p.device == CPU for p in model.parameters())


def test_a_model_with_two_layer_lists_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(
        T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64)
    )
    with pytest.raises(ValueError, match="has 2 layer lists .* links=\\[0, 1\\]"):
        hf_prefetch.plan(model, max_memory={0: "1GiB", 1: "1GiB"}, device="cpu")


def test_gpus_are_checked_before_anything_moves(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    budget = parse_max_memory({0: "1GiB", 2: "1GiB"})
    with pytest.raises(ValueError, match="names GPU 2, but this machine has 2 CUDA device"):
        resolve_budgets(budget, torch.device("cuda", 0), tiny_llama())
    with pytest.raises(ValueError, match=r"names the GPUs \[0, 2\] but the model executes on cuda:1"):
        resolve_budgets(budget, torch.device("cuda", 1), tiny_llama())
    order = resolve_budgets(parse_max_memory({0: "1GiB", 1: "2GiB"}), torch.device("cuda", 1), tiny_llama())
    assert [index for index, _ in order] == [1, 0]  # the execution device first


def test_pipeline_placement_and_shared_links_do_not_combine(monkeypatch):
    from hf_prefetch.planning.choose import choose_plan

    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    budget = parse_max_memory({0: 500_000, 1: 900_000, 2: "1GiB"}, reserve_bytes=RESERVE)
    config = hf_prefetch.PrefetchConfig()
    with pytest.raises(ValueError, match="do not combine yet"):
        choose_plan(model, config, None, CPU, budget, links=(0, 2))


def test_routed_experts_on_a_later_gpu_are_refused_with_the_fix():
    from hf_prefetch.planning.layers import model_bytes
    from tests.moe_models import moe_model

    model = moe_model("qwen3_moe")
    layer = model_bytes(model.model.layers[0])
    other = model_bytes(model) - 4 * layer
    budgets = {0: other + int(1.5 * layer) + RESERVE, 1: int(1.5 * layer) + RESERVE}  # both GPUs stream
    config = hf_prefetch.PrefetchConfig(prefetch_step=1)
    with pytest.raises(ValueError, match=r"route the experts of model\.layers\.\d.*routed_experts=False"):
        hf_prefetch.dispatch_model(model, config, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert hf_prefetch.get_state(model) is None
    config = hf_prefetch.PrefetchConfig(prefetch_step=1, routed_experts=False)
    hf_prefetch.dispatch_model(model, config, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    try:
        assert all(ring.streamed for ring in hf_prefetch.get_state(model).plan.rings)
    finally:
        hf_prefetch.remove_offload(model)


def test_each_resident_tensor_is_read_onto_its_layers_gpu():
    from hf_prefetch.planning.pipeline import home_of

    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    plan = hf_prefetch.plan(model, max_memory=TWO, reserve_bytes=RESERVE, device="cpu")
    first_on_1 = plan.rings[1].layers[0].index
    home = home_of(plan, torch.device("cuda", 0))  # as the loader sees it on a GPU
    assert home(f"model.layers.{first_on_1}.mlp.up_proj.weight") == torch.device("cuda", 1)
    assert home("model.layers.0.self_attn.q_proj.weight") == torch.device("cuda", 0)
    assert home("model.norm.weight") == home("lm_head.weight") == torch.device("cuda", 0)
    assert home_of(plan, CPU)(f"model.layers.{first_on_1}.mlp.up_proj.weight") == CPU


L_BYTES, O_BYTES = 147_968, 65_856  # tiny_llama(8), fp32: one layer, and everything outside the layer list


def test_a_split_that_does_not_fit_is_repaired_by_moving_layers():
    # Proportionally GPU 0 would get 2 layers, which do not fit 1.5 layers' memory with 2 slots; 1 + 1 + 6 does.
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    budgets = {0: O_BYTES + int(1.5 * L_BYTES) + RESERVE, 1: int(1.5 * L_BYTES) + RESERVE, 2: 4 * L_BYTES + RESERVE}
    plan = hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert [len(ring.layers) for ring in plan.rings] == [1, 1, 6]
    for index, budget in plan.gpus:
        assert sum(plan.gpu_bytes(index)) <= budget.weights_bytes


def test_the_host_budget_holds_for_all_gpus_together():
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    budgets = {0: O_BYTES + int(2.5 * L_BYTES) + RESERVE, 1: int(2.5 * L_BYTES) + RESERVE, "cpu": 5 * L_BYTES}
    # Every layer streams: 8 layers of 152 KiB in the host arena (each tensor at a 4 KiB boundary).
    with pytest.raises(ValueError, match=r"pin 1.2 MiB of host memory in all, more than max_memory\['cpu'\]"):
        hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    budgets["cpu"] = "1GiB"
    assert "of 1.00 GiB (max_memory['cpu'])" in str(
        hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    )


def test_the_host_budget_of_all_gpus_counts_the_arena_with_its_alignment_padding():
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    budgets = {0: O_BYTES + int(2.5 * L_BYTES) + RESERVE, 1: int(2.5 * L_BYTES) + RESERVE, "cpu": "1GiB"}
    plan = hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert plan.host_bytes > plan.offloaded_bytes  # each tensor at a 4 KiB boundary: the norms take 4 KiB each
    budgets["cpu"] = plan.host_bytes - 1  # more than the values, less than the arena that holds them
    with pytest.raises(ValueError, match=rf"pin {format_bytes(plan.host_bytes)} of host memory in all, more than"):
        hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    budgets["cpu"] = plan.host_bytes  # just enough: the same plan
    fits = hf_prefetch.plan(model, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert fits.rings == plan.rings and fits.host_bytes == plan.host_bytes == fits.gpus[0][1].host_bytes


def test_offload_params_may_match_nothing_in_one_gpus_run():
    from hf_prefetch.planning.layers import model_bytes
    from tests.moe_models import moe_model

    model = moe_model("deepseek_v3")  # layer 0 is dense: no experts
    layer = model_bytes(model.model.layers[1])
    other = model_bytes(model) - sum(model_bytes(m) for m in model.model.layers)
    config = hf_prefetch.PrefetchConfig(prefetch_step=1, offload_params={"experts"}, routed_experts=False)
    budgets = {0: other + model_bytes(model.model.layers[0]) + RESERVE, 1: 2 * layer + RESERVE}
    plan = hf_prefetch.plan(model, config, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert [layer.index for layer in plan.rings[0].layers] == [0] and plan.rings[1].streamed
    with pytest.raises(ValueError, match="matched no parameter"):
        hf_prefetch.plan(
            model,
            hf_prefetch.PrefetchConfig(offload_params={"nothing"}),
            max_memory=budgets,
            reserve_bytes=RESERVE,
            device="cpu",
        )


def test_the_expert_cache_of_the_first_gpu_is_kept():
    from hf_prefetch.planning.layers import model_bytes
    from tests.moe_models import moe_model

    model = moe_model("qwen3_moe")
    layer = model_bytes(model.model.layers[0])
    other = model_bytes(model) - 4 * layer
    budgets = {0: other + int(2.6 * layer) + RESERVE, 1: layer + RESERVE + 100}
    config = hf_prefetch.PrefetchConfig(prefetch_step=1, expert_cache=2)
    plan = hf_prefetch.plan(model, config, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    assert plan.rings[0].streamed and not plan.rings[1].streamed and plan.cached_experts == 2


def test_routed_max_tokens_0_never_routes_so_a_later_gpu_may_hold_expert_layers():
    from hf_prefetch.planning.layers import model_bytes
    from tests.moe_models import moe_model

    model = moe_model("qwen3_moe")
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = model(ids).logits
    layer = model_bytes(model.model.layers[0])
    other = model_bytes(model) - 4 * layer
    budgets = {0: other + int(1.5 * layer) + RESERVE, 1: int(1.5 * layer) + RESERVE}
    config = hf_prefetch.PrefetchConfig(prefetch_step=1, routed_max_tokens=0)
    hf_prefetch.dispatch_model(model, config, max_memory=budgets, reserve_bytes=RESERVE, device="cpu")
    try:
        assert hf_prefetch.get_state(model).plan.rings[1].streamed
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
    finally:
        hf_prefetch.remove_offload(model)
