"""A backend that kills its own process, or hangs, is a CRASH row; the run goes on."""

import time

import pytest
import torch

from conformance.cases.grammar import parse_case
from conformance.results import Verdict
from conformance.run.execution import Job
from conformance.run.isolation import run_isolated
from conformance.run.runner import RunOptions, run

SMALL = "gqa-h2/1-d16-fp32:5+1"
LARGE = "gqa-h2/1-d16-fp32:5+1x4"  # four requests: CrashesOnLargeBatch dies here
OTHER = "gqa-h2/1-d16-fp32:9+2"


def job(backend, cases):
    return Job(backend, "cpu", ["numerics"], [{"id": parse_case(text).id, "tag": ""} for text in cases])


@pytest.mark.slow
def test_crash_names_the_case_and_a_fresh_child_resumes():
    events = []
    result = run_isolated(
        job("tests.planted.defects:CrashesOnLargeBatch", [SMALL, LARGE, OTHER]), events.append, case_timeout_s=120
    )
    verdicts = {case: r.verdict for (_, case), r in result.results.items()}
    assert verdicts == {
        parse_case(SMALL).id: Verdict.PASS,
        parse_case(LARGE).id: Verdict.CRASH,
        parse_case(OTHER).id: Verdict.PASS,
    }
    crash = result.results[("numerics", parse_case(LARGE).id)]
    assert "SIGSEGV" in crash.reason and "while running this case" in crash.reason
    assert "stderr_tail" in crash.evidence


@pytest.mark.slow
def test_a_hung_case_is_killed_and_a_fresh_child_goes_on_with_the_next():
    started = time.monotonic()
    result = run_isolated(
        job("tests.planted.defects:HangsOnLongSequence", [OTHER, SMALL]), lambda e: None, case_timeout_s=4
    )
    hung, after = (result.results[("numerics", parse_case(t).id)] for t in (OTHER, SMALL))
    assert hung.verdict == Verdict.CRASH and "hung: ran past the per-case time limit of 4 s" in hung.reason
    assert after.verdict == Verdict.PASS
    assert time.monotonic() - started < 60  # not the hour the backend sleeps


@pytest.mark.slow
def test_past_the_backend_time_limit_the_rest_is_not_run():
    result = run_isolated(
        job("tests.planted.defects:Hangs", [SMALL, OTHER]), lambda e: None, case_timeout_s=600, backend_timeout_s=6
    )
    first, second = (result.results[("numerics", parse_case(t).id)] for t in (SMALL, OTHER))
    assert first.verdict == Verdict.CRASH and "backend's time limit of 6 s" in first.reason
    assert second.verdict == Verdict.ERROR and second.reason.startswith("not run")


@pytest.mark.slow
def test_after_the_crash_limit_cases_that_would_skip_stay_skip():
    cases = [LARGE, "gqa-h2/1-d16-fp32:6+1x4", "gqa-h2/1-d16-fp32:7+1x4", "gqa-h2/1-d16-fp32:8+1x4", OTHER]
    crashing = Job(
        "tests.planted.defects:CrashesOnLargeBatch",
        "cpu",
        ["numerics", "graphs", "draft-loop", "engine"],
        [{"id": parse_case(text).id, "tag": ""} for text in cases],
    )
    result = run_isolated(crashing, lambda e: None, case_timeout_s=120, max_crashes=3)
    numerics = [result.results[("numerics", parse_case(t).id)].verdict for t in cases]
    assert numerics == [Verdict.CRASH] * 4 + [Verdict.ERROR]
    assert "crashed or hung 4 times" in result.results[("numerics", parse_case(OTHER).id)].reason
    # The graph checks skip this backend (it claims no CUDA graphs): SKIP with that reason, not ERROR.
    assert (
        "cuda_graphs=NEVER" in result.skipped_checks["graphs"]
        and "cuda_graphs=NEVER" in result.skipped_checks["draft-loop"]
    )
    assert not any(check in ("graphs", "draft-loop") for check, _ in result.results)
    # The engine runs one case per layout: the first is not run, the others keep their SKIP.
    engine = [result.results[("engine", parse_case(t).id)] for t in cases]
    assert engine[0].verdict == Verdict.ERROR and all(
        r.verdict == Verdict.SKIP and "covered by" in r.reason for r in engine[1:]
    )


def test_a_raising_backend_is_an_error_with_its_traceback():
    result = run_isolated(job("tests.planted.defects:RaisesInBuild", [SMALL]), lambda e: None, case_timeout_s=120)
    error = result.results[("numerics", parse_case(SMALL).id)]
    assert error.verdict == Verdict.ERROR and "planted: build() refuses" in error.reason
    assert "RaisesInBuild" in error.evidence["traceback"] or "build" in error.evidence["traceback"]


@pytest.mark.slow
def test_run_reports_every_backend_after_a_crash():
    options = RunOptions(
        backends=["tests.planted.defects:CrashesOnLargeBatch", "torch_naive"],
        checks=["numerics"],
        cases=[parse_case(t) for t in (SMALL, LARGE)],
        device=torch.device("cpu"),
        case_timeout_s=120,
    )
    result = run(options)
    crashed, naive = result.backends
    assert crashed.check("numerics").verdict == Verdict.CRASH
    assert naive.check("numerics").verdict == Verdict.PASS
    assert result.any_failure()
