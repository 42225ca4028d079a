"""``flashinfer_mla``: BatchMLAPagedAttentionWrapper (FA3 on SM90, FA2 elsewhere; FlashInfer's
``auto``) through the non-deprecated plan/run API of 0.7.x: ``MLAPlanMetadata.csr`` planned from
host lengths, packed query [T, H, latent + rope] and packed cache [blocks, block_size, latent + rope]
— exactly this suite's MLA contract, so nothing is copied. An e4m3 latent cache (SM90: FlashInfer's
FA3 MLA kernels) is written by our write kernel with the layer's one scale."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends import fp8
from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    Fp8Scales,
    GpuLimit,
    LayerParameters,
)
from backends.features import EMPTY_REQUESTS, FP8_KV_CACHES, FP8_QUERY, TOKEN_TREES
from backends.flashinfer import FA2_COMPUTE_CAPABILITIES, new_workspace, runs_on
from backends.flashinfer.paged_layout import paged_layout
from backends.paged_write import read_paged_rows, write_paged_rows
from backends.vendor_layout import packed, packed_output


@dataclass
class FlashInferMLAMetadata:
    num_tokens: int


def plan_arguments(spec: AttentionSpec, common: CommonAttentionMetadata, metadata_class) -> dict[str, Any]:
    """Keyword arguments of BatchMLAPagedAttentionWrapper.plan, CSR metadata from host lengths."""
    layout = paged_layout(common, spec.block_size)
    return dict(
        metadata=metadata_class.csr(common.query_start_loc_cpu, layout.kv_indptr, layout.kv_indices, layout.seq_lens),
        num_heads=spec.num_heads,
        head_dim_ckv=spec.kv_lora_rank,
        head_dim_kpe=spec.rope_dim,
        page_size=spec.block_size,
        causal=True,
        sm_scale=spec.softmax_scale,
        q_data_type=spec.dtype,
        kv_data_type=spec.effective_kv_cache_dtype,
        query_layout="packed",
        kv_cache_layout="packed",
    )


class FlashInferMLABackend(AttentionBackend):
    name = "flashinfer_mla"
    capabilities = Capabilities(
        kinds=frozenset({"mla"}),
        # Not claimed: measured, H100 (docs/findings.md). The fp8 path below stays, tested by a
        # subclass that claims it (tests/backends/test_flashinfer_mla_fp8_gpu.py), so that a fixed
        # FlashInfer shows as a passing test, to claim again.
        not_claimed={
            **dict.fromkeys(
                FP8_KV_CACHES,
                "FlashInfer 0.7.2's FA3 MLA kernel rounds the layer's scale to bf16 before it dequantizes "
                "(k_scale 0.1 becomes 0.10009765625): outputs up to 1.65x past the tolerance where a few "
                "large scores share the softmax, measured on an H100; its MLA kernels take e4m3 only",
            ),
            FP8_QUERY: "this adapter hands FlashInfer 0.7.2's BatchMLAPagedAttentionWrapper the query in the "
            "compute dtype; an fp8 query through it is not built or measured here",
            TOKEN_TREES: "FlashInfer 0.7.2's BatchMLAPagedAttentionWrapper.plan takes `causal` and no mask: a "
            "verify request's tokens are causal to it",
        },
        feature_gpus=dict.fromkeys(
            FP8_KV_CACHES, GpuLimit(frozenset({(9, 0)}), "FlashInfer's fp8 MLA plan: its FA3 kernels")
        ),
        head_dims=frozenset({576}),
        block_sizes=frozenset({16, 32, 64}),
        features=frozenset({EMPTY_REQUESTS}),  # measured: H200, numerics
        max_query_len=8,
        cuda_graphs=CGSupport.NEVER,
        needs_cpu_seq_lens=True,
        draft_step_update=False,
        **runs_on(FA2_COMPUTE_CAPABILITIES),
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: PLC0415 - optional dependency

        self.metadata_class = MLAPlanMetadata
        self.wrapper = BatchMLAPagedAttentionWrapper(new_workspace(self.device))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.block_size, self.spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        k_scale = fp8.scale_tensors(self.spec, layer.scales)[0]
        write_paged_rows(kv_cache, key, slot_mapping, self.spec.block_size, k_scale)

    def read_kv(self, kv_cache, slot_mapping):
        return read_paged_rows(kv_cache, slot_mapping, self.spec.block_size), None

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        self.wrapper.plan(**plan_arguments(self.spec, common, self.metadata_class))
        return FlashInferMLAMetadata(common.num_actual_tokens)

    def forward(
        self, query, kv_cache, metadata: FlashInferMLAMetadata, out, layer: LayerParameters = PLAIN_LAYER
    ) -> None:
        tokens = metadata.num_tokens
        target, land = packed_output(out[:tokens])
        self.wrapper.run(query=packed(query[:tokens]), kv_cache=kv_cache, out=target, **self._fp8_scales(layer.scales))
        land()

    def _fp8_scales(self, scales: Fp8Scales | None) -> dict:
        """An fp8 latent cache's one scale, for the 512 latent and the 64 rope channels alike, as
        host floats (FlashInfer's tensor form, ``ckv_scale_arr``, holds a scale per block and
        head, not one per layer)."""
        if not self.spec.fp8_kv_cache:
            return {}
        k_scale, _ = fp8.scale_floats(self.spec, scales)
        return dict(ckv_scale=k_scale, kpe_scale=k_scale)
