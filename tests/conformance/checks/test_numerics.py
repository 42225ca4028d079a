"""The numerics check passes the baseline and fails every planted defect."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.checks.numerics import NumericsCheck
from conformance.harness.comparison import compare_with_oracle
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import defects, input_defects

CPU = torch.device("cpu")


def run_suite(backend_cls, cases):
    check = NumericsCheck()
    plan = check.plan(backend_cls, cases, CPU)
    results = [judge(check, backend_cls, case, CPU) for case in cases if not plan[case.id]]
    return check.summarize(results)[0], results


def test_torch_naive_passes_the_smoke_suite():
    verdict, results = run_suite(TorchNaiveBackend, suite("smoke"))
    assert verdict == Verdict.PASS and len(results) == len(suite("smoke"))
    assert all(
        result.metrics["max_rel_error"] < 1e-2 for result in results
    )  # outputs near 8 (the outlier value channel)
    # The NaN-poison pass ran on every case, and the step wrote exactly its own slots.
    cases = {case.id: case for case in suite("smoke")}
    assert all(result.metrics["nan-poison slots written"] == cases[result.case].num_tokens for result in results)


# Each planted defect and the cases it must fail (and torch_naive must pass).
PLANTED_DEFECT_CASES = {
    defects.CausalOffByOne: ["gqa-h4/2-d32-fp32-p16:10+4,0+6"],
    defects.FirstBlockOnly: ["gqa-h4/2-d32-fp32-p16:40+1,20+2"],
    defects.WrongScale: ["gqa-h4/2-d32-fp32-p16:30+1", "mla-h4-d32+8-bf16-p16:30+2"],
    defects.WritesSlotMinusOne: ["gqa-h4/2-d32-fp32-p16:40+1,20+2", "mla-h4-d32+8-bf16-p16:40+1,20+2"],
    defects.ForgetsLastToken: ["gqa-h4/2-d32-fp32-p16:40+1,20+2"],
}


@pytest.mark.parametrize("defect,case_text", [(d, case) for d, cases in PLANTED_DEFECT_CASES.items() for case in cases])
def test_each_planted_defect_fails(defect, case_text):
    case = parse_case(case_text)
    assert judge(NumericsCheck(), TorchNaiveBackend, case, CPU).verdict == Verdict.PASS
    result = judge(NumericsCheck(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL, result
    if defect is defects.WritesSlotMinusOne:  # the input watch sees the pool's last block change first
        assert "write_kv changed the KV pool outside the blocks the step writes" in result.reason, result.reason
    else:
        assert "worst at request" in result.reason and result.metrics["mismatched"] > 0


@pytest.mark.parametrize(
    "defect", [defects.CausalOffByOne, defects.FirstBlockOnly, defects.WrongScale, defects.WritesSlotMinusOne]
)
def test_each_planted_defect_fails_the_smoke_suite(defect):
    verdict, _ = run_suite(defect, suite("smoke"))
    assert verdict == Verdict.FAIL


def test_off_by_one_is_invisible_to_pure_decode_and_caught_by_spec_verify():
    """Why the suite has spec-verify cases: a decode token has no future to leak."""
    decode = judge(NumericsCheck(), defects.CausalOffByOne, parse_case("gqa-h4/2-d32-fp32:10+1,30+1"), CPU)
    verify = judge(NumericsCheck(), defects.CausalOffByOne, parse_case("gqa-h4/2-d32-fp32:10+4,30+4"), CPU)
    assert decode.verdict == Verdict.PASS and verify.verdict == Verdict.FAIL


def test_unwritten_rows_are_reported_as_non_finite():
    result = judge(NumericsCheck(), defects.ForgetsLastToken, parse_case("gqa-h4/2-d32-fp32:10+2"), CPU)
    assert result.metrics["non_finite"] == 4 * 32 and "NaN" in result.reason


def test_compare_locates_the_worst_element():
    reference = torch.zeros(5, 2, 3, dtype=torch.float64)
    out = reference.clone()
    out[3, 1, 2] = 0.5
    passed, metrics, evidence = compare_with_oracle(out, reference, [0, 2, 5], atol=1e-3, rtol=1e-3)
    assert not passed and metrics["mismatched"] == 1
    assert evidence["worst"] == {"request": 1, "token": 1, "head": 1, "channel": 2, "got": 0.5, "expected": 0.0}


# The later passes, in order: each one's planted defect, the reason it fails with, its error
# metric, and the cases (the earlier passes must be right on all of them).
LATER_PASSES = [
    (
        input_defects.CachesPoolViewsByShape,
        "a second layer",
        "second layer max abs error",
        [
            "gqa-h4/2-d32-bf16-p16:40+1,20+4",
            "mla-h4-d32+8-bf16-p16:40+1,20+4",
            "gqa-h4/2-d32-bf16-p16-strided:40+1,20+4",
        ],
    ),
    # Every other pass builds once per backend, so a plan cached by shape is always the right one there.
    (
        input_defects.ReusesPlanForSameShape,
        "two steps in flight: the next step (",
        "in-flight max abs error",
        [
            "gqa-h4/2-d32-bf16-p16:40+1,20+4,300+1",
            "mla-h4-d32+8-bf16-p16:40+1,20+4",
            "gqa-h4/2-d32-bf16-p16:100+1x3,7+1",
        ],
    ),
]


@pytest.mark.parametrize("index,case_text", [(i, case) for i, (*_, cases) in enumerate(LATER_PASSES) for case in cases])
def test_each_later_pass_fails_its_defect_after_the_earlier_passes_were_right(index, case_text):
    defect, reason, metric, _ = LATER_PASSES[index]
    case = parse_case(case_text)
    passed = judge(NumericsCheck(), TorchNaiveBackend, case, CPU)
    assert passed.verdict == Verdict.PASS and passed.metrics[metric] < 0.1
    result = judge(NumericsCheck(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL and result.reason.startswith(reason), result.reason
    assert result.metrics["mismatched"] == 0 and result.metrics["nan-poison mismatched"] == 0
    assert all(result.metrics[earlier] < 0.1 for _, _, earlier, _ in LATER_PASSES[:index])
