"""What a dispatched model refuses: the conversions that would change its tensors, and only those."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_prefetch
from tests.models import logits, tiny_llama

REFUSED = r"dispatched by hf_prefetch: \.to\(\), .*remove_offload\(model\) first"
CONFIG = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)

# On a float32 model dispatched to the CPU. Each conversion of a module that holds offloaded parameters follows one
# rule: one that would change none of its tensors returns the module, any other is refused.
UNCHANGED = {
    "cpu()": lambda m: m.cpu(),
    "to('cpu')": lambda m: m.to("cpu"),
    "float()": lambda m: m.float(),
    "to(float32)": lambda m: m.to(torch.float32),
    "to('cpu', float32)": lambda m: m.to("cpu", torch.float32),
    "to(tensor)": lambda m: m.to(torch.zeros(1)),
}
CHANGED = {
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "double()": lambda m: m.double(),
    "to(float16)": lambda m: m.to(torch.float16),
    "to('meta')": lambda m: m.to("meta"),
    "cuda()": lambda m: m.cuda(),
    "cuda(0)": lambda m: m.cuda(0),
    "to('cuda')": lambda m: m.to("cuda"),
    "to(channels_last)": lambda m: m.to(memory_format=torch.channels_last),
}


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models compute fastest on one thread
    model = tiny_llama(4)
    yield model, logits(model)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("path", ["", "model.layers.1", "model.layers.1.mlp.up_proj"])
def test_a_conversion_that_changes_nothing_returns_the_module_and_any_other_is_refused(reference, path):
    base, expected = reference
    model = hf_prefetch.dispatch_model(copy.deepcopy(base), CONFIG, device="cpu")
    module = model.get_submodule(path)
    for name, convert in UNCHANGED.items():
        assert convert(module) is module, name
    for name, convert in CHANGED.items():
        with pytest.raises(RuntimeError, match=REFUSED):
            convert(module)
        assert {p.dtype for p in model.parameters()} == {torch.float32}, name
    assert torch.equal(logits(model), expected)
    with pytest.raises(TypeError):
        module.cpu("cpu")  # an argument nn.Module's .cpu() does not take: its own error
    hf_prefetch.remove_offload(model)
    assert module.cpu() is module and module.double() is module  # an ordinary module again
    assert {p.dtype for p in module.parameters()} == {torch.float64}


def test_a_conversion_kept_after_its_module_was_collected_says_so(reference):
    model = hf_prefetch.dispatch_model(copy.deepcopy(reference[0]), CONFIG, device="cpu")
    cpu = model.cpu
    del model
    with pytest.raises(RuntimeError, match=r"This \.cpu\(\) belonged to a module that no longer exists"):
        cpu()


@pytest.mark.gpu
def test_on_cuda_cuda_and_to_cuda_change_nothing_and_cpu_is_refused(reference):
    model = hf_prefetch.dispatch_model(copy.deepcopy(reference[0]), CONFIG, device="cuda")
    for convert in (lambda m: m.cuda(), lambda m: m.to("cuda"), lambda m: m.cuda(torch.cuda.current_device())):
        assert convert(model) is model
    with pytest.raises(RuntimeError, match=REFUSED):
        model.cpu()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
