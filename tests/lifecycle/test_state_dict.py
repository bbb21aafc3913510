"""`load_state_dict` on a dispatched model writes through to host storage, whatever interrupts it."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_prefetch
from hf_prefetch.lifecycle.state_dict import WriteThrough
from tests.interrupting import at_every_point
from tests.models import prompt, tiny_llama


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models compute fastest on one thread
    yield
    torch.set_num_threads(threads)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_ctrl_c_anywhere_in_a_write_through_leaves_every_streamed_parameter_at_its_slot(one_thread):
    # A Ctrl-C as a write-through began pointing the parameters back at their slots (after it had taken them off its
    # list) left them on host storage for good: the next forward found nothing to complete.
    base = tiny_llama(2)
    ids = prompt(1, 5)
    model = hf_prefetch.dispatch_model(
        copy.deepcopy(base), hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1), device="cpu"
    )
    # New values of layer 1's attention (streamed, into the one slot layer 0 holds after a forward) and of the norm.
    names = [name for name in base.state_dict() if name.startswith("model.layers.1.self_attn.")] + [
        "model.norm.weight"
    ]
    values = [{name: tiny_llama(2, seed=seed).state_dict()[name] for name in names} for seed in (3, 4)]
    undispatched = copy.deepcopy(base)

    def load(model):
        model.load_state_dict(values[0], strict=False)
        values.reverse()

    def check(model, where):
        logits = _logits(model, ids)  # completes an interrupted load first
        for write_through in hf_prefetch.get_state(model).write_throughs:
            assert write_through.loading == [], where
            for streamed in write_through.streamed:
                assert streamed.offloaded.param.data_ptr() == streamed.slot_buffer.data_ptr(), where
        # Some tensors hold their new values, the others their old ones: it computes what its state dict shows.
        undispatched.load_state_dict(model.state_dict())
        assert torch.equal(logits, _logits(undispatched, ids)), where

    functions = [WriteThrough.before, WriteThrough.after, WriteThrough.complete]
    assert at_every_point(lambda: model, load, check, functions, opcodes=True) > 50
