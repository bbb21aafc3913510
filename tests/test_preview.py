"""`hf_prefetch.plan`: the plan a dispatch or a load would execute, for a model or a checkpoint folder."""

from __future__ import annotations

import re

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.planning.selection import make_plan
from tests.models import tiny_llama

RESERVE = 10_000


def test_plan_previews_dispatch():
    model = tiny_llama(8)
    preview = hf_prefetch.plan(model, max_memory={0: 1_000_000}, reserve_bytes=RESERVE, device="cpu")
    assert preview.link_gbps is None and "transfer per forward" not in str(preview)
    hf_prefetch.dispatch_model(model, device="cpu", max_memory={0: 1_000_000}, reserve_bytes=RESERVE)
    try:
        assert hf_prefetch.get_state(model).plan == preview
    finally:
        hf_prefetch.remove_offload(model)
    assert hf_prefetch.plan(model, device="cpu") == make_plan(model, PrefetchConfig())  # no budget: the pattern
    assert hf_prefetch.plan(
        model, hf_prefetch.PrefetchConfig(group_size=4, num_in_group=2), device="cpu"
    ) == make_plan(model, PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2))


def test_plan_of_a_checkpoint_folder_builds_the_model_as_the_loader_does(tmp_path):
    tiny_llama(8).save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = tiny_llama(8)
    assert hf_prefetch.plan(tmp_path, device="cpu") == make_plan(skeleton, PrefetchConfig())
    half = hf_prefetch.plan(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert half.offloaded_bytes * 2 == make_plan(skeleton, PrefetchConfig()).offloaded_bytes
    loaded = hf_prefetch.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert hf_prefetch.get_state(loaded).plan == half
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_prefetch.plan(tmp_path / "nothing", device="cpu")


def test_plan_table_and_html_show_the_budget_and_the_transfer_time():
    with torch.device("meta"):
        model = tiny_llama(8)
    plan = hf_prefetch.plan(
        model, max_memory={0: 1_000_000, "cpu": "1GiB"}, reserve_bytes=RESERVE, device="cpu", link_gbps=0.5
    )
    text = str(plan)
    assert re.search(r"model\.layers\.7\s+streamed", text)
    seconds = plan.streamed_bytes_per_forward / 0.5e9
    assert plan.transfer_seconds_per_forward == seconds
    assert f"transfer per forward   {seconds * 1e3:.2f} ms at 0.5 GB/s" in text
    assert "device budget          976.6 KiB (max_memory[0]): 9.8 KiB reserved" in text
    assert "of 1.00 GiB (max_memory['cpu'])" in text and "longest run 1 (to fit the budget, prefetch_step=2)" in text
    html = plan._repr_html_()
    assert html.startswith("<table>") and "model.layers.7" in html and "transfer per forward" in html


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(link_gbps=0), r"link_gbps=0 must be > 0"),
        (dict(link_gbps="fast"), r"link_gbps='fast' must be a number of GB/s"),
        (dict(dtype=torch.bfloat16), r"dtype= describes how a checkpoint is found and built; a built model"),
        (dict(revision="main", attn_implementation="eager"), r"revision= and attn_implementation= describe how a"),
        (
            dict(token="x", subfolder="a", trust_remote_code=True),
            r"token=, subfolder= and trust_remote_code= describe",
        ),
        (
            dict(max_memory={0: "1GiB"}, offload=PrefetchConfig(group_size=4)),
            r"max_memory chooses the streamed layers",
        ),
        (dict(max_memory={}), r"max_memory=\{\} gives no budget"),
        (dict(max_memory={"cpu": "64GiB"}), r"only a 'cpu' entry, so it has no budget for the execution device"),
        (dict(max_memory={0: "1e400GB"}), r"max_memory\[0\]='1e400GB' is not a size"),
        (dict(group_size=2), r"pass the configuration as an object"),
    ],
)
def test_plan_argument_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        hf_prefetch.plan(tiny_llama(2), device="cpu", **kwargs)


def test_plan_of_a_folder_takes_the_loaders_keywords(tmp_path):
    tiny_llama(4).save_pretrained(tmp_path / "text_model")
    with torch.device("meta"):
        skeleton = tiny_llama(4)
    assert hf_prefetch.plan(tmp_path, device="cpu", subfolder="text_model") == make_plan(skeleton, PrefetchConfig())
    assert hf_prefetch.plan(tmp_path / "text_model", device="cpu", attn_implementation="eager") == make_plan(
        skeleton, PrefetchConfig()
    )
    with pytest.raises(ValueError, match=r"revision='v1' choose what is read from the Hugging Face Hub"):
        hf_prefetch.plan(tmp_path / "text_model", device="cpu", revision="v1")
    with pytest.raises(ValueError, match=r"trust_remote_code=True is not supported yet"):
        hf_prefetch.plan(tmp_path / "text_model", device="cpu", trust_remote_code=True)
