"""graphs and draft-loop on a real GPU: a graph-safe backend passes; each planted defect fails
for its own reason."""

import subprocess
import sys

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.checks.determinism import DeterminismCheck
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.engine import EngineCheck
from conformance.checks.graphs import GraphsCheck
from conformance.results import RunResult, Verdict
from conformance.run.execution import judge
from tests.planted import graph_backends as planted

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DECODE = parse_case("gqa-h8/2-d64-fp16-p16:100+1,30+1,250+1")
VERIFY = parse_case("gqa-h8/2-d64-fp16-p16:100+4,30+4")
MIXED = parse_case("gqa-h8/2-d64-fp16-p16:0+40,100+4,30+1")


def marker_line(text: str) -> int:
    with open(planted.__file__.removesuffix("c")) as source:
        return next(number for number, line in enumerate(source, 1) if text in line)


@pytest.mark.parametrize("case", [DECODE, VERIFY, MIXED], ids=["decode", "verify", "mixed"])
def test_graph_safe_backend_passes(case):
    result = judge(GraphsCheck(), planted.TorchGraphSafe, case, CUDA)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["replays"] >= 4 and result.metrics["graph_pool_bytes"] > 0


def test_graph_safe_backend_passes_the_draft_loop():
    result = judge(DraftLoopCheck(), planted.TorchGraphSafe, DECODE, CUDA)
    assert result.verdict == Verdict.PASS, result.reason and "one graph" in result.reason


def test_baked_max_seq_len_fails_on_longer_contexts():
    result = judge(GraphsCheck(), planted.BakesMaxSeqLen, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "longer contexts" in result.reason, result.reason


def test_a_masked_read_only_under_capture_fails_the_nan_replays_and_the_nan_draft_loop():
    from conformance.checks.numerics import NumericsCheck

    defect = planted.MasksOnlyScoresUnderCapture
    assert judge(NumericsCheck(), defect, DECODE, CUDA).verdict == Verdict.PASS  # eager, it reads exactly
    result = judge(GraphsCheck(), defect, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "B1" in result.reason and "NaN in every unowned slot" in result.reason, (
        result.reason
    )
    result = judge(DraftLoopCheck(), defect, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "k=7" in result.reason and "NaN in every unowned slot" in result.reason, (
        result.reason
    )


def test_host_lengths_in_forward_fail_capture_naming_the_sync():
    result = judge(GraphsCheck(), planted.HostLengthsInForward, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "capture" in result.reason and "failed" in result.reason, result.reason
    assert f"graph_backends.py:{marker_line('metadata.seq_lens.max().item()')}" in result.reason


def test_stale_draft_positions_fail_at_step_two_or_later():
    result = judge(DraftLoopCheck(), planted.StaleDraftPositions, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.metrics["first_failing_step"] >= 2


def test_a_block_table_packed_in_build_fails_the_replays_with_new_block_tables():
    from conformance.checks.numerics import NumericsCheck

    defect = planted.PacksBlockTableInBuild
    strided = parse_case("gqa-h8/2-d64-fp16-p16-strided:100+1,30+1,250+1")
    assert judge(NumericsCheck(), defect, strided, CUDA).verdict == Verdict.PASS  # eagerly the copy is fresh
    result = judge(GraphsCheck(), defect, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "B1" in result.reason, result.reason


def test_padding_written_into_block_zero_is_caught_by_cache_isolation():
    # The replay's input watch sees it first (the pool outside the step's blocks), naming block 0.
    result = judge(GraphsCheck(), planted.WritesPaddingIntoBlockZero, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "the replay changed the KV pool outside the blocks the step writes (1 block(s): 0)" in result.reason


def test_a_query_scale_over_the_steps_tokens_fails_over_the_padding_requests_rows():
    from conformance.checks.numerics import NumericsCheck

    defect = planted.ScalesQueryOverTheStepsTokens
    assert judge(NumericsCheck(), defect, DECODE, CUDA).verdict == Verdict.PASS  # eager: its rows are the real ones
    result = judge(GraphsCheck(), defect, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "differs from the oracle" in result.reason, result.reason
    result = judge(DraftLoopCheck(), defect, DECODE, CUDA)  # its padding row is a request too
    assert result.verdict == Verdict.FAIL and "differs from the oracle" in result.reason, result.reason


def test_torch_naive_is_skipped():
    for check in (GraphsCheck(), DraftLoopCheck()):
        assert check.skip_reason(TorchNaiveBackend, CUDA) == "claims cuda_graphs=NEVER" or "NEVER" in check.skip_reason(
            TorchNaiveBackend, CUDA
        )


def test_flashinfer_graph_below_max_num_reqs_needs_its_own_wrapper(tmp_path):
    pytest.importorskip("flashinfer")
    from backends.flashinfer.gqa import FlashInferBackend

    case = parse_case("gqa-h32/8-d128-bf16-p16:100+1,30+1,250+1")
    assert judge(GraphsCheck(), FlashInferBackend, case, CUDA).verdict == Verdict.PASS
    # Its replays read freed plan buffers: wrong values or an illegal address, which would poison
    # this test process's CUDA context; so it runs isolated, as `conformance run` runs it.
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "run",
            "--backend",
            "tests.planted.graph_backends:FlashInferOneGraphWrapper",
            "--check",
            "graphs",
            "--case",
            case.id,
            "--device",
            "cuda",
            "--json",
            str(tmp_path / "r.json"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 1, completed.stderr[-2000:]
    result = RunResult.load(tmp_path / "r.json").backends[0].checks[0].cases[0]
    assert result.verdict == Verdict.CRASH or "differs from the oracle" in result.reason, result.reason


def test_forgotten_last_row_in_draft_update_fails_once_the_last_row_is_real():
    result = judge(DraftLoopCheck(), planted.ForgetsLastRowInDraftUpdate, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "no padding row" in result.reason and "request 2" in result.reason, result.reason


def test_workspace_grown_at_a_new_shape_fails_the_replay_after_it():
    result = judge(GraphsCheck(), planted.GrowsWorkspaceAtNewShape, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "after an eager step at a larger shape" in result.reason, result.reason


def test_autotuning_on_the_first_call_fails_the_first_call_capture_naming_the_sync():
    result = judge(GraphsCheck(), planted.AutotunesOnFirstCall, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.reason.startswith("capture as the backend's first call failed"), result.reason
    assert f"graph_backends.py:{marker_line('end.synchronize()')}" in result.reason, result.reason


def test_nondeterministic_replays_fail_when_determinism_is_claimed():
    case = parse_case("gqa-h8/2-d64-fp32-p16:100+1,30+1,250+1")
    result = judge(GraphsCheck(), planted.NondeterministicReplays, case, CUDA)
    assert result.verdict == Verdict.FAIL and "claims deterministic" in result.reason, result.reason
    # Unclaimed, the same measurement is information.
    assert judge(GraphsCheck(), planted.TorchGraphSafe, case, CUDA).verdict == Verdict.PASS
    assert judge(DeterminismCheck(), planted.NondeterministicReplays, case, CUDA).verdict == Verdict.FAIL


def test_engine_drafts_through_the_backend_under_graphs():
    case = parse_case("gqa-h4/2-d64-bf16-p16:30+1")
    result = judge(EngineCheck(), planted.TorchGraphSafe, case, CUDA)
    assert result.verdict == Verdict.PASS and "layer-skip drafting under CUDA graphs" in result.reason, result.reason
    result = judge(EngineCheck(), planted.ForgetsLastRowInDraftUpdate, case, CUDA)
    assert result.verdict == Verdict.FAIL and "update_for_draft_step drafts other tokens" in result.reason, (
        result.reason
    )


def test_empty_padding_requests_in_the_draft_loop_and_graphs():
    """A backend claiming vLLM's empty requests gets them as the draft loop's padding (and the
    graphs check's); a kernel whose empty request writes over the previous request's last token
    fails both, the draft loop at its first step."""
    result = judge(DraftLoopCheck(), planted.GraphSafeEmptyRequests, DECODE, CUDA)
    assert result.verdict == Verdict.PASS and "empty requests and rows" in result.reason, result.reason
    defect = planted.WritesLastTokenOfEmptyRequests
    result = judge(DraftLoopCheck(), defect, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "k=2 (padding last (empty requests))" in result.reason, result.reason
    assert "draft step 1 of 2" in result.reason, result.reason
    assert judge(GraphsCheck(), defect, DECODE, CUDA).verdict == Verdict.FAIL


def test_a_graph_captured_over_empty_requests_only_must_replay_every_batch_right():
    """vLLM #51970's class: what the capture's all-zero lengths decide is baked into the graph. A
    backend serving empty requests passes the fourth capture; one that captures nothing for an idle
    batch fails it, and only it."""
    passing = judge(GraphsCheck(), planted.GraphSafeWithEmptyRequests, MIXED, CUDA)
    assert passing.verdict == Verdict.PASS and "empty requests only" in passing.reason, passing.reason
    result = judge(GraphsCheck(), planted.SkipsAnIdleBatchAtCapture, MIXED, CUDA)
    assert result.verdict == Verdict.FAIL and "captured over empty requests only" in result.reason, result.reason
