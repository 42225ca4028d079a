"""The pytest plugin under pytest-xdist (``pytest -n``): each worker its GPU before any conftest,
one merged results file, and the plugin's own errors. (``conformance run --gpus/--workers`` runs
its own pool of isolated children: tests/conformance/run/test_pool.py.)"""

import os
from pathlib import Path

import pytest

from conformance.pytest_gpus import assign_gpus
from conformance.results import RunResult
from tests.conformance.test_pytest_plugin import plugin_args

pytest.importorskip("xdist")
execnet = pytest.importorskip("execnet")  # xdist's transport, installed with it
ROOT = Path(__file__).resolve().parents[2]
FAULTS = "tests.planted.defects:FaultsOnLongSequence"
FAULTING_CASE = "gqa-h4/1-d64-fp16-p16-w24-pad0-edges:50+4,3+1,100+1@0"  # the smoke suite's one sequence past 80


GPU_PROBE = """
import os
import time
from pathlib import Path

LOG = Path(os.environ["GPU_LOG"])


def record(what):
    with LOG.open("a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {os.environ.get('CUDA_VISIBLE_DEVICES')} {what}\\n")


def test_dies_once():
    marker = LOG.with_suffix(".died")
    if not marker.exists():
        marker.touch()
        record("died")
        os._exit(1)


@pytest.mark.parametrize("n", range(10))
def test_sees(n):
    time.sleep(0.1)
    record(f"test {AT_IMPORT}")
"""


@pytest.mark.slow
def test_each_worker_has_its_gpu_before_conftest_and_a_restarted_one_keeps_it(pytester, tmp_path, monkeypatch):
    # The controller "sees" GPUs 7 and 9 (no CUDA is needed to hand them out); one worker takes
    # the first. What a conftest reads at import is that GPU already; the worker started after it
    # died (gw1) takes the dead one's GPU, not the next in turn.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,9")
    monkeypatch.setenv("GPU_LOG", str(tmp_path / "gpus.log"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest("import os\nAT_IMPORT = os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    pytester.makepyfile("import pytest\nfrom conftest import AT_IMPORT\n" + GPU_PROBE)
    result = pytester.runpytest_subprocess(*plugin_args(), "-n", "1", "--conformance-gpus", "all")
    result.assert_outcomes(passed=10, failed=1)
    lines = [line.split() for line in (tmp_path / "gpus.log").read_text().splitlines()]
    assert {(worker, gpu) for worker, gpu, *_ in lines} == {("gw0", "7"), ("gw1", "7")}, lines
    assert all(line[3] == "7" for line in lines if line[2] == "test"), lines


def test_workers_take_the_gpus_round_robin():
    specs = [execnet.XSpec("popen") for _ in range(5)]
    assert assign_gpus(["3", "5"], specs) == ["3", "5"]
    assert [spec.env["CUDA_VISIBLE_DEVICES"] for spec in specs] == ["3", "5", "3", "5", "3"]
    assert assign_gpus(["3", "5", "6"], specs[:2]) == ["3", "5"]  # the results name only the GPUs used


@pytest.mark.slow
def test_the_plugin_under_pytest_xdist_writes_one_merged_results_file(pytester, tmp_path, monkeypatch):
    pytester.makepyfile("def test_own():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    json_path = tmp_path / "merged.json"
    result = pytester.runpytest_subprocess(
        *plugin_args(),
        "-n",
        "2",
        "--dist",
        "loadgroup",
        "-v",
        "--conformance-backend",
        "torch_naive,tests.planted.defects:WrongScale",
        "--conformance-suite",
        "smoke",
        "--conformance-check",
        "numerics,determinism",
        "--conformance-device",
        "cpu",
        f"--conformance-json={json_path}",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    merged = RunResult.load(json_path)
    assert [backend.name for backend in merged.backends] == ["torch_naive", "tests.planted.defects:WrongScale"]
    assert [check.verdict.value for check in merged.backends[1].checks] == ["FAIL", "PASS"]
    assert all(len(check.cases) == 9 for backend in merged.backends for check in backend.checks)
    # Each backend's check ran on one worker: "[gwN] ... conformance[<backend>-<check>-..." lines.
    workers: dict[str, set[str]] = {}
    for line in result.stdout.lines:
        if line.startswith("[gw") and "conformance[" in line:
            group = line.split("conformance[")[1].split("-gqa")[0].split("-mla")[0]
            workers.setdefault(group, set()).add(line.split("]")[0])
    assert len(workers) == 4 and all(len(ran_on) == 1 for ran_on in workers.values()), workers


def test_gpus_in_the_plugin_needs_xdist(pytester):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(
        *plugin_args(), "--conformance-backend", "torch_naive", "--conformance-gpus", "all", "-p", "no:xdist"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--conformance-gpus spreads items over pytest-xdist workers: add -n N*"])


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
