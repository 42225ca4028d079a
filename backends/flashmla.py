"""``flashmla``: sgl-flash-mla's dense bf16 MLA decode (``flash_mla_with_kvcache``,
``use_legacy=True`` on SM90), page size 64, latent 512 + rope 64.

The kernel takes queries as [batch, query_len, heads, 576], so every request of a batch must have
the same query length (decode, or spec-verify with the same number of drafts). Its split-KV
schedule is computed on the device from ``seq_lens`` during the first forward of each build, so a
captured graph recomputes it on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import FP8_KV_CACHES, FP8_QUERY, TOKEN_TREES
from backends.paged_write import write_paged_rows
from backends.vendor_layout import packed

INSTALL_HINT = "pip install 'specdec-conformance[flashmla]'"


@dataclass
class FlashMLAMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    schedule: Any
    num_reqs: int
    query_len: int


# What both FlashMLA adapters (this one, dense, and ``flashmla_sparse``) serve and run on:
# sgl-flash-mla's SM90 kernels, bf16 latents of 512 + 64 in pages of 64, 16 to 128 heads.
FLASHMLA_CLAIMS: dict[str, Any] = dict(
    kinds=frozenset({"mla"}),
    dtypes=frozenset({torch.bfloat16}),
    head_dims=frozenset({576}),
    block_sizes=frozenset({64}),
    num_heads=frozenset({16, 32, 64, 128}),
    devices=frozenset({"cuda"}),
    compute_capabilities=frozenset({(9, 0)}),
    required_modules=("flash_mla",),
    install_hint=INSTALL_HINT,
)


class FlashMLAModule(AttentionBackend):
    """A FlashMLA adapter: ``flash_mla`` imported when one is made (an optional dependency)."""

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        import flash_mla  # noqa: PLC0415 - optional dependency

        self.flash_mla = flash_mla


class FlashMLABackend(FlashMLAModule):
    name = "flashmla"
    capabilities = Capabilities(
        **FLASHMLA_CLAIMS,
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES,
                "FlashMLA's fp8 decode on SM90 takes the query in fp8 too, with its own scale (descale_q), "
                "which the contract does not hand a backend",
            ),
            FP8_QUERY: "FlashMLA's SM90 dense decode takes an fp8 query only with an fp8 cache (descale_q with "
            'descale_k; sgl-flash-mla checks "query and key must have the same dtype"): not built or measured here',
            TOKEN_TREES: "FlashMLA's dense decode (flash_mla_with_kvcache) takes `causal` and no mask: a verify "
            "request's tokens are causal to it",
        },
        max_query_len=8,
        uniform_query_len=True,
        cuda_graphs=CGSupport.UNIFORM_BATCH,
        needs_cpu_seq_lens=False,
        draft_step_update=False,
    )

    # [num_blocks, block_size, 1 latent head, kv_lora_rank + rope_dim]
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.block_size, 1, self.spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        write_paged_rows(kv_cache[:, :, 0], key, slot_mapping, self.spec.block_size)

    def build(self, common: CommonAttentionMetadata) -> FlashMLAMetadata:
        query_len = common.num_actual_tokens // common.num_reqs
        if query_len * common.num_reqs != common.num_actual_tokens or query_len != common.max_query_len:
            raise ValueError("flashmla needs the same query length for every request of a batch")
        schedule, _ = self.flash_mla.get_mla_metadata()  # filled on the device by the first forward
        return FlashMLAMetadata(common.block_table, common.seq_lens, schedule, common.num_reqs, query_len)

    def forward(self, query, kv_cache, metadata: FlashMLAMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        spec = self.spec
        tokens = metadata.num_reqs * metadata.query_len
        result, _ = self.flash_mla.flash_mla_with_kvcache(
            packed(query[:tokens]).view(metadata.num_reqs, metadata.query_len, spec.num_heads, spec.head_dim),
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            spec.kv_lora_rank,
            metadata.schedule,
            softmax_scale=spec.softmax_scale,
            causal=True,
            use_legacy=True,
        )
        out[:tokens].copy_(result.view(tokens, spec.num_heads, spec.kv_lora_rank))
