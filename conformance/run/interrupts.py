"""SIGINT and SIGTERM during a run: stop the children, keep what finished, exit 128 + signal.

While ``stopping_on_signals()`` is active either signal raises ``Interrupted`` in the main thread.
It derives from BaseException so that no check's ``except Exception`` swallows it; the runner
attaches the partial results to it on the way out, and the CLI writes them marked interrupted.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.partial = None  # the RunResult of what finished, set by the runner

    @property
    def not_run(self) -> str:
        """The reason every case that did not finish carries."""
        return f"not run: the run was interrupted by {signal.Signals(self.signum).name}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    stopped = []

    def stop(signum, frame) -> None:
        # From here on both signals are ignored, to the end of the process: a second Ctrl-C must
        # not cut short the writing of what finished.
        for other in SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        stopped.append(signum)
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in SIGNALS}
    try:
        yield
    finally:
        if not stopped:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
