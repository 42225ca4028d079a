"""Each backend runs in a child process, so a segfault, an abort, an illegal memory access or a
hang becomes a CRASH row naming the case it was running, and the run goes on.

After a crash, or a case that runs past the per-case time limit (the child is killed), a fresh
child resumes with the cases not yet reported (up to ``max_crashes`` times). Past the optional
time limit for the whole backend, the running case is a CRASH and the rest are not run. Cases
not run keep the SKIP they would have had on this device.

The child runs in its own process group, which the parent kills whenever it stops early
(an interrupt included); on Linux the child also dies with the parent (``PR_SET_PDEATHSIG``).
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

import torch

from backends import registry
from conformance.run.execution import Emit, Job, execute, plan
from conformance.results import CaseResult, Verdict

STDERR_TAIL_CHARS = 4000
POLL_INTERVAL_S = 0.1


@dataclass
class BackendEvents:
    """Everything the children of one backend reported, in arrival order."""

    results: dict[tuple[str, str], CaseResult] = field(default_factory=dict)
    skipped_checks: dict[str, str] = field(default_factory=dict)

    def record(self, event: dict[str, Any]) -> None:
        if event["event"] in ("result", "fatal"):
            result = CaseResult.from_dict(event["result"])
            self.results[(event["check"], result.case)] = result
        elif event["event"] == "check_skipped":
            self.skipped_checks[event["check"]] = event["reason"]


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
    except OSError:
        return ""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _child_env() -> dict[str, str]:
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


_DIE_WITH_PARENT = _die_with_parent_hook()


def _kill_group(child: subprocess.Popen) -> None:
    """The child and whatever it started (compilers, its own workers)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _not_run(job: Job, events: BackendEvents, verdict: Verdict, reason: str) -> list[dict[str, Any]]:
    """Result events for every case no child reported: SKIP where the check would have skipped
    it on this device (decided here, as the child would have), else ``verdict`` with ``reason``."""
    try:
        return _not_run_with_skips(job, events, verdict, reason)
    except Exception:  # noqa: BLE001 - deciding a skip failed: every case left simply gets the verdict
        tags = {case["id"]: case.get("tag", "") for case in job.cases}
        return [{"event": "result", "check": check,
                 "result": CaseResult(case["id"], verdict, reason, tag=tags[case["id"]]).to_dict()}
                for check in job.checks if check not in events.skipped_checks
                for case in job.cases if (check, case["id"]) not in events.results]


def _not_run_with_skips(job: Job, events: BackendEvents, verdict: Verdict, reason: str) -> list[dict[str, Any]]:
    out = []
    for item in plan(job, registry.load(job.backend), torch.device(job.device), set(events.results)):
        if item.check_name in events.skipped_checks:
            continue
        if item.case is None:
            out.append({"event": "check_skipped", "check": item.check_name, "reason": item.skip})
            continue
        result = CaseResult(item.case.id, Verdict.SKIP, item.skip, tag=item.case.tag) if item.skip else \
            CaseResult(item.case.id, verdict, reason, tag=item.case.tag)
        out.append({"event": "result", "check": item.check_name, "result": result.to_dict()})
    return out


def run_isolated(
    job: Job,
    on_event: Emit,
    *,
    case_timeout_s: float,
    backend_timeout_s: float | None = None,
    max_crashes: int = 3,
    events: BackendEvents | None = None,
) -> BackendEvents:
    """Run ``job`` in child processes; returns what they reported, CRASH rows included.
    ``events``: where to record (the caller keeps what arrived if this raises, an interrupt)."""
    events = events if events is not None else BackendEvents()
    deadline = time.monotonic() + backend_timeout_s if backend_timeout_s else float("inf")
    crashes = 0
    tags = {case["id"]: case.get("tag", "") for case in job.cases}

    def record(event: dict[str, Any]) -> None:
        events.record(event)
        on_event(event)

    def blame(item: tuple[str, str], reason: str, stderr_tail: str) -> None:
        check, case_id = item
        result = CaseResult(case_id, Verdict.CRASH, reason, tag=tags[case_id], evidence={"stderr_tail": stderr_tail})
        record({"event": "result", "check": check, "result": result.to_dict()})

    def mark_remaining(verdict: Verdict, reason: str) -> None:
        for event in _not_run(job, events, verdict, reason):
            record(event)

    with tempfile.TemporaryDirectory(prefix="conformance-") as workdir:
        for attempt in itertools.count():
            job.done = list(events.results)
            job_path = Path(workdir, f"job{attempt}.json")
            events_path = Path(workdir, f"events{attempt}.jsonl")
            log_path = Path(workdir, f"stderr{attempt}.log")
            job_path.write_text(json.dumps(job.to_dict()))
            events_path.touch()
            running, fatal_reported, hung, partial = None, False, None, ""
            with open(log_path, "w") as log, open(events_path) as reader:
                child = subprocess.Popen(
                    [sys.executable, "-m", "conformance.run.worker", str(job_path), str(events_path)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_child_env(),
                    start_new_session=True, preexec_fn=_DIE_WITH_PARENT,
                )
                try:
                    last_event = time.monotonic()  # the clock restarts at every event: a case's time (or the start-up's)
                    while True:
                        returncode = child.poll()
                        lines = (partial + reader.read()).split("\n")
                        partial = lines.pop()  # an event line still being written
                        for line in filter(None, lines):
                            event = json.loads(line)
                            running = (event["check"], event["case"]) if event["event"] == "start" else None
                            fatal_reported |= event["event"] == "fatal"
                            last_event = time.monotonic()
                            record(event)
                        if returncode is not None:
                            break
                        now = time.monotonic()
                        if now - last_event > case_timeout_s:
                            hung = f"the per-case time limit of {case_timeout_s:g} s (--timeout)"
                        elif now > deadline:
                            hung = f"the backend's time limit of {backend_timeout_s:g} s (--backend-timeout)"
                        if hung:
                            break
                        time.sleep(POLL_INTERVAL_S)
                finally:
                    if child.poll() is None:  # hung, or the parent is stopping (an interrupt)
                        _kill_group(child)
            stderr_tail = _tail(log_path)
            if hung:
                if running:
                    blame(running, f"hung: ran past {hung}; the process was killed", stderr_tail)
                if not running or now > deadline:
                    mark_remaining(Verdict.ERROR, f"not run: {hung} reached" + ("" if running else " outside any case"))
                    break
                crashes += 1
            elif returncode == 0:
                break
            else:
                crashes += 1
                how = describe_exit(returncode)
                if running:
                    blame(running, f"backend process {how} while running this case", stderr_tail)
                elif not fatal_reported:
                    # Died outside any case (an import error, a crash at start-up): nothing to resume.
                    mark_remaining(Verdict.CRASH, f"backend process {how} outside any case: {stderr_tail.strip()[-300:]}")
                    break
            if crashes > max_crashes:
                mark_remaining(Verdict.ERROR, f"not run: the backend process crashed or hung {crashes} times")
                break
    return events


def run_in_process(job: Job, on_event: Emit, *, events: BackendEvents | None = None) -> BackendEvents:
    """For debugging a backend (pdb, prints): no isolation, a crash ends the run."""
    events = events if events is not None else BackendEvents()

    def record(event: dict[str, Any]) -> None:
        events.record(event)
        on_event(event)

    execute(job, record)
    return events
