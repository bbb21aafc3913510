"""The UVA backend on the CPU: its plan, dispatch (a no-op with one warning), remove, errors and rollback.

The mapping of host memory into the GPU runs in tests/test_gpu.py; here the parts that do not need a GPU run for real.
"""

import math
import warnings
import weakref

import pytest
import torch
from torch import nn

import hf_prefetch
from hf_prefetch import OffloadConfig, OffloadPlan, PrefetchConfig, UVAConfig
from hf_prefetch.host import arena as host
from hf_prefetch.host.arena import HostArena
from hf_prefetch.lifecycle import attach
from hf_prefetch.planning.selection import make_uva_plan
from tests.models import llama_and_logits, tiny_llama

# tiny_llama: every layer has, in named_parameters order, q (16 KiB), k (8 KiB), v (8 KiB), o (16 KiB), gate, up,
# down (32 KiB each) and two norms (256 B each) in float32: 147,968 bytes.
LAYER = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "input_layernorm",
    "post_attention_layernorm",
]
LAYER_BYTES = 147_968
GIB = 2**30


@pytest.fixture(scope="module")
def reference():
    return llama_and_logits(8)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(attach, "_warned_on_cpu", False)


def _taken(plan: OffloadPlan) -> list[str]:
    return [
        f"{layer.index}.{spec.name.split('.')[-2]}"
        for ring in plan.rings
        for layer in ring.layers
        for spec in layer.offloaded
    ]


@pytest.mark.parametrize(
    "gb, segments, expected",
    [
        # Exactly two layers' bytes: layers 0 and 1, whole, and nothing of layer 2.
        (2 * LAYER_BYTES / GIB, (), [f"{i}.{name}" for i in (0, 1) for name in LAYER]),
        # One byte more: the next parameter in layer order (layer 2's q_proj) is taken and crosses the limit.
        ((2 * LAYER_BYTES + 1) / GIB, (), [f"{i}.{name}" for i in (0, 1) for name in LAYER] + ["2.q_proj"]),
        # Filtered by segments, still in layer order: 40,000 bytes of MLP weights are two 32 KiB matrices.
        (40_000 / GIB, {"mlp"}, ["0.gate_proj", "0.up_proj"]),
        (math.inf, {"down_proj"}, [f"{i}.down_proj" for i in range(8)]),
        (
            math.inf,
            {"self_attn.o_proj", "post_attention_layernorm"},
            [f"{i}.{n}" for i in range(8) for n in ("o_proj", "post_attention_layernorm")],
        ),
        (1e-9, (), ["0.q_proj"]),  # less than one parameter: the first one is taken
    ],
)
def test_plan_takes_parameters_in_layer_order_until_the_limit(gb, segments, expected):
    model = tiny_llama(8)
    plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=gb, cpu_offload_params=segments))
    assert _taken(plan) == expected
    params = dict(model.named_parameters())
    host_bytes = sum(
        params[f"{layer.path}.{spec.name}"].nbytes
        for ring in plan.rings
        for layer in ring.layers
        for spec in layer.offloaded
    )
    assert plan.offloaded_bytes == host_bytes
    assert plan.resident_bytes + plan.offloaded_bytes == sum(p.nbytes for p in model.parameters()) + sum(
        b.nbytes for b in model.buffers()
    )
    assert plan.device_bytes == plan.resident_bytes and plan.pool_bytes == 0


def test_plan_is_pure_and_prints_a_table():
    with torch.device("meta"):
        model = tiny_llama(4)
    plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=(LAYER_BYTES + 20_000) / GIB))
    lines = str(plan).splitlines()
    assert lines[0].split() == ["layer", "placement", "resident", "host", "slot", "next"]
    assert lines[1].split() == ["model.layers.0", "mapped", "0", "B", "144.5", "KiB", "-", "-"]
    assert lines[2].split() == ["model.layers.1", "partly", "mapped", "120.5", "KiB", "24.0", "KiB", "-", "-"]  # q, k
    assert lines[3].split() == ["model.layers.2", "resident", "144.5", "KiB", "-", "-", "-"]
    assert "mapped layers          2 of 4 (cpu_offload_gb=" in str(plan)
    assert "read per forward       168.5 KiB over the bus, at least" in str(plan)
    assert plan._repr_html_().startswith("<table>")


def test_plan_of_several_layer_lists_goes_through_them_in_order():
    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.decoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    model = TwoStacks()
    linear_bytes = (8 * 8 + 8) * 4
    plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=3 * linear_bytes / GIB), layers=["encoder", "decoder"])
    taken = [f"{layer.path}.{spec.name}" for ring in plan.rings for layer in ring.layers for spec in layer.offloaded]
    assert taken == [
        "encoder.0.weight",
        "encoder.0.bias",
        "encoder.1.weight",
        "encoder.1.bias",
        "decoder.0.weight",
        "decoder.0.bias",
    ]


def test_a_shared_parameter_is_taken_once():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            linear = nn.Linear(8, 8)
            self.layers = nn.ModuleList([linear, linear, nn.Linear(8, 8)])

    model = Shared()
    plan = make_uva_plan(model, UVAConfig(cpu_offload_gb=math.inf), layers="layers")
    assert [len(layer.offloaded) for layer in plan.rings[0].layers] == [2, 0, 2]
    assert plan.offloaded_bytes == sum(p.nbytes for p in model.parameters())


def test_segments_that_match_nothing_name_real_parameters():
    with pytest.raises(
        ValueError, match=r"cpu_offload_params=\{'w2'\} matched no parameter.*'self_attn.q_proj.weight'"
    ):
        make_uva_plan(tiny_llama(2), UVAConfig(cpu_offload_gb=1, cpu_offload_params={"w2"}))


def test_dispatch_on_the_cpu_changes_nothing_and_warns_once(reference):
    model, ids, logits = reference
    before = {name: (param, param.data_ptr()) for name, param in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=2 * LAYER_BYTES / GIB), device="cpu")
        state = hf_prefetch.get_state(model)
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu", replace=True)
    try:
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "The UVA backend on the CPU keeps every weight where it is" in messages[0]
        assert "289.0 KiB would stay in host memory" in messages[0]
        assert caught[0].filename == __file__
        assert isinstance(state.plan, OffloadPlan) and state.plan.offloaded_bytes == 2 * LAYER_BYTES
        assert state.offloaded == [] and state.engine is None
        assert not any(hasattr(module, "_hf_hook") for module in model.modules())
        assert {name: (p, p.data_ptr()) for name, p in model.named_parameters()} == before
        assert not hasattr(model, "hf_device_map")  # set only where layers sit on several devices
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
        with pytest.raises(ValueError, match="already dispatched with UVAConfig"):
            hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu")
        with pytest.raises(ValueError, match="UVA backend, which makes no copies"):
            hf_prefetch.stats(model)
    finally:
        hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None and not hasattr(model, "hf_device_map")
    assert {name: (p, p.data_ptr()) for name, p in model.named_parameters()} == before
    with pytest.raises(ValueError, match="is not dispatched by hf_prefetch: nothing to remove"):
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "offload, expected_plan",
    [
        (OffloadConfig(uva=UVAConfig(cpu_offload_gb=1)), "uva"),
        (UVAConfig(cpu_offload_gb=1), "uva"),
        (OffloadConfig(prefetch=PrefetchConfig(group_size=4, num_in_group=1)), "prefetch"),
        (OffloadConfig(backend="prefetch"), "prefetch"),
    ],
)
def test_dispatch_with_a_config_runs_the_selected_backend(reference, offload, expected_plan):
    model, ids, logits = reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_prefetch.dispatch_model(model, offload, device="cpu")
    try:
        state = hf_prefetch.get_state(model)
        assert state.plan.backend == expected_plan
        assert (state.engine is not None) == (expected_plan == "prefetch")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_replace_switches_between_backends(reference):
    model, ids, logits = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu", replace=True)
        assert isinstance(hf_prefetch.get_state(model).plan, OffloadPlan)
        assert not any(hasattr(m, "_hf_hook") for m in model.modules())  # the prefetch hooks are gone
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
        hf_prefetch.dispatch_model(
            model,
            hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2),
            device="cpu",
            replace=True,
        )
        assert hf_prefetch.get_state(model).engine is not None
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"offload": "uva"}, r"UVA backend with cpu_offload_gb=0 keeps nothing in host memory"),
        (
            {"offload": UVAConfig(cpu_offload_gb=1), "group_size": 2},
            r"\['group_size'\].*PrefetchConfig\(group_size=2\)",
        ),
        (
            {"offload": UVAConfig(cpu_offload_gb=1), "timing": True},
            r"timing, max_memory, reserve_bytes and links work with",
        ),
        ({"offload": UVAConfig(cpu_offload_gb=1), "max_memory": "auto"}, r"work with the prefetch backend only"),
        ({"offload": OffloadConfig()}, r"selects no backend"),
        ({"offload": UVAConfig(cpu_offload_gb=1, cpu_offload_params={"w2"})}, r"\{'w2'\} matched no parameter"),
        ({"offload": UVAConfig(cpu_offload_gb=1), "layers": "model.nope"}, r"layers='model.nope' is not a ModuleList"),
    ],
)
def test_bad_uva_input_leaves_nothing_behind(reference, kwargs, match):
    model, ids, logits = reference
    with pytest.raises((ValueError, TypeError), match=match):
        hf_prefetch.dispatch_model(model, device="cpu", **kwargs)
    assert hf_prefetch.get_state(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_failure_while_attaching_rolls_back(reference, monkeypatch):
    model, ids, logits = reference

    def broken(plan):
        raise RuntimeError("attach failed")

    monkeypatch.setattr("hf_prefetch.lifecycle.attach._warn_uva_on_cpu", broken)
    with pytest.raises(RuntimeError, match="attach failed"):
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu")
    assert hf_prefetch.get_state(model) is None and not hasattr(model, "hf_device_map")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize(
    "load",
    [
        lambda: hf_prefetch.from_pretrained("/nonexistent", hf_prefetch.UVAConfig(cpu_offload_gb=1)),
        lambda: hf_prefetch.from_pretrained("/nonexistent", offload=OffloadConfig(uva=UVAConfig(cpu_offload_gb=1))),
    ],
)
def test_loaders_refuse_uva_before_reading_anything(load):
    with pytest.raises(
        ValueError,
        match=r"UVA backend \(offload='uva' or a UVAConfig\) works with hf_prefetch.dispatch_model only"
        r".*hf_prefetch.plan",
    ):
        load()


def test_mapping_needs_a_pinned_arena():
    arena = HostArena([4096])
    with pytest.raises(RuntimeError, match=r"UVA needs the 0.00 GiB of offloaded weights page-locked.*ulimit -l"):
        arena.map(torch.device("cuda", 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process has libcudart loaded")
def test_mapping_without_a_cuda_runtime_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"no libcudart loaded.*Use offload='prefetch'"):
        host._device_pointer(4096, torch.device("cuda", 0))


def test_device_array_describes_the_bytes_and_holds_its_owner():
    owner = HostArena([4096])
    array = host._DeviceArray(0x7F0000000000, 8192, owner)
    assert array.__cuda_array_interface__ == {
        "shape": (8192,),
        "typestr": "|u1",
        "data": (0x7F0000000000, False),
        "strides": None,
        "version": 3,
    }
    assert array.owner is owner


def test_release_leaves_a_mapped_arena_registered_until_the_last_view_dies(monkeypatch):
    # [Note: UVA lifetime]: unregistering while a device view lives would make its next read fault.
    unregistered = []
    monkeypatch.setattr(host, "_register", lambda buffer, flags=0: True)
    monkeypatch.setattr(host, "_unregister", unregistered.append)
    arena = HostArena([4096, 4096])
    assert arena.pin()
    pointer = arena.bytes_view(0, 1).data_ptr()
    view_holder = host._DeviceArray(pointer, arena.nbytes, owner=arena)  # what a live device view keeps alive
    arena._mapping = weakref.ref(view_holder)
    arena.release()
    assert unregistered == [] and arena.pinned
    finalizer = arena._unpin
    del arena
    assert finalizer.alive  # the view still holds the arena
    del view_holder
    assert not finalizer.alive and unregistered == [pointer]


def test_release_of_an_unmapped_arena_unregisters_at_once(monkeypatch):
    unregistered = []
    monkeypatch.setattr(host, "_register", lambda buffer, flags=0: True)
    monkeypatch.setattr(host, "_unregister", unregistered.append)
    arena = HostArena([4096])
    arena.pin()
    pointer = arena.bytes_view(0, 1).data_ptr()
    arena.release()
    assert unregistered == [pointer] and not arena.pinned


def test_view_on_a_base_uses_the_same_offsets_and_layout():
    arena = HostArena([100 * 4, 6 * 2])
    base = torch.arange(arena.nbytes, dtype=torch.int32).to(torch.uint8)  # stands in for the mapped bytes
    host_view = arena.view(1, (2, 3), (1, 2), torch.bfloat16)
    other = arena.view(1, (2, 3), (1, 2), torch.bfloat16, base=base)
    assert other.shape == host_view.shape and other.stride() == host_view.stride() and other.dtype == torch.bfloat16
    assert other.data_ptr() - base.data_ptr() == host_view.data_ptr() - arena.bytes_view(0, 1).data_ptr() == 4096


@pytest.mark.parametrize(
    "call, match",
    [
        (hf_prefetch.stats, "UVA backend, which makes no copies"),
        (hf_prefetch.reset_stats, "UVA backend, which makes no copies"),
        (lambda model: hf_prefetch.reload_weights(model, model.state_dict()), "reload_weights works on models"),
        (hf_prefetch.sync_from_device, "sync_from_device works on models"),
    ],
)
def test_prefetch_only_calls_on_a_uva_model_say_so(reference, call, match):
    model = reference[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu")
    try:
        with pytest.raises(ValueError, match=match):
            call(model)
    finally:
        hf_prefetch.remove_offload(model)
