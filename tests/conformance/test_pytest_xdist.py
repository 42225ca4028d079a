"""The pytest plugin under pytest-xdist (``pytest -n``, xdist's ordinary scheduling): one merged
results file, verdict for verdict a run without xdist's; a worker that dies under a case makes
that case CRASH and the rest go on; a worker that ends after reporting a sticky CUDA error keeps
that case's verdict. (``conformance run --gpus/--workers`` runs its own pool of isolated children:
tests/conformance/run/test_pool.py.)"""

import os
from pathlib import Path

import pytest

from conformance.cases.grammar import parse_case
from conformance.results import RunResult
from tests.conformance.test_pytest_plugin import plugin_args

pytest.importorskip("xdist")
ROOT = Path(__file__).resolve().parents[2]
FAULTS = "tests.planted.defects:FaultsOnLongSequence"
FAULTING_CASE = "gqa-h4/1-d64-fp16-p16-w24-pad0-edges:50+4,3+1,100+1@0"  # the smoke suite's one sequence past 80
CRASHES = "tests.planted.defects:CrashesOnLargeBatch"  # SIGSEGV on a batch of more than 3 requests
SMOKE_CPU = ["--conformance-suite", "smoke", "--conformance-device", "cpu"]


def verdicts(run: RunResult) -> dict[str, dict[str, tuple[str, dict[str, str]]]]:
    """backend -> check -> (its verdict, case id -> the case's verdict)."""
    return {
        backend.name: {
            check.name: (check.verdict.value, {case.case: case.verdict.value for case in check.cases})
            for check in backend.checks
        }
        for backend in run.backends
    }


@pytest.mark.slow
def test_the_plugin_under_pytest_xdist_writes_one_merged_results_file(pytester, tmp_path, monkeypatch):
    # xdist's ordinary scheduling (no --dist): a check's items may run on either worker, and the
    # merged results are the serial run's, case for case.
    pytester.makepyfile("def test_own():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [
        *plugin_args(),
        "--conformance-backend",
        "torch_naive,tests.planted.defects:WrongScale",
        "--conformance-check",
        "numerics,determinism",
        *SMOKE_CPU,
    ]
    merged_path, serial_path = tmp_path / "merged.json", tmp_path / "serial.json"
    result = pytester.runpytest_subprocess(*args, "-n", "2", f"--conformance-json={merged_path}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    serial = pytester.runpytest(*args, f"--conformance-json={serial_path}")  # in this process: no xdist
    assert serial.ret == pytest.ExitCode.TESTS_FAILED
    merged = RunResult.load(merged_path)
    assert [backend.name for backend in merged.backends] == ["torch_naive", "tests.planted.defects:WrongScale"]
    assert verdicts(merged) == verdicts(RunResult.load(serial_path))
    assert [check.verdict.value for check in merged.backends[1].checks] == ["FAIL", "PASS"]
    assert all(len(check.cases) == 9 for backend in merged.backends for check in backend.checks)
    assert merged.environment["pytest_workers"] == 2 and not merged.interrupted


def both_workers_died_at_once(result) -> bool:
    """xdist's own race (pytest-xdist issue 204): when the two workers die together, the controller
    hands the first one's cases to the second as it goes down, and the session ends in an
    INTERNALERROR (a broken pipe in ``worker_errordown``). Seen once under a loaded CI machine,
    where the two large-batch cases crashed at the same moment; not the plugin's to catch."""
    output = "\n".join(result.outlines + result.errlines)
    return result.ret == pytest.ExitCode.INTERNAL_ERROR and "worker_errordown" in output and "BrokenPipeError" in output


@pytest.mark.slow
def test_under_xdist_a_dead_workers_case_is_crash_and_the_rest_go_on(pytester, tmp_path, monkeypatch):
    # CrashesOnLargeBatch kills its worker in each case of more than 3 requests: that case is
    # CRASH, every other case has its verdict. FaultsOnLongSequence's worker ends after reporting
    # its sticky error (CRASH, with the error as its reason): xdist then reports that item crashed
    # too, and the case keeps the result it reported.
    pytester.makepyfile("def test_own():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    json_path = tmp_path / "crashes.json"
    for _ in range(2):
        result = pytester.runpytest_subprocess(
            *plugin_args(),
            "-n",
            "2",
            "--conformance-backend",
            f"{CRASHES},{FAULTS},torch_naive",
            "--conformance-check",
            "numerics",
            *SMOKE_CPU,
            f"--conformance-json={json_path}",
        )
        if not both_workers_died_at_once(result):
            break
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    run = RunResult.load(json_path)
    crashes, faults, naive = (backend.checks[0].cases for backend in run.backends)
    large = {case.case for case in crashes if parse_case(case.case).num_reqs > 3}
    assert len(large) == 2 and len(crashes) == 9
    assert {case.case: case.verdict.value for case in crashes} == {
        case.case: "CRASH" if case.case in large else "PASS" for case in crashes
    }
    assert all(case.reason.startswith("pytest worker gw") for case in crashes if case.case in large)
    faulted = {case.case: case for case in faults if case.verdict.value != "PASS"}
    assert list(faulted) == [FAULTING_CASE] and faulted[FAULTING_CASE].verdict.value == "CRASH"
    assert "illegal memory access" in faulted[FAULTING_CASE].reason, faulted[FAULTING_CASE].reason
    assert [case.verdict.value for case in naive] == ["PASS"] * 9
    assert not run.interrupted


@pytest.mark.slow
def test_without_xdist_a_sticky_cuda_error_stops_the_session_saying_why(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    json_path = tmp_path / "stopped.json"
    result = pytester.runpytest_subprocess(
        *plugin_args(),
        "--conformance-backend",
        f"{FAULTS},torch_naive",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
        f"--conformance-json={json_path}",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    faults, naive = RunResult.load(json_path).backends
    assert [case.case for case in faults.checks[0].cases if case.verdict.value != "PASS"] == [FAULTING_CASE]
    reasons = {case.reason for case in naive.checks[0].cases}
    assert reasons == {
        f"not run: a sticky CUDA error in {FAULTS}'s case {FAULTING_CASE} left this process's CUDA context unusable"
    }
    assert not RunResult.load(json_path).interrupted


def test_a_case_time_limit_without_workers_is_a_usage_error(pytester):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(
        *plugin_args(), "--conformance-backend", "torch_naive", "--conformance-timeout", "5", "-p", "no:xdist"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--conformance-timeout ends a pytest-xdist worker that runs past it: add -n N*"])
