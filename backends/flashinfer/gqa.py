"""``flashinfer``: decode through BatchDecodeWithPagedKVCacheWrapper (tensor cores), prefill and
spec-verify through BatchPrefillWithPagedKVCacheWrapper (FA2), planned from host metadata.

A mixed batch whose single-token requests come first (as vLLM orders them) is split: the decodes
go to the decode wrapper, the rest to the prefill wrapper. Any other batch that is not pure decode
goes through the prefill wrapper whole, which handles single-token rows too. FA2 rather than FA3
for the prefill wrapper: on an H200 FlashInfer's FA2 ran spec-verify q=4 at batch 64 / context
4096 in 259 µs against FA3's 1133 µs.

A value head dim of its own (MLA prefill's layer, qk 192 / v 128): the cache holds [key | value]
rows per token and head, handed to the wrappers as a (key, value) pair of views; the decode
wrapper has one head dim, so every batch of such a layer goes through FA2 prefill wrappers, a
``use_cuda_graph`` one per captured batch size for decodes. (FA3 refused 192 / 128 on an H200:
"operation not supported".)

The log-sum-exp: the prefill wrapper returns it in the natural log (``lse_base="ln"``); the decode
wrapper only in base 2, converted.

fp8 KV cache (e4m3, e5m2): the wrappers are planned with the cache's dtype and run with the layer's
host scales; the cache rows are quantized by our write kernel (FlashInfer has no paged write that
takes a scale).

CUDA graphs: FlashInfer fixes a ``use_cuda_graph`` decode wrapper's batch size, so there is one
per captured batch size (as vLLM keeps them): ``limits.max_num_reqs`` from the start, any other
size made by ``build_for_capture`` (outside the capture). They share one float workspace and
slices of persistent indptr / indices / last-page buffers sized by the limits; ``build()``
re-plans the wrapper of the batch's size before every replay, and eager decodes of that size use
it too. (An engine capturing at padded sizes 1, 2, 4, … once got the non-graph wrapper inside its
graphs: its replay read freed plan buffers.)

Every plan goes through ``plan_staging``: a wrapper's plan is copied to the device from one
page-locked buffer when the stream reaches the copy, so a plan made while the last step is still
queued (an async scheduler) would overwrite it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from backends import fp8, token_tree
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
from backends.features import (
    ATTENTION_SINKS,
    DCP,
    FP8_E4M3,
    FP8_E5M2,
    FP8_QUERY,
    LOGITS_SOFT_CAP,
    LSE,
    SLIDING_WINDOW,
    TOKEN_TREES,
    VALUE_HEAD_DIM,
)
from backends.flashinfer import FA2_COMPUTE_CAPABILITIES, new_workspace, runs_on
from backends.flashinfer.paged_layout import paged_layout
from backends.flashinfer.plan_staging import PlanStaging
from backends.paged_write import read_paged_rows, write_paged_rows
from backends.utils import split_decodes_and_prefills, sub_batch
from backends.vendor_layout import packed, packed_output


@dataclass
class WrapperCall:
    wrapper: Any
    token_start: int
    token_end: int


@dataclass
class FlashInferMetadata:
    calls: list[WrapperCall]


VALUE_DIM_PAIR = (192, 128)  # the (q/k, v) head dims measured through FA2 on an H200: DeepSeek-V3's prefill layer


def tree_mask(common: CommonAttentionMetadata, sliding_window: int | None) -> torch.Tensor | None:
    """A step's token trees as FlashInfer's custom mask: each request's [query, sequence] keys it
    sees (``token_tree.visible``; a chain's its causal rule), flat, made on the host (where plan
    runs); None without trees."""
    parents = common.host_tree_parents
    if parents is None:
        return None
    starts, lengths = common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
    rows = []
    for request, seq_len in enumerate(lengths):
        tree = parents[starts[request] : starts[request + 1]].tolist()
        rows.append(token_tree.visible(tree, seq_len - len(tree), sliding_window).flatten())
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def packed_tree_mask(common: CommonAttentionMetadata, sliding_window: int | None) -> torch.Tensor | None:
    """``tree_mask`` packed as FlashInfer's prefill kernel reads it, on the host (uint8; None
    without trees): request b's bits, little-endian, from byte ``mask_indptr[b]`` on. Handed a
    packed mask, FlashInfer 0.7.2's plan computes ``mask_indptr`` as the mask *bits* before each
    request (query length x sequence length, summed) and its kernel adds it as a *byte* offset, so
    each request's bytes go at that offset and the bytes between stay unused. Its own packing
    (``custom_mask`` → ``segment_packbits``) is what costs a host sync: the packed size is read
    back and the indptr copied from pageable memory, every step."""
    mask = tree_mask(common, sliding_window)
    if mask is None:
        return None
    sizes = (common.query_lens_cpu * common.seq_lens_cpu).tolist()
    packed = torch.zeros(max(sum(sizes), 1), dtype=torch.uint8)
    weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.int32)
    bit, offset = 0, 0
    for size in sizes:
        bits = torch.nn.functional.pad(mask[bit : bit + size].to(torch.int32), (0, -size % 8))
        packed[offset : offset + bits.numel() // 8] = (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)
        bit, offset = bit + size, offset + size
    return packed


def window_left(spec: AttentionSpec) -> int:
    """FlashInfer counts the window without the token itself."""
    return -1 if spec.sliding_window is None else spec.sliding_window - 1


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        head_dims=frozenset({64, 128, 192, 256}),
        block_sizes=frozenset({16, 32, 64}),
        max_query_len=None,
        # Token trees as FlashInfer's packed custom mask, made on the host (``packed_tree_mask``).
        # DCP: its decode wrapper gives a row with no key (sequence length 0) output 0 and LSE -inf (H200).
        features=frozenset(
            {FP8_E4M3, FP8_E5M2, SLIDING_WINDOW, LOGITS_SOFT_CAP, VALUE_HEAD_DIM, LSE, TOKEN_TREES, DCP}
        ),
        not_claimed={
            FP8_QUERY: "FlashInfer 0.7.2 takes an fp8 query (scale_q) on its FA3 prefill path with an fp8 "
            "cache; this adapter plans FA2 wrappers with the query in the compute dtype",
            ATTENTION_SINKS: "FlashInfer 0.7.2's FA2 wrappers take `sinks`, but on SM90 their output misses them "
            "(H200: every learned-sinks case FAILed numerics, error 2.6 on outputs near 0.04)",
        },
        cuda_graphs=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        needs_cpu_seq_lens=True,
        draft_step_update=False,
        **runs_on(FA2_COMPUTE_CAPABILITIES),
    )

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, device) -> str | None:
        reason = super().unsupported_reason(spec, device)
        if reason is None and spec.head_dim == VALUE_DIM_PAIR[0] and spec.v_head_dim != VALUE_DIM_PAIR[1]:
            return "head_dim 192 is claimed only as MLA prefill's q/k head dim, with a value head dim of 128 (measured)"
        if reason is None and spec.v_head_dim != spec.head_dim and (spec.head_dim, spec.v_head_dim) != VALUE_DIM_PAIR:
            return (
                f"a value head dim of its own is claimed only as {VALUE_DIM_PAIR[0]} / {VALUE_DIM_PAIR[1]} "
                "(DeepSeek-V3's prefill layer, measured); not "
                f"{spec.head_dim} / {spec.v_head_dim}"
            )
        return reason

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        import flashinfer  # noqa: PLC0415 - optional dependency

        # The decode wrapper has one head dim: a layer with a value head dim of its own decodes through FA2 prefill.
        self.value_dim = spec.v_head_dim != spec.head_dim
        self.decode = (
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(new_workspace(self.device), "NHD", backend="fa2")
            if self.value_dim
            else flashinfer.BatchDecodeWithPagedKVCacheWrapper(new_workspace(self.device), "NHD", use_tensor_cores=True)
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(new_workspace(self.device), "NHD", backend="fa2")
        max_reqs = limits.max_num_reqs
        int32 = dict(dtype=torch.int32, device=self.device)
        self.graph_workspace = new_workspace(self.device)
        self.graph_qo_indptr = torch.arange(max_reqs + 1, **int32)  # a decode's: one query token per request
        self.graph_indptr = torch.zeros(max_reqs + 1, **int32)
        self.graph_indices = torch.zeros(max_reqs * limits.max_blocks_per_req(spec.block_size), **int32)
        self.graph_last_page_len = torch.zeros(max_reqs, **int32)
        self.graph_decode: dict[int, Any] = {}
        self.base2_lse = set() if self.value_dim else {id(self.decode)}  # the decode wrappers' (their LSE is in base 2)
        self.staging = {id(wrapper): PlanStaging(wrapper, self.device) for wrapper in (self.decode, self.prefill)}
        self._graph_decode_wrapper(max_reqs)

    def _graph_decode_wrapper(self, num_reqs: int):
        """The ``use_cuda_graph`` decode wrapper of one batch size (made once, never during a capture)."""
        if num_reqs not in self.graph_decode:
            import flashinfer  # noqa: PLC0415 - optional dependency

            if self.value_dim:
                self.graph_decode[num_reqs] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.graph_workspace,
                    "NHD",
                    backend="fa2",
                    use_cuda_graph=True,
                    qo_indptr_buf=self.graph_qo_indptr[: num_reqs + 1],
                    paged_kv_indptr_buf=self.graph_indptr[: num_reqs + 1],
                    paged_kv_indices_buf=self.graph_indices,
                    paged_kv_last_page_len_buf=self.graph_last_page_len[:num_reqs],
                )
            else:
                self.graph_decode[num_reqs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.graph_workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=self.graph_indptr[: num_reqs + 1],
                    paged_kv_indices_buffer=self.graph_indices,
                    paged_kv_last_page_len_buffer=self.graph_last_page_len[:num_reqs],
                )
                self.base2_lse.add(id(self.graph_decode[num_reqs]))
            self.staging[id(self.graph_decode[num_reqs])] = PlanStaging(self.graph_decode[num_reqs], self.device)
        return self.graph_decode[num_reqs]

    # NHD: [num_blocks, 2, block_size, kv_heads, head_dim]; a value dim of its own: [num_blocks,
    # block_size, kv_heads, head_dim + value_dim], a token's key then its value.
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        if self.value_dim:
            return (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim + spec.v_head_dim)
        return (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def key_value(self, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value pages, [num_blocks, block_size, kv_heads, dim] views."""
        if self.value_dim:
            return kv_cache[..., : self.spec.head_dim], kv_cache[..., self.spec.head_dim :]
        return kv_cache[:, 0], kv_cache[:, 1]

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        k_scale, v_scale = fp8.scale_tensors(self.spec, layer.scales)
        keys, values = self.key_value(kv_cache)
        write_paged_rows(keys, key, slot_mapping, self.spec.block_size, k_scale)
        write_paged_rows(values, value, slot_mapping, self.spec.block_size, v_scale)

    def read_kv(self, kv_cache, slot_mapping):
        return tuple(read_paged_rows(pages, slot_mapping, self.spec.block_size) for pages in self.key_value(kv_cache))

    def _plan_decode(self, wrapper, common: CommonAttentionMetadata) -> None:
        if self.value_dim:
            self._plan_prefill(common, wrapper)
            return
        spec = self.spec
        layout = paged_layout(common, spec.block_size)
        self.staging[id(wrapper)].plan(
            layout.kv_indptr,
            layout.kv_indices,
            layout.last_page_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.block_size,
            window_left=window_left(spec),
            logits_soft_cap=spec.logits_soft_cap,
            sm_scale=spec.softmax_scale,
            q_data_type=spec.dtype,
            kv_data_type=spec.effective_kv_cache_dtype,
        )

    def _plan_prefill(self, common: CommonAttentionMetadata, wrapper=None) -> None:
        spec = self.spec
        layout = paged_layout(common, spec.block_size)
        # Token trees: FlashInfer's custom mask, every request's [query, sequence] visibility flat
        # (the window in it too), in place of the causal rule.
        mask = packed_tree_mask(common, spec.sliding_window)
        masked = {}
        if mask is not None:  # packed here: FlashInfer's own packing syncs (``packed_tree_mask``)
            masked = dict(packed_custom_mask=token_tree.to_device(mask, self.device), causal=False, window_left=-1)
        self.staging[id(wrapper or self.prefill)].plan(
            common.query_start_loc_cpu,
            layout.kv_indptr,
            layout.kv_indices,
            layout.last_page_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.block_size,
            head_dim_vo=spec.v_head_dim,
            **{"causal": True, "window_left": window_left(spec), **masked},
            logits_soft_cap=spec.logits_soft_cap,
            sm_scale=spec.softmax_scale,
            q_data_type=spec.dtype,
            kv_data_type=spec.effective_kv_cache_dtype,
        )

    def build_for_capture(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        if common.max_query_len == 1:
            self._graph_decode_wrapper(common.num_reqs)
        return self.build(common)

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        tokens = common.num_actual_tokens
        if common.max_query_len == 1:
            wrapper = self.graph_decode.get(common.num_reqs, self.decode)
            self._plan_decode(wrapper, common)
            return FlashInferMetadata([WrapperCall(wrapper, 0, tokens)])
        decodes = 0 if self.value_dim else split_decodes_and_prefills(common).num_decodes
        if decodes == 0:
            self._plan_prefill(common)
            return FlashInferMetadata([WrapperCall(self.prefill, 0, tokens)])
        common.seq_lens_cpu  # noqa: B018 - one host copy (if any) for both halves, recorded on the step's metadata
        self._plan_decode(self.decode, sub_batch(common, 0, decodes))
        self._plan_prefill(sub_batch(common, decodes, common.num_reqs))
        return FlashInferMetadata([WrapperCall(self.decode, 0, decodes), WrapperCall(self.prefill, decodes, tokens)])

    def forward(
        self,
        query,
        kv_cache,
        metadata: FlashInferMetadata,
        out,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        lse = layer.lse
        # FlashInfer folds k_scale into the softmax scale and multiplies its output by v_scale: host
        # floats (vLLM's ``_k_scale_float``), fixed per layer, so a captured graph may bake them.
        scaled = (
            dict(zip(("k_scale", "v_scale"), fp8.scale_floats(self.spec, layer.scales)))
            if self.spec.fp8_kv_cache
            else {}
        )
        pages = self.key_value(kv_cache) if self.value_dim else kv_cache
        for call in metadata.calls:
            rows = slice(call.token_start, call.token_end)
            target, land = packed_output(out[rows])
            decode_kernel = id(call.wrapper) in self.base2_lse
            extra = dict(scaled)
            if lse is not None:  # the prefill wrapper's in the natural log; the decode wrapper's in base 2 only
                extra.update(lse=lse[rows], return_lse=True, **({} if decode_kernel else {"lse_base": "ln"}))
            call.wrapper.run(packed(query[rows]), pages, out=target, **extra)
            if lse is not None and decode_kernel:
                lse[rows].mul_(math.log(2))
            land()
