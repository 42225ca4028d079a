"""Each backend runs in a child process, so a segfault, an abort, an illegal memory access or a
hang becomes a CRASH row naming the case it was running, and the run goes on. Both sides are
here: the parent, which never imports backend code, and the child
(``python -m conformance.run.isolation JOB.json EVENTS``), whose first event says what its
backend is here (its claims and availability, or why its import failed: ``execution.answer``),
before it plans and runs the cases. A child that dies or hangs before saying it costs that
backend its row, with the reason the probe child gives (``import_failure``).

After a crash, or a case that runs past the per-case time limit (the child is killed), a fresh
child resumes with the cases not yet reported (up to ``max_crashes`` times). Past the optional
time limit for the whole backend, the running case is a CRASH and the rest are not run. Cases
not run keep the SKIP they would have had on this device.

A child is finished only when it reported every case and then ``done`` on the signed events
channel (``channel.py``): any exit before that, status 0 included, is a crash of the running case.
The parent never imports the backend: what a check or case would have been (SKIP on this device,
or run) comes from the plan the first child announces.

The probe child (``python -m conformance.run.isolation --ask DEVICE``) answers for many backends
at once, importing each in turn: ``conformance list``, and a run of several backends, several
slots or ``--warm``, before the pool starts any (so that a typo among them is refused before any
file is touched), then planning each for the pool's units; a run of one backend on one slot is
answered by the child that then runs it (``pool``).

The child runs in its own process group, which the parent kills whenever a child ends, early or
not (``reaper.py``: also the processes that left the group, and the groups of a run that died);
on Linux the child also dies with the parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.registry import BackendRef
from conformance.process_exit import describe_exit
from conformance.results import CaseResult, Verdict
from conformance.run import exit_guard
from conformance.run.channel import TAMPERING, ChannelReader, ChannelWriter, new_key
from conformance.run.execution import Emit, Job, answer, execute, load_backend, plan, plan_event, tampered
from conformance.run.reaper import Reaper, exited
from conformance.run.seal import Seal

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
    answer: dict[str, Any] | None = None  # the first child's "backend" event: what the backend is here

    def record(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind in ("result", "fatal"):
            result = CaseResult.from_dict(event["result"])
            self.results[(event["check"], result.case)] = result
        elif kind == "check_skipped":
            self.skipped_checks[event["check"]] = event["reason"]
        elif kind == "plan" and self.planned_checks is None:
            self.planned_checks, self.planned_cases = event["checks"], event["cases"]
        elif kind == "backend" and self.answer is None:
            self.answer = event

    def absorb(self, other: "BackendEvents") -> None:
        """What another child of the same backend reported (a pool's unit of other cases)."""
        self.results.update(other.results)
        for check, reason in other.skipped_checks.items():
            self.skipped_checks.setdefault(check, reason)
        if self.planned_checks is None and other.planned_checks is not None:
            self.planned_checks, self.planned_cases = other.planned_checks, other.planned_cases

        def runs(answer: dict[str, Any] | None) -> bool:
            return bool(answer) and not answer.get("failure") and not answer.get("unavailable")

        if self.answer is None or (not runs(self.answer) and runs(other.answer)):
            self.answer = other.answer  # a child that loaded and can run the backend says what it is

    def whole_skip(self, check: str) -> str | None:
        """Why ``check`` skips as a whole on this device (reported, or planned), or None."""
        return self.skipped_checks.get(check) or (self.planned_checks or {}).get(check)

    def unreported(self, check: str, case: str, tag: str, verdict: Verdict, reason: str) -> CaseResult:
        """A case of ``check`` that no child reported: the SKIP the plan gave it on this device, or
        else ``verdict`` with ``reason`` (also for every case when no child lived long enough to
        announce a plan). Never silently absent: every path (the children's parent, the runner,
        the pytest plugin's results) accounts for such a case here."""
        skip = self.planned_cases.get(check, {}).get(case)
        return CaseResult(case, Verdict.SKIP if skip else verdict, skip or reason, tag=tag)


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
    env[PARENT_ENV] = str(os.getpid())
    return env


PARENT_ENV = "CONFORMANCE_PARENT_PID"  # the process that started a child: it dies with it


def die_with_parent() -> None:
    """In a child, first thing: be killed when the parent dies, however it dies (Linux
    ``PR_SET_PDEATHSIG``). The child sets it itself: a ``preexec_fn`` between fork and exec is not
    safe in a parent with threads, as the pool's is (a lock held by another thread at the fork
    would hang the child before it ever runs). A parent gone before this ends the child at once."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit() and os.getppid() != int(parent):
        os._exit(1)  # its parent is gone: nobody reads what it would report


def not_run(job: Job, events: BackendEvents, verdict: Verdict, reason: str) -> list[dict[str, Any]]:
    """Events for every check and case no child reported (``BackendEvents.unreported``)."""
    out: list[dict[str, Any]] = []
    for check in job.checks:
        if check in events.skipped_checks:
            continue
        whole_skip = events.whole_skip(check)
        if whole_skip:
            out.append({"event": "check_skipped", "check": check, "reason": whole_skip})
            continue
        for case in job.reported():
            if (check, case["id"]) not in events.results:
                result = events.unreported(check, case["id"], case.get("tag", ""), verdict, reason)
                out.append({"event": "result", "check": check, "result": result.to_dict()})
    return out


MAX_CRASHES = 3  # a backend's crashes and hangs a run gets over; past them its other cases are not run


class CrashBudget:
    """How many times a backend's children may crash or hang before the rest of its cases are not
    run: one budget for every child of the backend, however many run at once (a pool's units)."""

    def __init__(self, limit: int = MAX_CRASHES) -> None:
        self.limit, self.spent, self.lock = limit, 0, threading.Lock()

    def spend(self) -> bool:
        """One more crash or hang; False once past the limit."""
        with self.lock:
            self.spent += 1
            return self.spent <= self.limit

    @property
    def exhausted(self) -> bool:
        return self.spent > self.limit

    @property
    def given_up(self) -> str:
        """The reason every case not run after the budget was spent carries."""
        return f"not run: the backend process crashed or hung {self.spent} times"


class Stopped(Exception):
    """A pool's run was stopped (an interrupt in its main thread): the child is killed."""


def _start_worker(
    job_path: Path, events_path: Path, log, key: bytes, env: dict[str, str] | None = None
) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-m", "conformance.run.isolation", str(job_path), str(events_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE,
        env={**child_env(), **(env or {})},
        start_new_session=True,
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
    answered: dict[str, Any] | None = None  # its "backend" event: what it said its backend is


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
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
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
        child = reaper.spawn(lambda: _start_worker(job_path, events_path, log, key, env))
        try:
            last_event = time.monotonic()  # the clock restarts at every event: a case's time (or the start-up's)
            while True:
                gone = exited(child)
                for event in reader.read():
                    if event["event"] == TAMPERING:
                        recorder.forged.append(event["what"])
                        continue
                    run.running = (event["check"], event["case"]) if event["event"] == "start" else None
                    if event["event"] == "backend":
                        run.answered = event
                    run.fatal_reported |= event["event"] == "fatal"
                    if event["event"] == "done":
                        finished_at = time.monotonic()
                    last_event = time.monotonic()
                    recorder.record(event)
                if gone:
                    break
                if stop is not None and stop.is_set():
                    raise Stopped()
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


def run_isolated(
    job: Job,
    on_event: Emit,
    *,
    case_timeout_s: float,
    backend_timeout_s: float | None = None,
    max_crashes: int = MAX_CRASHES,
    events: BackendEvents | None = None,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    budget: CrashBudget | None = None,
) -> BackendEvents:
    """Run ``job`` in child processes; returns what they reported, CRASH rows included.
    ``events``: where to record (the caller keeps what arrived if this raises, an interrupt).
    One child at a time (``_run_child``); after a crash or a hang a fresh one resumes with the
    cases not yet reported, unless nothing can be resumed or the limits say stop. ``env``: set in
    each child's environment (a pool slot's GPU); ``stop``: when set, the child is killed and
    ``Stopped`` raised (a pool's interrupt, from its main thread); ``budget``: the crashes the
    backend may still have, shared by its jobs (default: ``max_crashes`` for this job)."""
    budget = budget if budget is not None else CrashBudget(max_crashes)
    events = events if events is not None else BackendEvents()
    deadline = time.monotonic() + backend_timeout_s if backend_timeout_s else float("inf")
    recorder = _Recorder(job, events, on_event)
    key = new_key()
    reaper = Reaper()
    try:
        with tempfile.TemporaryDirectory(prefix="conformance-") as workdir:
            for attempt in itertools.count():
                run = _run_child(
                    job, attempt, workdir, key, reaper, recorder, case_timeout_s, backend_timeout_s, deadline, env, stop
                )
                if events.answer is None:  # it died or hung importing the backend: that backend's row
                    recorder.record({"event": "backend", **_unloadable(job.backend, run, case_timeout_s)})
                    break
                failure = (run.answered or {}).get("failure")
                if failure and attempt > 0:  # a fresh child could not load what the first one ran
                    recorder.mark_remaining(Verdict.CRASH if run.answered.get("crashed") else Verdict.ERROR, failure)
                if run.finished:
                    if recorder.forged:  # after the last case: charged to the last result reported
                        _charge_last(events, recorder.forged, on_event)
                    break
                within = budget.spend()
                if not _blame_and_resume(run, recorder):
                    break
                if not within:
                    recorder.mark_remaining(Verdict.ERROR, budget.given_up)
                    break
    finally:
        reaper.close()
    return events


def import_failure(name: str, *, hung: str | None = None, returncode: int | None = None, output: str = "") -> str:
    """Why a backend could not be loaded when the process importing it hung past ``hung`` (a time
    limit, in words) or ended (``returncode``, the last line of its ``output``): the same words
    from the probe child and from a run's child that dies before saying what its backend is."""
    if hung:
        why = f"importing it ran past {hung}"
    else:
        how = describe_exit(returncode)
        lines = output.strip().splitlines()
        why = f"the process importing it {'was ' * how.startswith('killed')}{how}" + (
            f": {lines[-1][:300]}" if lines else ""
        )
    return f"cannot load backend {name!r}: {why}"


def _unloadable(name: str, run: ChildRun, case_timeout_s: float) -> dict[str, Any]:
    """The answer of a child that died or hung before giving one: its backend's CRASH."""
    if run.hung:
        limit = run.hung if run.past_deadline else f"the time limit of {case_timeout_s:g} s (--timeout)"
        failure = import_failure(name, hung=limit)
    else:
        failure = import_failure(name, returncode=run.returncode, output=run.stderr_tail)
    return {"failure": failure, "mistyped": False, "crashed": True}


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
    return {**event, "result": tampered(CaseResult.from_dict(event["result"]), forged, channel=True).to_dict()}


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


@dataclass
class Probe:
    """One backend as the run sees it before running it: a child's answer (``execution.answer``)."""

    ref: BackendRef
    claims: dict[str, Any] = field(default_factory=dict)
    unavailable: str | None = None  # why it cannot run on this device (None: it can)
    failure: str | None = None  # why it could not even be asked (import error, crash, hang)
    failure_verdict: Verdict = Verdict.ERROR  # ERROR for a raised import error, CRASH for a dead or hung child
    mistyped: bool = False  # a pkg.module:Class that names no module or class: the user's mistake, not the backend's
    # Its ``plan`` event for the run's checks and cases, where the probe was asked to plan
    # (``probe_backends``' ``to_plan``) and planning ended: which cases run, before any child runs them.
    plan: dict[str, Any] | None = None

    @staticmethod
    def of(ref: BackendRef, said: dict[str, Any]) -> "Probe":
        return Probe(
            ref,
            claims=said.get("claims") or {},
            unavailable=said.get("unavailable"),
            failure=said.get("failure"),
            failure_verdict=Verdict.CRASH if said.get("crashed") else Verdict.ERROR,
            mistyped=bool(said.get("mistyped")),
        )


def probe_in_process(refs: list[BackendRef], device_text: str) -> dict[str, Probe]:
    return {ref.name: Probe.of(ref, answer(load_backend(ref), device_text)) for ref in refs}


def probe_backends(
    refs: list[BackendRef],
    device_text: str,
    timeout_s: float,
    to_plan: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Probe]:
    """Each backend's claims and availability, asked in one probe child (``--ask``), which prints
    one JSON line as it starts each backend and one with the answer; a backend whose import crashes
    or runs past ``timeout_s`` gets a ``failure``, and a fresh child goes on with the rest.
    ``to_plan`` (a job's ``checks``, ``cases`` and ``options``): each backend that can run here is
    also planned over them (``Probe.plan``). Planning runs backend code: a probe child that dies
    or hangs while planning leaves that backend without a plan (its own children then meet the
    same fault and say so), not without an answer. ``env``: set in the child's environment."""
    probes: dict[str, Probe] = {}
    pending = list(refs)
    while pending:
        stderr_file = tempfile.TemporaryFile("w+")  # a file, not a pipe: an import that prints a lot cannot block
        child = subprocess.Popen(
            [sys.executable, "-m", "conformance.run.isolation", "--ask", device_text],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
            env={**child_env(), **(env or {})},
            start_new_session=True,
        )
        try:
            header = json.dumps({"plan": to_plan}) + "\n"
            child.stdin.write(header + "".join(json.dumps(ref.__dict__) + "\n" for ref in pending))
            child.stdin.close()
        except OSError:
            pass
        current, buffer, deadline, hung, ended = None, b"", time.monotonic() + timeout_s, False, False
        planning: str | None = None  # the backend answered and being planned
        between = False  # a backend planned, the next not yet started: a death then is none's import
        try:
            while pending or planning:
                if b"\n" not in buffer:
                    ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
                    if not ready:
                        hung = True
                        break
                    chunk = os.read(child.stdout.fileno(), 65536)  # unbuffered: select sees what is left
                    if not chunk:
                        ended = True  # it died
                        break
                    buffer += chunk
                    continue
                line, buffer = buffer.split(b"\n", 1)
                data = json.loads(line)
                if "start" in data:
                    current, deadline, between = pending[0], time.monotonic() + timeout_s, False
                    continue
                if "planned" in data:  # the plan event, or None where planning raised
                    if planning is not None:
                        probes[planning].plan = data["planned"]
                    planning, between = None, True
                    continue
                probes[data["name"]] = Probe.of(pending.pop(0), data)
                current = None
                if data.get("planning"):
                    planning, deadline = data["name"], time.monotonic() + timeout_s
        finally:
            if ended:  # its output ended: let it finish dying, so its exit status says how
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    hung = True
            _kill(child)
        if pending and planning is None and not between:  # it died or hung importing a backend
            blamed = current or pending[0]
            stderr_file.seek(0)
            limit = f"the time limit of {timeout_s:g} s (--timeout)" if hung else None
            failure = import_failure(blamed.name, hung=limit, returncode=child.returncode, output=stderr_file.read())
            probes[blamed.name] = Probe(blamed, failure=failure, failure_verdict=Verdict.CRASH)
            pending.remove(blamed)
        stderr_file.close()
    return probes


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _ask_main(device_text: str) -> int:
    """The probe child: each backend named on standard input (one JSON line each) imported in turn,
    and answered on standard output."""
    answers = os.fdopen(os.dup(1), "w")  # a private copy of stdout: what a backend prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start_dir = os.getcwd()
    asked_plan = json.loads(sys.stdin.readline())["plan"]
    seal = Seal.take()  # before any backend is imported, as a run's child takes it
    for line in sys.stdin:
        ref = BackendRef(**json.loads(line))
        answers.write(json.dumps({"start": ref.name}) + "\n")
        answers.flush()
        loaded = load_backend(ref)
        said = answer(loaded, device_text)
        os.chdir(start_dir)  # an import that moved the process must not move the next one
        planning = asked_plan is not None and not loaded.failure and not said.get("unavailable")
        answers.write(json.dumps({"name": ref.name, **said, "planning": planning}) + "\n")
        answers.flush()
        if planning:
            planned = _plan_of(ref, loaded.backend_cls, asked_plan, device_text)
            os.chdir(start_dir)
            # A backend whose import or plan changed the harness's state gets no plan: the parent
            # reports nothing for it, and its children, which see the change, report each case.
            answers.write(json.dumps({"planned": None if seal.changes() else planned}) + "\n")
            answers.flush()
        seal.changes()  # put back for the next backend
    return 0


def _plan_of(ref: BackendRef, backend_cls, asked: dict[str, Any], device_text: str) -> dict[str, Any] | None:
    """The ``plan`` event a run's child of this backend would announce; None where planning raised
    (its children then report how)."""
    job = Job(ref.name, device_text, asked["checks"], asked["cases"], asked.get("options", {}))
    try:
        with exit_guard.watching("the plan"):
            import torch  # noqa: PLC0415 - the probe child's alone

            return plan_event(list(plan(job, backend_cls, torch.device(device_text))))
    except BaseException as error:  # noqa: BLE001 - the backend's planning fault is its children's to report
        if exit_guard.is_interrupt(error):
            raise
        return None


EXIT_FATAL = 70  # a run's child stopped on a fatal CUDA error (the parent starts a fresh one)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
KEEP_FREED_BYTES = 1 << 30


def _keep_freed_memory() -> None:
    """Let glibc keep freed memory (up to 1 GiB a block) for the next allocation instead of
    returning it to the kernel: a case allocates and frees the same large tensors over and over,
    and each fresh mapping is faulted in and zeroed again. Measured on the 2-core CPU machine: one
    large standard case (numerics + determinism) 35 s → 26 s, system time 22 s → 4.6 s."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    except (OSError, AttributeError):  # not glibc: the allocator's defaults
        pass


def _child_main(job_path: str, events_path: str) -> int:
    """A run's child: ``JOB.json EVENTS``, the channel's key on standard input (one hex line, read
    before the backend is imported; standard input is then /dev/null). Each event is one flushed,
    signed line (``channel.py``), so the parent keeps every result that landed before a crash and
    can tell the harness's lines from anything else written there. The last event is ``done``: an
    exit without it (status 0 included: a backend that calls ``exit``) is a crash of the case that
    was running. Exit status 0: finished; 70: stopped on a fatal CUDA error."""
    _keep_freed_memory()
    key = bytes.fromhex(sys.stdin.readline().strip())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with open(job_path) as job_file:
        job = Job.from_dict(json.load(job_file))
    with open(events_path, "a", buffering=1) as events:
        finished = execute(job, ChannelWriter(events, key).emit)
    return 0 if finished else EXIT_FATAL


if __name__ == "__main__":
    die_with_parent()
    sys.exit(_ask_main(sys.argv[2]) if sys.argv[1] == "--ask" else _child_main(*sys.argv[1:]))
