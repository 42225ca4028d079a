"""``triton_mla``: absorbed MLA decode and spec-verify (query length up to 8) over the latent
paged cache, split-KV with a merge kernel; graph-safe, needing no host lengths (as ``triton``).

A sparse layer (DeepSeek's DSA) reads by index rows with a kernel of its own (``sparse_mla``),
over the latent cache or DeepSeek's fp8_ds_mla: vLLM's 656-byte entries, packed by
``backends.fp8_ds_mla`` on the device (torch_naive's packer, so the bytes are its bytes) and
dequantized block by block in the sparse kernel. The dense split-KV kernel reads a latent of one
dtype, so fp8_ds_mla is claimed for sparse layers only (``feature_only_with``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CGSupport,
    LayerParameters,
    OnlyWith,
)
from backends.features import (
    EMPTY_REQUESTS,
    FP8_DS_MLA,
    FP8_E4M3,
    FP8_E5M2,
    FP8_QUERY,
    SPARSE_TOPK,
    SPARSE_WINDOW,
    TOKEN_TREES,
)
from backends.fp8 import to_cache
from backends.fp8_ds_mla import DsMlaLayout
from backends.triton import GATHER, GLUON, INSTALL_HINT, PAGE, TMA
from backends.triton.backend import (
    DECODE_VARIANTS,
    FP8_GPUS,
    LOG2E,
    DeviceLengthsBackend,
    TritonMetadata,
    interpreter_devices,
    interpreting,
)
from backends.triton.sparse_mla import SparseMLARead

try:
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from backends.triton import kernels, mla_kernels
except ModuleNotFoundError as missing:  # an extra: the claims import, availability names the install
    if missing.name != "triton":
        raise
try:
    from backends.triton import mla_gluon
except ImportError:  # a Triton without Gluon's Hopper API (older, or none): the Triton kernel serves
    mla_gluon = None

ROWS_PER_PROGRAM = 64  # tokens x heads per tile; 64 x 512 fp32 accumulator (swept on an H200: best of 16/32/64)
BLOCK_N = 64  # KV positions per tile
NUM_WARPS = 8

# Per way of reading a tile: pipeline stages, and programs wanted per SM when picking the split
# count. Swept on an H100 (python -m conformance.tuning.tune_triton_mla).
NUM_STAGES = {GATHER: 3, PAGE: 2, TMA: 2}
PROGRAMS_PER_MULTIPROCESSOR = {GATHER: 2, PAGE: 2, TMA: 1, GLUON: 1}
# Tiles of fewer rows read faster with masked loads than by TMA (16 heads decode: 130 against
# 152 µs, H100), so TMA serves only the full 64-row tiles.
TMA_MIN_ROWS = 64


@dataclass
class _Tiling:
    heads_per_program: int
    block_m: int


def tiling(num_heads: int, decode_q: int) -> _Tiling:
    heads = max(1, min(triton.next_power_of_2(num_heads), ROWS_PER_PROGRAM // decode_q))
    return _Tiling(heads, max(16, triton.next_power_of_2(heads * decode_q)))


def has_wgmma(device: torch.device) -> bool:
    """Hopper itself (SM90): the Gluon kernel's warpgroup MMA exists nowhere else."""
    return mla_gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def has_tma(device: torch.device) -> bool:
    """A Hopper-class GPU, or the interpreter (which runs descriptor loads as plain loads)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def tma_reads(spec: AttentionSpec, kv_cache: torch.Tensor) -> bool:
    """Whether the cache's tiles can be copied by TMA: a tile inside one page, latent and rope
    widths equal to the kernel's (powers of two, at least 16), so that no copy reaches into the
    next entry, and rows at 16-byte multiples. An fp8 cache's tiles are read with masked loads:
    the TMA path was measured and tuned on bf16 tiles only."""
    widths = (spec.kv_lora_rank, spec.rope_dim)
    row_bytes = kv_cache.stride(1) * kv_cache.element_size()
    return (
        spec.block_size % BLOCK_N == 0
        and kv_cache.is_contiguous()
        and row_bytes % 16 == 0
        and not spec.fp8_kv_cache
        and kv_cache.data_ptr() % 16 == 0
        and all(w >= 16 and w == triton.next_power_of_2(w) for w in widths)
    )


def tile_read(spec: AttentionSpec, block_m: int, kv_cache: torch.Tensor, tma: bool, wgmma: bool = False) -> int:
    """How a KV tile is read: GATHER, PAGE or TMA by the Triton kernel (``mla_kernels`` says what
    each is), or GLUON, the Gluon kernel's TMA ring (``mla_gluon``); ``tma`` and ``wgmma``: the
    device has them (``has_tma``, ``has_wgmma``)."""
    if spec.block_size % BLOCK_N:
        return GATHER
    if not (tma and block_m >= TMA_MIN_ROWS and tma_reads(spec, kv_cache)):
        return PAGE
    gluon = wgmma and block_m == mla_gluon.ROWS and spec.block_size % mla_gluon.BLOCK_N == 0
    return GLUON if gluon and mla_gluon.serves(spec.kv_lora_rank, spec.rope_dim) else TMA


# Why a dense layer over fp8_ds_mla SKIPs (the SKIP quotes it).
DS_MLA_DENSE = (
    "triton_mla reads fp8_ds_mla's packed entries in its sparse kernel only; its dense split-KV kernel "
    "reads a latent of one dtype"
)


class TritonMLABackend(DeviceLengthsBackend):
    name = "triton_mla"
    capabilities = Capabilities(
        kinds=frozenset({"mla"}),
        block_sizes=frozenset({16, 32, 64}),
        max_query_len=DECODE_VARIANTS[-1],
        features=frozenset({FP8_E4M3, FP8_E5M2, EMPTY_REQUESTS, SPARSE_TOPK, SPARSE_WINDOW, FP8_DS_MLA}),
        feature_gpus={**FP8_GPUS, FP8_DS_MLA: FP8_GPUS[FP8_E4M3]},
        feature_only_with={FP8_DS_MLA: OnlyWith(frozenset({SPARSE_TOPK}), DS_MLA_DENSE)},
        not_claimed={
            FP8_QUERY: "triton_mla's kernels load the query in the compute dtype: an fp8 query (its scale folded "
            "into the scores', as triton's MHA kernels do) is not built yet",
            TOKEN_TREES: "triton_mla's kernels (the split decode and the Gluon verify) mask a verify request's "
            "tokens causally and read no tree: not built yet (triton's MHA kernels do)",
        },
        # Uniform batches: the dense kernel's tiling follows the batch's query length (its decode
        # variant), so a graph serves the query length it was captured for; an H200 run showed a
        # graph captured over empty requests (variant 1) replaying a verify batch with no output.
        cuda_graphs=CGSupport.UNIFORM_BATCH,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=interpreter_devices(),
        required_modules=("triton",),
        install_hint=INSTALL_HINT,
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        self.upcast_dot = interpreting() and spec.dtype == torch.bfloat16
        self.allocate_split_buffers(spec.kv_lora_rank)
        self.tma = has_tma(self.device)  # asked once: forward runs every step
        self.wgmma = has_wgmma(self.device)
        self._descriptors: tuple[tuple, TensorDescriptor, TensorDescriptor] | None = None
        # A sparse layer (DeepSeek's DSA) reads by index rows with a kernel of its own.
        scratch = (self.partial_out, self.partial_lse, self.multiprocessors)
        self.sparse = (
            None if spec.sparse_topk is None else SparseMLARead(spec, limits, self.device, self.upcast_dot, scratch)
        )
        # DeepSeek's fp8_ds_mla: a token's entry packed as vLLM packs it (its own scales inside).
        self.packed = None if spec.kv_scale_block is None else DsMlaLayout(spec)
        if self.packed is not None and self.sparse is None:
            raise ValueError(f"fp8_ds_mla on a dense layer: {DS_MLA_DENSE}")

    def build(self, common):
        metadata = super().build(common)
        return metadata if self.sparse is None else self.sparse.build(metadata)

    def update_for_draft_step(self, metadata, common):
        if self.sparse is None:
            return super().update_for_draft_step(metadata, common)
        return self.sparse.update_for_draft_step(metadata, common)

    def descriptors(self, kv_cache: torch.Tensor, read: int) -> tuple:
        """TMA descriptors of the latent and rope columns of the cache's rows, made once per pool
        (Triton's for the TMA read, Gluon's for the Gluon kernel)."""
        key = (kv_cache.data_ptr(), kv_cache.shape, read, BLOCK_N, getattr(mla_gluon, "LATENT_CHUNK", 0))
        if self._descriptors is None or self._descriptors[0] != key:
            rank = self.spec.kv_lora_rank
            if read == GLUON:
                pair = mla_gluon.descriptors(kv_cache, rank)
            else:
                rows = kv_cache.view(-1, kv_cache.shape[-1])
                pair = (
                    TensorDescriptor.from_tensor(rows[:, :rank], [BLOCK_N, rank]),
                    TensorDescriptor.from_tensor(rows[:, rank:], [BLOCK_N, self.spec.rope_dim]),
                )
            self._descriptors = (key, *pair)
        return self._descriptors[1:]

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.packed is not None:  # fp8_ds_mla: a token's bytes
            return self.packed.cache_shape(num_blocks, self.spec.block_size)
        return (num_blocks, self.spec.block_size, self.spec.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        if self.packed is None:
            return super().allocate_kv_cache(num_blocks)
        return self.packed.allocate(num_blocks, self.spec.block_size, self.device)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        if self.packed is not None:
            self.packed.write(kv_cache, key, slot_mapping)  # fp8_ds_mla: torch_naive's packer
            return
        quantize = self.spec.fp8_kv_cache
        if quantize and interpreting():  # the interpreter flushes e4m3 subnormals (see TritonAttentionBackend)
            key, quantize = to_cache(key, self.device_scales(layer.scales)[0], kv_cache.dtype), False
        k_scale = self.device_scales(layer.scales)[0] if quantize else slot_mapping  # unread without QUANTIZE
        kernels.write_kv_kernel[(slot_mapping.shape[0],)](
            key,
            key,
            kv_cache,
            kv_cache,
            slot_mapping,
            key.stride(0),
            0,
            key.stride(0),
            0,
            kv_cache.stride(0),
            0,
            kv_cache.stride(1),
            k_scale,
            k_scale,
            1,
            self.spec.block_size,
            HEAD_DIM=self.spec.head_dim,
            BLOCK_HEADS=1,
            BLOCK_D=triton.next_power_of_2(self.spec.head_dim),
            HAS_VALUE=False,
            QUANTIZE=quantize,
            FP8_MAX=float(torch.finfo(kv_cache.dtype).max) if quantize else 448.0,
        )

    def read_kv(self, kv_cache, slot_mapping):
        if self.packed is not None:  # fp8_ds_mla: the entries dequantized, float32 (as torch_naive's)
            return self.packed.read(kv_cache, slot_mapping), None
        return kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping], None

    def forward(self, query, kv_cache, metadata: TritonMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        spec, limits = self.spec, self.limits
        if self.sparse is not None:
            per_tensor = spec.fp8_kv_cache and self.packed is None  # fp8_ds_mla's scales are its entries'
            k_scale = self.device_scales(layer.scales)[0] if per_tensor else None
            return self.sparse.forward(query, kv_cache, metadata, out, layer, k_scale)
        decode_q = metadata.decode_q
        tiles = tiling(spec.num_heads, decode_q)
        head_blocks = triton.cdiv(spec.num_heads, tiles.heads_per_program)
        read = tile_read(spec, tiles.block_m, kv_cache, self.tma, self.wgmma)
        num_splits = self.splits_for(metadata.num_reqs, decode_q, head_blocks, PROGRAMS_PER_MULTIPROCESSOR[read])
        grid = (head_blocks, limits.max_num_reqs, num_splits)
        # Both kernels take the same operands (where a read has no descriptors, the cache stands in).
        latent_desc, rope_desc = self.descriptors(kv_cache, read) if read in (TMA, GLUON) else (kv_cache, kv_cache)
        operands = (
            query,
            kv_cache,
            latent_desc,
            rope_desc,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.partial_out,
            self.partial_lse,
            out,
            metadata.num_reqs,
            num_splits,
            spec.softmax_scale * LOG2E,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            metadata.block_table.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
        )
        constants = dict(
            NUM_HEADS=spec.num_heads,
            HEADS_PER_PROGRAM=tiles.heads_per_program,
            DECODE_Q=decode_q,
            LATENT=spec.kv_lora_rank,
            ROPE=spec.rope_dim,
            PAGE_SIZE=spec.block_size,
            ONE_SPLIT=num_splits == 1,
        )
        if read == GLUON:
            mla_gluon.mla_gluon_kernel[grid](
                *operands,
                **constants,
                BLOCK_N=mla_gluon.BLOCK_N,
                NUM_STAGES=mla_gluon.NUM_STAGES,
                num_warps=mla_gluon.WARPS,
            )
        else:
            mla_kernels.mla_decode_split_kernel[grid](
                *operands,
                self.device_scales(layer.scales)[0] if spec.fp8_kv_cache else metadata.seq_lens,
                **constants,
                BLOCK_M=tiles.block_m,
                BLOCK_L=triton.next_power_of_2(spec.kv_lora_rank),
                BLOCK_R=max(16, triton.next_power_of_2(spec.rope_dim)),
                BLOCK_N=BLOCK_N,
                TILE_READ=read,
                UPCAST_DOT=self.upcast_dot,
                KV_FP8=spec.fp8_kv_cache,
                num_warps=NUM_WARPS if spec.kv_lora_rank >= 256 else 4,
                num_stages=NUM_STAGES[read],
            )
        self.merge_splits(out, metadata, num_splits, spec.kv_lora_rank)
