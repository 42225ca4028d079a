"""``triton_mla``'s sparse read (DeepSeek's DSA, ``sparse_topk``): the metadata it builds and
advances, and the launch of ``sparse_mla_kernels``.

Each token's request and position are position-dependent metadata, made on the device in
``build`` and remade in ``update_for_draft_step`` from the advanced ``seq_lens`` (stale positions
would move every token's causal edge and window part: vLLM #41162's crash under MTP was such
metadata left behind by the draft loop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import AttentionSpec, BackendLimits, CommonAttentionMetadata, LayerParameters
from backends.triton.backend import LOG2E, TritonMetadata

try:
    import triton

    from backends.triton import sparse_mla_kernels
except ModuleNotFoundError as missing:  # an extra: see backends.triton
    if missing.name != "triton":
        raise

# Heads per program: a program reads its token's gathered keys once for all its heads, so 128
# heads in programs of 64 read them twice where programs of 16 read them eight times, and a
# 64-row tile feeds Hopper's warpgroup MMA. The launch for each count, (index entries or window
# positions per tile, warps, stages), from conformance/tuning/tune_sparse_mla.py on an H200 (the
# notebook, "sparse kernel"; FlashMLA's forward for comparison):
# - 64 heads (64, 8, 3): DeepSeek-V3.2's top 2048, 128 heads, batch 64, 4096 keys, 196 µs bf16
#   and 229 µs fp8_ds_mla (FlashMLA's kernel alone 138 and 131); 32 heads a program (64, 4, 2)
#   took 286 µs there, 16 heads (32, 4, 3) 459 and 709.
# - 16 heads (64, 8, 3): TP 8's 16 heads, batch 64, 32768 keys, 141 µs against 205 for the
#   earlier (32, 4, 3) and FlashMLA's 92, both one split a token; two (``num_splits`` counting only
#   the step's real tokens) 90 µs against FlashMLA's 90. Padding those 16 heads to a program of 32 or 64 rows,
#   as FlashMLA does to 64, took 172 and 192 µs at their best launches (one split): see
#   MIN_HEADS_PER_PROGRAM. 4 warps (64, 4, 2) at four splits took 82 µs in one sweep and 347
#   unsplit: not shipped, as a step of enough tokens not to split would run it unsplit.
# - 32 heads: not timed on a 32-head layer; (64, 8, 3) was also the best launch for the 16-head
#   layer padded to 32.
MIN_HEADS_PER_PROGRAM = 16  # tl.dot's smallest tile
MAX_HEADS_PER_PROGRAM = 64
LAUNCH = {16: (64, 8, 3), 32: (64, 8, 3), 64: (64, 8, 3)}
# With a window part Triton pipelines the window loop's contiguous copies through shared memory:
# at 64 heads and 64-entry tiles, top 64 with a window of 128 asked for 295 KB, over the 227 KB a
# block may have on Hopper (an H200's OutOfResources; the compiled kernel's metadata on a CPU, as
# tests/backends/test_sparse_mla_launch.py reads it for every launch). 32-entry tiles take 148 KB
# and pass every check on an H200 (64 and 128 heads, bf16 and fp8_ds_mla; not timed). (The window
# loop unpipelined, ``tl.range(..., num_stages=1)``, would keep 64-entry tiles at 147 KB: not tried.)
# At 16 and 32 heads the window keeps the launches that every check passed with on an H200 before
# the launches above changed (not timed).
WINDOW_LAUNCH = {16: (32, 4, 3), 32: (64, 4, 2), 64: (32, 8, 3)}
POSITIONS_BLOCK = 64
# Heads a merge program folds: [16, 512] fp32 rows need 161 registers at 4 warps on SM90 and no
# spills, where 64 heads spilled 8 KB (compiled on a CPU); more programs, too, at batch 8.
MERGE_HEADS = 16


def heads_per_program(num_heads: int) -> int:
    """A power of two from MIN_HEADS_PER_PROGRAM to MAX_HEADS_PER_PROGRAM (a layer of fewer heads
    pads its programs' rows, masked)."""
    return min(MAX_HEADS_PER_PROGRAM, max(MIN_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads)))


def launch(spec: AttentionSpec) -> tuple[int, int, int, int]:
    """(heads per program, index entries or window positions per tile, warps, stages)."""
    heads = heads_per_program(spec.num_heads)
    return (heads, *(WINDOW_LAUNCH if spec.sparse_window else LAUNCH)[heads])


@dataclass
class SparseMetadata(TritonMetadata):
    token_request: torch.Tensor  # [max_num_tokens] int32: each token's request
    token_position: torch.Tensor  # [max_num_tokens] int32: each token's position in its request
    num_tokens: torch.Tensor  # [1] int32: the step's real tokens (query_start_loc[num_reqs])


def num_splits(
    num_tokens: int, real_tokens: int, head_blocks: int, tiles: int, multiprocessors: int, capacity: int
) -> int:
    """How many programs share a token's ``tiles`` (its index row's and its window's): as many as
    fill the GPU's SMs once, one program an SM (compiled for SM90 without a window, DeepSeek-V3.2's
    128-head block takes 222 KB of shared memory and 255 registers a thread, the 16-head one 95 KB
    and 177: either way one block of 8 warps an SM; the window launches of 4 warps were not
    compiled for this; Nsight Compute's run of the GPU's compile counted 183 at 16 heads), every
    split with a whole tile or more, and within the backend's split scratch (``capacity`` rows a
    head for the ``num_tokens`` rows launched).
    The SMs are shared among the programs of ``real_tokens`` only, rounded down: the rows an
    engine pads its batch with past them return at once and take no SM's time. Counting them, 64
    tokens padded by 3 on 132 SMs were one split, 67 programs with 65 SMs idle (16 heads, 32768
    keys on an H200: 141 µs, two splits 91); rounding the padded count to the nearest instead
    made two waves where one would do whenever the rows past one wave were real (35 tokens at 16
    heads: 91 µs against 68, 17 tokens: 56 against 43).
    From host ints only (the launched rows and the step's ``num_reqs × max_query_len``), so a
    CUDA graph replays the split of its capture, whose padding requests count as real; a sparse
    row's bits therefore follow the number of requests in its step."""
    programs = max(1, min(real_tokens, num_tokens) * head_blocks)
    wanted = max(1, min(multiprocessors // programs, tiles, capacity // max(1, num_tokens)))
    return triton.cdiv(tiles, triton.cdiv(tiles, wanted)) if tiles else 1  # no split left without a tile


class SparsePositions:
    """The persistent buffers of a sparse layer's metadata (each token's request and position),
    made on the device in ``build`` and remade in ``update_for_draft_step``; the indexer's too."""

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        self.spec = spec
        int32 = dict(dtype=torch.int32, device=device)
        self.token_request = torch.zeros(limits.max_num_tokens, **int32)
        self.token_position = torch.zeros(limits.max_num_tokens, **int32)
        self.num_tokens = torch.zeros(1, **int32)

    def build(self, metadata: TritonMetadata) -> SparseMetadata:
        sparse = SparseMetadata(
            **vars(metadata),
            token_request=self.token_request,
            token_position=self.token_position,
            num_tokens=self.num_tokens,
        )
        self.place_tokens(sparse)
        return sparse

    def place_tokens(self, metadata: SparseMetadata) -> None:
        """Each token's request and position, on the device, from the metadata's lengths."""
        chunks = triton.cdiv(max(metadata.max_query_len, 1), POSITIONS_BLOCK)  # a host int: no sync
        sparse_mla_kernels.sparse_positions_kernel[(metadata.num_reqs, chunks)](
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.token_request,
            metadata.token_position,
            metadata.num_tokens,
            metadata.num_reqs,
            BLOCK=POSITIONS_BLOCK,
        )

    def update_for_draft_step(self, metadata: SparseMetadata, common: CommonAttentionMetadata) -> SparseMetadata:
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = (
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
        )
        metadata.max_query_len = common.max_query_len
        self.place_tokens(metadata)  # every position moved on by one
        return metadata


class SparseMLARead(SparsePositions):
    """``triton_mla``'s sparse read: the metadata, and its kernels' launches. A step of few tokens
    splits each token's tiles over several programs (FlashMLA's sparse decode does too) into the
    backend's split scratch, then merges."""

    def __init__(
        self, spec: AttentionSpec, limits: BackendLimits, device: torch.device, upcast_dot: bool, scratch: tuple
    ) -> None:
        super().__init__(spec, limits, device)
        self.upcast_dot = upcast_dot
        # (partial rows, their LSEs, the SMs): the backend's split-KV scratch, which a sparse layer
        # does not otherwise use.
        self.partial_out, self.partial_lse, self.multiprocessors = scratch

    def forward(self, query, kv_cache, metadata: SparseMetadata, out, layer: LayerParameters, k_scale) -> None:
        """``k_scale``: an fp8 cache's one scale (device tensor), None otherwise; DeepSeek's
        fp8_ds_mla (``spec.kv_scale_block``) has its scales inside each entry, a pool of bytes."""
        spec = self.spec
        if layer.topk_indices is None:
            raise ValueError("a sparse layer's forward needs its index rows (layer.topk_indices)")
        indices, lse = layer.topk_indices, layer.lse
        heads, block_n, num_warps, num_stages = launch(spec)
        tokens, head_blocks = query.shape[0], triton.cdiv(spec.num_heads, heads)
        rows = min(self.partial_lse.numel(), self.partial_out.numel() // spec.kv_lora_rank)
        tiles = triton.cdiv(spec.sparse_topk, block_n) + triton.cdiv(spec.sparse_window or 0, block_n)
        # At least the step's tokens, from the host; a batch of empty requests (no query) counts every row.
        real = metadata.num_reqs * metadata.max_query_len or tokens
        splits = num_splits(tokens, real, head_blocks, tiles, self.multiprocessors, rows // spec.num_heads)
        if lse is not None:  # triton_mla claims no log-sum-exp: a row asked for one is not split
            splits = 1
        sparse_mla_kernels.sparse_mla_kernel[(tokens, head_blocks, splits)](
            query,
            kv_cache,
            metadata.block_table,
            metadata.token_request,
            metadata.token_position,
            metadata.num_tokens,
            indices,
            out,
            out if lse is None else lse,
            self.partial_out,
            self.partial_lse,
            metadata.seq_lens if k_scale is None else k_scale,
            spec.softmax_scale * LOG2E,
            splits,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            indices.stride(0),
            0 if lse is None else lse.stride(0),
            metadata.block_table.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
            NUM_HEADS=spec.num_heads,
            BLOCK_H=heads,
            LATENT=spec.kv_lora_rank,
            ROPE=spec.rope_dim,
            BLOCK_L=triton.next_power_of_2(spec.kv_lora_rank),
            BLOCK_R=max(16, triton.next_power_of_2(spec.rope_dim)),
            TOPK=spec.sparse_topk,
            WINDOW=spec.sparse_window or 0,
            BLOCK_N=block_n,
            PAGE_SIZE=spec.block_size,
            KV_FP8=k_scale is not None,
            DS_MLA=spec.kv_scale_block is not None,
            SCALE_BLOCK=spec.kv_scale_block or 1,
            UPCAST_DOT=self.upcast_dot,
            RETURN_LSE=lse is not None,
            ONE_SPLIT=splits == 1,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits > 1:
            sparse_mla_kernels.sparse_merge_kernel[(tokens, triton.cdiv(spec.num_heads, MERGE_HEADS))](
                self.partial_out,
                self.partial_lse,
                metadata.num_tokens,
                out,
                splits,
                out.stride(0),
                out.stride(1),
                NUM_HEADS=spec.num_heads,
                BLOCK_H=MERGE_HEADS,
                LATENT=spec.kv_lora_rank,
                BLOCK_L=triton.next_power_of_2(spec.kv_lora_rank),
            )
