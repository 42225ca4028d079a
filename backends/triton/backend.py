"""``triton``: our own paged attention for MHA/GQA, graph-safe, needing no host lengths.

``build()`` copies nothing and reads no device value: the metadata references the step's device
tensors, plus two host ints (the number of requests, and a kernel variant picked from the exact
``max_query_len``). Every grid comes from the static limits, so a CUDA graph captured for one
batch replays correctly for any other of the same padded size; the variant only changes speed,
because requests longer than it are served by the prefill kernel, launched whenever a graph is
being captured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from backends.base import AttentionBackend, AttentionSpec, BackendLimits, Capabilities, CGSupport, CommonAttentionMetadata
from backends.triton import kernels

DECODE_VARIANTS = (1, 2, 4, 8)  # query lengths served by the split (flash-decoding) kernel
PARTIAL_BUFFER_BYTES = 256 * 2**20  # cap on split-KV scratch; the split count shrinks to fit
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_devices() -> frozenset[str]:
    """CUDA, plus the CPU when Triton's interpreter is on (TRITON_INTERPRET=1, used by CI)."""
    return frozenset({"cuda", "cpu"}) if interpreting() else frozenset({"cuda"})


def decode_variant(max_query_len: int) -> int:
    return next((q for q in DECODE_VARIANTS if q >= max_query_len), DECODE_VARIANTS[-1])


def num_kv_splits(limits: BackendLimits, bytes_per_split: int) -> int:
    by_length = triton.cdiv(limits.max_model_len, 256)
    by_memory = max(1, PARTIAL_BUFFER_BYTES // max(1, bytes_per_split))
    return max(1, min(MAX_SPLITS, by_length, by_memory))


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass
class TritonMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    max_query_len: int
    decode_q: int


class DeviceLengthsBackend(AttentionBackend):
    """The base of backends whose kernels read every length from the device, so that their
    ``build`` and ``update_for_draft_step`` only reference the step's device tensors (no host
    lengths, no copies). Also the split-KV scratch."""

    def allocate_split_buffers(self, value_dim: int) -> None:
        """Partial outputs and log-sum-exps for every (request, decode token, head, split), once."""
        partial_rows = self.limits.max_num_reqs * DECODE_VARIANTS[-1] * self.spec.num_heads
        self.num_splits = num_kv_splits(self.limits, partial_rows * value_dim * 4)
        self.partial_out = torch.empty(partial_rows * self.num_splits * value_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(partial_rows * self.num_splits, dtype=torch.float32, device=self.device)

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        return TritonMetadata(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens, block_table=common.block_table,
            num_reqs=common.num_reqs, max_query_len=common.max_query_len, decode_q=decode_variant(common.max_query_len),
        )

    def update_for_draft_step(self, metadata: TritonMetadata, common: CommonAttentionMetadata) -> TritonMetadata:
        # Nothing position-dependent lives in the metadata: the kernels read seq_lens and
        # query_start_loc from the device, where the draft loop advanced them. Re-point in case
        # the caller handed new tensors.
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = (
            common.query_start_loc, common.seq_lens, common.block_table,
        )
        return metadata


class TritonAttentionBackend(DeviceLengthsBackend):
    name = "triton"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}), head_dims=frozenset({64, 128, 256}), block_sizes=frozenset({16, 32, 64}),
        max_query_len=None, sliding_window=True, logits_soft_cap=True,
        cuda_graphs=CGSupport.ALWAYS, needs_cpu_seq_lens=False, draft_step_update=True,
        devices=interpreter_devices(), required_modules=("triton",),
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        self.group = spec.query_group_size
        self.upcast_dot = interpreting() and spec.dtype == torch.bfloat16
        self.block_d = triton.next_power_of_2(spec.head_dim)
        self.block_n = 32 if spec.head_dim > 128 else 64
        self.prefill_block_m = 64
        self.prefill_block_q = max(1, self.prefill_block_m // self.group)
        self.allocate_split_buffers(spec.head_dim)

    # Layout [2, num_blocks, kv_heads, block_size, head_dim]: one head's page is contiguous.
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kernels.write_kv_kernel[(slot_mapping.shape[0],)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=self.spec.num_kv_heads, HEAD_DIM=self.spec.head_dim, PAGE_SIZE=self.spec.block_size,
            BLOCK_HEADS=triton.next_power_of_2(self.spec.num_kv_heads), BLOCK_D=self.block_d, HAS_VALUE=True,
        )

    def forward(self, query, kv_cache, metadata: TritonMetadata, out) -> None:
        spec, limits = self.spec, self.limits
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scale_log2 = spec.softmax_scale * LOG2E  # the kernels' softmax runs in base 2
        soft_cap = spec.logits_soft_cap or 0.0
        window = spec.sliding_window or 0
        common_args = dict(
            GROUP=self.group, HEAD_DIM=spec.head_dim, BLOCK_D=self.block_d, BLOCK_N=self.block_n,
            PAGE_SIZE=spec.block_size, USE_WINDOW=spec.sliding_window is not None,
            USE_SOFT_CAP=spec.logits_soft_cap is not None, UPCAST_DOT=self.upcast_dot,
        )
        decode_q = metadata.decode_q
        block_m = max(16, triton.next_power_of_2(decode_q * self.group))
        kernels.decode_split_kernel[(limits.max_num_reqs, spec.num_kv_heads, self.num_splits)](
            query, k_cache, v_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
            self.partial_out, self.partial_lse, metadata.num_reqs, scale_log2, soft_cap, window,
            query.stride(0), query.stride(1), metadata.block_table.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=spec.num_heads, DECODE_Q=decode_q, BLOCK_M=block_m, NUM_SPLITS=self.num_splits, **common_args,
        )
        kernels.merge_splits_kernel[(limits.max_num_reqs * decode_q, spec.num_heads)](
            self.partial_out, self.partial_lse, out, metadata.query_start_loc, metadata.num_reqs,
            out.stride(0), out.stride(1),
            NUM_HEADS=spec.num_heads, DECODE_Q=decode_q, HEAD_DIM=spec.head_dim, BLOCK_D=self.block_d,
            NUM_SPLITS=self.num_splits, BLOCK_SPLITS=triton.next_power_of_2(self.num_splits),
        )
        if metadata.max_query_len > decode_q or is_capturing(self.device):
            num_query_blocks = triton.cdiv(limits.max_num_tokens, self.prefill_block_q) + limits.max_num_reqs
            kernels.prefill_kernel[(num_query_blocks, spec.num_kv_heads)](
                query, k_cache, v_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens, out,
                metadata.num_reqs, scale_log2, soft_cap, window,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1), metadata.block_table.stride(0),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                DECODE_Q=decode_q, BLOCK_Q=self.prefill_block_q, BLOCK_M=self.prefill_block_m, **common_args,
            )
