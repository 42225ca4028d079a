"""The lightning indexer through the checks that drive steps, on a GPU: triton_indexer passes
graphs, the draft loop, the steady look, syncs, determinism and the engine; four planted
triton_indexer defects that choose right in one eager step (the indexer check passes them) each
fail the one check built to see them."""

import pytest
import torch

from backends.torch_indexer import TorchIndexerBackend
from conformance.cases.grammar import parse_case
from conformance.checks import make_check
from conformance.checks.indexer import IndexerCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import indexer_defects

pytestmark = pytest.mark.gpu

MIXED = "indexer-h16-d64-fp8e4m3-p16-topk32:100+1,60+4,0+40"
DECODE = "indexer-h16-d64-fp8e4m3-p16-topk32:300+1,100+1,60+1"


def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("check", ["graphs", "draft-loop", "steady", "syncs", "determinism", "engine", "indexer"])
def test_triton_indexer_passes_every_check_that_judges_an_indexer(check):
    from backends.triton.indexer import TritonIndexerBackend

    for text in (MIXED, DECODE):
        case = parse_case(text)
        checker = make_check(check)
        reason = checker.case_skip_reason(TritonIndexerBackend, case, cuda())
        if reason:
            assert check in ("draft-loop", "steady") and text == MIXED, reason  # they start from decodes
            continue
        result = judge(checker, TritonIndexerBackend, case, cuda())
        assert result.verdict == Verdict.PASS, (text, result.reason)


def test_torch_indexer_is_refused_graphs_with_the_reason():
    reason = make_check("graphs").case_skip_reason(TorchIndexerBackend, parse_case(MIXED), cuda())
    assert reason and "graph" in reason.lower()


@pytest.mark.parametrize(
    "defect,check,case_text",
    [
        (indexer_defects.StaleIndexerPositionsInDraftSteps, "draft-loop", DECODE),
        (indexer_defects.WeightsKeptFromCapture, "graphs", MIXED),
        (indexer_defects.LongestSequenceOnTheHost, "syncs", MIXED),
        (indexer_defects.RequestsPlacedOncePerBatchSize, "steady", DECODE),
    ],
)
def test_a_defect_one_eager_step_cannot_show_fails_its_check(defect, check, case_text):
    case = parse_case(case_text)
    assert judge(IndexerCheck(), defect, case, cuda()).verdict == Verdict.PASS  # right in one eager step
    result = judge(make_check(check), defect, case, cuda())
    assert result.verdict == Verdict.FAIL, result.reason
