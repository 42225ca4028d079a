"""Runs checks over cases for one backend and reports each step as an event.

The same loop serves the isolated child (``conformance.run.worker``, events to a JSON-lines file)
and ``--in-process`` runs (events to a callback). Events:

    {"event": "check_skipped", "check", "reason"}
    {"event": "start", "check", "case"}
    {"event": "result", "check", "result": CaseResult}
    {"event": "fatal", "check", "case", "result"}   the process must not go on (sticky CUDA error)
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from backends import registry
from conformance.inputs.cases import Case, parse_case
from conformance.checks import Check, make_check
from conformance.results import CaseResult, Verdict
from conformance.run.gpu_turns import big_pool_turn

Emit = Callable[[dict[str, Any]], None]

# Errors after which the CUDA context is unusable: the process must end and a fresh one go on.
_STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address")


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
            "backend": self.backend, "device": self.device, "checks": self.checks, "cases": self.cases,
            "options": self.options, "done": self.done,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Job":
        return Job(
            data["backend"], data["device"], data["checks"], data["cases"], data.get("options", {}),
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


def plan(job: Job, backend_cls, device: torch.device, reported: set[tuple[str, str]]) -> Iterator[Planned]:
    """What the job has left to do, check by check, in order; the child that runs it and the
    parent that accounts for what no child ran decide skips the same way here. Every case is asked
    for its skip reason, reported ones too: some checks keep state (the engine check runs one case
    per layout), and a resumed child must decide as the first one did."""
    cases = job_cases(job)
    for check_name in job.checks:
        check = make_check(check_name, job.options)
        reason = check.skip_reason(backend_cls, device)
        if reason:
            yield Planned(check_name, check, None, reason)
            continue
        for case in cases:
            skip = check.case_skip_reason(backend_cls, case, device)
            if (check_name, case.id) not in reported:
                yield Planned(check_name, check, case, skip)


def _error_result(case: Case, error: BaseException, verdict: Verdict) -> CaseResult:
    summary = f"{type(error).__name__}: {error}".strip().splitlines()[0][:400]
    return CaseResult(
        case.id, verdict, summary, tag=case.tag, evidence={"traceback": traceback.format_exc()[-4000:]}
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached_memory(device: torch.device) -> None:
    """Give the case's freed blocks back to the driver: runs of other backends side by side on
    the GPU (reports/regenerate.sh) need them more than the next case does."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def execute(job: Job, emit: Emit) -> bool:
    """Run the job; returns False when it stopped early on a fatal error."""
    backend_cls = registry.load(job.backend)
    device = torch.device(job.device)
    for item in plan(job, backend_cls, device, set(job.done)):
        check_name, check, case = item.check_name, item.check, item.case
        if case is None:
            emit({"event": "check_skipped", "check": check_name, "reason": item.skip})
            continue
        emit({"event": "start", "check": check_name, "case": case.id})
        if item.skip:
            result = CaseResult(case.id, Verdict.SKIP, item.skip, tag=case.tag)
        else:
            started = time.perf_counter()
            try:
                with big_pool_turn(case, device):
                    result = check.run_case(backend_cls, case, device)
                    _synchronize(device)  # an asynchronous kernel fault belongs to this case
            except Exception as error:  # noqa: BLE001 - a backend error is a result, not our crash
                if any(marker in str(error) for marker in _STICKY_CUDA_ERRORS):
                    emit({"event": "fatal", "check": check_name, "case": case.id,
                          "result": _error_result(case, error, Verdict.CRASH).to_dict()})
                    return False
                result = _error_result(case, error, Verdict.ERROR)
            result.seconds = round(time.perf_counter() - started, 3)
            _release_cached_memory(device)
        emit({"event": "result", "check": check_name, "result": result.to_dict()})
    return True
