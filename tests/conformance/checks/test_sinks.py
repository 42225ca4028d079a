"""Learned attention sinks (``attnsinks``): the grammar, the oracle against an independent
formula, torch_naive against the oracle on every path, and the planted sink defects each failing
numerics on the path it breaks."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.case_data import sink_logits
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.oracle import attention_reference
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import sink_defects

CPU = torch.device("cpu")
DECODE = "gqa-h8/2-d64-bf16-attnsinks:1+1,30+1,200+1"
PREFILL = "gqa-h8/2-d64-bf16-attnsinks:11+4,0+40"


def test_the_grammar_names_learned_sinks_apart_from_the_large_logit_data():
    case = parse_case("gqa-h8/2-d64-w32-attnsinks-outliers:30+4")
    assert case.spec.attention_sinks and case.data == "outliers" and parse_case(case.id) == case
    with pytest.raises(CaseSyntaxError, match="'outliers' for the large-logit data profile.*'attnsinks'"):
        parse_case("gqa-sinks:1+1")  # the old spelling of the data profile: neither, silently
    with pytest.raises(CaseSyntaxError, match="not MLA's"):
        parse_case("mla-attnsinks:1+1")


def test_the_sinks_belong_to_the_layer_and_differ_within_a_kv_group():
    spec = parse_case(DECODE).spec
    sinks = sink_logits(spec)
    assert sinks.dtype == torch.float32 and sinks.shape == (8,) and torch.equal(sinks, sink_logits(spec))
    assert torch.equal(materialize(parse_case(PREFILL), CPU).sinks, sinks)  # another batch, the same layer
    assert (sinks.view(2, 4) != sinks.view(2, 4)[:, :1]).any(dim=1).all()  # a KV head's query heads differ
    assert (sinks * 4 == (sinks * 4).round()).all() and sinks.max() >= 8  # exact quarters, some large


def test_the_oracle_weighs_the_sink_as_a_key_that_has_no_value():
    """Against the formula written out per head: the sink adds exp(sink) to the denominator only."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(shape, generator=generator, dtype=torch.float64) for shape in ((3, 4, 8), (7, 2, 8), (7, 2, 8))
    )
    sinks = torch.tensor([0.5, 3.0, -1.0, 9.0])
    scale = 0.3
    got = attention_reference(query, key, value, context_len=4, scale=scale, sinks=sinks)
    for head in range(4):
        kv = head // 2
        logits = (query[:, head] @ key[:, kv].T) * scale  # [3, 7]
        visible = torch.arange(7)[None, :] <= 4 + torch.arange(3)[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        weights = torch.exp(logits)
        expected = (weights @ value[:, kv]) / (weights.sum(-1, keepdim=True) + torch.exp(sinks[head].double()))
        torch.testing.assert_close(got[:, head], expected)


@pytest.mark.parametrize(
    "case_text",
    [
        DECODE,
        PREFILL,
        "gqa-h8/2-d64-fp16-w16-attnsinks-edges:0+40,30+1",
        "gqa-h8/2-d64-bf16-fp8e4m3-attnsinks:30+4,0+20",
    ],
)
def test_torch_naive_attends_with_the_sinks_on_every_path(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    ("defect", "caught_on_decode"),
    [
        (sink_defects.IgnoresSinksInPrefill, False),
        (sink_defects.AddsSinkToNumerator, True),
        (sink_defects.ReadsSinksPerKVHead, True),
    ],
)
def test_planted_sink_defects_fail_numerics_by_a_wide_margin_on_the_path_they_break(defect, caught_on_decode):
    prefill = judge(NumericsCheck(), defect, parse_case(PREFILL), CPU)
    assert prefill.verdict == Verdict.FAIL and prefill.metrics["tolerance_ratio"] > 10, prefill.reason
    decode = judge(NumericsCheck(), defect, parse_case(DECODE), CPU)
    assert (decode.verdict == Verdict.FAIL) == caught_on_decode, decode.reason


def test_a_backend_without_the_claim_skips_a_sinks_case_saying_so():
    from backends.base import DeviceInfo
    from tests.planted.graph_backends import TorchGraphSafe

    h200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    assert TorchGraphSafe.unsupported_reason(parse_case(DECODE).spec, h200) == "learned attention sinks not supported"
    assert TorchNaiveBackend.unsupported_reason(parse_case(DECODE).spec, CPU) is None


@pytest.mark.gpu
def test_flashinfer_handed_the_sinks_fails_numerics_on_a_gpu():
    """Why flashinfer does not claim learned sinks: given them, its FA2 wrappers answer as if
    there were none (the class of vLLM #52148), and numerics says so."""
    cuda = torch.device("cuda")
    case = parse_case("gqa-h8/2-d128-bf16-attnsinks:1+1,30+1,200+1")  # head dim 128: the kernels the GPU bundle ships
    if not torch.cuda.is_available() or sink_defects.FlashInferClaimingSinks.unsupported_reason(case.spec, cuda):
        pytest.skip("needs a GPU with flashinfer")
    result = judge(NumericsCheck(), sink_defects.FlashInferClaimingSinks, case, cuda)
    assert result.verdict == Verdict.FAIL and result.metrics["tolerance_ratio"] > 10, result.reason


def test_the_engine_runs_a_model_whose_layers_have_sinks_and_catches_sinks_dropped_in_prefill():
    from conformance.checks.engine import EngineCheck
    from conformance.harness.engine_model import model_and_prompts

    case = parse_case("gqa-h8/2-d64-bf16-attnsinks:1+1")
    model, _ = model_and_prompts(case, CPU, (4,))
    assert all(layer.sinks.dtype == torch.float32 and layer.sinks.shape == (8,) for layer in model.layers)
    assert judge(EngineCheck(), TorchNaiveBackend, case, CPU).verdict == Verdict.PASS
    # Verifying k + 1 tokens takes the prefill path, where the sinks go missing: the tokens change.
    result = judge(EngineCheck(), sink_defects.IgnoresSinksInPrefill, case, CPU)
    assert result.verdict == Verdict.FAIL, result.reason
