"""``flash_attn``: FlashAttention 4 (``flash-attn-4``, CuTe DSL) over a paged cache —
``page_table`` for the block table, ``seqused_k`` for the lengths on the device, so the host passes
none: only ``max_seqlen_q``, which it always knows exactly.

The entry point is ``flash_attn.cute.interface._flash_attn_fwd``, the function under the public
``flash_attn_varlen_func`` (an autograd wrapper that always allocates its output): it takes
``out``, so the kernel writes the caller's buffer as vLLM's FlashAttention backends do, with no
copy. That copy also cost the memory check minutes: initcheck does not see the kernel's
bulk-async (TMA) stores, so copying its fresh output printed a report per 32 bytes.

FlashAttention aligns causal masks bottom-right (query i of a request sees the keys up to
``seqused_k - query_len + i``), the contract's convention, and counts its left window without the
token itself. Its MLA path (``qv``) is Blackwell-only in flash-attn-4, so there is no
``flash_attn_mla`` on Hopper. The argument construction is a pure function, tested on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import (
    ATTENTION_SINKS,
    FP8_KV_CACHES,
    FP8_QUERY,
    LOGITS_SOFT_CAP,
    LSE,
    SLIDING_WINDOW,
    TOKEN_TREES,
    VALUE_HEAD_DIM,
)
from backends.paged_write import write_paged_rows

INSTALL_HINT = "pip install 'specdec-conformance[flash-attn]'"
# flash-attn-4 compiles each kernel variant (CuTe DSL) in every process, 10-50 s under
# compute-sanitizer, and the suite runs many processes; its own on-disk cache, keyed by a
# fingerprint of its sources and of the DSL's version, compiles each once. Read when flash_attn.cute
# is first imported, so it is set here, before; a user's own setting (0 included) wins.
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")


@dataclass
class FlashAttnMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    num_tokens: int


def kernel_arguments(spec: AttentionSpec, query, kv_cache, metadata: FlashAttnMetadata, out) -> dict[str, Any]:
    """Keyword arguments of ``flash_attn.cute.interface._flash_attn_fwd``: query [tokens, heads,
    dim], key and value pages [blocks, block_size, kv_heads, dim], one page-table row per request,
    and the output rows when they are contiguous (a strided view: None, the kernel allocates)."""
    window_left = None if spec.sliding_window is None else spec.sliding_window - 1
    rows = out[: metadata.num_tokens]
    return dict(
        q=query[: metadata.num_tokens],
        k=kv_cache[0],
        v=kv_cache[1],
        cu_seqlens_q=metadata.query_start_loc,
        seqused_k=metadata.seq_lens,
        max_seqlen_q=metadata.max_query_len,
        page_table=metadata.block_table,
        softmax_scale=spec.softmax_scale,
        causal=True,
        window_size_left=window_left,
        window_size_right=None if window_left is None else 0,
        softcap=spec.logits_soft_cap or 0.0,
        out=rows if rows.is_contiguous() else None,
    )


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES,
                "flash-attn-4's fp8 attention is for SM100 and quantizes the query too (q_descale), which the "
                "contract does not hand a backend",
            ),
            ATTENTION_SINKS: "not claimed until measured: flash-attn-4 was not installed on the GPU machines of the "
            "session that added learned sinks",
            VALUE_HEAD_DIM: "flash-attn-4 runs (hdim_qk, hdim_v) = (192, 128) on Blackwell only (its interface's "
            "supported features); this adapter runs on SM90",
            LSE: "flash-attn-4 returns one, but it is not claimed until measured: flash-attn-4 was not installed on "
            "the GPU machines of the session that added the LSE",
            FP8_QUERY: "flash-attn-4 takes an fp8 query (q_descale) only in its fp8 attention, with an fp8 cache, "
            "on SM100; this adapter runs on SM90 and hands the query in the compute dtype",
            TOKEN_TREES: "flash-attn-4's masks beyond causal and a window come as a CuTe DSL `mask_mod` (a compiled "
            "function, FlexAttention's style); this adapter hands `causal` and builds none from a step's tree",
        },
        head_dims=frozenset({64, 128}),
        block_sizes=frozenset({16, 32, 64}),  # 256: fails on SM90
        max_query_len=None,
        features=frozenset({SLIDING_WINDOW, LOGITS_SOFT_CAP}),
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=frozenset({"cuda"}),
        compute_capabilities=frozenset({(9, 0)}),  # measured on SM90 only
        required_modules=("flash_attn.cute",),
        install_hint=INSTALL_HINT,
    )

    def __init__(self, spec: AttentionSpec, limits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        from flash_attn.cute.interface import _flash_attn_fwd  # noqa: PLC0415 - optional dependency

        self.kernel = _flash_attn_fwd

    # [K | V, num_blocks, block_size, kv_heads, head_dim]: each plane is FlashAttention's paged layout
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        write_paged_rows(kv_cache[0], key, slot_mapping, self.spec.block_size)
        write_paged_rows(kv_cache[1], value, slot_mapping, self.spec.block_size)

    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        return FlashAttnMetadata(
            common.query_start_loc, common.seq_lens, common.block_table, common.max_query_len, common.num_actual_tokens
        )

    def update_for_draft_step(self, metadata: FlashAttnMetadata, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        # Lengths live on the device, where the draft loop advanced them; re-point in case of new tensors.
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = (
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
        )
        return metadata

    def forward(self, query, kv_cache, metadata: FlashAttnMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        arguments = kernel_arguments(self.spec, query, kv_cache, metadata, out)
        result, _ = self.kernel(**arguments)
        if arguments["out"] is None:  # a strided output: the kernel wrote a buffer of its own
            out[: metadata.num_tokens].copy_(result)
