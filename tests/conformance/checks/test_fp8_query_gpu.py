"""The fp8 query on a GPU: triton's kernels (the query's scale read on the device) pass numerics,
syncs, graphs and the draft loop over fp8-query cases, and fail numerics handed a scale of 1; a
graph-safe backend reading the scale on the host fails syncs where its control passes."""

from __future__ import annotations

import pytest
import torch

from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.syncs import SyncsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.fp8_query_defects import ReadsQScaleOnTheHost, triton_q_scale_dropped
from tests.planted.graph_backends import TorchGraphSafe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [
    "gqa-h32/8-d128-bf16-qfp8-p16:0+200,700+64,3000+1x2,50+4",
    "gqa-h32/8-d128-bf16-fp8e4m3-qfp8-p16:1+1,500+1,2000+1",
    "gqa-h64/8-d64-bf16-qfp8-p16-attnsinks-lse:0+64,300+4,1000+1",
]


@pytest.mark.parametrize("text", CASES)
def test_triton_passes_and_fails_with_its_query_scale_dropped(text):
    cuda, case = torch.device("cuda"), parse_case(text)
    for check in (NumericsCheck(), SyncsCheck()):
        result = judge(check, TritonAttentionBackend, case, cuda)
        assert result.verdict == Verdict.PASS, (check.name, result.reason)
    dropped = judge(NumericsCheck(), triton_q_scale_dropped(), case, cuda)
    assert dropped.verdict == Verdict.FAIL and dropped.metrics["tolerance_ratio"] > 5, dropped.reason


@pytest.mark.parametrize("check", [GraphsCheck(), DraftLoopCheck()])
def test_triton_replays_an_fp8_query_with_each_layers_scale(check):
    result = judge(
        check,
        TritonAttentionBackend,
        parse_case("gqa-h32/8-d128-bf16-qfp8-p16:1+1,100+1,1000+1,3000+1"),
        torch.device("cuda"),
    )
    assert result.verdict == Verdict.PASS, result.reason


def test_a_query_scale_read_on_the_host_fails_syncs():
    cuda, case = torch.device("cuda"), parse_case("gqa-h8/2-d64-fp16-qfp8-p16:100+1,30+1")
    assert judge(SyncsCheck(), TorchGraphSafe, case, cuda).verdict == Verdict.PASS
    result = judge(SyncsCheck(), ReadsQScaleOnTheHost, case, cuda)
    assert result.verdict == Verdict.FAIL and "device_query" in str(result.evidence), result.reason
