"""What the gate reads and writes cannot be turned against it: compare sees NEW's new failures
wherever they are, a results file with duplicates or broken metrics is a usage error, and a
backend's strings render as text in every report."""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from rich.console import Console

from conformance.report import html as report_html
from conformance.report import junit as report_junit
from conformance.report import markdown as report_markdown
from conformance.report.compare import CompareError, compare_runs
from conformance.report.terminal import print_report
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict


def passing(name="mine", checks=("numerics",)) -> BackendResult:
    return BackendResult(
        name,
        True,
        checks=[
            CheckResult(check, Verdict.PASS, "1 PASS", [CaseResult("gqa:5+1@0", Verdict.PASS)]) for check in checks
        ],
    )


def failing_check(name: str) -> CheckResult:
    return CheckResult(name, Verdict.FAIL, "1 FAIL", [CaseResult("gqa:5+1@0", Verdict.FAIL, "wrong")])


def test_compare_catches_a_new_failing_check_that_the_baseline_lacks():
    base = RunResult({}, [passing()], "standard", ["numerics"])
    new = RunResult(
        {},
        [BackendResult("mine", True, checks=[*passing().checks, failing_check("graphs")])],
        "standard",
        ["numerics", "graphs"],
    )
    regressions = [f for f in compare_runs(base, new) if f.regression]
    assert [(f.check, f.case) for f in regressions] == [("graphs", "gqa:5+1@0")]
    assert "check absent from BASE" in regressions[0].what


def test_compare_catches_a_new_failing_backend_and_one_that_failed_to_load():
    base = RunResult({}, [passing()], "standard", ["numerics"])
    new = RunResult(
        {},
        [
            passing(),
            BackendResult("other", True, checks=[failing_check("numerics")]),
            BackendResult("broken", True, checks=[CheckResult("numerics", Verdict.ERROR, "cannot import x")]),
        ],
        "standard",
        ["numerics"],
    )
    regressions = [f for f in compare_runs(base, new) if f.regression]
    assert {f.backend for f in regressions} == {"other", "broken"}
    assert compare_runs(base, RunResult({}, [passing(), passing("other")], "standard", ["numerics"])) == []


@pytest.mark.parametrize("which", ["base", "new"])
@pytest.mark.parametrize("duplicate", ["backend", "check", "case"])
def test_compare_refuses_duplicates_in_either_file(which, duplicate):
    good = RunResult({}, [passing()], "standard", ["numerics"])
    twice = RunResult.from_dict(good.to_dict())
    if duplicate == "backend":
        twice.backends.append(BackendResult("mine", True, checks=[failing_check("numerics")]))
    elif duplicate == "check":
        twice.backends[0].checks.append(failing_check("numerics"))
    else:
        twice.backends[0].checks[0].cases.append(CaseResult("gqa:5+1@0", Verdict.FAIL))
    base, new = (twice, good) if which == "base" else (good, twice)
    with pytest.raises(CompareError, match="twice"):
        compare_runs(base, new)


@pytest.mark.parametrize(
    "thresholds",
    [
        {"error_growth": float("inf")},
        {"error_growth": float("nan")},
        {"bench_threshold": float("inf")},
        {"bench_threshold": 0.0},
    ],
)
def test_compare_thresholds_must_be_finite_and_in_range(thresholds):
    run = RunResult({}, [passing()], "standard", ["numerics"])
    with pytest.raises(CompareError):
        compare_runs(run, run, **thresholds)


def _document(**case_fields) -> dict:
    return {
        "schema_version": 1,
        "suite": "standard",
        "checks": ["numerics"],
        "backends": [
            {
                "name": "mine",
                "available": True,
                "checks": [
                    {
                        "name": "numerics",
                        "verdict": "PASS",
                        "cases": [{"case": "gqa:5+1@0", "verdict": "PASS", **case_fields}],
                    }
                ],
            }
        ],
    }


@pytest.mark.parametrize(
    "document,message",
    [
        (_document(metrics={"max_abs_error": "abc"}), "max_abs_error is 'abc'"),
        (_document(metrics={"max_abs_error": float("nan")}), "not a finite number"),
        (_document(metrics={"forward_us": float("inf")}), "forward_us"),
        (_document(metrics={"forward_us": True}), "forward_us"),
        ({**_document(), "schema_version": True}, "schema_version True"),
        ([1, 2], "JSON object"),
    ],
)
def test_compare_and_report_refuse_broken_results_files(in_process, tmp_path, document, message):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_document()))
    bad.write_text(json.dumps(document))
    for command in (["compare", str(good), str(bad)], ["report", str(bad), "-o", str(tmp_path / "r.html")]):
        completed = in_process(*command)
        assert completed.returncode == 2, completed.stderr
        assert completed.stderr.count("\n") == 1 and message in completed.stderr and "Traceback" not in completed.stderr


HOSTILE = (
    "\x1b[2J\x1b[H\x1b]0;owned\x07\x1b[31mred\x1b[0m \x00\x08\x0b\x0c\x7f\x9b \ud800 "
    "| col | \n# Injected heading\n| a | b |\n<script>alert(1)</script> `tick` **bold** ]]> &amp;"
)


def hostile_run() -> RunResult:
    case = CaseResult(
        "gqa:5+1@0", Verdict.CRASH, HOSTILE, tag=HOSTILE, evidence={"stderr_tail": HOSTILE, "traceback": HOSTILE}
    )
    failed = CaseResult(
        "gqa:9+1@0",
        Verdict.FAIL,
        HOSTILE,
        evidence={"worst": {"request": 0, "token": 0, "head": 0, "channel": 0, "got": 1.0, "expected": 2.0}},
    )
    return RunResult(
        {"command": HOSTILE, "git_sha": HOSTILE, "gpu": HOSTILE},
        [
            BackendResult(HOSTILE, True, checks=[CheckResult("numerics", Verdict.CRASH, HOSTILE, [case, failed])]),
            BackendResult("unavailable", False, HOSTILE, checks=[CheckResult("numerics", Verdict.SKIP, HOSTILE)]),
        ],
        "standard",
        ["numerics"],
    )


def test_junit_stays_parseable_whatever_a_backend_prints(tmp_path):
    text = report_junit.render(hostile_run())
    root = ElementTree.fromstring(text.encode())  # raises on any character XML 1.0 forbids
    assert root.get("tests") == "3" and "\\x00" in text and "\x1b" not in text


def test_the_terminal_shows_control_characters_instead_of_running_them():
    console = Console(record=True, width=200, force_terminal=False)
    print_report(console, hostile_run())
    text = console.export_text()
    assert "\x1b" not in text and "\x00" not in text and "\x9b" not in text and "\x07" not in text
    assert "red" in text and "\\x00" in text


def test_markdown_escapes_tables_html_and_newlines():
    text = report_markdown.render(hostile_run())
    outside_code = re.sub(r"(`+).*?\1", "", text)  # a code span shows its text literally, HTML included
    assert "\n# Injected heading" not in text and "<script>" not in outside_code
    assert "\x1b" not in text
    table_rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table_rows) == 4  # header, rule, two backends: no row injected
    assert all(line.count("|") - line.count("\\|") == 3 for line in table_rows[2:])


def test_html_escapes_everything():
    text = report_html.render(hostile_run())
    assert "<script>alert" not in text


@pytest.mark.slow
def test_publish_keeps_every_file_inside_out(tmp_path):
    run = RunResult(
        {},
        [BackendResult("../../escaped", True, checks=[CheckResult("numerics", Verdict.PASS)])],
        "standard",
        ["numerics"],
    )
    run.save(tmp_path / "r.json")
    out = tmp_path / "a" / "b" / "out"
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.report.publish", str(tmp_path / "r.json"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    written = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*") if path.is_file())
    assert written == ["a/b/out/README.md", "a/b/out/_.._escaped.html", "a/b/out/_.._escaped.json", "r.json"]
