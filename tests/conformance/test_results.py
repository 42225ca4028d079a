import json

import pytest

from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict, worst


def sample() -> RunResult:
    cases = [
        CaseResult("gqa:1+1@0", Verdict.PASS, metrics={"max_abs_error": 1e-3}),
        CaseResult("gqa:2+1@0", Verdict.FAIL, "bad", tag="decode", evidence={"worst": {"request": 0}}),
    ]
    check = CheckResult("numerics", Verdict.FAIL, "1 PASS, 1 FAIL", cases, details={"tolerances": {}})
    backends = [
        BackendResult("a", True, claims={"kinds": ["mha"]}, checks=[check], wall_s=1.5),
        BackendResult("b", False, "needs SM100", checks=[CheckResult("numerics", Verdict.SKIP, "unavailable")]),
    ]
    return RunResult({"gpu": "H100"}, backends, "smoke", ["numerics"])


def test_round_trip(tmp_path):
    result = sample()
    result.save(tmp_path / "r.json")
    loaded = RunResult.load(tmp_path / "r.json")
    assert loaded == result
    assert json.loads((tmp_path / "r.json").read_text())["schema_version"] == 1


def test_unknown_schema_version_is_refused():
    data = sample().to_dict()
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version"):
        RunResult.from_dict(data)


def test_verdict_aggregation():
    assert worst([Verdict.PASS, Verdict.SKIP]) == Verdict.PASS
    assert worst([Verdict.PASS, Verdict.FAIL, Verdict.ERROR]) == Verdict.ERROR
    assert worst([Verdict.FAIL, Verdict.CRASH]) == Verdict.CRASH
    assert worst([Verdict.SKIP]) == Verdict.SKIP and worst([]) == Verdict.SKIP
    result = sample()
    assert result.any_failure() and result.ran_anything()
