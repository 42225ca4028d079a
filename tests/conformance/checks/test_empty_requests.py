"""vLLM's empty padding requests (``0+0``): the grammar, the block-table rows, who may run them,
torch_naive against the oracle, and the planted empty-request defects each failing numerics."""

import pytest
import torch

from backends.base import PaddingStyle
from backends.features import EMPTY_REQUESTS
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.suites import suite
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import padding_defects
from tests.planted.graph_backends import TorchGraphSafe

CPU = torch.device("cpu")
AT_THE_END = "gqa-h8/2-d64-bf16:30+1,500+1,0+0x3"
IN_BETWEEN = "gqa-h8/2-d64-bf16:0+0,40+4,0+0,0+30"


def test_an_empty_request_is_0_plus_0_and_its_block_table_row_is_minus_one():
    case = parse_case(IN_BETWEEN)
    assert case.empty_requests == 2 and parse_case(case.id) == case
    batch = materialize(case, CPU)
    assert (batch.block_table[[0, 2]] == -1).all() and (batch.block_table[[1, 3]] > 0).any(dim=1).all()
    common = batch.common_metadata()
    assert common.query_start_loc.tolist() == [0, 0, 4, 4, 34] and common.seq_lens.tolist() == [0, 44, 0, 30]
    assert batch.reference_output().shape[0] == 34
    for bad, message in (("gqa:30+0,1+1", "or 0\\+0"), ("gqa:0+0x2", "not empty")):
        with pytest.raises(CaseSyntaxError, match=message):
            parse_case(bad)


def test_only_a_backend_claiming_empty_requests_runs_them():
    check = NumericsCheck()
    case = parse_case(AT_THE_END)
    reason = TorchGraphSafe.capabilities.feature_reason(case.needs, CPU)  # a CUDA backend: its features alone
    assert reason.startswith("empty requests (query length 0, vLLM's graph padding) not supported"), reason
    assert TorchGraphSafe.capabilities.graph_padding == PaddingStyle.ROWS
    assert TorchNaiveBackend.capabilities.supports(EMPTY_REQUESTS)
    assert check.case_skip_reason(TorchNaiveBackend, parse_case(AT_THE_END), CPU) is None
    assert any(case.empty_requests for case in suite("standard") if case.spec.kind == "mla")
    assert any(case.empty_requests and case.batch[0] == (0, 0) for case in suite("standard"))


@pytest.mark.parametrize("case_text", [AT_THE_END, IN_BETWEEN, "mla-h4-d32+8-bf16-p16:0+0,30+4,17+1,0+0"])
def test_torch_naive_leaves_every_real_row_exact_around_empty_requests(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    "defect",
    [
        padding_defects.WritesLastTokenOfEachRequest,
        padding_defects.EmptyRequestWritesNaN,
        padding_defects.ReadsBlockMinusOne,
    ],
)
@pytest.mark.parametrize("case_text", [AT_THE_END, IN_BETWEEN])
def test_planted_empty_request_defects_fail_numerics(defect, case_text):
    result = judge(NumericsCheck(), defect, parse_case(case_text), CPU)
    assert result.verdict == Verdict.FAIL, result.reason
