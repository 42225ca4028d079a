"""Decode context parallelism on a GPU: triton's kernels (a row with no key on its rank through
the split kernel and the split merge: output 0, LSE -inf) pass the DCP pass of numerics and the
DCP draft loop under graphs and the engine with every layer sharded, and the planted empty-rank
and draft-update defects fail."""

from __future__ import annotations

import pytest
import torch

from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import dcp_defects

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [
    "gqa-h32/8-d128-bf16-p16-dcp4:1+1,2+1,4+1,500+1",
    "gqa-h32/8-d128-bf16-p16-dcp8:3000+1,1+1",  # one long request: several splits, and empty rows merged
    "gqa-h32/8-d128-bf16-fp8e4m3-qfp8-p16-dcp2:2000+1,0+1",
]


@pytest.mark.parametrize("text", CASES)
def test_triton_passes_dcp(text):
    result = judge(NumericsCheck(), TritonAttentionBackend, parse_case(text), torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["dcp_empty_rank_rows"] > 0


@pytest.mark.parametrize("defect", [dcp_defects.EmptyRankLseZero, dcp_defects.ClampsEmptyRankRowToOneKey])
def test_planted_empty_rank_defects_fail_on_a_gpu(defect):
    result = judge(NumericsCheck(), defect, parse_case(CASES[0]), torch.device("cuda"))
    assert result.verdict == Verdict.FAIL and "holds no key" in result.reason, result.reason


@pytest.mark.parametrize("text", CASES[:2])
def test_triton_passes_the_dcp_draft_loop_under_graphs(text):
    """One graph a rank, replayed after update_for_draft_step with each rank's lengths advanced by
    its own pattern."""
    from conformance.checks.draft_loop import DraftLoopCheck

    result = judge(DraftLoopCheck(), TritonAttentionBackend, parse_case(text), torch.device("cuda"))
    assert result.verdict == Verdict.PASS and "one graph a rank" in result.reason, result.reason


def test_triton_advancing_every_ranks_lengths_fails_the_dcp_draft_loop_under_graphs():
    from conformance.checks.draft_loop import DraftLoopCheck

    result = judge(
        DraftLoopCheck(),
        dcp_defects.triton_advances_every_rank_each_draft_step(),
        parse_case(CASES[0]),
        torch.device("cuda"),
    )
    assert result.verdict == Verdict.FAIL and result.reason.startswith("DCP draft step 2 of 4"), result.reason


ENGINE_CASE = "gqa-h32/8-d128-bf16-p16-dcp8:3000+1,1+1"


def test_the_engine_runs_triton_under_dcp_with_graphs_and_no_sync():
    """Every layer over 8 ranks: graphs replayed over the ranks' persistent batches, the draft loop
    in one graph through each rank's update_for_draft_step, 0 syncs a steady step."""
    from conformance.checks.engine import EngineCheck

    result = judge(EngineCheck(), TritonAttentionBackend, parse_case(ENGINE_CASE), torch.device("cuda"))
    assert result.verdict == Verdict.PASS and "over 8 DCP ranks" in result.reason, result.reason
    assert result.metrics["host_syncs_per_steady_step"] == 0


def test_triton_advancing_every_ranks_lengths_fails_the_engine_under_dcp():
    from conformance.checks.engine import EngineCheck

    defect = dcp_defects.triton_advances_every_rank_each_draft_step()
    result = judge(EngineCheck(), defect, parse_case(ENGINE_CASE), torch.device("cuda"))
    # It fails in the runs that draft through the backend, where its update runs (on an H200: the
    # drafting run under graphs emitted other tokens, its verify graph reading the lengths build
    # replaced), not in the plain or scripted runs.
    assert result.verdict == Verdict.FAIL and result.reason.startswith("layer-skip drafting"), result.reason
