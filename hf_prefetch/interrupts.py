"""Ctrl-C held back around the steps that must not stop half-way, and locks taken in turns so that a held-back Ctrl-C
still lands while a thread waits. A leaf: every part of the package may import it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["deferred_interrupts", "take_in_turns", "held_in_turns"]


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then hand it to the handler that was installed: Python's
    default raises KeyboardInterrupt, a program's own handler is called with it, the system default ends the process,
    an ignored signal stays ignored. In the main thread only (signal handlers can be set nowhere else); elsewhere, and
    where the handler was not installed from Python, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # no signal support in this interpreter
        yield
        return
    if previous is None:  # installed from outside Python: it could not be put back
        yield
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if callable(previous):
                previous(signal.SIGINT, received[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


# How long a wait for the model's lock runs with a Ctrl-C held back, in turns: a Ctrl-C the operating system gave
# another thread only wakes this one when a turn ends.
_TURN_SECONDS = 0.05


def take_in_turns(lock: threading.RLock, counted: Callable[[], None]) -> None:
    """Wait for `lock` in turns of `_TURN_SECONDS`, each with a Ctrl-C held back, and once it is taken call `counted`
    (which records that this thread holds it) before a Ctrl-C can land: one raised then leaves a lock its owner
    knows to release."""
    while True:
        with deferred_interrupts():
            if lock.acquire(timeout=_TURN_SECONDS):
                counted()
                return


@contextlib.contextmanager
def held_in_turns(lock: threading.RLock) -> Iterator[None]:
    # `lock` held for the block, taken as `take_in_turns` takes it and released with a Ctrl-C held back.
    taken: list[bool] = []
    try:
        take_in_turns(lock, lambda: taken.append(True))
        yield
    finally:
        if taken:
            with deferred_interrupts():
                lock.release()
