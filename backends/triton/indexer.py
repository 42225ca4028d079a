"""``triton_indexer``: DeepSeek-V3.2's lightning indexer (the layer kind ``indexer``,
``backends.base``: "The indexer") as a Triton kernel, graph-safe, needing no host lengths.

The cache is ``torch_indexer``'s, written and read by the same code (``IndexerKeyCache``): index
keys in the compute dtype, or e4m3 bytes with each token's float32 scale after its key.

``build`` reads no device value: the metadata references the step's device tensors, and each
token's request and position are made on the device into persistent buffers sized by the limits
(``sparse_mla``'s ``SparsePositions``, the same metadata ``triton_mla``'s sparse read uses), remade
from the advanced ``seq_lens`` by ``update_for_draft_step``. ``forward`` launches
``indexer_kernels.indexer_logits_kernel`` over every (query row, tile of positions) of the block
table's width (its columns × the page size, a static shape), a ``torch.topk`` over that width, and
``indexer_topk_write_kernel``, which writes each real token's row and leaves the rows past the
device's token count (padding) as they were: no grid, shape or branch depends on a length, so a
graph captured for one batch replays for any other of the same padded shape.
"""

from __future__ import annotations

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
from backends.features import EMPTY_REQUESTS, FP8_E4M3
from backends.torch_indexer import IndexerKeyCache
from backends.triton import INSTALL_HINT
from backends.triton.backend import FP8_GPUS, DeviceLengthsBackend, interpreter_devices, interpreting
from backends.triton.sparse_mla import SparseMetadata, SparsePositions

try:
    import triton

    from backends.triton import indexer_kernels
except ModuleNotFoundError as missing:  # an extra: the claims import, availability names the install
    if missing.name != "triton":
        raise

BLOCK_N = 64  # positions a logits program scores
BLOCK_K = 256  # output columns the write kernel takes at a time (it loops over the top-k)


class TritonIndexerBackend(IndexerKeyCache, DeviceLengthsBackend):
    name = "triton_indexer"
    capabilities = Capabilities(
        kinds=frozenset({"indexer"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_query_len=None,
        # An empty request has no token, so no program reads its block-table row.
        features=frozenset({FP8_E4M3, EMPTY_REQUESTS}),
        feature_gpus={FP8_E4M3: FP8_GPUS[FP8_E4M3]},
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=interpreter_devices(),
        required_modules=("triton",),
        install_hint=INSTALL_HINT,
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        # fp32 queries take an fp32 product (exact); the interpreter's numpy has no bf16 matmul.
        self.upcast_dot = interpreting() or spec.dtype == torch.float32
        self.positions = SparsePositions(spec, limits, self.device)
        self.block_h = max(16, triton.next_power_of_2(spec.num_heads))
        self.block_d = max(16, triton.next_power_of_2(spec.head_dim))

    def build(self, common: CommonAttentionMetadata) -> SparseMetadata:
        return self.positions.build(super().build(common))

    def update_for_draft_step(self, metadata: SparseMetadata, common: CommonAttentionMetadata) -> SparseMetadata:
        return self.positions.update_for_draft_step(metadata, common)  # every token's position moved on

    def forward(self, query, kv_cache, metadata: SparseMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        weights = layer.index_weights
        if weights is None:
            raise ValueError("an indexer's forward needs its head weights (layer.index_weights)")
        rows = query.shape[0]  # host shapes only: the real token count stays on the device
        if rows > self.limits.max_num_tokens:
            raise ValueError(f"{rows} query rows exceed the backend's limit of {self.limits.max_num_tokens} tokens")
        if rows == 0:
            return
        self.choose(self.logits(query, kv_cache, metadata, weights), metadata, out)

    def logits(self, query, kv_cache, metadata: SparseMetadata, weights) -> torch.Tensor:
        """float32 ``[rows, width]`` over the block table's width (its columns × the page size, a
        static shape): each row's logits, -inf past its token's own position."""
        spec, rows = self.spec, query.shape[0]
        width = metadata.block_table.shape[1] * spec.block_size
        logits = torch.empty(rows, width, dtype=torch.float32, device=query.device)
        fp8 = spec.fp8_kv_cache
        keys = kv_cache.view(spec.kv_cache_dtype) if fp8 else kv_cache  # the key bytes as e4m3
        if width:
            indexer_kernels.indexer_logits_kernel[(rows, triton.cdiv(width, BLOCK_N))](
                query,
                weights,
                keys,
                kv_cache,
                metadata.block_table,
                metadata.token_request,
                metadata.token_position,
                metadata.num_tokens,
                logits,
                width,
                query.stride(0),
                query.stride(1),
                query.stride(2),
                weights.stride(0),
                weights.stride(1),
                metadata.block_table.stride(0),
                kv_cache.stride(0),
                kv_cache.stride(1),
                logits.stride(0),
                NUM_HEADS=spec.num_heads,
                HEAD_DIM=spec.head_dim,
                BLOCK_H=self.block_h,
                BLOCK_D=self.block_d,
                BLOCK_N=BLOCK_N,
                PAGE_SIZE=spec.block_size,
                KEYS_FP8=fp8,
                UPCAST_DOT=self.upcast_dot,
                num_warps=4,
            )
        return logits

    def choose(self, logits: torch.Tensor, metadata: SparseMetadata, out: torch.Tensor) -> None:
        """Each real token's row of ``out``: the top-k of its logits (a static width), -1 for a
        -inf and past the width; the rows past the device's token count (padding) left as they are."""
        spec, rows = self.spec, logits.shape[0]
        chosen = min(spec.sparse_topk, logits.shape[1])  # a top-k wider than the table: -1 past its width
        values, indices = torch.topk(logits, chosen, dim=1, sorted=False)
        indexer_kernels.indexer_topk_write_kernel[(rows,)](
            values,
            indices,
            metadata.num_tokens,
            out,
            values.stride(0),
            indices.stride(0),
            out.stride(0),
            out.stride(1),
            CHOSEN=chosen,
            TOPK=spec.sparse_topk,
            BLOCK_K=min(BLOCK_K, triton.next_power_of_2(spec.sparse_topk)),
        )
