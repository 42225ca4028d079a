"""``flashmla_sparse``: FlashMLA's sparse MLA kernels (DeepSeek's DSA, sgl-flash-mla) for every
query length: decode, MTP verify and prefill. Over a bf16 latent cache the sparse prefill kernel
(``flash_mla_sparse_fwd``); over DeepSeek's fp8_ds_mla cache (vLLM's 656-byte entries, FlashMLA's
``V32`` format) the sparse decode kernel (``flash_mla_with_kvcache(indices=...)``), each query token
a request of one token, so a batch's query lengths need not be equal.

Both take, per query token, a list of slots of the pool to attend, -1 for none (the prefill kernel
also skips anything past ``s_kv``; the decode kernel checks no upper bound, and reads the entry
an index of -1 lands on, the reserved block's slot 63, before masking it): the adapter translates
each token's index row (positions in its request) into slots through the block table, on the
device, masking -1 and every entry past the token's own position, and appends its window part's
slots. Each token's request and position are metadata made on the device in ``build`` and remade
in ``update_for_draft_step``. The kernels serve 64 or 128 query heads on SM90; fewer are padded
with zero queries (as vLLM pads them) and their outputs dropped.

On SM90 the kernels are FlashMLA's legacy ones (``use_legacy=True``: the current kernels answer
"only supported on SM100f architectures"); both return the natural-log LSE. Not claimed: a
per-tensor fp8 cache (FlashMLA's sparse fp8 kernels read DeepSeek's fp8_ds_mla layout, scales
inside each entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from backends.features import FP8_DS_MLA, FP8_KV_CACHES, FP8_QUERY, LSE, SPARSE_TOPK, SPARSE_WINDOW
from backends.flashmla import FLASHMLA_CLAIMS, FlashMLAModule
from backends.fp8_ds_mla import DS_MLA_SCALE_BLOCK, DsMlaLayout
from backends.paged_write import write_paged_rows
from backends.sparse_slots import slot_translation

HEAD_MULTIPLE = 64  # the SM90 kernel's query heads: 64 or 128
INDEX_MULTIPLE = 128  # entries a row: SM90's kernel takes two tiles of 64 indices at a time


@dataclass
class SparseSlotsMetadata:
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    token_request: torch.Tensor  # [max_num_tokens] int64
    token_position: torch.Tensor  # [max_num_tokens] int64
    num_tokens: torch.Tensor  # [1] int64: the step's real tokens, on the device
    # fp8_ds_mla: FlashMLA's split schedule a query row count, made by the step's first forward of
    # that count and reused by every later one (every layer of the step), as vLLM's metadata
    # builder makes one FlashMLASchedMeta a step: its schedule follows the shapes alone. Keyed by
    # (rows, capturing) too: one first filled inside a capture holds a recorded scheduler launch,
    # not its result, until a replay runs it, and one filled eagerly would tie a graph to tensors
    # this metadata owns.
    schedules: dict[tuple[int, bool], object] = field(default_factory=dict)


class FlashMLASparseBackend(FlashMLAModule):
    name = "flashmla_sparse"
    capabilities = Capabilities(
        **{**FLASHMLA_CLAIMS, "required_modules": ("flash_mla", "triton")},  # triton: backends.sparse_slots
        features=frozenset({SPARSE_TOPK, SPARSE_WINDOW, LSE, FP8_DS_MLA}),
        only_with=frozenset({SPARSE_TOPK}),  # dense MLA is flashmla's
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES, "FlashMLA's sparse fp8 kernels read DeepSeek's fp8_ds_mla layout, not a per-tensor scale"
            ),
            FP8_QUERY: "FlashMLA's sparse decode takes the query in bf16 (its fp8 is the fp8_ds_mla cache's); an "
            "fp8 query is not built or measured here",
        },
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        self.padded_heads = -(-spec.num_heads // HEAD_MULTIPLE) * HEAD_MULTIPLE
        self.padded_query = torch.zeros(
            limits.max_num_tokens, self.padded_heads, spec.head_dim, dtype=spec.dtype, device=device
        )
        int64 = dict(dtype=torch.int64, device=device)
        self.token_request = torch.zeros(limits.max_num_tokens, **int64)
        self.token_position = torch.zeros(limits.max_num_tokens, **int64)
        self.num_tokens = torch.zeros(1, **int64)
        self.rows = torch.arange(limits.max_num_tokens, **int64)
        entries = (spec.sparse_topk or 0) + (spec.sparse_window or 0)
        self.row_entries = -(-entries // INDEX_MULTIPLE) * INDEX_MULTIPLE
        self.slot_rows = torch.empty(limits.max_num_tokens, self.row_entries, dtype=torch.int32, device=device)
        self.translate = slot_translation(self.device)
        # DeepSeek's fp8_ds_mla: a token's entry packed as vLLM packs it (FlashMLA's V32 format).
        self.packed = None if spec.kv_scale_block is None else DsMlaLayout(spec)
        if self.packed is not None and spec.kv_scale_block != DS_MLA_SCALE_BLOCK:
            raise ValueError(
                f"FlashMLA's V32 entry has a scale per {DS_MLA_SCALE_BLOCK} latent values, not {spec.kv_scale_block}"
            )

    # [num_blocks, block_size, latent + rope]: one bf16 entry a token, as flashmla's (fp8_ds_mla:
    # a token's 656 bytes).
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.packed is not None:
            return self.packed.cache_shape(num_blocks, self.spec.block_size)
        return (num_blocks, self.spec.block_size, self.spec.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        if self.packed is None:
            return super().allocate_kv_cache(num_blocks)
        return self.packed.allocate(num_blocks, self.spec.block_size, self.device)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        if self.packed is not None:
            self.packed.write(kv_cache, key, slot_mapping)
            return
        write_paged_rows(kv_cache, key, slot_mapping, self.spec.block_size)

    def read_kv(self, kv_cache, slot_mapping):
        if self.packed is not None:
            return self.packed.read(kv_cache, slot_mapping), None
        return kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping], None

    def build(self, common: CommonAttentionMetadata) -> SparseSlotsMetadata:
        metadata = SparseSlotsMetadata(
            common.block_table,
            common.query_start_loc,
            common.seq_lens,
            self.token_request,
            self.token_position,
            self.num_tokens,
        )
        self.place_tokens(metadata)
        return metadata

    def update_for_draft_step(self, metadata: SparseSlotsMetadata, common: CommonAttentionMetadata):
        metadata.block_table, metadata.query_start_loc, metadata.seq_lens = (
            common.block_table,
            common.query_start_loc,
            common.seq_lens,
        )
        self.place_tokens(metadata)  # every position moved on by one
        return metadata

    def place_tokens(self, metadata: SparseSlotsMetadata) -> None:
        """Each token's request and position, from the device's lengths (no host value)."""
        starts = metadata.query_start_loc.long()
        ends = starts[1:]
        request = torch.searchsorted(ends, self.rows, right=True).clamp_(max=ends.shape[0] - 1)
        context = metadata.seq_lens.long() - (ends - starts[:-1])
        metadata.token_request.copy_(request)
        metadata.token_position.copy_(context[request] + self.rows - starts[request])
        metadata.num_tokens.copy_(starts[-1:])

    def slots(self, metadata: SparseSlotsMetadata, topk_indices: torch.Tensor, tokens: int) -> torch.Tensor:
        """[tokens, 1, row_entries] int32: each token's attended slots, -1 for none
        (``backends.sparse_slots``). A padding row (past the step's tokens) lists the first token's
        own slot, which this step wrote: the kernel leaves a row with no entry unwritten, and the
        output's rows are all read below (the real ones kept); nothing else of the pool is read for it."""
        out = self.slot_rows[:tokens]
        self.translate(
            topk_indices,
            metadata.token_request,
            metadata.token_position,
            metadata.num_tokens,
            metadata.block_table,
            out,
            window=self.spec.sparse_window or 0,
            block_size=self.spec.block_size,
        )
        return out.view(tokens, 1, -1)

    def forward(self, query, kv_cache, metadata: SparseSlotsMetadata, out, layer: LayerParameters = PLAIN_LAYER):
        spec = self.spec
        if layer.topk_indices is None:
            raise ValueError("a sparse layer's forward needs its index rows (layer.topk_indices)")
        tokens = query.shape[0]
        queries = self.padded_query[:tokens]
        queries[:, : spec.num_heads].copy_(query)
        slots = self.slots(metadata, layer.topk_indices, tokens)
        attend = self.attend_packed if self.packed is not None else self.attend_latent
        result, lse = attend(queries, kv_cache, slots, metadata)
        # Only the step's real rows: rows past them (a graph's padding) keep what they held.
        real = self.rows[:tokens] < metadata.num_tokens
        out.copy_(torch.where(real.view(tokens, 1, 1), result[:, : spec.num_heads].to(out.dtype), out))
        if layer.lse is not None:
            layer.lse[:tokens].copy_(torch.where(real.view(tokens, 1), lse[:, : spec.num_heads], layer.lse[:tokens]))

    def attend_latent(self, queries, kv_cache, slots, metadata: SparseSlotsMetadata):
        """The sparse prefill kernel over the bf16 pool viewed as one flat ``kv``: ([tokens, heads,
        latent], LSE [tokens, heads]). It has no split schedule."""
        spec = self.spec
        result, _, lse = self.flash_mla.flash_mla_sparse_fwd(
            queries,
            kv_cache.view(-1, 1, spec.head_dim),
            slots,
            spec.softmax_scale,
            spec.kv_lora_rank,
            use_legacy=True,  # SM90's kernel (claimed: compute capability 9.0 only)
        )
        return result, lse

    def attend_packed(self, queries, kv_cache, slots, metadata: SparseSlotsMetadata):
        """The sparse decode kernel over the fp8_ds_mla pool, each token a request of one query:
        ([tokens, heads, latent], LSE [tokens, heads]). Its split schedule depends on the shapes
        alone (no ``topk_length``: unused entries are -1), so the step's metadata keeps one a row
        count: FlashMLA fills it on the device in its first call and every later call of the step
        reads it. A capture makes its own (``SparseSlotsMetadata.schedules``), which every replay
        refills."""
        spec, tokens = self.spec, queries.shape[0]
        key = (tokens, queries.is_cuda and torch.cuda.is_current_stream_capturing())
        if key not in metadata.schedules:
            metadata.schedules[key] = self.flash_mla.get_mla_metadata()[0]
        schedule = metadata.schedules[key]
        result, lse = self.flash_mla.flash_mla_with_kvcache(
            queries.view(tokens, 1, self.padded_heads, spec.head_dim),
            kv_cache.unsqueeze(2),  # [blocks, page, 1 kv head, 656 bytes]
            None,
            None,
            spec.kv_lora_rank,
            schedule,
            softmax_scale=spec.softmax_scale,
            is_fp8_kvcache=True,
            indices=slots,
            use_legacy=True,  # SM90's kernel (claimed: compute capability 9.0 only)
            kv_format="V32",  # DeepSeek-V3.2's 656-byte entry
        )
        return result[:, 0], lse[:, :, 0]
