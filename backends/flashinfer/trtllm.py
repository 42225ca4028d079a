"""``trtllm``: FlashInfer's trtllm_batch_decode_with_kv_cache — every input on the device
(trtllm-gen kernels on SM100, XQA kernels on SM90). ``max_seq_len`` is the host's upper bound.
Its fp8 path (an e4m3 cache written by our write kernel, the scales folded into the kernel's two
GEMM scales) is not claimed: see ``not_claimed``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends import fp8
from backends.base import PLAIN_LAYER, Capabilities, CGSupport, CommonAttentionMetadata, LayerParameters
from backends.features import ATTENTION_SINKS, FP8_KV_CACHES, TOKEN_TREES
from backends.flashinfer import DeviceLengthsEntryPoint, packed_rows, runs_on
from backends.paged_write import read_paged_rows, write_paged_rows
from backends.vendor_layout import packed, packed_output


@dataclass
class TrtllmMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    num_tokens: int


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
            TOKEN_TREES: "FlashInfer 0.7.2's XQA takes a spec-decode draft mask (bit-packed rows, with q_seq_len > 1; "
            "not with a sliding window), but this adapter serves decode only (max_query_len 1) and hands no mask: "
            "XQA's spec-decode path is not built or measured here",
        },
        head_dims=frozenset({64, 128}),
        block_sizes=frozenset({16, 32, 64}),
        features=frozenset({ATTENTION_SINKS}),
        max_query_len=1,
        cuda_graphs=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        **runs_on(frozenset({(9, 0), (10, 0), (10, 3)})),  # XQA on SM90, trtllm-gen on SM100/SM103
    )
    entry_point = ("flashinfer.decode", "trtllm_batch_decode_with_kv_cache")

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
        return TrtllmMetadata(common.block_table, common.seq_lens, self.limits.max_model_len, common.num_actual_tokens)

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
        self.kernel(
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
        land()
