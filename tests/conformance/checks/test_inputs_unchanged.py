"""Inputs come back as they went in, and output rows past the real tokens stay untouched: each
planted backend is right on its own output and fails for what it changed, in every check."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.checks.determinism import DeterminismCheck
from conformance.checks.numerics import NumericsCheck
from conformance.harness.input_watch import InputWatch
from conformance.results import Verdict
from tests.planted import input_defects

CPU = torch.device("cpu")
CASE = parse_case("gqa-h4/2-d32-fp32-p16:10+4,0+6,30+1")
DEFECTS = [
    (input_defects.ScalesQueryInPlace, "forward changed query (first at [0, 0, 0]"),
    (input_defects.TurnsSeqLensIntoContextLens, "build changed seq_lens (first at [0]: 14 → 10)"),
    (input_defects.ZeroesTheWholeOutput, "forward wrote 3 output rows past the step's 11 real tokens"),
]


@pytest.mark.parametrize("defect,reason", DEFECTS)
@pytest.mark.parametrize("check", [NumericsCheck, DeterminismCheck])
def test_a_changed_input_or_a_written_padding_row_fails_every_check(defect, reason, check):
    assert check().run(TorchNaiveBackend, CASE, CPU).verdict == Verdict.PASS
    result = check().run(defect, CASE, CPU)
    assert result.verdict == Verdict.FAIL and reason in result.reason, result.reason


def test_the_watch_sees_changes_swaps_and_shifts_but_not_a_rewrite_of_the_same_bits():
    for change in (
        lambda t: t[3].add_(1),
        lambda t: t.index_copy_(0, torch.tensor([1, 2]), t[[2, 1]]),
        lambda t: t.copy_(t.roll(1)),
    ):
        tensor = torch.arange(8.0)
        watch = InputWatch.of({"x": tensor})
        change(tensor)
        watch.called("forward")
        assert watch.changes() and watch.changes()[0].startswith("forward changed x")
    tensor = torch.arange(8.0)
    watch = InputWatch.of({"x": tensor, "absent": None})
    tensor.copy_(tensor.clone())
    watch.called("forward")
    assert watch.changes() == []
