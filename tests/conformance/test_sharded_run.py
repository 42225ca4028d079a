"""The suite over pytest-xdist workers: ``conformance run --workers/--gpus`` and the plugin under
``pytest -n``. The merged results must equal a serial run's, case for case."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.pytest_gpus import GpuChoiceError, assign_gpus, choose_gpus
from conformance.results import RunResult
from conformance.run.isolation import MAX_CRASHES
from tests.conformance.run.test_interrupts import FINISHES, HANGS, alive, children, start_run
from tests.conformance.test_cli import conformance
from tests.conformance.test_pytest_plugin import plugin_args

pytest.importorskip("xdist")
execnet = pytest.importorskip("execnet")  # xdist's transport, installed with it
ROOT = Path(__file__).resolve().parents[2]

CRASHES = "tests.planted.defects:CrashesOnLargeBatch"


def verdicts(result: RunResult) -> dict[tuple[str, str, str], str]:
    """Every check's and case's verdict and reason, by backend, check and case."""
    table = {}
    for backend in result.backends:
        for check in backend.checks:
            table[(backend.name, check.name, "")] = f"{check.verdict.value}: {check.summary}"
            for case in check.cases:
                reason = case.reason if case.verdict.value != "CRASH" else ""  # how the process died differs
                table[(backend.name, check.name, case.case)] = f"{case.verdict.value}: {reason}"
    return table


# A passing backend, a failing one, one that cannot run on a CPU (its reason as a serial run words
# it), and one whose import raises (its row from the probe: in pytest it stopped the session).
FOUR = "torch_naive,tests.planted.defects:WrongScale,tests.planted.defects:NeedsBlackwell"
FOUR += ",tests.planted.broken_module:Backend"
SERIAL_RUN = pytest.mark.xdist_group("sharded_serial_run")  # under pytest -n: the tests that share it on one worker


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory):
    """The serial run of FOUR over the smoke suite, every default check: what a sharded run must
    equal, and torch_naive's engine check, what a crashing one must mirror."""
    path = tmp_path_factory.mktemp("serial") / "serial.json"
    completed = conformance(
        "run", "--backend", FOUR, "--suite", "smoke", "--device", "cpu", "--quiet", "--json", str(path)
    )
    return completed, path


@SERIAL_RUN
@pytest.mark.slow
def test_workers_on_the_cpu_give_the_serial_runs_results_case_for_case(tmp_path, serial_run):
    common = ["run", "--backend", FOUR, "--suite", "smoke", "--device", "cpu", "--quiet"]
    serial, serial_path = serial_run
    sharded = conformance(*common, "--workers", "2", "--json", str(tmp_path / "sharded.json"))
    assert serial.returncode == sharded.returncode == 1, sharded.stderr
    serial_result, sharded_result = RunResult.load(serial_path), RunResult.load(tmp_path / "sharded.json")
    assert verdicts(sharded_result) == verdicts(serial_result)
    assert [b.reason for b in sharded_result.backends] == [b.reason for b in serial_result.backends]
    assert [b.name for b in sharded_result.backends] == [b.name for b in serial_result.backends]
    assert sharded_result.environment["pytest_workers"] == 2
    assert sharded_result.environment["command"].startswith("conformance run")
    assert "FAIL" in sharded.stdout and "WrongScale" in sharded.stdout  # the usual report, from the merged results
    assert not (tmp_path / "sharded.json.journal").exists()


@SERIAL_RUN
@pytest.mark.slow
def test_a_worker_that_dies_in_a_case_makes_it_crash_once_and_a_fresh_worker_decides_as_one_would(tmp_path, serial_run):
    # CrashesOnLargeBatch is torch_naive but for killing its process on a batch of more than 3
    # requests, which every engine run has (its model serves several prompts at once). Each engine
    # case torch_naive runs is then one CRASH, in a worker of its own; each it skips ("layout
    # covered by" an earlier case) is skipped too, decided again by the fresh worker that took over.
    # What torch_naive's engine check does is the serial run's (FOUR's first backend).
    common = ["run", "--suite", "smoke", "--check", "engine", "--device", "cpu", "--quiet"]
    crashing = conformance(*common, "--backend", CRASHES, "--workers", "2", "--json", str(tmp_path / "crash.json"))
    naive = RunResult.load(serial_run[1]).backends[0]
    assert naive.name == "torch_naive" and naive.check("engine").verdict.value == "PASS", naive.check("engine")
    assert crashing.returncode == 1, crashing.stderr
    expected = naive.check("engine").cases
    engine = RunResult.load(tmp_path / "crash.json").backends[0].check("engine")
    assert 0 < sum(case.verdict.value == "PASS" for case in expected) <= 3  # within the crashes a run allows
    assert [case.verdict.value for case in engine.cases] == [
        "CRASH" if case.verdict.value == "PASS" else case.verdict.value for case in expected
    ]
    assert all("pytest worker gw" in case.reason for case in engine.cases if case.verdict.value == "CRASH")


@pytest.mark.parametrize(
    "args,status,message",
    [
        (["--workers", "0"], 2, "--workers 0: give at least 1"),
        (["--workers", "2", "--in-process"], 2, "cannot be combined with --in-process"),
        (["--workers", "2", "--backend-timeout", "60"], 2, "cannot be combined with --backend-timeout"),
    ],
)
def test_bad_sharding_options_are_one_line_errors(in_process, tmp_path, args, status, message):
    completed = in_process("run", "--suite", "smoke", "--device", "cpu", "--out", str(tmp_path), *args)
    assert completed.returncode == status, completed.stderr
    assert message in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results.json").exists()


def test_bench_is_not_sharded(in_process, tmp_path):
    completed = in_process("bench", "--workers", "2", "--out", str(tmp_path))
    # Without a GPU bench stops first (exit 3); with one, --workers is refused (exit 2).
    assert completed.returncode in (2, 3) and len(completed.stderr.strip().splitlines()) == 1
    if completed.returncode == 2:
        assert "bench times backends side by side on one GPU" in completed.stderr


@pytest.mark.parametrize("hidden", ["", "-1"])
@pytest.mark.slow
def test_gpus_without_a_gpu_is_nothing_to_run(tmp_path, monkeypatch, hidden):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    completed = conformance("run", "--suite", "smoke", "--gpus", "all", "--out", str(tmp_path))
    assert completed.returncode == 3, completed.stderr
    assert "no CUDA device is visible" in completed.stderr


def test_gpu_choice_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,GPU-abc,-1,4")
    assert choose_gpus("all") == ["3", "5", "GPU-abc"]
    assert choose_gpus("2,0") == ["GPU-abc", "3"]
    for bad, message in (("3", "there is no GPU 3"), ("0,0", "more than once"), ("x", "give 'all' or GPU indices")):
        with pytest.raises(GpuChoiceError, match=message):
            choose_gpus(bad)


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


@pytest.mark.gpu
def test_two_workers_sharing_one_gpu_give_the_serial_runs_results(tmp_path):
    common = ["run", "--backend", "triton,torch_naive", "--suite", "smoke", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    sharded = conformance(*common, "--gpus", "0", "--workers", "2", "--json", str(tmp_path / "sharded.json"))
    assert serial.returncode == sharded.returncode == 0, sharded.stdout + sharded.stderr
    serial_result, sharded_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "sharded.json")
    # Verdicts case for case; on a GPU some reasons carry measurements (memory, timings) that differ
    # from run to run.
    serial_verdicts = {key: value.split(":")[0] for key, value in verdicts(serial_result).items()}
    sharded_verdicts = {key: value.split(":")[0] for key, value in verdicts(sharded_result).items()}
    keys = serial_verdicts.keys() | sharded_verdicts.keys()
    differing = {
        key: (sharded_verdicts.get(key), serial_verdicts.get(key))
        for key in keys
        if sharded_verdicts.get(key) != serial_verdicts.get(key)
    }
    assert not differing, differing
    assert sharded_result.environment["gpus"] == ["0"] and sharded_result.environment["pytest_workers"] == 2


@pytest.mark.slow
def test_sharded_run_module_has_no_gpu_work_at_import():
    # The CLI imports it on every run: it must not touch CUDA or import pytest.
    code = "import sys, conformance.sharded_run; print('pytest' in sys.modules, 'xdist' in sys.modules)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_a_backend_that_hangs_is_given_up_after_its_fourth_worker_death_as_in_a_serial_run(tmp_path):
    # Every case but the shortest hangs: each hang ends its worker at --timeout. After the fourth,
    # no more of that backend's cases run (not one --timeout each); the other backend is untouched.
    # One worker: every hang is the one case running, so the count is exactly the limit's (with
    # two, a hang already running on the other worker at the give-up may still end as a fifth,
    # and the test would depend on which worker got there first).
    completed = conformance(
        "run",
        "--backend",
        "tests.planted.defects:HangsOnLongSequence,torch_naive",
        "--suite",
        "smoke",
        "--check",
        "numerics,determinism",
        "--device",
        "cpu",
        "--workers",
        "1",
        "--timeout",
        "2",  # a case that does not hang takes a small fraction of a second
        "--quiet",
        "--json",
        str(tmp_path / "hangs.json"),
    )
    assert completed.returncode == 1, completed.stderr
    hangs, naive = RunResult.load(tmp_path / "hangs.json").backends
    cases = [case for check in hangs.checks for case in check.cases]
    verdicts = [(case.verdict.value, case.reason) for case in cases]
    crashes = [verdict for verdict, _ in verdicts if verdict == "CRASH"]
    assert len(crashes) == MAX_CRASHES + 1, verdicts
    given_up = f"not run: the backend's pytest workers crashed or hung {MAX_CRASHES + 1} times"
    assert all(verdict == "CRASH" or reason == given_up for verdict, reason in verdicts), verdicts
    assert all(check.verdict.value == "PASS" for check in naive.checks)


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


@pytest.mark.slow
def test_ctrl_c_stops_a_sharded_run_and_keeps_what_finished(tmp_path):
    # Ctrl-C in a terminal signals the whole foreground group; the CLI alone passes it to pytest
    # once (a second SIGINT there cut its writing short with a traceback). A SIGINT to the CLI
    # alone takes the same path from there.
    run, results = start_run(tmp_path, ("--workers", "2"))
    processes = descendants(run.pid)
    assert len(processes) >= 2, "pytest and its workers"
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stdout + stderr
    assert "interrupted by SIGINT" in stderr and "Traceback" not in stderr
    data = json.loads(results.read_text())
    assert data["interrupted"] is True
    cases = {case["case"]: (case["verdict"], case["reason"]) for case in data["backends"][0]["checks"][0]["cases"]}
    assert cases == {FINISHES: ("PASS", ""), HANGS: ("ERROR", "not run: the run was interrupted")}, cases
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in processes), "a pytest process survived the run"
    assert not results.with_name("results.json.journal").exists()


FAULTS = "tests.planted.defects:FaultsOnLongSequence"
FAULTING_CASE = "gqa-h4/1-d64-fp16-p16-w24-pad0-edges:50+4,3+1,100+1@0"  # the smoke suite's one sequence past 80


IMPORT_CHANGES = "tests.planted.gate.import_changes_state:Backend"


@pytest.mark.slow
def test_one_backends_process_wide_harm_stays_its_own_in_a_worker(tmp_path):
    # One worker runs every group in turn, as a serial run's children run the backends. The fault
    # poisons every later forward of its process: the next backends must run in a fresh worker.
    # The other backend's import changed a harness setting (in every worker, since each imports
    # every backend): that is its own first case's ERROR, not the first case the worker runs.
    common = ["run", "--backend", f"{FAULTS},{IMPORT_CHANGES},torch_naive", "--suite", "smoke", "--check"]
    common += ["numerics", "--device", "cpu", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    sharded = conformance(*common, "--workers", "1", "--json", str(tmp_path / "sharded.json"))
    assert serial.returncode == sharded.returncode == 1, sharded.stderr
    serial_result, sharded_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "sharded.json")
    assert verdicts(sharded_result) == verdicts(serial_result)
    faults, changes, naive = (backend.checks[0].cases for backend in sharded_result.backends)
    crashed = [case for case in faults if case.verdict.value == "CRASH"]
    assert [case.case for case in crashed] == [FAULTING_CASE] and "illegal memory access" in crashed[0].reason
    assert [case.verdict.value for case in faults if case.verdict.value != "CRASH"] == ["PASS"] * 8
    assert changes[0].verdict.value == "ERROR" and "float32 matmul precision" in changes[0].reason
    assert all(case.verdict.value == "PASS" for case in [*changes[1:], *naive])


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


def test_workers_on_one_named_gpu_stay_on_it():
    # `--device cuda:1 --workers 2` puts both workers on GPU 1, not on every GPU of the machine.
    from argparse import Namespace

    import torch

    from conformance.cli import _sharded_run

    args = Namespace(
        gpus=None, workers=2, command="run", in_process=False, backend_timeout=None, case=None, suite="smoke",
        seed=None, timeout=60.0, sync_detector="auto", prefill_backend="auto", device="cuda:1",
    )  # fmt: skip
    run = _sharded_run(args, ["torch_naive"], ["numerics"], [], torch.device("cuda:1"))
    assert (run.gpus, run.workers, run.device) == ("1", 2, "cuda")
    assert _sharded_run(args, ["torch_naive"], ["numerics"], [], torch.device("cuda")).gpus is None  # every GPU
