"""`time_layers`: the seconds each layer of a model computes in one forward, measured on the model as it is, for
`PrefetchConfig(compute_seconds=...)` (the planner's schedule weighs them against the link)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from .lifecycle.state import get_state
from .planning.layers import resolve_layer_lists

__all__ = ["time_layers"]


def time_layers(
    model: nn.Module, *args, repeats: int = 3, layers: str | Sequence[str] | None = None, **kwargs
) -> dict[str, float]:
    """Seconds each layer of the model's layer lists computes in `model(*args, **kwargs)`, the median of `repeats`
    timed forwards after one untimed (the first call's one-time costs). For `PrefetchConfig(compute_seconds=...)`.

    The model runs as it is, under `torch.no_grad()`: on a GPU each layer is timed with CUDA events on the current
    stream, on the CPU with the host's clock. A layer called twice in a forward counts both calls; one not called
    gets 0. Time the model before dispatching it (on the GPU where it fits, or on the input it will be planned for
    with fewer of its weights resident elsewhere): a dispatched model's streamed layers would be timed with their
    copies.

    Args:
        model (`nn.Module`): The model, not dispatched by hf_prefetch.
        *args, **kwargs: The inputs of the forward to plan for (one denoising step's, a prompt's).
        repeats (`int`, defaults to 3): Timed forwards.
        layers (`str` or `Sequence[str]`, *optional*): The layer lists, as for `dispatch_model`; found by default.

    Example:

    ```python
    >>> import torch, hf_prefetch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, vocab_size=64))
    >>> seconds = hf_prefetch.time_layers(model, torch.tensor([[1, 2, 3]]), repeats=1)
    >>> sorted(seconds), all(s > 0 for s in seconds.values())
    (['model.layers.0', 'model.layers.1'], True)

    ```
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"time_layers: repeats={repeats!r} must be an int >= 1.")
    if get_state(model) is not None:
        raise ValueError(
            f"time_layers: this {type(model).__name__} is dispatched by hf_prefetch, so its streamed layers would be "
            "timed with their copies. Time it before dispatch_model (or after hf_prefetch.remove_offload(model))."
        )
    modules = {
        f"{path}.{index}": layer
        for path in resolve_layer_lists(model, layers)
        for index, layer in enumerate(model.get_submodule(path))
    }
    runs: list[dict[str, float]] = []
    marks: dict[str, list] = {}
    cuda = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)

    def now():
        if cuda is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(cuda))
        return event

    def before(path):
        return lambda module, inputs: marks.setdefault(path, []).append([now(), None])

    def after(path):
        def hook(module, inputs, output):
            marks[path][-1][1] = now()

        return hook

    handles = []
    enabled = torch.is_grad_enabled()
    try:
        for path, module in modules.items():
            handles.append(module.register_forward_pre_hook(before(path)))
            handles.append(module.register_forward_hook(after(path)))
        with torch.no_grad():
            for run in range(repeats + 1):
                marks.clear()
                model(*args, **kwargs)
                if run == 0:
                    continue
                if cuda is not None:
                    torch.cuda.synchronize(cuda)
                runs.append({path: sum(_elapsed(a, b, cuda) for a, b in marks.get(path, [])) for path in modules})
    finally:
        # A Ctrl-C landing in `no_grad`'s own exit (CPython runs it outside the block's handler) would leave autograd
        # off for the caller's thread.
        torch.set_grad_enabled(enabled)
        for handle in handles:
            handle.remove()
    return {path: statistics.median(run[path] for run in runs) for path in modules}


def _elapsed(start, end, cuda) -> float:
    if end is None:  # the forward raised inside the layer: not reached, the exception propagates
        return 0.0
    return end - start if cuda is None else start.elapsed_time(end) / 1e3
