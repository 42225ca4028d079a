"""The checks, by name, in the order a run performs them."""
from __future__ import annotations

from conformance.checks.base import Check
from conformance.checks.bench import BenchCheck
from conformance.checks.determinism import DeterminismCheck
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.engine import EngineCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.syncs import SyncsCheck

CHECKS: dict[str, type[Check]] = {
    NumericsCheck.name: NumericsCheck,
    SyncsCheck.name: SyncsCheck,
    GraphsCheck.name: GraphsCheck,
    DraftLoopCheck.name: DraftLoopCheck,
    DeterminismCheck.name: DeterminismCheck,
    EngineCheck.name: EngineCheck,
    BenchCheck.name: BenchCheck,
}

# `conformance run` checks correctness; `conformance bench` (or --check bench) measures speed.
DEFAULT_CHECKS = [name for name in CHECKS if name != BenchCheck.name]


def make_check(name: str, options: dict | None = None) -> Check:
    return CHECKS[name](options)
