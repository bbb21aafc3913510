"""The measured recent-experts policy (hf_prefetch/runtime/expert_policy.py) and the expert cache's trades, on routing
the test controls (tests/routing.py): decisions per layer, bytes against the router's own picks, tokens bitwise
equal to the model's own."""

import copy

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.runtime.expert_policy import OFF_WASTE, ON_WASTE, WINDOW, RecentPolicy
from tests.models import assert_same_generation, generate_with_logits
from tests.moe_models import VOCAB, moe_model
from tests.routing import REGIMES, control_routing

# Layers 1 and 3 stream, taking turns in one slot; a forward of up to 4 tokens routes.
ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)
DECODE = 5 * WINDOW  # new tokens: five decisions
ROUTER_ONLY = PrefetchConfig(**ROUTED, recent_experts=False, expert_cache=0)


def _prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))


def _decode(family: str, regimes, config: PrefetchConfig | None, tokens: int = DECODE):
    """Greedy decode of `family` under controlled routing: undispatched (config None), or dispatched with `config`;
    (the generation, the streamed layers' transfers and stats, or None)."""
    model = moe_model(family)
    control_routing(model, regimes)
    if config is None:
        return generate_with_logits(model, _prompt(), max_new_tokens=tokens), None
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        out = generate_with_logits(model, _prompt(), max_new_tokens=tokens)
        return out, (hf_prefetch.get_state(model).engine.rings[0].layers, hf_prefetch.stats(model))
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_the_default_moves_at_most_a_twentieth_more_than_the_router_alone(family, regime):
    reference, _ = _decode(family, regime, None)
    default, (layers, stats) = _decode(family, regime, PrefetchConfig(**ROUTED))
    router_only, (_, router_stats) = _decode(family, regime, ROUTER_ONLY)
    assert_same_generation(default, reference)
    assert_same_generation(router_only, reference)
    assert stats.misses == 0 and stats.routed_picks == router_stats.routed_picks > 0
    assert stats.copied_bytes <= (1 + OFF_WASTE) * router_stats.copied_bytes, (
        stats.copied_bytes / router_stats.copied_bytes
    )
    decisions = {layer.recent.policy.on for layer in layers}
    if regime == "sticky":  # every fetched row picked again: fetched ahead, for no extra byte
        assert decisions == {True} and stats.recent_hits > 0
        # The only rows not picked again: those fetched for a forward that never came (after the last token).
        fetched = sum(layer.recent_fetched for layer in stats.layers)
        assert fetched - stats.recent_hits <= len(layers) * moe_model(family).config.num_experts_per_tok
    if regime == "random":  # top_k of num_experts picked again at random: never pays
        assert decisions == {False}
        assert stats.copied_bytes == router_stats.copied_bytes and stats.recent_hits == 0
    assert all(layer.recent_policy.split()[0] in {"on:", "off:"} for layer in stats.layers)


def test_forwards_of_several_tokens_count_each_fetched_expert_once():
    # A batch of 4 prompts: every decode forward routes 4 tokens, which may pick one expert several times. The fetch
    # brings each expert once and a hit counts once, so random routing stays off and moves the router's bytes.
    def run(config):
        model = moe_model("qwen3_moe")
        control_routing(model, "random")
        ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
        if config is None:
            return generate_with_logits(model, ids, max_new_tokens=DECODE), None
        hf_prefetch.dispatch_model(model, config, device="cpu")
        try:
            out = generate_with_logits(model, ids, max_new_tokens=DECODE)
            return out, (hf_prefetch.get_state(model).engine.rings[0].layers, hf_prefetch.stats(model))
        finally:
            hf_prefetch.remove_offload(model)

    reference, _ = run(None)
    default, (layers, stats) = run(PrefetchConfig(**ROUTED))
    _, (_, router_stats) = run(ROUTER_ONLY)
    assert_same_generation(default, reference)
    assert [layer.recent.policy.on for layer in layers] == [False, False]
    assert all(0 <= layer.recent.policy.hit_rate <= 1 for layer in layers)
    assert stats.copied_bytes <= (1 + OFF_WASTE) * router_stats.copied_bytes
    # Always fetching: each expert's rows once per fetch, however many of the 4 tokens picked it.
    _, (layers, always) = run(PrefetchConfig(**ROUTED, recent_experts=True))
    assert all(layer.recent_fetched <= 16 * DECODE for layer in always.layers)
    assert all(layer.recent.policy.hit_rate <= 1 for layer in layers)


def test_layers_decide_each_for_itself():
    # Layer 1 (streamed) picks the same experts every token, layer 3 (streamed) at random.
    regimes = ["random", "sticky", "random", "random"]
    reference, _ = _decode("qwen3_moe", regimes, None)
    out, (layers, stats) = _decode("qwen3_moe", regimes, PrefetchConfig(**ROUTED))
    assert_same_generation(out, reference)
    assert [layer.recent.policy.on for layer in layers] == [True, False]
    sticky, varied = stats.layers
    assert sticky.recent_policy.startswith("on: 100% of fetched rows picked again")
    assert varied.recent_policy.startswith("off: ") and varied.recent_fetched == 0
    table = str(stats)
    assert "wasted MiB" in table and "recent" in table.splitlines()[0]


def test_the_decision_follows_the_routing_when_it_changes():
    # Sticky, then random (a new prompt, sampling), then sticky again: on, off, on; tokens as the model's own.
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        layers = hf_prefetch.get_state(model).engine.rings[0].layers
        seen = []
        for seed, regime in enumerate(["sticky", "random", "sticky"]):
            controls = [control_routing(model, regime, device="cpu"), control_routing(reference, regime)]
            try:
                out = generate_with_logits(model, _prompt(seed), max_new_tokens=DECODE)
                assert_same_generation(out, generate_with_logits(reference, _prompt(seed), max_new_tokens=DECODE))
            finally:
                for control in controls:
                    control.remove()
            seen.append([layer.recent.policy.on for layer in layers])
        assert seen == [[True, True], [False, False], [True, True]]
        assert all(layer.recent.policy.switches == 3 for layer in layers)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sticky_routing_with_an_expert_cache_moves_at_most_half_the_router_alone(family):
    top_k = moe_model(family).config.num_experts_per_tok
    reference, _ = _decode(family, "sticky", None)
    cached, (_, stats) = _decode(family, "sticky", PrefetchConfig(**ROUTED, expert_cache=top_k))
    _, (_, router_stats) = _decode(family, "sticky", ROUTER_ONLY)
    assert_same_generation(cached, reference)
    # The experts' bytes (the rest of each streamed layer crosses alike): picks copied, fetched, and the cache's loads.
    assert stats.routed_bytes + stats.cache_loaded_bytes <= 0.5 * router_stats.routed_bytes
    assert stats.cache_saved_bytes > 0 and stats.cache_hits > 0


@pytest.mark.parametrize("regime", ["random", "skewed", "drifting"])
def test_a_cache_the_user_sets_never_moves_more_than_the_router_alone(regime):
    # Loading the cache and trading its rows costs bytes: trades only on a score beyond counting noise keep them
    # under what the hits save, even where every expert is picked alike.
    reference, _ = _decode("qwen3_moe", regime, None)
    cached, (_, stats) = _decode("qwen3_moe", regime, PrefetchConfig(**ROUTED, expert_cache=4))
    _, (_, router_stats) = _decode("qwen3_moe", regime, ROUTER_ONLY)
    assert_same_generation(cached, reference)
    assert stats.copied_bytes <= router_stats.copied_bytes, stats.copied_bytes / router_stats.copied_bytes
    assert stats.cache_loaded_bytes < stats.cache_saved_bytes


def test_recent_experts_true_always_fetches_and_still_measures():
    reference, _ = _decode("qwen3_moe", "random", None)
    out, (layers, stats) = _decode("qwen3_moe", "random", PrefetchConfig(**ROUTED, recent_experts=True))
    assert_same_generation(out, reference)
    assert all(layer.recent.policy.on and layer.recent.policy.fixed for layer in layers)
    assert all(layer.recent_policy.startswith("always: ") for layer in stats.layers)
    assert stats.recent_wasted_bytes > 0  # random picks: most fetched rows are not picked again


def test_compiled_decode_follows_the_policy():
    # Under torch.compile (on the CPU: no CUDA graphs) the fetch and the gather run as the hooks' custom ops, and the
    # decision is the same device flag.
    model = moe_model("qwen3_moe")
    control_routing(model, ["random", "sticky", "random", "random"])
    reference = torch.compile(copy.deepcopy(model), mode="default")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        compiled = torch.compile(model, mode="default")
        layers = hf_prefetch.get_state(model).engine.rings[0].layers
        ids = _prompt()
        with torch.no_grad():
            for _ in range(2 * WINDOW + 1):  # forwards of one token: each routes
                want, got = reference(ids).logits, compiled(ids).logits
                assert torch.equal(got, want)
                ids = got[:, -1:].argmax(-1)
        assert [layer.recent.policy.on for layer in layers] == [True, False]
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "counts, on",
    [
        ([(64, 64, 64)], True),  # every candidate picked again
        ([(64, 16, 64)], False),  # random: a quarter
        ([(64, 62, 64)], True),  # 3% extra rows: under ON_WASTE
        ([(64, 61, 64)], False),  # 4.7%: above ON_WASTE, stays off
        ([(1000, 955, 1000)], False),  # 4.5%: between the two, from off: stays off
        ([(1000, 1000, 1000), (1000, 930, 1000)], True),  # on, then 4.7% (decayed): between the two, stays on
        ([(64, 64, 64), (64, 50, 64)], False),  # on, then well above: off
        ([(0, 0, 0)], False),  # nothing measured: stays as it is
    ],
)
def test_the_rule_turns_on_under_one_share_and_off_above_another(counts, on):
    assert ON_WASTE < OFF_WASTE
    policy = RecentPolicy()
    for window in counts:
        policy.add(*window)
        policy.decide()
    assert policy.on is on
    fixed = RecentPolicy(fixed=True, on=True)
    fixed.add(64, 0, 64)
    assert not fixed.decide() and fixed.on


def test_recent_experts_true_without_routed_experts_says_it_changes_nothing():
    from tests.models import tiny_llama

    with pytest.warns(UserWarning, match=r"recent_experts=True\) changes nothing in this plan: no streamed parameter"):
        hf_prefetch.plan(tiny_llama(4), PrefetchConfig(recent_experts=True), device="cpu")
    model = moe_model("qwen3_moe")
    with pytest.warns(UserWarning, match=r"recent_experts=True\) changes nothing .* routed_max_tokens=0"):
        hf_prefetch.plan(
            model, PrefetchConfig(**{**ROUTED, "routed_max_tokens": 0}, recent_experts=True), device="cpu"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_graph_replays_follow_each_layers_decision(family):
    # Decoding compiled with CUDA graphs: the fetch in the graph reads the policy's flag at every replay, and the
    # decisions are made between replays. Layer 1 picks the same experts every token, layer 3 at random. Reference:
    # the same dispatch with routing off (whole expert tensors: the same ops, so the same fusions), compiled alike.
    from transformers import CompileConfig

    # grouped_mm, transformers' default: the eager implementation's loop over the picked experts breaks the graph.
    model = moe_model(family, experts_implementation="grouped_mm").to(torch.bfloat16).cuda().eval()
    control = control_routing(model, ["random", "sticky", "random", "random"], device="cuda")
    ids = _prompt().cuda()
    outputs, decisions = {}, None
    for name, limit in (("whole", 0), ("routed", 4)):
        hf_prefetch.dispatch_model(model, PrefetchConfig(**{**ROUTED, "routed_max_tokens": limit}), device="cuda")
        try:
            with torch.no_grad():
                outputs[name] = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=DECODE,
                    do_sample=False,
                    cache_implementation="static",
                    compile_config=CompileConfig(mode="reduce-overhead", fullgraph=False),
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            state = hf_prefetch.get_state(model)
            assert hf_prefetch.stats(model).misses == 0
            if name == "routed":
                assert state.engine.graphs
                decisions = [layer.recent.policy.on for layer in state.engine.rings[0].layers]
        finally:
            hf_prefetch.remove_offload(model, device="cuda")
            torch._dynamo.reset()
    control.remove()
    assert_same_generation(outputs["routed"], outputs["whole"])
    assert decisions == [True, False]


def test_the_cache_and_the_policy_count_their_windows_across_prompts(monkeypatch):
    # Generates of 8 tokens: 7 routing forwards each, fewer than a window. Both keep counting across prompts: after 21
    # routing forwards the cache loaded once and re-ranked once, and each policy decided once.
    from hf_prefetch.runtime import experts

    calls = []
    real = experts.refresh_caches
    monkeypatch.setattr(
        experts, "refresh_caches", lambda layers, non_blocking: calls.append(1) or real(layers, non_blocking)
    )
    model = moe_model("qwen3_moe")
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED, expert_cache=4), device="cpu")
    try:
        for seed in range(3):
            generate_with_logits(model, _prompt(seed), max_new_tokens=8)
        assert len(calls) == 2
        assert all(layer.recent.policy.decisions == 1 for layer in hf_prefetch.get_state(model).engine.rings[0].layers)
    finally:
        hf_prefetch.remove_offload(model)
