"""Routed experts computed on the host's cores (PrefetchConfig(cpu_experts=...), hf_prefetch/runtime/host_experts.py):
the module's own forward on host storage, the split of a forward's picks between host and device, its checks and
its failure paths."""

import copy
import dataclasses
import inspect
import warnings
from dataclasses import replace

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.planning.host_compute import HOST_IMPLEMENTATION, host_twin, pick_host_experts, split_inputs
from hf_prefetch.planning.host_split import HostCompute, best_host_count, host_count
from hf_prefetch.planning.placements import Routing
from hf_prefetch.runtime.host_experts import HostExperts
from tests.models import assert_same_generation, generate_with_logits, llama_and_logits
from tests.moe_models import FAMILIES, VOCAB, moe_model, routed_hooks

# Layers 1 and 3 stream, taking turns in one slot; a forward of up to 4 tokens routes.
ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _ids(seed: int = 1, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _host_parts(monkeypatch) -> list:
    """Every host computation's (inputs, output), recorded as the worker runs it."""
    calls = []
    run = HostExperts.run

    def recording(self, hidden, index, weights):
        out, seconds = run(self, hidden, index, weights)
        calls.append((self, hidden.clone(), index.clone(), weights.clone(), out.clone()))
        return out, seconds

    monkeypatch.setattr(HostExperts, "run", recording)
    return calls


@pytest.mark.parametrize(
    "family, implementation",
    [(family, "eager") for family in FAMILIES] + [("qwen3_moe", "grouped_mm"), ("gpt_oss", "batched_mm")],
)
def test_cpu_experts_true_on_the_cpu_is_bitwise_the_resident_model_and_copies_no_expert(family, implementation):
    model = moe_model(family, experts_implementation=implementation)
    want = generate_with_logits(copy.deepcopy(model), _ids())
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
        stats = hf_prefetch.stats(model)
        # Every forward's picks (the prefill's too) computed on the host: no expert row crossed, no layer completed.
        assert stats.host_picks > 0 and stats.routed_rows == 0 and stats.completions == 0
        assert stats.host_bytes > 0 and stats.host_seconds > 0
        routed = sum(t.nbytes for layer in hf_prefetch.get_state(model).engine.rings[0].layers for t in layer.routed)
        whole = sum(layer.copies for layer in stats.layers) * routed / len(stats.layers)
        assert stats.copied_bytes < whole  # the copies brought everything but the experts
        assert "host picks" in str(stats)
    finally:
        hf_prefetch.remove_offload(model)


def test_auto_on_the_cpu_computes_the_routing_forwards_on_the_host_bitwise():
    model = moe_model("qwen3_moe")
    want = generate_with_logits(copy.deepcopy(model), _ids())
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    try:
        plan = hf_prefetch.get_state(model).plan
        assert plan.host_compute.share == 1.0 and not plan.host_compute.always  # no link on a CPU device
        assert "experts on host" in str(plan)
        assert_same_generation(generate_with_logits(model, _ids()), want)
        stats = hf_prefetch.stats(model)
        # The prefill (6 tokens, more than routed_max_tokens) copied whole; the 5 decode forwards computed on the host,
        # except the first one's layer 1: copied whole at the prefill's end, it holds every expert in its slot.
        assert stats.host_picks == 5 * 4 * len(stats.layers) - 4 and stats.routed_rows == 0
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("held", [{}, dict(expert_cache=4, recent_experts=True)])  # on a GPU: picks held there
def test_a_split_is_deterministic_and_its_host_part_is_the_modules_own_forward_on_the_host(
    monkeypatch, device, implementation, held
):
    reference = moe_model("qwen3_moe", experts_implementation=implementation)
    want = generate_with_logits(copy.deepcopy(reference).to(device), _ids().to(device))
    calls = _host_parts(monkeypatch)
    model = copy.deepcopy(reference)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts="auto", **held), device=device)
    try:
        paths = {}
        for hook in routed_hooks(model):
            if device != "cpu":
                compute = hook.host.compute  # measured at planning: one token through 1 .. top_k experts
                assert len(compute.times) == 4 and all(t > 0 for t in compute.times) and compute.row_bytes > 0
            hook.host.compute = replace(hook.host.compute, share=0.5, times=None)  # half of the picks on each side
            paths[id(hook.host)] = hook.path
        first = generate_with_logits(model, _ids().to(device))
        second = generate_with_logits(model, _ids().to(device))
        assert_same_generation(second, first)  # every run the same
        stats = hf_prefetch.stats(model)
        assert 0 < stats.host_picks < stats.host_picks + stats.routed_picks
        assert stats.routed_rows > 0  # the device's share crossed the link
        # A sum in another order than the resident model's, of the same experts' results.
        for got, expected in zip(first.logits, want.logits, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    finally:
        hf_prefetch.remove_offload(model)
    # Each host part is the experts module's own forward on the host, on the same inputs, bit for bit: beside a GPU
    # with the host's implementation (generate switched the module to batched_mm for decoding), on a CPU device with
    # the module's.
    assert calls
    for host, hidden, index, weights, out in calls:
        module = copy.deepcopy(reference.get_submodule(paths[id(host)])).cpu()
        if device != "cpu":
            module.config = copy.copy(module.config)
            module.config._experts_implementation = HOST_IMPLEMENTATION
        with torch.no_grad():
            assert torch.equal(type(module).forward(module, hidden, index, weights), out)


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_experts_true_gives_the_host_computed_model_every_run(device):
    # On a GPU, the host's kernels accumulate as the host's: the tokens are those of the model with its experts run on
    # the host, every run alike, and within rounding of the resident GPU model.
    reference = moe_model("gpt_oss").to(torch.bfloat16)
    want = generate_with_logits(copy.deepcopy(reference).to(device), _ids().to(device))
    model = copy.deepcopy(reference)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device=device)
    try:
        runs = [generate_with_logits(model, _ids().to(device)) for _ in range(2)]
        assert_same_generation(runs[1], runs[0])
        if device == "cpu":
            assert_same_generation(runs[0], want)
        largest = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(runs[0].logits, want.logits, strict=True)
        )
        assert largest < 0.5, largest
        assert hf_prefetch.stats(model).routed_rows == 0
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_a_twin_beside_a_gpu_keeps_the_hosts_implementation_whatever_the_module_switches_to(implementation):
    module = moe_model("qwen3_moe", experts_implementation=implementation).model.layers[1].mlp.experts
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    beside_gpu, on_cpu = host_twin(module, params, HOST_IMPLEMENTATION), host_twin(module, params)
    assert beside_gpu.config is not module.config and on_cpu.config is module.config
    module.config._experts_implementation = "batched_mm"  # what generate does for GPU decoding
    assert beside_gpu.config._experts_implementation == HOST_IMPLEMENTATION
    assert on_cpu.config._experts_implementation == "batched_mm"
    hidden = torch.randn(3, module.config.hidden_size)
    index = torch.tensor([[1, 4, 9, 15], [2, 4, 4, 0], [7, 8, 9, 3]])
    weights = torch.rand(3, 4)
    with torch.no_grad():
        got = type(module).forward(beside_gpu, hidden, index, weights)
        module.config._experts_implementation = HOST_IMPLEMENTATION
        assert torch.equal(got, type(module).forward(module, hidden, index, weights))


def test_a_twin_of_a_module_without_implementations_shares_its_configuration():
    class Experts(torch.nn.Module):  # no @use_experts_implementation: its own forward only
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {})()
            self.weight = torch.nn.Parameter(torch.ones(4, 2, 2))

    module = Experts()
    twin = host_twin(module, {"weight": torch.zeros(4, 2, 2)}, HOST_IMPLEMENTATION)
    assert twin.config is module.config and not hasattr(twin.config, "_experts_implementation")
    assert torch.equal(twin.weight, torch.zeros(4, 2, 2)) and torch.equal(module.weight, torch.ones(4, 2, 2))


def test_pick_host_experts_takes_the_least_picked_first_from_the_picks_alone():
    index = torch.tensor([[3, 5], [5, 7], [9, 3], [5, 1]])  # 5 three times, 3 twice, the others once
    assert pick_host_experts(index, 10, lambda n: n) == {1, 3, 5, 7, 9}
    assert pick_host_experts(index, 10, lambda n: 0) == set()
    # Two of five, picked once each, highest first among ties; then 3 (twice) before 5 (three times).
    assert pick_host_experts(index, 10, lambda n: 2) == {9, 7}
    assert pick_host_experts(index, 10, lambda n: 4) == {9, 7, 1, 3}
    seen = []
    pick_host_experts(index, 10, lambda n: seen.append(n) or 0)
    assert seen == [5]  # the count is asked of the distinct picks
    assert pick_host_experts(torch.tensor([[10, -1]]), 10, lambda n: n) == set()  # sentinels are no experts


def test_best_host_count_weighs_the_measured_host_times_and_the_sync_against_the_link():
    row = 1.0  # one expert's row over the link: 1 s
    # A host as fast as the link per expert with no fixed cost: half each.
    assert best_host_count(4, (1.0, 2.0, 3.0, 4.0), row, 0.0) == 2
    # The same host with a fixed cost of 3.1 s a call: of 4 picks a split finishes at best in max(4.1, 3) = 4.1,
    # against 4 over the link alone, so nothing on the host; of 8 it pays: max(5.1, 6) = 6 < 8.
    slow_start = (4.1, 5.1, 6.1, 7.1)
    assert best_host_count(4, slow_start, row, 0.0) == 0
    assert best_host_count(8, slow_start, row, 0.0) == 2
    assert best_host_count(16, slow_start, row, 0.0) == 6  # past the measured times, at their average step
    # The synchronisation alone can tip it.
    assert best_host_count(2, (0.5, 1.0), row, 0.0) == 1
    assert best_host_count(2, (0.5, 1.0), row, 1.6) == 0
    assert best_host_count(0, (0.5,), row, 0.0) == 0
    assert best_host_count(3, (), row, 0.0) == 0  # nothing measured: the link


def test_auto_beside_a_gpu_skips_the_hosts_synchronisation_for_forwards_predicted_not_to_gain():
    module = moe_model("qwen3_moe").model.layers[1].mlp.experts  # 16 experts, top 4
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    routing = Routing("mlp.experts", 16, 4, "top_k_index")
    row = sum(t.nbytes for t in params.values()) // 16
    host = HostExperts(module, params, HostCompute(False, 0.4), routing, torch.device("cuda"))
    assert host.twin.config._experts_implementation == HOST_IMPLEMENTATION
    assert host.splits(1) and host.count(4) == 1  # unmeasured: the share (max(1 / 0.4, 3 / 0.6) = 5)
    # The host's times measured for these experts: one over the link takes as long as 1 s of them here.
    host.compute = HostCompute(False, 0.4, 1.0, row / 1e9, times=(4.1, 5.1, 6.1, 7.1), row_bytes=row)
    assert not host.splits(1) and host.count(4) == 0
    assert host.splits(4)  # four tokens reach about 11 distinct experts, where the host pays
    host.top_k = 1
    assert not host.splits(4)  # four tokens of one pick each reach about 4
    host.compute = replace(host.compute, always=True)
    assert host.splits(1) and host.count(4) == 4
    # Experts twice the size measured take twice the measured times and twice the link's.
    auto = replace(host.compute, always=False)
    assert auto.host_time(2, 2 * row) == pytest.approx(10.2) and auto.host_time(0, row) == 0.0
    assert auto.count(4, 2 * row) == 0 and auto.count(8, 2 * row) == 2  # max(10.2, 12) = 12 < 16


@pytest.mark.parametrize("n", range(0, 17))
@pytest.mark.parametrize("share", [0.05, 0.3, 0.36, 0.45, 0.5, 0.7, 0.95])
def test_host_count_finishes_both_sides_soonest(n, share):
    def slower(k):
        return max(k / share, (n - k) / (1 - share))

    best = min(slower(k) for k in range(n + 1))
    assert slower(host_count(n, share)) == best
    assert host_count(n, 0.0) == 0 and host_count(n, 1.0) == n


def test_split_inputs_gives_each_side_its_tokens_and_fills_the_other_sides_picks_with_a_zero_weighted_own_pick():
    index = torch.tensor([[3, 5], [7, 7], [5, 1]])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]])
    host, device = split_inputs(index, weights, {5}, 10)
    rows, idx, w = host
    assert rows.tolist() == [0, 2]
    assert idx.tolist() == [[5, 5], [5, 5]] and torch.equal(w, torch.tensor([[0.0, 0.4], [0.9, 0.0]]))
    rows, idx, w = device
    assert rows.tolist() == [0, 1, 2]
    assert idx.tolist() == [[3, 3], [7, 7], [1, 1]]
    assert torch.equal(w, torch.tensor([[0.6, 0.0], [0.5, 0.5], [0.0, 0.1]]))
    assert split_inputs(index, weights, {3, 5, 7, 1}, 10)[1] is None  # every pick on the host


@pytest.mark.parametrize(
    "where, error",
    [("host", KeyboardInterrupt), ("device", RuntimeError)],  # a Ctrl-C while the host computes; a failing kernel
)
def test_a_failure_in_either_part_fails_the_forward_and_the_next_one_is_bitwise(monkeypatch, where, error):
    model = moe_model("qwen3_moe")
    want = generate_with_logits(copy.deepcopy(model), _ids())
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")
    experts = model.model.layers[1].mlp.experts
    owner, name = (HostExperts, "run") if where == "host" else (experts, "_old_forward")
    original = getattr(owner, name)
    failures = {"left": 1}

    def failing(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise error("failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    try:
        with pytest.raises(error):
            generate_with_logits(model, _ids())
        assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("mode", [True, "auto"])
def test_beam_search_sampling_and_left_padded_batches_on_the_host_are_bitwise(mode):
    model = moe_model("gpt_oss")
    reference = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding
    cases = [
        dict(attention_mask=mask),  # 2 tokens per decode forward: routes
        dict(num_beams=3, attention_mask=mask),  # 6 tokens per decode forward: whole ("auto" copies)
        dict(do_sample=True, top_k=20),
    ]
    wants = []
    for case in cases:
        torch.manual_seed(7)
        wants.append(generate_with_logits(reference, ids, **case))
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=mode), device="cpu")
    try:
        for case, want in zip(cases, wants, strict=True):
            torch.manual_seed(7)
            assert_same_generation(generate_with_logits(model, ids, **case), want)
        assert hf_prefetch.stats(model).host_picks > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_compiled_or_captured_forwards_gather_over_the_link_and_say_so():
    model = moe_model("qwen3_moe")
    want = generate_with_logits(copy.deepcopy(model), _ids())
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    try:
        engine = hf_prefetch.get_state(model).engine
        engine.compiled = True  # what ops.py sets once compiled code calls the engine
        for hook in routed_hooks(model):
            hook.host = None  # the compiled graph's path: its custom op calls the engine's gather
        with pytest.warns(UserWarning, match="gathers them over the link"):
            got = generate_with_logits(model, _ids())
        assert_same_generation(got, want)
        assert hf_prefetch.stats(model).host_picks == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_bad_input_is_refused_before_anything_changes():
    with pytest.raises(ValueError, match=r"cpu_experts='yes' must be False"):
        PrefetchConfig(cpu_experts="yes")
    llama, _, _ = llama_and_logits(4)
    with pytest.raises(ValueError, match="the model has no routed experts"):
        hf_prefetch.dispatch_model(llama, PrefetchConfig(cpu_experts=True), device="cpu")
    assert hf_prefetch.get_state(llama) is None
    model = moe_model("qwen3_moe")
    config = PrefetchConfig(**ROUTED, cpu_experts=True, offload_params=["gate_up_proj"])
    with pytest.raises(ValueError, match=r"experts.down_proj stays on the device .*offload_params"):
        hf_prefetch.dispatch_model(model, config, device="cpu")
    assert hf_prefetch.get_state(model) is None
    model.config._experts_implementation = "sonicmoe"
    with pytest.raises(ValueError, match="experts_implementation='sonicmoe', a CUDA kernel"):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")
    assert hf_prefetch.get_state(model) is None


def test_quantized_experts_are_refused_naming_their_format(tmp_path):
    from tests.moe_models import mxfp4_checkpoint

    folder = mxfp4_checkpoint(tmp_path / "mxfp4")
    with pytest.raises(ValueError, match=r"stored as torch.uint8 \(MXFP4 blocks and scales\)"):
        hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED, cpu_experts=True), device="cpu")


def test_a_plan_whose_routed_layers_own_their_slots_says_cpu_experts_changes_nothing():
    model = moe_model("qwen3_moe")
    # Two streamed layers, two slots: each is alone in its slot and keeps its experts on the device.
    config = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2, cpu_experts=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        assert any("computes nothing on the host" in str(w.message) for w in caught)
        assert not any(hook.host for hook in routed_hooks(model))
    finally:
        hf_prefetch.remove_offload(model)


def test_the_plan_predicts_the_hosts_time_from_measured_speeds():
    import dataclasses

    from hf_prefetch.planning.placements import host_layers

    plan = hf_prefetch.plan(moe_model("qwen3_moe"), PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    assert plan.host_seconds_per_token is None  # no speeds measured on a CPU device
    measured = dataclasses.replace(plan, host_compute=HostCompute(False, 0.25, host_gbps=10.0, link_gbps=30.0))
    layers = host_layers(measured.rings)
    picked = sum(s.nbytes // s.routing.num_experts * s.routing.top_k for layer in layers for s in layer.routed)
    assert measured.host_seconds_per_token == pytest.approx(picked * 0.25 / 10e9)
    # The link copies the other three quarters of the picks (the plan on the CPU: none of them).
    specs = [s.nbytes // s.routing.num_experts * s.routing.top_k for layer in layers for s in layer.routed]
    moved = sum(bytes_ - int(bytes_ * 0.25) for bytes_ in specs)
    assert measured.streamed_bytes_per_token - plan.streamed_bytes_per_token == moved
    shown = str(measured)
    assert "compute 25% of the picked experts on the host's cores" in shown
    assert "ms predicted (link 30.0 GB/s beside the host)" in shown
    # With the host's times measured (beside a GPU): each layer's count of a token's 4 picks follows them.
    row = sum(s.nbytes for s in layers[0].routed) // 16
    link_row = row / 30e9
    timed = HostCompute(False, 0.25, 10.0, 30.0, times=(link_row, 1.5 * link_row, 4 * link_row, 8 * link_row),
                        row_bytes=row)  # fmt: skip
    assert timed.count(4, row) == 2  # max(1.5, 2) rows of time, against 4 over the link
    measured = dataclasses.replace(plan, host_compute=timed)
    assert measured.host_seconds_per_token == pytest.approx(len(layers) * 1.5 * link_row)
    assert measured.streamed_bytes_per_token - plan.streamed_bytes_per_token == len(layers) * 2 * row  # 2 of 4 cross
    shown = str(measured)
    assert "of a token's 4 picks the host computes 2 (one token through 1..4 experts took the host" in shown


@pytest.mark.parametrize("skeleton", [False, True])
def test_the_hosts_times_are_measured_on_a_twin_that_leaves_the_model_as_it_is(skeleton):
    from hf_prefetch.planning.host_compute import measure_host_times
    from hf_prefetch.planning.placements import host_layers

    model = moe_model("qwen3_moe", experts_implementation="batched_mm")
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    layer = host_layers(plan.rings)[0]
    if skeleton:  # from_pretrained plans before the weights are read: the model's tensors are on the meta device
        model = model.to("meta")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    routing = layer.routed[0].routing
    times, sync, row_bytes = measure_host_times(model, layer, routing, torch.device("cpu"))
    assert len(times) == routing.top_k == 4 and all(t > 0 for t in times) and sync > 0
    assert row_bytes == sum(s.nbytes for s in layer.routed) // routing.num_experts
    after = model.state_dict()
    assert all(t.is_meta or torch.equal(t, after[name]) for name, t in before.items())
    assert model.config._experts_implementation == "batched_mm"  # the twin computed with its own


def test_the_hosts_times_are_measured_in_the_width_the_experts_compute_in():
    # NemotronH's experts can compute in a latent width smaller than the hidden size.
    transformers = pytest.importorskip("transformers")
    if "moe_latent_size" not in inspect.signature(transformers.NemotronHConfig).parameters:
        pytest.skip("this transformers' NemotronH has no latent experts")
    from hf_prefetch.planning.host_compute import measure_host_times
    from hf_prefetch.planning.placements import host_layers

    config = transformers.NemotronHConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
        layers_block_type=["attention", "moe"] * 4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, moe_latent_size=16, intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    layer = host_layers(plan.rings)[0]
    times, _, _ = measure_host_times(model, layer, layer.routed[0].routing, torch.device("cpu"))
    assert len(times) == 2 and all(t > 0 for t in times)


def test_the_hosts_times_never_make_more_experts_cheaper():
    row = 1_000_000
    noisy = HostCompute(False, 0.4, 1.0, 1.0, times=(2.7e-3, 4.3e-3, 5.8e-3, 5.7e-3), row_bytes=row)
    assert [noisy.host_time(k) for k in (3, 4)] == [5.8e-3, 5.8e-3]  # the noisy last sample does not lower it
    # Past the measured times: their average step ((5.8 - 2.7) / 3 ms), at least one expert at the host's speed (1 ms).
    assert noisy.host_time(6) == pytest.approx(5.8e-3 + 2 * 3.1e-3 / 3)
    slow = HostCompute(False, 0.4, 0.1, 1.0, times=(2e-3, 2e-3), row_bytes=row)  # 10 ms an expert at 0.1 GB/s
    assert slow.host_time(4) == pytest.approx(2e-3 + 2 * 10e-3)


def test_auto_whose_measured_host_never_gains_says_so():
    from hf_prefetch.planning.host_compute import host_unused
    from hf_prefetch.planning.placements import host_layers

    plan = hf_prefetch.plan(moe_model("qwen3_moe"), PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    row = sum(s.nbytes for s in host_layers(plan.rings)[0].routed) // 16
    link_row = row / 30e9
    slow = HostCompute(False, 0.25, 10.0, 30.0, times=tuple(20 * k * link_row for k in range(1, 5)), row_bytes=row)
    assert "no forward that routes finishes sooner" in host_unused(dataclasses.replace(plan, host_compute=slow))
    fast = dataclasses.replace(slow, times=tuple(0.1 * k * link_row for k in range(1, 5)))
    assert host_unused(dataclasses.replace(plan, host_compute=fast)) is None


def test_an_experts_forward_the_host_cannot_time_leaves_the_split_to_the_speeds_and_says_so(monkeypatch):
    from hf_prefetch.planning.host_compute import measure_host_times
    from hf_prefetch.planning.placements import host_layers

    model = moe_model("qwen3_moe")
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    layer = host_layers(plan.rings)[0]
    experts = type(model.get_submodule(f"{layer.path}.mlp.experts"))

    def failing(self, hidden, index, weights):
        raise RuntimeError("no host kernel for this")

    monkeypatch.setattr(experts, "forward", failing)
    with pytest.warns(UserWarning, match="could not time the host's forward of Qwen3MoeExperts.*no host kernel"):
        assert measure_host_times(model, layer, layer.routed[0].routing, torch.device("cpu")) is None


def test_an_unknown_top_k_counts_every_expert_as_the_plans_bytes_do():
    from hf_prefetch.planning.host_split import expected_picks

    assert expected_picks(16, None, 1) == 16 and expected_picks(16, 4, 1) == 4 and expected_picks(16, 4, 100) == 16


def test_a_ctrl_c_while_the_host_is_timed_reaches_the_caller_and_leaves_the_model_as_it_was(monkeypatch):
    from hf_prefetch.planning.host_compute import measure_host_times
    from hf_prefetch.planning.placements import host_layers

    model = moe_model("qwen3_moe")
    want = generate_with_logits(copy.deepcopy(model), _ids())
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, cpu_experts="auto"), device="cpu")
    layer = host_layers(plan.rings)[0]
    experts = type(model.get_submodule(f"{layer.path}.mlp.experts"))
    forward, calls = experts.forward, []

    def interrupted(self, *args):
        calls.append(self)
        if len(calls) == 3:  # while timing, after the input width was found
            raise KeyboardInterrupt
        return forward(self, *args)

    monkeypatch.setattr(experts, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure_host_times(model, layer, layer.routed[0].routing, torch.device("cpu"))
    monkeypatch.setattr(experts, "forward", forward)
    assert all(module is not model.get_submodule(f"{layer.path}.mlp.experts") for module in calls)  # twins only
    assert_same_generation(generate_with_logits(model, _ids()), want)
