"""``bigpool`` at its real size on a GPU: every owned block past 2**31 elements of its plane. A
read whose offset is computed in 32 bits fails there and passes the same batch in a small pool;
our Triton backends (offsets widened to 64 bits) pass both."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from backends.triton.backend import TritonAttentionBackend
from backends.triton.mla_backend import TritonMLABackend
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import big_pool_skip_reason
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.input_defects import Int32ElementOffsets

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GQA = "gqa-h32/8-d128-bf16-p16-bigpool:1+1,700+1,63+4"
MLA = "mla-h16-d512+64-bf16-p64-bigpool:1+1,700+1,64+4"


def numerics(backend, case_id):
    case = parse_case(case_id)
    if big_pool_skip_reason(case, CUDA):
        pytest.skip(big_pool_skip_reason(case, CUDA))
    return judge(NumericsCheck(), backend, case, CUDA)


@pytest.mark.parametrize("case_id", [GQA, MLA], ids=["gqa", "mla"])
def test_32_bit_offsets_fail_only_in_the_big_pool(case_id):
    assert numerics(Int32ElementOffsets, case_id.replace("-bigpool", "")).verdict == Verdict.PASS
    assert numerics(TorchNaiveBackend, case_id).verdict == Verdict.PASS
    result = numerics(Int32ElementOffsets, case_id)
    assert result.verdict == Verdict.FAIL and "beyond tolerance" in result.reason, result.reason


@pytest.mark.parametrize(
    "backend,case_id", [(TritonAttentionBackend, GQA), (TritonMLABackend, MLA)], ids=["triton", "triton_mla"]
)
def test_our_triton_backends_pass_the_big_pool(backend, case_id):
    result = numerics(backend, case_id)
    assert result.verdict == Verdict.PASS, result.reason
