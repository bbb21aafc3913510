"""Several host links (hf_prefetch/planning/links.py): the cut of a layer's bytes between links, the engine copying
through helper staging buffers (on the CPU: synchronously, the same pieces and buffers), GPU selection and its errors,
and the plan. Real copies over two GPUs: tests/test_gpu.py (two GPUs)."""

from __future__ import annotations

import pytest
import torch

import hf_prefetch
from hf_prefetch.alignment import LINK_SHARE_ALIGN_BYTES
from hf_prefetch.config import PrefetchConfig
from hf_prefetch.planning.choose import choose_plan
from hf_prefetch.planning.links import STAGES, resolve_links, split_bytes
from hf_prefetch.planning.memory import parse_max_memory
from hf_prefetch.runtime.engine import PrefetchEngine
from hf_prefetch.runtime.pool import BufferPool
from hf_prefetch.runtime.ring import LayerTransfer, RingTransfers
from hf_prefetch.runtime.shared_links import SharedLinks
from tests.engines import copies, misses
from tests.models import tiny_llama

CPU = torch.device("cpu")


def _pairs(sizes: list[int], seed: int = 0) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(destination buffer, pairs): each pair's destination a consecutive view of one zeroed buffer."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.zeros(sum(sizes), dtype=torch.uint8)
    pairs, offset = [], 0
    for n in sizes:
        pairs.append((out[offset : offset + n], torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)))
        offset += n
    return out, pairs


@pytest.mark.parametrize("num_links", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "sizes", [[1], [7], [513, 1], [4096] * 3, [100_000, 3, 70_001, 512], [0, 5000, 0], [1 << 20, 12345]]
)
def test_the_ranges_cover_every_byte_once_in_near_equal_aligned_shares(sizes, num_links):
    out, pairs = _pairs(sizes)
    ranges = split_bytes(pairs, num_links)
    assert len(ranges) == num_links
    written = torch.zeros(out.numel(), dtype=torch.int64)
    total = out.numel()
    for r, pieces in enumerate(ranges):
        share = 0
        for dst, src in pieces:
            dst.copy_(src)
            begin = dst.data_ptr() - out.data_ptr()
            written[begin : begin + dst.numel()] += 1
            share += dst.numel()
        if r > 0 and pieces:  # a range starts at a cut, on an aligned byte
            assert (pieces[0][0].data_ptr() - out.data_ptr()) % LINK_SHARE_ALIGN_BYTES == 0
        assert share <= -(-total // num_links) + LINK_SHARE_ALIGN_BYTES  # near-equal shares
    assert bool((written == 1).all())  # every byte written exactly once ...
    assert torch.equal(out, torch.cat([src for _, src in pairs]))  # ... with its own value


def test_a_pair_that_is_not_contiguous_goes_whole_to_the_execution_devices_link():
    dst = torch.zeros(4, 3).t()
    src = torch.arange(12.0).reshape(4, 3).t()
    _, plain = _pairs([4096])
    ranges = split_bytes([(dst, src), *plain], 2)
    assert ranges[0][0][0] is dst and ranges[0][0][1] is src
    assert sum(d.numel() for d, _ in ranges[0][1:]) == sum(d.numel() for d, _ in ranges[1]) == 2048


# Layers of a few KiB: two dtypes, one transposed (non-contiguous) layout, one odd size.
KEYS = [
    ("w", (64, 48), (48, 1), torch.float32),
    ("wt", (32, 40), (1, 32), torch.float64),
    ("i", (1001,), (1,), torch.int32),
    ("h", (3, 7), (7, 1), torch.bfloat16),
]


def values(layer: int, version: int = 0) -> list[torch.Tensor]:
    """Distinct values for every layer and version, in each key's exact layout."""
    out = []
    for index, (_, shape, stride, dtype) in enumerate(KEYS):
        value = torch.arange(torch.Size(shape).numel()).reshape(shape) % 97 + 100 * layer + 10 * index + 7 * version
        out.append(torch.empty_strided(shape, stride, dtype=dtype).copy_(value))
    return out


def _engine(num_layers: int, num_slots: int, helpers: int) -> PrefetchEngine:
    pool = BufferPool(KEYS, num_slots, CPU)
    layers = []
    for k in range(num_layers):
        host = values(k)
        following = k + num_slots if k + num_slots < num_layers else k % num_slots
        device = [pool.buffer(key, k % num_slots) for key in KEYS]
        layers.append(LayerTransfer(host, device, k % num_slots, following, sum(t.nbytes for t in host)))
    engine = PrefetchEngine(CPU, [RingTransfers(layers, pool)], pinned=False, links=[CPU] * helpers)
    engine.start()
    return engine


def run(engine: PrefetchEngine, order: list[int], version: int = 0) -> None:
    """Run the layers in `order` as their hooks do, checking each slot holds its layer's values when it computes."""
    for position in order:
        engine.wait(0, position)
        layer = engine.rings[0].layers[position]
        for got, want in zip(layer.device, values(position, version), strict=True):
            assert torch.equal(got, want) and got.stride() == want.stride()
        engine.release(0, position)


@pytest.mark.parametrize("helpers", [1, 2])
@pytest.mark.parametrize("num_layers, num_slots", [(1, 1), (3, 2), (5, 3), (8, 2)])
def test_every_layer_computes_with_its_own_values_through_shared_links(num_layers, num_slots, helpers):
    engine = _engine(num_layers, num_slots, helpers)
    for _ in range(3):
        run(engine, list(range(num_layers)))  # checks every slot's values before each layer computes
    assert misses(engine) == 0
    links = engine._links
    assert links.num_links == 1 + helpers and all(len(h.staging) == STAGES for h in links.helpers)
    # Each helper carried its share of every copy: of the contiguous parameters (KEYS' transposed one stays on the
    # execution device's link), about 1 / (1 + helpers).
    contiguous = sum(
        torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        for _, shape, stride, dtype in KEYS
        if stride == torch.empty(shape).stride()
    )
    for helper in links.helpers:
        per_copy = helper.copied_bytes / sum(copies(engine))
        assert (
            contiguous / (1 + helpers) - LINK_SHARE_ALIGN_BYTES
            <= per_copy
            <= contiguous / (1 + helpers) + LINK_SHARE_ALIGN_BYTES
        )


def test_a_skipped_layer_is_a_miss_and_loads_its_own_values_with_shared_links():
    engine = _engine(6, 2, 1)
    run(engine, [0, 1, 3, 2, 4, 5, 5])
    assert misses(engine) > 0
    run(engine, list(range(6)))


def test_refill_after_rewriting_host_storage_gives_the_new_values_with_shared_links():
    engine = _engine(4, 2, 1)
    run(engine, list(range(4)))
    for layer, transfer in enumerate(engine.rings[0].layers):
        for host, new in zip(transfer.host, values(layer, version=1), strict=True):
            host.copy_(new)
    engine.refill()
    run(engine, list(range(4)), version=1)
    assert misses(engine) == 0


def test_staging_buffers_hold_the_largest_share():
    _, pairs = _pairs([10_000, 3000, 1])
    links = SharedLinks(CPU, [CPU, CPU], [pairs])
    largest = max(sum(d.numel() for d, _ in pieces) for pieces in split_bytes(pairs, 3)[1:])
    assert links.staging_bytes >= STAGES * largest
    rest = links.copy(pairs, non_blocking=False)
    for dst, src in rest:
        dst.copy_(src)
    for dst, src in pairs:
        assert torch.equal(dst, src)


# --- Choosing the GPUs -------------------------------------------------------------------------------------------


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake CUDA devices with peer access, for choosing links without a GPU."""
    access = {(0, 1): True, (1, 0): True}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access.get((a, b), False))
    return access


CUDA0 = torch.device("cuda", 0)


def test_links_name_the_execution_device_first(two_gpus):
    assert resolve_links([0, 1], CUDA0) == (0, 1)
    assert resolve_links(["cuda:1"], CUDA0) == (0, 1)
    assert resolve_links([torch.device("cuda", 1), 1], CUDA0) == (0, 1)
    assert resolve_links("all", CUDA0) == (0, 1)
    assert resolve_links("all", torch.device("cuda", 1)) == (1, 0)
    assert resolve_links(None, CUDA0) == ()
    assert resolve_links([0], CUDA0) == ()  # the execution device's link alone


@pytest.mark.parametrize(
    "links, message",
    [
        ([2], "names GPU 2, but this machine has 2 CUDA device"),
        (["cpu"], "contains 'cpu'"),
        ([-1], "contains -1"),
        ("cuda:1", "must be 'all' or a list of GPUs"),
        (1, "must be 'all' or a list of GPUs"),
        ([True], "contains True"),
    ],
)
def test_a_wrong_link_is_refused_with_the_value_and_the_fix(two_gpus, links, message):
    with pytest.raises(ValueError, match=message):
        resolve_links(links, CUDA0)


def test_a_gpu_without_peer_access_is_refused(two_gpus):
    two_gpus[(1, 0)] = False
    with pytest.raises(ValueError, match=r"GPU 1 has no peer access .*can_device_access_peer\(1, 0\) is False"):
        resolve_links([0, 1], CUDA0)
    assert resolve_links("all", CUDA0) == ()  # "all" takes only the GPUs it can reach


def test_links_on_the_cpu_are_refused_and_nothing_is_dispatched():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"links=\[0, 1\] .* executes on cpu"):
        hf_prefetch.dispatch_model(model, device="cpu", links=[0, 1])
    assert hf_prefetch.get_state(model) is None
    with pytest.raises(ValueError, match="not with UVA"):
        hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu", links=[0, 1])
    assert hf_prefetch.get_state(model) is None


# --- The plan ----------------------------------------------------------------------------------------------------


def test_the_plan_shows_each_gpus_bytes_and_the_time_over_both_links():
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    config = PrefetchConfig(group_size=2, num_in_group=1)
    one = choose_plan(model, config, None, CPU, None)
    two = choose_plan(model, config, None, CPU, None, links=(0, 1))
    assert two.links == (0, 1) and two.num_links == 2
    assert (two.resident_bytes, two.pool_bytes) == (one.resident_bytes, one.pool_bytes)
    largest = max(layer.offloaded_bytes for ring in two.rings for layer in ring.streamed)
    assert STAGES * largest / 2 <= two.staging_bytes <= STAGES * (largest / 2 + 64 * LINK_SHARE_ALIGN_BYTES)
    one = one.__class__(**{**one.__dict__, "link_gbps": 50.0})
    two = two.__class__(**{**two.__dict__, "link_gbps": 50.0})
    assert two.transfer_seconds_per_forward == pytest.approx(one.transfer_seconds_per_forward / 2)
    text = str(two)
    assert "cuda:0" in text and "cuda:1" in text and "staging" in text and "2 x 50.0 GB/s" in text
    assert "cuda:1" not in str(one)


def test_a_link_gpus_budget_must_hold_its_staging_buffers():
    with torch.device("meta"):
        model = tiny_llama(num_layers=8)
    config = PrefetchConfig()
    budget = parse_max_memory({0: 1_300_000, 1: 1000}, reserve_bytes=100_000)
    with pytest.raises(ValueError, match=r"max_memory\[1\] = 1000 B cannot hold GPU 1's staging buffers"):
        choose_plan(model, config, None, CPU, budget, links=(0, 1))
    roomy = parse_max_memory({0: 1_300_000, 1: "1GiB"}, reserve_bytes=100_000)
    plan = choose_plan(model, config, None, CPU, roomy, links=(0, 1))
    assert plan.budget.device_bytes == 1_300_000 and plan.links == (0, 1) and plan.staging_bytes > 1000
