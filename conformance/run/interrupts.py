"""SIGINT and SIGTERM during a run: stop the children, keep what finished, exit 128 + signal.

While ``stopping_on_signals()`` is active either signal raises ``Interrupted`` in the main thread.
It derives from BaseException so that no check's ``except Exception`` swallows it; the runner
attaches the partial results to it on the way out, and the CLI writes them marked interrupted.

A signal that arrives while the command is still importing torch (its first seconds) is held
(``hold_signals``, the first thing the command does) and delivered when the command takes the
signals over: a run then stops exactly as it would later on; any other command exits 128 + signal.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held: list[int] = []  # signals that arrived before the command took them over


def hold_signals() -> None:
    """From now on SIGINT and SIGTERM are recorded, not acted on, until ``stopping_on_signals``
    or ``release_signals``: no traceback from a Ctrl-C in the middle of an import."""
    for signum in SIGNALS:
        signal.signal(signum, lambda number, frame: _held.append(number))


def release_signals() -> None:
    """The default handling back (for commands that do not write partial results); a held
    signal ends the process now with 128 + signal."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _held:
        raise SystemExit(128 + _held[0])


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
    if _held:
        stop(_held.pop(0), None)
    try:
        yield
    finally:
        if not stopped:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
