"""The layer kinds as objects: what differs between MHA/GQA and absorbed MLA is asked of
``AttentionSpec.layout``, and each answer agrees with the contract's shapes."""

from __future__ import annotations

import pytest
import torch

from backends.base import AttentionSpec
from backends.layer_kinds import LAYER_KINDS

GQA = AttentionSpec("mha", num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, value_head_dim=32)
MLA = AttentionSpec("mla", num_heads=4, num_kv_heads=1, head_dim=40, dtype=torch.bfloat16, kv_lora_rank=32, rope_dim=8)


def test_each_kind_answers_for_its_layout():
    assert GQA.layout is LAYER_KINDS["mha"] and MLA.layout is LAYER_KINDS["mla"]
    assert (GQA.v_head_dim, MLA.v_head_dim) == (32, 32)
    assert GQA.layout.key_shape(GQA, 5) == (5, 2, 64) and GQA.layout.value_shape(GQA, 5) == (5, 2, 32)
    assert MLA.layout.key_shape(MLA, 5) == (5, 40) and MLA.layout.value_shape(MLA, 5) is None
    assert (GQA.layout.cache_row(GQA), MLA.layout.cache_row(MLA)) == (256, 40)
    assert (GQA.layout.scales(0.5, 2.0), MLA.layout.scales(0.5, 2.0)) == ((0.5, 2.0), (0.5, 0.5))


def test_what_a_head_weighs():
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 32)
    assert torch.equal(GQA.layout.head_values(GQA, key, value, 5), value[:, 1])  # head 5 of 8 reads KV head 1
    assert torch.equal(GQA.layout.value_heads(GQA, key, value), value)
    latent = torch.randn(5, 40)
    assert torch.equal(MLA.layout.head_values(MLA, latent, None, 3), latent[:, :32])
    assert MLA.layout.key_heads(latent).shape == (5, 1, 40)
    assert torch.equal(MLA.layout.value_heads(MLA, latent, None)[:, 0], latent[:, :32])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 2, "num_heads": 4}, "one latent KV head"),
        ({"rope_dim": 4}, "head_dim must equal"),
        ({"value_head_dim": 16}, "value_head_dim is an MHA/GQA layer's"),
        ({"attention_sinks": True}, "not MLA's"),
    ],
)
def test_an_mla_spec_it_cannot_have_is_refused(changes, message):
    fields = dict(num_heads=4, num_kv_heads=1, head_dim=40, dtype=torch.bfloat16, kv_lora_rank=32, rope_dim=8)
    with pytest.raises(ValueError, match=message):
        AttentionSpec("mla", **{**fields, **changes})


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of 'mha', 'mla', 'indexer', not 'gla'"):
        AttentionSpec("gla", num_heads=4, num_kv_heads=1, head_dim=40, dtype=torch.bfloat16)
