"""A real SIGINT or SIGTERM to a running ``conformance run``: the worker is stopped, what finished
is written marked interrupted, nothing is left behind, and the exit code says which signal."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.cases.grammar import parse_case

FINISHES = parse_case("gqa-h2/1-d16-fp32:5+1").id
HANGS = parse_case("gqa-h2/1-d16-fp32:9+2").id  # HangsOnLongSequence never returns here


def children(pid: int) -> list[int]:
    """Every thread's children (the run's children are its pool's: started from worker threads)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_command(*args: str) -> list[str]:
    """``conformance run ARGS`` as its own process runs it."""
    return [sys.executable, "-m", "conformance", "run", *args]


def start_run(tmp_path: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    results = tmp_path / "results.json"
    results.write_text("{}")  # an older run's file: must not survive looking current
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    command = run_command(
        "--backend",
        "tests.planted.defects:HangsOnLongSequence",
        "--case",
        FINISHES,
        "--case",
        HANGS,
        "--check",
        "numerics",
        "--device",
        "cpu",
        "--json",
        str(results),
        *extra,
    )
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )  # its own group: killpg reaches it and no test runner
    journal = results.with_name("results.json.journal")
    deadline = time.monotonic() + 120
    while not (journal.exists() and '"result"' in journal.read_text()):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.2)
    time.sleep(1.0)  # the worker is now inside the hanging case
    return run, results


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("signum,to_group", [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGINT, False)])
@pytest.mark.slow
def test_a_signal_stops_the_run_and_keeps_what_finished(tmp_path, signum, to_group):
    run, results = start_run(tmp_path)
    workers = children(run.pid)
    assert workers, "the run has a worker child"
    if to_group:
        os.killpg(run.pid, signum)  # Ctrl-C in a terminal: the whole foreground group
    else:
        os.kill(run.pid, signum)  # a CI runner or `kill`: the parent alone
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 128 + signum, stderr
    assert "interrupted by " + signal.Signals(signum).name in stderr and "Traceback" not in stderr
    data = json.loads(results.read_text())
    assert data["interrupted"] is True
    cases = {case["case"]: (case["verdict"], case["reason"]) for case in data["backends"][0]["checks"][0]["cases"]}
    # The hung case did not finish: ERROR "not run", never a PASS by omission.
    assert cases == {
        FINISHES: ("PASS", ""),
        HANGS: ("ERROR", f"not run: the run was interrupted by {signal.Signals(signum).name}"),
    }
    assert data["backends"][0]["checks"][0]["verdict"] == "ERROR"
    assert "planted_hangs" in stdout or "HangsOnLongSequence" in stdout  # the table of what finished
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a worker survived the run"
    assert not list((tmp_path / "tmp").iterdir()), "temporary directories left behind"
    assert not results.with_name("results.json.journal").exists()


@pytest.mark.parametrize("delay_s", [0.3, 1.0])
@pytest.mark.slow
def test_a_signal_in_the_first_seconds_is_handled_like_a_later_one(tmp_path, delay_s):
    """While torch is still importing: no traceback, the old results gone, an interrupted file."""
    results = tmp_path / "results.json"
    results.write_text("{}")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            "run",
            "--case",
            FINISHES,
            "--check",
            "numerics",
            "--device",
            "cpu",
            "--json",
            str(results),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay_s)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert json.loads(results.read_text())["interrupted"] is True


def test_compare_and_report_refuse_interrupted_results_unless_allowed(in_process, tmp_path):
    from conformance.results import BackendResult, RunResult

    RunResult({}, [BackendResult("a", True)], "standard", [], interrupted=True).save(tmp_path / "partial.json")
    RunResult({}, [BackendResult("a", True)], "standard", []).save(tmp_path / "base.json")
    for command in (
        ["compare", str(tmp_path / "base.json"), str(tmp_path / "partial.json")],
        ["report", str(tmp_path / "partial.json"), "-o", str(tmp_path / "r.html")],
    ):
        refused = in_process(*command)
        assert (
            refused.returncode == 2 and "interrupted run" in refused.stderr and "--allow-interrupted" in refused.stderr
        )
        allowed = in_process(*command, "--allow-interrupted")
        assert allowed.returncode == 0, allowed.stderr


def test_reports_of_interrupted_results_say_so():
    from conformance.report.html import render as render_html
    from conformance.report.markdown import render as render_markdown
    from conformance.results import BackendResult, RunResult

    partial = RunResult({}, [BackendResult("a", True)], "standard", [], interrupted=True)
    assert "only the cases that finished" in render_html(partial)
    assert "only the cases that finished" in render_markdown(partial)
    complete = RunResult({}, [BackendResult("a", True)], "standard", [])
    assert "only the cases that finished" not in render_html(complete) + render_markdown(complete)
