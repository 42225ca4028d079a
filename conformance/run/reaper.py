"""Every process a backend starts ends with its worker, and with the run.

* A worker runs in its own process group. When it exits (finished, crashed, or killed), the whole
  group is killed while the worker is still an unreaped zombie, so that its group id cannot have
  been handed to an unrelated process.
* A backend process that leaves the group (``setsid``, a daemon's double fork) is re-parented to
  the run, not to init, while a run is going (Linux ``PR_SET_CHILD_SUBREAPER``); after each
  worker every such orphan is killed.
* If the run itself dies (SIGKILL, a lost terminal), a sentinel process, which reads a pipe from
  the run and holds nothing else, sees the pipe close and kills the groups of workers still
  going. (The worker itself also dies with the run: ``PR_SET_PDEATHSIG``.)

"As far as Linux allows": a process that left the group after the run itself was killed is out
of reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

PR_SET_CHILD_SUBREAPER = 36

# Every worker and sentinel of every Reaper of this process: a pool runs several Reapers at once
# (one a unit), and one's sweep must not take another's live worker or sentinel for an orphan.
_LIVE: set[int] = set()
_LIVE_LOCK = threading.RLock()
_SPAWNING = [0]  # processes being started now: a sweep then waits for the next one (it cannot tell them apart)
_SUBREAPERS = [0]  # Reapers open: this process stays a subreaper while any is


def _live(pid: int, alive: bool) -> None:
    with _LIVE_LOCK:
        (_LIVE.add if alive else _LIVE.discard)(pid)


def _started(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """``start()``'s process, listed as live before any sweep may take it for an orphan. The lock
    is not held while it starts (a child started from a thread must not stall every other slot)."""
    with _LIVE_LOCK:
        _SPAWNING[0] += 1
    try:
        child = start()
        _live(child.pid, True)
        return child
    finally:
        with _LIVE_LOCK:
            _SPAWNING[0] -= 1


# Reads "watch PGID" / "forget PGID" lines; at end of input without "release", kills every group
# still watched. -I -S: no site packages, no environment, so it starts in milliseconds.
_SENTINEL = """
import os, signal, sys
groups, released = set(), False
for line in sys.stdin:
    word, _, value = line.strip().partition(" ")
    if word == "watch":
        groups.add(int(value))
    elif word == "forget":
        groups.discard(int(value))
    elif word == "release":
        released = True
if not released:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
"""


def _prctl():
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def children() -> set[int]:
    """This process's children (every thread's), from /proc; empty where /proc has no such file."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def kill_children_but(kept: set[int]) -> None:
    """Kill and reap every child of this process not in ``kept``, again until none is left
    (killing one can orphan its own children onto this process, a subreaper)."""
    for _ in range(10):
        strays = children() - kept
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError, PermissionError):
                pass


def exited(child: subprocess.Popen) -> bool:
    """Whether the child exited, without reaping it (its pid and group id stay reserved)."""
    if child.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class Reaper:
    """Around one backend's workers: ``watch`` each worker, ``finish`` it, ``close`` at the end."""

    def __init__(self) -> None:
        self.prctl = _prctl()
        with _LIVE_LOCK:
            _SUBREAPERS[0] += 1
            if self.prctl is not None:
                self.prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.sentinel = _started(
            lambda: subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _SENTINEL],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        )  # out of reach of a Ctrl-C to the run's group
        self.before = children()  # the run's own children (the sentinel among them): never swept

    def _tell(self, line: str) -> None:
        try:
            self.sentinel.stdin.write(line + "\n")
            self.sentinel.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def spawn(self, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """``start()``'s worker, listed as live before any sweep can see it, and watched."""
        child = _started(start)
        self._tell(f"watch {child.pid}")
        return child

    def finish(self, child: subprocess.Popen) -> int:
        """Kill the worker's group (whatever it left running), reap the worker, then every orphan
        re-parented to the run; returns the worker's exit status."""
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        returncode = child.wait()
        _live(child.pid, False)
        self._tell(f"forget {child.pid}")
        self.sweep()
        return returncode

    def sweep(self) -> None:
        with _LIVE_LOCK:
            if not _SPAWNING[0]:  # else a later sweep takes it (the next worker's end, the last close)
                kill_children_but(self.before | _LIVE)

    def close(self) -> None:
        self.sweep()
        self._tell("release")
        try:
            self.sentinel.stdin.close()
        except OSError:
            pass
        self.sentinel.wait()
        _live(self.sentinel.pid, False)
        with _LIVE_LOCK:
            _SUBREAPERS[0] -= 1
            if self.prctl is not None and not _SUBREAPERS[0]:
                self.prctl(PR_SET_CHILD_SUBREAPER, 0)


class Spawned:
    """The processes backend code started in a process that no worker group ends with (the
    pytest plugin's): each is recorded as a case ends, and ``end`` kills those still running.
    While a case runs, this process is a subreaper, so a helper that daemonized (a double fork)
    comes back to it instead of to init."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.prctl = _prctl()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        before = children()
        if self.prctl is not None:
            self.prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            yield
        finally:
            if self.prctl is not None:
                self.prctl(PR_SET_CHILD_SUBREAPER, 0)
            self.pids |= children() - before

    def end(self) -> None:
        if self.prctl is not None:  # what the killed ones orphan comes back here, to be killed too
            self.prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            kill_children_but(children() - self.pids)
        finally:
            if self.prctl is not None:
                self.prctl(PR_SET_CHILD_SUBREAPER, 0)
