import subprocess
import sys

import pytest
import torch

import hf_prefetch
from hf_prefetch.stats import LayerStats, TransferStats
from tests.models import prompt, tiny_llama


def test_counts_follow_the_slot_plan():
    model = tiny_llama(8)
    ids = prompt()
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
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
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=1), device="cpu", timing=True
    )
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


def test_a_snapshot_shows_as_its_table_in_a_repl_and_says_1_miss():
    # Outside Jupyter a snapshot showed as the dataclass, every LayerStats field of every layer.
    layers = (
        LayerStats("model.layers.1", 3, 4096, 1, 1e-3, 2e-4, 3e-3),
        LayerStats("model.layers.3", 2, 4096, 0, 0, 0, 0),
    )
    s = TransferStats(layers, timing=True)
    assert repr(s) == str(s) and str(s).splitlines()[0].split() == [
        "layer",
        "copies",
        "copied",
        "MiB",
        "copy",
        "ms",
        "GB/s",
        "stall",
        "ms",
        "compute",
        "ms",
        "misses",
    ]
    assert "LayerStats(" not in repr(s) and repr(s).splitlines()[-1].split()[0] == "total"
    assert repr(s.layers[0]).startswith("LayerStats(path='model.layers.1'")  # each layer's fields where asked


def test_the_plot_title_counts_1_miss(pyplot):
    s = TransferStats((LayerStats("model.layers.1", 3, 4096, 1, 1e-3, 2e-4, 3e-3),), timing=True)
    assert s.plot().get_title().endswith(", 1 miss")


def test_stats_of_an_undispatched_model_is_an_error():
    with pytest.raises(ValueError, match="not dispatched"):
        hf_prefetch.stats(tiny_llama(2))


@pytest.mark.gpu
def test_timing_on_cuda_matches_untimed_tokens():
    model = tiny_llama(8, dtype=torch.bfloat16).cuda()
    ids = prompt().cuda()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), timing=True
    )
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert torch.equal(out, expected)
        s = hf_prefetch.stats(model)
        assert s.misses == 0 and s.copies > 4 * 32
        assert s.copy_seconds > 0 and s.gbps > 0 and s.stall_seconds >= 0
    finally:
        hf_prefetch.remove_offload(model)


@pytest.fixture
def pyplot():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")  # no display: figures are drawn in memory
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


@pytest.fixture
def timed_stats():
    model = tiny_llama(6)
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu", timing=True
    )
    try:
        with torch.no_grad():
            model(prompt())
            model(prompt())
        yield hf_prefetch.stats(model)
    finally:
        hf_prefetch.remove_offload(model)


def test_plot_draws_each_layers_copy_compute_and_stall_milliseconds(pyplot, timed_stats):
    s = timed_stats
    ax = s.plot()
    assert ax.figure in [pyplot.figure(n) for n in pyplot.get_fignums()]  # through pyplot: Jupyter shows it
    assert [bars.get_label() for bars in ax.containers] == ["copy", "compute", "stall"]
    for bars, attribute in zip(ax.containers, ["copy_seconds", "compute_seconds", "stall_seconds"], strict=True):
        heights = [rect.get_height() for rect in bars]
        assert heights == pytest.approx([getattr(layer, attribute) * 1e3 for layer in s.layers], rel=1e-12)
        assert all(height > 0 for height in heights)
    assert [label.get_text() for label in ax.get_xticklabels()] == ["1", "3", "5"]
    assert ax.get_xlabel() == "streamed layer of model.layers"
    assert f"{s.stall_seconds * 1e3:.2f} ms" in ax.get_title() and "0 misses" in ax.get_title()
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["copy", "compute", "stall"]


def test_plot_into_a_given_axes(pyplot, timed_stats):
    figure, (left, right) = pyplot.subplots(1, 2)
    assert timed_stats.plot(ax=right) is right
    assert len(right.containers) == 3 and not left.containers
    assert pyplot.get_fignums() == [figure.number]  # no new figure


@pytest.mark.parametrize(
    ("paths", "labels", "xlabel"),
    [
        (["model.layers.1"], ["1"], "streamed layer of model.layers"),
        (
            ["model.encoder.layers.3", "model.decoder.layers.3"],
            ["encoder.layers.3", "decoder.layers.3"],
            "streamed layer of model",
        ),
        (["encoder.block.1", "decoder.block.1"], ["encoder.block.1", "decoder.block.1"], "streamed layer"),
    ],
)
def test_plot_labels_say_the_shared_path_once(pyplot, paths, labels, xlabel):
    s = TransferStats(tuple(LayerStats(path, 1, 4096, 0, 1e-3, 2e-4, 3e-3) for path in paths), timing=True)
    ax = s.plot()
    assert [label.get_text() for label in ax.get_xticklabels()] == labels
    assert ax.get_xlabel() == xlabel
    assert [rect.get_height() for rect in ax.containers[1]] == pytest.approx([3.0] * len(paths))


def test_plot_of_a_plan_that_streams_nothing(pyplot):
    ax = TransferStats((), timing=True).plot()
    assert ax.get_title() == "no streamed layers: nothing is copied"
    assert [len(bars) for bars in ax.containers] == [0, 0, 0]


def test_plot_without_timing_says_to_dispatch_with_timing():
    model = tiny_llama(4)
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu"
    )
    try:
        with pytest.raises(ValueError, match=r"dispatched without timing=True.*timing=True"):
            hf_prefetch.stats(model).plot()
    finally:
        hf_prefetch.remove_offload(model)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    s = TransferStats((LayerStats("model.layers.1", 1, 4096, 0, 1e-3, 1e-3, 1e-3),), timing=True)
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib.pyplot` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install \"hf_prefetch\[plot\]\"") as raised:
        s.plot()
    assert isinstance(raised.value.__cause__, ImportError)


def test_stats_and_import_do_not_import_matplotlib():
    code = (
        "import sys, torch, hf_prefetch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,\n"
        "                     num_key_value_heads=2, vocab_size=64)\n"
        "model = hf_prefetch.dispatch_model(LlamaForCausalLM(config), hf_prefetch.PrefetchConfig(group_size=1), "
        "device='cpu', timing=True)\n"
        "model(torch.tensor([[1, 2]]))\n"
        "s = hf_prefetch.stats(model)\n"
        "str(s), s._repr_html_()\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
