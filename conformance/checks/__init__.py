"""The check registry: the one list of checks, by name, in the order a run performs them.

A new check is one module under ``conformance/checks/`` (a ``Check`` subclass that runs a case
and describes its evidence) plus one line below; the CLI, the pytest plugin and every report
take their checks from here.
"""

from __future__ import annotations

import importlib.util
import os

from conformance.checks.base import Check
from conformance.checks.bench import BenchCheck
from conformance.checks.determinism import DeterminismCheck
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.engine import EngineCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.indexer import IndexerCheck
from conformance.checks.memory import MemoryCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.steady import SteadyCheck
from conformance.checks.syncs import SyncsCheck
from host_syncs.frames import treat_as_infrastructure

# A sync seen while the harness drives a backend is the backend's: never blame the harness, nor
# the contract's helpers that copy on the caller's behalf (CommonAttentionMetadata.seq_lens_cpu).
treat_as_infrastructure(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), importlib.util.find_spec("backends.base").origin
)

CHECKS: dict[str, type[Check]] = {
    NumericsCheck.name: NumericsCheck,
    SyncsCheck.name: SyncsCheck,
    SteadyCheck.name: SteadyCheck,
    GraphsCheck.name: GraphsCheck,
    DraftLoopCheck.name: DraftLoopCheck,
    DeterminismCheck.name: DeterminismCheck,
    EngineCheck.name: EngineCheck,
    IndexerCheck.name: IndexerCheck,
    MemoryCheck.name: MemoryCheck,
    BenchCheck.name: BenchCheck,
}


OPT_IN = (MemoryCheck.name, BenchCheck.name)  # minutes per backend, or a measurement: asked for by name


def default_checks() -> list[str]:
    """What `conformance run` checks: correctness, less the memory check (compute-sanitizer, about
    two minutes a backend: `--check memory`); `conformance bench` (or --check bench) measures speed."""
    return [name for name in CHECKS if name not in OPT_IN]


def make_check(name: str, options: dict | None = None) -> Check:
    return CHECKS[name](options)


def check_class(name: str) -> type[Check]:
    """The class that describes a result's evidence; the base for a check this version lacks
    (a results file from another version), which shows every evidence key as it is."""
    return CHECKS.get(name, Check)
