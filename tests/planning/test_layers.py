"""The walk over a model's layer lists (hf_prefetch/planning/layers.py): what tests/planning/test_selection.py does not
check (nested and mixed lists, `resolve_layer_lists`, each candidate parameter's exact layout and flags,
`model_bytes`)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hf_prefetch.planning.layers import candidate_layers, find_layer_lists, model_bytes, resolve_layer_lists
from hf_prefetch.planning.placements import Placement
from tests.models import tiny_llama


class Block(nn.Module):
    def __init__(self, width: int = 4, inner: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        if inner:
            self.inner = nn.ModuleList(Block(width) for _ in range(inner))  # a list of blocks inside a block


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([Block(inner=2), Block()])
        self.empty = nn.ModuleList()
        self.mixed = nn.ModuleList([Block(), nn.Linear(4, 4)])
        self.decoder = nn.Sequential(nn.ModuleList([Block(), Block(), Block()]))
        self.head = nn.Linear(4, 2)


def test_find_layer_lists_takes_the_outermost_lists_of_blocks_only():
    # Not encoder.0.inner (inside a found list), not the empty list, not the list that mixes blocks with a Linear.
    assert find_layer_lists(Net()) == ["encoder", "decoder.0"]


def test_a_model_without_no_split_modules_and_without_blocks_has_no_layer_list():
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    pattern = r"Found no layer list in Sequential.*holds only blocks.*'0' \(1 x Linear\), '1' \(Linear, ReLU\)"
    with pytest.raises(ValueError, match=pattern):
        find_layer_lists(model)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])  # torch.nn items: not blocks


class _Wrapper(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = _Block(width)


class _Diffusion(nn.Module):
    """As many diffusers transformers: no `_no_split_modules`, or one naming blocks that the lists only wrap."""

    _no_split_modules = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.double_blocks = nn.ModuleList([_Wrapper(16) for _ in range(3)])
        self.single_blocks = nn.ModuleList([_Wrapper(16) for _ in range(2)])
        self.tiny = nn.ModuleList([_Wrapper(2) for _ in range(2)])  # blocks, but under an eighth of the weights


def test_without_named_block_lists_the_lists_of_blocks_holding_the_weights_are_found():
    model = _Diffusion()
    assert find_layer_lists(model) == ["double_blocks", "single_blocks"]
    model._no_split_modules = None
    assert find_layer_lists(model) == ["double_blocks", "single_blocks"]
    model._no_split_modules = ["_Wrapper"]  # named: every list of them, small ones too
    assert find_layer_lists(model) == ["double_blocks", "single_blocks", "tiny"]


@pytest.mark.parametrize(
    "layers, expected",
    [
        (None, ["encoder", "decoder.0"]),
        ("mixed", ["mixed"]),  # named explicitly, any ModuleList is taken
        (["decoder.0", "encoder.0.inner"], ["decoder.0", "encoder.0.inner"]),  # in the given order
        (("encoder",), ["encoder"]),
    ],
)
def test_resolve_layer_lists(layers, expected):
    assert resolve_layer_lists(Net(), layers) == expected


@pytest.mark.parametrize(
    "layers, match",
    [
        ([], r"layers=\[\] names no layer list; pass None to find them"),
        ("head", r"layers='head' is not a ModuleList of Net\. ModuleLists in this model: 'encoder' \(2 x Block\)"),
        ("decoder", r"layers='decoder' is not a ModuleList"),  # a Sequential holding one
        (["encoder", "nothing.here"], r"layers='nothing\.here' is not a ModuleList"),
    ],
)
def test_resolve_layer_lists_errors(layers, match):
    with pytest.raises(ValueError, match=match):
        resolve_layer_lists(Net(), layers)


@pytest.mark.parametrize(
    "layers, pair, how, kept",
    [
        (["encoder", "encoder"], ("encoder", "encoder"), "the same ModuleList", ["encoder"]),
        (["encoder", "alias"], ("encoder", "alias"), "one ModuleList under two names", ["encoder"]),
        (["encoder", "encoder.0.inner"], ("encoder", "encoder.0.inner"), "'encoder.0.inner' lies inside 'encoder'",
         ["encoder"]),
        (["decoder.0", "encoder.0.inner", "encoder"], ("encoder.0.inner", "encoder"),
         "'encoder.0.inner' lies inside 'encoder'", ["decoder.0", "encoder"]),
        (["encoder", "sharing"], ("encoder", "sharing"), "they share modules", ["encoder"]),
    ],
)  # fmt: skip
def test_overlapping_layer_lists_are_refused_with_both_paths_and_the_fix(layers, pair, how, kept):
    net = Net()
    net.alias = net.encoder  # the same list under a second name
    net.sharing = nn.ModuleList([Block(), net.encoder[1]])  # another list holding one of encoder's blocks
    message = (
        f"layers={layers!r} names {pair[0]!r} and {pair[1]!r}, which overlap ({how}): the layers they share would be "
        f"planned, and their weights kept in host memory, twice. Name each layer list once, e.g. layers={kept!r}."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_layer_lists(net, layers)
    with pytest.raises(ValueError, match=re.escape(message)):
        candidate_layers(net, frozenset(), layers)  # every planner's walk
    assert resolve_layer_lists(net, kept) == kept


def test_candidates_are_every_parameter_of_every_layer_with_its_layout(llama_reference):
    model = llama_reference.model
    found = candidate_layers(model, frozenset({"mlp"}), None)
    assert list(found) == ["model.layers"]
    layers = found["model.layers"]
    assert [(c.path, c.index) for c in layers] == [(f"model.layers.{i}", i) for i in range(8)]
    for candidate, layer in zip(layers, model.model.layers, strict=True):
        params = dict(layer.named_parameters())
        assert [c.spec.name for c in candidate.params] == list(params)
        for c in candidate.params:
            param = params[c.spec.name]
            assert c.param is param and not c.shared
            assert (c.spec.shape, c.spec.stride, c.spec.dtype) == (tuple(param.shape), param.stride(), param.dtype)
            assert c.spec.nbytes == param.numel() * param.element_size()
            assert c.spec.placement is Placement.RESIDENT
            assert c.matched is c.spec.name.startswith("mlp.")
        assert candidate.matched
        assert candidate.streamable() == {id(p) for n, p in params.items() if n.startswith("mlp.")}


def test_a_layer_plan_of_the_chosen_parameters(llama_reference):
    candidate = candidate_layers(llama_reference.model, frozenset(), "model.layers")["model.layers"][2]
    up = candidate.params[[c.spec.name for c in candidate.params].index("mlp.up_proj.weight")]
    plan = candidate.placed(Placement.STREAMED, {id(up.param)})
    assert (plan.path, plan.index) == ("model.layers.2", 2)
    assert [s.name for s in plan.offloaded] == ["mlp.up_proj.weight"] and plan.streamed
    assert plan.offloaded_bytes == up.spec.nbytes
    assert plan.resident_bytes == sum(c.spec.nbytes for c in candidate.params) - up.spec.nbytes
    assert candidate.resident().offloaded == () and not candidate.resident().streamed


def test_segments_that_match_nothing_in_a_layer():
    candidate = candidate_layers(Net(), frozenset({"attn"}), "encoder")["encoder"][1]
    assert not candidate.matched and candidate.streamable() == set()


def test_a_parameter_reachable_under_two_names_is_shared_and_never_streamable():
    model = tiny_llama(4)
    shared = model.model.layers[1].mlp.down_proj.weight
    model.model.layers[3].mlp.down_proj.weight = shared  # tied across layers
    model.model.layers[2].extra = model.model.layers[2].mlp.up_proj  # a module reused under a second name
    layers = candidate_layers(model, frozenset(), None)["model.layers"]
    flags = {(c.index, p.spec.name): p.shared for c in layers for p in c.params}
    assert flags[1, "mlp.down_proj.weight"] and flags[3, "mlp.down_proj.weight"]
    assert flags[2, "mlp.up_proj.weight"] and not flags[2, "mlp.gate_proj.weight"]
    assert id(shared) not in layers[1].streamable() | layers[3].streamable()
    assert id(model.model.layers[2].mlp.up_proj.weight) not in layers[2].streamable()
    assert sum(not p.shared for c in layers for p in c.params) == 4 * 9 - 3
    # The layer owns the reused module once: its parameters are listed under one name.
    assert [p.spec.name for p in layers[2].params].count("mlp.up_proj.weight") == 1


class Layouts(nn.Module):
    _no_split_modules = ["Layout"]


class Layout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transposed = nn.Parameter(torch.zeros(3, 5).t())  # dense, permuted: kept as it is
        self.gaps = nn.Parameter(torch.zeros(4, 6)[:, ::2])  # every second column: stored contiguously
        self.column = nn.Parameter(torch.zeros(6, 4)[:, 1:2])  # one column of four: gaps
        self.row = nn.Parameter(torch.zeros(2, 6)[:1])  # one row of two: dense (a size-1 dim's stride is free)
        self.fp16 = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))


def test_a_dense_layout_is_kept_and_one_with_gaps_is_made_contiguous():
    model = Layouts()
    model.layers = nn.ModuleList([Layout()])
    layer = candidate_layers(model, frozenset(), None)["layers"][0]
    specs = {c.spec.name: c.spec for c in layer.params}
    assert (specs["transposed"].shape, specs["transposed"].stride) == ((5, 3), (1, 5))
    assert (specs["gaps"].shape, specs["gaps"].stride) == ((4, 3), (3, 1))
    assert (specs["column"].shape, specs["column"].stride) == ((6, 1), (1, 1))
    assert (specs["row"].shape, specs["row"].stride) == ((1, 6), (6, 1))
    assert specs["fp16"].dtype == torch.float16
    # Bytes of the values, not of the storage they are a view of.
    assert [specs[n].nbytes for n in ("transposed", "gaps", "column", "row", "fp16")] == [60, 48, 24, 24, 12]


def test_model_bytes_counts_every_parameter_and_buffer_once():
    model = nn.Module()
    model.a = nn.Linear(4, 3)  # 12 + 3 floats
    model.b = nn.Linear(4, 3, bias=False)
    model.b.weight = model.a.weight  # tied: counted once
    model.register_buffer("persistent", torch.zeros(5, dtype=torch.float64))
    model.register_buffer("computed", torch.zeros(2, dtype=torch.int8), persistent=False)
    assert model_bytes(model) == (12 + 3) * 4 + 5 * 8 + 2


def test_model_bytes_of_a_meta_model_matches_the_real_one(llama_reference):
    with torch.device("meta"):
        meta = tiny_llama(8)
    real = llama_reference.model
    expected = sum(p.numel() * p.element_size() for p in real.parameters())
    expected += sum(b.numel() * b.element_size() for b in real.buffers())
    assert model_bytes(meta) == model_bytes(real) == expected


class _Params4bit(nn.Parameter):
    """As bitsandbytes' 4-bit parameters: an nn.Parameter subclass carrying its quantization state."""

    quant_state = None


def test_quantized_parameters_are_refused_with_the_parameter_and_the_fix():
    import hf_prefetch
    from tests.models import tiny_llama

    model = tiny_llama(4)
    up = model.model.layers[1].mlp.up_proj
    up.weight = _Params4bit(up.weight.data, requires_grad=False)
    model.config.quantization_config = {"quant_method": "bitsandbytes"}  # what transformers sets (as an object)
    with pytest.raises(ValueError) as error:
        hf_prefetch.plan(model, hf_prefetch.PrefetchConfig(group_size=2), device="cpu")
    message = str(error.value)
    assert "model.layers.1.mlp.up_proj.weight is a quantized tensor (_Params4bit" in message
    assert "keep the quantized parameters resident" in message
    # Streaming only dense parameters around it works.
    plan = hf_prefetch.plan(
        model, hf_prefetch.PrefetchConfig(group_size=2, offload_params={"self_attn"}), device="cpu"
    )
    assert plan.offloaded_bytes > 0
    with pytest.raises(ValueError, match="is a quantized tensor"):
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=2), device="cpu")
    assert hf_prefetch.get_state(model) is None


def test_a_tensor_parallel_shard_streams_its_local_tensor(tmp_path):
    # transformers' tensor parallelism (distributed_config, tp_plan) makes the layers' weights DTensors: each rank
    # holds a shard, its local tensor, which is what streams. A process group of one rank on the CPU (gloo) makes one;
    # tests/distributed runs real groups of 2 and 4 ranks.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    import hf_prefetch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = tiny_llama()
        proj = model.model.layers[1].self_attn.q_proj
        proj.weight = nn.Parameter(distribute_tensor(proj.weight.detach(), mesh, [Shard(0)]))
        values = proj.weight.to_local().clone()
        config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
        plan = hf_prefetch.plan(model, config, device="cpu")
        names = [spec.name for spec in plan.rings[0].layers[1].offloaded]
        assert "self_attn.q_proj.weight:_local_tensor" in names
        assert [share.rank for share in plan.ranks] == [0] and "rank 0 (cpu)" in str(plan)
        with pytest.raises(ValueError, match=r"q_proj\.weight is a DTensor, .* which the UVA backend does not map"):
            hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu")
        dispatched = hf_prefetch.dispatch_model(model, config, device="cpu")
        assert type(proj.weight) is DTensor and proj.weight.device_mesh == mesh
        assert hf_prefetch.get_state(dispatched).plan.offloaded_bytes == plan.offloaded_bytes
        # (forwards need transformers' tensor-parallel hooks: tests/distributed)
        hf_prefetch.remove_offload(dispatched)
        assert type(proj.weight) is DTensor and torch.equal(proj.weight.to_local(), values)
        # Experts sharded as DTensors stream whole, never expert by expert: routed_experts=True says so.
        from ..moe_models import moe_model

        moe = moe_model("mixtral")
        experts = moe.model.layers[1].mlp.experts
        experts.gate_up_proj = nn.Parameter(distribute_tensor(experts.gate_up_proj.detach(), mesh, [Shard(0)]))
        routed = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1, routed_experts=True)
        with pytest.raises(ValueError, match=r"experts\.gate_up_proj:_local_tensor: its tensors are tensor-parallel"):
            hf_prefetch.plan(moe, routed, device="cpu")
        with pytest.warns(UserWarning, match="tensor-parallel shards"):
            hf_prefetch.plan(moe, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1), device="cpu")
        # A partial placement holds values pending a reduction, not stored ones: refused, naming the parameter.
        proj.weight = nn.Parameter(DTensor.from_local(proj.weight.to_local(), mesh, [Partial()]))
        with pytest.raises(ValueError, match=r"q_proj\.weight has a partial placement"):
            hf_prefetch.plan(model, config, device="cpu")
    finally:
        dist.destroy_process_group()
