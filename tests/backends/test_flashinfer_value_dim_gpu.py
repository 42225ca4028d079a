"""FlashInfer's FA2 on a GPU for MLA prefill's layer (qk 192, v 128) and the log-sum-exp: numerics
on DeepSeek-V3's prefill layer and a decode of that layer under CUDA graphs (the graph prefill
wrapper), the decode wrapper's base-2 LSE converted, and the engine's MLA model whose prefill runs
through FlashInfer beside a built-in that decodes."""

import pytest
import torch

from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DEEPSEEK_PREFILL = "mha-h16-d192/128-bf16-p64-scale0.13524-lse:200+64,0+100,1024+1"
VALUE_DIM_DECODE = "mha-h8-d192/128-bf16-p16-lse:100+1,30+1,7+1"


def flashinfer_backend():
    from backends.flashinfer.gqa import FlashInferBackend

    reason = FlashInferBackend.availability_reason(CUDA)
    if reason:
        pytest.skip(reason)
    return FlashInferBackend


@pytest.mark.parametrize(
    "case_text",
    [
        DEEPSEEK_PREFILL,
        VALUE_DIM_DECODE,
        "gqa-h8/2-d128-bf16-p16-lse:100+1,30+1,0+40",
        "gqa-h8/2-d128-bf16-p16-lse:300+1,50+1",
    ],
)
def test_numerics_and_lse(case_text):
    result = judge(NumericsCheck(), flashinfer_backend(), parse_case(case_text), CUDA)
    assert result.verdict == Verdict.PASS, result.reason


def test_a_value_dim_decode_under_cuda_graphs():
    result = judge(GraphsCheck(), flashinfer_backend(), parse_case(VALUE_DIM_DECODE.replace("-lse", "")), CUDA)
    assert result.verdict == Verdict.PASS, result.reason


def test_the_engine_runs_mla_prefill_through_flashinfer():
    backend = flashinfer_backend()
    case = parse_case(DEEPSEEK_PREFILL)
    check = EngineCheck()
    assert check.case_skip_reason(backend, case, CUDA) is None
    result = judge(check, backend, case, CUDA)
    assert result.verdict == Verdict.PASS, result.reason
    assert "flashinfer (MLA prefill, decompressed) served" in result.reason, result.reason
