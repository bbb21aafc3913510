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
from hf_prefetch.planning.memory import MemoryBudget
from hf_prefetch.planning.offload_plan import OffloadPlan, format_bytes, render_html, render_text
from hf_prefetch.planning.placements import LayerPlan, ParamSpec, Placement, RingPlan

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
