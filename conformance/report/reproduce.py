"""The one command that runs a failing case again, alone: what every report puts beside a failure."""

from __future__ import annotations

import shlex

from conformance.results import RunResult


def reproduce_command(run: RunResult, backend: str, check: str, case: str) -> str:
    """``conformance run --backend B --check C --case ID`` (``--device cuda`` when the run was on
    a GPU): the case id holds its whole definition, seed included."""
    words = ["conformance", "run", "--backend", backend, "--check", check, "--case", case]
    if run.environment.get("device") == "cuda":
        words += ["--device", "cuda"]
    return shlex.join(words)
