"""A process's first-forward costs, paid in the background while the loader builds the model and reads the checkpoint.

The first forward of a process on a GPU pays for what no later forward does: the CUDA context, cuBLAS's handle and
workspace, each kernel's module (CUDA loads them lazily, cuBLAS per GEMM shape), and transformers' first-call setup of
`generate()`. Measured on an H100 (`benchmarks/experiments/first_forward.py`): 0.3-0.4 s for the context, then 0.5 s
for the first forward of an 8B-shaped model against 0.005 s for the second, and 0.15 s for the first `generate()`
call's own setup. None of it needs the weights, so `Warmup` runs it in a thread, in two steps:

- at once (the loader starts it at the call's first line, before the skeleton and the plan): the CUDA context and
  cuBLAS's handle, which need no memory to speak of;
- once `run` hands it the model: a one-layer twin of the model (its class and config with one decoder layer, a small
  vocabulary, uninitialised weights) runs `generate()` for two tokens from a 16-token prompt (a prefill and a decode
  step) on the execution device, while the weights are read.

The context is made before the readers start because the readers' first writes into fresh host memory (page faults)
slow every thread that maps memory, the driver's included (`benchmarks/experiments/warmup_contention.py`).

The twin's memory comes out of the buffer pool's share of the budget, which the loader allocates only after the
reads: a twin larger than the pool does not run. The warm-up never touches the model and never fails a load: an error
is logged (debug) and costs only the time it would have saved.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import traceback
import weakref

import torch
from torch import nn

from .skeleton import empty_weights

__all__ = ["Warmup"]

logger = logging.getLogger(__name__)

_PROMPT_TOKENS = 16
_TWIN_VOCAB = 512  # the twin's vocabulary: its embedding and head stay small; token ids 0 only


class Warmup:
    """Warms `device` up in a thread: makes its CUDA context and cuBLAS handle at once, then runs the one-layer twin
    of the model that `run` hands it. `join()` waits for the thread (handing it nothing if `run` was not called); so
    does this object's end, should a caller lose it before joining (an interrupt).

    Nothing runs where the device is not CUDA or no thread can be started; no twin runs where the model's config
    cannot make one, or where it needs more than `spare_bytes` of device memory. `seconds` is how long the thread
    worked, its wait for `run` left out (None when it did not run); `error` what stopped it, without its traceback
    (which would keep the twin and its device memory).
    """

    def __init__(self, device: torch.device) -> None:
        self._shared = _Handoff()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            return
        # The thread holds the handoff, not this object: when this object goes, the thread stops waiting for a model.
        weakref.finalize(self, self._shared.handed.set)
        thread = threading.Thread(target=_run, args=(self._shared, device), name="hf_prefetch-warmup", daemon=True)
        try:
            thread.start()
            self._thread = thread
        except RuntimeError as err:  # "can't start new thread": the load goes on without a warm-up
            logger.debug("No warm-up: %r", err)
        except BaseException:  # an interrupt while it started: a started thread must not wait for a model
            self._shared.handed.set()
            raise

    @property
    def seconds(self) -> float | None:
        return self._shared.seconds

    @property
    def error(self) -> BaseException | None:
        return self._shared.error

    def run(self, model: nn.Module, spare_bytes: int) -> None:
        """Hands the thread `model`'s one-layer twin (built on the meta device), if it fits in `spare_bytes`."""
        shared = self._shared
        if self._thread is None or shared.handed.is_set() or not self._thread.is_alive():
            return
        twin = _twin(model)
        nbytes = sum(p.numel() * p.element_size() for p in twin.parameters()) if twin is not None else 0
        if nbytes > spare_bytes:
            logger.debug("No warm-up forward: its one-layer twin (%d bytes) exceeds the spare device memory (%d)",
                         nbytes, spare_bytes)  # fmt: skip
            twin = None
        shared.twin = twin
        shared.handed.set()

    def join(self) -> None:
        if self._thread is not None:
            self._shared.handed.set()  # a thread still waiting for a twin gets none
            self._thread.join()
            self._thread = None
            self._shared.twin = None


class _Handoff:
    """What the loading thread and the warm-up thread share: the twin (set once, before `handed`) and the report."""

    def __init__(self) -> None:
        self.handed = threading.Event()
        self.twin: nn.Module | None = None
        self.seconds: float | None = None
        self.error: BaseException | None = None


def _run(shared: _Handoff, device: torch.device) -> None:
    # The warm-up thread's body: the context, then the twin's forward once handed one.
    twin, worked = None, 0.0
    started = time.perf_counter()
    try:
        with torch.cuda.device(device):
            _make_context(device)
            worked = time.perf_counter() - started
            shared.handed.wait()
            started = time.perf_counter()
            twin, shared.twin = shared.twin, None
            if twin is not None:
                _warm(twin, device)
            torch.cuda.current_stream(device).synchronize()
    except Exception as err:  # a warm-up that cannot run costs only the time it would have saved
        shared.error = _without_frames(err)
        logger.debug("The warm-up failed (the load goes on): %r", err)
    finally:
        twin = None
        shared.seconds = worked + time.perf_counter() - started


def _make_context(device: torch.device) -> None:
    torch.empty(1, device=device)  # the CUDA context (where the process has none yet)
    # A runtime call that makes the device's context current on this thread: the allocation above runs none when the
    # caching allocator already holds a free block, and cuBLAS then warns that no context is current.
    torch.cuda.current_stream(device).query()
    torch.cuda.current_blas_handle()


def _without_frames(err: BaseException) -> BaseException:
    # `err` and the exceptions it chains, with their finished frames' locals cleared and their tracebacks dropped:
    # those frames hold the twin (and its device memory).
    seen: set[int] = set()
    links: list[BaseException | None] = [err]
    while links:
        link = links.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)  # the frame still running (the thread's) is skipped
        link.__traceback__ = None
        links += [link.__cause__, link.__context__]  # both: `raise X from Y` inside an except keeps a third
    return err


def _warm(twin: nn.Module, device: torch.device) -> None:
    # A prefill of _PROMPT_TOKENS and one decode step (generate() where the model generates), token ids 0.
    _materialise(twin, device)
    ids = torch.zeros(1, _PROMPT_TOKENS, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if hasattr(twin, "generate") and twin.can_generate():
            twin.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        else:
            twin(input_ids=ids, attention_mask=mask)


def _twin(model: nn.Module) -> nn.Module | None:
    # The model's class with one decoder layer of each kind its config lists (hybrid models: attention and linear
    # attention, sliding and full) and a small vocabulary, on the meta device (buffers real, as the loader's skeleton).
    # None where the config does not say how many layers the model has, or refuses the changes.
    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(config, "num_hidden_layers", None), int):
        return None
    try:
        config = copy.deepcopy(config)
        kinds = getattr(config, "layer_types", None)
        kinds = list(dict.fromkeys(kinds)) if isinstance(kinds, list) and kinds else None
        for name in ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"):
            if isinstance(getattr(config, name, None), int):  # encoder-decoder configs count each stack
                setattr(config, name, len(kinds) if kinds and name == "num_hidden_layers" else 1)
        if kinds:
            config.layer_types = kinds
        if isinstance(getattr(config, "vocab_size", None), int):
            config.vocab_size = min(config.vocab_size, _TWIN_VOCAB)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            if getattr(config, name, None) is not None:
                setattr(config, name, 0)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
        with empty_weights():
            return type(model)._from_config(config, dtype=dtype)
    except Exception as err:
        logger.debug("No warm-up: the model's config does not build a one-layer twin: %r", err)
        return None


def _materialise(twin: nn.Module, device: torch.device) -> None:
    # Parameters as uninitialised device memory (only the kernels matter), buffers (rotary tables, ...) moved.
    for module in twin.modules():
        for name, param in module._parameters.items():
            if param is not None:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
