"""A backend that ends the process in the middle of its code must not end a run with status 0.

Where a case runs in the process that reports (``--in-process``, the pytest plugin, a
pytest-xdist worker) and in a run's isolated child alike, every exit a backend asks for from
Python while its code runs is that case's CRASH, with the same reason on every path:

* ``os._exit`` (``posix._exit``) on the main thread raises ``BackendExited`` there;
* ``os._exit`` on any other thread ends that thread only, and the case it ran under is CRASH
  (``watching`` returns the attempts);
* ``SystemExit`` and every other ``BaseException`` a backend raises are caught by the runner
  (``execution.run_case``), except a real interrupt (``is_interrupt``).

A backend's import is watched the same way. Exits that are not the backend's pass: execnet's
receiver thread ends an orphaned pytest-xdist worker with ``os._exit``, and the harness's own
``real_exit``.

An ``exit()`` called from C code cannot be turned into a result: the process ends. While backend
code runs it ends with status ``EXIT_FROM_C`` instead of the status the backend gave, and one line
on stderr (a handler of C's own exit path, glibc's ``__cxa_atexit``; disarmed through
``__cxa_finalize`` as Python itself exits, so that it never runs once the interpreter is gone).
An isolated run's parent makes it the running case's CRASH; in a process that reports (the
plugin without pytest-xdist, ``--in-process``) the run ends there, non-zero.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import posix
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from conformance.run.interrupts import Interrupted

EXIT_FROM_C = 72  # the status of a process whose backend called C's exit() while its code ran


class BackendExited(BaseException):
    """The backend asked the process to end while its code ran (``os._exit`` on the main thread)."""


@dataclass
class _Watch:
    what: str  # "the case", "the import": the words of the CRASH reason
    attempts: list[str] = field(default_factory=list)  # exits asked for on other threads


def _stderr_copy() -> int | None:
    """The process's stderr as it was when this module was imported: a test runner that captures
    fd 2 later (pytest) drops what is written there when the process ends at once."""
    try:
        return os.dup(2)
    except OSError:
        return None


@dataclass
class _Guard:
    """The process's one guard (``os._exit`` is the process's too): an object, not plain data, so
    that the harness seal holds it by identity while its watch changes from case to case."""

    pid: int | None = None  # the process that installed it (a forked child installs its own)
    real_exit: Any = os._exit
    watch: _Watch | None = None
    signalled: bool = False  # a real SIGINT came while the last watch ran
    finalizing: bool = False  # Python itself is exiting: C's exit path is no longer the backend's
    c_hook: Any = None  # the C exit handler and what it needs, kept alive for the process's life
    stderr: int | None = field(default_factory=_stderr_copy)


_state = _Guard()


def real_exit(status: int) -> None:
    """The process's own ``os._exit``, for the harness's deliberate exits."""
    _state.real_exit(status)


def _from_execnet() -> bool:
    """The exit is execnet's own (its caller is execnet's code, not a backend's above it)."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("execnet")


def _guarded_exit(status: int) -> None:
    watch = _state.watch
    if watch is None or os.getpid() != _state.pid or _from_execnet():
        real_exit(status)
        return
    if threading.current_thread() is threading.main_thread():
        raise BackendExited(f"the backend called os._exit({status}) during {watch.what}")
    watch.attempts.append(f"the backend called os._exit({status}) on thread {threading.current_thread().name!r}")
    raise BackendExited(watch.attempts[-1])  # ends that thread only (its excepthook stays quiet)


def _quiet_excepthook(previous):
    def hook(args) -> None:
        if not isinstance(args.exc_value, BackendExited):
            previous(args)

    return hook


def install() -> None:
    """Guard this process's ``os._exit`` (once; a forked child's own exit is its way out). Done
    before the backend is imported, so that ``from os import _exit`` gets the guarded one too."""
    if _state.pid == os.getpid():
        return
    if _state.pid is None:
        _state.real_exit = os._exit
        threading.excepthook = _quiet_excepthook(threading.excepthook)
        _arm_c_exit()
    _state.pid = os.getpid()
    os._exit = posix._exit = _guarded_exit


def _arm_c_exit() -> None:
    """A handler on C's exit path that turns an exit() from backend code into ``EXIT_FROM_C``."""
    try:
        libc = ctypes.CDLL(None)
        register, finalize = libc.__cxa_atexit, libc.__cxa_finalize
    except (OSError, AttributeError):  # not glibc: such an exit keeps the status it gave
        return
    handle = ctypes.create_string_buffer(1)  # a "DSO" of our own: __cxa_finalize runs and drops only ours

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def on_c_exit(_) -> None:
        watch = _state.watch
        if watch is None or _state.finalizing or os.getpid() != _state.pid:
            return
        line = f"\nconformance: the backend called exit() from C code during {watch.what}\n".encode()
        try:
            os.write(2 if _state.stderr is None else _state.stderr, line)
        except OSError:
            pass
        real_exit(EXIT_FROM_C)

    def disarm() -> None:
        _state.finalizing = True
        finalize(ctypes.addressof(handle))

    register(on_c_exit, None, ctypes.addressof(handle))
    atexit.register(disarm)
    _state.c_hook = (on_c_exit, handle, finalize)


@contextmanager
def watching(what: str) -> Iterator[list[str]]:
    """While the block runs backend code: an exit asked for on the main thread raises
    ``BackendExited``; one asked for on another thread is appended to the yielded list (the
    block's caller makes it the case's CRASH). A real SIGINT meanwhile is told apart from a
    ``KeyboardInterrupt`` the backend raises (``is_interrupt``)."""
    install()
    outer = _state.watch
    watch = _state.watch = _Watch(what)
    _state.signalled = False
    wrapped = _mark_real_interrupts()
    try:
        yield watch.attempts
    finally:
        _state.watch = outer
        # Put SIGINT's handler back unless the handler itself replaced it meanwhile (a run that
        # stops ignores every later signal while it writes what finished).
        if wrapped is not None and signal.getsignal(signal.SIGINT) is wrapped[0]:
            signal.signal(signal.SIGINT, wrapped[1])


def _mark_real_interrupts():
    """SIGINT's handler, wrapped to note that a signal came (main thread only); returns (the
    wrapper, the handler to put back), or None where it could not be wrapped."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return None

    def noted(signum, frame):
        _state.signalled = True
        return previous(signum, frame)

    signal.signal(signal.SIGINT, noted)
    return noted, previous


def is_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is the run being stopped (a run's ``Interrupted``, or the
    ``KeyboardInterrupt`` of a real SIGINT while the last ``watching`` block ran), not an exit
    the backend asked for."""
    return isinstance(error, Interrupted) or (isinstance(error, KeyboardInterrupt) and _state.signalled)


def crash_reason(error: BaseException, what: str = "the case") -> str:
    """The CRASH reason of a ``BaseException`` that is no ``Exception``, raised by backend code."""
    if isinstance(error, BackendExited):
        return str(error)
    if isinstance(error, SystemExit):
        return f"the backend raised SystemExit({error.code!r}) during {what}"
    return f"the backend raised {type(error).__name__} during {what} (a BaseException: it ends a process)"
