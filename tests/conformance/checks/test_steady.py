"""steady: 256 steps of continuous batching (requests joining and leaving, decode and spec-verify
query lengths), every one watched. On the CPU its plan and its output path (a host cache
refreshed now and then shows at the step it skips; a plan reused for a shape that came back with
other requests; an LSE written only on the steps that re-planned); on a GPU its syncs and memory
(a sync every 64th step or whenever the number of requests changes, a workspace regrown and
kept), and the built-in backends passing."""

import dataclasses

import pytest
import torch

from backends import registry
from backends.base import PLAIN_LAYER, Capabilities, LayerParameters
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.checks import default_checks
from conformance.checks.steady import WARM_STEPS, SteadyCheck, steady_look
from conformance.harness.continuous_batch import MAX_BUDGET, continuous_batching, fixed_batch
from conformance.harness.lse_pass import lse_findings
from conformance.harness.step import prepare_case, run_step
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import steady_defects
from tests.planted.graph_backends import TorchGraphSafe

CPU = torch.device("cpu")
DECODE = parse_case("gqa-h8/2-d64-fp16-p16:100+1,30+1,250+1")
SMALL = parse_case("gqa-h4/2-d32-fp16-p16:40+1,9+1,70+1")  # the CPU looks that need no long run


def test_the_steps_are_continuous_batching_within_the_claims():
    schedule = continuous_batching(DECODE, 256, TorchGraphSafe.capabilities)
    assert schedule == continuous_batching(DECODE, 256, TorchGraphSafe.capabilities)  # planned from the case
    first = schedule.steps[0]
    assert (first.requests, first.query_lens, first.seq_lens) == ((0, 1, 2), (1, 1, 1), (101, 31, 251))
    summary = schedule.summary()
    assert summary["joins"] >= 20 and summary["leaves"] >= 20, summary
    assert summary["steps_same_count_other_requests"] >= 5, summary  # one left, another joined
    assert summary["query_lens"] == [1, 4] and summary["steps_with_mixed_query_lens"] >= 20, summary
    assert summary["requests_per_step"][1] <= 8 and summary["max_tokens_per_step"] <= 32, summary
    counts = [len(step.requests) for step in schedule.steps]
    assert counts[0] == counts[1] > counts[2] < counts[3]  # a swap, a leave, a join first
    # vLLM's persistent batch: the request that joined at step 1 took the row of the one that left.
    left, joined = schedule.left(1), schedule.joined(1)
    assert len(left) == len(joined) == 1
    assert schedule.steps[1].requests.index(joined[0]) == schedule.steps[0].requests.index(left[0])
    done = {}
    for step in schedule.steps:  # every request one query longer each step, its context first
        for r, query, seq_len in zip(step.requests, step.query_lens, step.seq_lens):
            done[r] = done.get(r, 0) + query
            assert seq_len == schedule.requests[r].context + done[r]
    assert all(request.new_tokens <= MAX_BUDGET <= 256 for request in schedule.requests)  # the ramp stays exact
    # The longest request grows past new multiples of 32 after the warm-up (KeepsEveryWorkspace's regrowth).
    sizes = [-(-max(step.seq_lens) // 32) for step in schedule.steps]
    assert max(sizes[WARM_STEPS:]) > max(sizes[:WARM_STEPS])


def test_the_query_lengths_follow_the_claims():
    decode_only = continuous_batching(DECODE, 64, Capabilities(max_query_len=1)).summary()
    assert decode_only["query_lens"] == [1] and decode_only["joins"] > 0
    uniform = continuous_batching(DECODE, 64, Capabilities(max_query_len=8, uniform_query_len=True)).summary()
    assert uniform["query_lens"] == [1, 4] and uniform["steps_with_mixed_query_lens"] == 0
    short = continuous_batching(DECODE, 64, Capabilities(max_query_len=2)).summary()
    assert short["query_lens"] == [1, 2]


@pytest.mark.slow
def test_a_cache_refreshed_now_and_then_fails_at_the_step_it_skips():
    assert steady_look(TorchGraphSafe, DECODE, CPU, steps=70).verdict == Verdict.PASS
    result = steady_look(steady_defects.SkipsRefreshEveryNthBuild, DECODE, CPU, steps=70)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("step 63 of 70 differs"), result.reason
    assert result.evidence["failing_step_batch"]["step"] == 63


def test_a_plan_reused_for_a_shape_that_comes_back_fails_only_with_the_batch_changing():
    """Right for a fixed batch (what the steady look ran before: its block table and query starts
    never change), wrong where the same shape comes back with other requests."""
    fixed = steady_look(steady_defects.ReusesPlanWhenShapeRepeats, SMALL, CPU, schedule=fixed_batch(SMALL, 24))
    assert fixed.verdict == Verdict.PASS, fixed.reason
    result = steady_look(steady_defects.ReusesPlanWhenShapeRepeats, SMALL, CPU, steps=24)
    assert result.verdict == Verdict.FAIL and " differs from the oracle " in result.reason, result.reason


def test_the_lse_is_checked_on_every_step_where_claimed():
    passed = steady_look(TorchNaiveBackend, SMALL, CPU, steps=24)
    assert passed.verdict == Verdict.PASS and "its log-sum-exp too" in passed.reason, passed.reason
    # One step, as numerics' LSE pass asks: right.
    prepared = prepare_case(steady_defects.StaleLseUnlessReplanned, dataclasses.replace(SMALL, lse=True), CPU)
    run_step(prepared)
    assert lse_findings(prepared)[0] is None
    result = steady_look(steady_defects.StaleLseUnlessReplanned, SMALL, CPU, steps=24)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("step 1 of 24: lse: "), result.reason
    assert "got NaN (not written)" in result.reason


class WritesLsePastItsRows(TorchNaiveBackend):
    """Writes one lse row more than it was handed (a kernel's grid over the limit's rows)."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer)
        lse = layer.lse
        if lse is not None:
            torch.as_strided(lse, (lse.shape[0] + 1, lse.shape[1]), lse.stride())[-1] = 0.0


def test_rows_past_the_ones_handed_stay_as_they_were():
    result = steady_look(WritesLsePastItsRows, SMALL, CPU, steps=4)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("step 0 of 4: forward wrote lse rows past")


@pytest.mark.parametrize(
    "case_id",
    [
        "mla-h4-d64+16-bf16-p16:40+1,9+1",
        "gqa-h4/2-d32-bf16-fp8e4m3-p16:30+1,17+1",
        "mla-h4-d64+16-bf16-fp8e4m3-p16:40+1,9+1",
    ],
)
def test_torch_naive_holds_steady_over_mla_and_fp8_caches(case_id):
    result = steady_look(TorchNaiveBackend, parse_case(case_id), CPU, steps=12)
    assert result.verdict == Verdict.PASS, result.reason


def test_it_runs_by_default_once_per_kind_cache_format_sparsity_and_query_format_on_small_decode_batches():
    assert "steady" in default_checks()
    check = SteadyCheck()
    assert "CUDA" in check.skip_reason(TorchGraphSafe, CPU)
    torch_naive = registry.load("torch_naive")
    plan = check.plan(torch_naive, suite("standard"), CPU)
    chosen = [case for case in suite("standard") if plan[case.id] is None]
    assert {(case.spec.kind, case.spec.fp8_kv_cache) for case in chosen} == {
        ("mha", False),
        ("mha", True),
        ("mla", False),
        ("mla", True),
    }
    assert all((case.max_query_len == 1 or case.trees) and case.num_reqs <= 8 for case in chosen)
    assert any(case.spec.sparse_topk for case in chosen)  # a sparse layer apart from the dense ones
    assert any(case.trees for case in chosen)  # a token-tree engine's steps apart from a chain engine's
    assert any(case.spec.fp8_query for case in chosen)  # an fp8 query's steps apart (its scale read every step)
    keys = {
        (
            case.spec.kind,
            case.spec.kv_cache_dtype,
            case.spec.sparse_topk is not None,
            bool(case.trees),
            case.spec.fp8_query,
        )
        for case in chosen
    }
    assert len(chosen) == len(keys)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "defect,expected",
    [
        (steady_defects.SyncsEveryNthBuild, "host sync(s) over 256 steps, in steps 63, 127, 191, 255"),
        (steady_defects.KeepsEveryWorkspace, "device memory held after a step grew"),
        (steady_defects.SkipsRefreshEveryNthBuild, "step 63 of 256 differs"),
        (steady_defects.SyncsOnTheThirdBuild, "host sync(s) over 256 steps, in steps 2;"),
        (steady_defects.SyncsWhenBatchChanges, "host sync(s) over 256 steps, in steps 2, 3, "),
        (steady_defects.ReusesPlanWhenShapeRepeats, " differs from the oracle "),
        (steady_defects.StaleLseUnlessReplanned, "step 1 of 256: lse: "),
    ],
)
def test_planted_defects_fail_on_a_gpu(defect, expected):
    cuda = torch.device("cuda")
    assert steady_look(TorchGraphSafe, DECODE, cuda).verdict == Verdict.PASS
    result = steady_look(defect, DECODE, cuda)
    assert result.verdict == Verdict.FAIL and expected in result.reason, result.reason


@pytest.mark.gpu
def test_a_sync_when_the_batch_changes_passes_a_fixed_batch():
    """What the steady look ran before: one batch, every request one token longer each step. The
    number of requests never changes after the first (unwatched) step, so the sync never shows."""
    result = steady_look(
        steady_defects.SyncsWhenBatchChanges, DECODE, torch.device("cuda"), schedule=fixed_batch(DECODE, 256)
    )
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [steady_defects.SyncsOnTheFirstBuild, steady_defects.SyncsOnItsFirstVerifyStep])
def test_a_sync_on_the_first_call_of_a_kernel_only_is_lazy_initialisation_and_passes(lazy):
    """What a fresh process's first call of a JIT-loaded module does (FlashInfer's XQA kernels load
    on trtllm's first forward, its speculative-decoding one on its first verify step): not the
    steady state, so the verdict does not depend on what else the process ran first."""
    result = steady_look(lazy, DECODE, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason
    assert result.evidence["sync_warm_up_steps"] == [0, 1]


def test_syncs_go_uncounted_in_the_first_step_of_each_kind_of_batch_only():
    """The first decode-only step and the first with a longer row (verify, tree, prefill chunk);
    one step for a decode-only backend or a fixed batch, whose steps are all of one kind."""
    from backends.flashinfer.trtllm import TrtllmBackend
    from conformance.checks.steady import warm_up_steps

    schedule = continuous_batching(DECODE, 256, TorchGraphSafe.capabilities)
    kinds = [max(step.query_lens) > 1 for step in schedule.steps]
    assert warm_up_steps(schedule) == {kinds.index(False), kinds.index(True)} == {0, 1}
    assert warm_up_steps(fixed_batch(DECODE, 256)) == {0}
    decode_only = dataclasses.replace(TrtllmBackend.capabilities, max_query_len=1)
    assert warm_up_steps(continuous_batching(DECODE, 256, decode_only)) == {0}
    tree = parse_case("gqa-h8/2-d64-fp16-p16:100+tree(2x2),30+1")
    assert warm_up_steps(continuous_batching(tree, 256, TorchGraphSafe.capabilities, trees=True)) == {0, 1}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "triton_mla", "flashinfer", "torch_naive"])
def test_built_in_backends_hold_steady(name):
    backend = registry.load(name)
    cuda = torch.device("cuda")
    check = SteadyCheck()
    for case in suite("standard"):
        if check.case_skip_reason(backend, case, cuda) is None:
            result = judge(check, backend, case, cuda)
            assert result.verdict == Verdict.PASS, (case.id, result.reason)


def test_an_input_changed_in_place_fails_naming_the_step_and_call():
    from tests.planted.input_defects import TurnsSeqLensIntoContextLens

    result = steady_look(TurnsSeqLensIntoContextLens, SMALL, CPU, steps=8)
    assert result.verdict == Verdict.FAIL and result.reason.startswith(
        "the backend changed an input it was handed: step 0: build changed seq_lens"
    ), result.reason
