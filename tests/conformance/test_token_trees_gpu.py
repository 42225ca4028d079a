"""Token trees on a GPU: triton's tree masks made in every build pass the graphs check (whose
replays hand other trees of the same sizes) and the tree draft loop, and triton keeping the
first build's masks fails both; trtllm's XQA draft masks pass numerics over trees and chains,
and fail with the tree dropped or the mask's bits reversed."""

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


TRTLLM = [
    "gqa-h32/8-d128-bf16-p16:3000+tree(4x2)x2,1000+tree(4x2)",
    "gqa-h32/8-d128-bf16-p16:3000+tree(4x2),700+tree[-1.0.0.0.1.1.2.4.5],2000+1x2,0+40,300+4",
    "gqa-h32/8-d128-bf16-p16:700+tree(2x5),40+1",  # 63 tokens: the mask's high word
    "gqa-h64/4-d128-fp16-p32-attnsinks:1200+tree(4x2),300+1",
]


def xqa_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not xqa_here(), reason="needs flashinfer on an SM90 GPU")
@pytest.mark.parametrize("text", TRTLLM)
def test_trtllm_passes_trees_through_xqa_draft_masks_and_fails_them_dropped_or_reversed(text):
    from backends.flashinfer.trtllm import TrtllmBackend
    from conformance.checks.numerics import NumericsCheck
    from tests.planted.tree_defects import trtllm_masks_bit_reversed, trtllm_tree_as_chain

    cuda, case = torch.device("cuda"), parse_case(text)
    result = judge(NumericsCheck(), TrtllmBackend, case, cuda)
    assert result.verdict == Verdict.PASS, result.reason
    for defect in (trtllm_tree_as_chain(), trtllm_masks_bit_reversed()):
        failed = judge(NumericsCheck(), defect, case, cuda)
        assert failed.verdict == Verdict.FAIL, failed.reason
