"""Each backend runs in a child process, so a segfault, an abort or an illegal memory access
becomes a CRASH row naming the case it was running, and the run goes on.

After a crash a fresh child resumes with the cases not yet reported (up to ``max_crashes``
times); a backend that exceeds its time limit is killed and the case it was running is a CRASH.
"""
from __future__ import annotations

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

from conformance.execution import Emit, Job, execute
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


def _describe_exit(returncode: int) -> str:
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


def run_isolated(
    job: Job,
    on_event: Emit,
    *,
    timeout_s: float,
    max_crashes: int = 3,
) -> BackendEvents:
    """Run ``job`` in child processes; returns what they reported, CRASH rows included."""
    events = BackendEvents()
    deadline = time.monotonic() + timeout_s
    crashes = 0
    all_items = [(check, case["id"]) for check in job.checks for case in job.cases]
    tags = {case["id"]: case.get("tag", "") for case in job.cases}

    def record(event: dict[str, Any]) -> None:
        events.record(event)
        on_event(event)

    def blame(item: tuple[str, str], reason: str, stderr_tail: str) -> None:
        check, case_id = item
        result = CaseResult(case_id, Verdict.CRASH, reason, tag=tags[case_id], evidence={"stderr_tail": stderr_tail})
        record({"event": "result", "check": check, "result": result.to_dict()})

    def mark_remaining(verdict: Verdict, reason: str) -> None:
        for check, case_id in all_items:
            if check not in events.skipped_checks and (check, case_id) not in events.results:
                result = CaseResult(case_id, verdict, reason, tag=tags[case_id])
                record({"event": "result", "check": check, "result": result.to_dict()})

    with tempfile.TemporaryDirectory(prefix="conformance-") as workdir:
        for attempt in itertools.count():
            job.done = list(events.results)
            job_path = Path(workdir, f"job{attempt}.json")
            events_path = Path(workdir, f"events{attempt}.jsonl")
            log_path = Path(workdir, f"stderr{attempt}.log")
            job_path.write_text(json.dumps(job.to_dict()))
            events_path.touch()
            running, fatal_reported, timed_out, partial = None, False, False, ""
            with open(log_path, "w") as log, open(events_path) as reader:
                child = subprocess.Popen(
                    [sys.executable, "-m", "conformance.worker", str(job_path), str(events_path)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_child_env(),
                )
                while True:
                    returncode = child.poll()
                    lines = (partial + reader.read()).split("\n")
                    partial = lines.pop()  # an event line still being written
                    for line in filter(None, lines):
                        event = json.loads(line)
                        running = (event["check"], event["case"]) if event["event"] == "start" else None
                        fatal_reported |= event["event"] == "fatal"
                        record(event)
                    if returncode is not None:
                        break
                    if time.monotonic() > deadline:
                        child.kill()
                        child.wait()
                        timed_out = True
                        break
                    time.sleep(POLL_INTERVAL_S)
            stderr_tail = _tail(log_path)
            if timed_out:
                reason = f"time limit of {timeout_s:g} s reached"
                if running:
                    blame(running, f"hung: {reason} while running this case", stderr_tail)
                mark_remaining(Verdict.ERROR, f"not run: {reason}")
                break
            if returncode == 0:
                break
            crashes += 1
            how = _describe_exit(returncode)
            if running:
                blame(running, f"backend process {how} while running this case", stderr_tail)
            elif not fatal_reported:
                # Died outside any case (an import error, a crash at start-up): nothing to resume.
                mark_remaining(Verdict.CRASH, f"backend process {how} outside any case: {stderr_tail.strip()[-300:]}")
                break
            if crashes > max_crashes:
                mark_remaining(Verdict.ERROR, f"not run: the backend process crashed {crashes} times")
                break
    return events


def run_in_process(job: Job, on_event: Emit) -> BackendEvents:
    """For debugging a backend (pdb, prints): no isolation, a crash ends the run."""
    events = BackendEvents()

    def record(event: dict[str, Any]) -> None:
        events.record(event)
        on_event(event)

    execute(job, record)
    return events
