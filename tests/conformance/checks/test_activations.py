"""Activation-like case data: per-channel means, an outlier value channel, heavy-tailed value
tokens, exact in every dtype; and the blind spot they close: an accumulator kept in the input
dtype across KV tiles passes zero-mean data at every length and fails these, by more the longer
the context (the margins the standard suite's long cases are sized by)."""

import pytest
import torch

import conformance.harness.batch as batch_module
from conformance.cases.case_data import HEAVY_EVERY, HEAVY_OFFSET, OUTLIER_VALUE_CHANNEL, OUTLIER_VALUE_MEAN
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.harness.batch import materialize
from conformance.harness.comparison import TOLERANCES
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.input_defects import AccumulatesInInputDtype

CPU = torch.device("cpu")


def test_values_have_channel_means_an_outlier_channel_and_heavy_tokens():
    batch = materialize(parse_case("gqa-h4/2-d64-bf16-p16:4000+1@0"), CPU)
    value, key = batch.values[0].float(), batch.keys[0].float()
    assert abs(value[..., OUTLIER_VALUE_CHANNEL].mean() - OUTLIER_VALUE_MEAN) < 0.2
    assert abs(value[..., 3].mean() + 1.0) < 0.2 and abs(value[..., 0].mean()) < 0.2  # channel 0: no mean
    heavy = value[HEAVY_OFFSET::HEAVY_EVERY, :, 3].std()
    assert 3.0 < heavy / value[HEAVY_OFFSET + 1 :: HEAVY_EVERY, :, 3].std() < 5.0
    assert abs(key[..., 4].mean() - 0.5) < 0.1  # keys: small means
    latent = materialize(parse_case("mla-h4-d64+16-bf16-p16:2000+1@0"), CPU).keys[0].float()
    assert abs(latent[:, OUTLIER_VALUE_CHANNEL].mean() - OUTLIER_VALUE_MEAN) < 0.2


def margin(case_text: str) -> tuple[Verdict, float]:
    """The verdict and the worst element's error over its allowed error."""
    case = parse_case(case_text)
    result = judge(NumericsCheck(), AccumulatesInInputDtype, case, CPU)
    atol, rtol = TOLERANCES[case.spec.dtype]
    got = float(result.reason.split("got ")[1].split(",")[0]) if "got " in result.reason else 0.0
    expected = float(result.reason.split("expected ")[1].rstrip(")")) if "expected " in result.reason else 1.0
    return result.verdict, abs(got - expected) / (atol + rtol * abs(expected))


@pytest.mark.parametrize(
    "case_text,at_least",
    [
        ("gqa-h4/2-d64-bf16-p16:4096+1,4000+1@0", 1.2),
        ("gqa-h4/2-d64-bf16-p16:16384+1@0", 10.0),
        ("gqa-h4/2-d64-fp16-p16:32768+1@0", 5.0),
    ],
)
def test_a_half_precision_accumulator_fails_activation_like_data(case_text, at_least):
    verdict, ratio = margin(case_text)
    assert verdict == Verdict.FAIL and ratio >= at_least, ratio


@pytest.mark.slow
def test_zero_mean_data_hid_it_at_every_length(monkeypatch):
    monkeypatch.setattr(batch_module, "shape_activations", lambda case, keys, values: None)
    for case_text in (
        "gqa-h4/2-d64-bf16-p16:4096+1,4000+1@0",
        "gqa-h4/2-d64-bf16-p16:32768+1@0",
        "gqa-h4/2-d64-fp16-p16:32768+1@0",
    ):
        assert margin(case_text)[0] == Verdict.PASS, case_text
