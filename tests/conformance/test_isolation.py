"""A backend that kills its own process is a CRASH row; the run goes on."""
import torch

from conformance.cases import parse_case
from conformance.execution import Job
from conformance.isolation import run_isolated
from conformance.results import Verdict
from conformance.runner import RunOptions, run

SMALL = "gqa-h2/1-d16-fp32:5+1"
LARGE = "gqa-h2/1-d16-fp32:5+1x4"  # four requests: CrashesOnLargeBatch dies here
OTHER = "gqa-h2/1-d16-fp32:9+2"


def job(backend, cases):
    return Job(backend, "cpu", ["numerics"], [{"id": parse_case(text).id, "tag": ""} for text in cases])


def test_crash_names_the_case_and_a_fresh_child_resumes():
    events = []
    result = run_isolated(job("tests.planted.defects:CrashesOnLargeBatch", [SMALL, LARGE, OTHER]), events.append, timeout_s=120)
    verdicts = {case: r.verdict for (_, case), r in result.results.items()}
    assert verdicts == {parse_case(SMALL).id: Verdict.PASS, parse_case(LARGE).id: Verdict.CRASH, parse_case(OTHER).id: Verdict.PASS}
    crash = result.results[("numerics", parse_case(LARGE).id)]
    assert "SIGSEGV" in crash.reason and "while running this case" in crash.reason
    assert "stderr_tail" in crash.evidence


def test_a_hang_becomes_a_result_at_the_time_limit():
    result = run_isolated(job("tests.planted.defects:Hangs", [SMALL, OTHER]), lambda e: None, timeout_s=20)
    first, second = (result.results[("numerics", parse_case(t).id)] for t in (SMALL, OTHER))
    assert first.verdict == Verdict.CRASH and "time limit" in first.reason
    assert second.verdict == Verdict.ERROR and "not run" in second.reason


def test_a_raising_backend_is_an_error_with_its_traceback():
    result = run_isolated(job("tests.planted.defects:RaisesInBuild", [SMALL]), lambda e: None, timeout_s=120)
    error = result.results[("numerics", parse_case(SMALL).id)]
    assert error.verdict == Verdict.ERROR and "planted: build() refuses" in error.reason
    assert "RaisesInBuild" in error.evidence["traceback"] or "build" in error.evidence["traceback"]


def test_run_reports_every_backend_after_a_crash():
    options = RunOptions(
        backends=["tests.planted.defects:CrashesOnLargeBatch", "torch_naive"],
        checks=["numerics"], cases=[parse_case(t) for t in (SMALL, LARGE)], device=torch.device("cpu"), timeout_s=120,
    )
    result = run(options)
    crashed, naive = result.backends
    assert crashed.check("numerics").verdict == Verdict.CRASH
    assert naive.check("numerics").verdict == Verdict.PASS
    assert result.any_failure()
