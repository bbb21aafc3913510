"""The host arena's page-locking accounting, on the CPU with a stand-in for the CUDA runtime (tests/test_gpu.py checks
the real registrations)."""

import gc

import pytest
import torch

import hf_prefetch
from hf_prefetch.host import arena as host
from hf_prefetch.host.arena import HostArena, pinned_bytes
from tests.models import prompt, tiny_llama


class FakeCudart:
    """`torch.cuda.cudart()` as if there were CUDA: records the calls, returns `register_error` on register. Pointers
    it did not register go to the real runtime where there is one (an arena of another test may die meanwhile)."""

    def __init__(self, real=None, register_error: int = 0) -> None:
        self.real = real
        self.register_error = register_error
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        if self.register_error == 0:
            self.registered[pointer] = nbytes
        return self.register_error

    def cudaHostUnregister(self, pointer: int) -> int:
        if self.registered.pop(pointer, None) is not None:
            return 0
        return self.real().cudaHostUnregister(pointer) if self.real is not None else 1  # cudaErrorInvalidValue


@pytest.fixture
def cudart(monkeypatch):
    gc.collect()  # arenas of earlier tests that are garbage unregister with the real runtime, not with this one
    fake = FakeCudart(real=torch.cuda.cudart if torch.cuda.is_available() else None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    if not torch.cuda.is_available():
        monkeypatch.setattr(host, "_clear_last_cuda_error", lambda: None)
    yield fake
    assert not fake.registered  # every fake registration was undone


def test_pinned_bytes_follow_pin_and_release(cudart):
    before = pinned_bytes()
    arena = HostArena([70_000, 4_000])
    assert pinned_bytes() == before  # allocating pins nothing
    assert arena.pin()
    assert pinned_bytes() - before == arena.nbytes == sum(cudart.registered.values())
    assert arena.pin() and pinned_bytes() - before == arena.nbytes  # pinning twice registers once
    arena.release()
    assert pinned_bytes() == before and not cudart.registered
    arena.release()
    assert pinned_bytes() == before


def test_pinned_bytes_of_a_dropped_arena_return(cudart):
    before = pinned_bytes()
    arenas = [HostArena([100_000]) for _ in range(3)]
    for arena in arenas:
        arena.pin()
    assert pinned_bytes() - before == sum(arena.nbytes for arena in arenas)
    del arena, arenas
    gc.collect()
    assert pinned_bytes() == before and not cudart.registered


def test_refused_registration_is_not_counted(cudart, monkeypatch):
    cudart.register_error = 2  # cudaErrorMemoryAllocation: a container's memlock limit
    monkeypatch.setattr(host, "_warned_unpinned", False)
    before = pinned_bytes()
    arena = HostArena([70_000])
    with pytest.warns(UserWarning, match="Could not page-lock"):
        assert not arena.pin()
    assert pinned_bytes() == before
    arena.release()
    assert pinned_bytes() == before


def test_an_empty_arena_pins_nothing(cudart):
    before = pinned_bytes()
    arena = HostArena([])
    assert not arena.pin() and pinned_bytes() == before and not cudart.registered


def test_dispatch_on_the_cpu_pins_nothing():
    before = pinned_bytes()
    model = hf_prefetch.dispatch_model(
        tiny_llama(4), hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1), device="cpu"
    )
    with torch.no_grad():
        model(prompt())
    assert pinned_bytes() == before and not hf_prefetch.get_state(model).arena.pinned
    hf_prefetch.remove_offload(model)
    assert pinned_bytes() == before
