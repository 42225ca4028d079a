"""Each backend runs in a child process, so a segfault, an abort, an illegal memory access or a
hang becomes a CRASH row naming the case it was running, and the run goes on.

After a crash, or a case that runs past the per-case time limit (the child is killed), a fresh
child resumes with the cases not yet reported (up to ``max_crashes`` times). Past the optional
time limit for the whole backend, the running case is a CRASH and the rest are not run. Cases
not run keep the SKIP they would have had on this device.

A child is finished only when it reported every case and then ``done`` on the signed events
channel (``channel.py``): any exit before that, status 0 included, is a crash of the running case.
The parent never imports the backend: what a check or case would have been (SKIP on this device,
or run) comes from the plan the first child announces.

The child runs in its own process group, which the parent kills whenever a child ends, early or
not (``reaper.py``: also the processes that left the group, and the groups of a run that died);
on Linux the child also dies with the parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.process_exit import describe_exit
from conformance.results import CaseResult, Verdict
from conformance.run import exit_guard
from conformance.run.channel import TAMPERING, ChannelReader, new_key
from conformance.run.execution import Emit, Job, execute
from conformance.run.reaper import Reaper, exited

STDERR_TAIL_CHARS = 4000
POLL_INTERVAL_S = 0.1


@dataclass
class BackendEvents:
    """Everything the children of one backend reported, in arrival order, and the plan the first
    one announced (what each check and case would be: the parent never imports the backend)."""

    results: dict[tuple[str, str], CaseResult] = field(default_factory=dict)
    skipped_checks: dict[str, str] = field(default_factory=dict)
    planned_checks: dict[str, str | None] | None = None  # check -> its whole-check skip reason
    planned_cases: dict[str, dict[str, str | None]] = field(default_factory=dict)  # check -> case -> skip reason

    def record(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind in ("result", "fatal"):
            result = CaseResult.from_dict(event["result"])
            self.results[(event["check"], result.case)] = result
        elif kind == "check_skipped":
            self.skipped_checks[event["check"]] = event["reason"]
        elif kind == "plan" and self.planned_checks is None:
            self.planned_checks, self.planned_cases = event["checks"], event["cases"]


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
    except OSError:
        return ""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The child must import what the parent can: the project and any module:Class backend.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _die_with_parent_hook():
    """For the child, run between fork and exec: be killed when the parent dies, however it dies
    (Linux ``PR_SET_PDEATHSIG``). Resolved here, in the parent, so the child imports nothing."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


DIE_WITH_PARENT = _die_with_parent_hook()


def not_run(job: Job, events: BackendEvents, verdict: Verdict, reason: str) -> list[dict[str, Any]]:
    """Result events for every case no child reported: SKIP where the plan the first child
    announced says it would have skipped on this device, else ``verdict`` with ``reason`` (also
    for every case when no child lived long enough to announce a plan)."""
    out: list[dict[str, Any]] = []
    for check in job.checks:
        if check in events.skipped_checks:
            continue
        whole_skip = (events.planned_checks or {}).get(check)
        if whole_skip:
            out.append({"event": "check_skipped", "check": check, "reason": whole_skip})
            continue
        skips = events.planned_cases.get(check, {})
        for case in job.cases:
            if (check, case["id"]) in events.results:
                continue
            skip = skips.get(case["id"])
            result = (
                CaseResult(case["id"], Verdict.SKIP, skip, tag=case.get("tag", ""))
                if skip
                else CaseResult(case["id"], verdict, reason, tag=case.get("tag", ""))
            )
            out.append({"event": "result", "check": check, "result": result.to_dict()})
    return out


def _start_worker(job_path: Path, events_path: Path, log, key: bytes) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-m", "conformance.run.worker", str(job_path), str(events_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
        preexec_fn=DIE_WITH_PARENT,
    )
    try:
        child.stdin.write(key.hex().encode() + b"\n")
        child.stdin.close()
    except OSError:  # it died at once: its exit status says how
        pass
    return child


DONE_GRACE_S = 10.0  # after "done", how long a worker may take to exit (atexit hooks) before it is killed


@dataclass
class ChildRun:
    """How one child ended: what it was running, and why the parent stopped watching it."""

    returncode: int | None = None
    running: tuple[str, str] | None = None  # (check, case) started and not reported
    fatal_reported: bool = False
    finished: bool = False  # reported every case, then "done"
    hung: str | None = None  # the time limit it ran past
    past_deadline: bool = False
    stderr_tail: str = ""


class _Recorder:
    """Where every child's events go: the backend's events and the caller's, with tampering seen
    on the channel charged to the next result, and the rows the parent writes itself."""

    def __init__(self, job: Job, events: BackendEvents, on_event: Emit) -> None:
        self.job, self.events, self.on_event = job, events, on_event
        self.tags = {case["id"]: case.get("tag", "") for case in job.cases}
        self.forged: list[str] = []  # tampering seen on the channel, not yet charged to a case

    def record(self, event: dict[str, Any]) -> None:
        if self.forged and event["event"] in ("result", "fatal"):
            event = _charged_with_tampering(event, self.forged)
            self.forged.clear()
        self.events.record(event)
        self.on_event(event)

    def blame(self, item: tuple[str, str], reason: str, stderr_tail: str) -> None:
        check, case_id = item
        result = CaseResult(
            case_id, Verdict.CRASH, reason, tag=self.tags[case_id], evidence={"stderr_tail": stderr_tail}
        )
        self.record({"event": "result", "check": check, "result": result.to_dict()})

    def mark_remaining(self, verdict: Verdict, reason: str) -> None:
        for event in not_run(self.job, self.events, verdict, reason):
            self.record(event)


def _run_child(
    job: Job,
    attempt: int,
    workdir: str,
    key: bytes,
    reaper: Reaper,
    recorder: _Recorder,
    case_timeout_s: float,
    backend_timeout_s: float | None,
    deadline: float,
) -> ChildRun:
    """One child over the cases not yet reported: started, its events read as they come, watched
    against both time limits, then it and its process group killed, however the watch ended."""
    recorder.job.done = list(recorder.events.results)
    job_path = Path(workdir, f"job{attempt}.json")
    events_path = Path(workdir, f"events{attempt}.jsonl")
    log_path = Path(workdir, f"stderr{attempt}.log")
    job_path.write_text(json.dumps(recorder.job.to_dict()))
    events_path.touch()
    run = ChildRun()
    finished_at = None
    with open(log_path, "w") as log, open(events_path) as stream:
        reader = ChannelReader(stream, key)
        child = _start_worker(job_path, events_path, log, key)
        reaper.watch(child)
        try:
            last_event = time.monotonic()  # the clock restarts at every event: a case's time (or the start-up's)
            while True:
                gone = exited(child)
                for event in reader.read():
                    if event["event"] == TAMPERING:
                        recorder.forged.append(event["what"])
                        continue
                    run.running = (event["check"], event["case"]) if event["event"] == "start" else None
                    run.fatal_reported |= event["event"] == "fatal"
                    if event["event"] == "done":
                        finished_at = time.monotonic()
                    last_event = time.monotonic()
                    recorder.record(event)
                if gone:
                    break
                now = time.monotonic()
                if finished_at is not None:
                    if now - finished_at > DONE_GRACE_S:
                        break  # reported everything; whatever keeps it alive is killed below
                elif now - last_event > case_timeout_s:
                    run.hung = f"the per-case time limit of {case_timeout_s:g} s (--timeout)"
                elif now > deadline:
                    run.hung = f"the backend's time limit of {backend_timeout_s:g} s (--backend-timeout)"
                if run.hung:
                    run.past_deadline = now > deadline
                    break
                time.sleep(POLL_INTERVAL_S)
        finally:
            run.returncode = reaper.finish(child)  # its group too, whatever stopped the loop (an interrupt)
    run.finished = finished_at is not None
    run.stderr_tail = _tail(log_path)
    return run


MAX_CRASHES = 3  # a backend's crashes and hangs a run gets over; past them its other cases are not run


def run_isolated(
    job: Job,
    on_event: Emit,
    *,
    case_timeout_s: float,
    backend_timeout_s: float | None = None,
    max_crashes: int = MAX_CRASHES,
    events: BackendEvents | None = None,
) -> BackendEvents:
    """Run ``job`` in child processes; returns what they reported, CRASH rows included.
    ``events``: where to record (the caller keeps what arrived if this raises, an interrupt).
    One child at a time (``_run_child``); after a crash or a hang a fresh one resumes with the
    cases not yet reported, unless nothing can be resumed or the limits say stop."""
    events = events if events is not None else BackendEvents()
    deadline = time.monotonic() + backend_timeout_s if backend_timeout_s else float("inf")
    recorder = _Recorder(job, events, on_event)
    key = new_key()
    crashes = 0
    reaper = Reaper()
    try:
        with tempfile.TemporaryDirectory(prefix="conformance-") as workdir:
            for attempt in itertools.count():
                run = _run_child(
                    job, attempt, workdir, key, reaper, recorder, case_timeout_s, backend_timeout_s, deadline
                )
                if run.finished:
                    if recorder.forged:  # after the last case: charged to the last result reported
                        _charge_last(events, recorder.forged, on_event)
                    break
                crashes += 1
                if not _blame_and_resume(run, recorder):
                    break
                if crashes > max_crashes:
                    recorder.mark_remaining(
                        Verdict.ERROR, f"not run: the backend process crashed or hung {crashes} times"
                    )
                    break
    finally:
        reaper.close()
    return events


def _blame_and_resume(run: ChildRun, recorder: _Recorder) -> bool:
    """The rows a child that did not finish leaves: its running case a CRASH; the rest not run
    where nothing can be resumed. True when a fresh child should go on."""
    if run.hung:
        if run.running:
            recorder.blame(run.running, f"hung: ran past {run.hung}; the process was killed", run.stderr_tail)
        if not run.running or run.past_deadline:
            recorder.mark_remaining(
                Verdict.ERROR, f"not run: {run.hung} reached" + ("" if run.running else " outside any case")
            )
            return False
        return True
    how = describe_exit(run.returncode)
    if run.returncode == 0:
        how += " before finishing (an exit from native code that no exit handler saw, such as _exit(0))"
    elif run.returncode == exit_guard.EXIT_FROM_C:
        how = "ended: the backend called exit() from C code"
    if run.running:
        recorder.blame(run.running, f"backend process {how} while running this case", run.stderr_tail)
    elif not run.fatal_reported:
        # Died outside any case (an import error, a crash at start-up): nothing to resume.
        recorder.mark_remaining(
            Verdict.CRASH, f"backend process {how} outside any case: {run.stderr_tail.strip()[-300:]}"
        )
        return False
    return True


def _charged_with_tampering(event: dict[str, Any], forged: list[str]) -> dict[str, Any]:
    """A result event turned ERROR because the channel carried lines the harness did not write
    while its case ran."""
    result = CaseResult.from_dict(event["result"])
    result = CaseResult(
        result.case,
        Verdict.ERROR,
        f"the events channel was tampered with while this case ran: {forged[0]}"
        + (f" (and {len(forged) - 1} more)" if len(forged) > 1 else "")
        + f"; the case's own verdict was {result.verdict.value}",
        tag=result.tag,
        metrics=result.metrics,
        evidence={**result.evidence, "channel_tampering": list(forged)},
        seconds=result.seconds,
    )
    return {**event, "result": result.to_dict()}


def _charge_last(events: BackendEvents, forged: list[str], on_event: Emit) -> None:
    if not events.results:
        return
    (check, _), last = next(reversed(events.results.items()))
    event = _charged_with_tampering({"event": "result", "check": check, "result": last.to_dict()}, forged)
    events.record(event)
    on_event(event)


def run_in_process(job: Job, on_event: Emit, *, events: BackendEvents | None = None) -> BackendEvents:
    """For debugging a backend (pdb, prints): no isolation, a crash ends the run."""
    events = events if events is not None else BackendEvents()

    def record(event: dict[str, Any]) -> None:
        events.record(event)
        on_event(event)

    try:
        with exit_guard.watching("the run"):  # backend code outside a case (its plan's skip decisions)
            execute(job, record)
    except BaseException as error:  # noqa: BLE001 - an exit the backend asked for ends its rows, not the run
        if exit_guard.is_interrupt(error):
            raise
        reason = exit_guard.crash_reason(error, "the run, outside any case")
        for event in not_run(job, events, Verdict.CRASH, reason):
            record(event)
    return events
