"""``trtllm``: FlashInfer's TensorRT-LLM decode kernels, every input on the device. A decode step
(every request one token) goes through trtllm_batch_decode_with_kv_cache (trtllm-gen kernels on
SM100, XQA kernels on SM90); a step with longer requests (spec-verify, token trees, a short
prefill) through XQA's speculative-decoding path, xqa_batch_decode_with_kv_cache, which FlashInfer's
trtllm entry point would route to on SM90 but without ragged requests: here each request keeps
its own length (``q_cu_seq_lens``) and each row gets a draft mask, the tree's (``tree_parents``)
or a chain's, its ancestors' bits made on the device in ``build``. ``max_seq_len`` is the host's
upper bound. Its fp8 path (an e4m3 cache written by our write kernel, the scales folded into the
kernel's two GEMM scales) is not claimed: see ``not_claimed``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from backends import fp8, token_tree
from backends.base import (
    PLAIN_LAYER,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import ATTENTION_SINKS, FP8_KV_CACHES, FP8_QUERY, TOKEN_TREES
from backends.flashinfer import DeviceLengthsEntryPoint, packed_rows, runs_on
from backends.paged_write import read_paged_rows, write_paged_rows
from backends.vendor_layout import packed, packed_output

# XQA compiles a module per maximum draft length (``q_seq_len``): every verify step is handed the
# longest a request may be, so one module per layer serves every step, and each row's draft mask
# is two 32-bit words, one int64 of ``token_tree.ancestor_bits`` (XQA reads ceil(q_seq_len / 32)
# words a row, bit j of a row: the request's new token j is visible).
VERIFY_TOKENS = token_tree.MAX_BIT_TOKENS


@dataclass
class TrtllmMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    num_tokens: int
    query_start_loc: torch.Tensor
    verify: bool  # a request longer than one token: XQA's speculative-decoding path, masks in the backend's buffer


class TrtllmBackend(DeviceLengthsEntryPoint):
    name = "trtllm"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        # The fp8 path below runs, but XQA computes in fp8 ("xqa will run fp8 calculation"): on an
        # H200 its e4m3 decode missed the bf16 tolerance by up to 10.8x (error 74 on an output of
        # 342), so it is not the attention of the dequantized cache the contract asks for.
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES,
                "XQA's e4m3 path on SM90 computes in fp8 and missed the tolerance by up to 10.8x on an H200 "
                "(max error 74 on an output of 342); e5m2 it does not take; trtllm-gen (SM100) is untested here",
            ),
            FP8_QUERY: "XQA takes the query in fp16 or bf16 only (FlashInfer 0.7.2's XQA module: \"only float16 "
            "and bfloat16 input are supported\"); trtllm-gen's fp8-query kernels (SM100) are untested here",
        },
        head_dims=frozenset({64, 128}),
        block_sizes=frozenset({16, 32, 64}),
        features=frozenset({ATTENTION_SINKS, TOKEN_TREES}),
        # XQA is a decode kernel: verify rows and short prefills, each request's rows one draft mask.
        max_query_len=VERIFY_TOKENS,
        max_tree_tokens=VERIFY_TOKENS,
        cuda_graphs=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        **runs_on(frozenset({(9, 0), (10, 0), (10, 3)})),  # XQA on SM90, trtllm-gen on SM100/SM103
    )
    entry_point = ("flashinfer.decode", "trtllm_batch_decode_with_kv_cache")
    verify_entry_point = "xqa_batch_decode_with_kv_cache"  # in the entry point's module

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        self.verify_kernel = getattr(importlib.import_module(self.entry_point[0]), self.verify_entry_point)
        # Each row's draft mask, made in build on the device (a graph replay re-reads it).
        self.masks = torch.zeros(limits.max_num_tokens, dtype=torch.int64, device=self.device)

    # HND: [num_blocks, 2, kv_heads, block_size, head_dim]
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        return (num_blocks, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        k_scale, v_scale = fp8.scale_tensors(self.spec, layer.scales)
        write_paged_rows(kv_cache[:, 0].transpose(1, 2), key, slot_mapping, self.spec.block_size, k_scale)
        write_paged_rows(kv_cache[:, 1].transpose(1, 2), value, slot_mapping, self.spec.block_size, v_scale)

    def read_kv(self, kv_cache, slot_mapping):
        return tuple(
            read_paged_rows(kv_cache[:, plane].transpose(1, 2), slot_mapping, self.spec.block_size) for plane in (0, 1)
        )

    def build(self, common: CommonAttentionMetadata) -> TrtllmMetadata:
        # The upper bound is what the kernel is given: the true lengths are read on the device.
        verify = common.max_query_len > 1
        if verify:
            parents = common.tree_parents
            if parents is None:  # chains: each row sees its request's earlier rows
                parents = token_tree.chain_parents(common.query_start_loc, common.num_actual_tokens)
            bits, _ = token_tree.ancestor_bits(common.query_start_loc, parents)
            self.masks[: bits.shape[0]].copy_(bits)
        return TrtllmMetadata(
            common.block_table,
            common.seq_lens,
            self.limits.max_model_len,
            common.num_actual_tokens,
            common.query_start_loc,
            verify,
        )

    def update_for_draft_step(self, metadata: TrtllmMetadata, common: CommonAttentionMetadata) -> TrtllmMetadata:
        metadata = super().update_for_draft_step(metadata, common)
        metadata.query_start_loc = common.query_start_loc
        return metadata

    def forward(
        self,
        query,
        kv_cache,
        metadata: TrtllmMetadata,
        out,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        tokens = metadata.num_tokens
        # The kernel's two GEMM scales carry the fp8 scales (host floats, fixed per layer, as vLLM
        # passes them): scores × softmax_scale × k_scale, output × v_scale.
        k_scale, v_scale = fp8.scale_floats(self.spec, layer.scales)
        target, land = packed_output(out[:tokens])
        common = dict(
            query=packed(query[:tokens]),
            kv_cache=kv_cache,
            workspace_buffer=self.workspace,
            block_tables=packed_rows(metadata.block_table),
            seq_lens=metadata.seq_lens,
            max_seq_len=metadata.max_seq_len,
            bmm1_scale=self.spec.softmax_scale * k_scale,
            bmm2_scale=v_scale,
            out=target,
            kv_layout="HND",
            sinks=layer.sinks,
        )
        if metadata.verify:
            # Ragged requests (query_start_loc), each row's mask XQA's uint16 words: bit j of the
            # row's 64 (little-endian) is the request's new token j.
            masks = self.masks[:tokens].view(torch.uint16).view(tokens, VERIFY_TOKENS // 16)
            self.verify_kernel(
                **common, q_len_per_req=VERIFY_TOKENS, q_cu_seq_lens=metadata.query_start_loc, mask=masks
            )
        else:
            self.kernel(**common)
        land()
