"""One run per results file: a second run aimed at a results file (and so at its journal) that a
running process writes would overwrite the other's results, or truncate its journal mid-run.

The lock is ``RESULTS.lock`` beside the results, held with ``flock`` for the whole run (the kernel
drops it when the process dies, however it dies) and holding the owner's pid for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class ResultsInUse(Exception):
    """Another live process holds the lock; the message names it (its pid, where the lock file
    says it)."""


class ResultsLock:
    def __init__(self, results_path: Path) -> None:
        self.path = results_path.with_name(results_path.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> "ResultsLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ResultsInUse(
                    f"{self.path.with_suffix('')} is being written by another conformance run "
                    f"(pid {owner}); wait for it or give another --json/--out"
                ) from None
            # The file may have been removed by its last owner between our open and our lock: a
            # lock on a removed file guards nothing, so try again on the one now at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:  # the pid only names the owner in another run's message: a full disk must not stop this one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still holding it: a waiter then retries on a new file
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "ResultsLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
