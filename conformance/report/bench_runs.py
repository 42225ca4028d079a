"""Repeated ``conformance bench`` runs folded into one result: per case, the median run.

A backend that appears in several bench files was run that many times; each file is one run of
the backends it holds (FlashAttention's own process is a file of its own, one per run). For every
case the published metrics are those of the run of median forward time (the lower of the middle
two), a whole run's figures together rather than medians of each figure apart, except
``ratio_to_fastest``: the median of the ratios taken within each run, where the backends shared
the GPU's state (``ratio_to_fastest_runs``), never a ratio of medians from different runs. Every
run's forward time stays in the case (``forward_us_runs``), so the published JSON keeps every run.
A case's verdict is the worst any run gave it: a failure in one run is never hidden by the others.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, worst


class BenchRunsError(ValueError):
    pass


def runs_per_backend(runs: list[RunResult]) -> dict[str, list[BackendResult]]:
    """Each backend's runs, in file order (a backend unavailable in a run adds no run)."""
    per_backend: dict[str, list[BackendResult]] = {}
    for run in runs:
        if run.suite != "bench":
            raise BenchRunsError(f"a {run.suite!r} run among the bench files: pass bench runs only")
        for backend in run.backends:
            per_backend.setdefault(backend.name, [])
            if backend.available:
                per_backend[backend.name].append(backend)
    return per_backend


def lower_middle(items: list, key=None):
    """The median item, the lower of the middle two for an even count (an item that was measured,
    never an average of two)."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def folded_case(cases: list[CaseResult]) -> CaseResult:
    """One case's runs as one: the median run's metrics, every run's forward time, the median
    in-run ratio, the worst verdict."""
    timed = [case for case in cases if case.metrics.get("forward_us") is not None]
    if not timed:  # skipped, or failed, in every run: the worst run as it was
        verdict = worst(case.verdict for case in cases)
        return next(case for case in cases if case.verdict == verdict)
    median = lower_middle(timed, key=lambda case: case.metrics["forward_us"])
    metrics = dict(median.metrics)
    metrics["forward_us_runs"] = [case.metrics["forward_us"] for case in timed]
    ratios = [case.metrics["ratio_to_fastest"] for case in timed if "ratio_to_fastest" in case.metrics]
    if ratios:
        metrics["ratio_to_fastest"] = statistics.median(ratios)
        metrics["ratio_to_fastest_runs"] = ratios
    verdict = worst(case.verdict for case in cases)
    reason = median.reason if verdict == median.verdict else next(c.reason for c in cases if c.verdict == verdict)
    return replace(median, verdict=verdict, reason=reason, metrics=metrics)


def folded_backend(runs: list[BackendResult]) -> BackendResult:
    """One backend's bench runs as one result (its cases in the first run's order)."""
    checks = []
    for first in runs[0].checks:
        same = [check for run in runs if (check := run.check(first.name)) is not None]
        by_case: dict[str, list[CaseResult]] = {}
        for check in same:
            for case in check.cases:
                by_case.setdefault(case.case, []).append(case)
        cases = [folded_case(by_case[case.case]) for case in first.cases]
        details = {**first.details, "runs": len(same)}
        verdict = worst([*(case.verdict for case in cases), *(check.verdict for check in same)])
        check = CheckResult(first.name, verdict, "", cases, details)
        check.summary = f"{check.tally()}, median of {len(same)} run{'s' if len(same) > 1 else ''}"
        checks.append(check)
    wall = lower_middle([run.wall_s for run in runs])
    return replace(runs[0], checks=checks, wall_s=wall)


def fold_bench_runs(runs: list[RunResult]) -> tuple[RunResult, int]:
    """The bench files as one result (the first file's environment) and how many runs the most
    repeated backend had."""
    if not runs:
        raise BenchRunsError("no bench files")
    per_backend = runs_per_backend(runs)
    backends = []
    for name, backend_runs in per_backend.items():
        if backend_runs:
            backends.append(folded_backend(backend_runs))
        else:  # unavailable in every run: as the first run said
            backends.append(next(b for run in runs for b in run.backends if b.name == name))
    repeats = max((len(backend_runs) for backend_runs in per_backend.values()), default=0)
    interrupted = any(run.interrupted for run in runs)
    return replace(runs[0], backends=backends, interrupted=interrupted), repeats
