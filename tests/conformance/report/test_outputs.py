"""A run's and a report's files: a malformed results file is one line (exit 2) and no partial
file; any string renders in every format; no output overwrites an input, a lock or a journal; a
full disk is one line naming what was kept; an interrupted run leaves no older report beside it;
the plugin takes the CLI's rules (the lock, output paths checked before the session)."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.report.compare import compare_runs
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.run.results_lock import ResultsLock
from tests.conformance.report.test_gate_reports import _document
from tests.conformance.run.test_interrupts import start_run
from tests.conformance.test_pytest_plugin import plugin_args

ROOT = Path(__file__).resolve().parents[3]
SMALL = "gqa-h2/1-d16-fp32:5+1"


def conformance(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "conformance", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env
    )


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def set_in(document: dict, path: tuple, value) -> dict:
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return document


CASE = ("backends", 0, "checks", 0, "cases", 0)
MALFORMED = [
    (("environment",), [], "RunResult.environment is [], not dict"),
    (("suite",), 5, "RunResult.suite is 5, not str"),
    (("checks",), 5, "RunResult.checks is 5, not list"),
    (("backends", 0, "checks", 0, "summary"), 5, "CheckResult.summary is 5, not str"),
    ((*CASE, "tag"), None, "CaseResult.tag is None, not str"),
    ((*CASE, "seconds"), "abc", "CaseResult.seconds is 'abc', not float | None"),
    ((*CASE, "evidence"), [1], "CaseResult.evidence is [1], not dict"),
    ((*CASE, "verdict"), "MAYBE", "CaseResult.verdict is 'MAYBE'"),
    (("backends", 0, "wall_s"), "1", "BackendResult.wall_s is '1', not float"),
]


@pytest.mark.parametrize("path,value,message", MALFORMED)
def test_a_malformed_results_file_is_one_line_and_no_file(in_process, tmp_path, path, value, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(set_in(_document(), path, value)))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_document()))
    outputs = [tmp_path / "o.html", tmp_path / "o.xml", tmp_path / "o.md"]
    for command in (
        ["report", bad, "-o", outputs[0], "--junit", outputs[1], "--markdown", outputs[2]],
        ["compare", good, bad],
    ):
        completed = in_process(*command)
        assert completed.returncode == 2, completed.stderr
        assert completed.stderr.count("\n") == 1 and message in completed.stderr, completed.stderr
    assert not any(path.exists() for path in outputs)


def test_evidence_no_report_can_draw_is_one_line_and_no_partial_file(in_process, tmp_path):
    # A numerics FAIL whose "worst" is a number: the HTML draws it as a place, the JUnit file would not need it.
    document = _document(verdict="FAIL", reason="wrong", evidence={"worst": 5})
    set_in(document, ("backends", 0, "checks", 0, "verdict"), "FAIL")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    completed = in_process("report", bad, "--junit", tmp_path / "o.xml", "-o", tmp_path / "o.html")
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert "cannot draw the" in completed.stderr and "Traceback" not in completed.stderr
    assert not (tmp_path / "o.xml").exists() and not (tmp_path / "o.html").exists()


def test_deeply_nested_json_is_one_line(in_process, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(nested(100_000))
    for command in (["report", deep, "-o", tmp_path / "o.html"], ["compare", deep, deep]):
        completed = in_process(*command)
        assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
        assert "nested too deeply" in completed.stderr


@pytest.mark.slow
def test_any_string_renders_in_every_format_and_the_terminal(tmp_path):
    # A backend whose error text holds an undecodable file name (a lone surrogate) and raw control characters.
    completed = conformance(
        "run",
        "--backend",
        "tests.planted.gate.backends:RaisesUndecodableText",
        "--case",
        SMALL,
        "--check",
        "numerics",
        "--device",
        "cpu",
        "--json",
        tmp_path / "r.json",
        "--html",
        tmp_path / "r.html",
        "--junit",
        tmp_path / "r.xml",
        "--markdown",
        tmp_path / "r.md",
    )
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr and "numerics" in completed.stdout  # the table
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "\\udcff" in page and not any(char in page for char in "\x00\x1b\x07\x9b")
    import xml.etree.ElementTree as ElementTree

    ElementTree.parse(tmp_path / "r.xml")
    assert "\\udcff" in (tmp_path / "r.md").read_text(encoding="utf-8")
    assert f"reports: {tmp_path / 'r.html'}, {tmp_path / 'r.xml'}, {tmp_path / 'r.md'}" in completed.stdout


def test_outputs_that_would_overwrite_an_input_a_lock_or_a_journal_are_refused(in_process, tmp_path):
    results = tmp_path / "r.json"
    results.write_text(json.dumps(_document()))
    for command in (
        ["report", results, "-o", results],
        ["report", results, "--junit", results],
        ["run", "--case", SMALL, "--device", "cpu", "--json", results, "--html", f"{results}.lock"],
        ["run", "--case", SMALL, "--device", "cpu", "--json", results, "--markdown", f"{results}.journal"],
    ):
        completed = in_process(*command)
        assert completed.returncode == 2 and completed.stderr.count("\n") == 1, (command, completed.stderr)
        assert "name another file" in completed.stderr
    assert json.loads(results.read_text()) == _document()


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_what_was_kept(tmp_path, monkeypatch, capsys):
    # The results file and the journal cannot be written past the journal's first case; the reports can.
    from conformance import cli
    from conformance.report import outputs
    from conformance.run import journal

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_write = outputs.write_atomically

    def write_atomically(path, text):
        if str(path).endswith(".json"):
            raise full
        real_write(path, text)

    class FullAfterOneLine:
        def __init__(self, path, *args, **kwargs):
            self.lines = 0

        def write(self, text):
            self.lines += 1
            if self.lines > 1:
                raise full

        def close(self):
            pass

    monkeypatch.setattr(outputs, "write_atomically", write_atomically)
    monkeypatch.setattr(journal, "open", FullAfterOneLine, raising=False)
    code = cli.main(
        ["run", "--case", SMALL, "--case", "gqa-h2/1-d16-fp32:9+2", "--device", "cpu", "--check", "numerics"]
        + ["--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), "--quiet"]
    )
    err = capsys.readouterr().err
    assert code == 1
    line = next(line for line in err.splitlines() if line.startswith("conformance: error:"))
    assert f"could not write {tmp_path / 'r.json'}: No space left on device" in line
    assert f"(written: {tmp_path / 'r.html'})" in line
    assert "r.json.journal holds 1 finished case(s), then it stopped: No space left on device" in line
    assert (tmp_path / "r.html").exists()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc (Linux)")
@pytest.mark.slow
def test_an_interrupted_run_leaves_no_older_report_beside_its_results(tmp_path):
    reports = [tmp_path / "old.html", tmp_path / "old.xml", tmp_path / "old.md"]
    for path in reports:
        path.write_text("an older run's green report")
    run, results = start_run(tmp_path, ("--html", reports[0], "--junit", reports[1], "--markdown", reports[2]))
    os.killpg(run.pid, signal.SIGINT)
    run.communicate(timeout=120)
    assert run.returncode == 130 and json.loads(results.read_text())["interrupted"] is True
    assert not any(path.exists() for path in reports)


def test_compare_does_not_pass_a_measurement_that_vanished():
    def run(metrics):
        case = CaseResult("gqa:5+1@0", Verdict.PASS, metrics=metrics)
        return RunResult({}, [BackendResult("b", True, checks=[CheckResult("bench", Verdict.PASS, "", [case])])])

    base = run({"forward_us": 10.0, "max_abs_error": 0.002})
    for new in ({"forward_us": 0, "max_abs_error": 0.002}, {"max_abs_error": 0.002}, {"forward_us": 10.0}):
        findings = [f for f in compare_runs(base, run(new)) if f.regression]
        assert len(findings) == 1 and "in BASE" in findings[0].what, findings
    accepted = compare_runs(base, run({"forward_us": 10.0, "max_abs_error": 0}), accept=["missing"])
    assert not [f for f in accepted if f.regression] and [f for f in accepted if f.accepted]


def plugin(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path)]
        + ["-c", os.devnull, "--conformance-backend", "torch_naive", "--conformance-check", "numerics"]
        + ["--conformance-case", SMALL, "--conformance-device", "cpu", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


def plugin_in_process(pytester, *args):
    """``plugin`` in this process (pytester's own run): for what the plugin refuses before its session."""
    result = pytester.runpytest(
        *plugin_args(), "-p", "no:cacheprovider", "-q", "--conformance-backend", "torch_naive", "--conformance-check",
        "numerics", "--conformance-case", SMALL, "--conformance-device", "cpu", *map(str, args),
    )  # fmt: skip
    return subprocess.CompletedProcess(args, result.ret, result.stdout.str(), result.stderr.str())


@pytest.mark.slow
def test_the_plugin_refuses_a_results_file_another_run_holds(tmp_path):
    results = tmp_path / "r.json"
    journal = tmp_path / "r.json.journal"
    journal.write_text('{"the other run": "its journal"}\n')
    # Held by a process of its own, then by the pytest's parent (this test): refused either way.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, time; from conformance.run.results_lock import ResultsLock; "
            f"ResultsLock(pathlib.Path({str(results)!r})).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        completed = plugin(tmp_path, "--conformance-json", results)
    finally:
        holder.kill()
        holder.wait()
    assert completed.returncode == pytest.ExitCode.USAGE_ERROR, completed.stdout + completed.stderr
    assert "is being written by another conformance run" in completed.stderr
    with ResultsLock(results):
        by_parent = plugin(tmp_path, "--conformance-json", results)
    assert by_parent.returncode == pytest.ExitCode.USAGE_ERROR, by_parent.stdout + by_parent.stderr
    assert "is being written by another conformance run" in by_parent.stderr
    assert journal.read_text() == '{"the other run": "its journal"}\n' and not results.exists()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="/proc: a place no process may create files, root too")
def test_the_plugin_checks_its_output_paths_before_the_session_read_only(pytester):
    completed = plugin_in_process(pytester, "--conformance-json", "/proc/conformance-results/r.json")
    assert completed.returncode == pytest.ExitCode.USAGE_ERROR and "cannot write there" in completed.stderr
    assert "INTERNALERROR" not in completed.stdout + completed.stderr


def test_the_plugin_checks_its_output_paths_before_the_session(pytester, tmp_path):
    (tmp_path / "a_folder").mkdir()
    for args, message in (
        (["--conformance-html", tmp_path / "a_folder"], "is a directory"),
        (
            ["--conformance-json", tmp_path / "x" / "r.json", "--conformance-markdown", tmp_path / "x" / "r.json"],
            "name the same file",
        ),
        (
            ["--conformance-json", tmp_path / "r.json", "--conformance-html", tmp_path / "r.json.lock"],
            "name another file",
        ),
    ):
        completed = plugin_in_process(pytester, *args)
        assert completed.returncode == pytest.ExitCode.USAGE_ERROR and message in completed.stderr, completed.stderr
        assert "passed" not in completed.stdout  # refused before any item ran


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs filled up (root, and a kernel that lets this sandbox mount one; else skipped)."""
    import shutil

    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount command here")
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode(errors='replace').strip()}")
    try:
        try:
            with open(mount / "filler", "wb") as filler:
                while True:
                    filler.write(b"\0" * 4096)
                    filler.flush()
        except OSError:  # full
            pass
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_disk_already_full_is_refused_before_the_run(full_disk):
    completed = conformance("run", "--case", SMALL, "--device", "cpu", "--json", full_disk / "r.json")
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert "cannot write there (No space left on device)" in completed.stderr


def test_the_lock_is_held_when_the_pid_cannot_be_written(tmp_path, monkeypatch):
    from conformance.run import results_lock

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results_lock.os, "write", full)
    lock = results_lock.ResultsLock(tmp_path / "r.json").acquire()
    monkeypatch.undo()
    try:  # held all the same: another run is refused
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import pathlib; from conformance.run.results_lock import ResultsLock; "
                f"ResultsLock(pathlib.Path({str(tmp_path / 'r.json')!r})).acquire()",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert other.returncode == 1 and "ResultsInUse" in other.stderr, other.stderr
    finally:
        lock.release()
