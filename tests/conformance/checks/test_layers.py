"""Every pass that runs more than one layer over one step's metadata gives each layer its own
pool, fp8 scales and learned sinks: numerics' second layer (CPU), the draft loop's layers (run
eagerly here; under CUDA graphs in ``test_graphs_gpu``), and the LSE judged wherever it is asked."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.case_data import sink_logits
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.harness.comparison import TOLERANCES
from conformance.harness.draft_loop import DraftLoop
from conformance.harness.graphs import STEP_LAYERS
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import fp8_defects, layer_defects, lse_defects

CPU = torch.device("cpu")
SINKS = "gqa-h8/2-d32-bf16-p16-attnsinks:30+1,20+4,0+9"
FP8 = "gqa-h8/2-d32-bf16-fp8e4m3-p16:30+1,20+4,0+9"


def test_a_later_layers_sinks_are_its_own_and_every_large_one_moved():
    case = parse_case(SINKS)
    first, second = sink_logits(case.spec), sink_logits(case.spec, 1)
    assert torch.equal(second, first.roll(1))
    large = first >= 8
    assert large.any() and not (second[large] >= 8).any()  # no large sink stays on its head


@pytest.mark.parametrize(
    "defect,case_text",
    [
        (layer_defects.StashesSinksInMetadata, SINKS),
        (layer_defects.KeepsFirstLayerSinks, SINKS),
        (fp8_defects.KeepsFirstLayerScales, FP8),
    ],
    ids=lambda value: getattr(value, "__name__", "case"),
)
def test_state_kept_from_the_first_layer_fails_numerics_second_layer_by_a_wide_margin(defect, case_text):
    case = parse_case(case_text)
    assert judge(NumericsCheck(), TorchNaiveBackend, case, CPU).verdict == Verdict.PASS
    result = judge(NumericsCheck(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("a second layer"), result.reason
    assert result.metrics["second layer tolerance_ratio"] >= 10, result.metrics


def eager_loop(backend_cls, case_text: str, steps: int = 3) -> DraftLoop:
    """The draft loop's steps run eagerly (build per step), every layer: what its graphs replay."""
    loop = DraftLoop(backend_cls, parse_case(case_text), steps, CPU, layers=STEP_LAYERS)
    backend = loop.buffers.backend
    loop.restart()
    for step in range(steps):
        loop.advance()
        loop.buffers.step(backend.build(loop.common(step)))
        loop.finish_step()
    return loop


DECODE_SINKS = "gqa-h8/2-d32-bf16-p16-attnsinks:30+1,20+1"


def test_the_draft_loop_runs_two_layers_each_its_own():
    loop = eager_loop(TorchNaiveBackend, DECODE_SINKS)
    assert len(loop.banks) == 2 and loop.first_failing_step(*TOLERANCES[torch.bfloat16]) == (None, {})
    failing, details = eager_loop(layer_defects.KeepsFirstLayerSinks, DECODE_SINKS).first_failing_step(
        *TOLERANCES[torch.bfloat16]
    )
    assert failing == 0 and details["layer"] == 1
    failing, details = eager_loop(
        fp8_defects.KeepsFirstLayerScales, "gqa-h8/2-d32-bf16-fp8e4m3-p16:30+1,20+1"
    ).first_failing_step(*TOLERANCES[torch.bfloat16])
    assert failing == 0 and details["layer"] == 1


def test_the_draft_loops_padding_row_holds_nan_and_huge_queries_in_every_layer():
    """The padding row an engine's draft graph carries holds whatever earlier steps left there."""
    loop = eager_loop(TorchNaiveBackend, DECODE_SINKS)
    for layer in loop.buffers.layers:
        rows = layer.query[loop.num_real :].float()
        assert len(rows) and (rows.isnan() | (rows.abs() > 1e30)).all()
    assert not loop.buffers.layers[0].query[: loop.num_real].isnan().any()


def test_the_draft_loop_judges_every_layers_lse():
    decode_lse = "gqa-h8/2-d32-bf16-p16-attnsinks-lse:30+1,20+1"
    assert eager_loop(TorchNaiveBackend, decode_lse).lse_problem() is None
    problem = eager_loop(lse_defects.LseInBaseTwo, decode_lse).lse_problem()
    assert problem is not None and problem.startswith("layer 0: lse:"), problem
