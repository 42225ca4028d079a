"""A backend that ends its process never ends a run with status 0, on any path: the serial run's
isolated children, ``--in-process``, ``--workers`` (pytest-xdist) and the pytest plugin without
xdist. An exit asked for from Python, on any thread or at import, is the case's CRASH with the same
reason on every path; an exit() from C code, which no process survives, is a dead worker's CRASH
where a worker can die, and status ``EXIT_FROM_C`` where the process that reports is the one that
ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cases.grammar import parse_case
from conformance.results import RunResult
from conformance.run.exit_guard import EXIT_FROM_C
from tests.conformance.run.test_gate import _alive
from tests.conformance.test_pytest_plugin import plugin_args

ROOT = Path(__file__).resolve().parents[3]
GATE = "tests.planted.gate"
SMALL = "gqa-h2/1-d16-fp32:5+1"
LARGE = "gqa-h2/1-d16-fp32:5+1x4"  # more than 3 requests: where the planted exits happen
PATHS = {
    "serial": [],
    "in-process": ["--in-process"],
    "workers": ["--workers", "1"],
}
REASONS = {
    "ExitsQuietly": "the backend called os._exit(0) during the case",
    "RaisesSystemExit": "the backend raised SystemExit(None) during the case",
    "ExitsOnAThread": "the backend called os._exit(0) on thread 'watchdog' during the case",
    "RaisesKeyboardInterrupt": (
        "the backend raised KeyboardInterrupt during the case (a BaseException: it ends a process)"
    ),
}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_cli(tmp_path: Path, backend: str, path: str) -> tuple[subprocess.CompletedProcess, Path]:
    results = tmp_path / f"{path}.json"
    completed = subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--backend", backend, "--check", "numerics"]
        + ["--case", SMALL, "--case", LARGE, "--device", "cpu", "--quiet", "--json", str(results)]
        + PATHS[path],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    return completed, results


def run_plugin(tmp_path: Path, backend: str) -> tuple[subprocess.CompletedProcess, Path]:
    results = tmp_path / "plugin.json"
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q"]
        + ["--conformance-backend", backend, "--conformance-check", "numerics", "--conformance-device", "cpu"]
        + ["--conformance-case", SMALL, "--conformance-case", LARGE, "--conformance-json", str(results)]
        + ["--rootdir", str(tmp_path), "-c", os.devnull],
        capture_output=True,
        text=True,
        env=env(),
        cwd=tmp_path,
        timeout=300,
    )
    return completed, results


def large_case(results: Path, backend: str | None = None):
    backends = RunResult.load(results).backends
    found = backends[0] if backend is None else next(row for row in backends if row.name == backend)
    return {case.case: case for case in found.checks[0].cases}[parse_case(LARGE).id]


# One run a path holds every backend that exits from Python (and the one whose import exits, and
# torch_naive after them: the run goes on past each); serial and --workers also the one that calls
# exit() from C, which ends only a child or a worker there. Each exit's CRASH and reason is read
# from its own row: a run a backend, as these tests once made, was 24 commands.
IMPORT_EXITS = f"{GATE}.import_exits:X"
FROM_C = f"{GATE}.backends:ExitsFromC"
MERGED = [f"{GATE}.backends:{backend}" for backend in sorted(REASONS)] + [IMPORT_EXITS]
EXITS = pytest.mark.xdist_group("exits")  # under pytest -n: the tests that share the runs on one worker


@pytest.fixture(scope="module")
def merged_runs(tmp_path_factory):
    """``{path: (completed, results)}``, each path's run made once, by the first test that asks."""
    runs = {}

    def run(path: str):
        if path not in runs:
            folder = tmp_path_factory.mktemp(f"exits-{path}")
            backends = MERGED + ([FROM_C] if path in ("serial", "workers") else []) + ["torch_naive"]
            if path == "plugin":
                runs[path] = run_plugin(folder, ",".join(backends))
            else:
                runs[path] = run_cli(folder, ",".join(backends), path)
        return runs[path]

    return run


@EXITS
@pytest.mark.parametrize("backend", sorted(REASONS))
@pytest.mark.slow
def test_an_exit_from_python_is_the_cases_crash_with_one_reason_on_every_path(merged_runs, backend):
    for path in (*PATHS, "plugin"):
        completed, results = merged_runs(path)
        assert completed.returncode == 1, (path, completed.stdout[-2000:], completed.stderr[-2000:])
        case = large_case(results, f"{GATE}.backends:{backend}")
        assert (case.verdict.value, case.reason) == ("CRASH", REASONS[backend]), path


@EXITS
@pytest.mark.slow
def test_an_exit_from_c_code_never_ends_a_run_with_status_0(tmp_path, merged_runs):
    completed, results = merged_runs("serial")
    assert completed.returncode == 1
    case = large_case(results, FROM_C)
    assert case.verdict.value == "CRASH"
    assert case.reason == "backend process ended: the backend called exit() from C code while running this case"
    completed, results = merged_runs("workers")
    assert completed.returncode == 1 and large_case(results, FROM_C).verdict.value == "CRASH"
    # Where the process that reports is the one that ends: no results, but never status 0.
    for completed, _ in (run_cli(tmp_path, FROM_C, "in-process"), run_plugin(tmp_path, FROM_C)):
        assert completed.returncode == EXIT_FROM_C, completed.stderr[-2000:]
        assert "conformance: the backend called exit() from C code during the case" in completed.stderr


@EXITS
@pytest.mark.slow
def test_an_import_that_exits_is_that_backends_crash_on_every_path(merged_runs):
    reason = f"cannot load backend '{IMPORT_EXITS}': the backend called os._exit(0) during its import"
    for path in (*PATHS, "plugin"):
        completed, results = merged_runs(path)
        assert completed.returncode == 1, (path, completed.stderr[-2000:])
        rows = {row["name"]: row for row in json.loads(results.read_text())["backends"]}
        exits, naive = rows[IMPORT_EXITS], rows["torch_naive"]
        assert [(check["verdict"], check["summary"]) for check in exits["checks"]] == [("CRASH", reason)], path
        assert naive["checks"][0]["verdict"] == "PASS", path
        # The run went on past every exit: each backend of it has its row, in the order asked.
        assert list(rows) == MERGED + ([FROM_C] if path in ("serial", "workers") else []) + ["torch_naive"], path


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.slow
def test_the_plugin_leaves_no_process_a_backend_started_behind(tmp_path, monkeypatch):
    # One helper in its own process group, one in a session of its own (setsid): neither survives pytest.
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PLANTED_PIDS_FILE", str(pids_file))
    completed, _ = run_plugin(tmp_path, f"{GATE}.backends:LeavesProcesses")
    assert completed.returncode == 0, completed.stdout[-2000:]
    pids = [int(line) for line in pids_file.read_text().split()]
    assert len(pids) >= 2  # two a backend instance (each case makes its own)
    assert not any(_alive(pid) for pid in pids), "a helper process outlived the pytest session"


def test_the_plugins_journal_holds_each_result_once(tmp_path):
    # Every phase's report carries the item's user properties (call, then teardown): one line each still.
    from types import SimpleNamespace

    from conformance.pytest_results import ResultCollector, event_property
    from conformance.run.journal import Journal
    from conformance.run.runner import Progress

    case = parse_case(SMALL)
    collector = ResultCollector(["b"], {}, ["numerics"], [case], {}, "custom", {})
    collector.journal = Journal(tmp_path / "r.json", Progress())
    event = {"event": "result", "check": "numerics", "result": {"case": case.id, "verdict": "PASS"}}
    properties = [event_property("b", event)]
    for when in ("setup", "call", "teardown"):
        report = SimpleNamespace(
            user_properties=properties if when != "setup" else [], when=when, nodeid="x", failed=False, duration=0.1
        )
        collector.pytest_runtest_logreport(report)
    collector.journal.file.flush()
    assert len(collector.journal.path.read_text().splitlines()) == 1
