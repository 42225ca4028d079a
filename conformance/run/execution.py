"""Runs checks over cases for one backend and reports each step as an event.

The same loop serves the isolated child (``conformance.run.isolation``, events to a signed
channel) and ``--in-process`` runs (events to a callback). Events:

    {"event": "backend", "claims", "unavailable"} or {"event": "backend", "failure", "mistyped", "crashed"}
        first: what the backend is here (``answer``), or why it could not be imported; a backend
        that cannot run here ends the job there (the parent makes its row from this answer, and
        never imports backend code to ask)
    {"event": "plan", "checks": {check: reason | null}, "cases": {check: {case: skip reason | null}}}
        next: what every check and case will be (a parent that never imports the backend accounts
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
from backends.base import DeviceInfo
from backends.registry import BackendLookupError, BackendRef, NoSuchBackendClass
from conformance.cases.grammar import Case, parse_case
from conformance.checks import Check, make_check
from conformance.harness.step import WroteOutsideOutput
from conformance.results import CaseResult, Outcome, Verdict
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
    # A part of a sharded run (``run.shard``): the case ids this job runs and reports; every case
    # is still planned, so that each part plans as the whole run does. None: every case.
    only: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "checks": self.checks,
            "cases": self.cases,
            "options": self.options,
            "done": self.done,
            "only": self.only,
        }

    def reported(self) -> list[dict[str, str]]:
        """The cases this job reports: its part's (``only``), or every one."""
        if self.only is None:
            return self.cases
        only = set(self.only)
        return [case for case in self.cases if case["id"] in only]

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Job":
        return Job(
            data["backend"],
            data["device"],
            data["checks"],
            data["cases"],
            data.get("options", {}),
            [tuple(d) for d in data.get("done", [])],
            data.get("only"),
        )


def job_cases(job: Job) -> list[Case]:
    return [replace(parse_case(item["id"]), tag=item.get("tag", "")) for item in job.cases]


@dataclass
class Loaded:
    """A backend's class, or why it could not be imported."""

    backend_cls: Any = None
    failure: str | None = None
    failure_verdict: Verdict = Verdict.ERROR  # CRASH: the import asked the process to end
    mistyped: bool = False


def load_backend(ref: BackendRef) -> Loaded:
    """Import the backend as every path does (a run's child, the probe child, ``--in-process``,
    the pytest plugin): an import that raises is the backend's ERROR, one that asks the process to
    end (``os._exit``, ``sys.exit``) its CRASH, a module:Class that names nothing a typo."""
    try:
        with exit_guard.watching("its import"):
            return Loaded(registry.load(ref))
    except BackendLookupError as error:
        return Loaded(failure=str(error), mistyped=ref.origin == "module:Class" and _names_nothing(ref, error))
    except BaseException as error:  # an exit asked for at import: the backend's CRASH, not the run's end
        if exit_guard.is_interrupt(error):
            raise
        reason = f"cannot load backend {ref.name!r}: {exit_guard.crash_reason(error, 'its import')}"
        return Loaded(failure=reason, failure_verdict=Verdict.CRASH)


def _names_nothing(ref: BackendRef, error: BackendLookupError) -> bool:
    """The module itself does not exist, or has no such class: a typo on the command line (a
    missing dependency inside the module is the backend's failure)."""
    module_name = ref.target.partition(":")[0]
    cause = error.__cause__
    if isinstance(cause, ModuleNotFoundError):
        return cause.name is not None and (module_name == cause.name or module_name.startswith(cause.name + "."))
    return cause is None and isinstance(error, NoSuchBackendClass)


def answer(loaded: Loaded, device_text: str) -> dict[str, Any]:
    """What a loaded backend is on the device (its claims, and why it cannot run here: None when it
    can), or why it could not be loaded: a run's child says it first, the probe child for each
    backend it is asked about."""
    if loaded.failure:
        return {
            "failure": loaded.failure,
            "mistyped": loaded.mistyped,
            "crashed": loaded.failure_verdict == Verdict.CRASH,
        }
    return {
        "claims": loaded.backend_cls.capabilities.to_dict(),
        "unavailable": loaded.backend_cls.availability_reason(DeviceInfo.of(torch.device(device_text))),
    }


@dataclass
class Planned:
    """One check's whole-check skip (``case`` None, ``skip`` the reason), or one of its cases with
    its skip reason (None: it runs)."""

    check_name: str
    check: Check
    case: Case | None
    skip: str | None


def plan(job: Job, backend_cls, device: torch.device) -> Iterator[Planned]:
    """Every check and case of the job, in order, with its skip reason (``Check.plan``: from the
    whole list of cases, so a resumed child plans as the first one did)."""
    cases = job_cases(job)
    for check_name in job.checks:
        check = make_check(check_name, job.options)
        reason = check.skip_reason(backend_cls, device)
        if reason:
            yield Planned(check_name, check, None, reason)
            continue
        skips = check.plan(backend_cls, cases, device)
        for case in cases:
            yield Planned(check_name, check, case, skips[case.id])


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


def tampered(result: CaseResult, changes: list[str], *, channel: bool = False) -> CaseResult:
    """The case's result when what its verdict rests on was tampered with while it ran: the
    harness's own state (``changes``, each put back), or, with ``channel``, the events channel
    (``changes``: the lines the harness did not write, seen by the parent). Every path turns such a
    result ERROR here, naming the case's own verdict and keeping the changes in its evidence."""
    verdict = result.verdict.value
    if channel:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        reason = f"the events channel was tampered with while this case ran: {changes[0]}{more}"
        reason += f"; the case's own verdict was {verdict}"
    else:
        reason = f"the backend changed the harness's state: {'; '.join(changes)} (put back; the case's own verdict was "
        reason += f"{verdict})"
    return CaseResult(
        result.case,
        Verdict.ERROR,
        reason,
        tag=result.tag,
        metrics=result.metrics,
        evidence={**result.evidence, "channel_tampering" if channel else "harness_state_changed": list(changes)},
        seconds=result.seconds,
    )


def judge(check: Check, backend_cls, case: Case, device: torch.device) -> CaseResult:
    """The check's outcome as the case's result, stamped with its id and tag: the one place a step
    that wrote where it may not (``WroteOutsideOutput``: a tensor it was handed, output rows past
    its real tokens) becomes the case's FAIL, in every check."""
    try:
        outcome = check.run_case(backend_cls, case, device)
    except WroteOutsideOutput as error:
        outcome = Outcome(Verdict.FAIL, str(error), metrics=error.metrics)
    return CaseResult.of(case.id, case.tag, outcome)


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
            result = judge(check, backend_cls, case, device)
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


def _load_and_answer(job: Job, emit: Emit):
    """The job's backend imported, and the ``backend`` event saying what it is here; None when it
    cannot run here (a name that no longer resolves, an import that failed, a device it does not
    run on)."""
    try:
        ref = registry.resolve(job.backend)
    except BackendLookupError as error:
        emit({"event": "backend", "failure": str(error), "mistyped": False, "crashed": False})
        return None
    loaded = load_backend(ref)
    said = answer(loaded, job.device)
    emit({"event": "backend", **said})
    return None if loaded.failure or said.get("unavailable") else loaded.backend_cls


def execute(job: Job, emit: Emit) -> bool:
    """Run the job; returns False when it stopped early on a fatal error."""
    seal = Seal.take()  # before the backend is imported: what the harness loaded is the harness's
    backend_cls = _load_and_answer(job, emit)
    if backend_cls is None:  # it cannot run here: its answer says why, and that is the whole job
        emit({"event": "done"})
        return True
    device = torch.device(job.device)
    items = list(plan(job, backend_cls, device))  # every case, reported ones too: the same skips as a fresh run
    emit(plan_event(items))
    done = set(job.done)
    if job.only is not None:  # another part of a sharded run reports the other cases
        only = set(job.only)
        done |= {(item.check_name, item.case.id) for item in items if item.case and item.case.id not in only}
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
