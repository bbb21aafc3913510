import dataclasses

import pytest
import torch
from torch import nn

from hf_prefetch import PrefetchConfig, Source, find_layer_lists
from hf_prefetch.host.arena import padded_bytes
from hf_prefetch.planning.layers import segment_matches
from hf_prefetch.planning.offload_plan import format_bytes
from hf_prefetch.planning.selection import make_plan
from tests.models import tiny_llama


@pytest.mark.parametrize(
    "num_layers, group_size, num_in_group, expected",
    [
        (16, 8, 2, [6, 7, 14, 15]),
        (8, 2, 1, [1, 3, 5, 7]),
        (8, 1, 1, list(range(8))),
        (8, 4, 4, list(range(8))),
        (9, 4, 1, [3, 7]),
        (10, 3, 2, [1, 2, 4, 5, 7, 8]),
        (4, 8, 2, []),
    ],
)
def test_group_selection(num_layers, group_size, num_in_group, expected):
    model = tiny_llama(num_layers)
    config = PrefetchConfig(group_size=group_size, num_in_group=num_in_group, prefetch_step=max(num_in_group, 1))
    plan = make_plan(model, config)
    assert [layer.index for layer in plan.rings[0].streamed] == expected


@pytest.mark.parametrize(
    "segments, name, matches",
    [
        ({"experts"}, "mlp.experts.w2_weight", True),
        ({"expert"}, "mlp.experts.w2_weight", False),
        ({"w2"}, "mlp.experts.w2_weight", False),
        ({"w2_weight"}, "mlp.experts.w2_weight", True),
        ({"w2_weight"}, "mlp.experts.w2_weight_scale", False),
        ({"experts.w2_weight"}, "mlp.experts.w2_weight", True),
        ({"mlp"}, "mlp.down_proj.weight", True),
        ({"down_proj"}, "mlp.down_proj.weight", True),
        ({"proj"}, "mlp.down_proj.weight", False),
        ({"weight"}, "mlp.down_proj.weight", True),
        (set(), "anything.at.all", True),
        ({"self_attn", "mlp"}, "input_layernorm.weight", False),
    ],
)
def test_segment_matching(segments, name, matches):
    assert segment_matches(frozenset(segments), name) is matches


@pytest.mark.parametrize(
    "num_streamed, prefetch_step, slots, next_in_slot",
    [
        (4, 2, [0, 1, 0, 1], [2, 3, 0, 1]),
        (4, 1, [0, 0, 0, 0], [1, 2, 3, 0]),
        (4, 4, [0, 1, 2, 3], [0, 1, 2, 3]),
        (3, 5, [0, 1, 2], [0, 1, 2]),
        # 5 layers, 2 slots: layer 4 uses slot 0 and hands it to layer 0 of the next forward; layer 3 (slot 1)
        # hands slot 1 to layer 1. No layer's slot is taken before it ran.
        (5, 2, [0, 1, 0, 1, 0], [2, 3, 4, 1, 0]),
        (7, 3, [0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 6, 1, 2, 0]),
    ],
)
def test_slot_assignment(num_streamed, prefetch_step, slots, next_in_slot):
    model = tiny_llama(num_streamed)
    plan = make_plan(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=prefetch_step))
    streamed = plan.rings[0].streamed
    assert [layer.slot for layer in streamed] == slots
    assert [layer.next_in_slot for layer in streamed] == next_in_slot
    assert plan.rings[0].num_slots == min(prefetch_step, num_streamed)


def _simulate_misses(slots, next_in_slot, num_slots, forwards=3):
    owners = [None] * num_slots
    misses = 0

    def prefetch(k):
        owners[slots[k]] = k

    for k in range(num_slots):
        prefetch(k)
    for _ in range(forwards):
        for k in range(len(slots)):
            if owners[slots[k]] != k:
                misses += 1
                owners[slots[k]] = k
            prefetch(next_in_slot[k])
    return misses


@pytest.mark.parametrize("num_streamed", range(1, 10))
@pytest.mark.parametrize("prefetch_step", range(1, 5))
def test_slot_plan_never_evicts_a_layer_before_it_runs(num_streamed, prefetch_step):
    model = tiny_llama(num_streamed)
    ring = make_plan(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=prefetch_step)).rings[0]
    slots = [layer.slot for layer in ring.streamed]
    nxt = [layer.next_in_slot for layer in ring.streamed]
    assert _simulate_misses(slots, nxt, ring.num_slots) == 0


def test_offload_params_whitelist_keeps_other_parameters_resident():
    model = tiny_llama(4)
    plan = make_plan(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=1, offload_params={"mlp"}))
    for layer in plan.rings[0].streamed:
        assert {spec.name for spec in layer.offloaded} == {
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        assert layer.resident_bytes > 0


def test_whitelist_matching_nothing_is_an_error_with_examples():
    model = tiny_llama(4)
    with pytest.raises(ValueError, match=r"offload_params=\{'w2'\} matched no parameter.*self_attn\.q_proj\.weight"):
        make_plan(model, PrefetchConfig(offload_params={"w2"}))


def test_layer_discovery_and_override():
    model = tiny_llama(2)
    assert find_layer_lists(model) == ["model.layers"]
    assert make_plan(model, PrefetchConfig(), layers="model.layers").rings[0].path == "model.layers"


class _NoLayers(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


def test_no_layer_list_error_lists_module_lists():
    with pytest.raises(ValueError, match=r"Found no layer list in _NoLayers.*'stages' \(2 x Linear\)"):
        find_layer_lists(_NoLayers())


def test_bad_layers_override():
    with pytest.raises(ValueError, match=r"layers='model.blocks' is not a ModuleList.*'model.layers' \(2 x"):
        make_plan(tiny_llama(2), PrefetchConfig(), layers="model.blocks")


def test_plan_bytes_and_table():
    model = tiny_llama(8)
    plan = make_plan(model, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2))
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan.offloaded_bytes == 4 * layer_bytes
    # Each buffer of a slot starts at an aligned offset (pool.py), as each tensor of the host arena does.
    slot_bytes = sum(padded_bytes(p.numel() * p.element_size()) for p in model.model.layers[0].parameters())
    assert plan.pool_bytes == 2 * slot_bytes
    assert plan.resident_bytes == total - 4 * layer_bytes
    assert plan.streamed_bytes_per_forward == 4 * layer_bytes
    text = str(plan)
    assert "model.layers.1" in text and "streamed" in text and "pool bytes" in text


def test_plan_of_a_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = tiny_llama(4)
    plan = make_plan(model, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1))
    assert plan.offloaded_bytes > 0


def test_shared_parameters_stay_resident():
    model = tiny_llama(4)
    model.model.layers[3].mlp.down_proj.weight = model.model.layers[1].mlp.down_proj.weight
    plan = make_plan(model, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1))
    names = {spec.name for layer in plan.rings[0].streamed for spec in layer.offloaded}
    assert "mlp.down_proj.weight" not in names
    assert "mlp.up_proj.weight" in names


def test_explicit_selection_replaces_the_group_pattern():
    model = tiny_llama(8)
    plan = make_plan(model, PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2), streamed=[5, 0, 5])
    assert [layer.index for layer in plan.rings[0].streamed] == [0, 5] and plan.source is Source.EXPLICIT
    assert "(chosen layers, prefetch_step=2)" in str(plan)
    assert (
        make_plan(model, PrefetchConfig(), streamed={"model.layers": [1, 3, 5, 7]}).rings
        == make_plan(model, PrefetchConfig(group_size=2, num_in_group=1)).rings
    )
    assert make_plan(model, PrefetchConfig(), streamed=[]).offloaded_bytes == 0


@pytest.mark.parametrize(
    "streamed, match",
    [
        ([8], r"streamed\['model.layers'\] holds 8; layer indices of model.layers are ints from 0 to 7"),
        ([-1], r"streamed\['model.layers'\] holds -1"),
        (["1"], r"streamed\['model.layers'\] holds '1'"),
        ([True], r"streamed\['model.layers'\] holds True"),
        (
            {"model.blocks": [1]},
            r"streamed names the layer list 'model.blocks', which is not one of \['model.layers'\]",
        ),
    ],
)
def test_explicit_selection_errors(streamed, match):
    with pytest.raises(ValueError, match=match):
        make_plan(tiny_llama(8), PrefetchConfig(), streamed=streamed)


def test_explicit_selection_of_a_model_with_two_layer_lists_names_them():
    from tests.zoo import ARCHS_BY_NAME

    model = ARCHS_BY_NAME["t5"].build()
    with pytest.raises(ValueError, match=r"has 2 layer lists \['encoder.block', 'decoder.block'\]; pass \{path"):
        make_plan(model, PrefetchConfig(), streamed=[1])
    plan = make_plan(model, PrefetchConfig(), streamed={"decoder.block": [2, 5]})
    assert [len(ring.streamed) for ring in plan.rings] == [0, 2]


@pytest.mark.parametrize(
    "group_size, num_in_group, longest",
    [(2, 1, 1), (4, 3, 3), (8, 2, 2), (1, 1, 8), (16, 1, 0)],
)
def test_longest_run(group_size, num_in_group, longest):
    config = PrefetchConfig(group_size=group_size, num_in_group=num_in_group, prefetch_step=num_in_group)
    plan = make_plan(tiny_llama(8), config)
    assert plan.longest_run == plan.rings[0].longest_run == longest
    assert f"longest run {longest}" in str(plan)


def test_plan_renders_as_html():
    plan = make_plan(tiny_llama(4), PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1))
    html = plan._repr_html_()
    assert html.startswith("<table><thead><tr><th>layer</th><th>placement</th>")
    assert "<td>model.layers.3</td><td>streamed</td>" in html
    assert f"<th>pool bytes</th><td>{format_bytes(plan.pool_bytes)} (1 slots)</td>" in html
    assert "transfer per forward" not in html
    assert "transfer per forward" in dataclasses.replace(plan, link_gbps=50.0)._repr_html_()


@pytest.mark.parametrize(
    "num_bytes, text",
    [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (10 * 2**30 + 2**29, "10.50 GiB")],
)
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text
