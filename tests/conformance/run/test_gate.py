"""The gate is not fooled by a backend that exits quietly, changes the harness's state, writes into
its events channel, misbehaves while being imported, or leaves processes behind. Each test runs a
planted backend of tests/planted/gate that passed the gate before these defences existed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.cases.grammar import parse_case
from conformance.results import RunResult, Verdict
from conformance.run.execution import Job
from conformance.run.isolation import run_isolated

SMALL = "gqa-h2/1-d16-fp32:5+1"
LARGE = "gqa-h2/1-d16-fp32:5+1x4"  # more than 3 requests: where the planted exits happen
OTHER = "gqa-h2/1-d16-fp32:9+2"
GATE = "tests.planted.gate"


def job(backend, cases, checks=("numerics",)):
    return Job(backend, "cpu", list(checks), [{"id": parse_case(text).id, "tag": ""} for text in cases])


def conformance(*args, cwd=None, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def verdicts(events):
    return {(check, case): result.verdict for (check, case), result in events.results.items()}


@pytest.mark.parametrize(
    "backend,reason",
    [
        ("ExitsQuietly", "the backend called os._exit(0) during the case"),
        ("RaisesSystemExit", "the backend raised SystemExit(None) during the case"),
        # C's _exit: no guard sees it, the worker is gone with status 0 and no "done".
        ("ExitsFromCWithoutCleanup", "backend process exited with status 0 before finishing"),
    ],
)
@pytest.mark.slow
def test_an_exit_with_status_0_mid_run_is_a_crash_and_the_rest_still_runs(backend, reason):
    events = run_isolated(
        job(f"{GATE}.backends:{backend}", [SMALL, LARGE, OTHER], ("numerics", "determinism")),
        lambda e: None,
        case_timeout_s=120,
    )
    for check in ("numerics", "determinism"):
        assert events.results[(check, parse_case(LARGE).id)].verdict == Verdict.CRASH
        assert events.results[(check, parse_case(LARGE).id)].reason.startswith(reason)
        assert events.results[(check, parse_case(OTHER).id)].verdict == Verdict.PASS  # the same or a fresh worker


@pytest.mark.xdist_group("gate_cli_run")  # under pytest -n: with the other tests of the shared run
@pytest.mark.slow
def test_the_cli_fails_a_backend_that_exits_quietly(gate_cli_run):
    completed, path, _ = gate_cli_run
    assert completed.returncode == 1, completed.stdout + completed.stderr
    backends = {backend.name: backend for backend in RunResult.load(path).backends}
    checks = backends[f"{GATE}.backends:ExitsQuietly"].checks
    assert [check.verdict for check in checks] == [Verdict.CRASH, Verdict.CRASH]


@pytest.mark.slow
def test_a_changed_tolerance_is_an_error_naming_it_and_is_put_back():
    events = run_isolated(job(f"{GATE}.backends:LoosensTolerances", [SMALL, OTHER]), lambda e: None, case_timeout_s=120)
    for case in (SMALL, OTHER):
        result = events.results[("numerics", parse_case(case).id)]
        assert result.verdict == Verdict.ERROR and "conformance.harness.comparison.TOLERANCES" in result.reason
        assert result.evidence["harness_state_changed"]


def test_the_seal_names_torch_settings_and_replaced_functions_and_restores_them():
    import torch

    from conformance.checks import numerics
    from conformance.harness import comparison
    from conformance.results import CaseResult
    from conformance.run.seal import Seal

    seal = Seal.take()
    original = comparison.compare_with_oracle
    torch.set_default_dtype(torch.float64)
    comparison.compare_with_oracle = lambda *args, **kwargs: (True, {}, {})
    CaseResult.to_dict = lambda self: {}
    numerics.NumericsCheck.summarize = lambda self, cases: (Verdict.PASS, "")  # added on the subclass: shadows Check's
    changes = seal.changes()
    assert any("torch default dtype" in line for line in changes)
    assert any("comparison.compare_with_oracle" in line for line in changes)
    assert any("CaseResult.to_dict" in line for line in changes)
    assert any("NumericsCheck.summarize (added)" in line for line in changes)
    assert torch.get_default_dtype() == torch.float32 and comparison.compare_with_oracle is original
    assert "summarize" not in vars(numerics.NumericsCheck) and CaseResult.to_dict is not None
    assert seal.changes() == []


@pytest.mark.slow
def test_a_forged_event_line_is_an_error_not_a_pass():
    events = run_isolated(job(f"{GATE}.backends:ForgesEvents", [SMALL, OTHER]), lambda e: None, case_timeout_s=120)
    for case in (SMALL, OTHER):
        result = events.results[("numerics", parse_case(case).id)]
        assert result.verdict == Verdict.ERROR and "events channel was tampered with" in result.reason
    assert ("numerics", "x") not in events.results  # the forged result never became one


def test_the_channel_reports_forged_dropped_repeated_and_truncated_lines(tmp_path):
    from conformance.run.channel import TAMPERING, ChannelReader, ChannelWriter, new_key

    path, key = tmp_path / "events", new_key()
    with open(path, "a", buffering=1) as stream, open(path) as read_stream:
        writer, reader = ChannelWriter(stream, key), ChannelReader(read_stream, key)
        writer.emit({"event": "start"})
        stream.write('1 0000 {"event": "result"}\n')  # forged
        writer.seq += 1  # a line dropped
        writer.emit({"event": "done"})
        kinds = [event["event"] for event in reader.read()]
        assert kinds == ["start", TAMPERING, TAMPERING, "done"]
        stream.seek(0)
        stream.truncate()
        assert [event["event"] for event in reader.read()] == [TAMPERING]


@pytest.fixture(scope="module")
def gate_cli_run(tmp_path_factory):
    """One ``conformance run`` of torch_naive beside a backend that exits quietly and both whose
    import crashes or hangs: each costs its own row only (the tests that read it each took a run of
    their own)."""
    path = tmp_path_factory.mktemp("gate-run") / "r.json"
    started = time.monotonic()
    completed = conformance(
        "run",
        "--backend",
        f"torch_naive,{GATE}.backends:ExitsQuietly,{GATE}.import_segfault:Backend,{GATE}.import_hang:Backend",
        "--case",
        SMALL,
        "--case",
        LARGE,
        "--check",
        "numerics,determinism",
        "--device",
        "cpu",
        "--timeout",
        "8",
        "--json",
        str(path),
    )
    return completed, path, time.monotonic() - started


@pytest.mark.xdist_group("gate_cli_run")  # under pytest -n: the tests that share the run on one worker
@pytest.mark.parametrize(
    "module,verdict,why",
    [
        ("import_segfault", "CRASH", "killed by signal SIGSEGV"),
        ("import_hang", "CRASH", "ran past the time limit of 8 s"),
    ],
)
@pytest.mark.slow
def test_an_import_that_crashes_or_hangs_costs_that_backend_only(gate_cli_run, module, verdict, why):
    completed, path, seconds = gate_cli_run
    assert completed.returncode == 1, completed.stdout + completed.stderr
    backends = {backend.name: backend for backend in RunResult.load(path).backends}
    assert all(check.verdict == Verdict.PASS for check in backends["torch_naive"].checks)
    broken = backends[f"{GATE}.{module}:Backend"]
    assert broken.check("numerics").verdict.value == verdict and why in broken.check("numerics").summary
    assert seconds < 120


@pytest.fixture(scope="module")
def entry_point_site(tmp_path_factory):
    """A real installed distribution (a dist-info on the path) whose entry point fails to import;
    the environment and folder of commands that see it."""
    folder = tmp_path_factory.mktemp("entry-point")
    dist = folder / "site" / "broken_vendor-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-vendor\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[conformance.backends]\nbroken_one = tests.planted.broken_module:Backend\n")
    return folder, dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder / "site"), str(Path.cwd())]))


@pytest.fixture(scope="module")
def entry_point_run(entry_point_site):
    """One run, from that folder with ``--out out``, of a backend whose import changes directory,
    torch_naive and the broken entry point (two tests read it; each took a run of its own)."""
    folder, env = entry_point_site
    completed = conformance(
        "run",
        "--backend",
        f"{GATE}.import_chdir:Backend,torch_naive,broken_one",
        "--case",
        SMALL,
        "--check",
        "numerics",
        "--device",
        "cpu",
        "--out",
        "out",
        cwd=folder,
        env=env,
    )
    return completed, folder / "out" / "results.json"


ENTRY_POINT_RUN = pytest.mark.xdist_group("gate_entry_point_run")  # under pytest -n: its tests on one worker


@ENTRY_POINT_RUN
@pytest.mark.slow
def test_an_import_that_changes_directory_does_not_move_the_results(entry_point_run):
    completed, results = entry_point_run
    assert results.exists(), completed.stdout + completed.stderr
    chdir = RunResult.load(results).backends[0]
    assert chdir.name == f"{GATE}.import_chdir:Backend" and chdir.check("numerics").verdict == Verdict.PASS


@ENTRY_POINT_RUN
@pytest.mark.slow
def test_a_broken_entry_point_is_one_row_and_the_others_run(entry_point_site, entry_point_run):
    folder, env = entry_point_site
    listed = conformance("list", "--device", "cpu", env=env)
    assert listed.returncode == 0 and "broken_one" in listed.stdout and "torch_naive" in listed.stdout
    assert "MY_BACKEND_HOME" in listed.stdout
    completed, results = entry_point_run
    assert completed.returncode == 1, completed.stdout + completed.stderr
    _, naive, broken = RunResult.load(results).backends
    assert naive.check("numerics").verdict == Verdict.PASS
    assert broken.check("numerics").verdict == Verdict.ERROR and "MY_BACKEND_HOME" in broken.check("numerics").summary


@pytest.mark.slow  # its probe is a process of its own
def test_a_mistyped_module_class_is_a_usage_error(in_process, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out folder, were the error not found first
    completed = in_process(
        "run", "--backend", "tests.planted.no_such_module:Backend", "--case", SMALL, "--device", "cpu"
    )
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1 and "No module named" in completed.stderr


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.slow
def test_processes_a_backend_leaves_behind_end_with_its_worker(tmp_path, monkeypatch):
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PLANTED_PIDS_FILE", str(pids_file))
    events = run_isolated(job(f"{GATE}.backends:LeavesProcesses", [SMALL]), lambda e: None, case_timeout_s=120)
    assert events.results[("numerics", parse_case(SMALL).id)].verdict == Verdict.PASS
    pids = [int(line) for line in pids_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a helper process outlived its worker"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.slow
def test_a_killed_run_takes_its_workers_processes_with_it(tmp_path):
    pids_file = tmp_path / "pids"
    env = dict(os.environ, PLANTED_PIDS_FILE=str(pids_file))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            "run",
            "--backend",
            f"{GATE}.backends:LeavesProcessesAndHangs",
            "--case",
            SMALL,
            "--check",
            "numerics",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "r.json"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 2):
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    pids = [int(line) for line in pids_file.read_text().split()]
    deadline = time.monotonic() + 10
    while _alive(pids[0]) and time.monotonic() < deadline:  # the other one may live on: not waited for
        time.sleep(0.1)
    # The helper in the worker's group dies with it; the one in a session of its own was out of
    # reach once the run was gone (docs/gating.md: as far as Linux allows).
    assert not _alive(pids[0])
    if _alive(pids[1]):
        os.kill(pids[1], signal.SIGKILL)


@pytest.mark.slow
def test_two_runs_on_one_results_file_the_second_refuses(in_process, tmp_path):
    results = tmp_path / "r.json"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            "run",
            "--backend",
            "tests.planted.defects:Hangs",
            "--case",
            SMALL,
            "--check",
            "numerics",
            "--device",
            "cpu",
            "--json",
            str(results),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        lock = results.with_name("r.json.lock")
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        second = in_process("run", "--case", SMALL, "--check", "numerics", "--device", "cpu", "--json", str(results))
        assert second.returncode == 2 and f"pid {first.pid}" in second.stderr and second.stderr.count("\n") == 1
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
    assert not results.with_name("r.json.lock").exists()
    assert json.loads(results.read_text())["interrupted"] is True  # the first run's own results, not lost


def test_results_are_written_with_the_users_umask(tmp_path):
    from conformance.results import RunResult as Run

    previous = os.umask(0o022)
    try:
        Run({}, []).save(tmp_path / "r.json")
    finally:
        os.umask(previous)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_the_runs_own_process_never_imports_backend_code(tmp_path):
    # One process: a run, then a list (what each imported is printed after it).
    code = (
        "import sys; from conformance.cli import main; "
        f"rc = main(['run', '--backend', 'torch_naive,{GATE}.backends:ExitsQuietly', '--case', '{SMALL}', "
        f"'--check', 'numerics', '--device', 'cpu', '--json', {str(tmp_path / 'r.json')!r}, '--quiet']); "
        "print('IMPORTED', sorted(m for m in sys.modules if m.startswith(('tests.planted', 'backends.torch_naive', "
        "'backends.triton', 'backends.flash')))); print('RC', rc); "
        "main(['list', '--device', 'cpu']); "
        "print('LISTED', [m for m in sys.modules if m.startswith(('backends.torch_naive', 'backends.triton'))])"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RC 0" in completed.stdout, completed.stdout + completed.stderr
    assert "IMPORTED []" in completed.stdout
    assert "LISTED []" in completed.stdout, completed.stdout + completed.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_is_gone_before_it_starts_ends_at_once():
    # The child sets its death signal itself (no preexec_fn in a parent with threads): one started
    # for a parent that is no longer its parent ends before doing anything; its own parent's runs.
    code = "from conformance.run.isolation import die_with_parent; die_with_parent(); print('ran')"
    for parent, ran in ((os.getpid(), "ran"), (1, "")):
        env = dict(os.environ, CONFORMANCE_PARENT_PID=str(parent))
        completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert completed.stdout.strip() == ran, (parent, completed.stderr)
