"""The run's journal: each finished case as one JSON line beside the results file, written as the
run goes, so that a run killed outright (SIGKILL, a lost machine) still leaves what finished.
Opened at the first finished case (a run refused before any case touches no file), removed once
the results file is written (or the partial one, on SIGINT/SIGTERM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conformance.results import BackendResult
from conformance.run.runner import Progress

RECORDED_EVENTS = ("result", "fatal", "check_skipped")


class Journal(Progress):
    """A Progress that writes the journal and passes every call on to ``inner``."""

    def __init__(self, results_path: Path, inner: Progress) -> None:
        self.path = results_path.with_name(results_path.name + ".journal")
        self.inner = inner
        self.lines = 0  # cases (and whole-check skips) the journal holds
        self.failure: str | None = None  # why it stopped being written (a full disk): the run goes on
        self.file = None
        self.opened = False

    def _open(self) -> None:
        self.opened = True
        try:
            self.file = open(self.path, "w", buffering=1, encoding="utf-8")
        except OSError as error:
            self.file, self.failure = None, error.strerror or str(error)

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None:
        self.inner.backend_started(name, num_checks, num_cases)

    def event(self, name: str, event: dict[str, Any]) -> None:
        if event["event"] in RECORDED_EVENTS and not self.opened:
            self._open()
        if event["event"] in RECORDED_EVENTS and self.file is not None:
            try:
                self.file.write(json.dumps({"backend": name, **event}) + "\n")
                self.lines += 1
            except OSError as error:  # the results are still kept in memory, and written at the end
                self.failure = error.strerror or str(error)
                self.close()
        self.inner.event(name, event)

    def backend_finished(self, result: BackendResult) -> None:
        self.inner.backend_finished(result)

    def warmed(self, units: int, seconds: float) -> None:
        self.inner.warmed(units, seconds)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def kept(self) -> str:
        """What the journal holds, for a run whose results file could not be written."""
        stopped = f", then it stopped: {self.failure}" if self.failure else ""
        return f"{self.path} holds {self.lines} finished case(s){stopped}"
