"""The state a dispatch leaves on a model, as a caller sees it."""

from __future__ import annotations

import warnings

import hf_prefetch
from hf_prefetch.lifecycle.state import Lifecycle
from hf_prefetch.planning.offload_plan import format_bytes
from tests.models import tiny_llama


def test_a_state_prints_as_one_line_and_its_plan_holds_the_details():
    # `print(get_state(model))` showed the generated dataclass repr: every journal step, parameter and tensor (about
    # 72 KB for an 8-layer model).
    model = tiny_llama(8)
    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    try:
        state = hf_prefetch.get_state(model)
        plan = state.plan
        expected = (
            "OffloadState(backend='prefetch', lifecycle='attached', device='cpu', streamed_layers='4 of 8', "
            f"device_bytes='{format_bytes(plan.device_bytes)}', host_bytes='{format_bytes(plan.host_bytes)}')"
        )
        assert str(state) == repr(state) == expected
        assert "model.layers.7" in str(plan)  # every layer, where asked for
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # UVA on the CPU changes nothing, and says so once per process
            hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=1), device="cpu", replace=True)
        assert repr(hf_prefetch.get_state(model)).startswith(
            "OffloadState(backend='uva', lifecycle='attached', device='cpu', mapped_layers='8 of 8'"
        )
        state = hf_prefetch.get_state(model)
    finally:
        hf_prefetch.remove_offload(model)
    assert state.lifecycle is not Lifecycle.ATTACHED and len(repr(state)) < 200  # a state kept after the removal


def test_a_ctrl_c_anywhere_in_the_lookup_of_a_models_lock_leaves_the_lookup_free():
    # A Ctrl-C landing as the lookup's `with` block returned, before its guard's release, kept the guard for good:
    # every later lookup (every verb, on every model) waited forever.
    from torch import nn

    from hf_prefetch.lifecycle import state
    from tests.interrupting import at_every_point

    def check(module, where):
        assert not state._MODEL_LOCKS_GUARD.locked(), where
        assert state.model_lock(module) is state.model_lock(module)

    assert at_every_point(lambda: nn.Linear(1, 1), state.model_lock, check, [state.model_lock]) > 3
