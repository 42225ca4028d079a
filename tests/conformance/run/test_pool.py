"""``conformance run --workers/--gpus``: the run over a pool of isolated children
(``conformance.run.pool``). Its results must equal a serial run's, case for case; a crash, a hang,
a fault and an interrupt stay what they are in a serial run."""

import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from conformance.cases.suites import suite
from conformance.results import RunResult
from conformance.run.gpus import GpuChoiceError, choose_gpus
from conformance.run.isolation import MAX_CRASHES
from conformance.run.pool import planned_skips, slots_for, units
from conformance.run.runner import RunOptions
from tests.conformance.run.test_interrupts import FINISHES, HANGS, alive, children, run_command, start_run
from tests.conformance.test_cli import conformance

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
# it), and one whose import raises (its row from the probe).
FOUR = "torch_naive,tests.planted.defects:WrongScale,tests.planted.defects:NeedsBlackwell"
FOUR += ",tests.planted.broken_module:Backend"
SERIAL_RUN = pytest.mark.xdist_group("pool_serial_run")  # under pytest -n: the tests that share it on one worker


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory):
    """The serial run of FOUR over the smoke suite, every default check: what a pool's run must
    equal, and torch_naive's engine check, what a crashing one must mirror."""
    path = tmp_path_factory.mktemp("serial") / "serial.json"
    completed = conformance(
        "run", "--backend", FOUR, "--suite", "smoke", "--device", "cpu", "--quiet", "--json", str(path)
    )
    return completed, path


def test_each_backends_cases_are_cut_for_the_slots_longest_first():
    from backends.registry import resolve

    cases = suite("standard")
    options = RunOptions(
        backends=["torch_naive", "triton"], checks=["numerics"], cases=cases, device=torch.device("cpu")
    )
    found = units(options, [resolve("torch_naive"), resolve("triton")], 4, {})
    assert len(found) == 8 and [unit.work for unit in found] == sorted((unit.work for unit in found), reverse=True)
    for name in ("torch_naive", "triton"):  # each backend's cases, each in one of its units
        ids = sorted(case_id for unit in found if unit.ref.name == name for case_id in unit.only)
        assert ids == sorted(case.id for case in cases)
    assert [slot.env["CUDA_VISIBLE_DEVICES"] for slot in slots_for(["3", "5"], 3)] == ["3", "5", "3"]
    assert [slot.name for slot in slots_for(None, 2)] == ["worker 1", "worker 2"]


def test_each_slots_children_take_their_share_of_the_cores_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("conformance.run.pool.cpu_count", lambda: 16)
    assert [slot.env["OMP_NUM_THREADS"] for slot in slots_for(["0"], 3)] == ["5"] * 3
    assert [slot.env["OMP_NUM_THREADS"] for slot in slots_for(None, 32)] == ["1"] * 32
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's own choice stands
    assert all("OMP_NUM_THREADS" not in slot.env for slot in slots_for(None, 2))


def test_a_case_no_check_runs_takes_no_unit_and_keeps_its_planned_skip():
    """With the probe's plans, only what some check runs is cut into units; a backend whose plan
    skips everything starts no child, and what the plans skip is reported as its children would."""
    from backends.registry import resolve

    cases = suite("smoke")
    runs = cases[3].id
    options = RunOptions(
        backends=["torch_naive", "triton"], checks=["numerics", "graphs"], cases=cases, device=torch.device("cpu")
    )
    one_case = {
        "event": "plan",
        "checks": {"numerics": None, "graphs": "no CUDA graphs on a CPU"},
        "cases": {"numerics": {case.id: None if case.id == runs else "too long" for case in cases}},
    }
    nothing = {**one_case, "cases": {"numerics": dict.fromkeys((case.id for case in cases), "needs fp8")}}
    found = units(options, [resolve("torch_naive"), resolve("triton")], 4, {"torch_naive": one_case, "triton": nothing})
    assert [(unit.ref.name, unit.checks, unit.only) for unit in found] == [("torch_naive", ["numerics"], [runs])]
    events = planned_skips(options, one_case)
    assert events[0] == one_case
    assert events[-1] == {"event": "check_skipped", "check": "graphs", "reason": "no CUDA graphs on a CPU"}
    skipped = [(event["check"], event["result"]["case"], event["result"]["reason"]) for event in events[1:-1]]
    assert skipped == [("numerics", case.id, "too long") for case in cases if case.id != runs]
    # Without a plan (a backend that could not be planned), every case is cut, as before.
    assert sorted(i for unit in units(options, [resolve("triton")], 4, {}) for i in unit.only) == sorted(
        case.id for case in cases
    )


@pytest.mark.slow
def test_a_backend_whose_plan_runs_nothing_starts_no_child_and_reads_as_a_serial_run(tmp_path):
    common = ["run", "--backend", "torch_naive,torch_indexer", "--check", "numerics,indexer", "--suite", "smoke"]
    common += ["--device", "cpu", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    pooled = conformance(*common, "--workers", "2", "--json", str(tmp_path / "pool.json"))
    assert serial.returncode == pooled.returncode == 0, pooled.stderr
    serial_result, pooled_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "pool.json")
    assert verdicts(pooled_result) == verdicts(serial_result)
    indexer = next(backend for backend in pooled_result.backends if backend.name == "torch_indexer")
    assert indexer.wall_s == 0.0  # no unit of its ran: its numerics cases are planned SKIPs
    assert pooled_result.environment["probe_s"] > 0  # its asking and planning, apart from the units


@SERIAL_RUN
@pytest.mark.slow
def test_workers_on_the_cpu_give_the_serial_runs_results_case_for_case(tmp_path, serial_run):
    common = ["run", "--backend", FOUR, "--suite", "smoke", "--device", "cpu", "--quiet"]
    serial, serial_path = serial_run
    pooled = conformance(*common, "--workers", "3", "--json", str(tmp_path / "pool.json"))
    assert serial.returncode == pooled.returncode == 1, pooled.stderr
    serial_result, pool_result = RunResult.load(serial_path), RunResult.load(tmp_path / "pool.json")
    assert verdicts(pool_result) == verdicts(serial_result)
    assert [b.reason for b in pool_result.backends] == [b.reason for b in serial_result.backends]
    assert [b.name for b in pool_result.backends] == [b.name for b in serial_result.backends]
    assert pool_result.environment["pool"] == ["worker 1", "worker 2", "worker 3"]
    assert pool_result.environment["command"].startswith("conformance run")
    assert "FAIL" in pooled.stdout and "WrongScale" in pooled.stdout  # the usual report
    assert not (tmp_path / "pool.json.journal").exists()


@SERIAL_RUN
@pytest.mark.slow
def test_a_child_that_dies_in_a_case_makes_it_crash_and_a_fresh_one_decides_as_one_would(tmp_path, serial_run):
    # CrashesOnLargeBatch is torch_naive but for killing its process on a batch of more than 3
    # requests, which every engine run has. Each engine case torch_naive runs is then one CRASH;
    # each it skips ("layout covered by" an earlier case) is skipped too, decided by the fresh
    # child that took over, whichever unit it is in (every unit plans the whole run).
    common = ["run", "--suite", "smoke", "--check", "engine", "--device", "cpu", "--quiet"]
    crashing = conformance(*common, "--backend", CRASHES, "--workers", "2", "--json", str(tmp_path / "crash.json"))
    naive = RunResult.load(serial_run[1]).backends[0]
    assert naive.name == "torch_naive" and naive.check("engine").verdict.value == "PASS", naive.check("engine")
    assert crashing.returncode == 1, crashing.stderr
    expected = naive.check("engine").cases
    engine = RunResult.load(tmp_path / "crash.json").backends[0].check("engine")
    assert 0 < sum(case.verdict.value == "PASS" for case in expected) <= MAX_CRASHES
    assert [case.verdict.value for case in engine.cases] == [
        "CRASH" if case.verdict.value == "PASS" else case.verdict.value for case in expected
    ]


@pytest.mark.parametrize(
    "args,status,message",
    [
        (["--workers", "0"], 2, "--workers 0: give at least 1"),
        (["--workers", "2", "--in-process"], 2, "cannot be combined with --in-process"),
        (["--workers", "2", "--backend-timeout", "60"], 2, "cannot be combined with --backend-timeout"),
    ],
)
def test_bad_pool_options_are_one_line_errors(in_process, tmp_path, args, status, message):
    completed = in_process("run", "--suite", "smoke", "--device", "cpu", "--out", str(tmp_path), *args)
    assert completed.returncode == status, completed.stderr
    assert message in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results.json").exists()


def test_bench_is_not_pooled(in_process, tmp_path):
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


@pytest.mark.gpu
def test_two_workers_sharing_one_gpu_give_the_serial_runs_results(tmp_path):
    common = ["run", "--backend", "triton,torch_naive", "--suite", "smoke", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    pooled = conformance(*common, "--gpus", "0", "--workers", "2", "--json", str(tmp_path / "pool.json"))
    assert serial.returncode == pooled.returncode == 0, pooled.stdout + pooled.stderr
    serial_result, pool_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "pool.json")
    # Verdicts case for case; on a GPU some reasons carry measurements (memory, timings) that differ.
    serial_verdicts = {key: value.split(":")[0] for key, value in verdicts(serial_result).items()}
    pool_verdicts = {key: value.split(":")[0] for key, value in verdicts(pool_result).items()}
    assert pool_verdicts == serial_verdicts
    assert pool_result.environment["pool"] == ["GPU 0", "GPU 0"]


@pytest.mark.slow
def test_the_pool_module_has_no_gpu_or_pytest_work_at_import():
    # The CLI imports it on every run: it must not touch CUDA or import pytest.
    code = "import sys, conformance.run.pool; print('pytest' in sys.modules, 'xdist' in sys.modules)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_a_backend_that_hangs_is_given_up_after_its_fourth_hang_over_all_its_units(tmp_path):
    # Every case but the shortest hangs: each hang ends its child at --timeout. After the fourth,
    # over all the backend's units together, no more of its cases run (not one --timeout each);
    # the other backend is untouched. Two slots: a hang already running in the other one at the
    # give-up may end as a fifth.
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
        "2",
        "--timeout",
        "6",  # a case that does not hang takes a fraction of a second, on a loaded 2-core machine too
        "--quiet",
        "--json",
        str(tmp_path / "hangs.json"),
    )
    assert completed.returncode == 1, completed.stderr
    hangs, naive = RunResult.load(tmp_path / "hangs.json").backends
    cases = [case for check in hangs.checks for case in check.cases]
    outcomes = [(case.verdict.value, case.reason) for case in cases]
    crashes = [verdict for verdict, _ in outcomes if verdict == "CRASH"]
    assert MAX_CRASHES + 1 <= len(crashes) <= MAX_CRASHES + 2, outcomes
    assert all(
        verdict in ("CRASH", "PASS") or reason.startswith("not run: the backend process crashed or hung")
        for verdict, reason in outcomes
    ), outcomes
    assert all(check.verdict.value == "PASS" for check in naive.checks)


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


@pytest.mark.slow
def test_ctrl_c_stops_a_pooled_run_and_keeps_what_finished(tmp_path):
    run, results = start_run(tmp_path, ("--workers", "2"))
    deadline = time.monotonic() + 60
    while len(descendants(run.pid)) < 2 and time.monotonic() < deadline:  # both units' children
        time.sleep(0.2)
    processes = descendants(run.pid)
    time.sleep(3)  # the short case finishes; the other hangs
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stdout + stderr
    assert "interrupted by SIGINT" in stderr and "Traceback" not in stderr
    data = json.loads(results.read_text())
    assert data["interrupted"] is True
    cases = {case["case"]: (case["verdict"], case["reason"]) for case in data["backends"][0]["checks"][0]["cases"]}
    assert cases == {FINISHES: ("PASS", ""), HANGS: ("ERROR", "not run: the run was interrupted by SIGINT")}, cases
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in processes), "a child survived the run"
    assert not results.with_name("results.json.journal").exists()


FAULTS = "tests.planted.defects:FaultsOnLongSequence"
FAULTING_CASE = "gqa-h4/1-d64-fp16-p16-w24-pad0-edges:50+4,3+1,100+1@0"  # the smoke suite's one sequence past 80
IMPORT_CHANGES = "tests.planted.gate.import_changes_state:Backend"


@pytest.mark.slow
def test_one_backends_process_wide_harm_stays_its_own(tmp_path):
    # The fault poisons every later forward of its process: its other cases run in a fresh child.
    # The other backend's import changed a harness setting: that is its own first case's ERROR.
    common = ["run", "--backend", f"{FAULTS},{IMPORT_CHANGES},torch_naive", "--suite", "smoke", "--check"]
    common += ["numerics", "--device", "cpu", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    pooled = conformance(*common, "--workers", "1", "--json", str(tmp_path / "pool.json"))
    assert serial.returncode == pooled.returncode == 1, pooled.stderr
    serial_result, pool_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "pool.json")
    assert verdicts(pool_result) == verdicts(serial_result)
    faults, changes, naive = (backend.checks[0].cases for backend in pool_result.backends)
    crashed = [case for case in faults if case.verdict.value == "CRASH"]
    assert [case.case for case in crashed] == [FAULTING_CASE] and "illegal memory access" in crashed[0].reason
    assert changes[0].verdict.value == "ERROR" and "float32 matmul precision" in changes[0].reason
    assert all(case.verdict.value == "PASS" for case in [*changes[1:], *naive])


def test_workers_on_one_named_gpu_stay_on_it(monkeypatch):
    # `--device cuda:1 --workers 2` puts both workers on GPU 1, not on every GPU of the machine.
    from conformance.cli import _pool_slots

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    args = Namespace(
        gpus=None, workers=2, command="run", in_process=False, backend_timeout=None, device="cuda:1",
    )  # fmt: skip
    assert [slot.env for slot in _pool_slots(args, ["numerics"], torch.device("cuda:1"))] == [
        {"CUDA_VISIBLE_DEVICES": "6"}
    ] * 2
    every = _pool_slots(args, ["numerics"], torch.device("cuda"))
    assert [slot.env["CUDA_VISIBLE_DEVICES"] for slot in every] == ["4", "6"]


@pytest.mark.slow
@pytest.mark.parametrize("fails_at", [2, 3])
def test_a_part_whose_process_cannot_load_the_backend_says_so_and_loses_no_other_case(tmp_path, monkeypatch, fails_at):
    # The probe child imports it first (and plans it); then exactly one of the three units'
    # children cannot load it (the first to import it, which likely answers first, or the
    # second): that part's cases are ERROR saying why, every other case is the backend's own result.
    monkeypatch.setenv("FLAKY_IMPORT_DIR", str(tmp_path))
    monkeypatch.setenv("FLAKY_IMPORT_FAILS_AT", str(fails_at))
    flaky = "tests.planted.gate.import_fails_second_time:Backend"
    common = ["run", "--backend", flaky, "--suite", "smoke", "--check", "numerics", "--device", "cpu", "--quiet"]
    completed = conformance(*common, "--workers", "3", "--json", str(tmp_path / "pool.json"))
    assert completed.returncode == 1, completed.stderr
    (backend,) = RunResult.load(tmp_path / "pool.json").backends
    cases = backend.check("numerics").cases
    assert backend.available and len(cases) == len(suite("smoke"))
    lost = [case for case in cases if case.verdict.value != "PASS"]
    assert 0 < len(lost) < len(cases), [(case.verdict.value, case.reason) for case in cases]
    assert all(case.reason.startswith("not run: this part's process could not load the backend") for case in lost)
    assert "the license server did not answer" in lost[0].reason


def test_a_backends_progress_starts_before_its_first_result_whatever_its_first_child_said():
    """A backend asked by its children: the first answer may be a child that could not load it
    while the others ran its cases. The progress (a terminal's bars look the backend up) starts
    it before the first case result it hears, and hears its first answer only then."""
    from conformance.run.pool import _Told
    from conformance.run.runner import Progress

    class Strict(Progress):
        def __init__(self):
            self.started, self.heard = [], []

        def backend_started(self, name, num_checks, num_cases):
            self.started.append(name)

        def event(self, name, event):
            assert name in self.started, event  # RichProgress.event raises KeyError here
            self.heard.append(event["event"])

    options = RunOptions(
        backends=["torch_naive"], checks=["numerics"], cases=suite("smoke"), device=torch.device("cpu")
    )
    progress = Strict()
    told = _Told(progress, options, {"torch_naive": None})
    told.event("torch_naive", {"event": "backend", "failure": "cannot load backend: boom", "claims": {}})
    told.event("torch_naive", {"event": "plan", "checks": {}, "cases": {}})
    told.event("torch_naive", {"event": "start", "check": "numerics", "case": "x"})
    assert progress.started == ["torch_naive"] and progress.heard == ["start"]


@pytest.mark.slow
def test_ctrl_c_while_the_probe_imports_keeps_every_backends_row(tmp_path):
    # Several backends: a probe child asks them all first; one import never returns. A SIGINT then
    # writes every backend's row, each check ERROR "not run", with the environment: not an empty file.
    results = tmp_path / "results.json"
    command = run_command("--backend", "tests.planted.gate.import_hang:Backend,torch_naive", "--suite", "smoke")
    command += ["--check", "numerics", "--device", "cpu", "--json", str(results)]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(8)  # the probe child is inside the import
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stdout + stderr
    data = json.loads(results.read_text())
    assert data["interrupted"] is True and data["environment"]["device"] == "cpu"
    rows = {backend["name"]: [check["summary"] for check in backend["checks"]] for backend in data["backends"]}
    assert rows == {name: ["not run: the run was interrupted by SIGINT"] for name in rows} and len(rows) == 2


@pytest.mark.slow
def test_a_backend_that_dies_while_the_probe_plans_it_is_answered_and_its_children_report_the_crash(tmp_path):
    planted = "tests.planted.gate.backends:SegfaultsWhilePlanning"
    # First: the probe child dies planning it with torch_naive still to ask; a fresh one asks that.
    common = ["run", "--backend", f"{planted},torch_naive", "--check", "numerics", "--suite", "smoke"]
    completed = conformance(*common, "--device", "cpu", "--quiet", "--workers", "2", "--json", str(tmp_path / "r.json"))
    assert completed.returncode == 1, completed.stderr
    dies, naive = RunResult.load(tmp_path / "r.json").backends
    assert naive.check("numerics").verdict.value == "PASS"
    assert dies.available and "cannot load" not in str(dies.to_dict())
    reasons = {case.reason.split(":")[0] for case in dies.check("numerics").cases}
    assert {case.verdict.value for case in dies.check("numerics").cases} == {"CRASH"}
    assert reasons == {"backend process killed by signal SIGSEGV outside any case"}, reasons


def test_a_check_that_watches_over_a_span_gets_its_cases_cut_finer_than_a_quick_one():
    from backends.registry import resolve

    cases = suite("smoke")
    options = RunOptions(
        backends=["torch_naive"], checks=["numerics", "engine"], cases=cases, device=torch.device("cpu")
    )
    every = {case.id: None for case in cases}
    plan = {
        "event": "plan",
        "checks": {"numerics": None, "engine": None},
        "cases": {"numerics": every, "engine": every},
    }
    found = units(options, [resolve("torch_naive")], 4, {"torch_naive": plan})
    per_check = {check: [unit for unit in found if unit.checks == [check]] for check in ("numerics", "engine")}
    assert len(per_check["engine"]) == 4 > len(per_check["numerics"]) >= 1  # 15 s a case against 1 s
    for check, found_units in per_check.items():  # each check's cases, each in one of its units
        assert sorted(i for unit in found_units for i in unit.only) == sorted(case.id for case in cases), check


def test_a_backend_without_a_plan_does_not_crowd_out_the_planned_ones():
    """Weighed in the same expected seconds: a backend whose planning failed is cut by case, and a
    planned backend's long check still gets units of its own."""
    from backends.registry import resolve

    cases = suite("smoke")
    options = RunOptions(
        backends=["torch_naive", "triton"], checks=["numerics", "engine"], cases=cases, device=torch.device("cpu")
    )
    every = {case.id: None for case in cases}
    plan = {
        "event": "plan",
        "checks": {"numerics": None, "engine": None},
        "cases": {"numerics": every, "engine": every},
    }
    found = units(options, [resolve("torch_naive"), resolve("triton")], 4, {"torch_naive": None, "triton": plan})
    assert len([unit for unit in found if unit.ref.name == "triton" and unit.checks == ["engine"]]) > 1
    unplanned = [unit for unit in found if unit.ref.name == "torch_naive"]
    assert unplanned and all(unit.checks is None for unit in unplanned)


@pytest.mark.slow
def test_an_import_that_changes_the_harness_is_seen_when_the_plan_runs_nothing(tmp_path):
    # Its plan skips every case of this check: the parent would report them all, and no child would
    # see the change. The probe sees it, gives no plan, and the children report it as a serial run.
    common = ["run", "--backend", "tests.planted.gate.import_changes_state:Backend", "--check", "indexer"]
    common += ["--suite", "smoke", "--device", "cpu", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    pooled = conformance(*common, "--workers", "2", "--json", str(tmp_path / "pool.json"))
    assert serial.returncode == pooled.returncode == 1, pooled.stderr
    for path in ("serial.json", "pool.json"):  # each child that imported it reports it once: one or two
        (backend,) = RunResult.load(tmp_path / path).backends
        cases = backend.check("indexer").cases
        changed = [case for case in cases if case.verdict.value == "ERROR"]
        assert changed and all("the backend changed the harness's state" in case.reason for case in changed), path
        assert all(case.verdict.value == "SKIP" for case in cases if case not in changed)
