"""What the numbers in a case are, beyond N(0, 1): the probe channel, the data profiles, and the
poison that fills every KV slot no request owns.

Random N(0, 1) data makes every boundary soft: a key seen one position too early, or a slot read
one past the end, moves the output by about 1/seq_len, which a long context hides inside the
tolerance. So one query channel, the *probe* (the last query/key channel), carries a constant
that makes chosen keys dominant:

* **poison** (every case): every slot no request owns — the rest of a request's last block, the
  reserved block 0, blocks nobody holds — is written, through the backend's own ``write_kv``,
  with a key whose probe channel scores ``POISON_LOGIT`` above anything real and a value of
  ``POISON_VALUE``. A backend that masks such a slot gives it weight exactly 0 (finite × 0 = 0),
  so correct backends are unaffected; one that reads it unmasked (past the sequence end, a wrong
  block, a stale length) returns about ``POISON_VALUE`` instead of an average of N(0, 1) values.
* **outliers**: a second channel shifts every logit by ``OUTLIER_SHIFT_LOGIT`` (an outlier channel of a
  trained model: softmax without its max subtracted overflows fp32, scores kept in bf16/fp16 lose
  several units) and position 0 of every request scores ``SINK_LOGIT`` more (an attention sink).
* **edges**: the key just past each boundary dominates the query that must not see it. Causal
  edge (cases without a window): the first ``EDGE_KEYS`` new tokens of a request score
  ``edge_base + EDGE_STEP * j``, so each query's own key dominates what it may see, the next
  token's key would dominate it more, and a length one short loses the dominant key. Window edge:
  the ``EDGE_KEYS`` keys ending just outside the
  last query's window score more the older they are, plus the key just inside it, so both a window
  one too wide and one too narrow swap the dominant key for every such query.

Every constant is an integer up to 256 or a power of two, so it is exact in fp16, bf16 and TF32
and its products with the probe query are exact: a correct backend's only error is the one the
tolerances already allow.

Keys and values are also **activation-like** in every profile (``shape_activations``): trained
models' keys and values are not zero-mean. Each channel has a mean of its own (a projection's
bias, as Qwen2's), one value channel a large one (an outlier channel), and one token in 16 has
values several times larger than the rest (heavy tails). An output is then about its channel's
mean, not about 1/√n, so a precision bug that scales with the output (an accumulator kept in the
input dtype across KV tiles) shows. Means go on channels 2 and up (an fp8 case's range channels
are 0 and 1; the probe and the outlier shift are the last two key channels); MLA's latent, keys
and values at once, gets the means but no heavy tails (its tokens' scores would follow them).

An **fp8 cache** holds at most ``largest × k_scale`` (448 × 0.1 for e4m3 by default): the probe
query grows (a power of two) until every probe key stays within half of that, and the data use
the format's range (``use_fp8_range``): one key and one value channel large enough that some of
its numbers saturate, one small enough to land among fp8's subnormals, the query scaled inversely
on those channels so the scores keep their spread.
"""

from __future__ import annotations

import math

import torch

from backends.base import AttentionSpec
from conformance.cases.kv_quantization import largest

POISON_LOGIT = 40.0  # above every real logit of the profile: e^40 outweighs any context
POISON_VALUE = 16.0  # what an unmasked read of a poisoned slot pulls the output towards
OUTLIER_SHIFT_LOGIT = 256.0  # exp(88) already overflows fp32; a bf16 score near 256 is rounded by up to 1
SINK_LOGIT = 6.0
EDGE_STEP = 3.0  # logits between neighbouring edge keys: e^3 = 20x the weight
EDGE_KEYS = 16
EDGE_MARGIN = 4.0  # logits by which the edge keys together outweigh every other key
FP8_KEY_HEADROOM = 0.5  # an fp8 case's probe keys stay within this fraction of the largest storable key
FP8_SATURATING = 0.5  # the large channel's scale, of the largest storable number: |x| > 2σ saturates
FP8_SUBNORMAL = 1 / 64  # the small channel's scale, of one stored unit × scale: subnormal in e4m3
SINK_SEED = 0x51_4B
SINK_QUARTERS = (-8, 25)  # most heads' learned sink logits, in quarters: -2 to 6
LARGE_SINK_QUARTERS = (32, 57)  # every fourth head's: 8 to 14, beyond most of its logits
COMPUTE_HEADROOM = 256  # the large channel's scale stays this far below the compute dtype's largest number


# Activation-like structure (module docstring): per-channel means by channel index, repeating
# from channel 2; all exact in every dtype and storable in fp8 at the scales cases use.
VALUE_MEANS = (0.5, -1.0, 0.25, 2.0, -0.5, 1.0, 0.0, -2.0)
OUTLIER_VALUE_CHANNEL = 2
OUTLIER_VALUE_MEAN = 8.0
KEY_MEANS = (0.25, -0.25, 0.5, 0.0, -0.5)
HEAVY_EVERY = 16  # one token in HEAVY_EVERY, at position HEAVY_OFFSET of each 16, has values HEAVY_GAIN times larger
HEAVY_OFFSET = 7
HEAVY_GAIN = 4.0
FIRST_SHAPED_CHANNEL = 2


def channel_means(pattern: tuple[float, ...], channels: int, device: torch.device) -> torch.Tensor:
    # Built on the host and copied once: element by element on a GPU it was one launch per
    # channel per request, which made a 128-request case's data take minutes on a shared GPU.
    means = [0.0] * min(channels, FIRST_SHAPED_CHANNEL)
    means += [
        pattern[(channel - FIRST_SHAPED_CHANNEL) % len(pattern)] for channel in range(FIRST_SHAPED_CHANNEL, channels)
    ]
    return torch.tensor(means, dtype=torch.float32, device=device)


def shape_activations(case, keys: list[torch.Tensor], values: list[torch.Tensor | None]) -> None:
    """Per-channel means, an outlier value channel and heavy-tailed value tokens, in place on the
    float32 N(0, 1) data (module docstring)."""
    spec = case.spec
    if not keys or not spec.layout.attends:  # an indexer's keys weigh no values
        return
    device = keys[0].device
    if spec.kind == "mla":  # the latent is the value too
        latent_means = channel_means(VALUE_MEANS, spec.kv_lora_rank, device)
        latent_means[OUTLIER_VALUE_CHANNEL] = OUTLIER_VALUE_MEAN
        for key in keys:
            key[:, : spec.kv_lora_rank] += latent_means
        return
    key_means = channel_means(KEY_MEANS, spec.head_dim, device)
    key_means[spec.head_dim - 2 :] = 0.0  # the outlier shift and the probe: set by the profiles
    value_means = channel_means(VALUE_MEANS, spec.v_head_dim, device)
    value_means[OUTLIER_VALUE_CHANNEL] = OUTLIER_VALUE_MEAN
    for key, value in zip(keys, values):
        key += key_means
        value[HEAVY_OFFSET::HEAVY_EVERY] *= HEAVY_GAIN
        value += value_means


def probe_query_value(case) -> float:
    """The probe channel's query value: a power of two near 1/scale, so probe logits are O(1) per
    unit; for an fp8 cache, larger where needed for the largest probe key to stay storable."""
    spec = case.spec
    value = 2.0 ** min(6, max(-2, math.floor(math.log2(1.0 / spec.softmax_scale))))
    if case.kv_scales:
        limit = FP8_KEY_HEADROOM * largest(spec.kv_cache_dtype) * case.kv_scales[0]
        needed = (POISON_LOGIT + profile_max_logit(spec, case.data, case.max_seq_len)) / (limit * spec.softmax_scale)
        value = max(value, 2.0 ** math.ceil(math.log2(needed)))
    return value


def _key_units(case, logit: float) -> float:
    """The probe-channel key value that adds ``logit`` to the score of every query."""
    return logit / (probe_query_value(case) * case.spec.softmax_scale)


def _exact_integer(value: float) -> float:
    # Integers up to 256 are exact in bf16 and fp16: the poison's score must not depend on rounding.
    return float(min(256, max(1, round(value))))


def profile_max_logit(spec: AttentionSpec, data: str, max_seq_len: int) -> float:
    """The largest logit a real key can reach above N(0, 1) data under ``data``."""
    if data == "outliers":
        return SINK_LOGIT  # the shift channel lifts poisoned slots as much as real ones
    if data == "edges":
        return edge_base(max_seq_len) + EDGE_STEP * (EDGE_KEYS + 1)
    return 0.0


def edge_base(seq_len: int) -> float:
    """A logit at which EDGE_KEYS keys outweigh ``seq_len`` N(0, 1)-logit keys by e^EDGE_MARGIN."""
    return math.log(max(seq_len, 2)) + EDGE_MARGIN


def apply_profile(case, query: torch.Tensor, keys: list[torch.Tensor]) -> None:
    """Shape float32 data in place: ``query`` [T, H, Dk], ``keys`` per request [s, Hkv, Dk]
    (MLA: [s, Dk]). The probe channel of every query is set in every profile."""
    spec, data, batch = case.spec, case.data, case.batch
    probe = spec.head_dim - 1
    query[..., probe] = probe_query_value(case)
    if data == "outliers":
        shift = spec.head_dim - 2
        query[..., shift] = 32.0
        shift_key = _exact_integer(OUTLIER_SHIFT_LOGIT / (32.0 * spec.softmax_scale))
        for key in keys:
            key[..., shift] = shift_key
            key[:1, ..., probe] = _exact_integer(_key_units(case, SINK_LOGIT))  # none for an empty request
    elif data == "edges":
        for key, (context_len, query_len) in zip(keys, batch):
            seq_len = context_len + query_len
            base = edge_base(seq_len)
            if spec.sliding_window is not None:
                # Older band keys score higher: for each query the key just outside its window
                # beats the one just inside by EDGE_STEP, and both beat the rest of the window.
                newest_outside = seq_len - 1 - spec.sliding_window
                for offset in range(-1, EDGE_KEYS):
                    position = newest_outside - offset
                    if 0 <= position < seq_len:
                        key[position, ..., probe] = _exact_integer(_key_units(case, base + EDGE_STEP * offset))
            else:
                for j in range(min(query_len, EDGE_KEYS)):
                    key[context_len + j, ..., probe] = _exact_integer(_key_units(case, base + EDGE_STEP * j))


def use_fp8_range(case, query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor | None]) -> None:
    """An fp8 case's data, in place (float32): channel 0 of keys and values large enough that
    its numbers beyond 2σ saturate, channel 1 small enough to be stored as subnormals; the query
    scaled inversely on both, so each channel adds to the scores what an N(0, 1) one would.

    The large value channel is one-signed, as activations' outlier channels are (a large offset):
    an output that averages values of ±900 to about 10 cancels, and then the rounding every
    kernel makes of the softmax weights (to bf16 for the product with V: 2^-9 of each term)
    is far beyond a tolerance taken on the output (MLA's latent is its values too: one-signed
    there). Keys keep both signs: scores are products summed in fp32, and both ends of the range
    saturate."""
    spec = case.spec
    k_scale, v_scale = case.kv_scales
    top = largest(spec.kv_cache_dtype)
    # e5m2 saturates past what fp16 holds: there the large channel stays well inside fp16 instead.
    ceiling = torch.finfo(spec.dtype).max / COMPUTE_HEADROOM

    def large(scale: float) -> float:
        return min(FP8_SATURATING * top * scale, ceiling)

    key_gains = (large(k_scale), FP8_SUBNORMAL * k_scale)
    value_gains = (large(v_scale), FP8_SUBNORMAL * v_scale)
    for channel, (key_gain, value_gain) in enumerate(zip(key_gains, value_gains)):
        query[..., channel] /= key_gain
        for key, value in zip(keys, values):
            key[..., channel] *= key_gain
            if value is not None:
                value[..., channel] *= value_gain
            if channel == 0:  # what the output averages: one-signed
                (key if value is None else value)[..., channel].abs_()


def sink_logits(spec: AttentionSpec, layer: int = 0) -> torch.Tensor:
    """A layer's learned attention sinks (``attnsinks``), float32 [num_heads] on the CPU, like
    gpt-oss's: most heads' a few units (``SINK_QUARTERS``), every fourth head's large
    (``LARGE_SINK_QUARTERS``: the sink takes most of the weight, so a backend that drops it is
    far off). Multiples of 1/4, exact in every dtype; one per query head, differing across the
    heads of a KV group, so a sink read per KV head is wrong. A layer's, not a batch's: every
    batch over one layer (a graph's replays, the engine's steps) sees the same sinks.

    ``layer`` > 0: another layer of the same model, whose sinks are layer 0's rolled by ``layer``
    heads: every large sink sits on another head, so a backend that keeps one layer's sinks for
    the next (in a persistent copy, in the step's metadata every layer shares) is far off."""
    heads = spec.num_heads
    generator = torch.Generator().manual_seed(SINK_SEED + heads)
    usual = torch.randint(*SINK_QUARTERS, (heads,), generator=generator)
    large = torch.randint(*LARGE_SINK_QUARTERS, (heads,), generator=generator)
    return (torch.where(torch.arange(heads) % 4 == 3, large, usual).float() / 4).roll(layer)


def poison_key_value(case) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One poisoned slot's key and value (float32, CPU): [Hkv, Dk] and [Hkv, Dv] (MLA: [Dk], None)."""
    spec, data = case.spec, case.data
    logit = POISON_LOGIT + profile_max_logit(spec, data, case.max_seq_len)
    if not spec.layout.separate_value:
        key = torch.zeros(spec.head_dim)
        key[: spec.kv_lora_rank] = POISON_VALUE / 4  # MLA's latent is the value too; its scores stay small
        value = None
    else:
        key = torch.zeros(spec.num_kv_heads, spec.head_dim)
        value = torch.full((spec.num_kv_heads, spec.v_head_dim), POISON_VALUE)
    key[..., spec.head_dim - 1] = _exact_integer(_key_units(case, logit))
    if data == "outliers":
        key[..., spec.head_dim - 2] = _exact_integer(OUTLIER_SHIFT_LOGIT / (32.0 * spec.softmax_scale))
    return key, value


INDEX_SCORE_CHUNK = 1 << 22  # an indexer's random scores drawn for at most this many (token, position) pairs at once
MESSY_PAST_FRACTION = 4  # a messyidx row: up to a quarter of its entries past the token's own position


def topk_indices(case, generator: torch.Generator) -> torch.Tensor:
    """A sparse case's index rows (``topkN``), int32 [num_tokens, topk] on the CPU, as an indexer
    hands them (``backends.base``: positions inside the request, -1 for no entry): each token's top
    ``topk`` of random scores over the positions it may index (``0 .. p``, or ``0 .. p - W`` with a
    window part of W), -1 where it has fewer. Seeded by the case alone. ``messyidx`` (module
    ``grammar``): each row shuffled (-1 between entries) and up to a quarter of its entries replaced
    by positions past the token's own, some past its sequence: all of them to be ignored; the row
    keeps its first entry that is not past the edge."""
    spec = case.spec
    topk, window = spec.sparse_topk, spec.sparse_window or 0
    rows = []
    for context_len, query_len in case.batch:
        seq_len = context_len + query_len
        positions = torch.arange(seq_len)
        query_positions = context_len + torch.arange(query_len)
        chunk = max(1, INDEX_SCORE_CHUNK // max(seq_len, 1))
        for start in range(0, query_len, chunk):
            mine = query_positions[start : start + chunk]
            scores = torch.rand(len(mine), seq_len, generator=generator)
            eligible = positions[None, :] <= (mine[:, None] - window)
            scores = scores.masked_fill(~eligible, -1.0)
            count = min(topk, seq_len)
            best, chosen = scores.topk(count, dim=1) if count else (scores[:, :0], scores[:, :0].long())
            row = torch.full((len(mine), topk), -1, dtype=torch.int64)
            row[:, :count] = torch.where(best >= 0, chosen, -1)
            if case.messy_indices:
                row = _messy(row, mine, seq_len, spec.block_size, generator)
            rows.append(row)
    return torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, topk, dtype=torch.int32)


def _messy(row: torch.Tensor, mine: torch.Tensor, seq_len: int, block_size: int, generator) -> torch.Tensor:
    """``row`` [q, topk] shuffled along each row, with up to a quarter of its entries (never its
    first real one) replaced by positions past the token's own: up to two blocks past the sequence."""
    tokens, topk = row.shape
    keep = row[:, :1].clone()  # the top score's entry: every token keeps one to attend (when it has one)
    order = torch.rand(tokens, topk, generator=generator).argsort(dim=1)
    row = row.gather(1, order)
    past = torch.rand(tokens, topk, generator=generator) < 1.0 / MESSY_PAST_FRACTION
    # Half of them inside the sequence (a later token of the same step, where there is one), half
    # in the two blocks past its end.
    ahead = (seq_len - mine)[:, None]  # 1 for the request's last token
    draw = torch.rand(tokens, topk, generator=generator)
    inside = (torch.rand(tokens, topk, generator=generator) < 0.5) & (ahead > 1)
    offsets = torch.where(inside, 1 + (draw * (ahead - 1)).long(), ahead + (draw * 2 * block_size).long())
    row = torch.where(past, mine[:, None] + offsets, row)
    has_keep = (row == keep).any(dim=1, keepdim=True)
    row[:, :1] = torch.where(has_keep, row[:, :1], keep)  # put the kept entry back where it was lost
    return row


def index_weights(case, generator: torch.Generator) -> torch.Tensor:
    """An indexer case's head weights, float32 [num_tokens, num_heads] on the CPU: N(0, 1) over
    sqrt(heads × head dim) (the model's projection with the softmax scale folded in), both signs,
    drawn from the batch's generator (another batch of the same seed, another step's weights)."""
    spec = case.spec
    weights = torch.randn(case.num_tokens, spec.num_heads, generator=generator)
    return weights / math.sqrt(spec.num_heads * spec.head_dim)
