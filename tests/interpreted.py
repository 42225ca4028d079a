"""Numerics verdicts of a Triton backend under Triton's CPU interpreter (``TRITON_INTERPRET=1``,
decided when triton is imported: a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import importlib, inspect, sys, torch
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.run.execution import judge
module, name = sys.argv[1].split(":")
backend = getattr(importlib.import_module(module), name)
backend = backend if inspect.isclass(backend) else backend()  # a class, or a function that makes one
for text in sys.argv[2:]:
    print(judge(NumericsCheck(), backend, parse_case(text), torch.device("cpu")).verdict.name)
"""


def interpreted(script: str, *args: str) -> str:
    """``python -c script args…`` under the interpreter: its standard output (it must exit 0)."""
    completed = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def numerics_verdicts(backend: str, cases: list[str]) -> list[str]:
    """Each case's numerics verdict (``PASS``, ``FAIL``, ...) for ``backend``: ``module:Class``, or
    ``module:function`` returning the class (a planted defect's factory)."""
    return interpreted(SCRIPT, backend, *cases).split()
