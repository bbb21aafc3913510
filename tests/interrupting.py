"""A Ctrl-C at every point of a call, for the tests of what an interrupt leaves behind.

`at_every_point(setup, call, check, functions)` runs `call(setup())` again and again: run N raises SIGINT
(`signal.raise_signal`, whose handler runs at once) at the N-th point executed in the code of `functions`, for
N = 1, 2, ... until a run ends before its N-th point. Python's handler raises KeyboardInterrupt there, as for a
Ctrl-C; inside the library's `deferred_interrupts` its own handler holds the Ctrl-C back until the block ends. The
points are the lines, or with `opcodes=True` the bytecodes where Python runs a signal's handler: the start of a
function (of `functions`, or one they call), the end of a call (such as the one between a call that opens a file and
the statement that keeps its descriptor), a loop's jump back. After each run, `check(value, where)` is called on what
`setup()` gave, once the interrupt and its traceback are gone (so that what only they kept alive is freed). Only the
main thread is interrupted: Python runs signal handlers nowhere else. Points inside a `weakref.finalize` callback are
left out (Python prints a KeyboardInterrupt raised there and drops it): the first point after them is interrupted
instead.
"""

from __future__ import annotations

import dis
import signal
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["at_every_point", "code_of"]


def code_of(functions: Iterable[Any]) -> set[types.CodeType]:
    """The code objects of functions, methods, properties and `contextmanager`s (the generator they wrap), with the
    functions and comprehensions defined inside them."""
    codes, todo = set(), []
    for function in functions:
        function = getattr(function, "fget", function)
        function = getattr(function, "__func__", function)
        todo.append(getattr(function, "__wrapped__", function).__code__)
    while todo:
        code = todo.pop()
        codes.add(code)
        todo += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return codes


def at_every_point(
    setup: Callable[[], Any],
    call: Callable[[Any], Any],
    check: Callable[[Any, str], None],
    functions: Iterable[Any],
    opcodes: bool = False,
    cap: int = 2000,
) -> int:
    """Interrupt `call(setup())` at each point of `functions` in turn and `check` what each run left (see the module's
    docstring); the last run, not interrupted, is checked too. Returns how many runs were interrupted; fails if the
    `cap`-th run is still interrupted (a cap too low to reach the end) or a run swallowed its interrupt."""
    codes = code_of(functions)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for at in range(1, cap + 1):
        value = setup()
        interrupted, fired = _interrupted(lambda: call(value), codes, at, opcodes)  # noqa: B023
        assert interrupted or not fired, f"the Ctrl-C raised at point {at} was swallowed"
        check(value, f"interrupted at point {at}" if interrupted else f"not interrupted ({at - 1} points)")
        if not interrupted:
            return at - 1
    raise AssertionError(f"still interrupted after {cap} points: raise the cap")


def _interrupted(call: Callable[[], Any], codes: set[types.CodeType], *how: Any) -> tuple[bool, bool]:
    # (whether the run ended with a KeyboardInterrupt, whether a SIGINT was raised); the interrupt and its traceback
    # are gone when this returns.
    fired: list[bool] = []
    try:
        _run(call, codes, fired, *how)
    except KeyboardInterrupt:
        assert fired, "a KeyboardInterrupt that no point raised"
        return True, True
    return False, bool(fired)


# Where Python runs a pending signal's handler: at a function's start, after a call of a C function (after a Python
# function's return it is the callee's last such point that counts), at a loop's jump back (JUMP_ABSOLUTE before
# Python 3.11).
_CALLS = {op for name, op in dis.opmap.items() if name.startswith("CALL")}
_CHECKS = {op for name, op in dis.opmap.items() if "JUMP_BACKWARD" in name and "NO_INTERRUPT" not in name}
_CHECKS |= {dis.opmap[name] for name in ("JUMP_ABSOLUTE",) if name in dis.opmap}


def _run(call: Callable[[], Any], codes: set[types.CodeType], fired: list, at: int, opcodes: bool) -> int:
    # `call()`, with SIGINT raised at the `at`-th point in `codes`; `fired` gets an item once it was raised. Returns
    # the points it went through.
    seen = [0]

    def reached(frame: types.FrameType) -> None:
        seen[0] += 1
        if seen[0] >= at and not fired and not _in_finalizer(frame):
            fired.append(True)
            signal.raise_signal(signal.SIGINT)  # its handler runs here; a KeyboardInterrupt ends the tracing

    def start(frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame.f_code not in codes:
            if opcodes and frame.f_back is not None and frame.f_back.f_code in codes:
                reached(frame)  # the start of a function the code calls
            return None
        frame.f_trace_opcodes = opcodes
        after_call = [True]  # the function's start

        def local(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and not opcodes:
                reached(frame)
            elif event == "opcode":
                op = frame.f_code.co_code[frame.f_lasti]
                if op in _CHECKS or after_call[0]:
                    reached(frame)
                after_call[0] = op in _CALLS
            return local

        return local

    sys.settrace(start)
    try:
        call()
    finally:
        sys.settrace(None)
    return seen[0]


def _in_finalizer(frame: types.FrameType | None) -> bool:
    # Whether the frame runs under a `weakref.finalize` callback.
    while frame is not None:
        if frame.f_code is _FINALIZE:
            return True
        frame = frame.f_back
    return False


_FINALIZE = weakref.finalize.__call__.__code__
