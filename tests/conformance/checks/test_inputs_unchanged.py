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
from conformance.run.execution import judge
from tests.planted import input_defects

CPU = torch.device("cpu")
CASE = parse_case("gqa-h4/2-d32-fp32-p16:10+4,0+6,30+1")
DEFECTS = [
    (input_defects.ScalesQueryInPlace, "forward changed query (first at [0, 0, 0]"),
    (input_defects.TurnsSeqLensIntoContextLens, "build changed seq_lens (first at [0]: 14 → 10)"),
    (input_defects.ZeroesTheWholeOutput, "forward wrote 3 output rows past the step's 11 real tokens"),
    (input_defects.WritesOutsideItsBlocks, "forward changed the KV pool outside the blocks the step writes"),
]
# The layer's own parameters: learned sinks, an fp8 layer's device scales (their host floats are
# what torch_naive dequantizes with, so its output stays right).
LAYER_DEFECTS = [
    (input_defects.ClampsSinksInPlace, "gqa-h4/2-d32-fp32-p16-attnsinks:10+4,0+6,30+1", "forward changed sinks"),
    (
        input_defects.RescalesFp8ScalesInPlace,
        "gqa-h4/2-d32-bf16-fp8e4m3-p16:10+4,0+6,30+1",
        "forward changed scales.k_scale_tensor (first at [0]: 0.1 → 0.3); forward changed scales.v_scale_tensor",
    ),
]


@pytest.mark.parametrize("defect,reason", DEFECTS)
@pytest.mark.parametrize("check", [NumericsCheck, DeterminismCheck])
def test_a_changed_input_or_a_written_padding_row_fails_every_check(defect, reason, check):
    assert judge(check(), TorchNaiveBackend, CASE, CPU).verdict == Verdict.PASS
    result = judge(check(), defect, CASE, CPU)
    assert result.verdict == Verdict.FAIL and reason in result.reason, result.reason


@pytest.mark.parametrize("defect,case_text,reason", LAYER_DEFECTS)
@pytest.mark.parametrize("check", [NumericsCheck, DeterminismCheck])
def test_a_layer_input_changed_in_place_fails_and_the_oracle_keeps_its_own(defect, case_text, reason, check):
    case = parse_case(case_text)
    assert judge(check(), TorchNaiveBackend, case, CPU).verdict == Verdict.PASS
    result = judge(check(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL and reason in result.reason, result.reason


def test_the_oracle_reads_the_harness_copies_of_sinks_and_scales():
    # What the backend is handed is a copy: changing it leaves the layer's own (the oracle's) as drawn.
    from conformance.harness.step import prepare_case

    for case_text in ("gqa-h4/2-d32-fp32-p16-attnsinks:30+1", "gqa-h4/2-d32-bf16-fp8e4m3-p16:30+1"):
        prepared = prepare_case(TorchNaiveBackend, parse_case(case_text), CPU)
        handed = prepared.forward_layer
        if handed.sinks is not None:
            handed.sinks.zero_()
            assert prepared.batch.sinks.abs().sum() > 0
        if handed.scales is not None:
            handed.scales.k_scale_tensor.zero_()
            assert float(prepared.scales.k_scale_tensor) == pytest.approx(0.1) and prepared.scales.k_scale == 0.1


def test_the_watch_reads_host_numbers_inside_the_layer_parameters_and_the_pool_outside_the_written_blocks():
    from backends.base import Fp8Scales, LayerParameters
    from conformance.harness.input_watch import PoolWatch

    scales = Fp8Scales(2.0, 4.0, torch.ones(1), torch.ones(1))
    lse = torch.zeros(3, 2)
    layer = LayerParameters(scales=scales, sinks=torch.ones(3), lse=lse)
    watch = InputWatch.of({}, layers={"": layer, " (layer 1)": LayerParameters(sinks=torch.ones(3))})
    object.__setattr__(scales, "k_scale", 3.0)  # frozen, as a backend would have to get around
    layer.sinks[1] = 5.0
    lse.fill_(1.0)  # forward's output: written, not watched
    watch.called("forward")
    changes = watch.changes()
    assert "the step's calls changed scales.k_scale (2.0 → 3.0)" in changes
    assert any(change.startswith("forward changed sinks (first at [1]: 1 → 5)") for change in changes)
    assert len(changes) == 2, changes

    pool = torch.zeros(6, 4, 2)  # 6 blocks of 4 slots
    slots = torch.tensor([9, -1])  # the step writes slot 9 (block 2); -1 is a padding row
    watch = InputWatch.of({}, pools={"KV pool": PoolWatch.of(pool, 6, 4, slots)})
    pool[2, 1] = 1.0  # its own block: the NaN-poison pass's business, not the watch's
    watch.called("write_kv")
    assert watch.changes() == []
    pool[5, 3, 1] = 1.0
    watch.called("forward")
    assert watch.changes() == ["forward changed the KV pool outside the blocks the step writes (1 block(s): 5)"]


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


def test_a_never_written_pool_is_not_digested():
    """The memory check's pool is never written outside the history (``PoolFill.FRESH``): a digest
    of it would read every unowned slot, which compute-sanitizer's initcheck reports as the
    backend's read of uninitialized memory (seen on an H200 as the harness's own reads)."""
    from conformance.harness.step import PoolFill, launch_step, prepare_case, stage_step

    case = parse_case("mla-h4-d32+16-bf16-p16:40+1,9+2")
    for fill, watched in ((PoolFill.FRESH, False), (PoolFill.LOUD, True)):
        step = stage_step(prepare_case(TorchNaiveBackend, case, torch.device("cpu"), fill=fill))
        launch_step(step)
        assert bool(step.watch.pools) == watched
