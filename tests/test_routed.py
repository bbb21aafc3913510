"""Routed experts (Placement.ROUTED): mixture-of-experts layers copy only the experts their router picks in forwards
of few tokens, whole expert tensors in forwards of many, and compute exactly what the unmodified model computes."""

import copy
import re
import warnings

import pytest
import torch

import hf_prefetch
from hf_prefetch import Placement, PrefetchConfig
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import FAMILIES, VOCAB, moe_model
from tests.routing import control_routing

ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)


def _ids(batch: int = 1, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


_generate = generate_with_logits
_same = assert_same_generation


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_routed_generate_is_bitwise_the_resident_model(family, implementation):
    model = moe_model(family, experts_implementation=implementation)
    reference = copy.deepcopy(model)
    ids = _ids()
    want = _generate(reference, ids, do_sample=False)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        plan = hf_prefetch.get_state(model).plan
        assert plan.routed_bytes > 0
        assert plan.streamed_bytes_per_token < plan.streamed_bytes_per_forward
        _same(_generate(model, ids, do_sample=False), want)
        stats = hf_prefetch.stats(model)
        # Prefill (6 tokens) copies whole layers; each of the 5 decode forwards after the first token routes.
        assert stats.routed_rows > 0 and stats.misses == 0
        assert stats.routed_bytes < stats.copied_bytes
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_beam_search_sampling_and_left_padded_batches(family):
    model = moe_model(family)
    reference = copy.deepcopy(model)
    ids = _ids(batch=2, length=5)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding
    cases = [
        dict(do_sample=False, attention_mask=mask),  # 2 tokens per decode forward: routes
        dict(do_sample=False, num_beams=3, attention_mask=mask),  # 6 tokens per decode forward: whole copies
        dict(do_sample=True, top_k=20),
    ]
    wants = []
    for case in cases:
        torch.manual_seed(7)
        wants.append(_generate(reference, ids, **dict(case)))
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        for case, want in zip(cases, wants, strict=True):
            torch.manual_seed(7)
            _same(_generate(model, ids, **dict(case)), want)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_switching_between_routed_and_whole_forwards_completes_layers():
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        with torch.no_grad():
            for length in (1, 9, 2, 1, 7, 3, 12, 1):  # routed and whole forwards in every order
                ids = _ids(length=length, seed=length)
                assert torch.equal(model(ids).logits, reference(ids).logits)
        stats = hf_prefetch.stats(model)
        # A whole forward right after a routed one finds its first layer copied without experts: completed.
        assert stats.completions > 0 and stats.misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_routed_rows_are_counted_per_pick():
    model = moe_model("qwen3_moe")  # 16 experts, 4 per token
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, recent_experts=False), device="cpu")
    try:
        with torch.no_grad():
            model(_ids(length=3))
        stats = hf_prefetch.stats(model)
        experts = model.model.layers[1].mlp.experts
        row_bytes = sum(p.numel() * p.element_size() for p in experts.parameters()) // experts.num_experts
        # Layer 1 was copied whole at dispatch (before any forward chose to route); layer 3 gets 3 tokens x 4 experts.
        assert [(layer.path, layer.routed_rows) for layer in stats.layers] == [
            ("model.layers.1", 0),
            ("model.layers.3", 3 * 4),
        ]
        assert stats.routed_bytes == stats.routed_rows * row_bytes
    finally:
        hf_prefetch.remove_offload(model)


def test_routed_experts_false_streams_whole_tensors():
    model = moe_model("mixtral")
    reference = copy.deepcopy(model)
    config = PrefetchConfig(**{**ROUTED, "routed_experts": False})
    plan = hf_prefetch.plan(model, config)
    placements = {spec.placement for layer in plan.rings[0].streamed for spec in layer.params}
    assert placements == {Placement.STREAMED}
    assert plan.streamed_bytes_per_token == plan.streamed_bytes_per_forward
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        _same(_generate(model, _ids(), do_sample=False), _generate(reference, _ids(), do_sample=False))
        assert hf_prefetch.stats(model).routed_rows == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_plan_counts_routed_bytes_per_token():
    model = moe_model("qwen3_moe")  # 16 experts, 4 per token: a quarter of the expert bytes per token
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, offload_params={"experts"}))
    layer = plan.rings[0].streamed[0]
    assert {spec.placement for spec in layer.offloaded} == {Placement.ROUTED}
    assert layer.bytes_per_token * 4 == layer.offloaded_bytes
    assert plan.streamed_bytes_per_token * 4 == plan.streamed_bytes_per_forward
    assert "routed" in str(plan)


def test_experts_only_offload_with_the_break_even_default():
    model = moe_model("olmoe")
    reference = copy.deepcopy(model)
    config = PrefetchConfig(group_size=1, prefetch_step=2, offload_params={"experts"})  # routed_max_tokens: default
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        # 16 experts, 4 per token: the break-even point is 0.75 * 16 / 4 = 3 tokens.
        assert hf_prefetch.get_state(model).engine.routed_max_tokens == 3
        _same(_generate(model, _ids(), do_sample=False), _generate(reference, _ids(), do_sample=False))
        assert hf_prefetch.stats(model).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_state_dict_and_sync_from_device_keep_host_values_of_routed_tensors():
    model = moe_model("qwen3_moe")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        with torch.no_grad():
            model(_ids(length=1))  # a routed forward: slots hold a few experts' rows and stale ones
        with pytest.warns(UserWarning, match="without their expert tensors"):
            hf_prefetch.sync_from_device(model)
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items())
        with torch.no_grad():
            model(_ids(length=1))
        assert torch.equal(model(_ids(length=2)).logits, moe_model("qwen3_moe")(_ids(length=2)).logits)
    finally:
        hf_prefetch.remove_offload(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


class _ListedExperts(torch.nn.Module):
    """Experts as a ModuleList of MLPs (the layout before transformers 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.items = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))


def test_an_unrecognised_experts_layout_streams_whole_with_a_warning_or_is_refused_when_routing_is_required():
    from hf_prefetch.planning.layers import experts_modules

    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = _ListedExperts()
    found = experts_modules(layer)
    assert isinstance(found["mlp.experts"], str) and "submodules" in found["mlp.experts"]

    model = moe_model("mixtral")
    reference = copy.deepcopy(model)
    model.model.layers[1].mlp.experts = _ListedExperts()
    reference.model.layers[1].mlp.experts = model.model.layers[1].mlp.experts
    # routed_experts=True: required, so refused with the module, the reason and the fix.
    with pytest.raises(ValueError) as error:
        hf_prefetch.plan(model, PrefetchConfig(**ROUTED, routed_experts=True))
    message = str(error.value)
    assert "model.layers.1.mlp.experts" in message and "_ListedExperts" in message and "submodules" in message
    assert "routed_experts=None" in message
    # The default: that module streams whole, and says so; the recognised ones still route.
    with pytest.warns(
        UserWarning, match=r"1 experts module .* stream whole .*submodules.*model\.layers\.1\.mlp\.experts"
    ):
        plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED))
    layer_1 = plan.rings[0].layers[1]
    assert {s.placement for s in layer_1.params if "experts" in s.name} == {Placement.STREAMED}
    assert {s.placement for s in plan.rings[0].layers[3].params if "experts" in s.name} == {Placement.ROUTED}
    # routed_experts=False: whole everywhere, no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, routed_experts=False))
    assert plan.routed_bytes == 0


def test_shared_experts_are_not_experts_modules():
    model = moe_model("deepseek_v3")  # DeepseekV3MoE.shared_experts: a dense MLP without num_experts
    plan = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, routed_experts=True))
    names = {s.name: s.placement for s in plan.rings[0].layers[1].params}
    assert names["mlp.shared_experts.gate_proj.weight"] is Placement.STREAMED
    assert names["mlp.experts.gate_up_proj"] is Placement.ROUTED


def test_experts_whose_rows_are_not_experts_are_refused_when_routing_is_required():
    model = moe_model("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data.transpose(0, 1).contiguous())
    with pytest.raises(ValueError, match=r"down_proj of shape \(64, 16, 32\); expected dimension 0 to be num_experts"):
        hf_prefetch.plan(model, PrefetchConfig(**ROUTED, routed_experts=True))


def test_a_bypassed_experts_module_raises_instead_of_computing_with_other_experts():
    # A kernel that replaces the MoE block's forward never calls the experts module, whose hook copies the routed
    # rows: the layer's output is refused.
    model = moe_model("qwen3_moe")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        block = model.model.layers[3].mlp
        with torch.no_grad():
            model(_ids(length=1))  # layer 3 is now copied for routing forwards
            block.forward = lambda hidden_states: hidden_states * 0
            with pytest.raises(RuntimeError, match="experts module's forward .* was not called"):
                model(_ids(length=1))
            del block.forward
            reference = moe_model("qwen3_moe")
            for length in (1, 6):
                assert torch.equal(model(_ids(length=length)).logits, reference(_ids(length=length)).logits)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_routed_max_tokens_is_validated(value):
    with pytest.raises(ValueError, match="routed_max_tokens"):
        PrefetchConfig(routed_max_tokens=value)


def test_routed_experts_is_validated():
    with pytest.raises(ValueError, match="routed_experts=1 must be None, True or False"):
        PrefetchConfig(routed_experts=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cached", [0, 6])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_routed_experts_on_cuda_read_the_mapped_arena_and_match_the_resident_model(implementation, cached):
    model = moe_model("qwen3_moe", experts_implementation=implementation).to(torch.bfloat16)
    reference = copy.deepcopy(model).cuda()
    ids = _ids(batch=2, length=7).cuda()
    want = _generate(reference, ids, do_sample=False, max_new_tokens=24)
    with torch.no_grad():
        prefill = reference(_ids(length=40).cuda()).logits
    config = PrefetchConfig(group_size=1, prefetch_step=2, routed_max_tokens=4, expert_cache=cached)
    hf_prefetch.dispatch_model(model, config, device="cuda")
    try:
        engine = hf_prefetch.get_state(model).engine
        routed = engine.rings[0].layers[0].routed
        assert routed and all(t.source.is_cuda and t.host.device.type == "cpu" for t in routed)  # UVA view
        for _ in range(3):  # routed decode (2 tokens per forward), whole prefills, and back
            _same(_generate(model, ids, do_sample=False, max_new_tokens=24), want)
            with torch.no_grad():
                assert torch.equal(model(_ids(length=40).cuda()).logits, prefill)
        stats = hf_prefetch.stats(model)
        assert stats.routed_rows > 0 and stats.completions > 0 and stats.misses == 0
        assert (stats.cache_hits > 0) == bool(cached)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("cached", [0, 6])
def test_routed_experts_on_a_second_gpu_gather_and_fetch_on_its_streams(cached):
    # The model on cuda:1 while cuda:0 stays the current device: the gather and the recent experts' fetch (Triton
    # kernels, which launch on the current device's stream unless told otherwise) must run on cuda:1's streams.
    model = moe_model("qwen3_moe", experts_implementation="grouped_mm").to(torch.bfloat16)
    reference = copy.deepcopy(model).to("cuda:1")
    ids = _ids(batch=1, length=7).to("cuda:1")
    want = _generate(reference, ids, do_sample=False, max_new_tokens=24)
    config = PrefetchConfig(group_size=1, prefetch_step=2, routed_max_tokens=4, expert_cache=cached)
    assert torch.cuda.current_device() == 0
    hf_prefetch.dispatch_model(model, config, device="cuda:1")
    try:
        for _ in range(3):
            _same(_generate(model, ids, do_sample=False, max_new_tokens=24), want)
        stats = hf_prefetch.stats(model)
        assert stats.routed_rows > 0 and stats.recent_hits > 0 and stats.misses == 0
        assert torch.cuda.current_device() == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_compiled_routed_forwards_match_the_compiled_resident_model(implementation):
    # Under torch.compile the experts' hook calls the custom op hf_prefetch::gather, run with the real router choice
    # each time the compiled code runs; routed (1-3 tokens) and whole (9 tokens) forwards alternate.
    model = moe_model("qwen3_moe", experts_implementation=implementation)
    reference = torch.compile(copy.deepcopy(model), mode="default")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        compiled = torch.compile(model, mode="default")
        with torch.no_grad():
            for length in (1, 2, 9, 1, 3):
                ids = _ids(length=length, seed=length)
                assert torch.equal(compiled(ids).logits, reference(ids).logits)
        stats = hf_prefetch.stats(model)
        assert stats.routed_rows > 0 and stats.completions > 0 and stats.misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def _graph_generate(model, ids):
    from transformers import CompileConfig

    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            cache_implementation="static",
            compile_config=CompileConfig(mode="reduce-overhead", fullgraph=False),  # inductor, CUDA graphs
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cached, recent", [(0, False), (6, False), (0, True), (6, True)])
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_cuda_graphs_record_routed_copies_that_follow_each_replays_router(implementation, cached, recent):
    # Decode graphs of batch 1 route (1 token <= routed_max_tokens=4); those of batch 8 copy whole expert tensors;
    # eager prefills (7 and 56 tokens) copy whole too. They alternate, so each kind of graph is replayed after the
    # other left the first layers copied its way. Reference: the same dispatch with routing off (the same ops, so the
    # same fusions), compiled the same way: every logit bitwise equal, replay after replay. The routers pick at random
    # (tests/routing.py): a random model's greedy tokens repeat, and with them its picks, which a cache may then hold
    # all of (no miss) or none of (no hit), and recent experts find nothing to fetch.
    model = moe_model("qwen3_moe", experts_implementation=implementation).to(torch.bfloat16).eval()
    control_routing(model, "random", device="cuda")
    batches = [_ids(batch=1, length=7, seed=1), _ids(batch=8, length=7, seed=2)]
    order = [0, 0, 1, 0, 1, 1, 0, 0]
    outputs = {}
    for name, limit in (("whole", 0), ("routed", 4)):
        config = PrefetchConfig(**{**ROUTED, "routed_max_tokens": limit}, expert_cache=cached, recent_experts=recent)
        hf_prefetch.dispatch_model(model, config, device="cuda")
        try:
            outputs[name] = []
            for batch in order:
                hf_prefetch.reset_stats(model)
                out = _graph_generate(model, batches[batch].cuda())
                outputs[name].append((out, hf_prefetch.stats(model)))
            assert hf_prefetch.get_state(model).engine.graphs
        finally:
            hf_prefetch.remove_offload(model, device="cpu")
            torch._dynamo.reset()
    for step, ((routed, routed_stats), (whole, whole_stats)) in enumerate(
        zip(outputs["routed"], outputs["whole"], strict=True)
    ):
        _same(routed, whole)
        assert routed_stats.misses == 0 and whole_stats.misses == 0
        if order[step] == 0 and step > 1:  # batch 1, replayed: its first layers were copied without experts
            # Fetching a layer's previous picks also moves those it does not pick again (4 of 16 experts a token).
            # A cache's loads (each prompt's prefill ranks it) are on top of what the forwards copy.
            copied = routed_stats.copied_bytes - routed_stats.cache_loaded_bytes
            assert copied < whole_stats.copied_bytes / (1 if recent else 2)
            assert (routed_stats.recent_hits > 0) == recent  # the replays' fetches and lookups, on the device
        if order[step] == 0 and cached:  # the replays' gathers looked their picks up in the cache, on the device
            assert routed_stats.cache_hits > 0 and routed_stats.cache_misses > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_graphs_of_each_kind_replay_right_after_forwards_of_the_other_kind(implementation):
    # Compiled forwards called directly (no generate, so no eager prefill between them) of 8 tokens (whole) and 1
    # token (routing). Per shape inductor's first call runs eagerly, the second records, later ones replay. Counting
    # calls from 0: a whole graph replays right after a routing forward (calls 4 and 7: its first layers were copied
    # without their experts, and only `prepare` completes them), and the routing graph is recorded right after a
    # whole forward (call 5: its first layers are whole at capture, yet its replays find them copied without
    # experts, so the graph must gather their rows anyway). Reference: the routing-off dispatch, compiled and called
    # the same way.
    model = moe_model("qwen3_moe", experts_implementation=implementation).to(torch.bfloat16).eval()
    order = [8, 8, 8, 1, 8, 1, 1, 8, 1, 8]
    logits = {}
    for name, limit in (("whole", 0), ("routed", 4)):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**{**ROUTED, "routed_max_tokens": limit}), device="cuda")
        try:
            compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
            logits[name] = []
            with torch.no_grad():
                for call, length in enumerate(order):
                    ids = _ids(length=length, seed=call).cuda()
                    logits[name].append(compiled(ids, use_cache=False).logits.clone())
            assert hf_prefetch.get_state(model).engine.graphs
            assert hf_prefetch.stats(model).misses == 0
        finally:
            hf_prefetch.remove_offload(model, device="cpu")
            torch._dynamo.reset()
    for call, (routed, whole) in enumerate(zip(logits["routed"], logits["whole"], strict=True)):
        assert torch.equal(routed, whole), f"call {call} ({order[call]} tokens)"


def test_the_stats_table_shows_routed_columns_once_experts_were_routed():
    model = moe_model("qwen3_moe")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        assert "routed experts" not in str(hf_prefetch.stats(model))
        with torch.no_grad():
            model(_ids(length=1))
        table = str(hf_prefetch.stats(model))
        header, *rows = table.splitlines()
        assert "routed experts" in header and "completions" in header
        total = next(row for row in rows if row.startswith("total")).split()
        snapshot = hf_prefetch.stats(model)
        assert total[-9] == str(snapshot.routed_rows)
        assert total[-4] == str(snapshot.recent_hits)
        assert total[-3] == f"{snapshot.recent_wasted_bytes / 2**20:.1f}"
        assert total[-2] == f"{snapshot.cache_saved_bytes / 2**20:.1f}"
        layer_rows = [row.split() for row in rows if row.startswith("model.layers.")]
        assert all(row[-1] in {"off", "on", "always", "-"} or row[-2] in {"off", "on", "always"} for row in layer_rows)
        assert "<th>routed MiB</th>" in hf_prefetch.stats(model)._repr_html_()
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("recent", [False, True])
@pytest.mark.parametrize("family, cached", [("qwen3_moe", 4), ("gpt_oss", 3), ("qwen3_moe", 16)])
def test_an_expert_cache_gives_the_same_tokens_and_counts_hits(family, cached, recent):
    model = moe_model(family)
    reference = copy.deepcopy(model)
    ids = _ids(batch=2, length=5)
    want = _generate(reference, ids, do_sample=False, max_new_tokens=24)  # 2 tokens per decode forward: routes
    config = PrefetchConfig(**ROUTED, expert_cache=cached, recent_experts=recent)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        plan = hf_prefetch.get_state(model).plan
        experts = model.model.layers[1].mlp.experts
        row_bytes = sum(p.numel() * p.element_size() for p in experts.parameters()) // experts.num_experts
        assert plan.cache_bytes == 2 * min(cached, experts.num_experts) * row_bytes  # 2 streamed routed layers
        assert plan.device_bytes == plan.resident_bytes + plan.pool_bytes + plan.cache_bytes
        _same(_generate(model, ids, do_sample=False, max_new_tokens=24), want)
        stats = hf_prefetch.stats(model)
        assert stats.cache_hits > 0 and stats.misses == 0
        if cached >= experts.num_experts:  # every expert cached: nothing routed crosses the link, nor is fetched
            assert stats.cache_misses == 0 and stats.routed_bytes == 0 and stats.recent_hits == 0
        elif not recent:
            assert stats.cache_misses > 0 and stats.routed_bytes == stats.cache_misses * row_bytes
            assert stats.recent_hits == 0
        else:  # rows fetched ahead count as routed rows, picked again (recent hits) or not
            assert stats.recent_hits > 0 and stats.routed_rows >= stats.cache_misses
            assert stats.routed_bytes == stats.routed_rows * row_bytes
    finally:
        hf_prefetch.remove_offload(model)


def test_the_expert_cache_follows_new_weights_after_a_reload(tmp_path):
    model = moe_model("qwen3_moe", seed=0)
    new = moe_model("qwen3_moe", seed=5)
    new.save_pretrained(tmp_path)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=8), device="cpu")
    try:
        with torch.no_grad():
            for length in (1, 2, 1):
                model(_ids(length=length, seed=length))  # the cache fills with the old weights
            hf_prefetch.reload_weights(model, tmp_path)
            for length in (1, 2, 7, 1):
                ids = _ids(length=length, seed=length)
                assert torch.equal(model(ids).logits, new(ids).logits)
        assert hf_prefetch.stats(model).cache_hits > 0
    finally:
        hf_prefetch.remove_offload(model)


def _picks_of(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    # How often the router of `layer` picks each expert in a forward of the unmodified `model` over `ids`.
    experts = model.model.layers[layer].mlp.experts
    seen = []
    handle = experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].reshape(-1)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return torch.bincount(torch.cat(seen), minlength=experts.num_experts)


def test_a_prefill_ranks_the_cache_and_only_a_clear_winner_takes_a_row():
    model = moe_model("qwen3_moe")  # 16 experts; layers 1 and 3 stream (ring positions 0 and 1)
    reference = copy.deepcopy(model)
    prompt = _ids(length=9, seed=3)
    prefill_picks = _picks_of(reference, 3, prompt)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    try:
        cache = hf_prefetch.get_state(model).engine.rings[0].layers[1].cache
        with torch.no_grad():
            assert torch.equal(model(prompt).logits, reference(prompt).logits)  # a whole forward: picks counted
            assert not cache.valid and torch.equal(cache.picks, prefill_picks)
            ids = _ids(length=1, seed=4)
            assert torch.equal(model(ids).logits, reference(ids).logits)  # the first routing forward loads it
        ranked = sorted(range(16), key=lambda e: (-int(prefill_picks[e]), e))[:4]
        assert cache.valid and cache.experts == ranked
        assert cache.scores == [float(n) for n in prefill_picks.tolist()]
        for expert in range(16):  # the device lookup finds exactly the cached experts, in their rows
            row = cache.experts.index(expert) if expert in cache.experts else -1
            assert int(cache.slot_of[expert]) == row
        wanted = dict(reference.model.layers[3].mlp.experts.named_parameters())
        layer = hf_prefetch.get_state(model).engine.rings[0].layers[1]
        for tensor, cached in zip(layer.routed, cache.tensors, strict=True):
            (name,) = [n for n, p in wanted.items() if p.shape == tensor.host.shape]
            for row, expert in enumerate(cache.experts):  # each row holds its expert's weights
                assert torch.equal(cached[row], wanted[name][expert])
    finally:
        hf_prefetch.remove_offload(model)


def test_the_re_rank_swaps_an_expert_only_for_one_scored_more_than_twice_as_high_and_beyond_noise():
    from hf_prefetch.runtime.experts import _reranked

    model = moe_model("qwen3_moe")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    try:
        cache = hf_prefetch.get_state(model).engine.rings[0].layers[1].cache
        cache.scores = [100.0, 10.0, 50.0, 4.0, 30.0, 19.0, 9.0] + [0.0] * 9
        assert _reranked(cache) == [0, 2, 4, 5]  # not valid: the best four
        cache.experts, cache.valid = [0, 1, 2, 3], True
        # Expert 4 (30) beats expert 3 (4) by more than twice; expert 5 (19) does not beat expert 1 (10).
        assert _reranked(cache) == [0, 1, 2, 4]
        # Three times as high, but 3 picks against 1 is within counting noise (2 standard deviations: 4): no trade.
        cache.scores = [100.0, 10.0, 50.0, 1.0, 3.0] + [0.0] * 11
        assert _reranked(cache) == [0, 1, 2, 3]
        cache.scores = [0.0] * 16
        assert _reranked(cache) == [0, 1, 2, 3]  # nothing picked: nothing moves
        cache.scores = [1.0] * 4 + [1.9] * 12
        assert _reranked(cache) == [0, 1, 2, 3]  # near-equal scores do not trade rows
    finally:
        hf_prefetch.remove_offload(model)


def test_decode_re_ranks_every_refresh_and_stays_bitwise():
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4, recent_experts=False), device="cpu")
    try:
        engine = hf_prefetch.get_state(model).engine
        cache = engine.rings[0].layers[1].cache
        picks = torch.zeros(16, dtype=torch.long)
        with torch.no_grad():
            for step in range(cache.REFRESH + 1):
                ids = _ids(length=1, seed=100 + step)
                picks += _picks_of(reference, 3, ids)
                assert torch.equal(model(ids).logits, reference(ids).logits)
        # The first forward loaded it (nothing counted yet: experts 0-3); REFRESH forwards later the picks of the
        # first REFRESH forwards were read and halved history added.
        last = _picks_of(reference, 3, _ids(length=1, seed=100 + cache.REFRESH))
        assert torch.equal(cache.picks, last)
        assert cache.scores == [float(n) for n in (picks - last).tolist()]
        stats = hf_prefetch.stats(model)
        # Every pick of both streamed layers, but layer 1's in the first forward (copied whole before it: no gather).
        top_k = model.config.num_experts_per_tok
        assert stats.cache_hits + stats.cache_misses == top_k * (2 * (cache.REFRESH + 1) - 1)
        assert stats.routed_rows == stats.cache_misses > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_a_budget_spends_spare_memory_on_the_expert_cache():
    from hf_prefetch.planning.placements import expert_row_bytes

    model = moe_model("qwen3_moe")
    budget = dict(max_memory={0: 1_400_000}, reserve_bytes=0, device="cpu")
    base = hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1, expert_cache=0), **budget)
    plan = hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1), **budget)  # the default: expert_cache=None
    assert plan.rings == base.rings and base.cached_experts == 0
    spare = 1_400_000 - base.device_bytes
    assert plan.cached_experts == spare // expert_row_bytes(plan.rings) > 0
    assert base.device_bytes < plan.device_bytes <= 1_400_000
    assert plan.streamed_bytes_per_token < base.streamed_bytes_per_token  # expected hits
    assert "expert cache" in str(plan)
    # An explicit cache must fit with the streamed layers, or the error says it takes the room.
    with pytest.raises(ValueError, match="expert_cache=16 keeps 16 experts of every streamed layer"):
        hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1, expert_cache=16), **budget)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_a_cached_pick_is_read_from_its_cache_row_and_the_others_from_host_memory(device):
    # Cache rows marked with values no host row has: the slot's rows show where each pick was read from.
    from hf_prefetch.runtime.experts import collect_tallies, gather_looked_up, load_cache

    model = moe_model("qwen3_moe").to(torch.bfloat16)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device=device)
    try:
        layer = hf_prefetch.get_state(model).engine.rings[0].layers[1]
        cache = layer.cache
        with torch.no_grad():
            load_cache(layer, [5, 9, 2, 14], non_blocking=False)
            for tensor in cache.tensors:
                for row in range(4):
                    tensor[row].fill_(1000.0 + row)
            index = torch.tensor([[9, 3], [14, 9], [0, 15]], device=device)  # 9 twice, 3 of 6 picks cached
            gather_looked_up(layer, index)
        collect_tallies([layer])
        assert (layer.counters.cache_hits, layer.counters.cache_misses) == (3, 3)
        assert layer.counters.routed_rows == 3
        for tensor in layer.routed:
            for expert in (3, 0, 15):
                assert torch.equal(tensor.device[expert].cpu(), tensor.host[expert])
            for expert, row in ((9, 1), (14, 3)):
                assert torch.all(tensor.device[expert] == 1000.0 + row)
        assert cache.picks[9] == 2 and int(cache.picks.sum()) == 6
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_an_interrupt_while_the_cache_loads_leaves_no_row_found_for_another_expert():
    from hf_prefetch.runtime.experts import load_cache

    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    try:
        layer = hf_prefetch.get_state(model).engine.rings[0].layers[1]
        with torch.no_grad():
            model(_ids(length=1))
        assert layer.cache.valid and layer.cache.experts == [0, 1, 2, 3]
        real_copy, calls = torch.Tensor.copy_, {"n": 0}

        def interrupted(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:  # the lookup's update, row 0's two tensors, then row 1's first
                raise KeyboardInterrupt
            return real_copy(self, *args, **kwargs)

        torch.Tensor.copy_ = interrupted
        try:
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                load_cache(layer, [10, 11, 2, 3], non_blocking=False)
        finally:
            torch.Tensor.copy_ = real_copy
        assert not layer.cache.valid  # rows half rewritten: not trusted
        found = {e: int(layer.cache.slot_of[e]) for e in range(16) if layer.cache.slot_of[e] >= 0}
        assert found == {2: 2, 3: 3}  # the rows that keep their expert; none of the rows being rewritten
        with torch.no_grad():
            for length in (1, 2, 1):
                ids = _ids(length=length, seed=length)
                assert torch.equal(model(ids).logits, reference(ids).logits)
        assert layer.cache.valid
        assert sorted(int(layer.cache.slot_of[e]) for e in layer.cache.experts) == [0, 1, 2, 3]
    finally:
        hf_prefetch.remove_offload(model)


class _TwoExpertBlocks(torch.nn.Module):
    """A layer with two experts modules of different sizes (num_experts 8 and 16)."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        super().__init__()
        first, second = copy.deepcopy(config), copy.deepcopy(config)
        first.num_experts, second.num_experts = 8, 16
        self.a = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(first)
        self.b = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(second)

    def forward(self, hidden_states):
        return self.a(hidden_states) + self.b(hidden_states)


@pytest.mark.parametrize("cached", [0, 4, 12])
def test_a_layer_with_two_experts_modules_routes_each_and_gets_no_cache(cached):
    model = moe_model("qwen3_moe")
    torch.manual_seed(3)
    for layer in model.model.layers:
        layer.mlp = _TwoExpertBlocks(model.config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 1.0)
            elif "experts" in name:  # the new blocks' experts are uninitialised
                param.normal_(0, 0.05)
    model.eval()
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=cached), device="cpu")
    try:
        state = hf_prefetch.get_state(model)
        assert state.plan.cache_bytes == 0  # one cache per layer holds one experts module's experts
        assert all(layer.cache is None for ring in state.engine.rings for layer in ring.layers)
        with torch.no_grad():
            for step in range(12):
                ids = _ids(length=1 + step % 3, seed=step)
                assert torch.equal(model(ids).logits, reference(ids).logits)
        assert hf_prefetch.stats(model).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_cache_loads_are_counted_and_a_cache_larger_than_the_experts_is_capped():
    model = moe_model("qwen3_moe")  # 16 experts
    capped = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, expert_cache=1000))
    exact = hf_prefetch.plan(model, PrefetchConfig(**ROUTED, expert_cache=16))
    assert capped.cache_bytes == exact.cache_bytes > 0 and capped.device_bytes == exact.device_bytes
    from hf_prefetch.planning.placements import cache_bytes  # what the budget planner adds for an explicit cache

    assert cache_bytes(capped.rings, 1000) == exact.cache_bytes
    assert "expert cache" in str(capped) and "+ expert cache)" in str(capped)
    never = hf_prefetch.plan(model, PrefetchConfig(**{**ROUTED, "routed_max_tokens": 0}, expert_cache=8))
    assert never.cached_experts == 0 and never.cache_bytes == 0  # no forward routes: no cache
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    try:
        with torch.no_grad():
            model(_ids(length=1))
        stats = hf_prefetch.stats(model)
        experts = model.model.layers[1].mlp.experts
        row_bytes = sum(p.numel() * p.element_size() for p in experts.parameters()) // experts.num_experts
        loaded = sum(
            layer.counters.cache_loaded_bytes for layer in hf_prefetch.get_state(model).engine.rings[0].layers
        )
        assert loaded == 2 * 4 * row_bytes  # both streamed layers' caches filled before the first routing forward
        assert stats.copied_bytes >= loaded + stats.routed_bytes
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_from_pretrained_routes_experts_read_straight_from_the_checkpoint(family, tmp_path):
    model = moe_model(family, experts_implementation="grouped_mm")  # transformers' default, as the load gets
    model.save_pretrained(tmp_path)
    loaded = hf_prefetch.from_pretrained(tmp_path, PrefetchConfig(**ROUTED), device="cpu")
    try:
        assert hf_prefetch.get_state(loaded).plan.routed_bytes > 0
        ids = _ids()
        _same(_generate(loaded, ids, do_sample=False), _generate(model, ids, do_sample=False))
        assert hf_prefetch.stats(loaded).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(loaded)


def test_from_pretrained_with_a_budget_streams_only_the_experts(tmp_path):
    model = moe_model("qwen3_moe", experts_implementation="grouped_mm")  # transformers' default, as the load gets
    model.save_pretrained(tmp_path)
    budget = dict(max_memory={0: 1_000_000, "cpu": 10**9}, reserve_bytes=0, device="cpu")
    loaded = hf_prefetch.from_pretrained(tmp_path, PrefetchConfig(prefetch_step=1), **budget)
    try:
        plan = hf_prefetch.get_state(loaded).plan
        assert plan.config.offload_params == {"experts"} and plan.rings[0].streamed
        ids = _ids(batch=2)
        _same(_generate(loaded, ids), _generate(model, ids))
    finally:
        hf_prefetch.remove_offload(loaded)


def test_a_deleted_routed_model_frees_its_engine_and_cache_without_remove_offload():
    import gc
    import weakref

    model = moe_model("qwen3_moe")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    with torch.no_grad():
        model(_ids(length=1))
    engine = hf_prefetch.get_state(model).engine
    refs = [
        weakref.ref(engine),
        *(weakref.ref(t) for r in engine.rings for layer in r.layers if layer.cache for t in layer.cache.tensors),
    ]
    assert len(refs) > 1
    del engine
    gc.disable()
    try:
        del model  # freed by reference counting: the hooks' cycles are broken by the journal's weak references
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "make, wide",
    [
        (lambda: torch.randn(4, 3, 4).bfloat16(), torch.int64),  # 24-byte rows
        (lambda: torch.randn(4, 1, 2).bfloat16(), torch.int32),  # 4-byte rows
        (lambda: torch.randn(4, 3, 3).bfloat16(), torch.bfloat16),  # 18-byte rows: as stored
        (lambda: torch.randn(4, 5, 3).transpose(1, 2), torch.float32),  # rows not dense in order: as stored
        (lambda: torch.randn(4, 2, 3), torch.int64),
    ],
)
def test_routed_rows_are_read_as_the_widest_elements_their_layout_allows(make, wide):
    from hf_prefetch.runtime.experts import copy_routed_rows
    from hf_prefetch.runtime.ring import LayerTransfer, RoutedTensor

    host = make()
    device = torch.zeros_like(host)
    tensor = RoutedTensor(host, host, device, num_experts=4)
    assert tensor.source_rows.dtype == tensor.device_rows.dtype == wide
    layer = LayerTransfer(host=[], device=[], slot=0, next_in_slot=0, nbytes=0, routed=[tensor])
    copy_routed_rows(layer, torch.tensor([[3, 1], [3, 3]]))
    assert torch.equal(device[[1, 3]], host[[1, 3]]) and not device[[0, 2]].any()
    assert layer.counters.routed_rows == 4 and layer.counters.routed_bytes == 4 * host[0].numel() * host.element_size()


def test_a_budget_streams_only_the_experts_when_that_moves_fewer_bytes_per_token():
    # Attention weights stay resident and a decoded token moves only its experts' rows: fewer bytes per token than
    # streaming whole layers (nearly: every segment of the layer but its norms) at the same budget.
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    budget = dict(max_memory={0: 1_000_000}, reserve_bytes=0, device="cpu")
    plan = hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1), **budget)
    layers = hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1, offload_params={"self_attn", "mlp"}), **budget)
    assert plan.config.offload_params == {"experts"} and plan.rings[0].streamed
    assert plan.streamed_bytes_per_token < layers.streamed_bytes_per_token
    for layer in plan.rings[0].streamed:
        assert {s.name for s in layer.params if s.placement is not Placement.RESIDENT} == {
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        }
    hf_prefetch.dispatch_model(model, PrefetchConfig(prefetch_step=1), **budget)
    try:
        assert hf_prefetch.get_state(model).plan.config.offload_params == {"experts"}
        ids = _ids(batch=2, length=5)
        _same(_generate(model, ids, max_new_tokens=8), _generate(reference, ids, max_new_tokens=8))
        assert hf_prefetch.stats(model).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "config, why",
    [
        (PrefetchConfig(prefetch_step=1, routed_experts=False), "expert tensors stream whole"),
        (PrefetchConfig(prefetch_step=1, routed_max_tokens=0), "no forward routes"),
        (PrefetchConfig(prefetch_step=1, offload_params={"self_attn", "mlp"}), "the caller chose the parameters"),
    ],
)
def test_the_experts_only_selection_is_not_made_when_routing_is_off_or_parameters_are_given(config, why):
    model = moe_model("qwen3_moe")
    plan = hf_prefetch.plan(model, config, max_memory={0: 1_000_000}, reserve_bytes=0, device="cpu")
    assert plan.config.offload_params == config.offload_params, why


def test_a_budget_too_small_for_resident_attention_streams_whole_layers():
    model = moe_model("qwen3_moe")
    budget = dict(max_memory={0: 560_000}, reserve_bytes=0, device="cpu")
    with pytest.raises(ValueError):  # even the experts of every layer streamed leave too much resident
        hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1, offload_params={"experts"}), **budget)
    plan = hf_prefetch.plan(model, PrefetchConfig(prefetch_step=1), **budget)
    assert plan.config.offload_params == frozenset()
    assert any("self_attn" in s.name for s in plan.rings[0].streamed[0].params if s.placement is Placement.STREAMED)


def test_without_routing_forwards_a_token_is_counted_as_a_whole_forward():
    model = moe_model("qwen3_moe")
    plan = hf_prefetch.plan(model, PrefetchConfig(**{**ROUTED, "routed_max_tokens": 0}), device="cpu")
    assert plan.routed_bytes > 0 and plan.streamed_bytes_per_token == plan.streamed_bytes_per_forward
    assert "copied whole in every forward (routed_max_tokens=0)" in str(plan) and "per token" not in str(plan)
    routed = hf_prefetch.plan(model, PrefetchConfig(**ROUTED), device="cpu")
    assert routed.streamed_bytes_per_token < routed.streamed_bytes_per_forward


def test_the_prefetch_step_hint_of_a_budget_error_counts_an_explicit_cache():
    from hf_prefetch.planning.offload_plan import format_bytes

    model = moe_model("qwen3_moe")

    def fits(budget: int, step: int) -> bool:
        try:
            config = PrefetchConfig(prefetch_step=step, expert_cache=2)
            hf_prefetch.plan(model, config, max_memory={0: budget}, reserve_bytes=0, device="cpu")
        except ValueError:
            return False
        return True

    low, high = 1, 4_000_000
    while low < high:  # the smallest budget prefetch_step=1 fits
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle, 1) else (middle + 1, high)
    with pytest.raises(ValueError, match=rf"prefetch_step=1 needs {re.escape(format_bytes(low))} in all"):
        hf_prefetch.plan(
            model, PrefetchConfig(prefetch_step=2, expert_cache=2), max_memory={0: low}, reserve_bytes=0, device="cpu"
        )


# --- Recent experts: the latest forward's picks, fetched with the next routing copy ---------------------------------


def _router_picks(model, layer: int, ids: torch.Tensor) -> list[int]:
    # The experts the router of `layer` picks, in order, in a forward of `model` over `ids`.
    experts = model.model.layers[layer].mlp.experts
    seen = []
    handle = experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].reshape(-1).tolist()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen[0]


def test_each_layer_remembers_its_latest_picks_and_its_next_copy_fetches_them():
    model = moe_model("qwen3_moe")  # 16 experts, 4 per token; layers 1 and 3 take turns in one slot
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, recent_experts=True), device="cpu")
    try:
        engine = hf_prefetch.get_state(model).engine
        first, second = engine.rings[0].layers
        ids = _ids(length=2, seed=4)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
        for layer, index in ((first, 1), (second, 3)):
            picks = _router_picks(reference, index, ids)
            assert layer.recent.count == len(picks) == 8
            assert layer.recent.experts[:8].tolist() == picks and set(layer.recent.experts[8:].tolist()) == {-1}
        # The end of the forward copied layer 1 again for the next one: with its latest picks, marked ready.
        wanted = set(_router_picks(reference, 1, ids))
        assert {e for e in range(16) if first.recent.ready[e]} == wanted
        for tensor in first.routed:
            for expert in wanted:
                assert torch.equal(tensor.device[expert], tensor.host[expert])
        stats = hf_prefetch.stats(model)
        assert stats.layers[0].routed_rows == len(wanted)  # the fetch brings and counts each expert's rows once
        with torch.no_grad():  # a single token repeats some of them: those are found, the rest copied at the router
            ids = _ids(length=1, seed=4)
            assert torch.equal(model(ids).logits, reference(ids).logits)
        again = set(_router_picks(reference, 1, ids))
        layer_1 = hf_prefetch.stats(model).layers[0]
        assert layer_1.recent_hits == len(again & wanted) and layer_1.routed_picks == 4  # whole in the first forward
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
@pytest.mark.parametrize("cached", [0, 4])
def test_a_fetched_pick_is_left_in_the_slot_and_a_cached_one_is_not_fetched(device, cached):
    # Slot rows marked with values no host row has: after the fetch and the gather, each row shows where it came from.
    from hf_prefetch.runtime.experts import collect_tallies, fetch_recent, gather_looked_up, load_cache

    model = moe_model("qwen3_moe").to(torch.bfloat16)
    config = PrefetchConfig(**ROUTED, expert_cache=cached, recent_experts=True)
    hf_prefetch.dispatch_model(model, config, device=device)
    try:
        layer = hf_prefetch.get_state(model).engine.rings[0].layers[1]
        recent = layer.recent
        with torch.no_grad():
            if cached:
                load_cache(layer, [5, 9, 2, 14], non_blocking=False)
            collect_tallies([layer])
            layer.counters = type(layer.counters)()
            for tensor in layer.routed:
                tensor.device.fill_(-7.0)
            recent.experts.fill_(-1)
            recent.experts[:5] = torch.tensor([3, 9, 16, 3, 11])  # 16: not an expert of the layer (a sentinel)
            recent.count, recent.ready[0] = 5, 1  # a stale mark the fetch must clear
            fetch_recent(layer)
            fetched = {3, 11} if cached else {3, 9, 11}  # a cached expert is not fetched
            assert {e for e in range(16) if recent.ready[e]} == fetched
            for tensor in layer.routed:
                for expert in range(16):
                    want = tensor.host[expert] if expert in fetched else torch.full_like(tensor.host[expert], -7.0)
                    assert torch.equal(tensor.device[expert].cpu(), want)
                tensor.device[3].fill_(1000.0)  # found ready at the router: must stay as it is
            gather_looked_up(layer, torch.tensor([[3, 9], [0, 11]], device=device))
        collect_tallies([layer])
        c = layer.counters
        assert c.recent_hits == (2 if cached else 3) and c.routed_picks == 4
        assert (c.cache_hits, c.cache_misses) == ((1, 1) if cached else (0, 0))
        # Fetched once each (3 is listed twice): 3, 9 unless cached, 11; copied at the router: expert 0.
        assert c.routed_rows == (2 if cached else 3) + 1
        for tensor in layer.routed:
            assert torch.all(tensor.device[3] == 1000.0)
            for expert in (0, 9, 11):
                assert torch.equal(tensor.device[expert].cpu(), tensor.host[expert])
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_a_miss_clears_what_an_older_copy_fetched():
    # Layer 1's slot is taken from it after its copy fetched its picks, and its rows overwritten: it runs as a miss,
    # whose copy brings no routed rows, so nothing may be found ready from before.
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, recent_experts=True), device="cpu")
    try:
        engine = hf_prefetch.get_state(model).engine
        first = engine.rings[0].layers[0]
        with torch.no_grad():
            ids = _ids(length=1, seed=2)
            model(ids)  # the end of the forward fetched layer 1's picks into the slot
            assert int(first.recent.ready.sum()) > 0
            engine.invalidate(0, 0)
            for tensor in first.routed:
                tensor.device.fill_(1000.0)
            assert torch.equal(model(ids).logits, reference(ids).logits)  # the same picks again
        assert hf_prefetch.stats(model).misses == 1
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recent_experts_on_and_off_give_the_same_tokens(family):
    model = moe_model(family)
    reference = copy.deepcopy(model)
    ids = _ids(batch=2, length=5)
    want = _generate(reference, ids, do_sample=False, max_new_tokens=12)
    for recent in (True, False):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, recent_experts=recent), device="cpu")
        try:
            _same(_generate(model, ids, do_sample=False, max_new_tokens=12), want)
            engine = hf_prefetch.get_state(model).engine
            layers = [layer for ring in engine.rings for layer in ring.layers if layer.routed]
            assert all((layer.recent is not None) == recent for layer in layers)
            assert (hf_prefetch.stats(model).recent_hits > 0) == recent
        finally:
            hf_prefetch.remove_offload(model)


def test_recent_experts_must_be_a_bool():
    with pytest.raises(ValueError, match=r"recent_experts='yes' must be None \(measured per layer\), True or False"):
        PrefetchConfig(recent_experts="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_expert_that_enters_the_cache_during_a_fetch_is_fetched_whole_or_not_marked():
    # `prepare` may load the cache on the compute stream while a fetch issued before it runs on the copy stream. Expert
    # 5 enters the cache at delays swept across the fetch: every expert marked ready must have all its rows fetched.
    import types

    from hf_prefetch.host.arena import HostArena
    from hf_prefetch.runtime.expert_kernels import TALLIES
    from hf_prefetch.runtime.expert_policy import RecentPolicy
    from hf_prefetch.runtime.experts import fetch_recent
    from hf_prefetch.runtime.ring import LayerTransfer, RecentPicks, RoutedTensor

    device = torch.device("cuda", torch.cuda.current_device())
    experts, row = 16, 1 << 20  # two routed tensors of 8 MiB rows
    arena = HostArena([experts * row * 8, experts * row * 8])
    assert arena.pin()
    mapped = arena.map(device)
    hosts = [arena.view(i, (experts, row), (row, 1), torch.int64) for i in range(2)]
    for number, host in enumerate(hosts):
        host.copy_((torch.arange(experts) * 10 + number + 1)[:, None].expand(experts, row))
    slots = [torch.empty(experts, row, dtype=torch.int64, device=device) for _ in hosts]
    routed = [RoutedTensor(h, arena.mapped_like(h, mapped), s, experts) for h, s in zip(hosts, slots, strict=True)]
    layer = LayerTransfer([], [], 0, 1, 0, routed)
    layer.cache = types.SimpleNamespace(slot_of=torch.full((experts,), -1, dtype=torch.long, device=device))
    layer.recent = RecentPicks(
        torch.full((experts,), -1, dtype=torch.long, device=device),
        torch.zeros(experts, dtype=torch.int32, device=device),
        torch.full((experts,), -1, dtype=torch.long, device=device),
        marked=torch.zeros(experts, dtype=torch.int32, device=device),
        enabled=torch.ones(1, dtype=torch.int32, device=device),  # fetching
        policy=RecentPolicy(fixed=True, on=True),
    )
    layer.tallies = torch.zeros(TALLIES, dtype=torch.long, device=device)
    layer.recent.experts[:4] = torch.tensor([3, 5, 7, 9])
    layer.recent.count = 4
    copy_stream = torch.cuda.Stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(copy_stream):
        fetch_recent(layer)  # compiles the kernel
        begin.record()
        fetch_recent(layer)
        end.record()
    torch.cuda.synchronize()
    fetch_ms = begin.elapsed_time(end)
    begin.record()
    torch.cuda._sleep(10**6)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10**6 / begin.elapsed_time(end)
    for trial in range(40):
        for slot in slots:
            slot.fill_(-7)
        layer.cache.slot_of.fill_(-1)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(cycles_per_ms * fetch_ms * 1.3 * trial / 40))  # the compute stream: a late `prepare`
        layer.cache.slot_of[5:6].fill_(0)
        with torch.cuda.stream(copy_stream):
            fetch_recent(layer)
        torch.cuda.synchronize()
        for expert in layer.recent.ready.nonzero().flatten().tolist():
            for number, slot in enumerate(slots):
                assert torch.all(slot[expert] == 10 * expert + number + 1), (trial, expert, number)
    arena.release()


def test_the_plan_says_which_layers_fetch_their_recent_experts():
    model = moe_model("qwen3_moe")  # layers 1 and 3 stream, taking turns in one slot
    shown = str(hf_prefetch.plan(model, PrefetchConfig(**ROUTED, recent_experts=True), device="cpu"))
    assert "recent experts" in shown and "2 layers fetch the experts they picked in their previous forward" in shown
    measured = str(hf_prefetch.plan(model, PrefetchConfig(**ROUTED), device="cpu"))
    assert "2 layers measure whether fetching the experts they picked in their previous forward" in measured
    assert "recent experts" not in str(
        hf_prefetch.plan(model, PrefetchConfig(**ROUTED, recent_experts=False), device="cpu")
    )
    # A layer alone in its slot is copied whole once: it fetches nothing.
    alone = hf_prefetch.plan(model, PrefetchConfig(**{**ROUTED, "prefetch_step": 2}), device="cpu")
    assert "recent experts" not in str(alone)


def test_a_fetch_reads_as_many_recent_picks_as_the_forward_under_way_records():
    # A CUDA-graph replay records its picks without Python, so `recent.count` may be that of an older forward: a copy
    # during a forward of 2 tokens reads the entries of 2 tokens' picks all the same. Simulated on the CPU by writing 8
    # picks behind a count of 4; the entries past the picks are -1 and fetch nothing.
    from hf_prefetch.runtime.experts import fetch_recent

    model = moe_model("qwen3_moe")  # 16 experts, 4 per token
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, recent_experts=True), device="cpu")
    try:
        layer = hf_prefetch.get_state(model).engine.rings[0].layers[1]
        with torch.no_grad():
            model(_ids(length=1, seed=3))  # records 4 picks per layer, top_k 4
        recent = layer.recent
        assert (recent.count, recent.top_k) == (4, 4)
        recent.experts[:8] = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
        fetch_recent(layer)
        assert {e for e in range(16) if recent.ready[e]} == {0, 1, 2, 3}
        fetch_recent(layer, tokens=2)
        assert {e for e in range(16) if recent.ready[e]} == {0, 1, 2, 3, 8, 9, 10, 11}
        for tensor in layer.routed:
            for expert in (8, 9, 10, 11):
                assert torch.equal(tensor.device[expert], tensor.host[expert])
        fetch_recent(layer, tokens=3)  # entries 8-11 are -1
        assert int(recent.ready.sum()) == 8
    finally:
        hf_prefetch.remove_offload(model)


def test_sync_from_device_writes_expert_tensors_back_only_from_a_whole_slot_and_says_so():
    # After a forward that routed, a layer's expert tensors in its slot hold the picked experts' rows: the layer is
    # written back without them, with a warning naming them (an edit of them is lost); after a forward of many tokens
    # (a whole copy) the same edit is written back.
    model = moe_model("qwen3_moe")
    config = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4, expert_cache=0)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        with torch.no_grad():
            model(torch.tensor([[5]]))  # routes; layer 1 is then copied for the next forward, routing too
        experts, attention = model.model.layers[1].mlp.experts, model.model.layers[1].self_attn.q_proj
        before = model.state_dict()
        with torch.no_grad():
            experts.down_proj.mul_(2.0)
            attention.weight.mul_(2.0)
        edited_attention = attention.weight.detach().clone()
        with pytest.warns(UserWarning, match=r"model\.layers\.1 without their expert tensors \(.*down_proj\)"):
            assert "model.layers.1" in hf_prefetch.sync_from_device(model)
        after = model.state_dict()
        assert torch.equal(after["model.layers.1.self_attn.q_proj.weight"], edited_attention)
        key = "model.layers.1.mlp.experts.down_proj"
        assert torch.equal(after[key], before[key])  # the host's values stay
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 9)))  # a whole forward: layer 1 is copied whole for the next one
            experts.down_proj.mul_(2.0)
        edited = experts.down_proj.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "model.layers.1" in hf_prefetch.sync_from_device(model)
        assert torch.equal(model.state_dict()["model.layers.1.mlp.experts.down_proj"], edited)
    finally:
        hf_prefetch.remove_offload(model)
