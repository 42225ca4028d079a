"""The vendor adapters' fp8 KV cache on the CPU, their libraries faked: which formats each claims
and why the others are refused, the dtype each plans with, the scales each hands its kernel (host
floats or device tensors, the right one to the right argument), and what ``write_kv`` stores
(``read_kv`` gives it back). The kernels themselves run in the GPU tests."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import backends.flashinfer as flashinfer_adapters
from backends.base import BackendLimits, DeviceInfo, Fp8Scales, LayerParameters
from backends.flash_attn import FlashAttnBackend
from backends.flashinfer.gqa import FlashInferBackend
from backends.flashinfer.mla import FlashInferMLABackend
from backends.flashinfer.trtllm import TrtllmBackend
from backends.flashmla import FlashMLABackend
from backends.fp8 import to_cache
from conformance.cases.grammar import parse_case
from conformance.harness.batch import materialize
from tests.planted.fp8_defects import FlashInferMLAClaimingE4M3

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0))
E4M3 = "gqa-h4/2-d128-bf16-fp8e4m3-kscale0.05-vscale4-p16"
E5M2 = "gqa-h4/2-d128-fp16-fp8e5m2-p16"
MLA_E4M3 = "mla-h16-d512+64-bf16-fp8e4m3-kscale0.05-p64"
SCALES = Fp8Scales.on("cpu", 0.05, 4.0)


@pytest.fixture
def every_module_installed(monkeypatch):
    """Availability decided by the claims alone (the libraries are not on a CPU machine)."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())


def reason(backend_cls, case: str, device=H200) -> str | None:
    return backend_cls.unsupported_reason(parse_case(f"{case}:10+1").spec, device)


def test_each_adapter_claims_the_fp8_formats_its_library_takes_and_says_why_not_the_others(every_module_installed):
    assert reason(FlashInferBackend, E4M3) is None and reason(FlashInferBackend, E5M2) is None
    assert "computes in fp8" in reason(TrtllmBackend, E4M3) and "e5m2" in reason(TrtllmBackend, E5M2)
    assert "rounds the layer's scale to bf16" in reason(FlashInferMLABackend, MLA_E4M3)
    assert reason(FlashInferMLABackend, "mla-h16-d512+64-bf16-p64", B200) is None
    # The fp8 path it keeps (tested on a GPU through a subclass that claims it) runs on SM90 only.
    assert reason(FlashInferMLAClaimingE4M3, MLA_E4M3) is None and "SM90" in reason(
        FlashInferMLAClaimingE4M3, MLA_E4M3, B200
    )
    assert "descale_q" in reason(FlashMLABackend, MLA_E4M3)
    assert "q_descale" in reason(FlashAttnBackend, E4M3)


def run_once(backend_cls, case: str, scales: Fp8Scales | None):
    """Build, write every row and forward one batch of ``case``; the backend and its cache."""
    parsed = parse_case(case)
    batch = materialize(parsed, "cpu")
    backend = backend_cls(parsed.spec, BackendLimits(8, 64, 256), torch.device("cpu"))
    cache = backend.allocate_kv_cache(16)
    layer = LayerParameters(scales=scales)
    spec = parsed.spec
    tokens = batch.common_metadata().num_actual_tokens
    key = (
        torch.randn(tokens, spec.num_kv_heads, spec.head_dim)
        if spec.kind != "mla"
        else torch.randn(tokens, spec.head_dim)
    )
    value = torch.randn_like(key) * 100 if spec.kind != "mla" else None
    slots = batch.common_metadata().slot_mapping
    backend.write_kv(cache, key, value, slots, layer=layer)
    metadata = backend.build(batch.common_metadata())
    out = torch.zeros(tokens, spec.num_heads, spec.v_head_dim, dtype=spec.dtype)
    backend.forward(
        torch.zeros(tokens, spec.num_heads, spec.head_dim, dtype=spec.dtype), cache, metadata, out, layer=layer
    )
    return backend, cache, (key, value, slots)


def test_flashinfer_plans_the_cache_dtype_and_runs_with_the_layers_host_scales(fake_flashinfer):
    backend, cache, (key, value, slots) = run_once(FlashInferBackend, f"{E4M3}:10+1,20+1", SCALES)
    wrapper = backend.graph_decode[8] if backend.graph_decode[8].ran else backend.decode
    assert (
        wrapper.planned[-1]["kv_data_type"] == torch.float8_e4m3fn
        and wrapper.planned[-1]["q_data_type"] == torch.bfloat16
    )
    assert wrapper.ran[-1]["k_scale"] == 0.05 and wrapper.ran[-1]["v_scale"] == 4.0
    stored_k, stored_v = backend.read_kv(cache, slots)
    assert stored_k.dtype == torch.float8_e4m3fn and torch.equal(
        stored_k.float(), to_cache(key, 0.05, torch.float8_e4m3fn).float()
    )
    assert torch.equal(stored_v.float(), to_cache(value, 4.0, torch.float8_e4m3fn).float())
    bf16, _, _ = run_once(FlashInferBackend, "gqa-h4/2-d128-bf16-p16:10+4", None)
    assert "k_scale" not in bf16.prefill.ran[-1] and bf16.prefill.planned[-1]["kv_data_type"] == torch.bfloat16


def test_trtllm_folds_the_scales_into_its_two_gemm_scales(monkeypatch):
    """Not claimed (XQA computes in fp8), but the path is kept right for a GPU where it would pass."""
    handed = {}
    monkeypatch.setitem(
        sys.modules,
        "flashinfer.decode",
        types.SimpleNamespace(
            trtllm_batch_decode_with_kv_cache=lambda **kwargs: handed.update(kwargs),
            xqa_batch_decode_with_kv_cache=lambda **kwargs: handed.update(kwargs),
        ),
    )
    monkeypatch.setattr(flashinfer_adapters, "WORKSPACE_BYTES", 64)
    backend, cache, (key, value, slots) = run_once(TrtllmBackend, f"{E4M3}:10+1,20+1", SCALES)
    assert handed["bmm1_scale"] == pytest.approx(backend.spec.softmax_scale * 0.05) and handed["bmm2_scale"] == 4.0
    stored_k, stored_v = backend.read_kv(cache, slots)
    assert torch.equal(stored_k.float(), to_cache(key, 0.05, torch.float8_e4m3fn).float())
    assert torch.equal(stored_v.float(), to_cache(value, 4.0, torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="scales"):
        backend.write_kv(cache, key, value, slots)  # an fp8 layer without its scales: a clear error


def test_flashinfer_mla_gives_its_one_scale_to_the_latent_and_the_rope_channels(fake_flashinfer):
    backend, cache, (key, _, slots) = run_once(FlashInferMLABackend, f"{MLA_E4M3}:10+1,20+1", SCALES)
    assert backend.wrapper.planned[-1]["kv_data_type"] == torch.float8_e4m3fn
    ran = backend.wrapper.ran[-1]
    assert ran["ckv_scale"] == ran["kpe_scale"] == 0.05 and "ckv_scale_arr" not in ran
    stored, none = backend.read_kv(cache, slots)
    assert none is None and torch.equal(stored.float(), to_cache(key, 0.05, torch.float8_e4m3fn).float())


def test_an_fp8_cache_names_the_gpus_it_needs_where_they_are_fewer_than_the_backends():
    from backends.triton.backend import TritonAttentionBackend

    a100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))
    reason = TritonAttentionBackend.unsupported_reason(parse_case(f"{E4M3}:10+1").spec, a100)
    assert "SM89" in reason and "Triton's fp8 conversions" in reason and "A100" in reason
    assert TritonAttentionBackend.unsupported_reason(parse_case("gqa-h4/2-d128-bf16:10+1").spec, a100) is None
