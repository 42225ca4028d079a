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

from backends import fp8, token_tree
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
from backends.features import (
    ATTENTION_SINKS,
    DCP,
    EMPTY_REQUESTS,
    FP8_E4M3,
    FP8_E5M2,
    FP8_KV_CACHES,
    FP8_QUERY,
    LOGITS_SOFT_CAP,
    LSE,
    SLIDING_WINDOW,
    TOKEN_TREES,
    VALUE_HEAD_DIM,
)
from backends.fp8 import to_cache
from backends.paged_write import write_paged_rows
from backends.triton import INSTALL_HINT

try:
    import triton

    from backends.triton import kernels
except ModuleNotFoundError as missing:  # an extra: the claims import, availability names the install
    if missing.name != "triton":
        raise

DECODE_VARIANTS = (1, 2, 4, 8)  # query lengths served by the split (flash-decoding) kernel
PARTIAL_BUFFER_BYTES = 256 * 2**20  # cap on split-KV scratch; the split count shrinks to fit
# Splits a request may take: enough for one request of a long context to fill an H100 or H200
# (its 132 SMs, each kv head or head block a program per split), not only a big batch.
MAX_SPLITS = 64
BLOCK_SPLITS = 16  # the merge kernel's tile over splits (it loops): one compiled variant for every split count
LOG2E = 1.4426950408889634
# Triton converts to and from e4m3 / e5m2 on Ada, Hopper and newer.
FP8_GPUS = dict.fromkeys(
    FP8_KV_CACHES, GpuLimit(frozenset({(8, 9), (9, 0), (10, 0), (10, 3), (12, 0)}), "Triton's fp8 conversions")
)
# The interpreter has no multiprocessors; this stand-in and a short minimum split make the CPU
# tests run one split (output written directly) and several (merged) on small cases.
INTERPRETER_MULTIPROCESSORS = 4


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_devices() -> frozenset[str]:
    """CUDA, plus the CPU when Triton's interpreter is on (TRITON_INTERPRET=1, used by CI)."""
    return frozenset({"cuda", "cpu"}) if interpreting() else frozenset({"cuda"})


def decode_variant(max_query_len: int) -> int:
    return next((q for q in DECODE_VARIANTS if q >= max_query_len), DECODE_VARIANTS[-1])


def num_kv_splits(limits: BackendLimits, bytes_per_split: int, floor_tokens: int) -> int:
    """The most KV splits a step may use: at least ``floor_tokens`` keys each at the longest
    context (16 under the interpreter), and scratch within PARTIAL_BUFFER_BYTES at
    ``bytes_per_split``."""
    by_length = triton.cdiv(limits.max_model_len, 16 if interpreting() else floor_tokens)
    by_memory = max(1, PARTIAL_BUFFER_BYTES // max(1, bytes_per_split))
    return max(1, min(MAX_SPLITS, by_length, by_memory))


def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    tree: bool  # the step carries token trees (their bits and depths in the backend's buffers)


class DeviceLengthsBackend(AttentionBackend):
    """The base of backends whose kernels read every length from the device, so that their
    ``build`` and ``update_for_draft_step`` only reference the step's device tensors (no host
    lengths, no copies). Also the split-KV scratch."""

    split_floor_tokens = 256  # the fewest keys a split may have at the longest context
    merge_columns: int | None = None  # output columns one merge program folds (None: the whole row)

    @staticmethod
    def device_scales(scales: Fp8Scales | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 layer's (k, v) scale tensors, which the kernels read on the device."""
        scales = fp8.required(scales)
        return scales.k_scale_tensor, scales.v_scale_tensor

    def allocate_split_buffers(self, value_dim: int) -> None:
        """Partial outputs and log-sum-exps for every (request, decode token, head, split) of the
        longest decode variant, once; shorter variants fit more splits in the same scratch."""
        partial_rows = self.limits.max_num_reqs * DECODE_VARIANTS[-1] * self.spec.num_heads
        floor = self.split_floor_tokens
        self.partial_row_capacity = partial_rows * num_kv_splits(self.limits, partial_rows * value_dim * 4, floor)
        self.max_splits = num_kv_splits(self.limits, 1, floor)
        self.multiprocessors = multiprocessors(self.device)
        self.partial_out = torch.empty(self.partial_row_capacity * value_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(self.partial_row_capacity, dtype=torch.float32, device=self.device)

    def splits_for(
        self, num_reqs: int, decode_q: int, programs_per_request: int, programs_per_multiprocessor: int
    ) -> int:
        """This step's KV split count, from host ints only: as many programs as fill the GPU
        (``programs_per_multiprocessor`` on each SM) and no more, because every extra split writes
        and merges partial rows. A request's output bits therefore depend on how many requests
        share its batch."""
        by_memory = self.partial_row_capacity // (self.limits.max_num_reqs * decode_q * self.spec.num_heads)
        # Rounded down: a batch that fills the GPU once unsplit is not split into a second wave.
        wanted = programs_per_multiprocessor * self.multiprocessors // (max(1, num_reqs) * programs_per_request)
        return max(1, min(self.max_splits, by_memory, wanted))

    def merge_splits(
        self,
        out,
        metadata: TritonMetadata,
        num_splits: int,
        value_dim: int,
        sinks: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Fold the partial results of a step that used more than one split into ``out`` (and the
        layer's learned sinks into their denominators, once; the rows' log-sum-exp into ``lse``)."""
        if num_splits == 1:
            return  # the split kernel wrote the output itself
        columns = triton.next_power_of_2(min(self.merge_columns or value_dim, value_dim))
        rows = self.limits.max_num_reqs * metadata.decode_q
        kernels.merge_splits_kernel[(rows, self.spec.num_heads, triton.cdiv(value_dim, columns))](
            self.partial_out,
            self.partial_lse,
            out,
            metadata.query_start_loc,
            metadata.num_reqs,
            num_splits,
            out.stride(0),
            out.stride(1),
            self.partial_lse if sinks is None else sinks,
            self.partial_lse if lse is None else lse,
            0 if lse is None else lse.stride(0),
            self.spec.num_heads,
            metadata.decode_q,
            HEAD_DIM=value_dim,
            BLOCK_D=columns,
            BLOCK_SPLITS=BLOCK_SPLITS,
            HAS_SINKS=sinks is not None,
            RETURN_LSE=lse is not None,
        )

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        return TritonMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            decode_q=decode_variant(common.max_query_len),
            tree=False,
        )

    def update_for_draft_step(self, metadata: TritonMetadata, common: CommonAttentionMetadata) -> TritonMetadata:
        # Nothing position-dependent lives in the metadata: the kernels read seq_lens and
        # query_start_loc from the device, where the draft loop advanced them. Re-point in case
        # the caller handed new tensors.
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = (
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
        )
        return metadata


# The split kernel's launch, swept on an H100 by conformance/tuning/tune_triton.py (decode and
# spec-verify, batch 1 to 256): 4 warps, 3 stages and 128-key tiles were best or within 1.3% of
# the best on every shape. Head dim 256 keeps 32-key tiles (shared memory). Programs wanted per
# SM, by decode variant: decode (q = 1) was fastest split into up to 8 per SM (batch 64: 2 splits,
# 388 µs against 410 unsplit), spec-verify into up to 4 (q = 4, batch 64: unsplit, 373 against 407).
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
DECODE_PROGRAMS_PER_MULTIPROCESSOR = {1: 8, 2: 4, 4: 4, 8: 4}
# Over an fp8 cache a program reads half the bytes and is bound by latency, not bandwidth: on an
# H200 (tune_triton --splits-only), spec-verify q = 4 at batch 64 split in two took 32k keys from
# 1420 to 1338 µs and 4096 keys from 202 to 224 µs (FlashInfer's fp8: 1528 and 233). The split
# count cannot follow the context (no host lengths), so fp8 verify q = 4 takes 8 programs an SM
# (q = 2 and 8 were not swept).
FP8_CACHE_PROGRAMS_PER_MULTIPROCESSOR = {**DECODE_PROGRAMS_PER_MULTIPROCESSOR, 4: 8}


class TritonAttentionBackend(DeviceLengthsBackend):
    name = "triton"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        head_dims=frozenset({64, 128, 192, 256}),
        block_sizes=frozenset({16, 32, 64}),
        max_query_len=None,
        # An empty request's programs return before reading anything.
        features=frozenset(
            {
                FP8_E4M3,
                FP8_E5M2,
                SLIDING_WINDOW,
                LOGITS_SOFT_CAP,
                ATTENTION_SINKS,
                VALUE_HEAD_DIM,
                LSE,
                EMPTY_REQUESTS,
                TOKEN_TREES,
                FP8_QUERY,
                DCP,
            }
        ),
        max_tree_tokens=token_tree.MAX_BIT_TOKENS,  # a token's ancestors are one int64's bits
        feature_gpus={**FP8_GPUS, FP8_QUERY: FP8_GPUS[FP8_E4M3]},
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=interpreter_devices(),
        required_modules=("triton",),
        install_hint=INSTALL_HINT,
    )
    # 128, not 256: at 512 keys the floor of 256 left a single request 2 or 3 splits, 8 or 24
    # programs on 132 SMs. With 128, spec-verify q = 2 / 4 / 8 at batch 1 and 512 keys took 0.95 /
    # 0.98 / 1.09x FlashInfer's time against 1.11 / 1.13 / 1.29x, every other GQA bench shape within
    # a run's noise; 64 was slower at 4096 keys (1.24 against 1.12x). H100, one run of
    # ``python -m conformance.tuning.tune_split_floor``. triton_mla keeps 256 (not swept).
    split_floor_tokens = 128
    # The merge spreads a row's 128 output columns over two programs: one program a (row, head)
    # left a single 32k request's merge 32 programs (10.9 us against FlashInfer's 6.0 in 264 blocks,
    # Nsight Compute, H100). With 64 columns a program, batch 1 at 32k keys went from 1.11 / 1.13x
    # FlashInfer's time to 1.08 / 1.11x (decode / verify q = 8) and q = 8 at 4096 keys from 1.13 to
    # 1.10x; batch 8 did not move (H100, two A/B runs side by side). Each output element is folded
    # from the same splits in the same order, so its bits do not change. triton_mla keeps whole
    # rows: its 128 heads already fill the GPU, and eight programs of a 512-wide row took 5-23 %
    # longer in the same runs.
    merge_columns = 64

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        self.group = spec.query_group_size
        # Over an fp8 cache the products are fp16 (``kernels.fp16_scaling``), which the interpreter runs right.
        self.upcast_dot = interpreting() and spec.dtype == torch.bfloat16 and not spec.fp8_kv_cache
        self.block_d = triton.next_power_of_2(spec.head_dim)
        self.block_dv = triton.next_power_of_2(spec.v_head_dim)
        self.block_n = 32 if spec.head_dim > 128 else 64  # the prefill kernel's key tile
        self.decode_block_n = 32 if spec.head_dim > 128 else 128
        self.prefill_block_m = 64
        self.prefill_block_q = max(1, self.prefill_block_m // self.group)
        self.allocate_split_buffers(spec.v_head_dim)
        # Token trees: each token's ancestors (an int64 bitmask) and depth, made on the device in build.
        self.tree_ancestors = torch.zeros(limits.max_num_tokens, dtype=torch.int64, device=self.device)
        self.tree_depths = torch.zeros(limits.max_num_tokens, dtype=torch.int32, device=self.device)

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        metadata = super().build(common)
        if common.tree_parents is not None:  # a host fact of the step: whether it has trees
            bits, depths = token_tree.ancestor_bits(common.query_start_loc, common.tree_parents)
            self.tree_ancestors[: bits.shape[0]].copy_(bits)
            self.tree_depths[: depths.shape[0]].copy_(depths)
            metadata.tree = True
        return metadata

    # Layout [2, num_blocks, kv_heads, block_size, head_dim]: one head's page is contiguous. Where
    # the value head dim differs (d192/128), [num_blocks, kv_heads, block_size, head_dim +
    # v_head_dim]: a token's key then its value, the two planes sharing their strides.
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        if spec.v_head_dim != spec.head_dim:
            return (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim + spec.v_head_dim)
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V), each [num_blocks, kv_heads, block_size, its head dim], with the same strides."""
        if self.spec.v_head_dim != self.spec.head_dim:
            return kv_cache[..., : self.spec.head_dim], kv_cache[..., self.spec.head_dim :]
        return kv_cache[0], kv_cache[1]

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        scales = layer.scales
        k_cache, v_cache = self.planes(kv_cache)
        if self.spec.v_head_dim != self.spec.head_dim:  # each plane by the paged writer, in its own width
            for plane, rows, scale in zip((k_cache, v_cache), (key, value), fp8.scale_tensors(self.spec, scales)):
                write_paged_rows(plane.transpose(1, 2), rows, slot_mapping, self.spec.block_size, scale)
            return
        quantize = self.spec.fp8_kv_cache
        if quantize and interpreting():
            # The interpreter's fp32 -> e4m3 conversion flushes subnormals to zero (a GPU's rounds
            # them): quantize with torch's conversion, on the device scales, and store as they are.
            key, value = (
                to_cache(rows, scale, k_cache.dtype) for rows, scale in zip((key, value), self.device_scales(scales))
            )
            quantize = False
        k_scale, v_scale = self.device_scales(scales) if quantize else (slot_mapping, slot_mapping)
        kernels.write_kv_kernel[(slot_mapping.shape[0],)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_scale,
            v_scale,
            self.spec.num_kv_heads,
            self.spec.block_size,
            HEAD_DIM=self.spec.head_dim,
            BLOCK_HEADS=triton.next_power_of_2(self.spec.num_kv_heads),
            BLOCK_D=self.block_d,
            HAS_VALUE=True,
            QUANTIZE=quantize,
            FP8_MAX=float(torch.finfo(k_cache.dtype).max) if quantize else 448.0,
        )

    def read_kv(self, kv_cache, slot_mapping):
        blocks, offsets = slot_mapping // self.spec.block_size, slot_mapping % self.spec.block_size
        k_cache, v_cache = self.planes(kv_cache)
        return k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]

    def forward(
        self,
        query,
        kv_cache,
        metadata: TritonMetadata,
        out,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        spec, limits = self.spec, self.limits
        scales, sinks, lse = layer.scales, layer.sinks, layer.lse
        if spec.attention_sinks and sinks is None:
            raise ValueError("a layer with learned attention sinks needs them (``layer.sinks`` of forward)")
        sinks_ptr = metadata.seq_lens if sinks is None else sinks  # read only with HAS_SINKS
        lse_args = (self.partial_lse, 0) if lse is None else (lse, lse.stride(0))  # written only with RETURN_LSE
        k_cache, v_cache = self.planes(kv_cache)
        kv_fp8 = spec.fp8_kv_cache
        k_scale, v_scale = self.device_scales(scales) if kv_fp8 else (metadata.seq_lens, metadata.seq_lens)
        # An fp8 query's scale, read on the device (a placeholder pointer, never read, without one).
        q_scale = fp8.required(scales).q_scale_tensor if spec.fp8_query else metadata.seq_lens
        scale_log2 = spec.softmax_scale * LOG2E  # the kernels' softmax runs in base 2
        soft_cap = spec.logits_soft_cap or 0.0
        window = spec.sliding_window or 0
        common_args = dict(
            GROUP=self.group,
            HEAD_DIM=spec.head_dim,
            BLOCK_D=self.block_d,
            PAGE_SIZE=spec.block_size,
            USE_WINDOW=spec.sliding_window is not None,
            USE_SOFT_CAP=spec.logits_soft_cap is not None,
            UPCAST_DOT=self.upcast_dot,
            KV_FP8=kv_fp8,
            Q_FP8=spec.fp8_query,
            HAS_SINKS=sinks is not None,
            HEAD_DIM_V=spec.v_head_dim,
            BLOCK_DV=self.block_dv,
            RETURN_LSE=lse is not None,
            TREE=metadata.tree,
        )
        decode_q = metadata.decode_q
        block_m = max(16, triton.next_power_of_2(decode_q * self.group))
        num_splits = self.splits_for(
            metadata.num_reqs,
            decode_q,
            spec.num_kv_heads,
            (FP8_CACHE_PROGRAMS_PER_MULTIPROCESSOR if kv_fp8 else DECODE_PROGRAMS_PER_MULTIPROCESSOR)[decode_q],
        )
        kernels.decode_split_kernel[(limits.max_num_reqs, spec.num_kv_heads, num_splits)](
            query,
            k_cache,
            v_cache,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.partial_out,
            self.partial_lse,
            out,
            metadata.num_reqs,
            num_splits,
            scale_log2,
            soft_cap,
            window,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            metadata.block_table.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_scale,
            v_scale,
            q_scale,
            sinks_ptr,
            *lse_args,
            self.tree_ancestors,
            self.tree_depths,
            NUM_HEADS=spec.num_heads,
            DECODE_Q=decode_q,
            BLOCK_M=block_m,
            BLOCK_N=self.decode_block_n,
            ONE_SPLIT=num_splits == 1,
            **common_args,
            num_warps=DECODE_NUM_WARPS,
            num_stages=DECODE_NUM_STAGES,
        )
        self.merge_splits(out, metadata, num_splits, spec.v_head_dim, sinks, lse)
        if metadata.max_query_len > decode_q or is_capturing(self.device):
            num_query_blocks = triton.cdiv(limits.max_num_tokens, self.prefill_block_q) + limits.max_num_reqs
            kernels.prefill_kernel[(num_query_blocks, spec.num_kv_heads)](
                query,
                k_cache,
                v_cache,
                metadata.block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
                out,
                metadata.num_reqs,
                scale_log2,
                soft_cap,
                window,
                query.stride(0),
                query.stride(1),
                out.stride(0),
                out.stride(1),
                metadata.block_table.stride(0),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                k_scale,
                v_scale,
                q_scale,
                sinks_ptr,
                *lse_args,
                self.tree_ancestors,
                self.tree_depths,
                DECODE_Q=decode_q,
                BLOCK_Q=self.prefill_block_q,
                BLOCK_M=self.prefill_block_m,
                BLOCK_N=self.block_n,
                **common_args,
            )
