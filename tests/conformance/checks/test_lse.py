"""The log-sum-exp output (feature ``lse``): the oracle's against a direct formula, torch_naive
against the oracle on every path (sinks, fp8, a value head dim of its own, MLA), and the planted
convention slips failing numerics."""

import pytest
import torch

from backends.features import LSE
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.cases.oracle import attention_reference
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import lse_defects

CPU = torch.device("cpu")
SINKS = "gqa-h8/2-d64-bf16-attnsinks-lse:30+4,0+20,17+1"


def test_the_oracle_lse_is_the_log_of_each_softmax_denominator():
    generator = torch.Generator().manual_seed(1)
    query, key, value = (
        torch.randn(shape, generator=generator, dtype=torch.float64) for shape in ((3, 4, 8), (7, 2, 8), (7, 2, 6))
    )
    sinks = torch.tensor([0.5, 3.0, -1.0, 9.0])
    _, lse = attention_reference(query, key, value, context_len=4, scale=0.3, sinks=sinks, return_lse=True)
    for head in range(4):
        logits = (query[:, head] @ key[:, head // 2].T) * 0.3
        visible = torch.arange(7)[None, :] <= 4 + torch.arange(3)[:, None]
        total = torch.exp(logits).masked_fill(~visible, 0).sum(-1) + torch.exp(sinks[head].double())
        torch.testing.assert_close(lse[:, head], total.log())


@pytest.mark.parametrize(
    "case_text",
    [
        SINKS,
        "gqa-h8/2-d64-bf16-fp8e4m3-outliers-lse:30+4,0+20",
        "mla-h4-d32+8-fp16-p16-lse:30+4,17+1",
        "mha-h4-d192/128-bf16-p64-scale0.13524-lse:30+4,0+40,0+0",
    ],
)
def test_torch_naive_returns_the_lse_on_every_path(case_text):
    assert parse_case(case_text).lse
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS and result.metrics["lse_max_abs_error"] < 1e-3, result.reason


@pytest.mark.parametrize("defect", [lse_defects.LseInBaseTwo, lse_defects.LseWithoutTheSink])
def test_planted_lse_slips_fail_numerics(defect):
    result = judge(NumericsCheck(), defect, parse_case(SINKS), CPU)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("lse:"), result.reason


# The standard suite's lse cases of a group of 8 (Llama-3-70B) and of 16 (Qwen3-235B-A22B at TP 2):
# decode, verify and prefill rows in one batch each.
GROUPS = ("gqa-h64/8-d128-bf16-p16-lse:0+24,70+8,300+1x2", "gqa-h32/2-d128-bf16-p16-lse:0+24,70+8,300+1x2")


@pytest.mark.parametrize("case_text", GROUPS)
@pytest.mark.parametrize(
    "defect", [lse_defects.LsePerKVHead, lse_defects.LseOfGroupsFirstHead, lse_defects.LseWrittenAtKVHeadSlot]
)
def test_an_lse_kept_per_kv_head_fails_numerics_by_ten_times_the_tolerance(defect, case_text):
    from conformance.cases.suites import suite

    case = parse_case(case_text)
    assert case in suite("standard") and case.spec.query_group_size in (8, 16)
    result = judge(NumericsCheck(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("lse:"), result.reason
    assert result.metrics["lse_tolerance_ratio"] >= 10, result.metrics


@pytest.mark.parametrize("case_text", GROUPS)
def test_torch_naive_passes_the_group_cases(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS and result.metrics["lse_tolerance_ratio"] < 1, result.reason


def test_an_lse_case_is_skipped_by_a_backend_that_returns_none_and_only_asks_where_it_says_so():
    from tests.planted.fp8_defects import DropsScaleOnDecode

    naive = TorchNaiveBackend.capabilities
    no_lse = type(
        "NoLse",
        (TorchNaiveBackend,),
        {"capabilities": __import__("dataclasses").replace(naive, features=naive.features - {LSE})},
    )
    assert (
        NumericsCheck()
        .case_skip_reason(no_lse, parse_case(SINKS), CPU)
        .startswith("the log-sum-exp (the case hands forward an lse buffer) not supported")
    )
    assert NumericsCheck().case_skip_reason(TorchNaiveBackend, parse_case(SINKS), CPU) is None
    # Without the attribute forward is never handed an lse buffer: a subclass whose forward does
    # not take one (most planted defects) still runs every other case.
    assert not parse_case("gqa-h8/2-d64-bf16-fp8e4m3:30+4").lse
    result = judge(NumericsCheck(), DropsScaleOnDecode, parse_case("gqa-h8/2-d64-bf16-fp8e4m3:30+4,0+20"), CPU)
    assert result.verdict == Verdict.PASS, result.reason  # no decode rows: its bug does not show, and no lse is asked


def test_the_step_merged_from_its_two_pieces_by_their_lses_equals_the_oracle_and_a_base_two_lse_breaks_it():
    """vLLM's MLA prefill with context: the context piece (null keys) and the new-token piece,
    joined by merge_attn_states' rule; called on its own, the merge catches an LSE in base 2 too."""
    from conformance.harness.lse_merge import merge_applies, merge_findings
    from conformance.harness.step import prepare_case, run_step

    for backend, caught in ((TorchNaiveBackend, False), (lse_defects.LseInBaseTwo, True)):
        prepared = prepare_case(backend, parse_case("mha-h16-d192/128-bf16-p64-scale0.13524-lse:200+64,0+100"), CPU)
        run_step(prepared)
        assert merge_applies(prepared)
        problem, metrics = merge_findings(prepared)
        assert (problem is not None) == caught, problem
    assert not merge_applies(prepare_case(TorchNaiveBackend, parse_case(SINKS), CPU))  # a sink would count twice


def test_an_fp8_layers_lse_is_judged_with_the_dequantization_allowance_and_still_fails_defects():
    """``lse_pass.lse_allowed``, shared by every pass that judges an LSE, adds an fp8 layer's
    rounding allowance: torch_naive passes an fp8 lse case; the LSE defects still fail it by far."""
    import torch

    from backends.torch_naive import TorchNaiveBackend
    from conformance.cases.grammar import parse_case
    from conformance.checks.numerics import NumericsCheck
    from conformance.results import Verdict
    from tests.planted.lse_defects import LseInBaseTwo, LsePerKVHead

    case = parse_case("gqa-h8/2-d64-bf16-fp8e4m3-p16-lse:30+1,20+4,0+9")
    cpu = torch.device("cpu")
    assert judge(NumericsCheck(), TorchNaiveBackend, case, cpu).verdict == Verdict.PASS
    for defect in (LseInBaseTwo, LsePerKVHead):
        result = judge(NumericsCheck(), defect, case, cpu)
        assert result.verdict == Verdict.FAIL and result.metrics["lse_tolerance_ratio"] >= 10, result.reason
