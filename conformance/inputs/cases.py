"""Cases: a layer spec, a batch of (context_len, query_len) requests, and a seed.

A case's id is its whole definition, in the same compact grammar ``--case`` accepts:

    LAYER ":" BATCH ["@" SEED]

    LAYER  = KIND ("-" ATTR)*             KIND: gqa | mha | mla
      hQ/KV or hQ   query / KV heads; hQ alone is MHA (default h32/8; MLA: h16, one latent KV head)
      dN            head dim               (default d128; MLA: d512+64, latent + rope)
      dQK/V         query/key head dim QK, value and output head dim V (DeepSeek-V3's MLA
                    prefill as vLLM runs it: d192/128)
      fp16|bf16|fp32 dtype                 (default bf16)
      fp8e4m3|fp8e5m2 an fp8 KV cache with per-tensor scales (default: the cache in the dtype)
      kscaleX vscaleX the fp8 cache's key and value scales (default 0.1 and 4; MLA: kscale only)
      pN            KV block (page) size   (default p16; MLA default p64)
      wN            sliding window         (a token sees itself and the N-1 before it)
      capX          logits soft cap
      scaleX        softmax scale          (default 1/sqrt(head dim))
      shareN        the first N blocks of every request are one shared prefix
      linear        blocks in order (default: physical blocks randomly permuted)
      strided       query, key and value are views into one fused QKV projection, the output a
                    view into a wider buffer, the block table a column slice of a wider table
                    (non-contiguous rows, as engines hand them over)
      padN          N padding rows (slot -1) after the real tokens (default 3; pad0: none)
      lse           forward is also handed an ``lse`` buffer: the step's log-sum-exp is checked
                    (run by a backend that claims returns_lse)
      attnsinks     learned attention sinks (gpt-oss): one logit per query head joins every
                    softmax denominator, handed to forward as ``sinks`` (MHA/GQA only)
      outliers      large logits: an outlier channel shifts every logit by ~100+ and position 0
                    is a sink in the data (the data of trained models, near fp16's range)
      edges         boundary-sensitive data: the key just past each causal edge and just
                    outside each sliding window dominates, so an off-by-one fails widely
      bigpool       a pool past 2**31 elements per K (V) plane, the requests' blocks at its top:
                    an offset into it computed in 32 bits wraps (a GPU with room for it only)
    BATCH  = ITEM ("," ITEM)*
    ITEM   = CTX "+" Q ["x" N]             N requests with CTX cached tokens and Q new ones;
                                           numbers take a k suffix (4k = 4096); 0+0 is an
                                           empty request (vLLM's graph padding: query and
                                           sequence length 0, its block-table row -1), run only
                                           by a backend that claims PaddingStyle.EMPTY_REQUESTS

Examples:
    4k+1x64                                 64 decodes over 4096 cached tokens (default layer)
    gqa-h32/8-d128-bf16-p16:4096+4x8        spec-verify, 1 + 3 drafts, batch 8
    mha-h16-d64-fp16-p32:1000+24,0+300,17+1 chunked prefill, prefill and a decode in one batch
    gqa-h8/2-d128-w256:2000+8@7             sliding window 256, seed 7
    mla-h128-d512+64-bf16-p64:4096+1x64     DeepSeek-style absorbed MLA decode
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from backends.base import DTYPE_NAMES, AttentionSpec, dtype_name, kv_dtype_name
from conformance.inputs.kv_quantization import DEFAULT_K_SCALE, DEFAULT_V_SCALE, FP8_DTYPES


DATA_PROFILES = ("normal", "outliers", "edges")
DEFAULT_PADDING_TOKENS = 3
MAX_PADDING_TOKENS = 1024
MAX_TOKENS_PER_REQUEST = 1 << 22  # 4M tokens: beyond any model's context, and beyond any device's memory here
MAX_REQUESTS = 1 << 16
MAX_SEED = 2**63 - 1


class CaseSyntaxError(ValueError):
    """A --case string that does not parse; the message says what was wrong and what is expected."""


@dataclass(frozen=True)
class Case:
    spec: AttentionSpec
    batch: tuple[tuple[int, int], ...]  # (context_len, query_len) per request
    seed: int = 0
    shared_prefix_blocks: int = 0
    permute_blocks: bool = True
    strided: bool = False  # inputs and output as views into larger buffers (see harness)
    data: str = "normal"  # normal | outliers | edges (see conformance.inputs.batch)
    padding: int = DEFAULT_PADDING_TOKENS  # rows with slot -1 after the step's real tokens
    big_pool: bool = False  # the pool past 2**31 elements a plane, owned blocks at its top (see batch)
    k_scale: float | None = None  # an fp8 cache's scales; None: the default (kv_quantization)
    v_scale: float | None = None
    lse: bool = False  # forward is also asked for the step's log-sum-exp (a backend claiming returns_lse)
    tag: str = field(default="", compare=False)  # a human label ("decode"), not part of the id

    def __post_init__(self) -> None:
        if not self.batch:
            raise CaseSyntaxError("a batch needs at least one request")
        if len(self.batch) > MAX_REQUESTS:
            raise CaseSyntaxError(f"{len(self.batch)} requests: at most {MAX_REQUESTS} in one batch")
        for context_len, query_len in self.batch:
            if context_len < 0 or query_len < 0 or (query_len == 0 and context_len != 0):
                raise CaseSyntaxError(f"request {context_len}+{query_len}: context must be >= 0 and query >= 1, "
                                      "or 0+0 (an empty request: vLLM's graph padding)")
            if context_len + query_len > MAX_TOKENS_PER_REQUEST:
                raise CaseSyntaxError(f"request {context_len}+{query_len}: at most {MAX_TOKENS_PER_REQUEST} tokens per request")
        if all(query == 0 for _, query in self.batch):
            raise CaseSyntaxError("a batch needs at least one request that is not empty (0+0)")
        if not 0 <= self.seed <= MAX_SEED:
            raise CaseSyntaxError(f"seed {self.seed}: seeds are between 0 and {MAX_SEED}")
        if self.data not in DATA_PROFILES:
            raise CaseSyntaxError(f"data profile {self.data!r} is not one of {', '.join(DATA_PROFILES)}")
        if not 0 <= self.padding <= MAX_PADDING_TOKENS:
            raise CaseSyntaxError(f"pad{self.padding}: padding rows must be between 0 and {MAX_PADDING_TOKENS}")
        if not self.spec.fp8_kv_cache and (self.k_scale is not None or self.v_scale is not None):
            raise CaseSyntaxError("kscale and vscale are an fp8 cache's scales: give fp8e4m3 or fp8e5m2 too")
        if self.spec.kind == "mla" and self.v_scale is not None:
            raise CaseSyntaxError("MLA's latent cache has one scale: give kscale, not vscale")
        if self.shared_prefix_blocks:
            needed = self.shared_prefix_blocks * self.spec.block_size
            if min(context for context, _ in self.batch) < needed:
                raise CaseSyntaxError(
                    f"share{self.shared_prefix_blocks} needs every context >= {needed} tokens "
                    f"({self.shared_prefix_blocks} blocks of {self.spec.block_size})"
                )

    @property
    def id(self) -> str:
        return format_case(self)

    @property
    def layer_options(self) -> LayerOptions:
        return LayerOptions(self.shared_prefix_blocks, self.permute_blocks, self.strided, self.data, self.padding,
                            self.big_pool, self.k_scale, self.v_scale, self.lse)

    @property
    def kv_scales(self) -> tuple[float, float] | None:
        """(k_scale, v_scale) of an fp8 cache (MLA: v_scale is k_scale, unused); None otherwise."""
        if not self.spec.fp8_kv_cache:
            return None
        k_scale = DEFAULT_K_SCALE if self.k_scale is None else self.k_scale
        if self.spec.kind == "mla":
            return k_scale, k_scale
        return k_scale, DEFAULT_V_SCALE if self.v_scale is None else self.v_scale

    @property
    def num_reqs(self) -> int:
        return len(self.batch)

    @property
    def num_tokens(self) -> int:
        return sum(query for _, query in self.batch)

    @property
    def max_query_len(self) -> int:
        return max(query for _, query in self.batch)

    @property
    def empty_requests(self) -> int:
        """How many requests are 0+0: vLLM's padding requests (query length 0, sequence length 0)."""
        return sum(1 for request in self.batch if request == (0, 0))

    @property
    def max_seq_len(self) -> int:
        return max(context + query for context, query in self.batch)

    @property
    def kv_elements(self) -> int:
        """Key and value numbers the case holds (MLA: its latent and rope rows): what a CPU run's
        time grows with."""
        row = self.spec.head_dim if self.spec.kind == "mla" else 2 * self.spec.num_kv_heads * self.spec.head_dim
        return sum(context + query for context, query in self.batch) * row


# --- grammar -----------------------------------------------------------------------------------

_GRAMMAR_HINT = "expected LAYER:BATCH[@SEED], e.g. gqa-h32/8-d128-bf16-p16:4096+1x64 (see `conformance run --help`)"


def _number(text: str, what: str) -> int:
    match = re.fullmatch(r"(\d+)(k?)", text)
    if not match:
        raise CaseSyntaxError(f"{what} {text!r} is not a number; {_GRAMMAR_HINT}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def _float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CaseSyntaxError(f"{what} {text!r} is not a number") from None


def parse_batch(text: str) -> tuple[tuple[int, int], ...]:
    requests: list[tuple[int, int]] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+k?)\+(\d+k?)(?:x(\d+))?\s*", item)
        if not match:
            raise CaseSyntaxError(f"batch item {item!r} is not CTX+Q[xN]; {_GRAMMAR_HINT}")
        context = _number(match.group(1), "context length")
        query = _number(match.group(2), "query length")
        count = _number(match.group(3), "repeat count") if match.group(3) else 1
        requests += [(context, query)] * count
    return tuple(requests)


@dataclass(frozen=True)
class LayerOptions:
    """The parts of a LAYER that are not the AttentionSpec: how the harness lays out the data."""

    shared_prefix_blocks: int = 0
    permute_blocks: bool = True
    strided: bool = False
    data: str = "normal"
    padding: int = DEFAULT_PADDING_TOKENS
    big_pool: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    lse: bool = False


_ATTRIBUTE_KINDS = (
    (r"fp16|bf16|fp32", "dtype"), (r"fp8e4m3|fp8e5m2", "KV-cache dtype"), (r"kscale.+", "key scale"),
    (r"vscale.+", "value scale"), (r"h\d+(/\d+)?", "heads"), (r"d\d+([+/]\d+)?", "head dim"), (r"p\d+", "block size"),
    (r"w\d+", "sliding window"), (r"cap.+", "soft cap"), (r"scale.+", "scale"), (r"share\d+", "shared prefix"),
    (r"pad\d+", "padding"), (r"outliers|edges", "data profile"),
)


def _attribute_kind(attr: str) -> str:
    """What a layer attribute sets (two attributes setting one thing contradict each other)."""
    for pattern, kind in _ATTRIBUTE_KINDS:
        if re.fullmatch(pattern, attr):
            return kind
    return attr  # linear, strided, bigpool, or unknown (reported by the parser)


def parse_layer(text: str) -> tuple[AttentionSpec, LayerOptions]:
    kind_name, *attrs = text.split("-")
    if kind_name not in ("gqa", "mha", "mla"):
        raise CaseSyntaxError(f"layer kind {kind_name!r} is not gqa, mha or mla; {_GRAMMAR_HINT}")
    is_mla = kind_name == "mla"
    num_heads, num_kv_heads = (16, 1) if is_mla else (32, 8)
    head_dim, kv_lora_rank, rope_dim = 128, 512, 64
    dtype, block_size = torch.bfloat16, 64 if is_mla else 16
    window = cap = scale = kv_cache_dtype = k_scale = v_scale = None
    share, permute, strided, data, padding, big_pool = 0, True, False, "normal", DEFAULT_PADDING_TOKENS, False
    sinks = lse = False
    value_head_dim = None
    kv_heads_given = False
    given: dict[str, str] = {}  # attribute kind -> the attribute that set it
    for attr in attrs:
        kind = _attribute_kind(attr)
        if kind in given:
            if given[kind] == attr:
                raise CaseSyntaxError(f"{attr} is given twice in {text!r}")
            raise CaseSyntaxError(f"{given[kind]} and {attr} both set the {kind} in {text!r}: give it once")
        given[kind] = attr
        if attr in DTYPE_NAMES:
            dtype = DTYPE_NAMES[attr]
        elif attr.startswith("fp8") and attr[3:] in FP8_DTYPES:
            kv_cache_dtype = FP8_DTYPES[attr[3:]]
        elif match := re.fullmatch(r"kscale(.+)", attr):
            k_scale = _float(match.group(1), "key scale")
        elif match := re.fullmatch(r"vscale(.+)", attr):
            v_scale = _float(match.group(1), "value scale")
        elif attr == "linear":
            permute = False
        elif attr == "strided":
            strided = True
        elif attr == "bigpool":
            big_pool = True
        elif attr == "attnsinks":
            sinks = True
        elif attr == "lse":
            lse = True
        elif attr == "sinks":
            raise CaseSyntaxError(f"'sinks' is ambiguous in {text!r}: write 'outliers' for the large-logit data profile "
                                  "(its old name), 'attnsinks' for learned attention sinks (gpt-oss)")
        elif attr in DATA_PROFILES[1:]:
            data = attr
        elif match := re.fullmatch(r"pad(\d+)", attr):
            padding = int(match.group(1))
        elif match := re.fullmatch(r"h(\d+)(?:/(\d+))?", attr):
            num_heads = int(match.group(1))
            if match.group(2):
                if is_mla:
                    raise CaseSyntaxError("MLA has one latent KV head: write hQ, not hQ/KV")
                num_kv_heads, kv_heads_given = int(match.group(2)), True
        elif is_mla and (match := re.fullmatch(r"d(\d+)\+(\d+)", attr)):
            kv_lora_rank, rope_dim = int(match.group(1)), int(match.group(2))
        elif not is_mla and (match := re.fullmatch(r"d(\d+)(?:/(\d+))?", attr)):
            head_dim = int(match.group(1))
            value_head_dim = int(match.group(2)) if match.group(2) else None
        elif match := re.fullmatch(r"p(\d+)", attr):
            block_size = int(match.group(1))
        elif match := re.fullmatch(r"w(\d+)", attr):
            window = int(match.group(1))
        elif match := re.fullmatch(r"cap(.+)", attr):
            cap = _float(match.group(1), "soft cap")
        elif match := re.fullmatch(r"scale(.+)", attr):
            scale = _float(match.group(1), "scale")
        elif match := re.fullmatch(r"share(\d+)", attr):
            share = int(match.group(1))
        else:
            raise CaseSyntaxError(f"layer attribute {attr!r} not understood in {text!r}; {_GRAMMAR_HINT}")
    if kind_name == "mha" and kv_heads_given and num_kv_heads != num_heads:
        raise CaseSyntaxError(f"mha has one KV head per query head, but {text!r} gives {num_heads}/{num_kv_heads}: "
                              "write gqa for grouped heads")
    if not is_mla and not kv_heads_given and (kind_name == "mha" or "heads" in given):
        num_kv_heads = num_heads  # mha, or hQ alone: one KV head per query head
    if window is not None and window < 1:
        raise CaseSyntaxError(f"w{window}: a sliding window holds at least 1 token")
    for name, value in (("soft cap", cap), ("scale", scale), ("key scale", k_scale), ("value scale", v_scale)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CaseSyntaxError(f"{name} {value:g}: must be a finite number above 0")
    if not is_mla and num_kv_heads >= 1 and num_heads % num_kv_heads:
        raise CaseSyntaxError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if block_size < 1 or num_heads < 1 or num_kv_heads < 1:
        raise CaseSyntaxError("block size and head counts must be positive")
    dims = {"latent dim": kv_lora_rank, "rope dim": rope_dim} if is_mla else {"head dim": head_dim}
    for name, value in dims.items():
        if value < 1:
            raise CaseSyntaxError(f"{name} {value}: must be at least 1")
    if value_head_dim == head_dim:
        value_head_dim = None  # d128/128 is d128
    if is_mla and sinks:
        raise CaseSyntaxError(f"attnsinks in {text!r}: learned attention sinks are an MHA/GQA layer's (gpt-oss), not MLA's")
    try:
        if is_mla:
            spec = AttentionSpec(
                kind="mla", num_heads=num_heads, num_kv_heads=1, head_dim=kv_lora_rank + rope_dim, dtype=dtype,
                block_size=block_size, kv_cache_dtype=kv_cache_dtype, sliding_window=window, logits_soft_cap=cap, scale=scale,
                kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
            )
        else:
            spec = AttentionSpec(
                kind="mha", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                block_size=block_size, kv_cache_dtype=kv_cache_dtype, sliding_window=window, logits_soft_cap=cap, scale=scale,
                attention_sinks=sinks, value_head_dim=value_head_dim,
            )
    except ValueError as error:
        raise CaseSyntaxError(str(error)) from None
    return spec, LayerOptions(share, permute, strided, data, padding, big_pool, k_scale, v_scale, lse)


def parse_case(text: str, default_seed: int = 0) -> Case:
    """Parse ``LAYER:BATCH[@SEED]``; a bare ``BATCH`` uses the default layer (Llama-3-8B GQA)."""
    text = text.strip()
    body, _, seed_text = text.partition("@")
    seed = _number(seed_text, "seed") if seed_text else default_seed
    layer_text, _, batch_text = body.rpartition(":")
    spec, options = parse_layer(layer_text or "gqa")
    return Case(spec, parse_batch(batch_text), seed, options.shared_prefix_blocks, options.permute_blocks,
                options.strided, options.data, options.padding, options.big_pool, options.k_scale, options.v_scale,
                options.lse)


def _format_number(value: float) -> str:
    return f"{value:g}"


def format_layer(spec: AttentionSpec, options: LayerOptions = LayerOptions()) -> str:
    if spec.kind == "mla":
        parts = ["mla", f"h{spec.num_heads}", f"d{spec.kv_lora_rank}+{spec.rope_dim}"]
    else:
        kind = "mha" if spec.num_kv_heads == spec.num_heads else "gqa"
        value_dim = "" if spec.v_head_dim == spec.head_dim else f"/{spec.v_head_dim}"
        parts = [kind, f"h{spec.num_heads}/{spec.num_kv_heads}", f"d{spec.head_dim}{value_dim}"]
    parts.append(dtype_name(spec.dtype))
    if spec.fp8_kv_cache:
        parts.append(kv_dtype_name(spec.kv_cache_dtype))
        parts += [f"{name}{_format_number(value)}" for name, value in (("kscale", options.k_scale), ("vscale", options.v_scale))
                  if value is not None]
    parts.append(f"p{spec.block_size}")
    if spec.sliding_window is not None:
        parts.append(f"w{spec.sliding_window}")
    if spec.logits_soft_cap is not None:
        parts.append(f"cap{_format_number(spec.logits_soft_cap)}")
    if spec.scale is not None:
        parts.append(f"scale{_format_number(spec.scale)}")
    if spec.attention_sinks:
        parts.append("attnsinks")
    if options.shared_prefix_blocks:
        parts.append(f"share{options.shared_prefix_blocks}")
    if not options.permute_blocks:
        parts.append("linear")
    if options.strided:
        parts.append("strided")
    if options.padding != DEFAULT_PADDING_TOKENS:
        parts.append(f"pad{options.padding}")
    if options.data != "normal":
        parts.append(options.data)
    if options.lse:
        parts.append("lse")
    if options.big_pool:
        parts.append("bigpool")
    return "-".join(parts)


def format_batch(batch: tuple[tuple[int, int], ...]) -> str:
    items: list[str] = []
    index = 0
    while index < len(batch):
        run = 1
        while index + run < len(batch) and batch[index + run] == batch[index]:
            run += 1
        context, query = batch[index]
        items.append(f"{context}+{query}" + (f"x{run}" if run > 1 else ""))
        index += run
    return ",".join(items)


def format_case(case: Case) -> str:
    layer = format_layer(case.spec, case.layer_options)
    return f"{layer}:{format_batch(case.batch)}@{case.seed}"


# --- suites ------------------------------------------------------------------------------------

LLAMA3_8B = "gqa-h32/8-d128-bf16-p16"


def _boundary_batch(block_size: int, query_len: int) -> str:
    """Sequence lengths at, just below and just above one and two block boundaries."""
    items = []
    for boundary in (block_size, 2 * block_size):
        for seq_len in (boundary - 1, boundary, boundary + 1):
            items.append(f"{max(seq_len - query_len, 0)}+{min(query_len, seq_len)}")
    return ",".join(items)


def _mha_batches(block_size: int, *, rich: bool) -> list[tuple[str, str]]:
    batches = [
        ("decode", "1+1,15+1,16+1,100+1,511+1,1000+1,2047+1,3000+1"),
        ("spec-verify k=1", "200+2,1500+2,33+2,4000+2"),
        ("spec-verify k=3", "300+4,1200+4,63+4,2900+4"),
        ("spec-verify k=7", "100+8,2000+8,47+8,777+8"),
        ("chunked prefill with context", "1024+256,300+100"),
        ("mixed prefill + decode", "0+200,700+64,3000+1x6,50+4x3"),
        ("mixed, decodes first", "3000+1x4,100+1,0+200,700+64,50+4x2"),
        # Few query tokens: the memory check runs its mixed case under compute-sanitizer, whose cost
        # grows with each report (see conformance.checks.memory).
        ("mixed, small", "0+24,70+8,300+1x3,50+4x2"),
        ("block boundaries decode", _boundary_batch(block_size, 1)),
        ("block boundaries verify", _boundary_batch(block_size, 4)),
        ("length 1", "0+1"),
    ]
    if rich:
        batches += [
            ("prefill", "0+512"),
            ("decode batch 1", "4096+1"),
            ("decode batch 128", "64+1x32,500+1x32,1100+1x32,2100+1x32"),
            ("spec-verify batch 128", "180+4x64,1000+4x64"),
            ("long context", "8192+1x2,8190+4"),
        ]
    return batches


def _mla_batches(block_size: int, *, rich: bool) -> list[tuple[str, str]]:
    batches = [
        ("decode", "1+1,63+1,64+1,65+1,700+1,2500+1"),
        ("spec-verify k=1", "100+2,1000+2,2000+2"),
        ("spec-verify k=3", "64+4,900+4,3000+4"),
        ("spec-verify k=7", "50+8,640+8,1800+8"),
        ("block boundaries decode", _boundary_batch(block_size, 1)),
        ("mixed prefill + decode", "0+100,500+40,2000+1x4"),
        ("mixed, small", "0+24,70+8,700+1x3,50+4x2"),
    ]
    if rich:
        batches += [("decode batch 1", "4096+1"), ("decode batch 128", "200+1x64,1500+1x64")]
    return batches


def _cases(layer: str, batches: list[tuple[str, str]]) -> list[Case]:
    return [replace(parse_case(f"{layer}:{batch}"), tag=tag) for tag, batch in batches]


def smoke_suite() -> list[Case]:
    """Seconds on a CPU: one of each kind of batch on small layers."""
    return _cases(
        "gqa-h4/2-d64-fp32-p16",
        [
            ("decode", "1+1,15+1,16+1,40+1"),
            ("spec-verify k=3", "20+4,33+4"),
            ("mixed prefill + decode", "0+24,30+8,17+1x2"),
        ],
    ) + _cases("gqa-h4/1-d64-bf16-p16-w24-cap20", [("sliding window, soft cap", "0+40,50+4,3+1")]) + _cases(
        "gqa-h4/2-d64-fp16-p16-share2", [("prefix sharing", "40+1,32+4,60+1")]
    ) + _cases("mla-h4-d64+16-bf16-p16", [("decode", "1+1,40+1"), ("spec-verify k=3", "30+4")]) + _cases(
        "gqa-h4/2-d64-bf16-p16-strided-outliers", [("strided views, large logits", "40+1,20+4,0+9")]
    ) + _cases("gqa-h4/1-d64-fp16-p16-w24-pad0-edges", [("window edges, no padding", "50+4,3+1,100+1")])


def _variant_cases() -> list[Case]:
    """The properties a real engine varies and the base suite holds fixed: strided views, padding,
    large logits, boundary-sensitive data and the softmax scale (see docs/checks.md, "What the harness
    varies")."""
    cases = _cases(LLAMA3_8B + "-strided", [
        ("strided: decode", "1+1,100+1,1000+1,2047+1"),
        ("strided: spec-verify k=3", "300+4,1200+4,63+4"),
        ("strided: mixed prefill + decode", "0+200,700+64,3000+1x4"),
    ])
    cases += _cases(LLAMA3_8B + "-pad0", [("no padding rows: decode", "500+1,33+1,1000+1"),
                                          ("no padding rows: mixed", "0+100,70+4,300+1")])
    cases += _cases(LLAMA3_8B + "-pad64", [("64 padding rows: spec-verify", "300+4,70+4")])
    cases += _cases(LLAMA3_8B + "-outliers", [
        ("large logits: decode", "1+1,500+1,3000+1"),
        ("large logits: spec-verify k=3", "300+4,1200+4"),
        ("large logits: mixed", "0+200,700+64,3000+1x2"),
    ])
    cases += _cases("gqa-h32/8-d128-fp16-p32-outliers", [("large logits, fp16: decode", "1+1,500+1,3000+1"),
                                                       ("large logits, fp16: spec-verify k=3", "300+4,1200+4")])
    cases += _cases(LLAMA3_8B + "-edges", [
        ("edges: decode at block ends", "1+1,15+1,16+1,31+1,100+1,1000+1,3000+1"),
        ("edges: spec-verify k=3", "300+4,1200+4,12+4,60+4"),
        ("edges: spec-verify k=7", "100+8,2000+8"),
        ("edges: chunked prefill", "1024+256,300+100"),
        ("edges: mixed", "0+200,700+64,3000+1x2,50+4"),
    ])
    cases += _cases("gqa-h32/8-d128-fp16-p32-edges", [("edges, fp16: spec-verify k=3", "300+4,1200+4,28+4")])
    cases += _cases("gqa-h8/2-d128-bf16-p16-w256-edges", [
        ("window edges: decode", "1000+1,200+1,255+1,256+1,257+1"),
        ("window edges: spec-verify k=3", "600+4,2000+4,254+4"),
        ("window edges: mixed", "0+300,700+64,3000+1"),
    ])
    cases += _cases("gqa-h8/2-d128-bf16-p16-scale0.25", [("scale 0.25: decode", "100+1,2000+1"),
                                                          ("scale 0.25: spec-verify k=3", "500+4,30+4"),
                                                          ("scale 0.25: mixed prefill + decode", "0+200,700+64,300+1x2")])
    # A cap matters only on logits past it: large logits (near 256) under a cap of 30, every path.
    cases += _cases("gqa-h8/2-d128-bf16-p16-cap30-outliers", [("cap 30, large logits: decode", "1+1,500+1,3000+1"),
                                                           ("cap 30, large logits: spec-verify k=3", "300+4,1200+4"),
                                                           ("cap 30, large logits: mixed", "0+200,700+64,3000+1x2")])
    # DeepSeek-V3's MLA scale: 1/sqrt(192) times its YaRN mscale squared (0.1 ln 40 + 1)^2, not 1/sqrt(576).
    cases += _cases("mla-h16-d512+64-bf16-p64-scale0.13524", [("DeepSeek scale: decode", "1+1,700+1,2500+1"),
                                                              ("DeepSeek scale: spec-verify k=3", "64+4,900+4"),
                                                              ("DeepSeek scale: mixed", "0+100,500+40,2000+1x4")])
    cases += _cases("mla-h16-d512+64-bf16-p64-strided", [("strided: decode", "1+1,700+1,2500+1"),
                                                         ("strided: spec-verify k=3", "64+4,900+4")])
    cases += _cases("mla-h16-d512+64-bf16-p64-outliers", [("large logits: decode", "1+1,700+1,2500+1"),
                                                       ("large logits: spec-verify k=3", "64+4,900+4")])
    cases += _cases("mla-h16-d512+64-bf16-p64-edges", [("edges: decode at block ends", "63+1,64+1,127+1,700+1"),
                                                       ("edges: spec-verify k=3", "60+4,900+4"),
                                                       ("edges: spec-verify k=7", "57+8,640+8")])
    # Engines' pools are tens of GiB: an offset computed in 32 bits wraps past 2**31 elements.
    cases += _cases(LLAMA3_8B + "-bigpool", [("big pool: decode", "1+1,700+1,3000+1"),
                                             ("big pool: spec-verify k=3", "63+4,1200+4")])
    cases += _cases("mla-h16-d512+64-bf16-p64-bigpool", [("big pool: decode", "1+1,700+1,2500+1"),
                                                         ("big pool: spec-verify k=3", "64+4,900+4")])
    return cases + _fp8_cases()


def _fp8_cases() -> list[Case]:
    """An fp8 KV cache (scales k 0.1, v 4 unless given) on every kind of batch and layer option
    where scales have broken backends: decode and prefill paths, block boundaries, long context,
    MLA's latent cache, strided inputs, padding, large logits and boundary data, other scales."""
    fp8 = LLAMA3_8B.replace("-p16", "-fp8e4m3-p16")
    cases = _cases(fp8, [(f"fp8: {tag}", batch) for tag, batch in _mha_batches(16, rich=False)
                         if tag in ("decode", "spec-verify k=3", "chunked prefill with context", "mixed prefill + decode",
                                    "block boundaries decode", "block boundaries verify")]
                   + [("fp8: long context", "8192+1x2,8190+4")])
    cases += _cases("gqa-h32/8-d128-fp16-fp8e5m2-p32", [("fp8 e5m2: decode", "1+1,500+1,3000+1"),
                                                        ("fp8 e5m2: spec-verify k=3", "300+4,1200+4"),
                                                        ("fp8 e5m2: mixed", "0+200,700+64,3000+1x2")])
    cases += _cases(fp8 + "-strided-pad64", [("fp8, strided, 64 padding rows: spec-verify k=3", "300+4,1200+4,63+4")])
    cases += _cases(fp8 + "-pad0-outliers", [("fp8, large logits, no padding: decode", "1+1,500+1,3000+1")])
    cases += _cases(fp8 + "-edges", [("fp8, edges: spec-verify k=3", "300+4,1200+4,12+4,60+4")])
    cases += _cases("gqa-h8/2-d128-bf16-fp8e4m3-p16-w256-edges", [("fp8, window edges: mixed", "0+300,700+64,255+1")])
    cases += _cases("gqa-h8/2-d128-bf16-fp8e4m3-kscale0.03-vscale7-p16", [("fp8, scales 0.03 and 7: decode", "100+1,2000+1"),
                                                                            ("fp8, scales 0.03 and 7: spec-verify k=3", "500+4,30+4")])
    cases += _cases("mla-h16-d512+64-bf16-fp8e4m3-p64", [("fp8 latent: decode", "1+1,63+1,64+1,700+1,2500+1"),
                                                         ("fp8 latent: spec-verify k=3", "64+4,900+4"),
                                                         ("fp8 latent: mixed", "0+100,500+40,2000+1x4")])
    return cases


QUICK_KV_ELEMENTS = 2_000_000  # 8 MB of float32 keys and values a case


def quick_suite() -> list[Case]:
    """The default on a CPU: the standard suite's cases of at most QUICK_KV_ELEMENTS key/value
    numbers, and each layer's smallest case where it has none that small (every layer, and so
    every kind, dtype and layer option, stays; the large batches, long contexts and chunked
    prefills, which a CPU spends most of a standard run on, are left to ``--suite standard``)."""
    cases = standard_suite()
    small = [case for case in cases if case.kv_elements <= QUICK_KV_ELEMENTS]
    layers = {format_layer(case.spec, case.layer_options) for case in small}
    for case in sorted(cases, key=lambda case: case.kv_elements):
        layer = format_layer(case.spec, case.layer_options)
        if layer not in layers:
            layers.add(layer)
            small.append(case)
    return [case for case in cases if case in small]


def standard_suite() -> list[Case]:
    """The default on a GPU: every kind of batch on the layers engines ship."""
    cases = _cases(LLAMA3_8B, _mha_batches(16, rich=True))
    cases += _cases(LLAMA3_8B + "-share4", [("prefix sharing", "64+1,100+4,200+1x2,70+8")])
    cases += _cases(LLAMA3_8B + "-linear", [("blocks in order", "1000+1,300+4")])
    cases += _cases("gqa-h32/8-d128-fp16-p32", _mha_batches(32, rich=False))
    cases += _cases("gqa-h16/4-d128-bf16-p64", _mha_batches(64, rich=False)[:4])
    cases += _cases("mha-h16/16-d64-fp16-p16", _mha_batches(16, rich=False)[:6])
    cases += _cases("gqa-h8/2-d256-bf16-p16", _mha_batches(16, rich=False)[:6])
    cases += _cases("gqa-h8/2-d128-fp32-p16", _mha_batches(16, rich=False)[:6])
    # Groups that are not a power of two (Qwen2.5-7B: 28 query heads over 4 KV heads) and wider
    # than a small tile (Qwen3-235B-A22B: 64 over 4): a padded or fixed-width group reads the wrong heads.
    cases += _cases("gqa-h28/4-d128-bf16-p16", [("group of 7: decode", "1+1,100+1,1000+1,3000+1"),
                                                ("group of 7: spec-verify k=3", "300+4,1200+4,63+4"),
                                                ("group of 7: mixed prefill + decode", "0+200,700+64,3000+1x2,50+4")])
    cases += _cases("gqa-h64/4-d128-bf16-p16", [("group of 16: decode", "1+1,1000+1,3000+1"),
                                                ("group of 16: spec-verify k=3", "300+4,1200+4")])
    cases += _cases("gqa-h8/2-d128-bf16-p16-w256", [("decode", "1000+1,200+1,255+1,256+1"), ("spec-verify k=3", "600+4,2000+4"), ("mixed prefill + decode", "0+300,700+64,3000+1")])
    cases += _cases("gqa-h8/2-d128-bf16-p16-cap30", [("decode", "1000+1,20+1"), ("spec-verify k=3", "600+4"), ("mixed prefill + decode", "0+200,500+1")])
    # Long contexts over activation-like values (a channel's mean, not 1/√n, is the output): an
    # accumulator kept in half precision across KV tiles is 19x the tolerance at 16k in bf16, 7x at
    # 32k in fp16 (tiles of 16; at 4k 1.7x: tests/conformance/checks/test_activations.py).
    cases += _cases(LLAMA3_8B, [("long context: decode and spec-verify", "16k+1,12k+4")])
    cases += _cases("gqa-h32/8-d128-fp16-p32", [("long context decode", "32k+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64", _mla_batches(64, rich=True))
    cases += _cases("mla-h128-d512+64-bf16-p64", _mla_batches(64, rich=False))
    cases += _cases("mla-h16-d512+64-fp16-p16", _mla_batches(16, rich=False)[:3])
    # Fewer heads than a 16-head tile (Kimi-K2's 64 heads at tensor parallel 8; DeepSeek-V3's 128
    # at 16): a tile's rows past the head count must be masked.
    cases += _cases("mla-h8-d512+64-bf16-p64", [("8 heads: decode", "1+1,700+1,2500+1"), ("8 heads: spec-verify k=3", "64+4,900+4")])
    # DeepSeek-V3's MLA prefill as vLLM and SGLang run it: ordinary attention over decompressed
    # keys, q/k 192 (128 + 64 rope), v 128, 128 heads over tensor parallel 8, its YaRN scale.
    cases += _cases("mha-h16-d192/128-bf16-p64-scale0.13524-lse", [("DeepSeek-V3 prefill: with context", "200+64,0+100"),
                                                              ("DeepSeek-V3 prefill: chunked, long context", "1024+256,0+300,4096+512")])
    return cases + _variant_cases() + _sink_cases() + _empty_request_cases()


def _empty_request_cases() -> list[Case]:
    """vLLM's graph padding, empty requests (0+0), run by the backends that claim that style: at
    the end of a batch as vLLM pads, and between real requests (``query_start_loc`` repeating
    mid-batch)."""
    cases = _cases(LLAMA3_8B, [("empty requests after decodes", "1+1,500+1,3000+1,0+0x5"),
                               ("empty requests between spec-verify and prefill", "0+0,300+4,0+0,0+200,1000+1")])
    cases += _cases("gqa-h64/8-d64-bf16-p16-attnsinks", [("learned sinks, empty requests", "100+1,1000+1,0+0x2")])
    cases += _cases("mla-h16-d512+64-bf16-p64", [("empty requests after decodes", "700+1,2500+1,0+0x3"),
                                                 ("empty request first", "0+0,64+4,900+4")])
    return cases


GPT_OSS = "gqa-h64/8-d64-bf16-p16"  # gpt-oss-20b/120b attention: 64 query heads over 8, head dim 64


def _sink_cases() -> list[Case]:
    """Learned attention sinks on gpt-oss's layer: every path, its alternate layers' window of 128
    (edges: the keys just outside the window dominate), and an fp8 cache."""
    cases = _cases(GPT_OSS + "-attnsinks", [("learned sinks: decode", "1+1,100+1,1000+1,3000+1"),
                                           ("learned sinks: spec-verify k=3", "11+4,300+4,1200+4"),
                                           ("learned sinks: mixed prefill + decode", "0+200,700+64,3000+1x2,50+4")])
    cases += _cases(GPT_OSS + "-w128-attnsinks-edges", [("learned sinks, window 128: decode", "1000+1,127+1,128+1,129+1"),
                                                       ("learned sinks, window 128: mixed", "0+300,700+64,255+1")])
    cases += _cases("gqa-h64/8-d64-bf16-fp8e4m3-p16-attnsinks", [("fp8, learned sinks: mixed", "0+100,500+4,2000+1")])
    # The log-sum-exp with a sink in it (its term belongs to the denominator a merge weighs by),
    # and MLA decode's (what decode-context parallelism merges).
    cases += _cases(GPT_OSS + "-attnsinks-lse", [("learned sinks, log-sum-exp: mixed", "0+64,300+4,1000+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64-lse", [("log-sum-exp: decode and verify", "700+1,64+4,2500+1")])
    return cases


def full_suite() -> list[Case]:
    """Standard plus long contexts (32k), batch 256 and more layer variants."""
    cases = standard_suite()
    cases += _cases(
        LLAMA3_8B,
        [
            ("long context decode", "32k+1x4,31k+1x4"),
            ("long context spec-verify", "32k+4x2,32760+8"),
            ("decode batch 256", "1000+1x128,3000+1x128"),
            ("long prefill with context", "16k+2048"),
        ],
    )
    cases += _cases("mla-h128-d512+64-bf16-p64", [("long context decode", "32k+1x4"), ("decode batch 256", "1000+1x256")])
    for layer in ("gqa-h32/8-d64-bf16-p16", "gqa-h32/8-d256-fp16-p64", "mha-h32/32-d128-bf16-p32", "gqa-h32/4-d128-fp16-p16-w1024-cap50"):
        cases += _cases(layer, _mha_batches(16, rich=False))
    cases += _cases(LLAMA3_8B + "-edges", [("edges: long context", "32k+1x2,32760+4")])
    cases += _cases(LLAMA3_8B + "-outliers-strided", [("large logits, strided: long context", "32k+4x2,16k+1")])
    cases += _cases("gqa-h32/4-d128-fp16-p16-w1024-edges", [("window edges: long context", "8k+1,5000+4,1023+1")])
    cases += _cases("mla-h128-d512+64-bf16-p64-edges", [("edges: decode", "63+1,64+1,2000+1x4"), ("edges: spec-verify k=3", "900+4x4")])
    return cases


BENCH_MAX_KV_TOKENS = 2 * 1024 * 1024  # batch x context beyond this is left out (host and GPU memory)


def bench_suite() -> list[Case]:
    """Shapes that matter for speed: decode and spec-verify (query 1, 2, 4, 8) at batch 1 / 8 / 64 /
    256 and context 512 / 4k / 32k (up to 2M cached tokens), GQA 32/8x128 and MLA 128 heads,
    plus a mixed prefill + decode batch."""
    cases = []
    for layer in (LLAMA3_8B, "mla-h128-d512+64-bf16-p64"):
        batches = []
        for query in (1, 2, 4, 8):
            for batch in (1, 8, 64, 256):
                for context in (512, 4096, 32768):
                    if batch * context <= BENCH_MAX_KV_TOKENS:
                        kind = "decode" if query == 1 else f"verify q={query}"
                        batches.append((f"{kind} b{batch} ctx{context}", f"{context}+{query}x{batch}"))
        cases += _cases(layer, batches)
    cases += _cases(LLAMA3_8B, [("mixed prefill + decode", "0+512,2000+1x32,4000+4x16")])
    # An fp8 cache beside bf16, for the backends that claim it: decode and spec-verify at batch 64.
    cases += _cases(LLAMA3_8B + "-fp8e4m3", [(f"fp8 cache: {kind} b64 ctx{context}", f"{context}+{query}x64")
                                             for kind, query in (("decode", 1), ("verify q=4", 4)) for context in (4096, 32768)
                                             if 64 * context <= BENCH_MAX_KV_TOKENS])
    return cases


SUITES = {"smoke": smoke_suite, "quick": quick_suite, "standard": standard_suite, "full": full_suite, "bench": bench_suite}


def suite(name: str) -> list[Case]:
    if name not in SUITES:
        raise CaseSyntaxError(f"unknown suite {name!r} (choose from {', '.join(SUITES)})")
    return SUITES[name]()
