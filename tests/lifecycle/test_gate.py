"""The forward gate, whatever interrupts a forward."""

from __future__ import annotations

import copy
import threading

import torch

import hf_prefetch
from hf_prefetch.lifecycle.gate import ForwardGate
from hf_prefetch.lifecycle.state import model_lock
from tests.interrupting import at_every_point
from tests.models import prompt, tiny_llama


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _free_for_another_thread(lock: threading.RLock) -> bool:
    taken: list[bool] = []

    def take() -> None:
        taken.append(lock.acquire(blocking=False))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return taken == [True]


def test_a_ctrl_c_anywhere_in_the_gate_leaves_it_open():
    # A Ctrl-C as a forward that returned left the gate (before the `finally` held interrupts back) kept the model's
    # lock for good: every other thread's forward, removal or re-dispatch waited for ever.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models compute fastest on one thread
    try:
        base, ids = tiny_llama(2), prompt(1, 5)
        expected = _logits(base, ids)
        config = hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1)
        model = hf_prefetch.dispatch_model(copy.deepcopy(base), config, device="cpu")
        gate = hf_prefetch.get_state(model).gate

        def check(model, where):
            assert gate.depth() == 0, where
            assert _free_for_another_thread(model_lock(model)), where
            assert torch.equal(_logits(model, ids), expected), where

        functions = [ForwardGate.guard, ForwardGate._enter, ForwardGate._leave]
        assert at_every_point(lambda: model, lambda model: _logits(model, ids), check, functions, opcodes=True) > 50
    finally:
        torch.set_num_threads(threads)
