"""The fp8 query (``backends.base``: "fp8 query"): the grammar, what the harness hands (the
contract's e4m3 quantization of the drawn query) and what the oracle attends with (it dequantized
by the layer's own q scale), torch_naive and triton passing, and each planted fp8-query defect
failing by a wide margin."""

import pytest
import torch

from backends.base import DeviceInfo
from backends.features import FP8_QUERY
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.kv_quantization import DEFAULT_Q_SCALE
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.harness.coverage import PARAMETERS
from conformance.harness.step import case_scales, layer_batch
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.interpreted import numerics_verdicts
from tests.planted import fp8_query_defects

CPU = torch.device("cpu")
CASES = [
    "gqa-h8/2-d64-qfp8:100+1,30+4,0+20",  # decode, verify and a prefill in one batch
    "gqa-h8/2-d64-fp16-qfp8-fp8e4m3:300+1,40+4",  # with an fp8 cache
    "mla-h16-d512+64-qfp8:200+1,20+4",
    "gqa-h8/2-d64-qfp8-attnsinks-lse-strided:50+3,9+1",
    "gqa-h8/2-d64-qfp8-w16-edges:100+tree(2x2),40+1",
]


def test_the_grammar_round_trips_and_refuses_an_indexers_fp8_query():
    case = parse_case("gqa-h8/2-d64-fp16-fp8e4m3-qfp8:10+4@3")
    assert parse_case(case.id) == case and case.spec.fp8_query and case.q_scale == DEFAULT_Q_SCALE
    assert parse_case("gqa:1+1").q_scale is None and not parse_case("gqa:1+1").spec.fp8_query
    with pytest.raises(CaseSyntaxError, match="an attention layer's"):
        parse_case("indexer-h64-d128-qfp8-topk64:100+1")
    with pytest.raises(CaseSyntaxError, match="given twice"):
        parse_case("gqa-qfp8-qfp8:1+1")


def test_the_query_is_handed_quantized_and_each_layer_dequantizes_it_with_its_own_scale():
    case = parse_case(CASES[0])
    batch = materialize(case, CPU)
    assert batch.query.dtype == torch.float8_e4m3fn and batch.query_scale == DEFAULT_Q_SCALE
    assert torch.equal(batch.query_values(), batch.query.double() * DEFAULT_Q_SCALE)
    scales = case_scales(case, CPU)
    assert (scales.q_scale, scales.k_scale, scales.v_scale) == (DEFAULT_Q_SCALE, 1.0, 1.0)
    assert scales.q_scale_tensor.item() == pytest.approx(DEFAULT_Q_SCALE)
    second = layer_batch(batch, 1)
    assert second.query is batch.query and second.query_scale == case_scales(case, CPU, layer=1).q_scale
    assert second.query_scale == pytest.approx(2.5 * DEFAULT_Q_SCALE)
    # What the kernel is handed is e4m3 numbers, within the format's range, of every magnitude.
    stored = batch.query.float().abs()
    assert stored.max() <= 448 and (stored > 1).float().mean() > 0.5


def test_the_q_scale_is_a_layer_parameter_the_output_depends_on():
    parameter = next(p for p in PARAMETERS if p.name == "fp8 q_scale")
    batch = materialize(parse_case(CASES[0]), CPU)
    assert parameter.applies(batch.case) and float(parameter.how_wrong(batch).max()) > 5


@pytest.mark.parametrize("text", CASES)
def test_torch_naive_passes(text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    "defect,text,says",
    [
        (fp8_query_defects.QScaleDropped, CASES[0], "beyond tolerance"),
        (fp8_query_defects.QScaleDroppedInDecodeRows, "gqa-h8/2-d64-qfp8:100+1,30+4,9+1", "beyond tolerance"),
        (fp8_query_defects.KeyScaleFromTheQuery, CASES[1], "stored"),
        (fp8_query_defects.KeepsFirstQScale, CASES[0], "fp8 scales q 0.125 instead of the first layer's"),
        (fp8_query_defects.QScaleDropped, CASES[2], "beyond tolerance"),
    ],
)
def test_each_planted_fp8_query_defect_fails_numerics(defect, text, says):
    result = judge(NumericsCheck(), defect, parse_case(text), CPU)
    assert result.verdict == Verdict.FAIL and says in result.reason, result.reason
    if says == "beyond tolerance":  # wide: a dropped scale moves every score 20-fold
        assert result.metrics["tolerance_ratio"] > 5, result.metrics


def test_decode_rows_only_defect_passes_a_case_without_decode_rows():
    """Why the suite's fp8-query cases hold decode rows: without them the defect is invisible."""
    result = judge(
        NumericsCheck(), fp8_query_defects.QScaleDroppedInDecodeRows, parse_case("gqa-h8/2-d64-qfp8:100+4,30+4"), CPU
    )
    assert result.verdict == Verdict.PASS, result.reason


def test_a_backend_without_the_claim_says_exactly_why():
    from backends.registry import BUILTIN_BACKENDS, load

    h200 = DeviceInfo("cuda", "H200", (9, 0))
    for name in BUILTIN_BACKENDS:
        claims = load(name).capabilities
        if FP8_QUERY in claims.features or not claims.kinds & {"mha", "mla"}:  # an indexer's query is no case's
            continue
        reason = claims.feature_reason(parse_case("gqa-qfp8:1+1").needs, h200) or ""
        assert FP8_QUERY in claims.not_claimed, f"{name} says nothing of the fp8 query"
        assert reason.startswith("an fp8 query") and len(reason) > 60, (name, reason)


# triton's kernels under Triton's CPU interpreter: an fp8 query through the split decode kernel
# and the prefill kernel, with an fp8 cache, sinks and the LSE; and the same kernels handed a
# query scale of 1, FAIL.
TRITON_CASES = [
    "gqa-h4/2-d64-fp32-qfp8:40+1,10+3,0+12",
    "gqa-h4/2-d64-bf16-qfp8-fp8e4m3-attnsinks-lse:30+1,7+4",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,verdict",
    [
        ("backends.triton.backend:TritonAttentionBackend", "PASS"),
        ("tests.planted.fp8_query_defects:triton_q_scale_dropped", "FAIL"),
    ],
)
def test_triton_kernels_under_the_interpreter(backend, verdict):
    assert numerics_verdicts(backend, TRITON_CASES) == [verdict] * len(TRITON_CASES)


@pytest.mark.parametrize("text", ["gqa-h8/2-d64-qfp8:100+1,30+4", "mla-h16-d128+32-qfp8:50+1,20+4"])
def test_the_engine_hands_each_layer_its_query_quantized(text):
    """The engine check's model quantizes each layer's query with its own q scale: torch_naive
    passes, and a backend that drops the scale, or keeps the first layer's, decodes other tokens."""
    from conformance.checks.engine import EngineCheck

    case = parse_case(text)
    assert judge(EngineCheck(), TorchNaiveBackend, case, CPU).verdict == Verdict.PASS
    for defect in (fp8_query_defects.QScaleDropped, fp8_query_defects.KeepsFirstQScale):
        result = judge(EngineCheck(), defect, case, CPU)
        assert result.verdict == Verdict.FAIL and "instead of" in result.reason, result.reason
