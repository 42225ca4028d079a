"""Token trees under CUDA graphs, on a GPU: triton's tree masks made in every build pass the
graphs check (whose replays hand other trees of the same sizes), and triton keeping the first
build's masks fails it."""

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
