"""The contract's features as data: one table (``backends.features``), one rule table
(``Capabilities.skip_reason``), claims serialised from the fields. A feature added in a test is
claimed, refused with its reason, and listed, with no other code touched."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from backends.base import Capabilities, DeviceInfo, GpuLimit, OnlyWith
from backends.features import (
    EMPTY_REQUESTS,
    FEATURES,
    FP8_DS_MLA,
    FP8_E4M3,
    FP8_E5M2,
    LSE,
    SPARSE_TOPK,
    Needs,
    by_name,
    feature,
)
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck

CPU = torch.device("cpu")
H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))
ON_CPU = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))


@pytest.fixture
def odd_heads():
    """A feature this project does not have: an odd number of query heads."""
    row = feature("odd_heads", "an odd number of query heads", lambda needs: needs.spec.num_heads % 2 == 1)
    yield row
    del FEATURES[row.name]


def test_a_feature_added_to_the_table_is_refused_claimed_and_listed_with_no_other_code(odd_heads):
    odd, even = parse_case("gqa-h3/1-d16-fp32:8+1"), parse_case("gqa-h4/1-d16-fp32:8+1")
    assert ON_CPU.skip_reason(odd.needs, CPU) == "an odd number of query heads not supported"
    assert ON_CPU.skip_reason(even.needs, CPU) is None  # a case that does not ask is not touched
    why = dataclasses.replace(ON_CPU, not_claimed={odd_heads: "its tiles are pairs of heads"})
    assert why.skip_reason(odd.needs, CPU) == "an odd number of query heads not supported: its tiles are pairs of heads"
    claimed = dataclasses.replace(ON_CPU, features=frozenset({odd_heads}))
    assert claimed.skip_reason(odd.needs, CPU) is None
    assert claimed.to_dict()["features"] == ["odd_heads"]
    assert why.to_dict()["not_claimed"] == {"odd_heads": "its tiles are pairs of heads"}
    # Every check plans through the same table.
    naive = type("Naive", (TorchNaiveBackend,), {"capabilities": why})
    assert NumericsCheck().plan(naive, [odd, even], CPU) == {
        odd.id: "an odd number of query heads not supported: its tiles are pairs of heads",
        even.id: None,
    }


def test_the_table_holds_every_feature_a_case_can_ask_and_names_are_unique():
    assert {"fp8_e4m3_kv_cache", "fp8_e5m2_kv_cache", "attention_sinks", "lse", "empty_requests"} <= set(FEATURES)
    with pytest.raises(ValueError, match="already in the table"):
        feature("lse", "again", lambda needs: False)
    assert by_name("lse") is LSE
    with pytest.raises(ValueError, match="unknown feature 'trees'"):
        by_name("trees")


def test_each_case_attribute_asks_for_its_feature():
    asked = {
        "gqa-h8/2-d64-bf16-fp8e4m3:30+4": {FP8_E4M3},
        "gqa-h8/2-d64-bf16-fp8e5m2:30+4": {FP8_E5M2},
        "gqa-h8/2-d64-bf16-lse:30+4": {LSE},
        "gqa-h8/2-d64-bf16:0+0,30+4": {EMPTY_REQUESTS},
        "gqa-h8/2-d64-bf16:30+4": set(),
    }
    for text, features in asked.items():
        needs = parse_case(text).needs
        assert {row for row in FEATURES.values() if row.asked(needs)} == features, text


def test_a_claimed_feature_on_fewer_gpus_says_which_and_why():
    spec = parse_case("gqa-h8/2-d64-bf16-fp8e4m3:30+4").spec
    caps = Capabilities(
        features=frozenset({FP8_E4M3}),
        feature_gpus={FP8_E4M3: GpuLimit(frozenset({(9, 0)}), "its FA3 kernels")},
    )
    assert caps.skip_reason(Needs(spec), H100) is None
    assert caps.skip_reason(Needs(spec), A100) == (
        "KV cache fp8e4m3 needs compute capability SM90 (its FA3 kernels); this GPU (NVIDIA A100) is SM80"
    )


def test_a_feature_claimed_only_with_another_says_why_without_it():
    sparse = parse_case("mla-h4-d512+16-bf16-fp8dsmla-p16-topk16:40+1").needs
    dense = parse_case("mla-h4-d512+16-bf16-fp8dsmla-p16:40+1").needs
    caps = Capabilities(
        kinds=frozenset({"mla"}),
        features=frozenset({FP8_DS_MLA, SPARSE_TOPK}),
        feature_only_with={FP8_DS_MLA: OnlyWith(frozenset({SPARSE_TOPK}), "its sparse kernel alone reads it")},
    )
    assert caps.skip_reason(sparse, H100) is None
    assert caps.skip_reason(dense, H100) == (
        f"{FP8_DS_MLA.words(dense)} not supported without sparse_topk: its sparse kernel alone reads it"
    )
    assert caps.to_dict()["feature_only_with"] == {
        "fp8_ds_mla_kv_cache": {"features": ["sparse_topk"], "why": "its sparse kernel alone reads it"}
    }
    with pytest.raises(ValueError, match="feature_only_with names fp8_ds_mla_kv_cache, not claimed in features"):
        Capabilities(feature_only_with={FP8_DS_MLA: OnlyWith(frozenset({SPARSE_TOPK}))})


def test_a_reason_for_a_claimed_feature_is_a_contradiction():
    with pytest.raises(ValueError, match="not_claimed names lse, claimed in features"):
        Capabilities(features=frozenset({LSE}), not_claimed={LSE: "why"})


def test_claims_serialise_every_field_by_name():
    claims = TorchNaiveBackend.capabilities.to_dict()
    assert set(claims) == {field.name for field in dataclasses.fields(Capabilities)}
    assert json.loads(json.dumps(claims)) == claims
    assert claims["cuda_graphs"] == "NEVER" and claims["dtypes"] == ["bf16", "fp16", "fp32"]
    assert "lse" in claims["features"] and claims["compute_capabilities"] is None
