"""The plan renderer (hf_prefetch/planning/offload_plan.py) on hand-made plans, cell by cell: what
tests/planning/test_selection.py, test_preview.py and test_uva.py do not check (the `next` column names layer indices,
layers that own their slot, several rings, a negative spare, HTML escaping, the text and the HTML saying the same)."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest
import torch

from hf_prefetch import PrefetchConfig, Source
from hf_prefetch.formats.lossless import layout_of
from hf_prefetch.planning.memory import MemoryBudget
from hf_prefetch.planning.offload_plan import (
    OffloadPlan,
    compresses_nothing,
    format_bytes,
    no_saving,
    render_html,
    render_text,
)
from hf_prefetch.planning.placements import LayerPlan, ParamSpec, Placement, RingPlan, Routing

KiB, MiB = 2**10, 2**20
STREAMED = Placement.STREAMED


def spec(name: str, nbytes: int, placement: Placement = Placement.RESIDENT) -> ParamSpec:
    return ParamSpec(name, (nbytes // 4,), (1,), torch.float32, nbytes, placement)


def streamed(path, index, position, slot, next_in_slot, *extra):
    return LayerPlan(path, index, (spec("w", 2 * MiB, STREAMED), *extra), position, slot, next_in_slot)


ENCODER = RingPlan(
    "enc",
    (
        LayerPlan("enc.0", 0, (spec("w", 1 * MiB),)),
        streamed("enc.1", 1, 0, 0, 2, spec("norm", 4 * KiB)),  # hands slot 0 to position 2: layer enc.3
        streamed("enc.2", 2, 1, 1, 1),  # alone in slot 1
        streamed("enc.3", 3, 2, 0, 0),  # hands slot 0 back to position 0: layer enc.1
    ),
    num_slots=2,
)
DECODER = RingPlan(
    "dec<&>",
    (
        LayerPlan("dec<&>.0", 0, (spec("w", 512 * KiB, STREAMED),), 0, 0, 0),
        LayerPlan("dec<&>.1", 1, (spec("w", 512 * KiB),)),
    ),
    num_slots=1,
)
PLAN = OffloadPlan(PrefetchConfig(prefetch_step=2), (ENCODER, DECODER), resident_bytes=3 * MiB, source=Source.EXPLICIT)

ROWS = [
    ["layer", "placement", "resident", "host", "slot", "next"],
    ["enc.0", "resident", "1.0 MiB", "-", "-", "-"],
    ["enc.1", "streamed", "4.0 KiB", "2.0 MiB", "0", "3"],  # `next` is the layer's index, not its position (2)
    ["enc.2", "own slot", "0 B", "2.0 MiB", "1", "-"],
    ["enc.3", "streamed", "0 B", "2.0 MiB", "0", "1"],
    ["dec<&>.0", "own slot", "0 B", "512.0 KiB", "0", "-"],
    ["dec<&>.1", "resident", "512.0 KiB", "-", "-", "-"],
]
TOTALS = [
    ("streamed layers", "4 of 6, longest run 3 (chosen layers, prefetch_step=2)"),
    ("resident bytes", "3.0 MiB"),
    ("pool bytes", "4.5 MiB (2/1 slots)"),  # 2 MiB x 2 slots + 512 KiB x 1 slot
    ("device bytes", "7.5 MiB (resident + pool)"),
    ("pinned host bytes", "6.5 MiB"),
    ("streamed per forward", "4.0 MiB (2 layers own a slot: copied once)"),  # enc.1 and enc.3 only
]


WIDTHS = (32, 13, 11, 11, 4, 5)  # the columns' fixed widths, one space apart


def text_rows(text: str) -> list[list[str]]:
    """The table's cells, read at their fixed places."""
    rows = []
    for line in text.split("\n\n")[0].splitlines():
        cells, start = [], 0
        for width in WIDTHS:
            cells.append(line[start : start + width].strip())
            assert start == 0 or line[start - 1 : start] in ("", " ")
            start += width + 1
        assert len(line) <= start - 1
        rows.append(cells)
    return rows


def text_totals(text: str) -> list[tuple[str, str]]:
    return [(line[:22].strip(), line[23:]) for line in text.split("\n\n")[1].splitlines()]


def html_rows(page: str) -> list[list[str]]:
    first = page.split("</table>")[0]
    return [
        [html.unescape(cell) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", first)
    ]


def html_totals(page: str) -> list[tuple[str, str]]:
    second = page.split("</table>")[1]
    return [
        (html.unescape(a), html.unescape(b)) for a, b in re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", second)
    ]


def test_the_text_table_cell_by_cell():
    text = render_text(PLAN)
    assert text == str(PLAN)
    assert text_rows(text) == ROWS
    assert text_totals(text) == TOTALS
    assert text.splitlines()[2] == "enc.1" + " " * 28 + "streamed" + " " * 6 + "    4.0 KiB     2.0 MiB    0     3"


def test_the_html_says_what_the_text_says_and_escapes_it():
    page = render_html(PLAN)
    assert page == PLAN._repr_html_()
    assert html_rows(page) == ROWS
    assert html_totals(page) == TOTALS
    assert "<td>dec&lt;&amp;&gt;.0</td>" in page and "dec<&>" not in page


def test_budget_and_link_lines():
    budget = MemoryBudget(device_bytes=8 * MiB, reserve_bytes=1 * MiB, host_bytes=8 * MiB, source="max_memory[0]")
    plan = dataclasses.replace(PLAN, budget=budget, link_gbps=2.0)
    totals = dict(text_totals(render_text(plan)))
    # 8 MiB - 1 MiB reserved - 7.5 MiB on the device: the plan is over budget by 512 KiB.
    assert totals["device budget"] == (
        "8.0 MiB (max_memory[0]): 1.0 MiB reserved for activations and the KV cache, -512.0 KiB spare"
    )
    assert totals["pinned host bytes"] == "6.5 MiB of 8.0 MiB (max_memory['cpu'])"
    assert totals["transfer per forward"] == f"{4 * MiB / 2e9 * 1e3:.2f} ms at 2.0 GB/s" == "2.10 ms at 2.0 GB/s"
    assert dict(html_totals(render_html(plan))) == totals
    no_host = dataclasses.replace(plan, budget=dataclasses.replace(budget, host_bytes=None))
    assert dict(text_totals(render_text(no_host)))["pinned host bytes"] == "6.5 MiB"


@pytest.mark.parametrize(
    "source, config, chosen",
    [
        (Source.STRIDE, PrefetchConfig(group_size=4, num_in_group=3, prefetch_step=3),
         "group_size=4, num_in_group=3, prefetch_step=3"),
        (Source.BUDGET, PrefetchConfig(prefetch_step=1), "to fit the budget, prefetch_step=1"),
        (Source.EXPLICIT, PrefetchConfig(offload_params={"mlp", "attn"}),
         "chosen layers, prefetch_step=2, offload_params=['attn', 'mlp']"),
    ],
)  # fmt: skip
def test_how_the_layers_were_chosen(source, config, chosen):
    plan = dataclasses.replace(PLAN, source=source, config=config)
    assert dict(text_totals(render_text(plan)))["streamed layers"] == f"4 of 6, longest run 3 ({chosen})"


def test_a_plan_that_streams_nothing():
    resident = RingPlan("layers", (LayerPlan("layers.0", 0, (spec("w", 100),)),), num_slots=0)
    text = render_text(OffloadPlan(PrefetchConfig(), (resident,), resident_bytes=100))
    assert text_rows(text)[1] == ["layers.0", "resident", "100 B", "-", "-", "-"]
    totals = dict(text_totals(text))
    assert totals["streamed layers"].startswith("0 of 1, longest run 0")
    assert totals["pool bytes"] == "0 B (0 slots)" and totals["streamed per forward"] == "0 B"
    assert totals["saves nothing"].startswith("no layer streams: ")


def _resident_plan(num_layers, config, **kwargs):
    layers = tuple(LayerPlan(f"layers.{i}", i, (spec("w", 100),)) for i in range(num_layers))
    return OffloadPlan(config, (RingPlan("layers", layers, num_slots=0),), resident_bytes=100 * num_layers, **kwargs)


@pytest.mark.parametrize(
    "plan, why",
    [
        # The group pattern's streamed layers (the last num_in_group of each group) lie past a short layer list.
        (_resident_plan(2, PrefetchConfig(group_size=4, num_in_group=1)),
         "group_size=4, num_in_group=1 streams the last 1 of every 4 layers, and layers has 2: every weight stays on "
         "the device. Lower group_size, or pass max_memory to stream what does not fit."),
        (_resident_plan(3, PrefetchConfig(), source=Source.BUDGET, budget=MemoryBudget(2 * MiB, MiB, None, "cuda:0")),
         "all of the model fits cuda:0 = 2.0 MiB (with reserve_bytes = 1.0 MiB), so every weight stays on the "
         "device. Run it without hf_prefetch, or give a smaller max_memory."),
        # Layers selected (index 3 of a group of 4), none of whose parameters can leave the device.
        (_resident_plan(4, PrefetchConfig(group_size=4, num_in_group=1)),
         "no parameter of the layers that group_size=4, num_in_group=1, prefetch_step=2 selects can leave the device"),
        (_resident_plan(4, PrefetchConfig(), source=Source.EXPLICIT),
         "no layer was chosen, or no parameter of the chosen layers can leave the device"),
    ],
)  # fmt: skip
def test_a_plan_that_streams_nothing_says_why_and_that_it_saves_nothing(plan, why):
    assert not plan.saves_device_memory and plan.offloaded_bytes == 0
    assert no_saving(plan).startswith(f"no layer streams: {why}")
    assert dict(text_totals(render_text(plan)))["saves nothing"] == no_saving(plan)
    assert dict(html_totals(render_html(plan)))["saves nothing"] == no_saving(plan)


def test_a_plan_whose_pool_is_as_large_as_what_it_offloads_says_so():
    own = RingPlan("r", tuple(streamed(f"r.{i}", i, i, i, i) for i in range(3)), num_slots=3)  # each alone in a slot
    plan = OffloadPlan(PrefetchConfig(prefetch_step=3), (own,), resident_bytes=MiB, source=Source.EXPLICIT)
    assert not plan.saves_device_memory and plan.offloaded_bytes
    why = (
        f"its buffer pool ({format_bytes(plan.pool_bytes)}) is as large as what it offloads "
        f"({format_bytes(plan.offloaded_bytes)}). Stream more layers than prefetch_step (or lower prefetch_step), or "
        "do not offload."
    )
    assert no_saving(plan) == why == dict(text_totals(render_text(plan)))["saves nothing"]
    assert no_saving(PLAN) is None and "saves nothing" not in render_text(PLAN)


def test_with_compress_the_streamed_tensors_kept_plain_are_counted_by_reason():
    def bf16(name, shape, placement=STREAMED, **kwargs):
        stride = kwargs.pop("stride", (shape[1], 1))
        return ParamSpec(name, shape, stride, torch.bfloat16, 2 * shape[0] * shape[1], placement, **kwargs)

    big = (256, 256)
    compressed = dataclasses.replace(bf16("w", big), compressed=layout_of(torch.bfloat16, 256 * 256))
    params = (
        compressed,
        bf16("norm", (1, 64)),  # too small
        dataclasses.replace(bf16("half", big), dtype=torch.float16),
        bf16("experts", big, Placement.ROUTED, routing=Routing("mlp.experts", 4, 2, "top_k_index")),
        bf16("q:qdata", big),  # an inner tensor of a tensor subclass
        bf16("t", big, stride=(1, 256)),  # transposed
        bf16("spread", big),  # could be compressed, but its values were not (too many escapes)
        bf16("resident", big, Placement.RESIDENT),  # not streamed: not counted
    )
    ring = RingPlan(
        "r",
        (
            LayerPlan("r.0", 0, params, 0, 0, 1),
            LayerPlan("r.1", 1, (bf16("w", big),), 1, 0, 0),
            LayerPlan("r.2", 2, (bf16("w", big),), 2, 1, 2),  # alone in slot 1
        ),
        num_slots=2,
    )
    plan = OffloadPlan(PrefetchConfig(compress=True), (ring,), resident_bytes=0, source=Source.EXPLICIT)
    assert plan.kept_plain == {
        "under the codec's minimum of 16384 elements": 1,
        "of dtype float16, not bfloat16 or float32": 1,
        "routed experts, copied row by row": 1,
        "parts of a parameter stored as several tensors": 1,
        "not dense in row-major order": 1,
        "whose values have too many rare exponents for their layout": 2,  # spread, and r.1's w
        "in layers alone in their slot, which are copied once": 1,
    }
    assert compresses_nothing(plan) is None  # one is compressed: nothing to warn about
    assert dict(text_totals(render_text(plan)))["kept plain"].startswith("8 streamed tensors: 1 under the codec's")
    plain = OffloadPlan(PrefetchConfig(compress=True), (dataclasses.replace(ring, layers=ring.layers[1:]),), 0)
    assert compresses_nothing(plain) == (
        "all 2 streamed tensors stay plain (1 whose values have too many rare exponents for their layout; 1 in layers "
        "alone in their slot, which are copied once)"
    )
    assert dict(text_totals(render_text(plain)))["compressed"] == f"nothing: {compresses_nothing(plain)}"
    off = dataclasses.replace(plan, config=PrefetchConfig())
    assert off.kept_plain == {} and compresses_nothing(off) is None and "kept plain" not in render_text(off)


def test_one_layer_that_owns_its_slot_is_singular():
    plan = dataclasses.replace(PLAN, rings=(ENCODER,))
    assert dict(text_totals(render_text(plan)))["streamed per forward"] == "4.0 MiB (1 layer owns a slot: copied once)"


@pytest.mark.parametrize(
    "num_bytes, text",
    [
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (MiB - 1, "1024.0 KiB"),
        (MiB, "1.0 MiB"),
        (2**30 - 1, "1024.0 MiB"),
        (2**30, "1.00 GiB"),
        (5 * 2**40, "5120.00 GiB"),
        (-1536, "-1.5 KiB"),
        (-3 * MiB, "-3.0 MiB"),
        (-5, "-5 B"),
    ],
)
def test_format_bytes_at_the_unit_boundaries_and_below_zero(num_bytes, text):
    assert format_bytes(num_bytes) == text
