import contextlib
import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from accelerate import init_empty_weights

from hf_prefetch.loading import warmup
from hf_prefetch.loading.warmup import Warmup
from tests.moe_models import FAMILIES, moe_model
from tests.zoo import ARCHS


def _on_meta(model):
    with init_empty_weights(include_buffers=False):
        return type(model)._from_config(model.config)


def _layers(model) -> int:
    return max(int(name.split(".")[i + 1]) for name, _ in model.named_parameters() for i, part in
               enumerate(name.split(".")[:-1]) if part in ("layers", "h", "layer", "block") and
               name.split(".")[i + 1].isdigit()) + 1  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_the_twin_of_every_architecture_runs_a_prefill_and_a_decode_step(arch):
    if reason := arch.missing():
        pytest.skip(reason)
    model = _on_meta(arch.build())
    before = [(name, p.device, p.shape) for name, p in model.named_parameters()]
    twin = warmup._twin(model)
    assert twin is not None and twin is not model
    if not arch.seq2seq:  # one layer of each kind (sliding and full attention, ...)
        kinds = getattr(model.config, "layer_types", None) or [None]
        assert _layers(twin) == len(set(kinds))
    assert all(p.is_meta for p in twin.parameters())
    warmup._warm(twin, torch.device("cpu"))  # raises if the twin cannot run
    assert all(not p.is_meta for p in twin.parameters())
    assert [(name, p.device, p.shape) for name, p in model.named_parameters()] == before  # the model is untouched


@pytest.mark.parametrize("family", FAMILIES)
def test_the_twin_of_every_moe_family_runs(family):
    model = _on_meta(moe_model(family))
    twin = warmup._twin(model)
    kinds = getattr(model.config, "layer_types", None) or [None]
    assert twin is not None and _layers(twin) == len(set(kinds))
    warmup._warm(twin, torch.device("cpu"))


def test_no_twin_without_a_layer_count():
    assert warmup._twin(torch.nn.Linear(2, 2)) is None


def test_no_thread_on_the_cpu(monkeypatch):
    model = _on_meta(ARCHS[0].build())
    started = []
    monkeypatch.setattr(warmup.threading.Thread, "start", lambda self: started.append(self))
    run = Warmup(torch.device("cpu"))
    run.run(model, spare_bytes=2**40)
    run.join()
    assert started == [] and run.seconds is None


def test_the_thread_gets_a_twin_only_within_the_spare_memory_and_none_from_join(monkeypatch):
    model = _on_meta(ARCHS[0].build())
    handed = []

    def body(shared, device):  # the thread's own CUDA work left out: what it is handed
        shared.handed.wait()
        handed.append(shared.twin)

    monkeypatch.setattr(warmup, "_run", body)
    run = Warmup(torch.device("cuda", 0))
    run.run(model, spare_bytes=0)  # the twin needs more than 0 bytes
    run.join()
    run = Warmup(torch.device("cuda", 0))
    run.run(model, spare_bytes=2**40)
    run.join()
    run = Warmup(torch.device("cuda", 0))
    run.join()  # never handed a model (the load failed before its plan): the thread ends all the same
    assert handed[0] is None and handed[2] is None
    assert type(handed[1]) is type(model) and handed[1] is not model and all(p.is_meta for p in handed[1].parameters())


def test_a_failing_warmup_is_logged_and_the_load_goes_on(monkeypatch, caplog):
    model = _on_meta(ARCHS[0].build())
    monkeypatch.setattr(warmup.torch.cuda, "device", lambda device: (_ for _ in ()).throw(RuntimeError("no GPU")))
    with caplog.at_level("DEBUG", logger="hf_prefetch.loading.warmup"):
        run = Warmup(torch.device("cuda", 0))
        run.run(model, spare_bytes=2**40)
        run.join()
    assert isinstance(run.error, RuntimeError) and run.seconds is not None
    assert "The warm-up failed (the load goes on)" in caplog.text


def _without_cuda(monkeypatch):
    # The thread's own CUDA work left out, so that it runs on the CPU up to the twin's forward.
    monkeypatch.setattr(warmup.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(warmup, "_make_context", lambda device: None)
    monkeypatch.setattr(warmup.torch.cuda, "current_stream", lambda device: _NoSync())


class _NoSync:
    def synchronize(self):
        pass


def test_a_failed_warmup_keeps_neither_the_twin_nor_its_frames(monkeypatch):
    # An out-of-memory error in the twin's generate(): its traceback's frames hold the twin (device memory on CUDA),
    # and the thread's frame the warm-up. `error` keeps neither, so the twin is gone at join without a collection.
    model = _on_meta(ARCHS[0].build())
    _without_cuda(monkeypatch)
    twins = []

    def fail(twin, device):
        twins.append(weakref.ref(twin))
        try:
            raise ValueError("inner")  # handled, then another error raised from a third: three tracebacks
        except ValueError:
            raise RuntimeError("CUDA out of memory") from KeyError("third")

    monkeypatch.setattr(warmup, "_warm", fail)
    gc.disable()
    try:
        run = Warmup(torch.device("cuda", 0))
        run.run(model, spare_bytes=2**40)
        run.join()
        assert len(twins) == 1 and twins[0]() is None
    finally:
        gc.enable()
    assert isinstance(run.error, RuntimeError) and run.error.__traceback__ is None
    assert run.error.__context__.__traceback__ is None and isinstance(run.error.__cause__, KeyError)


def test_a_warmup_dropped_without_join_or_interrupted_while_starting_ends_its_thread(monkeypatch):
    # A load interrupted before it kept its Warmup, or while the thread started, never joins it: the thread must not
    # wait for a model forever.
    _without_cuda(monkeypatch)
    run = Warmup(torch.device("cuda", 0))
    thread = run._thread
    del run
    thread.join(timeout=10)
    assert not thread.is_alive()

    started = []
    start = warmup.threading.Thread.start

    def start_then_interrupt(self):
        start(self)
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(warmup.threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        Warmup(torch.device("cuda", 0))
    monkeypatch.setattr(warmup.threading.Thread, "start", start)
    started[0].join(timeout=10)
    assert not started[0].is_alive()


def test_seconds_leave_out_the_wait_for_the_model(monkeypatch):
    model = _on_meta(ARCHS[0].build())
    _without_cuda(monkeypatch)
    monkeypatch.setattr(warmup, "_warm", lambda twin, device: None)
    run = Warmup(torch.device("cuda", 0))
    time.sleep(0.5)  # the skeleton and the plan
    run.run(model, spare_bytes=2**40)
    run.join()
    assert run.error is None and run.seconds is not None and run.seconds < 0.4


def test_no_thread_that_cannot_start_fails_a_load(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(warmup.threading.Thread, "start", refuse)
    run = Warmup(torch.device("cuda", 0))
    run.run(_on_meta(ARCHS[0].build()), spare_bytes=2**40)
    run.join()
    assert run.seconds is None and not any(t.name == "hf_prefetch-warmup" for t in threading.enumerate())


@pytest.mark.gpu
def test_the_warmup_runs_on_cuda_and_leaves_no_memory_behind():
    from tests.models import gpu_llama

    model = _on_meta(gpu_llama(2))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run = Warmup(torch.device("cuda", 0))
    run.run(model, spare_bytes=2**40)
    run.join()
    assert run.error is None and run.seconds is not None
    # What stays is cuBLAS's workspace for the warm-up thread's handle (32 MiB, kept by torch for the process, and
    # what the first real forward would allocate); the twin itself (~190 MB) is gone.
    assert torch.cuda.memory_allocated() - before <= 32 * 2**20


@pytest.mark.gpu
def test_the_warmup_thread_asks_for_cublas_with_its_context_current():
    # With a small free block in the caching allocator, the thread's first allocation makes no runtime call, and
    # cuBLAS warned "no current CUDA context" (a UserWarning, made an error here, which the warm-up stores).
    code = (
        "import torch\n"
        "from hf_prefetch.loading.warmup import Warmup\n"
        "block = torch.empty(1, device='cuda'); del block\n"
        "run = Warmup(torch.device('cuda', 0)); run.join()\n"
        "assert run.error is None, repr(run.error)\n"
    )
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "CUDA context" not in done.stderr, done.stderr
