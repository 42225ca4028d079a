"""On a GPU: graphs and the draft loop capture two layers over one metadata, each with its own
pool, fp8 scales and learned sinks, and judge the LSE on every replay; syncs watches the steps
right after the batch changed. Each planted defect fails where a single layer, an eager LSE or a
fixed batch let it pass."""

import pytest
import torch

from conformance.cases.grammar import parse_case
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.syncs import SyncsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import layer_defects
from tests.planted.graph_backends import TorchGraphSafe

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SINKS_LSE = {
    "decode": parse_case("gqa-h8/2-d64-bf16-p16-attnsinks-lse:100+1,30+1,250+1"),
    "verify": parse_case("gqa-h8/2-d64-bf16-p16-attnsinks-lse:100+4,30+4"),
}
FP8_DECODE = parse_case("gqa-h8/2-d64-bf16-fp8e4m3-p16:100+1,30+1,250+1")


@pytest.mark.parametrize("name", list(SINKS_LSE))
def test_a_correct_graph_safe_backend_passes_two_layers_and_the_lse(name):
    case = SINKS_LSE[name]
    for check in (GraphsCheck(), DraftLoopCheck()):
        if name == "verify" and isinstance(check, DraftLoopCheck):
            continue
        result = judge(check, layer_defects.GraphSafeWithSinksAndLse, case, CUDA)
        assert result.verdict == Verdict.PASS, (check.name, result.reason)
    assert judge(GraphsCheck(), TorchGraphSafe, FP8_DECODE, CUDA).verdict == Verdict.PASS


def test_sinks_kept_from_the_first_layer_fail_the_graphs_second_layer():
    case = SINKS_LSE["decode"]
    result = judge(GraphsCheck(), layer_defects.GraphSafeKeepsFirstSinks, case, CUDA)
    assert result.verdict == Verdict.FAIL and "layer 1 (its own pool, scales and sinks)" in result.reason, result.reason
    assert result.metrics["tolerance_ratio"] >= 10
    result = judge(DraftLoopCheck(), layer_defects.GraphSafeKeepsFirstSinks, case, CUDA)
    assert result.verdict == Verdict.FAIL and "(layer 1" in result.reason, result.reason


def test_scales_kept_from_the_first_layer_fail_under_graphs_and_eagerly():
    defect = layer_defects.KeepsFirstScalesOnDevice
    result = judge(GraphsCheck(), defect, FP8_DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "layer 1" in result.reason, result.reason
    assert result.metrics["tolerance_ratio"] >= 10
    assert judge(DraftLoopCheck(), defect, FP8_DECODE, CUDA).verdict == Verdict.FAIL
    assert judge(NumericsCheck(), defect, FP8_DECODE, CUDA).verdict == Verdict.FAIL


def test_an_lse_written_only_eagerly_fails_under_graphs_and_passes_numerics():
    defect = layer_defects.LseOnlyEager
    case = SINKS_LSE["decode"]
    assert judge(NumericsCheck(), defect, case, CUDA).verdict == Verdict.PASS
    result = judge(GraphsCheck(), defect, case, CUDA)
    assert result.verdict == Verdict.FAIL and "lse:" in result.reason and "NaN before the replay" in result.reason, (
        result.reason
    )
    result = judge(DraftLoopCheck(), defect, case, CUDA)
    assert result.verdict == Verdict.FAIL and "the LSE of the draft steps" in result.reason, result.reason


def test_a_sync_only_when_the_batch_changes_fails_syncs():
    from tests.planted.steady_defects import SyncsWhenBatchChanges

    case = parse_case("gqa-h8/2-d64-bf16-p16:100+1,30+4,250+1")
    result = judge(SyncsCheck(), SyncsWhenBatchChanges, case, CUDA)
    assert result.verdict == Verdict.FAIL and "after its last request left" in result.reason, result.reason
    assert judge(SyncsCheck(), TorchGraphSafe, case, CUDA).verdict == Verdict.PASS
    alone = parse_case("gqa-h8/2-d64-bf16-p16:100+1")  # nothing to drop: its step alone, which it passes
    assert judge(SyncsCheck(), SyncsWhenBatchChanges, alone, CUDA).verdict == Verdict.PASS
