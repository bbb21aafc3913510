import pytest
import torch
from models import prompt, tiny_llama

import hf_prefetch


def test_counts_follow_the_slot_plan():
    model = tiny_llama(8)
    ids = prompt()
    hf_prefetch.dispatch_model(model, device="cpu", group_size=2, num_in_group=1, prefetch_step=2)
    try:
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
        s = hf_prefetch.stats(model)
        assert (s.copies, s.copied_bytes, s.misses) == (2, 2 * layer_bytes, 0)  # the first two slots are filled
        with torch.no_grad():
            model(ids)
            model(ids)
        s = hf_prefetch.stats(model)
        # every streamed layer hands its slot on once per forward
        assert (s.copies, s.misses) == (2 + 2 * 4, 0)
        assert [layer.copies for layer in s.layers] == [3, 3, 2, 2]
        assert not s.timing and s.copy_seconds == 0.0
        assert "model.layers.7" in str(s) and "timing=True" in str(s)
        hf_prefetch.reset_stats(model)
        assert hf_prefetch.stats(model).copies == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_timing_on_cpu_counts_copy_and_stall_seconds():
    model = tiny_llama(4)
    hf_prefetch.dispatch_model(model, device="cpu", group_size=1, num_in_group=1, prefetch_step=1, timing=True)
    try:
        with torch.no_grad():
            model(prompt())
        s = hf_prefetch.stats(model)
        assert s.timing and s.copies == 5
        assert s.copy_seconds > 0 and s.stall_seconds == pytest.approx(s.copy_seconds)
        assert s.compute_seconds > 0 and all(layer.compute_seconds > 0 for layer in s.layers)
        assert s.gbps > 0
        html = s._repr_html_()
        assert html.startswith("<table>") and "model.layers.3" in html
    finally:
        hf_prefetch.remove_offload(model)


def test_stats_of_an_undispatched_model_is_an_error():
    with pytest.raises(ValueError, match="not dispatched"):
        hf_prefetch.stats(tiny_llama(2))


@pytest.mark.gpu
def test_timing_on_cuda_matches_untimed_tokens():
    model = tiny_llama(8, dtype=torch.bfloat16).cuda()
    ids = prompt().cuda()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    hf_prefetch.dispatch_model(model, group_size=2, num_in_group=1, prefetch_step=2, timing=True)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert torch.equal(out, expected)
        s = hf_prefetch.stats(model)
        assert s.misses == 0 and s.copies > 4 * 32
        assert s.copy_seconds > 0 and s.gbps > 0 and s.stall_seconds >= 0
    finally:
        hf_prefetch.remove_offload(model)
