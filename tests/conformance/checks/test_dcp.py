"""Decode context parallelism, simulated (``conformance.harness.dcp``): the grammar, vLLM's local
lengths, the merge, torch_naive and triton passing, each planted DCP defect failing, and the
checks that do not shard a step saying so."""

import dataclasses

import pytest
import torch

from backends.base import DeviceInfo
from backends.features import DCP
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.checks import CHECKS
from conformance.checks.numerics import NumericsCheck
from conformance.harness.dcp import local_seq_len, rank_positions
from conformance.results import Verdict
from conformance.run.execution import judge
from reference_engine.dcp_attention import local_lengths, merge
from tests.interpreted import numerics_verdicts
from tests.planted import dcp_defects

CPU = torch.device("cpu")
CASES = [
    "gqa-h8/2-d64-dcp2:100+1,0+1,7+1",
    "gqa-h8/2-d64-dcp4:100+1,1+1,2+1,3+1",  # rows with no key on ranks 1-3, 2-3, 3
    "mla-h16-d128+32-dcp8:60+1,4+1",
    "gqa-h8/2-d64-fp16-fp8e4m3-qfp8-dcp4:300+1,2+1",
    "gqa-h8/2-d64-dcp2-strided:50+1,0+1",
]


def test_the_grammar_round_trips_and_refuses_what_dcp_does_not_shard():
    case = parse_case("gqa-h8/2-d64-dcp4:100+1,1+1@2")
    assert parse_case(case.id) == case and case.dcp == 4 and case.needs.dcp == 4 and case.needs.lse
    for text, message in [
        ("gqa-dcp2:100+4", "decode batches only"),
        ("gqa-dcp2:100+tree(2x1)", "decode batches only"),
        ("gqa-w64-dcp2:100+1", "without a window"),
        ("gqa-attnsinks-dcp2:100+1", "learned sinks"),
        ("mla-topk8-dcp2:100+1", "without a window"),
        ("gqa-dcp1:1+1", "from 2 to 8"),
        ("gqa-dcp16:1+1", "from 2 to 8"),
        ("gqa-dcp2-dcp4:1+1", "both set the DCP ranks"),
    ]:
        with pytest.raises(CaseSyntaxError, match=message):
            parse_case(text)


def test_local_lengths_are_vllms_and_every_position_lives_on_one_rank():
    """``get_dcp_local_seq_lens`` at interleave size 1: base = n // W; remainder = n - base·W;
    rank r holds base + clip(remainder - r, 0, 1)."""
    for world in (2, 4, 8):
        for seq_len in range(0, 40):
            base = seq_len // world
            vllm = [base + min(max(seq_len - base * world - rank, 0), 1) for rank in range(world)]
            assert [local_seq_len(seq_len, rank, world) for rank in range(world)] == vllm
            assert [int(local_lengths(torch.tensor(seq_len), rank, world)) for rank in range(world)] == vllm
            held = sorted(p for rank in range(world) for p in rank_positions(seq_len, rank, world))
            assert held == list(range(seq_len))


def test_the_merge_weighs_ranks_by_their_lse_and_drops_an_empty_one():
    outputs = [torch.tensor([[[1.0, 3.0]]]), torch.tensor([[[5.0, 7.0]]]), torch.full((1, 1, 2), float("nan"))]
    lses = [torch.tensor([[0.0]]), torch.tensor([[torch.log(torch.tensor(3.0))]]), torch.tensor([[float("-inf")]])]
    merged, lse = merge(outputs, lses, torch.float64)  # weights 1/4 and 3/4; the empty rank none, its NaN dropped
    assert torch.allclose(merged, torch.tensor([[[4.0, 6.0]]], dtype=torch.float64))
    assert torch.allclose(lse, torch.log(torch.tensor([[4.0]], dtype=torch.float64)))


@pytest.mark.parametrize("text", CASES)
def test_torch_naive_passes(text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(text), CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["dcp_ranks"] == parse_case(text).dcp


@pytest.mark.parametrize(
    "defect,says",
    [
        (dcp_defects.EmptyRankLseZero, "gave LSE 0 and output max |0|"),
        (dcp_defects.EmptyRankRowNaN, "gave LSE nan"),
        (dcp_defects.ClampsEmptyRankRowToOneKey, "rank 2 of 4 holds no key of row 1's request"),
        (dcp_defects.LseInBaseTwo, "differs from the oracle"),
    ],
)
def test_each_planted_dcp_defect_fails(defect, says):
    result = judge(NumericsCheck(), defect, parse_case(CASES[1]), CPU)
    assert result.verdict == Verdict.FAIL and says in result.reason, result.reason
    # Without DCP the same backends pass (each defect lives in what DCP asks).
    plain = judge(NumericsCheck(), defect, parse_case(CASES[1].replace("-dcp4", "")), CPU)
    assert plain.verdict == Verdict.PASS, plain.reason


def test_numerics_the_draft_loop_and_the_engine_shard_a_step_and_the_others_say_so():
    case = parse_case(CASES[0])
    assert sorted(name for name, check in CHECKS.items() if check.drives_dcp) == ["draft-loop", "engine", "numerics"]
    reason = CHECKS["graphs"]().judged_reason(case)
    assert reason.startswith("the graphs check does not shard a step over DCP ranks: DCP is judged by ")


@pytest.mark.parametrize(
    "text,stale_drafts",
    [("gqa-h8/2-d64-bf16-dcp2:1+1,5+1", False), ("mla-h16-d128+32-bf16-p64-dcp8:30+1,0+1", True)],
)
def test_the_engine_shards_every_layer_and_holds_the_merge_to_torch_naive_without_dcp(text, stale_drafts):
    """torch_naive under DCP against itself without: PASS (the reference is compared, not missing);
    a keyless rank's LSE as 0 and an LSE in base 2 decode other tokens. A draft update advancing
    every rank's length (numerics passes it) drafts other tokens where it bites: over 8 ranks 7 read
    a slot past their keys each draft step; over 2 ranks one does, and the engine's pool holds zeros
    there (no poison), which moved no draft of this model: the DCP draft loop, over a poisoned pool,
    is the check that judges it every time."""
    from conformance.checks.engine import EngineCheck, layout_key

    case = parse_case(text)
    assert layout_key(case, CPU) != layout_key(parse_case(text.replace(f"-dcp{case.dcp}", "")), CPU)
    result = judge(EngineCheck(), TorchNaiveBackend, case, CPU)
    assert result.verdict == Verdict.PASS and f"over {case.dcp} DCP ranks" in result.reason, result.reason
    assert result.evidence["independent_reference"] == "plain decoding gave torch_naive's tokens without DCP"
    for defect, says in [
        (dcp_defects.EmptyRankLseZero, "plain vs torch_naive"),
        (dcp_defects.LseInBaseTwo, "plain vs torch_naive"),
    ] + [(dcp_defects.AdvancesEveryRankEachDraftStep, "update_for_draft_step drafts other tokens")] * stale_drafts:
        result = judge(EngineCheck(), defect, case, CPU)
        assert result.verdict == Verdict.FAIL and says in result.reason, (defect, result.reason)


def test_the_engine_skips_a_dcp_layout_the_backend_cannot_shard():
    from conformance.checks.engine import EngineCheck

    reason = EngineCheck().case_skip_reason(dcp_defects.NotClaimingDcp, parse_case(CASES[0]), CPU)
    assert reason.startswith(
        "the engine shards every layer over 2 DCP ranks through the backend: backend planted_not_claiming_dcp "
        "cannot run under DCP 2: decode context parallelism over 2 ranks"
    ), reason

    # MLA prefill's layer: under DCP the model runs absorbed, so a backend of MHA layers only (the
    # prefill's) would serve no layer while a built-in decodes every one.
    class MhaOnly(TorchNaiveBackend):
        capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, kinds=frozenset({"mha"}))

    prefill = parse_case("mha-h16/16-d192/128-bf16-p16-dcp2:100+1,5+1")
    reason = EngineCheck().case_skip_reason(MhaOnly, prefill, CPU)
    assert reason and "the backend under test (MLA prefill's) serves no layer" in reason, reason


@pytest.mark.parametrize("text", ["gqa-h8/2-d64-dcp4:100+1,1+1,2+1", "mla-h16-d128+32-qfp8-dcp2:30+1,0+1"])
def test_the_dcp_draft_loop_eagerly_passes_torch_naive_and_fails_each_rank_advanced_by_the_global_step(text):
    """The loop's steps on a CPU (no graphs): each step's new position on its own rank. A draft
    update that advances every rank's lengths (right without DCP: numerics passes it) reads a
    key its rank does not hold."""
    from conformance.harness.dcp_draft_loop import run_dcp_draft_loop

    case = parse_case(text)
    for backend in (TorchNaiveBackend, dcp_defects.UpdatesLikeTorchNaive):
        result = run_dcp_draft_loop(backend, case, CPU, graphs=False)
        assert result.verdict == Verdict.PASS and "every step's merge equal" in result.reason, result.reason
    for defect, says in [
        (dcp_defects.AdvancesEveryRankEachDraftStep, "DCP draft step 2 of 4 (update_for_draft_step, eager"),
        (dcp_defects.EmptyRankLseZero, "DCP draft step 1 of 4"),
    ]:
        result = run_dcp_draft_loop(defect, case, CPU, graphs=False)
        assert result.verdict == Verdict.FAIL and says in result.reason, result.reason
    assert judge(NumericsCheck(), dcp_defects.AdvancesEveryRankEachDraftStep, case, CPU).verdict == Verdict.PASS


def test_a_backend_without_the_claim_says_why():
    from backends.registry import BUILTIN_BACKENDS, load

    h200 = DeviceInfo("cuda", "H200", (9, 0))
    needs = parse_case(CASES[0]).needs
    for name in BUILTIN_BACKENDS:
        claims = load(name).capabilities
        if DCP in claims.features or "mha" not in claims.kinds:
            continue
        reason = claims.feature_reason(needs, h200)
        assert reason.startswith(("the log-sum-exp", "decode context parallelism")), (name, reason)
        if reason.startswith("decode context parallelism"):
            assert DCP in claims.not_claimed, name


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    cases = ["gqa-h4/2-d64-fp32-dcp4:40+1,1+1,2+1", "gqa-h4/2-d64-bf16-fp8e4m3-qfp8-dcp2:30+1,0+1"]
    assert numerics_verdicts("backends.triton.backend:TritonAttentionBackend", cases) == ["PASS"] * len(cases)
