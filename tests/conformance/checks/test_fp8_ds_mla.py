"""DeepSeek's fp8_ds_mla KV cache (``fp8dsmla``): e4m3 latent with a float32 scale per 128 values a
token inside the entry, the rope part unquantized. The grammar, the packed layout, the harness's
quantizer against the backend's, torch_naive, a packed pool negated for numerics' second layer,
and a planted per-token scale."""

import dataclasses

import pytest
import torch

from backends.base import DeviceInfo
from backends.flashmla import FlashMLABackend
from backends.flashmla_sparse import FlashMLASparseBackend
from backends.fp8_ds_mla import DsMlaLayout
from backends.torch_naive import TorchNaiveBackend
from backends.triton.mla_backend import TritonMLABackend
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.kv_quantization import block_quantize, block_scales
from conformance.checks.numerics import NumericsCheck
from conformance.harness.step import negate_pool, prepare_case
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import sparse_defects

CPU = torch.device("cpu")
H200 = DeviceInfo("cuda", "H200", (9, 0))


def test_the_grammar_reads_and_writes_fp8_ds_mla():
    case = parse_case("mla-h16-d512+64-fp8dsmla-topk2048:4000+1")
    assert (case.spec.kv_cache_dtype, case.spec.kv_scale_block, case.kv_scales) == (torch.float8_e4m3fn, 128, None)
    assert parse_case(case.id) == case


@pytest.mark.parametrize(
    "text,words",
    [
        ("gqa-fp8dsmla:40+1", "an MLA layer's cache"),
        ("mla-d32+16-fp8dsmla:40+1", "whole blocks"),
        ("mla-fp8dsmla-kscale0.5:40+1", "scales are its own"),
        ("mla-fp8dsmla-fp8e4m3:40+1", "give it once"),
    ],
)
def test_fp8_ds_mla_out_of_place_is_a_syntax_error(text, words):
    with pytest.raises(CaseSyntaxError, match=words):
        parse_case(text)


def test_the_layout_is_vllms_656_bytes_and_the_two_quantizers_agree():
    spec = parse_case("mla-h16-d512+64-bf16-fp8dsmla:10+1").spec
    layout = DsMlaLayout(spec)
    assert layout.row_bytes == 656
    entry = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    entry[:, :512] *= torch.tensor([0.01, 1.0, 30.0, 0.5]).repeat_interleave(128)  # blocks of their own sizes
    entry = entry.to(torch.bfloat16)
    unpacked = layout.unpack(layout.pack(entry))
    stored, scales = block_quantize(entry[:, :512], 128, torch.float8_e4m3fn)
    assert torch.equal(scales, block_scales(entry[:, :512], 128, torch.float8_e4m3fn))
    assert len(set(scales[0].tolist())) == 4  # a scale a block, not one a token
    expected = (stored.float().reshape(5, 4, 128) * scales[..., None]).reshape(5, 512)  # dequantized in float32
    assert torch.equal(unpacked[:, :512], expected)  # the backend's quantization is the harness's
    assert torch.equal(unpacked[:, 512:], entry[:, 512:].float())  # the rope part as given


@pytest.mark.parametrize(
    "case_text",
    [
        "mla-h4-d512+16-bf16-fp8dsmla-p16:40+1,20+4,0+9,0+0",
        "mla-h4-d128+16-bf16-fp8dsmla-p16-topk16-win8-messyidx:60+2,9+4",
        "mla-h16-d512+64-bf16-fp8dsmla-p64-topk256-edges:0+100,900+4,2000+1",
    ],
)
def test_torch_naive_serves_fp8_ds_mla(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


def test_a_packed_pool_is_negated_by_writing_it_again():
    """numerics' second layer negates its pool in place; a pool of bytes is written again through
    write_kv, poison and history negated: every entry read back is the original's negation."""
    prepared = prepare_case(TorchNaiveBackend, parse_case("mla-h4-d128+16-bf16-fp8dsmla-p16:40+1,20+4"), CPU)
    slots = torch.arange(prepared.batch.num_slots)
    before, _ = prepared.backend.read_kv(prepared.kv_cache, slots)
    negate_pool(prepared)
    after, _ = prepared.backend.read_kv(prepared.kv_cache, slots)
    assert torch.equal(after, before.neg())


def test_one_scale_a_token_fails_the_stored_cache():
    result = judge(
        NumericsCheck(),
        sparse_defects.ScalesPerTokenInDsMla,
        parse_case("mla-h4-d512+16-bf16-fp8dsmla-p16:40+1,20+4,0+9"),
        CPU,
    )
    assert result.verdict == Verdict.FAIL and "e4m3 step" in result.reason, result.reason


def test_backends_without_the_claim_say_why():
    needs = parse_case("mla-h16-d512+64-fp8dsmla-topk64:100+1").needs
    assert FlashMLASparseBackend.capabilities.feature_reason(needs, H200) is None  # FlashMLA's sparse decode
    assert "fp8_ds_mla KV cache" in FlashMLABackend.capabilities.feature_reason(needs, H200)  # its dense decode
    # triton_mla claims it for sparse layers only (tests/backends/test_triton_mla_fp8_ds_mla.py).
    dense = parse_case("mla-h16-d512+64-fp8dsmla:100+1").needs
    assert "not supported without sparse_topk" in TritonMLABackend.capabilities.feature_reason(dense, H200)


def test_the_engine_runs_the_case_over_deepseeks_packed_cache():
    """The engine check's model for an fp8_ds_mla case keeps its attention cache in the format
    (packed entries, their scales inside, no layer scales) and decodes speculatively (MTP) as it
    does plainly."""
    from conformance.harness.engine_model import cache_config, model_and_prompts
    from reference_engine.batched_engine import BatchedEngine
    from reference_engine.core import EngineConfig
    from reference_engine.sampling import SamplingParams

    case = parse_case("mla-h16-d512+64-bf16-fp8dsmla-p64-topk2048:4000+1,2049+1,3000+4")
    model, prompts = model_and_prompts(case, torch.device("cpu"), (5, 40))
    model = model.float()
    config = EngineConfig(model=model.config, block_size=64, num_blocks=16, **cache_config(case))
    engine = BatchedEngine(config, model)
    assert engine.kv_scales is None
    row = DsMlaLayout(engine.backend.groups[0].plan.spec).row_bytes  # 656 in bf16; its rope part fp32 here
    assert all(
        caches.attention.dtype == torch.uint8 and caches.attention.shape[-1] == row for caches in engine.kv_caches
    )
    params = SamplingParams(max_tokens=6)
    plain = [out.tokens for out in engine.generate(prompts, params)]
    spec = BatchedEngine(dataclasses.replace(config, num_spec_tokens=3, drafter="mtp"), model)
    assert [out.tokens for out in spec.generate(prompts, params)] == plain
