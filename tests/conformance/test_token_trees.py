"""Token trees (EAGLE's top-k > 1 drafts, ``backends.base``: "Token trees"): the grammar, the
oracle's mask (a chain written as a tree is today's verify), torch_naive through the checks that
drive trees, the planted tree defects failing numerics by a wide margin, and the checks that run
chains only saying so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends import token_tree
from backends.base import CGSupport, DeviceInfo
from backends.features import TOKEN_TREES
from backends.torch_naive import TorchNaiveBackend
from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.checks import CHECKS, make_check
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.interpreted import numerics_verdicts
from tests.planted import tree_defects

CPU = torch.device("cpu")


def test_the_tree_helpers():
    assert token_tree.full(2, 2) == (-1, 0, 0, 1, 1, 2, 2)
    assert token_tree.depths(token_tree.full(2, 2)) == [0, 1, 1, 2, 2, 2, 2]
    assert token_tree.chain(4) == (-1, 0, 1, 2)
    seen = token_tree.ancestors((-1, 0, 0, 1))
    assert seen[3].tolist() == [True, True, False, True]  # its grandparent, parent and itself, not its uncle
    assert seen[2].tolist() == [True, False, True, False]  # not its sibling
    # A window of 2 positions: token 3 (depth 2, position 12) sees positions 11 and 12 only.
    window = token_tree.visible((-1, 0, 0, 1), 10, sliding_window=2)
    assert window[3].nonzero().flatten().tolist() == [10 + 1, 10 + 3]  # its parent's slot and its own
    with pytest.raises(ValueError, match="parent"):
        token_tree.depths((0,))


@pytest.mark.parametrize(
    "text,batch,trees",
    [
        (
            "gqa-h8/2-d64:3000+tree(4x2),500+1x3",
            ((3000, 21),) + ((500, 1),) * 3,
            (token_tree.full(4, 2),) + (None,) * 3,
        ),
        ("gqa-h8/2-d64:100+tree[-1.0.0.1]x2,5+1", ((100, 4),) * 2 + ((5, 1),), ((-1, 0, 0, 1),) * 2 + (None,)),
        ("gqa-h8/2-d64:100+tree[-1.-1.-1]", ((100, 3),), ((-1, -1, -1),)),
    ],
)
def test_the_grammar_reads_and_writes_trees(text, batch, trees):
    case = parse_case(text)
    assert case.batch == batch and case.trees == trees and case.needs.trees
    assert parse_case(case.id) == case
    assert not parse_case("gqa-h8/2-d64:100+4").trees


@pytest.mark.parametrize(
    "text,words",
    [
        ("gqa:100+tree[0.1]", "a parent is -1 or an earlier token"),
        ("gqa:100+tree[-1.2]", "a parent is -1 or an earlier token"),
        ("gqa:100+tree(0x2)", "K and D from 1"),
        ("gqa:100+tree(9x9)", "at most 512 tokens"),
        ("gqa:100+treex", r"is not CTX\+Q"),
        ("mla-h16-d512+64-topk64:100+tree(2x1)", "dense attention layers"),
        ("indexer-h4-d32-topk8:100+tree(2x1)", "dense attention layers"),
    ],
)
def test_bad_trees_are_one_line_errors(text, words):
    with pytest.raises(CaseSyntaxError, match=words):
        parse_case(text)


def test_a_chain_written_as_a_tree_is_todays_verify():
    chain = materialize(parse_case("gqa-h8/2-d64-w16:100+4,30+3"), CPU).reference_output()
    tree = materialize(parse_case("gqa-h8/2-d64-w16:100+tree[-1.0.1.2],30+3"), CPU)
    tree_as_written = materialize(parse_case("gqa-h8/2-d64-w16:100+4,30+3"), CPU)
    tree.query, tree.keys, tree.values = tree_as_written.query, tree_as_written.keys, tree_as_written.values
    tree._reference = None
    assert torch.equal(tree.reference_output(), chain)


def test_the_oracle_hides_siblings_and_places_a_tree_by_depth():
    """A branch's tokens do not see the other branch: changing one branch's keys leaves the other
    branch's answers as they were."""
    case = parse_case("gqa-h4/4-d32-fp32:20+tree[-1.0.0.1.2]")
    batch = materialize(case, CPU)
    before = batch.reference_output().clone()
    batch.keys[0][20 + 2] += 5.0  # token 2 (the right branch) and its child 4 see it; tokens 1 and 3 do not
    batch.values[0][20 + 2] += 5.0
    batch._reference = None
    after = batch.reference_output()
    changed = (after != before).flatten(1).any(dim=1).tolist()
    assert changed == [False, False, True, False, True]


TREE_CASES = [
    "gqa-h8/2-d64:100+tree(2x2),20+1,0+5",  # beside a decode and a prefill
    "gqa-h16/1-d64-w16-edges:100+tree(3x2),40+tree[-1.0.1.0]",  # the window's edge inside the tree
    "mha-h4/4-d64-fp8e4m3-attnsinks-lse:60+tree(2x3)",  # fp8, sinks, the LSE
    "mla-h16-d512+64-bf16-p64:300+tree(4x1),70+1x2",  # MLA
]


@pytest.mark.parametrize("text", TREE_CASES)
def test_torch_naive_passes_the_checks_that_drive_trees_on_a_cpu(text):
    for name in ("numerics", "determinism"):  # syncs, graphs, memory and bench drive them too, on a GPU
        result = judge(make_check(name), TorchNaiveBackend, parse_case(text), CPU)
        assert result.verdict == Verdict.PASS, (name, result.reason)
    assert {name for name, check in CHECKS.items() if check.drives_trees} == {
        "numerics",
        "syncs",
        "graphs",
        "determinism",
        "memory",
        "bench",
        "engine",
        "steady",
        "draft-loop",
    }


ENGINE_TREE_CASES = [
    TREE_CASES[0],
    "gqa-h8/2-d64-w4-edges:10+tree(1x12)",
    "mha-h4/4-d64-fp8e4m3-attnsinks:60+tree(2x3)",
]


@pytest.mark.parametrize("text", ENGINE_TREE_CASES)
def test_the_engine_check_drafts_and_verifies_trees_through_torch_naive(text):
    result = judge(make_check("engine"), TorchNaiveBackend, parse_case(text), CPU)
    assert result.verdict == Verdict.PASS, result.reason
    runs = result.evidence["token_trees"]
    assert len(runs) == 3 and all(run["accepted_nodes_moved"] > 0 for run in runs.values()), runs


@pytest.mark.parametrize("defect", [tree_defects.TreeAsChain, tree_defects.SiblingsVisible])
def test_the_engine_check_fails_a_backend_that_mistakes_trees(defect):
    result = judge(make_check("engine"), defect, parse_case(TREE_CASES[0]), CPU)
    assert result.verdict == Verdict.FAIL and "token trees" in result.reason, result.reason


@pytest.mark.parametrize(
    "defect,text",
    [
        (tree_defects.TreeAsChain, "gqa-h8/2-d64:100+tree(3x2),20+1"),
        (tree_defects.SiblingsVisible, "gqa-h8/2-d64:100+tree(3x2)"),
        (tree_defects.ParentButNotGrandparent, "gqa-h8/2-d64:100+tree(2x3)"),
        (tree_defects.PositionsByQueryIndex, "gqa-h8/2-d64-w16-edges:100+tree(4x2)"),
        (tree_defects.FirstRequestsTree, "gqa-h8/2-d64:100+tree(2x1),60+tree[-1.0.1],30+tree[-1.-1.-1]"),
        (tree_defects.AncestorsIn32Bits, "gqa-h8/2-d64:70+tree(2x5),40+1"),
        (tree_defects.WindowOverTheContextOnly, "gqa-h8/2-d64-w4-edges:10+tree(1x12),5+tree[-1.0.1.2.3.4.5.2.7.8.9]"),
    ],
)
def test_each_planted_tree_defect_fails_numerics_widely(defect, text):
    result = judge(NumericsCheck(), defect, parse_case(text), CPU)
    assert result.verdict == Verdict.FAIL and result.metrics["tolerance_ratio"] > 5, result.reason
    assert judge(NumericsCheck(), defect, parse_case("gqa-h8/2-d64:100+4,20+1"), CPU).verdict == Verdict.PASS


def test_a_backend_without_the_claim_and_the_checks_that_run_chains_say_why():
    from backends.flash_attn import FlashAttnBackend
    from backends.flashinfer.gqa import FlashInferBackend
    from backends.flashinfer.trtllm import TrtllmBackend

    case = parse_case(TREE_CASES[0])
    h200 = DeviceInfo("cuda", "H200", (9, 0))
    reason = FlashAttnBackend.capabilities.feature_reason(case.needs, h200)
    assert "token trees" in reason and "mask_mod" in reason, reason
    assert FlashInferBackend.capabilities.feature_reason(case.needs, h200) is None
    assert TrtllmBackend.capabilities.feature_reason(case.needs, h200) is None
    assert TOKEN_TREES in TorchNaiveBackend.capabilities.features
    assert all(check.drives_trees for name, check in CHECKS.items() if name not in ("indexer", "lse-merge"))


# triton's kernels under Triton's CPU interpreter: trees through the split decode kernel (8 tokens
# or fewer) and the prefill kernel (more), a window's edge, sinks and the LSE, fp8, a group of 16,
# an empty request; and the same kernels with the step's tree dropped, FAIL.
TRITON_TREES = [
    "gqa-h4/2-d64-fp32:40+tree(2x2),10+1",
    "gqa-h4/2-d64-fp32:40+tree(2x3),3+tree[-1.0.0.1]",
    "gqa-h4/2-d64-fp32-w8-edges:40+tree(2x3)",
    "gqa-h4/2-d64-bf16-lse-attnsinks:40+tree(2x2),0+5,7+1",
    "gqa-h8/8-d64-fp16-fp8e4m3:30+tree(3x2),9+tree(1x3)",
    "gqa-h16/1-d64-bf16:100+tree[-1.0.0.0.1.1.2.4.5],0+0,5+2",
    "gqa-h4/2-d64-fp32:30+tree(2x5)",  # 63 tokens: the mask's high bits, bit 63 its sign
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,verdict",
    [
        ("backends.triton.backend:TritonAttentionBackend", "PASS"),
        ("tests.planted.tree_defects:triton_tree_as_chain", "FAIL"),
    ],
)
def test_tritons_kernels_attend_over_trees_under_the_interpreter(backend, verdict):
    cases = TRITON_TREES if verdict == "PASS" else TRITON_TREES[:2]
    assert numerics_verdicts(backend, cases) == [verdict] * len(cases)


def test_triton_claims_trees_of_up_to_64_tokens():
    claims = TritonAttentionBackend.capabilities
    h200 = DeviceInfo("cuda", "H200", (9, 0))
    assert TOKEN_TREES in claims.features
    assert claims.skip_reason(parse_case("gqa:100+tree(2x5)").needs, h200) is None  # 63 tokens
    assert claims.skip_reason(parse_case("gqa:100+tree(4x3)").needs, h200).startswith(
        "a step of token trees with a request of 85 tokens exceeds the claimed maximum 64"
    )


def test_graph_replays_keep_each_requests_tree_and_one_hands_other_trees():
    """The graphs check's replays of a tree batch: each request's tree moves with it (fewer
    requests, reversed, query lengths moved, one more request), and one replay keeps every length
    but hands other trees of the same sizes, so a mask kept from the capture is stale there."""
    from backends.base import CGSupport
    from conformance.harness.graph_batches import replay_batches

    case = parse_case("gqa-h8/2-d64:300+tree(2x2),40+1,90+tree[-1.0.1]")
    replays = {replay.description: replay.case for replay in replay_batches(case, CGSupport.ALWAYS)}
    full = token_tree.full(2, 2)
    assert replays["fewer real requests, more padding rows"].trees == (full,)
    assert replays["requests in reverse order (another request is last)"].trees == case.trees[::-1]
    assert replays["no padding rows (every row a real request)"].trees == case.trees + (None,)
    assert replays["query lengths moved between requests"].trees == ((-1, 0, 1), None, full)
    other = replays["other trees of the same sizes (a mask kept from the capture is stale)"]
    assert other.batch == case.batch and other.trees == ((-1, 0, 0, 0, 0, 0, 0), None, (-1, 0, 0))


def test_a_sub_batch_keeps_its_requests_trees_and_flashinfers_mask_is_each_requests_visibility():
    """A backend that splits a step (decodes first, then the rest) hands each part its own
    requests' trees; FlashInfer's custom mask is each request's [query, sequence] visibility."""
    from backends.flashinfer.gqa import packed_tree_mask, tree_mask
    from backends.utils import sub_batch

    batch = materialize(parse_case("gqa-h8/2-d64-w8:20+1,30+tree[-1.0.0.1],5+2"), CPU)
    common = batch.common_metadata()
    rest = sub_batch(common, 1, 3)
    assert rest.host_tree_parents.tolist() == [-1, 0, 0, 1, -1, 0] and rest.tree_parents.tolist() == [
        -1,
        0,
        0,
        1,
        -1,
        0,
    ]
    mask = tree_mask(rest, 8)
    expected = torch.cat(
        [token_tree.visible((-1, 0, 0, 1), 30, 8).flatten(), token_tree.visible((-1, 0), 5, 8).flatten()]
    )
    assert torch.equal(mask, expected)
    assert tree_mask(materialize(parse_case("gqa-h8/2-d64:20+1,30+4"), CPU).common_metadata(), None) is None
    # Packed for FlashInfer's kernel: request b's bits, little-endian, from the byte its plan's
    # mask_indptr names (the mask bits before b: query x sequence lengths summed).
    packed = packed_tree_mask(rest, 8)
    unpacked = ((packed[:, None].int() >> torch.arange(8)) & 1).flatten().bool()
    first, second = 4 * 34, 2 * 7  # each request's query x sequence bits
    assert packed.numel() == first + second
    assert torch.equal(unpacked[:first], expected[:first])
    assert torch.equal(unpacked[8 * first : 8 * first + second], expected[first:])


def test_ancestor_bits_on_the_device_agree_with_the_host_rule():
    """triton's masks (pointer jumping, int64 bits) against ``ancestors`` and ``depths``: an empty
    request first, several roots, a chain, and a tree of 64 tokens (bit 63 is the sign bit)."""
    trees = [(), (-1, -1, 0, 1, 1), token_tree.chain(5), token_tree.full(2, 5)[:64]]
    starts = [0]
    for tree in trees:
        starts.append(starts[-1] + len(tree))
    parents = torch.tensor([p for tree in trees for p in tree], dtype=torch.int32)
    bits, depths = token_tree.ancestor_bits(torch.tensor(starts), parents)
    for tree, start in zip(trees, starts):
        mask = token_tree.ancestors(tree)
        for index in range(len(tree)):
            row = int(bits[start + index]) & (2**64 - 1)
            assert [bool(row >> j & 1) for j in range(len(tree))] == mask[index].tolist()
        assert depths[start : start + len(tree)].tolist() == token_tree.depths(tree)


def test_a_tree_step_is_held_to_its_longest_request_and_ids_read_back():
    """Every request of a tree step is a tree to a backend (a chain too): the step's longest
    request is what ``max_tree_tokens`` limits; a case left with chains only is a case without
    trees, its id read back the same."""
    from dataclasses import replace

    h200 = DeviceInfo("cuda", "H200", (9, 0))
    reason = TritonAttentionBackend.capabilities.skip_reason(parse_case("gqa-h4/2-d64:10+tree(1x1),0+80").needs, h200)
    assert reason.startswith("a step of token trees with a request of 80 tokens exceeds the claimed maximum 64")
    case = parse_case("gqa-h8/2-d64:40+1,300+tree(2x2)")
    chains_only = replace(case, batch=case.batch[:1], trees=(None,))
    assert chains_only.trees == () and parse_case(chains_only.id) == chains_only
    with pytest.raises(CaseSyntaxError, match="at most 512"):
        parse_case("gqa:10+tree(999x40000)")


# --- the steady look over token trees -----------------------------------------------------------------


def test_visibility_over_steps_sees_earlier_steps_whole_and_its_own_by_ancestry():
    seen = token_tree.visible_in_steps([(-1,), (-1, 0, 0), (-1, 0)], 10)
    assert seen.shape == (6, 16)
    assert seen[1, :12].all() and seen[1, 12:].tolist() == [False, False, False, False]  # step 2's root
    assert seen[3, 10:14].tolist() == [True, True, False, True]  # its parent (11), not its sibling (12)
    assert seen[4, :14].all() and seen[4, 14:].tolist() == [True, False]  # step 3 sees all of step 2
    # A window of 2: step 2's third token (depth 1, position 12) sees its parent at 11, not 10.
    windowed = token_tree.visible_in_steps([(-1,), (-1, 0, 0), (-1, 0)], 10, sliding_window=2)
    assert windowed[3].nonzero().flatten().tolist() == [11, 13]


def test_a_tree_runs_schedule_starts_decoding_and_draws_a_tree_per_verify_row():
    from backends.triton.backend import TritonAttentionBackend
    from conformance.harness.continuous_batch import continuous_batching

    case = parse_case(TREE_CASES[0])
    schedule = continuous_batching(case, 40, TritonAttentionBackend.capabilities, trees=True)
    assert schedule.steps[0].query_lens == (1, 1, 1)  # the 0+5 request drops out: no query in the look
    trees = [tree for step in schedule.steps for tree in step.trees]
    assert len(trees) == sum(len(step.requests) for step in schedule.steps)
    verifies = [tree for tree in trees if len(tree) > 1]
    assert all(tree[0] == -1 and all(0 <= p < i for i, p in enumerate(tree) if i) for tree in verifies)
    assert len(set(verifies)) > 3 and (-1,) in trees  # many shapes, decodes among them


@pytest.mark.parametrize("text", [TREE_CASES[0], TREE_CASES[1], TREE_CASES[2]])
def test_torch_naive_holds_steady_over_trees(text):
    from conformance.checks.steady import steady_look

    result = steady_look(TorchNaiveBackend, parse_case(text), CPU, steps=40)
    assert result.verdict == Verdict.PASS, result.reason


def test_trees_kept_for_their_shape_pass_one_step_and_fail_the_steady_look():
    from conformance.checks.steady import steady_look

    case = parse_case("gqa-h8/2-d64-fp32:100+tree(2x2),60+1,30+1")
    assert judge(NumericsCheck(), tree_defects.TreesKeptForTheirShape, case, CPU).verdict == Verdict.PASS
    result = steady_look(tree_defects.TreesKeptForTheirShape, case, CPU, steps=40)
    assert result.verdict == Verdict.FAIL and "differs from the oracle" in result.reason, result.reason
    assert "trees" in result.evidence["failing_step_batch"]
    assert steady_look(tree_defects.TreeAsChain, case, CPU, steps=40).verdict == Verdict.FAIL


def test_the_engine_check_skips_a_tree_layout_for_a_backend_without_trees():
    """Its engines verify trees through the backend itself (no companion takes them): a backend
    that does not claim trees SKIPs the tree layout with its reason, before any engine is made."""
    from conformance.checks.engine import engine_skip_reason

    case = parse_case(TREE_CASES[0])
    reason = engine_skip_reason(tree_defects.TreeAsChain, case, CPU)
    assert reason is None
    reason = engine_skip_reason(TorchNaiveWithoutTrees, case, CPU)
    assert reason.startswith("the engine verifies token trees of 9 tokens through the backend: token trees"), reason
    assert make_check("engine").case_skip_reason(TorchNaiveWithoutTrees, case, CPU) == reason


class TorchNaiveWithoutTrees(TorchNaiveBackend):
    """torch_naive claiming no token trees (what most vendor adapters claim)."""

    capabilities = dataclasses.replace(
        TorchNaiveBackend.capabilities, features=TorchNaiveBackend.capabilities.features - {TOKEN_TREES}
    )


# --- the draft loop over token trees ------------------------------------------------------------------


def test_a_tree_draft_step_hands_every_node_up_to_its_level():
    from conformance.harness.tree_draft_loop import grown, grown_case, max_depth

    case = parse_case("gqa-h8/2-d64:100+tree[-1.0.1.0.3],20+1,0+3")
    assert max_depth(case) == 2
    assert grown_case(case, 0).batch == ((100, 1), (20, 1), (0, 1))
    step = grown_case(case, 1)
    assert step.batch == ((100, 3), (20, 1), (0, 2)) and step.trees == ((-1, 0, 0), None, None)
    full = materialize(case, CPU)
    batch = grown(full, 1)  # nodes 0, 1, 3 of the tree: query rows and keys are the full batch's own
    assert torch.equal(batch.query[:3], full.query[[0, 1, 3]])
    assert torch.equal(batch.keys[0][100:], full.keys[0][[100, 101, 103]])
    assert torch.equal(batch.keys[2], full.keys[2][:2])


@pytest.mark.parametrize("text", TREE_CASES)
def test_torch_naive_drafts_trees_right_step_by_step(text):
    from conformance.harness.tree_draft_loop import run_tree_draft_loop

    result = run_tree_draft_loop(TorchNaiveBackend, parse_case(text), CPU, graphs=False)
    assert result.verdict == Verdict.PASS, result.reason


def test_a_tree_taken_as_a_chain_or_kept_for_its_shape_fails_the_tree_draft_loop():
    from conformance.harness.tree_draft_loop import run_tree_draft_loop

    case = parse_case("gqa-h8/2-d64-w8-edges:100+tree(3x3),40+tree[-1.0.1.0]")
    result = run_tree_draft_loop(tree_defects.TreeAsChain, case, CPU, graphs=False)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("tree draft step 2 of 4"), result.reason
    # Right for the trees it first saw at each size; the pass with other trees of those sizes fails it.
    kept = run_tree_draft_loop(tree_defects.TreesKeptForTheirShape, case, CPU, graphs=False)
    assert kept.verdict == Verdict.FAIL and "replayed with other trees" in kept.reason, kept.reason


def test_the_draft_loop_runs_a_tree_case_where_every_step_is_a_batch_the_backend_captures():
    from conformance.checks.draft_loop import DraftLoopCheck

    check = DraftLoopCheck()
    uniform = parse_case("gqa-h8/2-d64:100+tree(2x2)x2")
    mixed = parse_case(TREE_CASES[0])
    assert check._tree_graph_reason(TritonAttentionBackend, mixed) is None
    graphs_of_uniform_batches = type(
        "UniformOnly",
        (),
        {"capabilities": dataclasses.replace(TorchNaiveBackend.capabilities, cuda_graphs=CGSupport.UNIFORM_BATCH)},
    )
    assert check._tree_graph_reason(graphs_of_uniform_batches, uniform) is None
    assert "query lengths differ" in check._tree_graph_reason(graphs_of_uniform_batches, mixed)
