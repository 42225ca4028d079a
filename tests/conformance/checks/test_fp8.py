"""The fp8 KV cache: the contract's quantization, the grammar, the two questions numerics asks
(what write_kv stored, what forward computed from it), torch_naive passing them, and each planted
fp8 defect failing by a wide margin."""

import pytest
import torch

from backends.base import AttentionSpec, Capabilities
from backends.features import FP8_E4M3
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.kv_quantization import quantize, ulps_apart
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import fp8_defects

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_quantize_divides_rounds_to_nearest_even_and_saturates():
    values = torch.tensor([0.1 * 1.0625, 0.1 * 1.1875, 0.1 * 1000, -0.1 * 1000, 0.1 * 0.001, float("nan")])
    stored = quantize(values, 0.1, E4M3).float()
    # 1.0625 lies halfway between 1 and 1.125: even is 1; 1.1875 between 1.125 and 1.25: even is 1.25.
    assert stored[:4].tolist() == [1.0, 1.25, 448.0, -448.0]
    assert stored[4] == 2**-9 and torch.isnan(stored[5])  # the smallest subnormal; NaN stays NaN
    assert quantize(torch.tensor([1e6]), 1.0, E5M2).float().item() == 57344.0  # saturated, not inf


def test_ulps_count_fp8_numbers_between_two_stored_values():
    a = torch.tensor([1.0, 1.0, -0.0, 448.0, 2**-9]).to(E4M3)
    b = torch.tensor([1.125, 1.375, 0.0, -448.0, -(2**-9)]).to(E4M3)
    assert ulps_apart(a, b).tolist() == [1, 3, 0, 252, 2]


@pytest.mark.parametrize(
    "text,message",
    [
        ("gqa-kscale2:1+1", "fp8 cache's scales"),
        ("mla-fp8e4m3-vscale2:1+1", "one scale"),
        ("gqa-fp8e4m3-fp8e5m2:1+1", "both set the KV-cache dtype"),
        ("gqa-fp8e4m3-vscale0:1+1", "value scale 0: must be a finite number from 0.01 to 10000"),
        ("gqa-fp8e4m3-kscaleinf:1+1", "finite"),
        ("gqa-fp8e4m3-kscale0.00001:1+1", "key scale 0.00001: must be a finite number from 0.0001 to 10000"),
        ("gqa-fp16-fp8e4m3-kscale0.001:1+1", "from 0.01 to 10000 in fp16, whose range the data would run past"),
        ("gqa-fp16-kscale0.005:1+1", "fp8 cache's scales"),
    ],
)
def test_bad_fp8_cases_are_refused(text, message):
    with pytest.raises(CaseSyntaxError, match=message):
        parse_case(text)


def test_fp8_case_ids_round_trip_and_carry_their_scales():
    case = parse_case("gqa-h8/2-d64-fp16-fp8e5m2-kscale0.5:10+4@3")
    assert parse_case(case.id) == case and case.kv_scales == (0.5, 4.0)
    assert parse_case("mla-h4-d64+16-fp8e4m3:3+1").kv_scales == (0.1, 0.1)
    assert parse_case("gqa:1+1").kv_scales is None


def test_a_backend_without_the_claim_says_exactly_why():
    spec = parse_case("gqa-h8/2-d64-fp8e4m3:1+1").spec
    assert Capabilities(devices=frozenset({"cpu"})).unsupported_reason(spec, CPU) == "KV cache fp8e4m3 not supported"
    why = Capabilities(devices=frozenset({"cpu"}), not_claimed={FP8_E4M3: "its kernel computes in fp8"})
    assert why.unsupported_reason(spec, CPU) == "KV cache fp8e4m3 not supported: its kernel computes in fp8"
    assert TorchNaiveBackend.unsupported_reason(spec, CPU) is None
    with pytest.raises(ValueError, match="neither the compute dtype nor an fp8 format"):
        AttentionSpec("mha", 4, 2, 64, torch.bfloat16, kv_cache_dtype=torch.float16)


FP8_CASES = [
    "gqa-h4/2-d32-bf16-fp8e4m3-p16:40+1,20+4,0+9",
    "mla-h4-d32+8-bf16-fp8e4m3-p16:40+1,20+4",
    "gqa-h4/2-d32-fp16-fp8e5m2-p16:40+1,20+4",
    "gqa-h4/1-d64-fp16-fp8e4m3-p16-w24-pad0-edges:50+4,3+1,100+1",
    "gqa-h4/2-d64-bf16-fp8e4m3-p16-outliers-strided:40+1,20+4",
    "gqa-h4/2-d32-fp32-fp8e4m3-kscale0.03-vscale7:30+2",
    # Queries past fp16's range (the key scale's inverse), every score as usual.
    "gqa-h4/2-d32-bf16-fp8e4m3-kscale0.0001-p16:40+1,20+4,0+9",
    "mla-h4-d32+8-bf16-fp8e4m3-kscale0.0001-p16:40+1,20+4",
]


@pytest.mark.parametrize("case_text", FP8_CASES)
def test_torch_naive_passes_every_fp8_pass(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["nan-poison mismatched"] == 0


def test_the_data_use_the_fp8_range():
    """Some stored numbers saturate and some are subnormal, in keys and in values."""
    from conformance.harness.step import prepare_case
    from conformance.harness.stored_cache import _stored

    prepared = prepare_case(TorchNaiveBackend, parse_case("gqa-h4/2-d32-bf16-fp8e4m3-p16:200+1"), CPU)
    for stored in _stored(prepared, 0):
        magnitudes = stored.float().abs()
        assert (magnitudes == 448).sum() > 0 and ((magnitudes > 0) & (magnitudes < 2**-6)).sum() > 0


# Each planted defect, the cases it must fail, and what its reason starts with or contains.
DEFECTS = [
    (fp8_defects.DropsScaleOnDecode, FP8_CASES[:3], "elements beyond tolerance"),
    (fp8_defects.SwapsFp8Scales, [FP8_CASES[0], FP8_CASES[2]], "elements beyond tolerance"),
    (fp8_defects.ScalesTwiceOnRead, FP8_CASES[:3], "elements beyond tolerance"),
    (fp8_defects.TruncatesOnWrite, FP8_CASES[:3], "write_kv rounded"),
    (fp8_defects.NoSaturation, FP8_CASES[:2], "write_kv stored NaN where the contract saturates"),
    (fp8_defects.KeepsFirstLayerScales, FP8_CASES[:3], "a second layer"),
    (fp8_defects.RoundsQueryToFp16, FP8_CASES[6:], "NaN/Inf outputs"),
]


@pytest.mark.parametrize("defect,case_text,reason", [(d, c, r) for d, cases, r in DEFECTS for c in cases])
def test_each_planted_fp8_defect_fails_numerics(defect, case_text, reason):
    result = judge(NumericsCheck(), defect, parse_case(case_text), CPU)
    assert result.verdict == Verdict.FAIL and reason in result.reason, result.reason


def test_a_query_rounded_to_fp16_passes_the_usual_scales():
    """Why the suite holds cases with a key scale of 0.0001: at the usual scales every query is
    within fp16's range and a backend that rounds it there passes."""
    for case_text in FP8_CASES[:6]:
        result = judge(NumericsCheck(), fp8_defects.RoundsQueryToFp16, parse_case(case_text), CPU)
        assert result.verdict == Verdict.PASS, result.reason


def test_a_scale_applied_twice_fails_by_orders_of_magnitude():
    result = judge(NumericsCheck(), fp8_defects.ScalesTwiceOnRead, parse_case(FP8_CASES[0]), CPU)
    assert result.metrics["tolerance_ratio"] > 100


class DequantizesIntoComputeDtype(TorchNaiveBackend):
    """Not a defect: stored × scale rounded to the layer's dtype before the attention, as vLLM's
    Triton unified attention does."""

    def dequantize(self, stored, scale):
        return super().dequantize(stored, scale).to(self.spec.dtype).float()


@pytest.mark.parametrize(
    "case_text",
    [
        "mla-h16-d512+64-bf16-fp8e4m3-p64-edges:63+1,64+1,127+1,700+1",
        "gqa-h8/2-d128-bf16-fp8e4m3-p16-edges:1+1,16+1,100+1,1000+1,3000+1",
    ],
)
def test_dequantizing_into_the_compute_dtype_passes_where_exact_tolerance_alone_would_not(case_text):
    """A few large scores sharing the softmax make the rounding of every dequantized key up to 2.4×
    the output tolerance. Both ways of dequantizing follow the contract; the comparison adds the
    distance between the two oracles."""
    from conformance.harness.comparison import TOLERANCES, compare_with_oracle
    from conformance.harness.step import prepare_case, run_step
    from conformance.harness.stored_cache import oracle

    case = parse_case(case_text)
    prepared = prepare_case(DequantizesIntoComputeDtype, case, CPU)
    out = run_step(prepared, with_host_lengths=True)
    reference, allowance = oracle(prepared)
    atol, rtol = TOLERANCES[case.spec.dtype]
    starts = prepared.batch.query_start_loc
    assert not compare_with_oracle(out, reference, starts, atol, rtol)[0]  # the exact oracle alone: a false alarm
    assert compare_with_oracle(out, reference, starts, atol, rtol, allowance)[0]
    result = judge(NumericsCheck(), DequantizesIntoComputeDtype, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
