"""Memory budgets: `max_memory` parsing, `plan_for_budget` (fits, minimal, strided), errors, and budgeted dispatch."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch
from accelerate import init_empty_weights

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.host.arena import HostArena
from hf_prefetch.planning import memory as memory_budget
from hf_prefetch.planning.budget import plan_for_budget, spread
from hf_prefetch.planning.memory import (
    DEFAULT_RESERVE_BYTES,
    MaxMemory,
    MemoryBudget,
    parse_max_memory,
    resolve_budget,
)
from hf_prefetch.planning.offload_plan import format_bytes
from hf_prefetch.planning.selection import make_plan
from tests.models import llama_and_logits, tiny_llama
from tests.zoo import ARCHS_BY_NAME

GiB, MiB = 2**30, 2**20
RESERVE = 10_000  # bytes kept free in the tests' budgets: the tiny models' layers take 147,968 bytes each


def _subsets(num_layers):
    return itertools.chain.from_iterable(itertools.combinations(range(num_layers), k) for k in range(num_layers + 1))


def _indices(plan, ring=0):
    return [layer.index for layer in plan.rings[ring].streamed]


# --- parsing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_memory, reserve_bytes, expected",
    [
        ({0: "10GiB", "cpu": "64GiB"}, None, MaxMemory(((0, 10 * GiB),), 64 * GiB, DEFAULT_RESERVE_BYTES)),
        ({"cuda:1": "9.5GB"}, "512MiB", MaxMemory(((1, 9_500_000_000),), None, 512 * MiB)),
        ({"cuda": "500MB"}, 0, MaxMemory(((None, 500_000_000),), None, 0)),
        ({0: 123_456, "cpu": "1000"}, "2GiB", MaxMemory(((0, 123_456),), 1000, 2 * GiB)),
        ({"0": "1GiB"}, None, MaxMemory(((0, GiB),), None, DEFAULT_RESERVE_BYTES)),
        ({torch.device("cuda", 2): "1.5GiB"}, None, MaxMemory(((2, 3 * GiB // 2),), None, DEFAULT_RESERVE_BYTES)),
        ({0: "auto", "cpu": "8GiB"}, None, MaxMemory(((0, None),), 8 * GiB, DEFAULT_RESERVE_BYTES)),
        ({"cpu": "8GiB"}, None, MaxMemory((), 8 * GiB, DEFAULT_RESERVE_BYTES)),
        ("auto", "1GiB", MaxMemory(((None, None),), None, GiB)),
        ({0: "1GiB", 1: "2GiB"}, None, MaxMemory(((0, GiB), (1, 2 * GiB)), None, DEFAULT_RESERVE_BYTES)),
    ],
)
def test_max_memory_forms(max_memory, reserve_bytes, expected):
    assert parse_max_memory(max_memory, reserve_bytes) == expected


def test_no_budget_is_none():
    assert parse_max_memory(None) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_memory={"disk": "1GiB"}), r"key 'disk'; keys are GPU indices .* no 'disk'"),
        (dict(max_memory={"mps": "1GiB"}), r"key 'mps'"),
        (dict(max_memory={True: "1GiB"}), r"key True"),
        (dict(max_memory={-1: "1GiB"}), r"key -1"),
        (dict(max_memory={0: "10G"}), r"max_memory\[0\]='10G' is not a size; .*'10GiB'"),
        (dict(max_memory={0: -5}), r"max_memory\[0\]=-5 is not a size"),
        (dict(max_memory={0: 1.5e9}), r"max_memory\[0\]=1500000000.0 is not a size"),
        (dict(max_memory={0: True}), r"max_memory\[0\]=True is not a size"),
        (dict(max_memory={"cpu": "auto"}), r"max_memory\['cpu'\]='auto' is not a size"),
        (dict(max_memory={0: "1GiB", "cuda:0": "2GiB"}), r"names one GPU twice, as 0 and 'cuda:0'; keep one entry"),
        (dict(max_memory="10GiB"), r"max_memory='10GiB' must be a dict like \{0: '10GiB', 'cpu': '64GiB'\}"),
        (dict(max_memory=10 * GiB), r"must be a dict like"),
        (dict(max_memory={0: "1GiB"}, reserve_bytes="lots"), r"reserve_bytes='lots' is not a size"),
        (
            dict(max_memory=None, reserve_bytes="1GiB"),
            r"reserve_bytes='1GiB' is only used with a memory budget; pass max_memory",
        ),
    ],
)
def test_bad_max_memory_names_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parse_max_memory(**kwargs)


@pytest.mark.parametrize(
    "config",
    [
        PrefetchConfig(group_size=4, num_in_group=1),
        PrefetchConfig(num_in_group=2),
        PrefetchConfig(group_size=4, num_in_group=2),
    ],
)
def test_budget_and_group_pattern_are_exclusive(config):
    with pytest.raises(ValueError, match=r"max_memory chooses the streamed layers itself.*prefetch_step"):
        parse_max_memory({0: "1GiB"}, None, config)


def test_prefetch_step_and_offload_params_go_with_a_budget():
    config = PrefetchConfig(prefetch_step=3, offload_params={"mlp"})
    assert parse_max_memory({0: "1GiB"}, None, config) is not None


# --- the device budget ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_memory, device, device_bytes, source",
    [
        ({0: "1GiB", 1: "2GiB"}, torch.device("cuda", 1), 2 * GiB, "max_memory[1]"),
        ({"cuda": "3GiB"}, torch.device("cuda", 0), 3 * GiB, "max_memory['cuda']"),
        ({0: "1GiB", "cpu": "4GiB"}, torch.device("cpu"), GiB, "max_memory[0]"),  # CPU: planned as that GPU
    ],
)
def test_resolve_budget_picks_the_execution_device(max_memory, device, device_bytes, source):
    budget = resolve_budget(parse_max_memory(max_memory, "100MiB"), device, tiny_llama(2))
    assert (budget.device_bytes, budget.reserve_bytes, budget.source) == (device_bytes, 100 * MiB, source)


@pytest.mark.parametrize(
    "max_memory, device, match",
    [
        ({1: "1GiB"}, torch.device("cuda", 0), r"names the GPUs \[1\] but the model executes on cuda:0"),
        ({0: "1GiB", 1: "1GiB"}, torch.device("cpu"), r"names the GPUs \[0, 1\] but the model executes on cpu"),
        ("auto", torch.device("cpu"), r"'auto' measures a CUDA device's free memory, but the model executes on cpu"),
        ({"cpu": "1GiB"}, torch.device("cpu"), r"only a 'cpu' entry, so it has no budget for the execution device"),
    ],
)
def test_resolve_budget_errors(max_memory, device, match):
    with pytest.raises(ValueError, match=match):
        resolve_budget(parse_max_memory(max_memory), device, tiny_llama(2))


def test_auto_is_free_plus_cached_plus_the_models_own_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * GiB)
    budget = resolve_budget(parse_max_memory({0: "auto", "cpu": "9GiB"}), torch.device("cuda", 0), tiny_llama(2))
    assert budget == MemoryBudget(6 * GiB, DEFAULT_RESERVE_BYTES, 9 * GiB, "free memory of cuda:0")


def test_a_single_gpu_entry_chooses_the_device(monkeypatch):
    assert memory_budget.device_argument(parse_max_memory({1: "1GiB"}), "cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_budget.device_argument(parse_max_memory({1: "1GiB"}), None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert memory_budget.device_argument(parse_max_memory({1: "1GiB"}), None) == 1
    assert memory_budget.device_argument(parse_max_memory({0: "1GiB", 1: "1GiB"}), None) is None


# --- the layout ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", range(1, 17))
def test_spread_is_strided_with_the_shortest_longest_run(num_layers):
    for num_streamed in range(num_layers + 1):
        indices = spread(num_layers, num_streamed)
        assert indices == sorted(set(indices)) and len(indices) == num_streamed
        assert all(0 <= i < num_layers for i in indices)
        flags = [i in indices for i in range(num_layers)]
        longest = max((len(list(run)) for streamed, run in itertools.groupby(flags) if streamed), default=0)
        assert longest == math.ceil(num_streamed / (num_layers - num_streamed + 1))


@pytest.mark.parametrize(
    "num_layers, num_streamed, expected",
    [
        (8, 1, [7]),  # later layers first, as the group pattern does
        (8, 4, [1, 3, 5, 7]),  # = group_size=2, num_in_group=1
        (8, 2, [3, 7]),  # = group_size=4, num_in_group=1
        (16, 4, [3, 7, 11, 15]),  # strided where group_size=8, num_in_group=2 bunches 6, 7, 14, 15
        (8, 6, [0, 1, 3, 4, 6, 7]),  # runs of 2 where group_size=4, num_in_group=3 has runs of 3
        (32, 20, spread(32, 20)),
    ],
)
def test_spread_examples(num_layers, num_streamed, expected):
    assert spread(num_layers, num_streamed) == expected


# --- plan_for_budget: fits, minimal, strided -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_subset():
    """(num_layers, prefetch_step) -> [(device bytes, streamed bytes per forward, pinned bytes)] of every subset."""
    cache = {}

    def table(num_layers, prefetch_step):
        if (num_layers, prefetch_step) not in cache:
            model = tiny_llama(num_layers)
            config = PrefetchConfig(prefetch_step=prefetch_step)
            plans = [make_plan(model, config, streamed=subset) for subset in _subsets(num_layers)]
            cache[num_layers, prefetch_step] = [
                (p.device_bytes, p.streamed_bytes_per_forward, p.offloaded_bytes) for p in plans
            ]
        return cache[num_layers, prefetch_step]

    return table


def _edge_budgets(model, prefetch_step):
    # Just enough and one byte short for every number of streamed layers: the budgets where the answer changes.
    n = len(model.model.layers)
    config = PrefetchConfig(prefetch_step=prefetch_step)
    needs = sorted({make_plan(model, config, streamed=spread(n, s)).device_bytes for s in range(n + 1)})
    return [RESERVE + need + delta for need in needs for delta in (-1, 0, 1000)] + [RESERVE + 10**9]


@pytest.mark.parametrize("num_layers", [8, 10])
@pytest.mark.parametrize("prefetch_step", [1, 2, 3])
def test_plan_fits_streams_the_fewest_bytes_and_is_strided(every_subset, num_layers, prefetch_step):
    model = tiny_llama(num_layers)
    config = PrefetchConfig(prefetch_step=prefetch_step)
    subsets = every_subset(num_layers, prefetch_step)
    for device_bytes in _edge_budgets(model, prefetch_step):
        budget = MemoryBudget(device_bytes, RESERVE)
        fitting = [streamed for device, streamed, _ in subsets if device + RESERVE <= device_bytes]
        if not fitting:
            with pytest.raises(ValueError, match="even streaming every layer"):
                plan_for_budget(model, budget, config)
            continue
        plan = plan_for_budget(model, budget, config)
        assert plan.device_bytes + RESERVE <= device_bytes
        assert plan.streamed_bytes_per_forward == min(fitting), device_bytes  # no subset streams less and fits
        num_streamed = len(plan.rings[0].streamed)
        assert plan.longest_run == math.ceil(num_streamed / (num_layers - num_streamed + 1))
        if num_streamed <= prefetch_step * (num_layers - num_streamed + 1):
            assert plan.longest_run <= prefetch_step
        assert plan.source is hf_prefetch.Source.BUDGET and plan.budget is budget
        # The same selection through the public explicit path gives the same plan.
        again = make_plan(model, config, streamed=_indices(plan))
        assert again.rings == plan.rings and again.resident_bytes == plan.resident_bytes


@pytest.mark.parametrize("prefetch_step", [1, 2, 4])
def test_sixteen_layers_from_tiny_to_generous(prefetch_step):
    model = tiny_llama(16)
    config = PrefetchConfig(prefetch_step=prefetch_step)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    everything = make_plan(model, config, streamed=[]).device_bytes
    previous = None
    for device_bytes in range(everything // 4, everything + 3 * layer_bytes, layer_bytes // 3):
        try:
            plan = plan_for_budget(model, MemoryBudget(device_bytes, RESERVE), config)
        except ValueError as err:
            assert previous is None and "even streaming every layer" in str(err)
            continue
        num_streamed = len(plan.rings[0].streamed)
        assert plan.device_bytes + RESERVE <= device_bytes
        assert _indices(plan) == spread(16, num_streamed)
        if num_streamed:  # one layer fewer (any of them: the layers are equal) does not fit
            fewer = make_plan(model, config, streamed=range(num_streamed - 1))
            assert fewer.device_bytes + RESERVE > device_bytes
        if num_streamed <= prefetch_step * (16 - num_streamed + 1):
            assert plan.longest_run <= prefetch_step
        assert previous is None or num_streamed <= previous  # more memory never streams more
        previous = num_streamed
    assert previous == 0  # generous: everything resident


def test_two_layer_lists_fit_together_with_the_fewest_bytes():
    arch = ARCHS_BY_NAME["t5"]
    model = dataclasses.replace(
        arch, config_kwargs={**arch.config_kwargs, "num_layers": 3, "num_decoder_layers": 3}
    ).build()
    paths = hf_prefetch.find_layer_lists(model)
    config = PrefetchConfig(prefetch_step=1)
    table = []
    for encoder in _subsets(3):
        for decoder in _subsets(3):
            p = make_plan(model, config, streamed={paths[0]: encoder, paths[1]: decoder})
            table.append((p.device_bytes, p.streamed_bytes_per_forward))
    # T5's first layers also hold the position bias, so the strided layout may stream those few bytes more than the
    # best of every subset; the counts per layer list are searched exactly.
    bias_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "relative_attention" in n)
    for device_bytes in sorted({device + RESERVE for device, _ in table}):
        plan = plan_for_budget(model, MemoryBudget(device_bytes, RESERVE), config)
        assert plan.device_bytes + RESERVE <= device_bytes
        least = min(s for d, s in table if d + RESERVE <= device_bytes)
        assert least <= plan.streamed_bytes_per_forward <= least + bias_bytes


# --- errors --------------------------------------------------------------------------------------------------------


def test_a_budget_too_small_even_fully_streamed_gives_the_numbers():
    model = tiny_llama(8)
    least = make_plan(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2)).device_bytes
    one_slot = make_plan(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=1)).device_bytes
    budget = MemoryBudget(least + RESERVE - 1, RESERVE, source="max_memory[0]")
    message = ".*".join(
        re.escape(part)
        for part in (
            f"LlamaForCausalLM does not fit max_memory[0] = {format_bytes(least + RESERVE - 1)}: after reserve_bytes",
            f"{format_bytes(RESERVE)} for activations and the KV cache",
            f"even streaming every layer needs {format_bytes(least)} on the device",
            f"Give the device at least {format_bytes(least + RESERVE)}, lower prefetch_step (prefetch_step=1 needs "
            f"{format_bytes(one_slot + RESERVE)} in all), lower reserve_bytes, or load the model in a smaller dtype.",
        )
    )
    with pytest.raises(ValueError, match=message):
        plan_for_budget(model, budget, PrefetchConfig(prefetch_step=2))
    plan_for_budget(model, MemoryBudget(least + RESERVE, RESERVE), PrefetchConfig(prefetch_step=2))  # just fits


@pytest.mark.parametrize("num_layers, prefetch_step", [(2, 2), (3, 4), (1, 1)])
def test_a_budget_too_small_where_streaming_cannot_help_says_so(num_layers, prefetch_step):
    # A pool of min(prefetch_step, streamed) slots, each a whole layer laid out at 4 KiB boundaries, is larger than
    # what the streamed layers free: the least device memory keeps every layer resident, and the message says that
    # plan and why, not "even streaming every layer".
    model = tiny_llama(num_layers)
    config = PrefetchConfig(prefetch_step=prefetch_step)
    resident, every = make_plan(model, config, streamed=[]), make_plan(model, config, streamed=range(num_layers))
    assert every.device_bytes > resident.device_bytes and not every.saves_device_memory
    budget = MemoryBudget(resident.device_bytes + RESERVE - 1, RESERVE, source="max_memory[0]")
    with pytest.raises(ValueError) as caught:
        plan_for_budget(model, budget, config)
    message = str(caught.value)
    assert "even streaming every layer" not in message
    every_layer = f"all {num_layers} layers" if num_layers > 1 else "its one layer"
    assert (
        f"is left for weights, but the least it can take on the device is all of it, "
        f"{format_bytes(resident.device_bytes)}, with every layer resident: streaming cannot help here, since the "
        "buffer pool that streamed layers need is at least as large as what they free (streaming "
        f"{every_layer} needs a pool of {format_bytes(every.pool_bytes)}, prefetch_step={prefetch_step} "
        f"slot{'s' if prefetch_step > 1 else ''} of one layer, to free {format_bytes(every.offloaded_bytes)}: "
        f"{format_bytes(every.device_bytes)} in all). Give the device at least "
        f"{format_bytes(resident.device_bytes + RESERVE)}, "
    ) in message
    one_slot = make_plan(model, PrefetchConfig(prefetch_step=1), streamed=range(num_layers)).device_bytes
    if one_slot < resident.device_bytes:  # fewer slots help: said, with what they need
        assert f"lower prefetch_step (prefetch_step=1 needs {format_bytes(one_slot + RESERVE)} in all)" in message
    else:
        assert "prefetch_step (" not in message and "lower prefetch_step" not in message
    plan_for_budget(model, MemoryBudget(resident.device_bytes + RESERVE, RESERVE), config)  # just fits: resident


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)


class _FirstLarger(torch.nn.Module):
    # Streaming the first block adds a buffer of its shape to each of the pool's slots, more than it frees.
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(128)] + [_Block(64) for _ in range(5)])


def test_a_budget_too_small_for_the_plan_that_streams_some_layers_describes_that_plan():
    model, config = _FirstLarger(), PrefetchConfig(prefetch_step=2)
    least = make_plan(model, config, "blocks", streamed=range(1, 6))
    every = make_plan(model, config, "blocks", streamed=range(6))
    assert least.device_bytes < every.device_bytes
    with pytest.raises(ValueError) as caught:
        plan_for_budget(model, MemoryBudget(least.device_bytes - 1, 0, source="max_memory[0]"), config, "blocks")
    assert (
        f"the plan that needs the least device memory streams 5 of 6 layers and needs "
        f"{format_bytes(least.device_bytes)}: {format_bytes(least.resident_bytes)} that stays resident"
    ) in str(caught.value)
    assert (
        f"and a buffer pool of {format_bytes(least.pool_bytes)} (prefetch_step=2 slots of one layer). Streaming more "
        f"layers does not lower it (streaming all 6 layers needs {format_bytes(every.device_bytes)}). Give the device "
        f"at least {format_bytes(least.device_bytes)}, "
    ) in str(caught.value)
    assert plan_for_budget(model, MemoryBudget(least.device_bytes, 0), config, "blocks").rings == least.rings


def test_a_reserve_larger_than_the_budget_is_an_error():
    with pytest.raises(ValueError, match=r"max_memory\[0\] = 1.0 MiB leaves nothing for weights after reserve_bytes"):
        plan_for_budget(tiny_llama(2), MemoryBudget(MiB, 2 * MiB, source="max_memory[0]"))


def test_a_host_budget_too_small_gives_the_numbers():
    model = tiny_llama(8)
    budget = MemoryBudget(RESERVE + make_plan(model, PrefetchConfig(), streamed=spread(8, 4)).device_bytes, RESERVE)
    pinned = make_plan(model, PrefetchConfig(), streamed=spread(8, 4)).host_bytes
    assert plan_for_budget(model, MemoryBudget(budget.device_bytes, RESERVE, pinned)).host_bytes == pinned
    small = MemoryBudget(budget.device_bytes, RESERVE, pinned - 1, "max_memory[0]")
    message = (
        rf"streams 4 layers and pins {format_bytes(pinned)} of host memory, but max_memory\['cpu'\] allows "
        rf"{format_bytes(pinned - 1)}. Raise max_memory\['cpu'\] to at least {format_bytes(pinned)}"
    )
    with pytest.raises(ValueError, match=message):
        plan_for_budget(model, small)


def test_the_host_budget_counts_the_arena_with_its_alignment_padding():
    # Each tensor starts at a TENSOR_ALIGN_BYTES boundary of the host arena: tiny_llama's 256-byte norms take 4 KiB
    # each, so the arena is larger than the values it holds. A max_memory['cpu'] between the two is refused before
    # anything is allocated, not exceeded by the arena.
    model, ids, logits = llama_and_logits(8)
    every = make_plan(model, PrefetchConfig(), streamed=range(8))
    sizes = [spec.nbytes for layer in every.rings[0].layers for spec in layer.offloaded]
    arena = HostArena.bytes_for(sizes)
    assert every.host_bytes == arena > every.offloaded_bytes == sum(sizes)
    device = every.device_bytes + RESERVE  # only streaming every layer fits the device
    message = (
        rf"streams 8 layers and pins {format_bytes(arena)} of host memory, but max_memory\['cpu'\] allows "
        rf"{format_bytes(arena - 1)}\. Raise max_memory\['cpu'\] to at least {format_bytes(arena)}"
    )
    short = dict(device="cpu", max_memory={0: device, "cpu": arena - 1}, reserve_bytes=RESERVE)
    with pytest.raises(ValueError, match=message):
        hf_prefetch.dispatch_model(model, **short)
    assert hf_prefetch.get_state(model) is None
    with pytest.raises(ValueError, match=message):
        hf_prefetch.plan(model, **short)
    hf_prefetch.dispatch_model(model, device="cpu", max_memory={0: device, "cpu": arena}, reserve_bytes=RESERVE)
    try:
        state = hf_prefetch.get_state(model)
        assert state.arena.nbytes == state.plan.host_bytes == arena  # what the plan said is what was allocated
        assert f"pinned host bytes      {format_bytes(arena)} of {format_bytes(arena)}" in str(state.plan)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_offload_params_that_match_nothing():
    with pytest.raises(ValueError, match=r"offload_params=\{'w2'\} matched no parameter"):
        plan_for_budget(tiny_llama(4), MemoryBudget(GiB, RESERVE), PrefetchConfig(offload_params={"w2"}))


def test_offload_params_with_a_budget_streams_only_those():
    model = tiny_llama(8)
    plan = plan_for_budget(model, MemoryBudget(900_000, RESERVE), PrefetchConfig(offload_params={"mlp"}))
    assert plan.rings[0].streamed and plan.device_bytes + RESERVE <= 900_000
    assert {spec.name.split(".")[0] for layer in plan.rings[0].streamed for spec in layer.offloaded} == {"mlp"}


# --- the public entry points ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    model, ids, logits = llama_and_logits(8)
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    return model, ids, logits, tokens


@pytest.mark.parametrize("num_streamed", [0, 1, 3, 4, 6, 8])
@pytest.mark.parametrize("prefetch_step", [1, 2])
def test_dispatch_with_max_memory_is_bitwise_equal(reference, num_streamed, prefetch_step):
    model, ids, logits, tokens = reference
    need = make_plan(model, PrefetchConfig(prefetch_step=prefetch_step), streamed=spread(8, num_streamed)).device_bytes
    max_memory = {0: need + RESERVE, "cpu": "1GiB"}
    hf_prefetch.dispatch_model(
        model,
        hf_prefetch.PrefetchConfig(prefetch_step=prefetch_step),
        device="cpu",
        max_memory=max_memory,
        reserve_bytes=RESERVE,
    )
    try:
        plan = hf_prefetch.get_state(model).plan
        assert plan.device_bytes + RESERVE <= need + RESERVE and plan.budget.source == "max_memory[0]"
        assert len(plan.rings[0].streamed) <= num_streamed
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).logits, logits)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        assert torch.equal(out, tokens)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_dispatch_with_max_memory_errors_before_touching_the_model(reference):
    model, ids, logits, _ = reference
    with pytest.raises(ValueError, match="max_memory chooses the streamed layers itself"):
        hf_prefetch.dispatch_model(
            model, hf_prefetch.PrefetchConfig(group_size=4), device="cpu", max_memory={0: "1GiB"}
        )
    with pytest.raises(ValueError, match="even streaming every layer"):
        hf_prefetch.dispatch_model(model, device="cpu", max_memory={0: 300_000}, reserve_bytes=RESERVE)
    assert hf_prefetch.get_state(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget_checkpoint")
    tiny_llama(8).save_pretrained(folder, max_shard_size="300KB")
    return folder


def test_from_pretrained_with_max_memory(reference, checkpoint):
    model, ids, logits, tokens = reference
    max_memory = {"cuda:0": 1_000_000, "cpu": "10MiB"}
    preview = hf_prefetch.plan(checkpoint, max_memory=max_memory, reserve_bytes=RESERVE, device="cpu")
    expected = plan_for_budget(model, MemoryBudget(1_000_000, RESERVE, 10 * MiB, "max_memory[0]"))
    assert preview == expected and _indices(preview) == [1, 3, 5, 7]
    loaded = hf_prefetch.from_pretrained(checkpoint, device="cpu", max_memory=max_memory, reserve_bytes=RESERVE)
    assert hf_prefetch.get_state(loaded).plan == preview
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
    out = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, tokens)


def test_load_checkpoint_and_dispatch_with_max_memory(reference, checkpoint):
    _, ids, logits, _ = reference
    with init_empty_weights():
        model = tiny_llama(8)
    model = hf_prefetch.load_checkpoint_and_dispatch(
        model,
        checkpoint,
        hf_prefetch.PrefetchConfig(prefetch_step=1),
        device="cpu",
        max_memory={0: 1_200_000},
        reserve_bytes=RESERVE,
    )
    assert _indices(hf_prefetch.get_state(model).plan) == spread(8, 2)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_from_pretrained_refuses_an_impossible_budget_before_reading(checkpoint):
    with pytest.raises(ValueError, match=r"does not fit max_memory\[0\]"):
        hf_prefetch.from_pretrained(checkpoint, device="cpu", max_memory={0: 300_000}, reserve_bytes=RESERVE)
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\] allows"):
        hf_prefetch.from_pretrained(
            checkpoint, device="cpu", max_memory={0: 1_000_000, "cpu": 1000}, reserve_bytes=RESERVE
        )
