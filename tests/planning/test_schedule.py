"""Planning with measured compute times: `time_layers`, the schedule simulation (`schedule.forward_seconds`) and the
budget planner's `compute_seconds` mode."""

import dataclasses

import pytest
import torch
from torch import nn

import hf_prefetch
from hf_prefetch.planning.budget import plan_for_budget
from hf_prefetch.planning.memory import MemoryBudget
from hf_prefetch.planning.schedule import forward_seconds
from tests.models import tiny_llama


class TwoLists(nn.Module):
    """A diffusion transformer's shape in miniature: a first list of large layers that compute little per byte (Flux's
    double blocks), then a list of small ones that compute more per byte (its single blocks)."""

    def __init__(self, big: int = 4, small: int = 8):
        super().__init__()
        self.big = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(big))
        self.small = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(small))

    def forward(self, x):
        for layer in self.big:
            x = layer(x)
        x = x[..., :32]
        for layer in self.small:
            x = layer(x)
        return x


BIG, SMALL = 64 * 64 * 4, 32 * 32 * 4  # bytes of one layer of each list (float32)


def _ring_of(plan, path):
    return next(ring for ring in plan.rings if ring.path == path)


def test_one_ring_takes_the_longer_of_its_copies_and_its_compute():
    model = TwoLists(big=4, small=1)
    config = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=2)
    plan = hf_prefetch.plan(model, config, layers="big", device="cpu")
    rate = BIG / 1.0  # one big layer per second
    for compute, expected in ((0.25, 4.0), (3.0, 12.0)):  # copy-bound: 4 copies; compute-bound: 4 layers' compute
        seconds = forward_seconds(plan.rings, {f"big.{i}": compute for i in range(4)}, rate)
        assert seconds == pytest.approx(expected)


def test_the_first_layers_copies_overlap_the_forward_before():
    # Two streamed layers of four through two slots, a resident layer before each: in a loop the wrapped copies run
    # during the previous forward's last layers, so a forward takes its compute when the copies fit in it.
    model = TwoLists(big=4, small=1)
    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
    plan = hf_prefetch.plan(model, config, layers="big", device="cpu")
    assert [layer.index for layer in plan.rings[0].streamed] == [1, 3]
    compute = {f"big.{i}": 1.0 for i in range(4)}
    assert forward_seconds(plan.rings, compute, BIG / 0.5) == pytest.approx(4.0)
    # Each copy takes 2 s: it waits for the slot (its layer ran) and hides behind one resident layer only.
    assert forward_seconds(plan.rings, compute, BIG / 2.0) == pytest.approx(6.0)


def _budget_for(model, streamed_bytes: int) -> MemoryBudget:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return MemoryBudget(total - streamed_bytes, reserve_bytes=0)


def test_the_planner_spends_the_budget_where_compute_hides_the_copies():
    model = TwoLists(big=10, small=20)
    # Flux's proportions: the link moves a big layer in 1 s, which computes 0.28 s; a small one in 0.25 s, which
    # computes 0.145 s (twice as long per byte).
    compute = {f"big.{i}": 0.28 for i in range(10)} | {f"small.{i}": 0.145 for i in range(20)}
    link_gbps = BIG / 1e9
    budget = _budget_for(model, streamed_bytes=int(0.3 * (10 * BIG + 20 * SMALL)))
    by_bytes = plan_for_budget(model, budget, hf_prefetch.PrefetchConfig(), layers=["big", "small"])
    timed = hf_prefetch.PrefetchConfig(compute_seconds=compute)
    by_time = plan_for_budget(model, budget, timed, layers=["big", "small"], link_gbps=link_gbps)
    rate = link_gbps * 1e9
    assert by_time.device_bytes <= budget.weights_bytes
    assert forward_seconds(by_time.rings, compute, rate) < forward_seconds(by_bytes.rings, compute, rate)
    # Fewest bytes streams small layers only; by time, big layers stream too, behind the small ones' compute ...
    assert not _ring_of(by_bytes, "big").streamed and _ring_of(by_time, "big").streamed
    # ... and of the plans that fit, none is faster.
    assert by_time.streamed_bytes_per_forward >= by_bytes.streamed_bytes_per_forward
    # Without a link speed (a CPU execution device, whose copies do not overlap compute) the fewest bytes win, and
    # the times are still checked.
    assert plan_for_budget(model, budget, timed, layers=["big", "small"]).rings == by_bytes.rings


def test_compute_seconds_must_name_every_layer_and_no_other():
    model = TwoLists(big=2, small=2)
    budget = _budget_for(model, streamed_bytes=SMALL)
    full = {"big.0": 1.0, "big.1": 1.0, "small.0": 1.0, "small.1": 1.0}
    for seconds, match in (
        ({k: v for k, v in full.items() if k != "small.1"}, r"has no time for 1 layers \(small.1\)"),
        (full | {"small.9": 1.0}, r"names 1 paths that are no layer of \['big', 'small'\] \(small.9\)"),
    ):
        config = hf_prefetch.PrefetchConfig(compute_seconds=seconds)
        with pytest.raises(ValueError, match=match):
            plan_for_budget(model, budget, config, layers=["big", "small"], link_gbps=1.0)


def test_compute_seconds_needs_a_budget_and_one_gpu():
    model = tiny_llama()
    config = hf_prefetch.PrefetchConfig(compute_seconds={"model.layers.0": 1.0})
    with pytest.raises(ValueError, match="no max_memory was given"):
        hf_prefetch.dispatch_model(model, config, device="cpu")
    assert hf_prefetch.get_state(model) is None
    with pytest.raises(ValueError, match=r"plans one GPU's layers, and max_memory names the GPUs \[0, 1\]"):
        hf_prefetch.plan(model, config, max_memory={0: "1GiB", 1: "1GiB"}, device="cpu")


@pytest.mark.parametrize(
    "value, match",
    [
        ([("a", 1.0)], "must be a mapping of layer path to seconds"),
        ({"a": -1.0}, r"compute_seconds\['a'\]=-1.0 must be a finite number of seconds >= 0"),
        ({"a": float("nan")}, r"compute_seconds\['a'\]=nan must be"),
        ({"a": True}, r"compute_seconds\['a'\]=True must be"),
        ({3: 1.0}, "has the key 3: keys are layer paths"),
    ],
)
def test_compute_seconds_is_validated(value, match):
    with pytest.raises(ValueError, match=match):
        hf_prefetch.PrefetchConfig(compute_seconds=value)


def test_compute_seconds_is_part_of_the_config_identity():
    a = hf_prefetch.PrefetchConfig(compute_seconds={"x.1": 2.0, "x.0": 1})
    b = hf_prefetch.PrefetchConfig(compute_seconds={"x.0": 1.0, "x.1": 2.0})
    assert a == b and hash(a) == hash(b) and a.compute_hash() == b.compute_hash()
    assert a.compute_hash() != hf_prefetch.PrefetchConfig(compute_seconds={"x.0": 1.0, "x.1": 3.0}).compute_hash()
    assert a.compute_hash() != hf_prefetch.PrefetchConfig().compute_hash()
    assert dataclasses.replace(a, prefetch_step=1).compute_seconds == a.compute_seconds == (("x.0", 1.0), ("x.1", 2.0))


class SkipsAndRepeats(nn.Module):
    """Its forward skips its last layer and calls its first twice."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return self.blocks[1](self.blocks[0](self.blocks[0](x)))


def test_time_layers_times_every_layer_of_the_lists_and_leaves_no_hook():
    model = TwoLists(big=2, small=3)
    x = torch.randn(4, 64)
    seconds = hf_prefetch.time_layers(model, x, layers=["big", "small"], repeats=2)
    assert sorted(seconds) == ["big.0", "big.1", "small.0", "small.1", "small.2"]
    assert all(value > 0 for value in seconds.values())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # A layer the forward skips takes no time; one called twice counts both calls.
    model = SkipsAndRepeats()
    calls = []
    model.blocks[0].register_forward_hook(lambda *args: calls.append(1))
    seconds = hf_prefetch.time_layers(model, torch.randn(2, 8), layers="blocks", repeats=1)
    assert seconds["blocks.2"] == 0.0 and seconds["blocks.0"] > 0 and seconds["blocks.1"] > 0
    assert len(calls) == 4  # the untimed forward and the timed one, two calls each


def test_time_layers_removes_its_hooks_when_the_forward_raises():
    model = TwoLists(big=2, small=2)
    with pytest.raises(RuntimeError):
        hf_prefetch.time_layers(model, torch.randn(4, 7), layers=["big", "small"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_an_interrupt_in_no_grad_s_own_exit_leaves_autograd_as_it_was(monkeypatch):
    # CPython runs a with block's normal exit outside its handler: a Ctrl-C landing inside `no_grad.__exit__`, before
    # it restores the mode, would leave autograd off for the caller.
    exits = []

    def interrupted(self, *exc):
        exits.append(exc)
        raise KeyboardInterrupt

    model, x = TwoLists(big=1, small=1), torch.randn(4, 64)
    monkeypatch.setattr(torch.no_grad, "__exit__", interrupted)
    try:
        hf_prefetch.time_layers(model, x, layers=["big", "small"], repeats=1)
    except KeyboardInterrupt:
        pass
    finally:
        monkeypatch.undo()
    enabled = torch.is_grad_enabled()
    torch.set_grad_enabled(True)  # for the tests after this one, should it fail
    assert exits == [(None, None, None)] and enabled
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_time_layers_refuses_a_dispatched_model_and_bad_repeats():
    model = tiny_llama()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        hf_prefetch.time_layers(model, ids, repeats=0)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(prefetch_step=1), device="cpu")
    try:
        with pytest.raises(ValueError, match="is dispatched by hf_prefetch, so its streamed layers would be timed"):
            hf_prefetch.time_layers(model, ids)
    finally:
        hf_prefetch.remove_offload(model)


def test_a_plan_from_measured_times_is_the_dispatch_and_stays_bitwise():
    model = tiny_llama(num_layers=4)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(ids).logits
    config = hf_prefetch.PrefetchConfig(compute_seconds=hf_prefetch.time_layers(model, ids))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = {0: int(total * 0.8) + 2**20}
    plan = hf_prefetch.plan(model, config, max_memory=budget, reserve_bytes=2**20, device="cpu")
    hf_prefetch.dispatch_model(model, config, device="cpu", max_memory=budget, reserve_bytes=2**20)
    try:
        assert hf_prefetch.get_state(model).plan.rings == plan.rings and plan.rings[0].streamed
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.gpu
def test_on_cuda_the_plan_from_measured_times_is_the_dispatch_and_stays_bitwise():
    model = tiny_llama(num_layers=6).to("cuda")
    ids = torch.tensor([[1, 2, 3, 4]], device="cuda")
    with torch.no_grad():
        expected = model(ids).logits
    seconds = hf_prefetch.time_layers(model, ids)
    assert sorted(seconds) == [f"model.layers.{i}" for i in range(6)] and all(v > 0 for v in seconds.values())
    config = hf_prefetch.PrefetchConfig(compute_seconds=seconds)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = {0: int(total * 0.8) + 2**20}
    plan = hf_prefetch.plan(model, config, max_memory=budget, reserve_bytes=2**20, device="cuda")
    hf_prefetch.dispatch_model(model, config, device="cuda", max_memory=budget, reserve_bytes=2**20)
    try:
        assert hf_prefetch.get_state(model).plan.rings == plan.rings and plan.rings[0].streamed
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).logits, expected)
    finally:
        hf_prefetch.remove_offload(model)
