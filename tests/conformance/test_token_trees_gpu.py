"""Token trees under CUDA graphs, on a GPU: triton's tree masks made in every build pass the
graphs check (whose replays hand other trees of the same sizes) and the tree draft loop, and
triton keeping the first build's masks fails both."""

from __future__ import annotations

import pytest
import torch

from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.graphs import GraphsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.tree_defects import triton_tree_kept_from_first_build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = ["gqa-h32/8-d128-bf16-p16:3000+tree(4x2),700+tree[-1.0.0.0.1.1.2.4.5],20+1", "gqa-h8/2-d128-w64:500+tree(2x3)"]


@pytest.mark.parametrize("text", CASES)
def test_triton_passes_graphs_over_trees_and_a_mask_kept_from_the_first_build_fails(text):
    cuda = torch.device("cuda")
    result = judge(GraphsCheck(), TritonAttentionBackend, parse_case(text), cuda)
    assert result.verdict == Verdict.PASS, result.reason
    stale = judge(GraphsCheck(), triton_tree_kept_from_first_build(), parse_case(text), cuda)
    assert stale.verdict == Verdict.FAIL, stale.reason


DRAFTED = [
    "gqa-h32/8-d128-bf16-p16:3000+tree(4x2)x2,1000+tree(4x2)@0",
    "gqa-h32/8-d128-bf16-p16-w4-edges:10+tree(1x12),5+tree[-1.0.1.2.3.4.5.2.7.8.9]@0",
]


@pytest.mark.parametrize("text", DRAFTED)
def test_the_tree_draft_loop_passes_triton_and_fails_its_planted_defects(text):
    """Each level's step its own graph, replayed in order with build before each replay:
    triton's masks made in every build pass; kept from the first build, or dropped, fail."""
    from conformance.checks.draft_loop import DraftLoopCheck
    from tests.planted.tree_defects import triton_tree_as_chain

    cuda, case = torch.device("cuda"), parse_case(text)
    result = judge(DraftLoopCheck(), TritonAttentionBackend, case, cuda)
    assert result.verdict == Verdict.PASS and "tree draft steps" in result.reason, result.reason
    for defect in (triton_tree_kept_from_first_build(), triton_tree_as_chain()):
        failed = judge(DraftLoopCheck(), defect, case, cuda)
        assert failed.verdict == Verdict.FAIL and failed.reason.startswith("tree draft step "), failed.reason
