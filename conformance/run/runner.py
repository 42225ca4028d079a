"""A run: every requested backend through every requested check, each backend isolated; and the
options a run takes, checked the same way for every entry point (the CLI's flags, the pytest
plugin's ``--conformance-*`` options)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from backends import registry
from backends.registry import BackendRef
from conformance.cases.grammar import Case, CaseSyntaxError
from conformance.cases.suites import chosen_cases
from conformance.checks import CHECKS, default_checks, make_check
from conformance.results import BackendResult, CheckResult, RunResult, Verdict
from conformance.run.environment import collect_environment
from conformance.run.execution import Job
from conformance.run.interrupts import Interrupted
from conformance.run.isolation import (
    BackendEvents,
    Probe,
    probe_backends,
    probe_in_process,
    run_in_process,
)
from reference_engine.device_flag import DeviceError, resolve_device


class OptionError(ValueError):
    """An option a run cannot take, in one line; ``absent``: it names a device this machine lacks."""

    def __init__(self, message: str, absent: bool = False) -> None:
        super().__init__(message)
        self.absent = absent


def split_names(values: list[str]) -> list[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]``: a repeatable option of comma-separated names."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _no_repeats(option: str, names: list[str]) -> list[str]:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise OptionError(f"{option} names {repeated[0]!r} more than once")
    return names


def backend_names(values: list[str], option: str) -> list[str]:
    """Names that resolve (built-in, entry point, or pkg.module:Class), each once. Nothing is
    imported here: the run's own process never imports backend code (a child says what each is)."""
    names = split_names(values)
    if not names:
        raise OptionError(f"{option} needs at least one name")
    for name in names:
        try:
            registry.resolve(name)
        except registry.BackendLookupError as error:
            raise OptionError(str(error)) from None
    return _no_repeats(option, names)


def check_names(values: list[str] | None, option: str) -> list[str]:
    """The checks named (default: ``default_checks()``), each a known one, each once."""
    names = split_names(values) if values else default_checks()
    if not names:
        raise OptionError(f"{option} needs at least one check name")
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise OptionError(f"unknown check {unknown[0]!r} (choose from {', '.join(CHECKS)})")
    return _no_repeats(option, names)


def run_cases(case_texts: list[str] | None, suite: str, seed: int | None, option: str) -> list[Case]:
    """The ``--case`` cases, or else the suite's (``chosen_cases``), each once."""
    try:
        cases = chosen_cases(case_texts, suite, seed)
    except CaseSyntaxError as error:
        raise OptionError(str(error)) from None
    _no_repeats(option, [case.id for case in cases])
    return cases


CUSTOM_SUITE = "custom"  # the suite a run records when its cases were named one by one


def run_suite(case_texts: list[str] | None, suite: str) -> str:
    """The suite a run records: ``custom`` for ``--case`` cases, else the suite's name."""
    return CUSTOM_SUITE if case_texts else suite


def run_device(text: str | None, option: str) -> torch.device:
    """The device named (None: cuda when visible, else cpu)."""
    try:
        return resolve_device(text, option)
    except DeviceError as error:
        raise OptionError(str(error), absent=error.absent) from None


def positive_seconds(*limits: tuple[str, float | None]) -> None:
    """Each (option, seconds) given: a finite, positive number."""
    for option, seconds in limits:
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise OptionError(f"{option} {seconds:g}: must be a finite, positive number of seconds")


SYNC_DETECTORS = ("auto", "cupti", "torch")


def check_options(sync_detector: str, prefill_backend: str, suite: str) -> dict[str, Any]:
    """What the checks are told of the run's options (``make_check``)."""
    return {"sync_detector": sync_detector, "prefill_backend": prefill_backend, "suite": suite}


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
    # Told every backend's probe once all are known, before any case result is passed on (the CLI
    # refuses a mistyped module:Class there, before it touches any file); raising stops the run.
    ready: Callable[[dict[str, Probe]], None] | None = None
    # A part of a sharded run (``--shard``): the ids of the cases it runs (every case is still
    # planned), and what its results record of the cut (``RunResult.shard``). None: the whole run.
    only: list[str] | None = None
    shard: dict[str, Any] | None = None
    # Where the isolated children run (``pool.Slot``s: ``--gpus`` / ``--workers``); None: one
    # slot, the device as given.
    slots: list[Any] | None = None
    warm: bool = False  # ``--warm``: each layout's case once before the checks (``run.warm``)

    @property
    def reported_cases(self) -> list[Case]:
        """The cases this run reports: its part's, or every one."""
        if self.only is None:
            return self.cases
        only = set(self.only)
        return [case for case in self.cases if case.id in only]


class Progress:
    """What a run tells its caller as it goes (the CLI draws a progress bar from it)."""

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None: ...

    def event(self, name: str, event: dict[str, Any]) -> None: ...

    def backend_finished(self, result: BackendResult) -> None: ...

    def warmed(self, units: int, seconds: float) -> None:
        """The warm phase (``--warm``) ended: ``units`` children ran each layout's case once."""


def assemble_checks(
    checks: list[str], cases: list[Case], events: BackendEvents, options: dict[str, Any], not_run: str
) -> list[CheckResult]:
    """Each check's result from what the children reported. A case no child reported keeps the
    SKIP the plan gave it on this device, or else is ERROR ``not_run``: never silently absent, and a
    check with nothing reported did not run (never "SKIP no cases")."""
    results = []
    for check_name in checks:
        check = make_check(check_name, options)
        whole_skip = events.whole_skip(check_name)
        if whole_skip:
            results.append(CheckResult(check_name, Verdict.SKIP, whole_skip))
            continue
        case_results = [
            events.results.get((check_name, case.id))
            or events.unreported(check_name, case.id, case.tag, Verdict.ERROR, not_run)
            for case in cases
        ]
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


def not_run_here(probe: Probe, options: RunOptions) -> BackendResult:
    """A backend that cannot run here, as its probe says: its import failed (``failed_to_load``),
    or it is unavailable on this device (every check SKIP, saying why)."""
    if probe.failure:
        return failed_to_load(probe.ref.name, probe, options)
    reason = probe.unavailable or ""
    return BackendResult(
        probe.ref.name, False, reason, probe.ref.origin, probe.claims, unavailable_checks(options.checks, reason)
    )


def _cannot_run(probe: Probe | None) -> bool:
    return probe is not None and bool(probe.failure or probe.unavailable)


def backend_row(
    ref: BackendRef, probe: Probe | None, options: RunOptions, events: BackendEvents, not_run: str, wall_s: float
) -> BackendResult:
    """A backend's row from what its children reported: what its own child said it is decides
    (a child whose import failed after all included); a case no child reported is ``not_run``."""
    said = Probe.of(ref, events.answer) if events.answer is not None else probe
    if _cannot_run(said):
        return not_run_here(said, options)
    return BackendResult(
        ref.name,
        True,
        "",
        ref.origin,
        said.claims if said is not None else {},
        assemble_checks(options.checks, options.reported_cases, events, options.check_options, not_run),
        wall_s=wall_s,
    )


def run_backend(
    ref: BackendRef,
    probe: Probe | None,
    options: RunOptions,
    progress: Progress,
    asked: Callable[[Probe], None] = lambda probe: None,
) -> BackendResult:
    """One backend through the checks in this process (``--in-process``; isolated runs go through
    the pool). ``probe``: what it is, asked already."""
    name = ref.name
    if _cannot_run(probe):
        result = not_run_here(probe, options)
        progress.backend_finished(result)
        return result
    job = Job(
        backend=name,  # resolved again in the child: its answer names the backend as the user did
        device=str(options.device),
        checks=list(options.checks),
        cases=[{"id": case.id, "tag": case.tag} for case in options.cases],
        options=options.check_options,
        only=options.only,
    )
    started = time.monotonic()
    if probe is not None:
        progress.backend_started(name, len(options.checks), len(options.reported_cases))

    def on_event(event: dict[str, Any]) -> None:
        nonlocal probe
        if event["event"] == "backend" and probe is None:
            probe = Probe.of(ref, event)
            asked(probe)
            if not _cannot_run(probe):
                progress.backend_started(name, len(options.checks), len(options.reported_cases))
        progress.event(name, event)

    def finished(events: BackendEvents, not_run: str) -> BackendResult:
        return backend_row(ref, probe, options, events, not_run, time.monotonic() - started)

    events = BackendEvents()
    try:
        run_in_process(job, on_event, events=events)
    except Interrupted as interrupted:
        interrupted.partial = finished(events, interrupted.not_run)  # what this backend finished; the rest is "not run"
        raise
    result = finished(events, "not run: no worker reported this case")
    progress.backend_finished(result)
    return result


def probe(options: RunOptions, planned: bool = False, env: dict[str, str] | None = None) -> dict[str, Probe]:
    """Every backend's claims and availability, asked in one probe child (in this process with
    ``--in-process``), before the pool hands out any unit; ``planned``: with each one's plan of the
    run's checks and cases (``Probe.plan``); ``env``: set in the probe child's environment (a slot's GPU)."""
    refs = [registry.resolve(name) for name in options.backends]
    if options.in_process:
        return probe_in_process(refs, str(options.device))
    to_plan = None
    if planned:
        cases = [{"id": case.id, "tag": case.tag} for case in options.cases]
        to_plan = {"checks": list(options.checks), "cases": cases, "options": options.check_options}
    return probe_backends(refs, str(options.device), options.case_timeout_s, to_plan, env)


def _asked_ahead(options: RunOptions, refs: list[BackendRef]) -> dict[str, Probe | None]:
    """What each backend is, asked in this process before the in-process run starts."""
    return dict(probe_in_process(refs, str(options.device)))


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
    """Every backend through the checks: in isolated children over the pool's slots (``pool``,
    one slot unless ``options.slots`` says more), or with ``--in-process`` in this process, every
    backend in turn. On ``Interrupted`` the exception leaves with ``partial``: a RunResult (marked
    interrupted) of what finished, and every case not run as ERROR "not run"."""
    progress = progress or Progress()
    if not options.in_process:
        from conformance.run.pool import run_pooled  # noqa: PLC0415 - the pool builds on this module

        return run_pooled(options, progress)
    refs = [registry.resolve(name) for name in options.backends]
    probes: dict[str, Probe | None] = {}
    backends: list[BackendResult] = []

    def asked(probe: Probe) -> None:
        probes[probe.ref.name] = probe
        if options.ready is not None and None not in probes.values():
            options.ready(probes)

    try:
        probes.update(_asked_ahead(options, refs))
        if None not in probes.values():
            asked(next(iter(probes.values())))
        for ref in refs:
            backends.append(run_backend(ref, probes[ref.name], options, progress, asked))
    except Interrupted as interrupted:
        backends += [interrupted.partial] if interrupted.partial is not None else []
        for ref in refs[len(backends) :]:
            backends.append(_not_started(ref, probes.get(ref.name), options, interrupted.not_run))
        interrupted.partial = RunResult(
            collect_environment(options.device),
            backends,
            options.suite,
            list(options.checks),
            interrupted=True,
            shard=options.shard,
        )
        raise
    annotate_bench_ratios(backends)
    return RunResult(
        collect_environment(options.device), backends, options.suite, list(options.checks), shard=options.shard
    )


def _not_started(ref: BackendRef, probe: Probe | None, options: RunOptions, not_run: str) -> BackendResult:
    if _cannot_run(probe):
        return not_run_here(probe, options)
    claims = probe.claims if probe is not None else {}
    return BackendResult(
        ref.name, True, "", ref.origin, claims, [CheckResult(check, Verdict.ERROR, not_run) for check in options.checks]
    )
