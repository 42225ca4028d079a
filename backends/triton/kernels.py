"""Triton kernels for paged attention over any batch, with no host lengths.

Every grid is sized from static limits (max requests, max tokens, split count); a program whose
request, query block or KV split does not exist in this batch returns at once. Requests are
served by one of two kernels, decided on the device from each request's query length:

* ``decode_split_kernel``: requests with at most DECODE_Q new tokens (decode, spec-verify). One
  program per (request, KV head, KV split): all the request's new tokens times the query heads
  of one KV group form the rows of one tile, so each KV block is read once per group. The host
  picks the split count per step from the number of requests (enough programs to fill the GPU,
  no more); with one split the program writes the output itself, otherwise the partial results
  (normalised output and log-sum-exp per split) are merged by ``merge_splits_kernel``
  (flash-decoding). The split count is a runtime argument, and one kernel serves every count.
* ``prefill_kernel``: requests with more than DECODE_Q new tokens. One program per (query block,
  KV head); the query block → request map is a binary search over ``query_start_loc``, so the
  grid never depends on the batch.

Softmax runs in fp32 with exp2; products are fp16/bf16 with fp32 accumulation.

fp8 cache (``KV_FP8``): keys and values are loaded as fp8 and widened to fp16 (exact: every e4m3
and e5m2 number is an fp16 number; one instruction a pair, where bf16 takes five), the query scaled
by a power of two into fp16 (``fp16_scaling``); ``k_scale`` is folded into the score scale and
``v_scale`` into the output, both read from their 1-element device tensors, so nothing is read on
the host.

Every row sees every key before the request's first new token, so those whole tiles run unmasked
(no window): only the tiles that hold new tokens' keys (causal, tree) or a window's edge compare
positions.
``write_kv_kernel`` quantizes (``QUANTIZE``): value / scale, saturated, converted with round to
nearest even.

Integer arguments that change from batch to batch (request count, split count, window, block
table width) are ``do_not_specialize``: Triton would otherwise compile a kernel apart for each of
their classes (1, multiples of 16, the rest), which multiplied a suite's compiles. A single split
keeps a kernel of its own, as Triton's ``num_splits == 1`` specialization gave it (its range and
store fold away at compile time), through the explicit ``ONE_SPLIT`` constexpr: a split kernel has
two variants. For the same reason the small kernels take as plain integers what shapes only their
index arithmetic: the merge's head count and tokens per request, the cache write's KV head count
and page size (as constexprs they made 48 and 42 of the 243 kernels a whole default GPU run
compiled, each compile about half a second of CPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

BATCH_VARYING = ("num_reqs", "num_splits", "window", "stride_block_table")


def batch_kernel(fn):
    """``triton.jit`` that leaves the batch-varying integer arguments fn has unspecialized."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[name for name in BATCH_VARYING if name in names])


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _soft_cap(scores, cap):
    # cap * tanh(scores / cap), with tanh written through the sigmoid so the interpreter runs it too.
    return cap * (2.0 * tl.sigmoid(2.0 * scores / cap) - 1.0)


@triton.jit
def _quantized(rows, scale_ptr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr):
    """``rows / scale`` saturated to the fp8 format's largest number (the store converts, rounding
    to nearest even); ``rows`` as they are without QUANTIZE."""
    if QUANTIZE:  # one return: a compiled kernel's returns must agree in type
        # NaN kept NaN (as torch's conversion does): without propagate_nan, max/min map it to -FP8_MAX.
        scaled = rows.to(tl.float32) / tl.load(scale_ptr)
        rows = tl.minimum(
            tl.maximum(scaled, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL
        )
    return rows


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    page_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_VALUE: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # graph padding: write nothing
        return
    block = slot // page_size
    offset = slot % page_size
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    destination = block * stride_cache_block + heads * stride_cache_head + offset * stride_cache_token + dims
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    key = _quantized(key, k_scale_ptr, QUANTIZE, FP8_MAX)
    tl.store(k_cache_ptr + destination, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_VALUE:
        value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
        value = _quantized(value, v_scale_ptr, QUANTIZE, FP8_MAX)
        tl.store(v_cache_ptr + destination, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def decode_query(query_start_loc_ptr, request, num_reqs, DECODE_Q):
    """A decode or spec-verify request's new tokens: (first token, how many).

    How many is 0 for a program with nothing to serve: one past the batch (grids are sized from
    static limits), or a request with more than DECODE_Q new tokens (``prefill_kernel`` serves it).
    """
    live = request < num_reqs
    query_start = tl.load(query_start_loc_ptr + request, mask=live, other=0)
    query_len = tl.load(query_start_loc_ptr + request + 1, mask=live, other=0) - query_start
    return query_start, tl.where(query_len > DECODE_Q, 0, query_len)


@triton.jit
def decode_rows(
    query_len, first_head, HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, DECODE_Q: tl.constexpr, BLOCK_M: tl.constexpr
):
    """The rows of one decode tile: every new token of the request times HEADS query heads from
    ``first_head`` — (token, head, valid) per row, padding rows invalid."""
    rows = tl.arange(0, BLOCK_M)
    token = rows // HEADS
    head = first_head + rows % HEADS
    return token, head, (token < query_len) & (rows < DECODE_Q * HEADS) & (head < NUM_HEADS)


@triton.jit
def decode_tile(
    query_start_loc_ptr,
    seq_lens_ptr,
    request,
    num_reqs,
    first_head,
    HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    DECODE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Everything a split-KV decode program knows before it reads the cache: the request's first
    new token, how many (0: nothing to serve), its length, and the tile's rows with their positions."""
    query_start, query_len = decode_query(query_start_loc_ptr, request, num_reqs, DECODE_Q)
    seq_len = tl.load(seq_lens_ptr + request, mask=query_len > 0, other=0)
    token, head, row_valid = decode_rows(query_len, first_head, HEADS, NUM_HEADS, DECODE_Q, BLOCK_M)
    return query_start, query_len, seq_len, token, head, row_valid, seq_len - query_len + token


@triton.jit
def split_range(low, seq_len, split, num_splits, BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr):
    """The key positions [start, end) of one split: [low, seq_len) cut into num_splits whole tiles."""
    if ONE_SPLIT:
        return low, seq_len
    per_split = tl.cdiv(tl.cdiv(seq_len - low, num_splits), BLOCK_N) * BLOCK_N
    start = low + split * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def online_softmax_step(scores, value, acc, row_max, row_sum, PRODUCT_SCALE: tl.constexpr):
    """Fold one KV tile (base-2 scores, -inf where not visible; its value rows) into the running
    output ``acc``, row maximum and row sum. The probabilities enter the product times
    PRODUCT_SCALE, which ``acc`` then carries (1.0, or ``FP16_PRODUCT_SCALE``)."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing visible yet
    probabilities = tl.exp2(scores - safe_max[:, None])
    rescale = tl.exp2(row_max - safe_max)
    row_sum = row_sum * rescale + tl.sum(probabilities, axis=1)
    if PRODUCT_SCALE != 1.0:
        probabilities = probabilities * PRODUCT_SCALE
    acc = acc * rescale[:, None] + tl.dot(probabilities.to(value.dtype), value)
    return acc, new_max, row_sum


@triton.jit
def fold_sink(acc, row_max, row_sum, sinks_ptr, head, row_valid):
    """Fold each row's learned sink (a natural-log logit per query head, at ``sinks_ptr[head]``)
    into its softmax: one more term of the row sum and none of the output, as a key with value 0."""
    sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * LOG2E
    new_max = tl.maximum(row_max, sink)
    rescale = tl.exp2(row_max - new_max)
    return acc * rescale[:, None], new_max, row_sum * rescale + tl.exp2(sink - new_max)


@triton.jit
def store_lse(row_max, row_sum, lse_ptr, lse_stride, token_index, head, row_valid):
    """Each row's log-sum-exp, natural log (the softmax runs in base 2: row_max is in base-2 units)."""
    tl.store(lse_ptr + token_index * lse_stride + head, (row_max + tl.log2(row_sum)) * LN2, mask=row_valid)


@triton.jit
def store_output(
    acc, row_sum, out_ptr, token_index, head, dims, row_valid, stride_out_token, stride_out_head, WIDTH: tl.constexpr
):
    """The normalised output rows of a tile that saw every key of its rows, in the output dtype."""
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + token_index[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (dims[None, :] < WIDTH),
    )


@triton.jit
def store_split_result(
    acc,
    row_max,
    row_sum,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    query_start,
    token,
    head,
    request,
    split,
    num_splits,
    dims,
    row_valid,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    DECODE_Q: tl.constexpr,
    WIDTH: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):
    """A split-KV program's result. With one split it is the whole answer and goes straight to
    ``out`` (no merge is launched). Otherwise: the split's normalised output and base-2
    log-sum-exp per row, for ``merge_splits_kernel``; a row that saw no key (an empty split) gets
    -inf and so no weight."""
    if ONE_SPLIT:
        store_output(
            acc, row_sum, out_ptr, query_start + token, head, dims, row_valid, stride_out_token, stride_out_head, WIDTH
        )
    else:
        partial_row = (request * DECODE_Q + token) * NUM_HEADS + head  # [rows, heads] flattened
        seen = row_sum > 0
        out = acc / tl.where(seen, row_sum, 1.0)[:, None]
        lse = tl.where(seen, row_max + tl.log2(tl.where(seen, row_sum, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_row * num_splits + split, lse, mask=row_valid)
        tl.store(
            partial_out_ptr + (partial_row * num_splits + split)[:, None] * WIDTH + dims[None, :],
            out,
            mask=row_valid[:, None] & (dims[None, :] < WIDTH),
        )


# The probabilities (at most 1) enter an fp16 product times 2^15: fp16 would flush those under
# 2^-24 to zero, keeping their weight in the row sum but not their values in the output (a sink
# head over 128k keys: an error of 1.5e-3 where bf16's was 1e-9); times 2^15 only those under 2^-39.
FP16_PRODUCT_SCALE = tl.constexpr(32768.0)


@triton.jit
def largest_magnitude(x):
    """Each row's max |x| of a 2-D tile, in fp32."""
    return tl.max(tl.abs(x.to(tl.float32)), axis=1)


@triton.jit
def fp16_scaling(top):
    """(2^e, 2^-e) for each row: the power of two that brings a query row whose largest magnitude
    is ``top`` into fp16's range, and its inverse, each built exactly from its bits.

    For an fp8 cache the products run in fp16: e4m3 and e5m2 widen to fp16 in one instruction a
    pair, where bf16 takes five (through fp16 and fp32), which made the fp8 kernels issue-bound. A
    bf16 query row can exceed fp16's range, so it is scaled first, its largest magnitude into
    [2^11, 2^14) (log2's rounding at a power of two is the slack): every element down to 2^-25 of
    the row's largest keeps all of its bits, a smaller one is off by at most 2^-36 of it. Rows whose
    largest is under 2^-114 are scaled by 2^126 only (fp32's limit), and keep fewer bits below it.
    Each row's inverse goes into its score scale, so its scores are those of its unrounded query;
    a row of inf or NaN scales only itself."""
    exponent = tl.where(top > 0, 12.0 - tl.floor(tl.log2(tl.where(top > 0, top, 1.0))), 0.0)
    exponent = tl.minimum(tl.maximum(exponent, -126.0), 126.0).to(tl.int32)
    up = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def _attend_tile(
    q,
    acc,
    row_max,
    row_sum,
    tile_start,
    request,
    kv_head,
    end,
    query_positions,
    row_valid,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    stride_block_table,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    scale_log2,
    soft_cap,
    window,
    context_len,
    query_start,
    query_ancestors,
    tree_depths_ptr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TREE: tl.constexpr,
    MASKED: tl.constexpr,
    PRODUCT_SCALE: tl.constexpr,
):
    """Fold the KV tile at ``tile_start`` into (acc, row_max, row_sum). MASKED: the tile may hold
    keys past ``end`` or keys some row must not see (causal, window, tree). Unmasked tiles are
    whole context tiles every row sees, and skip every comparison and select."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    in_range = positions < end
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)  # the value head dim may differ (DeepSeek-V3's prefill: 192 / 128)
    if MASKED:
        blocks = tl.load(
            block_table_ptr + request * stride_block_table + positions // PAGE_SIZE, mask=in_range, other=0
        )
        key_mask = in_range[:, None] & (dims[None, :] < HEAD_DIM)
        value_mask = in_range[:, None] & (value_dims[None, :] < HEAD_DIM_V)
    else:
        blocks = tl.load(block_table_ptr + request * stride_block_table + positions // PAGE_SIZE)
        key_mask = (dims < HEAD_DIM)[None, :]
        value_mask = (value_dims < HEAD_DIM_V)[None, :]
    rows = (
        blocks.to(tl.int64) * stride_cache_block
        + kv_head * stride_cache_head
        + (positions % PAGE_SIZE) * stride_cache_token
    )
    key = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=key_mask, other=0.0).to(q.dtype)
    value = tl.load(v_cache_ptr + rows[:, None] + value_dims[None, :], mask=value_mask, other=0.0).to(q.dtype)
    if UPCAST_DOT:
        key = key.to(tl.float32)
        value = value.to(tl.float32)
    scores = tl.dot(q, tl.trans(key))
    if USE_SOFT_CAP:  # the cap applies to natural-log scores; the softmax runs in base 2
        scores = _soft_cap(scores * (scale_log2 / LOG2E), soft_cap) * LOG2E
    else:
        scores = scores * scale_log2
    if MASKED:
        key_positions = positions
        structural = in_range[None, :] & row_valid[:, None]
        if TREE:
            new = positions >= context_len
            index = tl.where(new & in_range, positions - context_len, 0)
            depth = tl.load(tree_depths_ptr + query_start + index, mask=new & in_range, other=0)
            key_positions = tl.where(new, context_len + depth, positions)
            bit = ((query_ancestors[:, None] >> index[None, :].to(tl.int64)) & 1) != 0
            structural = structural & (bit | ~new[None, :])
        visible = (key_positions[None, :] <= query_positions[:, None]) & structural
        if USE_WINDOW:
            visible = visible & (query_positions[:, None] - key_positions[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
    return online_softmax_step(scores, value, acc, row_max, row_sum, PRODUCT_SCALE)


@triton.jit
def _attend(
    q,
    request,
    kv_head,
    start,
    end,
    query_positions,
    row_valid,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    stride_block_table,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    scale_log2,
    soft_cap,
    window,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    context_len,
    query_start,
    query_ancestors,
    tree_depths_ptr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TREE: tl.constexpr,
):
    """Online softmax of the rows in ``q`` over KV slots [start, end) of one request (in slot
    order): (unnormalised output, row maximum, row sum).

    The whole tiles before the request's first new token (``context_len``) are seen by every row,
    so without a window they run unmasked; the tiles from there on are masked.
    UPCAST_DOT (Triton's CPU interpreter only, whose bf16 tl.dot is wrong): products in fp32.
    KV_FP8: the cache holds fp8 numbers and their scales are at ``k_scale_ptr`` / ``v_scale_ptr``;
    keys and values widen to fp16, the query is scaled into fp16 (``fp16_scaling``).
    Q_FP8: ``q`` holds an fp8 query's numbers (exact in the compute dtype), its scale at
    ``q_scale_ptr``: folded, like k's, into the scores' scale on the device.
    TREE (a token tree, ``backends.token_tree``): a new token's key sits at context_len + its depth
    (``tree_depths_ptr``, the request's tokens from ``query_start``), and a row sees it only where
    its bit is set in the row's ``query_ancestors`` (bit j: the request's new token j); the
    context's keys at their slots' positions, as a chain's.
    """
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        if q.dtype != tl.float16:  # an fp16 query (an fp16 model's) is already in range
            up, down = fp16_scaling(largest_magnitude(q))
            q = (q.to(tl.float32) * up[:, None]).to(tl.float16)
            scale_log2 = scale_log2 * down[:, None]  # a column: each row's scale (a scalar elsewhere)
    if Q_FP8:
        scale_log2 = scale_log2 * tl.load(q_scale_ptr)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    product_scale: tl.constexpr = FP16_PRODUCT_SCALE if KV_FP8 else 1.0
    unmasked_end = start
    if not USE_WINDOW:
        unmasked_end = start + tl.maximum(tl.minimum(end, context_len) - start, 0) // BLOCK_N * BLOCK_N
    for tile_start in range(start, unmasked_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, tile_start, request, kv_head, end, query_positions, row_valid,
            k_cache_ptr, v_cache_ptr, block_table_ptr, stride_block_table, stride_cache_block,
            stride_cache_head, stride_cache_token, scale_log2, soft_cap, window, context_len, query_start,
            query_ancestors, tree_depths_ptr, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, USE_WINDOW,
            USE_SOFT_CAP, UPCAST_DOT, HEAD_DIM_V, BLOCK_DV, TREE, False, product_scale,
        )  # fmt: skip
    for tile_start in range(unmasked_end, end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, tile_start, request, kv_head, end, query_positions, row_valid,
            k_cache_ptr, v_cache_ptr, block_table_ptr, stride_block_table, stride_cache_block,
            stride_cache_head, stride_cache_token, scale_log2, soft_cap, window, context_len, query_start,
            query_ancestors, tree_depths_ptr, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, USE_WINDOW,
            USE_SOFT_CAP, UPCAST_DOT, HEAD_DIM_V, BLOCK_DV, TREE, True, product_scale,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * (tl.load(v_scale_ptr) / FP16_PRODUCT_SCALE)
    return acc, row_max, row_sum


@batch_kernel
def decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_reqs,
    num_splits,
    scale_log2,
    soft_cap,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block_table,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    sinks_ptr,
    lse_ptr,
    lse_stride,
    tree_ancestors_ptr,
    tree_depths_ptr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DECODE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    TREE: tl.constexpr,
):
    request, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # grid (requests, KV heads, splits)
    query_start, query_len, seq_len, token, head, row_valid, query_positions = decode_tile(
        query_start_loc_ptr, seq_lens_ptr, request, num_reqs, kv_head * GROUP, GROUP, NUM_HEADS, DECODE_Q, BLOCK_M
    )
    if query_len == 0:
        return
    context_len = seq_len - query_len
    query_ancestors = tl.zeros([BLOCK_M], dtype=tl.int64)
    if TREE:  # a token tree: each row at its depth, seeing its ancestors (``_attend``)
        query_positions = context_len + tl.load(tree_depths_ptr + query_start + token, mask=row_valid, other=0)
        query_ancestors = tl.load(tree_ancestors_ptr + query_start + token, mask=row_valid, other=0)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        query_ptr
        + (query_start + token)[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    if Q_FP8:  # an fp8 query's numbers, exact in the compute dtype (its scale folded into the scores')
        q = q.to(out_ptr.dtype.element_ty)

    low = 0
    if USE_WINDOW:
        low = tl.maximum(seq_len - query_len - window + 1, 0)
    start, end = split_range(low, seq_len, split, num_splits, BLOCK_N, ONE_SPLIT)

    acc, row_max, row_sum = _attend(
        q,
        request,
        kv_head,
        start,
        end,
        query_positions,
        row_valid,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        stride_block_table,
        stride_cache_block,
        stride_cache_head,
        stride_cache_token,
        scale_log2,
        soft_cap,
        window,
        k_scale_ptr,
        v_scale_ptr,
        q_scale_ptr,
        context_len,
        query_start,
        query_ancestors,
        tree_depths_ptr,
        BLOCK_M,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        PAGE_SIZE,
        USE_WINDOW,
        USE_SOFT_CAP,
        UPCAST_DOT,
        KV_FP8,
        Q_FP8,
        HEAD_DIM_V,
        BLOCK_DV,
        TREE,
    )
    if HAS_SINKS and ONE_SPLIT:  # with several splits, the merge adds the sink once
        acc, row_max, row_sum = fold_sink(acc, row_max, row_sum, sinks_ptr, head, row_valid)
    if RETURN_LSE and ONE_SPLIT:  # with several splits, the merge writes it
        store_lse(row_max, row_sum, lse_ptr, lse_stride, query_start + token, head, row_valid)
    store_split_result(
        acc,
        row_max,
        row_sum,
        partial_out_ptr,
        partial_lse_ptr,
        out_ptr,
        query_start,
        token,
        head,
        request,
        split,
        num_splits,
        tl.arange(0, BLOCK_DV),
        row_valid,
        stride_out_token,
        stride_out_head,
        NUM_HEADS,
        DECODE_Q,
        HEAD_DIM_V,
        ONE_SPLIT,
    )


@batch_kernel
def merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_out_token,
    stride_out_head,
    sinks_ptr,
    lse_ptr,
    lse_stride,
    num_heads,
    decode_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    RETURN_LSE: tl.constexpr = False,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    columns = tl.program_id(2) * BLOCK_D  # the output's columns are spread over programs too
    request = row // decode_q
    token = row % decode_q
    query_start, query_len = decode_query(query_start_loc_ptr, request, num_reqs, decode_q)
    if token >= query_len:
        return
    # Any number of splits, BLOCK_SPLITS at a time: the largest log-sum-exp first, then the
    # weighted sum of the splits' rows (in split order, so a step's bits depend only on its count).
    splits = tl.arange(0, BLOCK_SPLITS)
    partial_row = row * num_heads + head
    top = float("-inf")
    for first in range(0, num_splits, BLOCK_SPLITS):
        lse = tl.load(
            partial_lse_ptr + partial_row * num_splits + first + splits,
            mask=first + splits < num_splits,
            other=float("-inf"),
        )
        top = tl.maximum(top, tl.max(lse, axis=0))
    if HAS_SINKS:  # the learned sink joins the denominator once, over every split
        sink = tl.load(sinks_ptr + head) * LOG2E
        top = tl.maximum(top, sink)
        total = tl.exp2(sink - top)
    else:
        total = 0.0
    dims = columns + tl.arange(0, BLOCK_D)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_SPLITS):
        in_range = first + splits < num_splits
        lse = tl.load(partial_lse_ptr + partial_row * num_splits + first + splits, mask=in_range, other=float("-inf"))
        weights = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)  # an empty split (or row): no weight
        total += tl.sum(weights, axis=0)
        partial = tl.load(
            partial_out_ptr + (partial_row * num_splits + first + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=in_range[:, None] & (dims[None, :] < HEAD_DIM),
            other=0.0,
        )
        out += tl.sum(partial * weights[:, None], axis=0)
    out = out / tl.where(total > 0, total, 1.0)  # a row with no key at all (a DCP rank's): output 0, LSE -inf
    if RETURN_LSE and columns == 0:
        tl.store(lse_ptr + (query_start + token) * lse_stride + head, (top + tl.log2(total)) * LN2)
    tl.store(
        out_ptr + (query_start + token) * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@batch_kernel
def prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    num_reqs,
    scale_log2,
    soft_cap,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block_table,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    sinks_ptr,
    lse_ptr,
    lse_stride,
    tree_ancestors_ptr,
    tree_depths_ptr,
    GROUP: tl.constexpr,
    DECODE_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    TREE: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Request r owns query blocks [qsl[r] // BLOCK_Q + r, ... + cdiv(len_r, BLOCK_Q)): monotone in
    # r and non-overlapping, so the largest r whose first block is <= program is the owner.
    low = 0
    high = num_reqs
    while low < high:
        middle = (low + high) // 2
        if tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle <= program:
            low = middle + 1
        else:
            high = middle
    request = low - 1
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    query_block = program - (query_start // BLOCK_Q + request)
    if (query_len <= DECODE_Q) | (query_block * BLOCK_Q >= query_len):
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token = query_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (token < query_len) & (rows < BLOCK_Q * GROUP)
    query_positions = context_len + token
    query_ancestors = tl.zeros([BLOCK_M], dtype=tl.int64)
    if TREE:  # a token tree: each row at its depth, seeing its ancestors (``_attend``)
        query_positions = context_len + tl.load(tree_depths_ptr + query_start + token, mask=row_valid, other=0)
        query_ancestors = tl.load(tree_ancestors_ptr + query_start + token, mask=row_valid, other=0)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims[None, :] < HEAD_DIM
    q = tl.load(
        query_ptr
        + (query_start + token)[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_mask,
        other=0.0,
    )
    if Q_FP8:
        q = q.to(out_ptr.dtype.element_ty)
    first_position = context_len + query_block * BLOCK_Q
    last_position = tl.minimum(first_position + BLOCK_Q, seq_len)  # exclusive: causal
    start = 0
    if USE_WINDOW:
        # A tree's tile holds tokens as shallow as the root (position context_len).
        earliest = context_len if TREE else first_position
        start = tl.maximum(earliest - window + 1, 0)
    start = (start // BLOCK_N) * BLOCK_N

    acc, row_max, row_sum = _attend(
        q,
        request,
        kv_head,
        start,
        last_position,
        query_positions,
        row_valid,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        stride_block_table,
        stride_cache_block,
        stride_cache_head,
        stride_cache_token,
        scale_log2,
        soft_cap,
        window,
        k_scale_ptr,
        v_scale_ptr,
        q_scale_ptr,
        context_len,
        query_start,
        query_ancestors,
        tree_depths_ptr,
        BLOCK_M,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        PAGE_SIZE,
        USE_WINDOW,
        USE_SOFT_CAP,
        UPCAST_DOT,
        KV_FP8,
        Q_FP8,
        HEAD_DIM_V,
        BLOCK_DV,
        TREE,
    )
    if HAS_SINKS:
        acc, row_max, row_sum = fold_sink(acc, row_max, row_sum, sinks_ptr, head, row_valid)
    if RETURN_LSE:
        store_lse(row_max, row_sum, lse_ptr, lse_stride, query_start + token, head, row_valid)
    store_output(
        acc,
        row_sum,
        out_ptr,
        query_start + token,
        head,
        tl.arange(0, BLOCK_DV),
        row_valid,
        stride_out_token,
        stride_out_head,
        HEAD_DIM_V,
    )
