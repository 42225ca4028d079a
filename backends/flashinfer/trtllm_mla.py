"""``trtllm_mla``: FlashInfer's trtllm_batch_decode_with_kv_cache_mla (trtllm-gen kernels on
SM100/SM103, XQA on SM120). On Hopper it is unavailable, decided from the claims before any kernel
is called. The argument construction is a pure function so it is tested where it cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import FP8_KV_CACHES, FP8_QUERY, TOKEN_TREES
from backends.flashinfer import DeviceLengthsEntryPoint, packed_rows, runs_on
from backends.paged_write import write_paged_rows
from backends.vendor_layout import packed, packed_output

QK_NOPE_HEAD_DIM = 128  # DeepSeek-V3's per-head non-rope query dim, which FlashInfer still asks for


@dataclass
class TrtllmMLAMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    query_len: int


def kernel_arguments(
    spec: AttentionSpec, limits: BackendLimits, query, kv_cache, workspace, metadata: TrtllmMLAMetadata, out
) -> dict[str, Any]:
    """Keyword arguments for trtllm_batch_decode_with_kv_cache_mla, shapes as FlashInfer wants them:
    query [batch, query_len, heads, 576], cache [blocks, 1, block_size, 576], out [batch, query_len, heads, 512]."""
    tokens = metadata.num_reqs * metadata.query_len
    return dict(
        query=packed(query[:tokens]).view(metadata.num_reqs, metadata.query_len, spec.num_heads, spec.head_dim),
        kv_cache=kv_cache.unsqueeze(1),
        workspace_buffer=workspace,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.rope_dim,
        block_tables=packed_rows(metadata.block_table),
        seq_lens=metadata.seq_lens,
        max_seq_len=limits.max_model_len,
        out=out[:tokens].view(metadata.num_reqs, metadata.query_len, spec.num_heads, spec.kv_lora_rank),
        bmm1_scale=spec.softmax_scale,
        bmm2_scale=1.0,
    )


class TrtllmMLABackend(DeviceLengthsEntryPoint):
    name = "trtllm_mla"
    capabilities = Capabilities(
        kinds=frozenset({"mla"}),
        dtypes=frozenset({torch.bfloat16}),
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES,
                "trtllm-gen's e4m3 MLA path is not claimed until it passes on a Blackwell GPU, which this "
                "project has not had",
            ),
            FP8_QUERY: "trtllm-gen's fp8 MLA kernels (SM100) take the query in e4m3 with an e4m3 cache; not "
            "claimed until it passes on a Blackwell GPU, which this project has not had",
            TOKEN_TREES: "FlashInfer 0.7.2's trtllm_batch_decode_with_kv_cache_mla takes no mask: a verify "
            "request's tokens are causal to it",
        },
        head_dims=frozenset({576}),
        block_sizes=frozenset({32, 64}),
        max_query_len=8,
        uniform_query_len=True,
        cuda_graphs=CGSupport.UNIFORM_BATCH,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        **runs_on(frozenset({(10, 0), (10, 3), (12, 0)})),  # trtllm-gen on SM100/SM103, XQA on SM120
    )
    entry_point = ("flashinfer.mla", "trtllm_batch_decode_with_kv_cache_mla")

    # [num_blocks, block_size, kv_lora_rank + rope_dim]
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.block_size, self.spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        write_paged_rows(kv_cache, key, slot_mapping, self.spec.block_size)

    def build(self, common: CommonAttentionMetadata) -> TrtllmMLAMetadata:
        query_len = common.num_actual_tokens // common.num_reqs
        if query_len * common.num_reqs != common.num_actual_tokens or query_len != common.max_query_len:
            raise ValueError("trtllm_mla needs the same query length for every request of a batch")
        return TrtllmMLAMetadata(common.block_table, common.seq_lens, common.num_reqs, query_len)

    def forward(self, query, kv_cache, metadata: TrtllmMLAMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        target, land = packed_output(out)
        self.kernel(**kernel_arguments(self.spec, self.limits, query, kv_cache, self.workspace, metadata, target))
        land()
