"""How a child process ended, in words (the runner's worker, its probe, the memory check's child)."""

from __future__ import annotations

import signal


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
