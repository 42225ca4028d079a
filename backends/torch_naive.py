"""Plain PyTorch attention over the paged cache: the readable baseline, on CPU and CUDA.

One request at a time, in float32, from host lengths: easy to check by eye, slow, and honest
about it (needs host lengths, no CUDA graphs). Small hooks (``softmax_scale``, ``visible``,
``gather``, ``dequantize``) keep each piece of the math in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends import fp8, token_tree
from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    Fp8Scales,
    LayerParameters,
)
from backends.features import (
    ATTENTION_SINKS,
    DCP,
    EMPTY_REQUESTS,
    FP8_DS_MLA,
    FP8_E4M3,
    FP8_E5M2,
    FP8_QUERY,
    LOGITS_SOFT_CAP,
    LSE,
    SLIDING_WINDOW,
    SPARSE_TOPK,
    SPARSE_WINDOW,
    TOKEN_TREES,
    VALUE_HEAD_DIM,
)
from backends.fp8 import from_cache, to_cache
from backends.fp8_ds_mla import DsMlaLayout
from backends.paged_write import write_paged_rows


@dataclass
class NaiveMetadata:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    tree_parents: list[int] | None = None  # token trees: each token's parent (``backends.token_tree``)


class TorchNaiveBackend(AttentionBackend):
    name = "torch_naive"
    capabilities = Capabilities(
        kinds=frozenset({"mha", "mla"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_query_len=None,
        features=frozenset(
            {
                FP8_E4M3,
                FP8_E5M2,
                FP8_QUERY,
                DCP,
                SLIDING_WINDOW,
                LOGITS_SOFT_CAP,
                ATTENTION_SINKS,
                VALUE_HEAD_DIM,
                LSE,
                EMPTY_REQUESTS,
                SPARSE_TOPK,
                SPARSE_WINDOW,
                FP8_DS_MLA,
                TOKEN_TREES,
            }
        ),
        cuda_graphs=CGSupport.NEVER,
        needs_cpu_seq_lens=True,
        draft_step_update=False,
        deterministic=True,
        batch_invariant=True,  # one request at a time, fixed reduction order
        devices=frozenset({"cpu", "cuda"}),
    )

    def __init__(self, spec, limits, device) -> None:
        super().__init__(spec, limits, device)
        # DeepSeek's fp8_ds_mla: a token's entry packed as vLLM packs it (its own scales inside).
        self.packed = None if spec.kv_scale_block is None else DsMlaLayout(spec)

    # Layout: MHA [num_blocks, block_size, kv_heads, head_dim + v_head_dim], a token's key then its
    # value (their head dims may differ: d192/128), so that K and V each view as [num_slots,
    # kv_heads, dim]; MLA [num_blocks, block_size, kv_lora_rank + rope_dim] (fp8_ds_mla: its bytes).
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        if self.packed is not None:
            return self.packed.cache_shape(num_blocks, spec.block_size)
        if spec.kind == "mla":
            return (num_blocks, spec.block_size, spec.head_dim)
        return (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim + spec.v_head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        if self.packed is None:
            return super().allocate_kv_cache(num_blocks)
        return self.packed.allocate(num_blocks, self.spec.block_size, self.device)

    def block_planes(self, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """The cache as [num_blocks, block_size, ...] views: [K, V] for MHA, [latent] for MLA."""
        if self.spec.kind == "mla":
            return [kv_cache]
        return [kv_cache[..., : self.spec.head_dim], kv_cache[..., self.spec.head_dim :]]

    def slot_planes(self, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """The cache as per-slot views: [K, V] for MHA, [latent] for MLA."""
        if self.spec.kind == "mla":
            return [kv_cache.view(-1, 1, kv_cache.shape[-1])]
        return [plane.flatten(0, 1) for plane in self.block_planes(kv_cache)]

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        rows = [key] if self.spec.kind == "mla" else [key, value]
        for plane, rows_, scale in zip(self.block_planes(kv_cache), rows, self.scale_floats(layer.scales)):
            stored = rows_ if scale is None else self.quantize(rows_, scale, plane.dtype)
            stored = stored if self.packed is None else self.packed.pack(rows_)
            write_paged_rows(plane, stored, slot_mapping, self.spec.block_size)

    def quantize(self, rows: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
        """What an fp8 cache stores for ``rows`` (the contract's rule, ``backends.fp8.to_cache``)."""
        return to_cache(rows, scale, cache_dtype)

    def scale_floats(self, scales: Fp8Scales | None) -> list[float | None]:
        """The key and value planes' scales (MLA: its one plane's), or None for a compute-dtype cache."""
        if not self.spec.fp8_kv_cache or self.packed is not None:  # fp8_ds_mla's scales are the cache's own
            return [None, None]
        if scales is None:
            raise ValueError("an fp8 KV cache needs the layer's scales (``layer.scales`` of write_kv and forward)")
        return [scales.k_scale, scales.v_scale]

    def read_kv(self, kv_cache, slot_mapping):
        planes = self.slot_planes(kv_cache)
        if self.spec.kind == "mla":
            return self.entries(planes[0][slot_mapping])[:, 0], None
        return planes[0][slot_mapping], planes[1][slot_mapping]

    def build(self, common: CommonAttentionMetadata) -> NaiveMetadata:
        return NaiveMetadata(
            query_start_loc=common.query_start_loc_cpu.tolist(),
            seq_lens=common.seq_lens_cpu.tolist(),  # copies from the device when the host lacks them
            block_table=common.block_table,
            tree_parents=None if common.host_tree_parents is None else common.host_tree_parents.tolist(),
        )

    def forward(
        self,
        query,
        kv_cache,
        metadata: NaiveMetadata,
        out,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        if self.spec.sparse_topk is not None and layer.topk_indices is None:
            raise ValueError("a sparse layer's forward needs its index rows (layer.topk_indices)")
        planes = self.slot_planes(kv_cache)
        plane_scales = self.scale_floats(layer.scales)
        query = self.query_values(query, layer.scales)
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end == start:
                continue
            if seq_len == 0:  # a DCP rank holding no key of the request: output 0, LSE -inf
                out[start:end] = 0
                if layer.lse is not None:
                    layer.lse[start:end] = float("-inf")
                continue
            kv = [self.entries(self.gather(plane, metadata.block_table[request], seq_len)) for plane in planes]
            kv = [rows if scale is None else self.dequantize(rows, scale) for rows, scale in zip(kv, plane_scales)]
            key, value = (kv[0], kv[0][..., : self.spec.v_head_dim]) if self.spec.kind == "mla" else kv
            context_len = seq_len - (end - start)
            request_sinks = self.request_sinks(layer.sinks, end - start)
            rows = None if layer.topk_indices is None else layer.topk_indices[start:end]
            tree = None if metadata.tree_parents is None else metadata.tree_parents[start:end]
            seen = self.seen(context_len, end - start, key.shape[0], rows, tree)
            out[start:end] = self.attend(query[start:end], key, value, context_len, request_sinks, seen).to(out.dtype)
            if layer.lse is not None:
                layer.lse[start:end] = self.log_sum_exp(query[start:end], key, context_len, request_sinks, seen)

    def query_values(self, query: torch.Tensor, scales: Fp8Scales | None) -> torch.Tensor:
        """The query attended with: an fp8 query's numbers (``stored × q_scale``), else as handed."""
        return fp8.query_values(self.spec, query, scales)

    def entries(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of a plane as the attention reads them: as stored, or fp8_ds_mla's unpacked."""
        return rows if self.packed is None else self.packed.unpack(rows[:, 0])[:, None, :]

    def dequantize(self, stored: torch.Tensor, scale: float) -> torch.Tensor:
        """The numbers an fp8 cache's stored elements stand for, in float32."""
        return from_cache(stored, scale)

    def request_sinks(self, sinks: torch.Tensor | None, query_len: int) -> torch.Tensor | None:
        """The learned sinks one request's softmax uses: the layer's, for every request."""
        return sinks

    def gather(self, plane: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The first ``seq_len`` cached rows of one request, in position order."""
        block_size = self.spec.block_size
        num_blocks = -(-seq_len // block_size)
        blocks = block_table_row[:num_blocks].long()
        offsets = torch.arange(block_size, device=plane.device)
        slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:seq_len]
        return plane[slots]

    def softmax_scale(self) -> float:
        return self.spec.softmax_scale

    def seen(
        self,
        context_len: int,
        num_queries: int,
        num_keys: int,
        rows: torch.Tensor | None = None,
        tree: list[int] | None = None,
    ) -> torch.Tensor:
        """[q, num_keys] mask of the keys (in slot order) one request's new tokens see: causal by
        position and within the window (``visible``); a token tree's tokens at their depths, and
        among the new tokens their ancestors only; a sparse layer's index rows (``indexed``)."""
        if tree is None:
            query_positions = context_len + torch.arange(num_queries, device=self.device)
        else:
            depths = torch.tensor(token_tree.depths(tree), dtype=torch.long)
            query_positions = context_len + token_tree.to_device(depths, self.device)
        key_positions = torch.arange(num_keys, device=self.device)  # a chain's: its slot order
        if tree is not None:
            key_positions[context_len : context_len + num_queries] = query_positions
        seen = self.visible(query_positions, key_positions)
        if tree is not None:
            seen[:, context_len : context_len + num_queries] &= token_tree.ancestors(tree, self.device)
        if rows is not None:
            seen &= self.indexed(rows, context_len)
        return seen

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[q, k] mask: causal, and within the sliding window when there is one."""
        seen = key_positions[None, :] <= query_positions[:, None]
        if self.spec.sliding_window is not None:
            seen &= query_positions[:, None] - key_positions[None, :] < self.spec.sliding_window
        return seen

    def indexed(self, rows: torch.Tensor, context_len: int) -> torch.Tensor:
        """[q, s] mask of a sparse layer: each token sees the positions its index row lists (-1 and
        anything past its own position are no entries) and its window part, if the layer has one."""
        seq_len = context_len + rows.shape[0]
        query_positions = context_len + torch.arange(rows.shape[0], device=rows.device)
        key_positions = torch.arange(seq_len, device=rows.device)
        entries = rows.long()
        usable = (entries >= 0) & (entries <= query_positions[:, None])  # -1 and past its own position: no key
        seen = torch.zeros(rows.shape[0], seq_len + 1, dtype=torch.bool, device=rows.device)
        seen.scatter_(1, torch.where(usable, entries, seq_len), True)  # the unusable land in column seq_len
        seen = seen[:, :seq_len]
        if self.spec.sparse_window is not None:
            distance = query_positions[:, None] - key_positions[None, :]
            seen |= (distance >= 0) & (distance < self.spec.sparse_window)
        return seen

    def kv_head_of(self) -> list[int]:
        """The KV head each query head reads (query head h reads KV head h // group)."""
        return [head // self.spec.query_group_size for head in range(self.spec.num_heads)]

    def head_runs(self) -> list[tuple[int, int, int]]:
        """(first, end, KV head): runs of consecutive query heads that read one KV head. The math
        runs per run on slices: never a copy of the cache per query head (MLA's 128 query heads
        over one latent head would copy the whole context 128 times), and no index tensor (on a
        GPU, indexing with a host tensor copies it over and synchronizes)."""
        runs: list[tuple[int, int, int]] = []
        for head, kv in enumerate(self.kv_head_of()):
            if runs and runs[-1][2] == kv:
                runs[-1] = (runs[-1][0], head + 1, kv)
            else:
                runs.append((head, head + 1, kv))
        return runs

    def grouped(self) -> bool:
        """Query head h reads KV head h // group, as the contract says: the math then runs as one
        product over every (KV head, group) at once. (A subclass that maps heads otherwise, a
        planted defect, goes run by run.)"""
        group = self.spec.query_group_size
        return self.kv_head_of() == [head // group for head in range(self.spec.num_heads)]

    def masked_scores(self, query, key, context_len: int, seen: torch.Tensor | None = None) -> torch.Tensor:
        """[H, q, s] float32 logits (soft-capped), -inf where a query may not look (``seen``, the
        request's mask; None: a chain's, causal within the window)."""
        query, key = query.float(), key.float()
        if self.grouped():
            by_group = query.view(query.shape[0], key.shape[1], -1, query.shape[2])  # [q, Hkv, group, d]
            scores = torch.einsum("qkgd,skd->kgqs", by_group, key).reshape(query.shape[1], query.shape[0], key.shape[0])
        else:
            scores = query.new_empty(query.shape[1], query.shape[0], key.shape[0])
            for first, end, kv in self.head_runs():
                scores[first:end] = torch.einsum("qhd,kd->hqk", query[:, first:end], key[:, kv])
        scores *= self.softmax_scale()
        if self.spec.logits_soft_cap is not None:
            cap = self.spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        if seen is None:
            seen = self.seen(context_len, query.shape[0], key.shape[0])
        return scores.masked_fill(~seen, float("-inf"))

    def with_sinks(self, scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """[H, q, s] logits, and each head's learned sink as one more column (a key without a value)."""
        if sinks is None:
            return scores
        return torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)

    def log_sum_exp(self, query, key, context_len: int, sinks=None, seen=None) -> torch.Tensor:
        """[q, H] float32: the natural log of each softmax's denominator, the sink's term included."""
        return torch.logsumexp(self.with_sinks(self.masked_scores(query, key, context_len, seen), sinks), dim=-1).T

    def attend(self, query, key, value, context_len: int, sinks=None, seen=None) -> torch.Tensor:
        """query [q, H, Dk], key [s, Hkv, Dk], value [s, Hkv, Dv] → [q, H, Dv], in float32.
        ``sinks`` [H]: each head's learned sink joins its softmax as one more logit, whose weight
        is then dropped (it has no value). ``seen``: the request's [q, s] mask (``seen``)."""
        scores = self.masked_scores(query, key, context_len, seen)
        probs = self.with_sinks(scores, sinks).softmax(dim=-1)[..., : scores.shape[-1]]
        value = value.float()
        if self.grouped():
            by_group = probs.view(value.shape[1], -1, query.shape[0], key.shape[0])  # [Hkv, group, q, s]
            return torch.einsum("kgqs,skd->qkgd", by_group, value).reshape(
                query.shape[0], query.shape[1], value.shape[-1]
            )
        out = value.new_empty(query.shape[0], query.shape[1], value.shape[-1])
        for first, end, kv in self.head_runs():
            out[:, first:end] = torch.einsum("hqk,kd->qhd", probs[first:end], value[:, kv])
        return out
