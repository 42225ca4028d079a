"""The engine check's model for a case's layer, and its prompts (``model_for``,
``model_and_prompts``): a small two-layer model of the layer's layout, seeded from the case."""

from __future__ import annotations

from typing import Any

import torch

from conformance.cases.grammar import Case

ENGINE_WINDOW = 48  # a windowed layer's window in the engine: shorter than its prompts and outputs, so it bites
ENGINE_TOPK = 24  # a sparse layer's top-k in the engine: fewer than its prompts' tokens, so it bites
ENGINE_INDEX_WINDOW = 8  # and its window part, where it has one


def cache_config(case: Case) -> dict[str, Any]:
    """The EngineConfig fields of the case's attention cache: an fp8 format and its scales,
    DeepSeek's fp8_ds_mla (its scales its own), or nothing (an indexer's keys are its model's)."""
    spec = case.spec
    if spec.kv_scale_block is not None:
        return dict(kv_cache_dtype=spec.kv_cache_dtype, kv_scale_block=spec.kv_scale_block)
    return dict(kv_cache_dtype=spec.kv_cache_dtype, kv_scales=case.kv_scales) if case.kv_scales else {}


def query_config(case: Case) -> dict[str, Any]:
    """The EngineConfig field of the case's query: an fp8 query (each layer's its own scale)."""
    return dict(query_dtype=case.spec.query_dtype) if case.spec.fp8_query else {}


def is_mla_prefill_layer(spec) -> bool:
    """An MHA layer whose value head dim is not its key's: MLA's prefill (DeepSeek-V3: 192 / 128)."""
    return spec.kind == "mha" and spec.v_head_dim != spec.head_dim


def model_for(case: Case):
    """The engine's model for a case's layer: a Llama-style model (windowed cases: windowed layers
    alternating with full ones, as gpt-oss's and Gemma 2's do; sinks cases: every layer's own
    sinks), an MLA model for MLA's layer (a sparse layer's: sparse, its rows from each layer's
    lightning indexer), a sparse MLA model for an indexer's (the case's index heads and head dim),
    and for MLA prefill's layer (a value head dim other than the key's) a DeepSeek-style MLA model
    whose prefill it is."""
    from reference_engine.model import ModelConfig

    spec = case.spec
    common = dict(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=512, max_model_len=512)
    if spec.kind == "indexer":
        return ModelConfig(
            attention="mla",
            num_heads=4,
            kv_lora_rank=64,
            qk_rope_dim=16,
            qk_nope_dim=64,
            v_head_dim=64,
            index_topk=min(spec.sparse_topk, ENGINE_TOPK),
            index_heads=spec.num_heads,
            index_head_dim=spec.head_dim,
            index_kv_cache_dtype=spec.kv_cache_dtype,
            **common,
        )
    if spec.kind == "mla":
        return ModelConfig(
            attention="mla",
            num_heads=spec.num_heads,
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_dim=spec.rope_dim,
            qk_nope_dim=64,
            v_head_dim=64,
            index_topk=None if spec.sparse_topk is None else min(spec.sparse_topk, ENGINE_TOPK),
            index_window=None if spec.sparse_window is None else ENGINE_INDEX_WINDOW,
            **common,
        )
    if is_mla_prefill_layer(spec):
        rope = 64 if spec.head_dim > 64 else spec.head_dim // 2  # DeepSeek-V3: 192 = 128 + 64
        return ModelConfig(
            attention="mla",
            num_heads=spec.num_heads,
            kv_lora_rank=512,
            qk_rope_dim=rope,
            qk_nope_dim=spec.head_dim - rope,
            v_head_dim=spec.v_head_dim,
            **common,
        )
    return ModelConfig(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        attention_sinks=spec.attention_sinks,
        alternating_window=True,
        sliding_window=ENGINE_WINDOW if spec.sliding_window is not None else None,
        **common,
    )


def model_and_prompts(case: Case, device: torch.device, lengths: tuple[int, ...]):
    """``model_for(case)`` with seeded random weights, and prompts of these lengths from the same seed."""
    from reference_engine.model import LlamaModel

    config = model_for(case)
    model = LlamaModel.random(config, case.seed, case.spec.dtype, device)
    generator = torch.Generator().manual_seed(case.seed)
    return model, [torch.randint(0, config.vocab_size, (length,), generator=generator).tolist() for length in lengths]
