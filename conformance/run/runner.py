"""A run: every requested backend through every requested check, each backend isolated."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from backends import registry
from conformance.cases.grammar import Case
from conformance.checks import make_check
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.run.environment import collect_environment
from conformance.run.execution import Job
from conformance.run.interrupts import Interrupted
from conformance.run.isolation import BackendEvents, run_in_process, run_isolated
from conformance.run.probe import Probe, probe_backends, probe_in_process


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
    probes: dict[str, Probe] | None = None  # asked already (the CLI asks before it touches any file)


class Progress:
    """What a run tells its caller as it goes (the CLI draws a progress bar from it)."""

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None: ...

    def event(self, name: str, event: dict[str, Any]) -> None: ...

    def backend_finished(self, result: BackendResult) -> None: ...


def assemble_checks(
    checks: list[str], cases: list[Case], events: BackendEvents, options: dict[str, Any], not_run: str
) -> list[CheckResult]:
    """Each check's result from what the children reported. A case no child reported keeps the
    SKIP the plan gave it on this device, or else is ERROR ``not_run``: never silently absent, and a
    check with nothing reported did not run (never "SKIP no cases")."""
    results = []
    for check_name in checks:
        check = make_check(check_name, options)
        whole_skip = events.skipped_checks.get(check_name) or (events.planned_checks or {}).get(check_name)
        if whole_skip:
            results.append(CheckResult(check_name, Verdict.SKIP, whole_skip))
            continue
        planned = events.planned_cases.get(check_name, {})

        def unreported(case: Case) -> CaseResult:
            skip = planned.get(case.id)
            return CaseResult(case.id, Verdict.SKIP if skip else Verdict.ERROR, skip or not_run, tag=case.tag)

        case_results = [events.results.get((check_name, case.id)) or unreported(case) for case in cases]
        verdict, summary = check.summarize(case_results)
        details = {**check.details(), **check.aggregate(case_results)}
        results.append(CheckResult(check_name, verdict, summary, case_results, details=details))
    return results


def unavailable_checks(checks: list[str], reason: str) -> list[CheckResult]:
    """Every check of a backend that cannot run on this device: SKIP, saying why."""
    return [CheckResult(check, Verdict.SKIP, f"backend unavailable: {reason}") for check in checks]


def failed_backend(name: str, origin: str, verdict: Verdict, why: str, checks: list[str]) -> BackendResult:
    """A backend whose import raised, crashed or hung: every check carries why, as a failure."""
    return BackendResult(name, True, "", origin, {}, [CheckResult(check, verdict, why) for check in checks])


def failed_to_load(name: str, probe: Probe, options: RunOptions) -> BackendResult:
    return failed_backend(name, probe.ref.origin, probe.failure_verdict, probe.failure or "", options.checks)


def run_backend(name: str, probe: Probe, options: RunOptions, progress: Progress) -> BackendResult:
    ref = probe.ref
    if probe.failure:
        result = failed_to_load(name, probe, options)
        progress.backend_finished(result)
        return result
    claims = probe.claims
    if probe.unavailable:
        reason = probe.unavailable
        checks = unavailable_checks(options.checks, reason)
        result = BackendResult(name, False, reason, ref.origin, claims, checks)
        progress.backend_finished(result)
        return result
    job = Job(
        backend=ref.target,
        device=str(options.device),
        checks=list(options.checks),
        cases=[{"id": case.id, "tag": case.tag} for case in options.cases],
        options=options.check_options,
    )
    progress.backend_started(name, len(options.checks), len(options.cases))
    started = time.monotonic()

    def on_event(event: dict[str, Any]) -> None:
        progress.event(name, event)

    def finished(events: BackendEvents, not_run: str) -> BackendResult:
        return BackendResult(
            name,
            True,
            "",
            ref.origin,
            claims,
            assemble_checks(options.checks, options.cases, events, options.check_options, not_run),
            wall_s=time.monotonic() - started,
        )

    events = BackendEvents()
    try:
        if options.in_process:
            run_in_process(job, on_event, events=events)
        else:
            run_isolated(
                job,
                on_event,
                case_timeout_s=options.case_timeout_s,
                backend_timeout_s=options.backend_timeout_s,
                events=events,
            )
    except Interrupted as interrupted:
        interrupted.partial = finished(events, interrupted.not_run)  # what this backend finished; the rest is "not run"
        raise
    result = finished(events, "not run: no worker reported this case")
    progress.backend_finished(result)
    return result


def probe(options: RunOptions) -> dict[str, Probe]:
    """Every backend's claims and availability, asked before the run (in a child process unless
    ``--in-process``)."""
    refs = [registry.resolve(name) for name in options.backends]
    if options.in_process:
        return probe_in_process(refs, str(options.device))
    return probe_backends(refs, str(options.device), options.case_timeout_s)


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
    RunResult (marked interrupted) of every backend finished, what the current one finished, and
    every case not run as ERROR "not run"."""
    progress = progress or Progress()
    probes = options.probes if options.probes is not None else probe(options)
    backends: list[BackendResult] = []
    try:
        for name in options.backends:
            backends.append(run_backend(name, probes[name], options, progress))
    except Interrupted as interrupted:
        backends += [interrupted.partial] if interrupted.partial is not None else []
        for name in options.backends[len(backends) :]:
            backends.append(_not_started(name, probes[name], options, interrupted.not_run))
        interrupted.partial = RunResult(
            collect_environment(options.device), backends, options.suite, list(options.checks), interrupted=True
        )
        raise
    annotate_bench_ratios(backends)
    return RunResult(collect_environment(options.device), backends, options.suite, list(options.checks))


def _not_started(name: str, probe: Probe, options: RunOptions, not_run: str) -> BackendResult:
    if probe.failure or probe.unavailable:
        return (
            failed_to_load(name, probe, options)
            if probe.failure
            else BackendResult(
                name,
                False,
                probe.unavailable or "",
                probe.ref.origin,
                probe.claims,
                unavailable_checks(options.checks, probe.unavailable or ""),
            )
        )
    return BackendResult(
        name,
        True,
        "",
        probe.ref.origin,
        probe.claims,
        [CheckResult(check, Verdict.ERROR, not_run) for check in options.checks],
    )
