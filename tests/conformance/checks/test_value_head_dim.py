"""A value head dim other than the query/key one (``dQK/V``; DeepSeek-V3's MLA prefill as vLLM
runs it, 192 / 128): the grammar, the claim, torch_naive against the oracle, and a planted value
offset that only a distinct value dim exposes."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.suites import suite
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.graph_backends import TorchGraphSafe
from tests.planted.value_dim_defects import ValueOffsetFromValueDim

CPU = torch.device("cpu")
DEEPSEEK = "mha-h4-d192/128-bf16-p64-scale0.13524:30+4,0+40,100+1"


def test_the_grammar_gives_query_key_and_value_head_dims():
    case = parse_case(DEEPSEEK)
    assert (case.spec.head_dim, case.spec.v_head_dim) == (192, 128) and parse_case(case.id) == case
    assert parse_case("gqa-d128/128:1+1").spec == parse_case("gqa-d128:1+1").spec  # the same dim twice is one
    batch = materialize(case, CPU)
    assert (
        batch.keys[0].shape[-1] == 192
        and batch.values[0].shape[-1] == 128
        and batch.reference_output().shape[-1] == 128
    )
    with pytest.raises(CaseSyntaxError):
        parse_case("mla-d512/128:1+1")
    assert any(c.spec.v_head_dim != c.spec.head_dim and c.spec.kind == "mha" for c in suite("standard"))


def test_torch_naive_claims_it_and_a_backend_without_the_claim_says_why():
    from backends.base import DeviceInfo

    spec = parse_case(DEEPSEEK).spec
    h200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    assert "value head dim (128)" in TorchGraphSafe.unsupported_reason(spec, h200)
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(DEEPSEEK), CPU)
    assert result.verdict == Verdict.PASS, result.reason


def test_a_value_offset_taken_from_the_value_dim_fails_only_where_the_dims_differ():
    result = judge(NumericsCheck(), ValueOffsetFromValueDim, parse_case(DEEPSEEK), CPU)
    assert result.verdict == Verdict.FAIL and result.metrics["tolerance_ratio"] > 10, result.reason
    same = judge(NumericsCheck(), ValueOffsetFromValueDim, parse_case("mha-h4-d64-bf16:30+4,0+40"), CPU)
    assert same.verdict == Verdict.PASS, same.reason
