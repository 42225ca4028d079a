"""``torch_indexer``: DeepSeek-V3.2's lightning indexer in plain PyTorch (the layer kind
``indexer``, ``backends.base``: "The indexer"), one request at a time from host lengths: the
readable reference, CPU and CUDA.

Cache: ``[num_blocks, block_size, head_dim]`` in the compute dtype; with fp8 keys, bytes
``[num_blocks, block_size, head_dim + 4]``: each token's e4m3 key, then its float32 scale (the
layout vLLM's indexer cache has, a token's scale beside its key).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from backends.features import EMPTY_REQUESTS, FP8_E4M3
from backends.fp8 import to_cache, token_scales
from backends.paged_write import write_paged_rows

SCALE_BYTES = 4


@dataclass
class IndexerMetadata:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor


class IndexerKeyCache:
    """An indexer's key cache (the module docstring's layout): its shape, ``write_kv`` and
    ``read_kv``, shared by every indexer backend that keeps this layout (``torch_indexer``,
    ``triton_indexer``) and, through ``block_planes``, by one that lays a page out otherwise
    (``deepgemm_indexer``). Plain PyTorch, no host value read: ``write_kv`` is graph-safe (on CUDA
    the rows go through our Triton write kernel, ``paged_write``)."""

    spec: AttentionSpec
    device: torch.device

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        extra = SCALE_BYTES if self.spec.fp8_kv_cache else 0
        return (num_blocks, self.spec.block_size, self.spec.head_dim + extra)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        dtype = torch.uint8 if self.spec.fp8_kv_cache else self.spec.dtype
        return torch.zeros(self.kv_cache_shape(num_blocks), dtype=dtype, device=self.device)

    def block_planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 keys: the cache as two byte planes ``[num_blocks, block_size, ...]``, the keys' bytes
        ``[..., head_dim]`` and their float32 scales' ``[..., 4]`` (here side by side in a token's row)."""
        dim = self.spec.head_dim
        return kv_cache[..., :dim], kv_cache[..., dim:]

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keys of ``slots`` as stored: ``[n, head_dim]`` (fp8 or the compute dtype) and, for fp8
        keys, their scales ``[n]`` float32. Only those slots are read (initcheck sees the rest)."""
        if not self.spec.fp8_kv_cache:
            return kv_cache.view(-1, kv_cache.shape[-1])[slots], None
        keys, scales = self.block_planes(kv_cache)
        block, offset = slots // self.spec.block_size, slots % self.spec.block_size
        return keys[block, offset].view(self.spec.kv_cache_dtype), scales[block, offset].view(torch.float32)[:, 0]

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        if not self.spec.fp8_kv_cache:
            write_paged_rows(kv_cache, key, slot_mapping, self.spec.block_size)
            return
        scales = token_scales(key, self.spec.kv_cache_dtype)
        stored = to_cache(key, scales[:, None], self.spec.kv_cache_dtype).view(torch.uint8)
        keys, scale_bytes = self.block_planes(kv_cache)
        write_paged_rows(keys, stored, slot_mapping, self.spec.block_size)
        write_paged_rows(scale_bytes, scales.view(-1, 1).view(torch.uint8), slot_mapping, self.spec.block_size)

    def read_kv(self, kv_cache, slot_mapping):
        return self.gather(kv_cache, slot_mapping)


class TorchIndexerBackend(IndexerKeyCache, AttentionBackend):
    name = "torch_indexer"
    capabilities = Capabilities(
        kinds=frozenset({"indexer"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_query_len=None,
        features=frozenset({FP8_E4M3, EMPTY_REQUESTS}),
        cuda_graphs=CGSupport.NEVER,
        needs_cpu_seq_lens=True,
        deterministic=True,
        batch_invariant=True,
        devices=frozenset({"cpu", "cuda"}),
    )

    def build(self, common: CommonAttentionMetadata) -> IndexerMetadata:
        return IndexerMetadata(common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist(), common.block_table)

    def keys(self, kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        """A request's first ``seq_len`` index keys, dequantized, float32 ``[seq_len, head_dim]``."""
        block_size = self.spec.block_size
        blocks = block_table_row[: -(-seq_len // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(-1)[:seq_len]
        stored, scales = self.gather(kv_cache, slots)
        return stored.float() if scales is None else stored.float() * scales[:, None]

    def logits(self, query, keys, weights, context_len: int) -> torch.Tensor:
        """[q, s] float32: Σ_h w_h · relu(q_h · k_s), -inf past each token's own position."""
        scores = torch.einsum("qhd,sd->qhs", query.float(), keys).clamp(min=0)
        logits = torch.einsum("qh,qhs->qs", weights.float(), scores)
        positions = context_len + torch.arange(query.shape[0], device=query.device)
        causal = torch.arange(keys.shape[0], device=query.device)[None, :] <= positions[:, None]
        return logits.masked_fill(~causal, float("-inf"))

    def forward(self, query, kv_cache, metadata: IndexerMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if layer.index_weights is None:
            raise ValueError("an indexer's forward needs its head weights (layer.index_weights)")
        topk = self.spec.sparse_topk
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end == start:
                continue
            keys = self.keys(kv_cache, metadata.block_table[request], seq_len)
            logits = self.logits(query[start:end], keys, layer.index_weights[start:end], seq_len - (end - start))
            count = min(topk, seq_len)
            # Ties (a ReLU leaves many logits exactly 0) broken by position, the earliest first,
            # whatever the step's shape: a decode and a verify of one token choose alike.
            best, chosen = logits.sort(dim=1, descending=True, stable=True)
            best, chosen = best[:, :count], chosen[:, :count]
            rows = torch.full((end - start, topk), -1, dtype=out.dtype, device=out.device)
            rows[:, :count] = torch.where(best > float("-inf"), chosen, -1).to(out.dtype)
            out[start:end] = rows
