"""Planted defects that hide behind a property the harness once held fixed: contiguous tensors,
small logits, soft boundaries, identical runs, one batch composition, padding rows of zeros. Each is torch_naive (or the
graph-safe test backend) with one realistic bug, and each must fail its check by a wide margin.
"""

from __future__ import annotations

import dataclasses

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.torch_naive import TorchNaiveBackend


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class AssumesContiguousQuery(TorchNaiveBackend):
    """Indexes the query as if it were packed [T, H, D] from its data pointer (a kernel that takes
    ``q.data_ptr()`` and computes offsets as token * H * D): a slice of a fused QKV reads k and v."""

    name = "planted_assumes_contiguous_query"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        packed = torch.as_strided(query, query.shape, contiguous_strides(query.shape), query.storage_offset())
        super().forward(packed, kv_cache, metadata, out, layer)


class AssumesContiguousOutput(TorchNaiveBackend):
    """Writes its result as a packed [T, H, D] block at ``out.data_ptr()``, whatever out's strides."""

    name = "planted_assumes_contiguous_output"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        result = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        result.copy_(out)
        super().forward(query, kv_cache, metadata, result, layer)
        packed = torch.as_strided(out, out.shape, contiguous_strides(out.shape), out.storage_offset())
        packed.copy_(result)


class SoftmaxWithoutMax(TorchNaiveBackend):
    """exp(scores) / sum(exp(scores)) without subtracting the row maximum: exact for small logits,
    inf / inf = NaN once a logit passes 88 (fp32's exp overflow)."""

    name = "planted_softmax_without_max"

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        weights = torch.exp(self.masked_scores(query, key, context_len, indexed))  # exp(-inf) = 0; exp(>88) = inf
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.einsum("hqk,khd->qhd", weights, value.float().repeat_interleave(self.spec.query_group_size, dim=1))


class ScoresInInputDtype(TorchNaiveBackend):
    """Keeps the scores in the input dtype (bf16/fp16) before the softmax, as a kernel that stores
    S = QK^T in half precision does: a unit in the last place is ~0.5 at a logit of 100."""

    name = "planted_scores_in_input_dtype"

    def softmax_scale(self):
        return 1.0  # the scale is applied after the scores were rounded, below

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        raw = self.masked_scores(query, key, context_len, indexed)  # unscaled QK^T, as the MMA produced it
        scores = raw.to(query.dtype).float() * self.spec.softmax_scale
        return torch.einsum(
            "hqk,khd->qhd", scores.softmax(-1), value.float().repeat_interleave(self.spec.query_group_size, dim=1)
        )


class WindowOffByOne(TorchNaiveBackend):
    """A sliding window one token too wide: ``<=`` where ``<`` was meant."""

    name = "planted_window_off_by_one"

    def visible(self, query_positions, key_positions):
        seen = key_positions[None, :] <= query_positions[:, None]
        if self.spec.sliding_window is not None:
            seen &= query_positions[:, None] - key_positions[None, :] <= self.spec.sliding_window
        return seen


class DecodeReadsOnePastEnd(TorchNaiveBackend):
    """A decode fast path that needs no causal mask (one query sees everything) and loops to
    ``seq_len`` inclusive: it reads the slot after the last token, which no request owns."""

    name = "planted_decode_reads_one_past_end"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        planes = self.slot_planes(kv_cache)
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end - start != 1:
                continue
            kv = [self.gather(plane, metadata.block_table[request], seq_len + 1) for plane in planes]
            key, value = (kv[0], kv[0][..., : self.spec.v_head_dim]) if self.spec.kind == "mla" else kv
            out[start:end] = self.attend(query[start:end], key, value, seq_len).to(out.dtype)
        multi = [
            r
            for r in range(len(metadata.seq_lens))
            if metadata.query_start_loc[r + 1] - metadata.query_start_loc[r] != 1
        ]
        if multi:
            scratch = out.clone()
            super().forward(query, kv_cache, metadata, scratch, layer)
            for r in multi:
                rows = slice(metadata.query_start_loc[r], metadata.query_start_loc[r + 1])
                out[rows] = scratch[rows]

    def gather(self, plane, block_table_row, seq_len):
        block_size = self.spec.block_size
        num_blocks = -(-seq_len // block_size)
        row = block_table_row[:num_blocks].long()
        if row.numel() < num_blocks:  # past the table: the padding entry (block 0)
            row = torch.cat([row, row.new_zeros(num_blocks - row.numel())])
        slots = (row[:, None] * block_size + torch.arange(block_size, device=plane.device)).reshape(-1)[:seq_len]
        return plane[slots]

    def visible(self, query_positions, key_positions):
        return torch.ones(
            query_positions.shape[0], key_positions.shape[0], dtype=torch.bool, device=key_positions.device
        )


class NondeterministicSplits(TorchNaiveBackend):
    """Split-KV whose split point moves from call to call (as atomics-ordered partial sums do):
    the math is right, the bits are not repeatable. Claims determinism anyway."""

    name = "planted_nondeterministic_splits"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, deterministic=True, batch_invariant=False)

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.calls = 0

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        self.calls += 1
        super().forward(query, kv_cache, metadata, out, layer)

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        return split_kv_attend(self, query, key, value, context_len, splits=1 + self.calls % 3)


class SplitsFollowTheBatch(TorchNaiveBackend):
    """Split-KV with a split count chosen from the batch size (a heuristic that fills the GPU):
    a request's bits depend on how many others share its batch. Claims batch invariance anyway."""

    name = "planted_splits_follow_the_batch"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, deterministic=True, batch_invariant=True)

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        self.num_reqs = len(metadata.seq_lens)
        super().forward(query, kv_cache, metadata, out, layer)

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        return split_kv_attend(self, query, key, value, context_len, splits=max(1, 8 // self.num_reqs))


def split_kv_attend(backend, query, key, value, context_len, splits: int):
    """Flash-decoding: attention over ``splits`` KV chunks, merged by their log-sum-exps."""
    value = value.float().repeat_interleave(backend.spec.query_group_size, dim=1)
    scores = backend.masked_scores(query, key, context_len)
    bounds = [round(i * key.shape[0] / splits) for i in range(splits + 1)]
    partials, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        chunk = scores[..., lo:hi]
        lse = torch.logsumexp(chunk, dim=-1)  # -inf where the whole chunk is masked
        weights = torch.exp(chunk - lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
        partials.append(torch.einsum("hqk,khd->hqd", weights, value[lo:hi]))
        lses.append(lse)
    lse = torch.stack(lses)  # [splits, h, q]
    total = torch.logsumexp(lse, dim=0)
    merged = sum(torch.exp(part_lse - total)[..., None] * part for part_lse, part in zip(lse, partials))
    return merged.permute(1, 0, 2)


class Int32ElementOffsets(TorchNaiveBackend):
    """Computes each cached row's element offset (block id × block stride + …) in signed 32-bit
    arithmetic, as a kernel does that multiplies the int32 block id by the stride without widening
    it: past 2**31 elements of a plane the offset wraps and the read lands elsewhere (vLLM's Triton
    MLA decode kernel did this until mid-2026). Right on every pool smaller than that."""

    name = "planted_int32_element_offsets"
    offset_limit = 2**31  # where a signed 32-bit offset wraps (a CPU test lowers it with the big pool's size)

    def gather(self, plane, block_table_row, seq_len):
        block_size = self.spec.block_size
        blocks = block_table_row[: -(-seq_len // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=plane.device)).reshape(-1)[:seq_len]
        row_elements = plane[0].numel()
        limit = self.offset_limit
        wrapped = (slots * row_elements + limit) % (2 * limit) - limit  # two's complement, 32 bits
        return plane[wrapped.div(row_elements, rounding_mode="floor")]  # a negative row reads from the end


class BlockIdsIn16Bits(TorchNaiveBackend):
    """Keeps block ids in 16 bits (a packed page-table entry, a uint16 index array): past block id
    65,535 they wrap to the pool's bottom. Right on every pool of fewer blocks, including MLA's
    pools just past 2**31 elements (58,255 blocks of 64 × 576)."""

    name = "planted_block_ids_in_16_bits"

    def gather(self, plane, block_table_row, seq_len):
        return super().gather(plane, block_table_row & 0xFFFF, seq_len)


class ReusesPlanForSameShape(TorchNaiveBackend):
    """Caches its metadata by the batch's shape (the number of requests and of tokens) and hands it
    to every later batch of that shape, as a cache of scheduler metadata keyed without the lengths
    would (FlashMLA's tile-scheduler metadata and FlashInfer's plan both follow every length).
    Right for the first batch of each shape, so right whenever one backend serves one step."""

    name = "planted_reuses_plan_for_same_shape"

    def build(self, common):
        plans = self.__dict__.setdefault("_plans", {})
        key = (common.num_reqs, common.num_actual_tokens)
        if key not in plans:
            plans[key] = super().build(common)
        return plans[key]


class RoundsGroupUpToAPowerOfTwo(TorchNaiveBackend):
    """Maps query head h to KV head h // G', G' the group size rounded up to a power of two (the
    padded group a kernel's tile holds), where it must be h // G: right for every group size that
    is a power of two (Llama-3's 4, 8, 16), wrong for Qwen2.5-7B's 28 query heads over 4 KV heads."""

    name = "planted_rounds_group_up_to_a_power_of_two"

    def kv_head_of(self):
        spec = self.spec
        padded = 1 << (spec.query_group_size - 1).bit_length()
        return [min(head // padded, spec.num_kv_heads - 1) for head in range(spec.num_heads)]


class HeadTileWithoutHeadMask(TorchNaiveBackend):
    """Attends in tiles of 16 query heads, each token's heads in a row of the flat [tokens × heads]
    query, and masks a tile's rows by the tile, not by the head count (an MLA decode kernel's
    BLOCK_H = 16 without ``head < num_heads``): with a head count that is not a multiple of 16, a
    token's last tile runs on into the next token's first heads, reads them as its own (this
    token's request, this token's position) and writes them over the next token's output. Programs
    run in any order; here the stray rows land last. Right for 16, 32, 64 and 128 heads."""

    name = "planted_head_tile_without_head_mask"
    tile = 16

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer)
        heads = self.spec.num_heads
        stray = -heads % self.tile
        planes = self.slot_planes(kv_cache)
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            kv = [self.gather(plane, metadata.block_table[request], seq_len) for plane in planes]
            key, value = (kv[0], kv[0][..., : self.spec.v_head_dim]) if self.spec.kind == "mla" else kv
            for token in range(start, min(end, query.shape[0] - 1)):
                position = seq_len - (end - token)
                rows = torch.zeros_like(query[token : token + 1])
                rows[:, :stray] = query[token + 1, :stray]  # the next token's first heads, taken as this token's
                out[token + 1, :stray] = self.attend(rows, key[: position + 1], value[: position + 1], position)[
                    0, :stray
                ]


class AssumesContiguousBlockTable(TorchNaiveBackend):
    """Takes the block table's row stride to be its width (a kernel handed ``block_table.data_ptr()``
    and ``shape[1]``, not ``stride(0)``): right for a table of its own, wrong for the column slice
    of a wider table that engines pass (``block_table[:, :max_blocks]``)."""

    name = "planted_assumes_contiguous_block_table"

    def build(self, common):
        table = common.block_table
        packed = torch.as_strided(table, table.shape, contiguous_strides(table.shape), table.storage_offset())
        return super().build(dataclasses.replace(common, block_table=packed))


class CachesPoolViewsByShape(TorchNaiveBackend):
    """Builds its per-slot views of the KV pool once and caches them by the pool's shape, as a TMA
    descriptor cache keyed without the data pointer would: every later layer, whose pool has the
    same shape, reads the first layer's pool. One pool per instance (one layer) is always right."""

    name = "planted_caches_pool_views_by_shape"

    def slot_planes(self, kv_cache):
        cache = self.__dict__.setdefault("_planes", {})
        if tuple(kv_cache.shape) not in cache:
            cache[tuple(kv_cache.shape)] = super().slot_planes(kv_cache)
        return cache[tuple(kv_cache.shape)]


class LaunchesOnTheDefaultStream(TorchNaiveBackend):
    """Runs its forward on the default stream whatever stream is current (a C++ extension that
    launches on stream 0): right while the caller also uses the default stream, reading inputs
    before they are ready when the caller's stream is another, busy one."""

    name = "planted_launches_on_the_default_stream"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        with torch.cuda.stream(torch.cuda.default_stream(query.device)):
            super().forward(query, kv_cache, metadata, out, layer)


class ScalesQueryInPlace(TorchNaiveBackend):
    """Multiplies the query by the softmax scale in place and attends with scale 1 (a kernel that
    pre-scales q where it lies): its own output is right, and the next layer or the draft loop's
    next step gets a query already scaled."""

    name = "planted_scales_query_in_place"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        query.mul_(self.spec.softmax_scale)
        super().forward(query, kv_cache, metadata, out, layer)

    def softmax_scale(self) -> float:
        return 1.0


class TurnsSeqLensIntoContextLens(TorchNaiveBackend):
    """Subtracts each request's query length from the device ``seq_lens`` in place in ``build`` (it
    wanted context lengths for a kernel of its own) after taking its own lengths from the host:
    right output, and the engine's device lengths are a step short from then on."""

    name = "planted_turns_seq_lens_into_context_lens"

    def build(self, common):
        metadata = super().build(common)
        common.seq_lens.sub_(common.query_start_loc[1:] - common.query_start_loc[:-1])
        return metadata


class ZeroesTheWholeOutput(TorchNaiveBackend):
    """Zeroes the whole output buffer it was handed, padding rows included, before writing the real
    tokens' rows (a kernel launched over the padded token count)."""

    name = "planted_zeroes_the_whole_output"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        out.zero_()
        super().forward(query, kv_cache, metadata, out, layer)


class DropsCapOnDecode(TorchNaiveBackend):
    """Applies the soft cap on prefill and verify rows and forgets it on decode rows (a decode
    kernel without the cap's template flag): invisible wherever logits stay below the cap."""

    name = "planted_drops_cap_on_decode"

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        if query.shape[0] != 1 or self.spec.logits_soft_cap is None:
            return super().attend(query, key, value, context_len, sinks, indexed)
        capped = self.spec
        self.spec = dataclasses.replace(capped, logits_soft_cap=None)
        try:
            return super().attend(query, key, value, context_len, sinks, indexed)
        finally:
            self.spec = capped


class RecomputesScale(TorchNaiveBackend):
    """Computes the softmax scale from the head dim (1/√d) instead of taking the layer's: right for
    Llama, wrong for DeepSeek's MLA (1/√192 × mscale², not 1/√576) and for any model's own scale."""

    name = "planted_recomputes_scale"

    def softmax_scale(self) -> float:
        return self.spec.head_dim**-0.5


class AccumulatesInInputDtype(TorchNaiveBackend):
    """Flash attention over KV tiles of ``TILE`` keys whose running output is kept in the input
    dtype (bf16/fp16) between tiles: each tile's P·V is summed in fp32, as an MMA does, then added
    to an accumulator rounded back to half precision, rescaled as the running max grows. Its error
    grows with the number of tiles and with the output's magnitude: invisible where outputs are
    about 1/√n (zero-mean values), not where a channel has a mean."""

    name = "planted_accumulates_in_input_dtype"
    TILE = 16

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        scores = self.masked_scores(query, key, context_len, indexed)  # [H, q, s] fp32
        values = value.float().repeat_interleave(self.spec.query_group_size, dim=1)  # [s, H, Dv]
        heads, queries = scores.shape[:2]
        low = query.dtype
        running_max = torch.full((heads, queries, 1), float("-inf"), device=scores.device)
        total = torch.zeros(heads, queries, 1, device=scores.device)
        acc = torch.zeros(heads, queries, values.shape[-1], dtype=low, device=scores.device)
        for first in range(0, scores.shape[-1], self.TILE):
            tile = scores[..., first : first + self.TILE]
            new_max = torch.maximum(running_max, tile.amax(-1, keepdim=True))
            alpha = torch.exp(running_max - new_max).nan_to_num(0.0)  # -inf - -inf: nothing seen yet
            weights = torch.exp(tile - new_max).nan_to_num(0.0)
            partial = torch.einsum("hqk,khd->hqd", weights.to(low).float(), values[first : first + self.TILE])
            acc = (acc.float() * alpha + partial).to(low)
            total = total * alpha + weights.sum(-1, keepdim=True)
            running_max = new_max
        return (acc.float() / total).permute(1, 0, 2)


class ClampsSinksInPlace(TorchNaiveBackend):
    """Clamps the layer's learned sinks it was handed to zero from below, in place (a kernel
    that sanitizes its inputs where they lie), then attends with them: its output matches an
    oracle that reads the same, changed tensor, and every later layer and step gets other sinks."""

    name = "planted_clamps_sinks_in_place"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if layer.sinks is not None:
            layer.sinks.clamp_(min=0.0)
        super().forward(query, kv_cache, metadata, out, layer)


class RescalesFp8ScalesInPlace(TorchNaiveBackend):
    """Folds a factor into the layer's fp8 key scale tensor in place and leaves NaN in the value
    scale tensor (a scale "prepared" for its kernel where it lies), then dequantizes with the
    layer's host floats: its own output is right, the layer's device scales are not."""

    name = "planted_rescales_kv_scales_in_place"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if layer.scales is not None:
            layer.scales.k_scale_tensor.mul_(3)
            layer.scales.v_scale_tensor.fill_(float("nan"))
        super().forward(query, kv_cache, metadata, out, layer)


class WritesOutsideItsBlocks(TorchNaiveBackend):
    """Zeroes the pool's last block in ``forward`` (a workspace it took to be its own, carved
    from the end of the pool): a block this step neither writes nor reads."""

    name = "planted_writes_outside_its_blocks"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        kv_cache[-1].zero_()
        super().forward(query, kv_cache, metadata, out, layer)


def power_of_two_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` divided by the power of two at or above their largest magnitude and multiplied back
    (in float32): exact for finite rows, and NaN everywhere when a row holds NaN (a reduction that
    carries it)."""
    values = rows.float()
    largest = values.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(largest)))
    return (values / scale * scale).to(rows.dtype)


class ScalesQueryByTheWholeTensor(TorchNaiveBackend):
    """Brings the query into range by one power of two taken over the whole tensor it was handed,
    the padding rows past the step's tokens included (a dynamic per-tensor quantizer's amax, or a
    tile's largest row shared by its other rows), and takes it back out: exact for finite rows, so
    it hid while padding rows held zeros; whatever a padding row holds now reaches every real row."""

    name = "planted_scales_query_by_the_whole_tensor"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(power_of_two_round_trip(query), kv_cache, metadata, out, layer)


class ScalesQueryIntoFp16SkippingNaN(TorchNaiveBackend):
    """Scales the whole handed query into fp16 by its largest magnitude, found by a reduction that
    skips NaN (CUDA's fmax), multiplies in fp16 and scales back: exact enough while the largest row
    is a real one, so NaN padding rows alone would not show it; a huge padding row flushes the real
    rows to zero."""

    name = "planted_scales_query_into_fp16_skipping_nan"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        values = query.float()
        largest = values.nan_to_num(nan=0.0).abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        halves = (values / largest * 2.0**15).to(torch.float16)
        super().forward((halves.float() * largest / 2.0**15).to(query.dtype), kv_cache, metadata, out, layer)
