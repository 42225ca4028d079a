"""DeepSeek-V3.2's lightning indexer as a layer kind: the grammar, the contract's per-token fp8
scales, the judge of a choice of positions, torch_indexer, the planted indexer defects, and the
attention checks that leave indexer cases to the indexer check."""

import pytest
import torch

from backends.fp8 import token_scales as backend_token_scales
from backends.torch_indexer import TorchIndexerBackend
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.kv_quantization import token_scales
from conformance.cases.oracle import index_logits
from conformance.cases.suites import standard_suite
from conformance.checks import CHECKS, make_check
from conformance.checks.indexer import IndexerCheck
from conformance.harness.index_choice import judge_rows
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import indexer_defects

CPU = torch.device("cpu")
SMALL = "indexer-h8-d32-fp8e4m3-p16-topk16:40+1,20+4,0+30,0+0"


def test_the_grammar_reads_and_writes_an_indexer():
    case = parse_case("indexer-fp8e4m3-topk2048:5000+1")
    assert (case.spec.kind, case.spec.num_heads, case.spec.head_dim, case.spec.block_size) == ("indexer", 64, 128, 64)
    assert parse_case(case.id) == case


@pytest.mark.parametrize(
    "text,words",
    [
        ("indexer-h8-d32:40+1", "give topkN"),
        ("indexer-h8/2-topk4:40+1", "one index key a token"),
        ("indexer-topk4-w8:40+1", "no sliding_window"),
        ("indexer-topk4-win8:40+1", "no sparse_window"),
        ("indexer-topk4-messyidx:40+1", "sparse MLA layer's data"),
        ("indexer-topk4-fp8e4m3-kscale0.5:40+1", "scales are its own"),
    ],
)
def test_what_an_indexer_has_not_is_a_syntax_error(text, words):
    with pytest.raises(CaseSyntaxError, match=words):
        parse_case(text)


def test_the_per_token_scales_are_the_smallest_powers_of_two_over_the_largest_key():
    keys = torch.tensor([[448.0, 1.0], [449.0, -3.0], [-0.5, 0.0], [0.0, 0.0], [224.0, 0.0]])
    expected = torch.tensor([1.0, 2.0, 2.0**-9, 1.0, 0.5], dtype=torch.float64)
    assert torch.equal(token_scales(keys, torch.float8_e4m3fn), expected)
    assert torch.equal(backend_token_scales(keys, torch.float8_e4m3fn).double(), expected)  # the two agree


def test_the_judge_lets_a_near_tie_go_either_way_and_names_every_broken_rule():
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0005, -1.0]])  # positions 0..4, token at position 4
    tol = torch.tensor([0.01])

    def problem(row):
        return judge_rows(torch.tensor([row]), logits, tol, 4, 3, 0)[0]

    assert problem([0, 1, 2]) is None and problem([3, 1, 0]) is None  # 1.0 and 1.0005: a near-tie
    assert "below the k-th" in problem([0, 1, 4]).what
    assert "past its own" in judge_rows(torch.tensor([[0, 1, 2]]), logits[:, :3], tol, 1, 3, 0)[0].what
    assert "twice" in problem([0, 0, 1]).what
    assert "chose 2 positions" in problem([0, 1, -1]).what
    assert "an entry is a position or -1" in problem([0, 1, -5]).what


def test_the_oracle_is_the_weighted_sum_of_each_heads_relu():
    query = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one token, two heads
    keys = torch.tensor([[2.0, -3.0], [-1.0, 1.0]])
    weights = torch.tensor([[0.5, 2.0]])
    logits = index_logits(query, keys, weights, context_len=1)
    assert logits.tolist() == [[0.5 * 2.0 + 2.0 * 0.0, 0.5 * 0.0 + 2.0 * 1.0]]


@pytest.mark.parametrize(
    "case_text",
    [SMALL, "indexer-h8-d32-p16-topk16:40+1,20+4,0+30", "indexer-h16-d64-fp8e4m3-p64-topk64:300+1x2,100+4"],
)
def test_torch_indexer_chooses_as_the_oracle_ranks(case_text):
    result = judge(IndexerCheck(), TorchIndexerBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    "defect,words",
    [
        (indexer_defects.TopKOverTheWholeSequence, "past its own"),
        (indexer_defects.KeysWithoutTheirScales, "the tolerance"),
        (indexer_defects.ReluOfTheSum, "the tolerance"),
        (indexer_defects.ExactScales, "stored key scale"),
        (indexer_defects.KeysQuantizedWithoutTheirScales, "stored key scale 1,"),
    ],
)
def test_planted_indexer_defects_fail(defect, words):
    result = judge(IndexerCheck(), defect, parse_case(SMALL), CPU)
    assert result.verdict == Verdict.FAIL and words in result.reason, result.reason
    assert result.metrics.get("tolerance_ratio", float("inf")) > 5


STEP_CHECKS = {"indexer", "syncs", "graphs", "draft-loop", "steady", "determinism", "engine", "bench", "memory"}


def test_the_checks_that_drive_steps_and_memory_judge_an_indexer_and_the_attention_checks_leave_it():
    case = parse_case(SMALL)
    for name in CHECKS:
        reason = make_check(name).judged_reason(case)
        assert (reason is None) == (name in STEP_CHECKS), (name, reason)
    assert IndexerCheck().case_skip_reason(TorchNaiveBackend, case, CPU) == "INDEXER not supported (supports mha, mla)"
    assert (
        IndexerCheck()
        .case_skip_reason(TorchIndexerBackend, parse_case("mla-h4-d32+16:40+1"), CPU)
        .startswith("MLA not supported")
    )


def test_the_standard_suite_has_deepseeks_indexer():
    indexer = [case for case in standard_suite() if case.spec.kind == "indexer"]
    assert {case.spec.sparse_topk for case in indexer} >= {2048} and any(case.spec.fp8_kv_cache for case in indexer)


def test_an_indexer_that_breaks_ties_at_random_fails_determinism_and_torch_indexer_passes():
    from conformance.checks.determinism import DeterminismCheck

    case = parse_case(SMALL)
    assert judge(DeterminismCheck(), TorchIndexerBackend, case, CPU).verdict == Verdict.PASS
    # Its ties fall at random: two runs of the step may happen to choose alike, and then only the
    # reordered batch differs (a CI run saw it, with the generator where earlier tests on its
    # worker had left it). Seeded, its two runs differ.
    torch.manual_seed(0)
    result = judge(DeterminismCheck(), indexer_defects.TiesBrokenAtRandom, case, CPU)
    assert result.verdict == Verdict.FAIL and "claims deterministic but two runs" in result.reason, result.reason


def test_the_engine_runs_an_indexer_under_test_as_a_sparse_models_indexer():
    """The engine check's model for an indexer case: a sparse MLA model whose indexer is the
    backend under test (its attention a built-in's). torch_indexer decodes as the reference does;
    one ranking positions past the token's own decodes other tokens (on the CPU a narrow margin:
    0.10 of a logit past the near-tie tolerance of 0.10)."""
    from conformance.checks.engine import EngineCheck

    case = parse_case("indexer-h64-d128-fp8e4m3-p64-topk512:0+64,900+4,1500+1")
    assert judge(EngineCheck(), TorchIndexerBackend, case, CPU).verdict == Verdict.PASS
    result = judge(EngineCheck(), indexer_defects.TopKOverTheWholeSequence, case, CPU)
    assert result.verdict == Verdict.FAIL and "plain vs torch_naive" in result.reason, result.reason


@pytest.mark.parametrize(
    "backend,clean", [(TorchIndexerBackend, True), (indexer_defects.WholePagesMaskedByAddition, False)]
)
def test_the_memory_checks_nan_poison_pass_sees_an_indexer_read_past_its_requests_keys(backend, clean):
    """The memory check runs over indexers: with NaN in every slot no request owns, an indexer that
    scores whole pages and masks their tails by adding -inf chooses wrong (NaN + -inf is NaN);
    with numerics' finite poison the same indexer passes (the indexer check)."""
    from conformance.harness.nan_poison import nan_poison_pass
    from conformance.harness.step import prepare_case

    case = parse_case("indexer-h4-d32-bf16-fp8e4m3-p16-topk8:40+1,21+4,3+1")
    findings, _ = nan_poison_pass(prepare_case(backend, case, CPU))
    assert (not findings) == clean, findings
    # In an indexer's words: tokens' choices, a position and its logit against the k-th largest.
    assert clean or ("tokens' choices" in findings[0]["what"] and "k-th largest" in findings[0]["place"]), findings
    assert judge(IndexerCheck(), backend, case, CPU).verdict == Verdict.PASS
    assert "indexer" in make_check("memory").kinds


def test_the_engine_over_a_sparse_model_on_the_cpu_decodes_speculatively_as_plainly():
    """torch_indexer breaks exact ties (a ReLU leaves many logits 0) by position, whatever the
    step's shape: with torch.topk a verify step chose other positions among the ties than a decode
    of the same token, and the engine check of the CPU's default run FAILed (spec vs plain, a
    token 0.3 of a logit past the near-tie tolerance) on torch_naive itself."""
    from conformance.checks.engine import EngineCheck

    case = parse_case("mla-h16-d512+64-bf16-p64-topk2048:1+1,100+1,2047+1")
    result = judge(EngineCheck(), TorchNaiveBackend, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
