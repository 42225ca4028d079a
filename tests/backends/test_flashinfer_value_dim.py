"""FlashInfer's adapter for a layer with a value head dim of its own (MLA prefill's, qk 192 /
v 128) and for the log-sum-exp, its library faked; the kernels run in the GPU tests."""

import math

import torch

from backends.base import BackendLimits, LayerParameters
from backends.flashinfer.gqa import FlashInferBackend
from conformance.cases.grammar import parse_case
from conformance.harness.batch import materialize
from tests.backends.conftest import FakeWrapper


class LseWrapper(FakeWrapper):
    """Fills the log-sum-exp it is handed with 2.0 (base 2, as FlashInfer's decode kernel gives it)."""

    pages: list = []

    def run(self, query, pages, lse=None, **kwargs):
        super().run(lse=lse, **kwargs)
        self.pages = self.pages + [pages]
        if lse is not None:
            lse.fill_(2.0)


def test_flashinfer_runs_a_value_head_dim_of_its_own_through_fa2_with_its_lse_in_ln(fake_flashinfer, monkeypatch):
    """MLA prefill's layer (qk 192, v 128): [key | value] pages handed as a pair of views, every
    batch (decodes too, and the graph wrappers) through prefill wrappers planned with head_dim_vo;
    the LSE asked for in the natural log. An ordinary layer's decode LSE (base 2) is converted."""
    import flashinfer

    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", LseWrapper)
    monkeypatch.setattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", LseWrapper)
    case = parse_case("mha-h4/4-d192/128-bf16-p16:10+1,20+1")
    backend = FlashInferBackend(case.spec, BackendLimits(8, 64, 256), torch.device("cpu"))
    cache = backend.allocate_kv_cache(16)
    assert cache.shape == (16, 16, 4, 320)
    batch = materialize(case, "cpu")
    common = batch.common_metadata()
    key, value = torch.randn(2, 4, 192).bfloat16(), torch.randn(2, 4, 128).bfloat16()
    backend.write_kv(cache, key, value, common.slot_mapping)
    stored_k, stored_v = backend.read_kv(cache, common.slot_mapping)
    assert torch.equal(stored_k, key) and torch.equal(stored_v, value)
    metadata = backend.build_for_capture(
        common
    )  # a decode batch: the graph wrapper, FA2 prefill with a qo_indptr buffer
    (call,) = metadata.calls
    assert call.wrapper is backend.graph_decode[2] and call.wrapper.planned[-1]["head_dim_vo"] == 128
    lse = torch.zeros(2, 4)
    backend.forward(
        torch.zeros(2, 4, 192).bfloat16(),
        cache,
        metadata,
        torch.zeros(2, 4, 128).bfloat16(),
        layer=LayerParameters(lse=lse),
    )
    handed = call.wrapper.ran[-1]
    assert handed["lse_base"] == "ln" and handed["return_lse"] and torch.equal(lse, torch.full((2, 4), 2.0))
    keys, values = call.wrapper.pages[-1]
    assert keys.shape == (16, 16, 4, 192) and values.data_ptr() == cache[..., 192:].data_ptr()
    mixed = parse_case("mha-h4/4-d192/128-bf16-p16:10+1,0+30")
    assert [c.wrapper for c in backend.build(materialize(mixed, "cpu").common_metadata()).calls] == [backend.prefill]

    ordinary = FlashInferBackend(
        parse_case("gqa-h4/2-d128-bf16-p16:10+1").spec, BackendLimits(8, 64, 256), torch.device("cpu")
    )
    decode = parse_case("gqa-h4/2-d128-bf16-p16:10+1")
    metadata = ordinary.build(materialize(decode, "cpu").common_metadata())
    lse = torch.zeros(1, 4)
    ordinary.forward(
        torch.zeros(1, 4, 128).bfloat16(),
        ordinary.allocate_kv_cache(4),
        metadata,
        torch.zeros(1, 4, 128).bfloat16(),
        layer=LayerParameters(lse=lse),
    )
    assert "lse_base" not in metadata.calls[0].wrapper.ran[-1]
    torch.testing.assert_close(lse, torch.full((1, 4), 2.0 * math.log(2)))


def test_only_the_measured_pair_of_head_dims_is_claimed(monkeypatch):
    import importlib.util

    from backends.base import DeviceInfo

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    hopper = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    assert FlashInferBackend.unsupported_reason(parse_case("mha-h16-d192/128-bf16-p64:10+1").spec, hopper) is None
    assert "value head dim of 128" in FlashInferBackend.unsupported_reason(
        parse_case("mha-h16-d192-bf16-p64:10+1").spec, hopper
    )
    assert "not 128 / 64" in FlashInferBackend.unsupported_reason(
        parse_case("mha-h16-d128/64-bf16-p64:10+1").spec, hopper
    )
