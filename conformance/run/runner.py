"""A run: every requested backend through every requested check, each backend isolated."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from backends import registry
from backends.base import DeviceInfo
from conformance.inputs.cases import Case
from conformance.checks import make_check
from conformance.run.environment import collect_environment
from conformance.run.execution import Job
from conformance.run.interrupts import Interrupted
from conformance.run.isolation import BackendEvents, run_in_process, run_isolated
from conformance.results import BackendResult, CheckResult, RunResult, Verdict


@dataclass
class RunOptions:
    backends: list[str]
    checks: list[str]
    cases: list[Case]
    device: torch.device
    suite: str = ""
    case_timeout_s: float = 900.0  # a case running longer is a hang: its child is killed, a fresh one goes on
    backend_timeout_s: float | None = None  # all of one backend's cases
    in_process: bool = False
    check_options: dict[str, Any] = field(default_factory=dict)


class Progress:
    """What a run tells its caller as it goes (the CLI draws a progress bar from it)."""

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None: ...

    def event(self, name: str, event: dict[str, Any]) -> None: ...

    def backend_finished(self, result: BackendResult) -> None: ...


def _assemble(checks: list[str], cases: list[Case], events: BackendEvents, options: dict[str, Any]) -> list[CheckResult]:
    results = []
    for check_name in checks:
        check = make_check(check_name, options)
        if check_name in events.skipped_checks:
            reason = events.skipped_checks[check_name]
            results.append(CheckResult(check_name, Verdict.SKIP, reason))
            continue
        case_results = [events.results[(check_name, case.id)] for case in cases if (check_name, case.id) in events.results]
        verdict, summary = check.summarize(case_results)
        details = {**check.details(), **check.aggregate(case_results)}
        results.append(CheckResult(check_name, verdict, summary, case_results, details=details))
    return results


def run_backend(name: str, options: RunOptions, progress: Progress) -> BackendResult:
    ref = registry.resolve(name)
    backend_cls = registry.load(ref)
    claims = backend_cls.capabilities.to_dict()
    reason = backend_cls.availability_reason(DeviceInfo.of(options.device))
    if reason:
        checks = [CheckResult(check, Verdict.SKIP, f"backend unavailable: {reason}") for check in options.checks]
        result = BackendResult(name, False, reason, ref.origin, claims, checks)
        progress.backend_finished(result)
        return result
    job = Job(
        backend=ref.target, device=str(options.device), checks=list(options.checks),
        cases=[{"id": case.id, "tag": case.tag} for case in options.cases], options=options.check_options,
    )
    progress.backend_started(name, len(options.checks), len(options.cases))
    started = time.monotonic()

    def on_event(event: dict[str, Any]) -> None:
        progress.event(name, event)

    def finished(events: BackendEvents) -> BackendResult:
        return BackendResult(name, True, "", ref.origin, claims,
                             _assemble(options.checks, options.cases, events, options.check_options),
                             wall_s=time.monotonic() - started)

    events = BackendEvents()
    try:
        if options.in_process:
            run_in_process(job, on_event, events=events)
        else:
            run_isolated(job, on_event, case_timeout_s=options.case_timeout_s,
                         backend_timeout_s=options.backend_timeout_s, events=events)
    except Interrupted as interrupted:
        interrupted.partial = finished(events)  # what this backend finished; the rest is absent
        raise
    result = finished(events)
    progress.backend_finished(result)
    return result


def annotate_bench_ratios(backends: list[BackendResult]) -> None:
    """Each bench case's forward time over the fastest backend's on the same case, in this run."""
    timings: dict[str, list] = {}
    for backend in backends:
        for case in backend.bench_cases():
            timings.setdefault(case.case, []).append(case)
    for cases in timings.values():
        fastest = min(case.metrics["forward_us"] for case in cases)
        for case in cases:
            case.metrics["ratio_to_fastest"] = case.metrics["forward_us"] / fastest


def run(options: RunOptions, progress: Progress | None = None) -> RunResult:
    """Every backend in turn. On ``Interrupted`` the exception leaves with ``partial``: a
    RunResult (marked interrupted) of every backend finished and what the current one finished."""
    progress = progress or Progress()
    backends: list[BackendResult] = []
    try:
        for name in options.backends:
            backends.append(run_backend(name, options, progress))
    except Interrupted as interrupted:
        backends += [interrupted.partial] if interrupted.partial is not None else []
        interrupted.partial = RunResult(collect_environment(options.device), backends, options.suite,
                                        list(options.checks), interrupted=True)
        raise
    annotate_bench_ratios(backends)
    return RunResult(collect_environment(options.device), backends, options.suite, list(options.checks))

