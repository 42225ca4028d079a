"""Runs checks over cases for one backend and reports each step as an event.

The same loop serves the isolated child (``conformance.run.worker``, events to a signed channel)
and ``--in-process`` runs (events to a callback). Events:

    {"event": "plan", "checks": {check: reason | null}, "cases": {check: {case: skip reason | null}}}
        first: what every check and case will be (a parent that never imports the backend accounts
        for what no child ran from it)
    {"event": "check_skipped", "check", "reason"}
    {"event": "start", "check", "case"}
    {"event": "result", "check", "result": CaseResult}
    {"event": "fatal", "check", "case", "result"}   the process must not go on (sticky CUDA error)
    {"event": "done"}   last: every case given was reported (an exit without it is a crash)

The harness state is sealed before the backend is imported and checked after every case
(``seal.py``): a change is the case's ERROR, and is put back.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from backends import registry
from conformance.cases.grammar import Case, parse_case
from conformance.checks import Check, make_check
from conformance.results import CaseResult, Verdict
from conformance.run import exit_guard
from conformance.run.gpu_turns import big_pool_turn
from conformance.run.seal import Seal

Emit = Callable[[dict[str, Any]], None]

# Errors after which the CUDA context is unusable: the process must end and a fresh one go on.
_STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
)


@dataclass
class Job:
    backend: str  # a registry name or pkg.module:Class
    device: str
    checks: list[str]
    cases: list[dict[str, str]]  # [{"id", "tag"}]
    options: dict[str, Any] = field(default_factory=dict)  # check options (e.g. sync_detector)
    done: list[tuple[str, str]] = field(default_factory=list)  # (check, case id) already reported

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "checks": self.checks,
            "cases": self.cases,
            "options": self.options,
            "done": self.done,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Job":
        return Job(
            data["backend"],
            data["device"],
            data["checks"],
            data["cases"],
            data.get("options", {}),
            [tuple(d) for d in data.get("done", [])],
        )


def job_cases(job: Job) -> list[Case]:
    return [replace(parse_case(item["id"]), tag=item.get("tag", "")) for item in job.cases]


@dataclass
class Planned:
    """One check's whole-check skip (``case`` None, ``skip`` the reason), or one of its cases with
    its skip reason (None: it runs)."""

    check_name: str
    check: Check
    case: Case | None
    skip: str | None


def plan(job: Job, backend_cls, device: torch.device) -> Iterator[Planned]:
    """Every check and case of the job, in order, with its skip reason. A resumed child plans the
    whole job again, reported cases too: some checks keep state (the engine check runs one case
    per layout), and it must decide as the first child did."""
    cases = job_cases(job)
    for check_name in job.checks:
        check = make_check(check_name, job.options)
        reason = check.skip_reason(backend_cls, device)
        if reason:
            yield Planned(check_name, check, None, reason)
            continue
        for case in cases:
            yield Planned(check_name, check, case, check.case_skip_reason(backend_cls, case, device))


def _error_result(case: Case, error: BaseException, verdict: Verdict) -> CaseResult:
    summary = f"{type(error).__name__}: {error}".strip().splitlines()[0][:400]
    return CaseResult(case.id, verdict, summary, tag=case.tag, evidence={"traceback": traceback.format_exc()[-4000:]})


def _crash_result(case: Case, reason: str, own: CaseResult | None = None) -> CaseResult:
    evidence = {"traceback": traceback.format_exc()[-4000:]} if own is None else own.evidence
    return CaseResult(case.id, Verdict.CRASH, reason, tag=case.tag, evidence=evidence)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached_memory(device: torch.device) -> None:
    """Give the case's freed blocks back to the driver: runs of other backends side by side on
    the GPU (reports/regenerate.sh) need them more than the next case does."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plan_event(items: list[Planned]) -> dict[str, Any]:
    checks: dict[str, str | None] = {}
    cases: dict[str, dict[str, str | None]] = {}
    for item in items:
        if item.case is None:
            checks[item.check_name] = item.skip
        else:
            checks.setdefault(item.check_name, None)
            cases.setdefault(item.check_name, {})[item.case.id] = item.skip
    return {"event": "plan", "checks": checks, "cases": cases}


def tampered(result: CaseResult, changes: list[str]) -> CaseResult:
    """The case's result when the harness's own state changed while it ran."""
    return CaseResult(
        result.case,
        Verdict.ERROR,
        f"the backend changed the harness's state: {'; '.join(changes)} (put back; the case's own verdict was "
        f"{result.verdict.value})",
        tag=result.tag,
        metrics=result.metrics,
        evidence={**result.evidence, "harness_state_changed": changes},
        seconds=result.seconds,
    )


def run_case(check: Check, backend_cls, case: Case, device: torch.device) -> tuple[CaseResult, bool]:
    """One case that runs (its skip already decided), as every runner runs it: the GPU's big-pool
    turn, the device synchronized inside the case (an asynchronous kernel fault is this case's),
    a backend's exception its ERROR, the case's wall time, its cached memory released. Returns the
    result and whether the process must stop (a sticky CUDA error: the context is unusable, and
    the result is CRASH)."""
    started = time.perf_counter()
    attempts: list[str] = []
    try:
        with exit_guard.watching("the case") as attempts, big_pool_turn(case, device):
            result = check.run(backend_cls, case, device)
            _synchronize(device)
    except Exception as error:  # noqa: BLE001 - a backend error is a result, not our crash
        if any(marker in str(error) for marker in _STICKY_CUDA_ERRORS):
            return _error_result(case, error, Verdict.CRASH), True
        result = _error_result(case, error, Verdict.ERROR)
    except BaseException as error:  # an exit the backend asked for: its CRASH on every path, never the run's end
        if exit_guard.is_interrupt(error):
            raise
        result = _crash_result(case, exit_guard.crash_reason(error))
    if attempts:  # os._exit on a thread of the backend's: the thread ended, the process would have
        result = _crash_result(case, attempts[0] + " during the case", result)
    result.seconds = round(time.perf_counter() - started, 3)
    _release_cached_memory(device)
    return result, False


def execute(job: Job, emit: Emit) -> bool:
    """Run the job; returns False when it stopped early on a fatal error."""
    seal = Seal.take()  # before the backend is imported: what the harness loaded is the harness's
    with exit_guard.watching("its import"):
        backend_cls = registry.load(job.backend)
    device = torch.device(job.device)
    items = list(plan(job, backend_cls, device))  # every case, reported ones too: the same skips as a fresh run
    emit(plan_event(items))
    done = set(job.done)
    for item in items:
        check_name, check, case = item.check_name, item.check, item.case
        if case is None:
            emit({"event": "check_skipped", "check": check_name, "reason": item.skip})
            continue
        if (check_name, case.id) in done:
            continue
        emit({"event": "start", "check": check_name, "case": case.id})
        if item.skip:
            result = CaseResult(case.id, Verdict.SKIP, item.skip, tag=case.tag)
        else:
            result, fatal = run_case(check, backend_cls, case, device)
            if fatal:
                emit({"event": "fatal", "check": check_name, "case": case.id, "result": result.to_dict()})
                return False
        changes = seal.changes()  # also what the import or the plan changed, on the first case
        if changes:
            result = tampered(result, changes)
        emit({"event": "result", "check": check_name, "result": result.to_dict()})
    emit({"event": "done"})
    return True
