"""The run's journal: each finished case as one JSON line beside the results file, written as the
run goes, so that a run killed outright (SIGKILL, a lost machine) still leaves what finished.
Removed once the results file is written (or the partial one, on SIGINT/SIGTERM)."""

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
        self.file = open(self.path, "w", buffering=1)

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None:
        self.inner.backend_started(name, num_checks, num_cases)

    def event(self, name: str, event: dict[str, Any]) -> None:
        if event["event"] in RECORDED_EVENTS:
            self.file.write(json.dumps({"backend": name, **event}) + "\n")
        self.inner.event(name, event)

    def backend_finished(self, result: BackendResult) -> None:
        self.inner.backend_finished(result)

    def remove(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)
