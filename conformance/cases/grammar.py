"""Cases: a layer spec, a batch of (context_len, query_len) requests, and a seed.

A case's id is its whole definition, in the same compact grammar ``--case`` accepts:

    LAYER ":" BATCH ["@" SEED]

    LAYER  = KIND ("-" ATTR)*             KIND: gqa | mha | mla | indexer
      hQ/KV or hQ   query / KV heads; hQ alone is MHA (default h32/8; MLA: h16, one latent KV head;
                    indexer: h64 index heads over one index key)
      dN            head dim               (default d128; MLA: d512+64, latent + rope)
      dQK/V         query/key head dim QK, value and output head dim V (DeepSeek-V3's MLA
                    prefill as vLLM runs it: d192/128)
      fp16|bf16|fp32 dtype                 (default bf16)
      fp8e4m3|fp8e5m2 an fp8 KV cache with per-tensor scales (default: the cache in the dtype)
      fp8dsmla      DeepSeek's fp8_ds_mla cache (MLA): e4m3 latent, a float32 scale per 128 values
                    a token, written by write_kv, the rope part unquantized
      kscaleX vscaleX the fp8 cache's key and value scales (default 0.1 and 4; MLA: kscale only;
                    from 0.01 to 10000; kscale from 0.0001 in bf16 and fp32, where the
                    queries then reach past fp16's range)
      qfp8          an fp8 query: handed to forward in e4m3 with its per-tensor q_scale (0.05),
                    the oracle attending with it dequantized (vLLM's quantized query input)
      pN            KV block (page) size   (default p16; MLA default p64)
      wN            sliding window         (a token sees itself and the N-1 before it)
      topkN         sparse attention (MLA; DeepSeek's DSA): each token attends only to the N
                    positions its indexer chose, handed to forward as ``topk_indices``
      winN          a sparse layer's window part (DeepSeek-V4): the N most recent positions too;
                    an indexer's topkN is how many positions it chooses a token
      messyidx      index rows as a careless indexer could hand them: -1 between entries, entries
                    past the token's own position and past its sequence (all to be ignored)
      capX          logits soft cap        (from 0.000001 to 1000000; no exponents: 0.00001)
      scaleX        softmax scale          (default 1/sqrt(head dim); the same range)
      shareN        the first N blocks of every request are one shared prefix
      linear        blocks in order (default: physical blocks randomly permuted)
      strided       query, key and value are views into one fused QKV projection, the output a
                    view into a wider buffer, the block table a column slice of a wider table
                    (non-contiguous rows, as engines hand them over)
      padN          N padding rows (slot -1, query NaN or huge) after the real tokens (default 3; pad0: none)
      lse           forward is also handed an ``lse`` buffer: the step's log-sum-exp is checked
                    (run by a backend that claims returns_lse)
      dcpN          decode context parallelism over N simulated ranks (2 to 8): each request's KV
                    interleaved token by token (position p on rank p % N), every rank's forward
                    over its shard, the outputs merged by their log-sum-exps (decode batches)
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
    Q      = N | TREE
    TREE   = "tree(" K "x" D ")"           a spec-verify request's drafts as a token tree
                                           (EAGLE's top-k > 1): the root (the token the last
                                           step accepted) and K children of every token down to
                                           depth D, 1 + K + ... + K^D new tokens, breadth first
           | "tree[" P ("." P)* "]"        the tree by its parents: token i's parent among the
                                           new tokens, -1 for the context (``backends.token_tree``;
                                           tree[-1.0.1] is the chain 3)

Examples:
    4k+1x64                                 64 decodes over 4096 cached tokens (default layer)
    gqa-h32/8-d128-bf16-p16:4096+4x8        spec-verify, 1 + 3 drafts, batch 8
    mha-h16-d64-fp16-p32:1000+24,0+300,17+1 chunked prefill, prefill and a decode in one batch
    gqa-h8/2-d128-w256:2000+8@7             sliding window 256, seed 7
    mla-h16-d512+64-topk64-win32:2000+2x4   sparse MLA verify: 64 indexed positions + a 32 window
    indexer-h64-d128-fp8e4m3-topk2048:5000+1x4  DeepSeek-V3.2's lightning indexer, fp8 index keys
    mla-h128-d512+64-bf16-p64:4096+1x64     DeepSeek-style absorbed MLA decode
    gqa-h32/8-d128:3000+tree(4x2),500+1x3   a tree of 21 drafts (top-k 4, depth 2) beside decodes
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal

import torch

from backends import token_tree
from backends.base import DTYPE_NAMES, AttentionSpec, dtype_name, kv_dtype_name
from backends.features import Needs
from backends.fp8_ds_mla import DS_MLA_SCALE_BLOCK
from conformance.cases.kv_quantization import DEFAULT_K_SCALE, DEFAULT_Q_SCALE, DEFAULT_V_SCALE, FP8_DTYPES

DATA_PROFILES = ("normal", "outliers", "edges")
DEFAULT_PADDING_TOKENS = 3
MAX_PADDING_TOKENS = 1024
MAX_TOKENS_PER_REQUEST = 1 << 22  # 4M tokens: beyond any model's context, and beyond any device's memory here
MAX_REQUESTS = 1 << 16
MAX_SEED = 2**63 - 1
MIN_VALUE_DIM = 3  # a key or value row's channels the harness's data needs (probes, means)


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
    data: str = "normal"  # normal | outliers | edges (see conformance.harness.batch)
    padding: int = DEFAULT_PADDING_TOKENS  # rows with slot -1 after the step's real tokens
    big_pool: bool = False  # the pool past 2**31 elements a plane, owned blocks at its top (see batch)
    k_scale: float | None = None  # an fp8 cache's scales; None: the default (kv_quantization)
    v_scale: float | None = None
    lse: bool = False  # forward is also asked for the step's log-sum-exp (feature ``lse``)
    messy_indices: bool = False  # a sparse layer's index rows with -1 between entries and past-causal ones
    dcp: int = 1  # decode context parallelism: the ranks each request's KV is sharded over (1: none)
    # Token trees: per request its new tokens' parents (``backends.token_tree``), None for a
    # chain; () when no request has a tree.
    trees: tuple[tuple[int, ...] | None, ...] = ()
    tag: str = field(default="", compare=False)  # a human label ("decode"), not part of the id

    def __post_init__(self) -> None:
        if not self.batch:
            raise CaseSyntaxError("a batch needs at least one request")
        if len(self.batch) > MAX_REQUESTS:
            raise CaseSyntaxError(f"{len(self.batch)} requests: at most {MAX_REQUESTS} in one batch")
        for context_len, query_len in self.batch:
            if context_len < 0 or query_len < 0 or (query_len == 0 and context_len != 0):
                raise CaseSyntaxError(
                    f"request {context_len}+{query_len}: context must be >= 0 and query >= 1, "
                    "or 0+0 (an empty request: vLLM's graph padding)"
                )
            if context_len + query_len > MAX_TOKENS_PER_REQUEST:
                raise CaseSyntaxError(
                    f"request {context_len}+{query_len}: at most {MAX_TOKENS_PER_REQUEST} tokens per request"
                )
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
        if self.messy_indices and (self.spec.sparse_topk is None or not self.spec.layout.attends):
            raise CaseSyntaxError("messyidx is a sparse layer's index data: give topkN too")
        self._check_trees()
        self._check_dcp()
        if (self.k_scale is not None or self.v_scale is not None) and self.kv_scales is None:
            raise CaseSyntaxError(
                "this cache's fp8 scales are its own (write_kv computes them: an indexer's keys, fp8_ds_mla): "
                "no kscale or vscale"
            )
        if self.v_scale is not None and not self.spec.layout.separate_value:
            raise CaseSyntaxError("MLA's latent cache has one scale: give kscale, not vscale")
        if self.shared_prefix_blocks:
            needed = self.shared_prefix_blocks * self.spec.block_size
            if min(context for context, _ in self.batch) < needed:
                raise CaseSyntaxError(
                    f"share{self.shared_prefix_blocks} needs every context >= {needed} tokens "
                    f"({self.shared_prefix_blocks} blocks of {self.spec.block_size})"
                )

    def _check_dcp(self) -> None:
        if self.dcp == 1:
            return
        spec = self.spec
        if not 2 <= self.dcp <= MAX_DCP:
            raise CaseSyntaxError(f"dcp{self.dcp}: from 2 to {MAX_DCP} ranks")
        if any(query > 1 for _, query in self.batch) or self.trees:
            raise CaseSyntaxError(
                f"dcp{self.dcp}: decode batches only (query length 1; vLLM hands a backend without varlen DCP "
                "single-token rows)"
            )
        position_bound = spec.sliding_window is not None or spec.sparse_topk is not None
        if position_bound or spec.attention_sinks or not spec.layout.attends:
            raise CaseSyntaxError(
                f"dcp{self.dcp}: a dense attention layer without a window or learned sinks (a rank sees local "
                "positions; a sink would join every rank's denominator)"
            )

    def _check_trees(self) -> None:
        if self.trees and all(tree is None for tree in self.trees):  # only chains: the id says so
            object.__setattr__(self, "trees", ())
        if not self.trees:
            return
        if len(self.trees) != len(self.batch):
            raise CaseSyntaxError(f"{len(self.trees)} trees for {len(self.batch)} requests")
        if any(tree is not None for tree in self.trees) and (
            self.spec.sparse_topk is not None or not self.spec.layout.attends
        ):
            raise CaseSyntaxError("token trees are for dense attention layers (not sparse, not an indexer)")
        for (context, query), tree in zip(self.batch, self.trees):
            if tree is None:
                continue
            if len(tree) != query:
                raise CaseSyntaxError(f"a tree of {len(tree)} tokens on a request of {query} new ones")
            if not 1 <= len(tree) <= MAX_TREE_TOKENS:
                raise CaseSyntaxError(f"a tree of {len(tree)} tokens: from 1 to {MAX_TREE_TOKENS}")
            try:
                token_tree.depths(tree)
            except ValueError as error:
                raise CaseSyntaxError(f"tree[{'.'.join(map(str, tree))}]: {error}") from None

    @property
    def id(self) -> str:
        return format_case(self)

    @property
    def layer_options(self) -> LayerOptions:
        return LayerOptions(
            self.shared_prefix_blocks,
            self.permute_blocks,
            self.strided,
            self.data,
            self.padding,
            self.big_pool,
            self.k_scale,
            self.v_scale,
            self.lse,
            self.messy_indices,
            self.dcp,
        )

    @property
    def kv_scales(self) -> tuple[float, float] | None:
        """(k_scale, v_scale) of an fp8 cache (MLA: v_scale is k_scale, unused); None otherwise, and
        for a cache whose scales are its own, computed by ``write_kv`` (an indexer's keys, fp8_ds_mla)."""
        if not self.spec.fp8_kv_cache or not self.spec.layout.attends or self.spec.kv_scale_block is not None:
            return None  # no fp8 cache, or one whose scales are its own (an indexer's keys, fp8_ds_mla)
        k_scale = DEFAULT_K_SCALE if self.k_scale is None else self.k_scale
        return self.spec.layout.scales(k_scale, DEFAULT_V_SCALE if self.v_scale is None else self.v_scale)

    @property
    def q_scale(self) -> float | None:
        """An fp8 query's per-tensor scale (the layer's first: ``step.case_scales``); None otherwise."""
        return DEFAULT_Q_SCALE if self.spec.fp8_query else None

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
    def needs(self) -> Needs:
        """What this case asks of a backend (``backends.features``: the features its attributes ask for)."""
        query_lens = tuple(query for _, query in self.batch)
        tree_tokens = max(query_lens) if self.trees else 0  # every request of a tree step (``Needs``)
        # DCP merges the ranks' outputs by their log-sum-exps: its steps ask for the LSE too.
        return Needs(self.spec, query_lens, self.lse or self.dcp > 1, tree_tokens, self.dcp)

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
        row = self.spec.layout.cache_row(self.spec)
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
        hint = " (write it without an exponent: 0.00001, not 1e-05)" if text.lower().endswith("e") else ""
        raise CaseSyntaxError(f"{what} {text!r} is not a number{hint}") from None


# What the harness can draw data for, measured with torch_naive over every dtype, both fp8 formats
# and each data profile: past these the range runs out (the probe query grows as 1 / key scale,
# the stored values × a large value scale overflow). A key scale under 0.01 takes a compute dtype
# with bf16's range: its queries are then past fp16's (the point of such a case: a backend that
# rounds the query to fp16 for its fp8 products breaks).
FLOAT_RANGES = {
    "scale": (1e-6, 1e6),
    "soft cap": (1e-6, 1e6),
    "key scale": (0.0001, 10000.0),
    "value scale": (0.01, 10000.0),
}
# Where a compute dtype narrows a range: the queries grow as 1 / key scale, past fp16's range
# under 0.01.
DTYPE_RANGES = {torch.float16: {"key scale": (0.01, 10000.0)}}


def float_range(name: str, dtype: torch.dtype) -> tuple[float, float]:
    """The bounds of the number ``name`` in a layer of ``dtype`` (FLOAT_RANGES, narrowed by DTYPE_RANGES)."""
    return DTYPE_RANGES.get(dtype, {}).get(name, FLOAT_RANGES[name])


MAX_TREE_TOKENS = 512  # a tree's new tokens (EAGLE's trees are tens)
MAX_DCP = 8  # decode context parallel ranks (vLLM's DCP sizes: 2 to 8)


def parse_batch(text: str) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...] | None, ...]]:
    """(requests, trees): each request's (context, query) and its tree's parents (None: a chain);
    trees is () when no request has one."""
    requests: list[tuple[int, int]] = []
    trees: list[tuple[int, ...] | None] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+k?)\+(\d+k?|tree\(\d+x\d+\)|tree\[[-\d.]*\])(?:x(\d+))?\s*", item)
        if not match:
            raise CaseSyntaxError(f"batch item {item!r} is not CTX+Q[xN] (Q a count or a tree); {_GRAMMAR_HINT}")
        context = _number(match.group(1), "context length")
        tree = _parse_tree(match.group(2))
        query = _number(match.group(2), "query length") if tree is None else len(tree)
        count = _number(match.group(3), "repeat count") if match.group(3) else 1
        requests += [(context, query)] * count
        trees += [tree] * count
    return tuple(requests), (tuple(trees) if any(tree is not None for tree in trees) else ())


def _parse_tree(text: str) -> tuple[int, ...] | None:
    """A TREE's parents; None for a plain query count."""
    full = re.fullmatch(r"tree\((\d+)x(\d+)\)", text)
    if full:
        width, depth = int(full.group(1)), int(full.group(2))
        tokens, level = 1, 1
        for _ in range(depth if width >= 1 else 0):  # level by level, stopping once past the limit
            level *= width
            tokens += level
            if tokens > MAX_TREE_TOKENS:
                break
        if width < 1 or depth < 1 or tokens > MAX_TREE_TOKENS:
            raise CaseSyntaxError(f"{text}: K and D from 1, at most {MAX_TREE_TOKENS} tokens in a tree")
        return token_tree.full(width, depth)
    listed = re.fullmatch(r"tree\[(-?\d+(?:\.-?\d+)*)\]", text)
    if listed:
        parents = tuple(int(parent) for parent in listed.group(1).split("."))
        if len(parents) > MAX_TREE_TOKENS:
            raise CaseSyntaxError(f"{text}: at most {MAX_TREE_TOKENS} tokens in a tree")
        return parents
    if text.startswith("tree"):
        raise CaseSyntaxError(f"{text!r} is not tree(KxD) or tree[P.P...] (parents, -1 for the context)")
    return None


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
    messy_indices: bool = False
    dcp: int = 1


_ATTRIBUTE_KINDS = (
    (r"fp16|bf16|fp32", "dtype"),
    (r"fp8e4m3|fp8e5m2|fp8dsmla", "KV-cache dtype"),
    (r"qfp8", "query dtype"),
    (r"kscale.+", "key scale"),
    (r"vscale.+", "value scale"),
    (r"h\d+(/\d+)?", "heads"),
    (r"d\d+([+/]\d+)?", "head dim"),
    (r"p\d+", "block size"),
    (r"w\d+", "sliding window"),
    (r"topk\d+", "sparse top-k"),
    (r"win\d+", "sparse window part"),
    (r"cap.+", "soft cap"),
    (r"scale.+", "scale"),
    (r"share\d+", "shared prefix"),
    (r"pad\d+", "padding"),
    (r"dcp\d+", "DCP ranks"),
    (r"outliers|edges", "data profile"),
)


def _attribute_kind(attr: str) -> str:
    """What a layer attribute sets (two attributes setting one thing contradict each other)."""
    for pattern, kind in _ATTRIBUTE_KINDS:
        if re.fullmatch(pattern, attr):
            return kind
    return attr  # linear, strided, bigpool, or unknown (reported by the parser)


def parse_layer(text: str) -> tuple[AttentionSpec, LayerOptions]:
    kind_name, *attrs = text.split("-")
    if kind_name not in ("gqa", "mha", "mla", "indexer"):
        raise CaseSyntaxError(f"layer kind {kind_name!r} is not gqa, mha, mla or indexer; {_GRAMMAR_HINT}")
    is_mla, is_indexer = kind_name == "mla", kind_name == "indexer"
    num_heads, num_kv_heads = {"mla": (16, 1), "indexer": (64, 1)}.get(kind_name, (32, 8))
    head_dim, kv_lora_rank, rope_dim = 128, 512, 64
    dtype, block_size = torch.bfloat16, 64 if is_mla or is_indexer else 16
    window = cap = scale = kv_cache_dtype = k_scale = v_scale = query_dtype = None
    share, permute, strided, data, padding, big_pool = 0, True, False, "normal", DEFAULT_PADDING_TOKENS, False
    sinks = lse = messy = False
    dcp = 1
    topk = sparse_window = scale_block = None
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
        elif attr == "fp8dsmla":
            kv_cache_dtype, scale_block = FP8_DTYPES["e4m3"], DS_MLA_SCALE_BLOCK
        elif attr == "qfp8":
            if is_indexer:
                raise CaseSyntaxError(f"qfp8 in {text!r}: an fp8 query is an attention layer's (mha, gqa, mla)")
            query_dtype = FP8_DTYPES["e4m3"]
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
        elif attr == "messyidx":
            messy = True
        elif match := re.fullmatch(r"dcp(\d+)", attr):
            dcp = int(match.group(1))
            if not 2 <= dcp <= MAX_DCP:
                raise CaseSyntaxError(f"dcp{dcp} in {text!r}: from 2 to {MAX_DCP} ranks (no DCP: leave it out)")
        elif match := re.fullmatch(r"topk(\d+)", attr):
            topk = int(match.group(1))
        elif match := re.fullmatch(r"win(\d+)", attr):
            sparse_window = int(match.group(1))
        elif attr == "sinks":
            raise CaseSyntaxError(
                f"'sinks' is ambiguous in {text!r}: write 'outliers' for the large-logit data profile "
                "(its old name), 'attnsinks' for learned attention sinks (gpt-oss)"
            )
        elif attr in DATA_PROFILES[1:]:
            data = attr
        elif match := re.fullmatch(r"pad(\d+)", attr):
            padding = int(match.group(1))
        elif match := re.fullmatch(r"h(\d+)(?:/(\d+))?", attr):
            num_heads = int(match.group(1))
            if match.group(2):
                if is_mla or is_indexer:
                    one = "MLA has one latent KV head" if is_mla else "an indexer has one index key a token"
                    raise CaseSyntaxError(f"{one}: write hQ, not hQ/KV")
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
        raise CaseSyntaxError(
            f"mha has one KV head per query head, but {text!r} gives {num_heads}/{num_kv_heads}: "
            "write gqa for grouped heads"
        )
    if kind_name in ("gqa", "mha") and not kv_heads_given and (kind_name == "mha" or "heads" in given):
        num_kv_heads = num_heads  # mha, or hQ alone: one KV head per query head
    if window is not None and window < 1:
        raise CaseSyntaxError(f"w{window}: a sliding window holds at least 1 token")
    if is_indexer and topk is None:
        raise CaseSyntaxError(f"{text!r}: an indexer chooses topkN positions a token: give topkN")
    if topk is not None and not (is_mla or is_indexer):
        raise CaseSyntaxError(f"topk{topk} in {text!r}: sparse attention is an MLA layer's (DeepSeek's DSA)")
    if sparse_window is not None and topk is None:
        raise CaseSyntaxError(f"win{sparse_window} in {text!r}: a window part is a sparse layer's: give topkN too")
    if topk is not None and window is not None and is_mla:
        raise CaseSyntaxError(f"w{window} in {text!r}: a sparse layer's window is its window part: write win{window}")
    if messy and (topk is None or is_indexer):
        raise CaseSyntaxError(f"messyidx in {text!r}: index rows are a sparse MLA layer's data (mla-...-topkN)")
    for name, value in (("topk", topk), ("win", sparse_window)):
        if value is not None and value < 1:
            raise CaseSyntaxError(f"{name}{value}: at least 1 position")
    numbers = [("soft cap", cap), ("scale", scale)]
    if kv_cache_dtype is not None:  # without an fp8 cache the case refuses the scales themselves
        numbers += [("key scale", k_scale), ("value scale", v_scale)]
    for name, value in numbers:
        low, high = float_range(name, dtype)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            why = ""
            if (low, high) != FLOAT_RANGES[name]:
                dtype_name = next(key for key, value in DTYPE_NAMES.items() if value == dtype)
                widest = f"{_format_number(FLOAT_RANGES[name][0])} to {_format_number(FLOAT_RANGES[name][1])}"
                why = f" in {dtype_name}, whose range the data would run past (other dtypes: {widest})"
            raise CaseSyntaxError(
                f"{name} {_format_number(value) if math.isfinite(value) else value}: must be a finite number "
                f"from {_format_number(low)} to {_format_number(high)}{why}"
            )
    if not is_mla and num_kv_heads >= 1 and num_heads % num_kv_heads:
        raise CaseSyntaxError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if block_size < 1 or num_heads < 1 or num_kv_heads < 1:
        raise CaseSyntaxError("block size and head counts must be positive")
    # The harness's data holds its probes and means in a value's first three channels.
    dims = (
        {"latent dim": (kv_lora_rank, MIN_VALUE_DIM), "rope dim": (rope_dim, 1)}
        if is_mla
        else {
            "head dim": (head_dim, MIN_VALUE_DIM),
            "value head dim": (head_dim if value_head_dim is None else value_head_dim, MIN_VALUE_DIM),
        }
    )
    for name, (value, least) in dims.items():
        if value < least:
            raise CaseSyntaxError(f"{name} {value}: must be at least {least}")
    if value_head_dim == head_dim:
        value_head_dim = None  # d128/128 is d128
    if is_mla and sinks:
        raise CaseSyntaxError(
            f"attnsinks in {text!r}: learned attention sinks are an MHA/GQA layer's (gpt-oss), not MLA's"
        )
    # What each kind's spec is made of; every attribute that does not apply to it was refused
    # above, or is refused by its LayerKind.
    shape = {
        "mla": dict(
            num_kv_heads=1,
            head_dim=kv_lora_rank + rope_dim,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            kv_scale_block=scale_block,
        ),
        "indexer": dict(num_kv_heads=1, head_dim=head_dim, value_head_dim=value_head_dim),
    }.get(kind_name, dict(num_kv_heads=num_kv_heads, head_dim=head_dim, value_head_dim=value_head_dim))
    if scale_block is not None and not is_mla:
        raise CaseSyntaxError(f"fp8dsmla in {text!r}: DeepSeek's fp8_ds_mla is an MLA layer's cache")
    try:
        spec = AttentionSpec(
            kind="mha" if kind_name == "gqa" else kind_name,
            num_heads=num_heads,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            sliding_window=window,
            logits_soft_cap=cap,
            scale=scale,
            attention_sinks=sinks,
            sparse_topk=topk,
            sparse_window=sparse_window,
            query_dtype=query_dtype,
            **shape,
        )
    except ValueError as error:
        raise CaseSyntaxError(str(error)) from None
    return spec, LayerOptions(share, permute, strided, data, padding, big_pool, k_scale, v_scale, lse, messy, dcp)


def parse_case(text: str, default_seed: int = 0) -> Case:
    """Parse ``LAYER:BATCH[@SEED]``; a bare ``BATCH`` uses the default layer (Llama-3-8B GQA)."""
    text = text.strip()
    body, _, seed_text = text.partition("@")
    seed = _number(seed_text, "seed") if seed_text else default_seed
    layer_text, _, batch_text = body.rpartition(":")
    spec, options = parse_layer(layer_text or "gqa")
    batch, trees = parse_batch(batch_text)
    return Case(
        spec,
        batch,
        seed,
        options.shared_prefix_blocks,
        options.permute_blocks,
        options.strided,
        options.data,
        options.padding,
        options.big_pool,
        options.k_scale,
        options.v_scale,
        options.lse,
        options.messy_indices,
        options.dcp,
        trees,
    )


def _format_number(value: float) -> str:
    """The shortest digits that read back as exactly ``value``, without an exponent: a layer's
    attributes are split at "-", and 1e-05 would be cut in two."""
    text = format(Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_layer(spec: AttentionSpec, options: LayerOptions = LayerOptions()) -> str:
    if spec.kind == "mla":
        parts = ["mla", f"h{spec.num_heads}", f"d{spec.kv_lora_rank}+{spec.rope_dim}"]
    elif spec.kind == "indexer":
        parts = ["indexer", f"h{spec.num_heads}", f"d{spec.head_dim}"]
    else:
        kind = "mha" if spec.num_kv_heads == spec.num_heads else "gqa"
        value_dim = "" if spec.v_head_dim == spec.head_dim else f"/{spec.v_head_dim}"
        parts = [kind, f"h{spec.num_heads}/{spec.num_kv_heads}", f"d{spec.head_dim}{value_dim}"]
    parts.append(dtype_name(spec.dtype))
    if spec.kv_scale_block is not None:
        parts.append("fp8dsmla")
    elif spec.fp8_kv_cache:
        parts.append(kv_dtype_name(spec.kv_cache_dtype))
        parts += [
            f"{name}{_format_number(value)}"
            for name, value in (("kscale", options.k_scale), ("vscale", options.v_scale))
            if value is not None
        ]
    if spec.fp8_query:
        parts.append("qfp8")
    parts.append(f"p{spec.block_size}")
    if spec.sliding_window is not None:
        parts.append(f"w{spec.sliding_window}")
    if spec.sparse_topk is not None:
        parts.append(f"topk{spec.sparse_topk}")
    if spec.sparse_window is not None:
        parts.append(f"win{spec.sparse_window}")
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
    if options.dcp > 1:
        parts.append(f"dcp{options.dcp}")
    if options.messy_indices:
        parts.append("messyidx")
    if options.big_pool:
        parts.append("bigpool")
    return "-".join(parts)


def format_batch(batch: tuple[tuple[int, int], ...], trees: tuple[tuple[int, ...] | None, ...] = ()) -> str:
    items: list[str] = []
    requests = list(zip(batch, trees or (None,) * len(batch)))
    index = 0
    while index < len(requests):
        run = 1
        while index + run < len(requests) and requests[index + run] == requests[index]:
            run += 1
        (context, query), tree = requests[index]
        items.append(f"{context}+{query if tree is None else _format_tree(tree)}" + (f"x{run}" if run > 1 else ""))
        index += run
    return ",".join(items)


def _format_tree(parents: tuple[int, ...]) -> str:
    """tree(KxD) where the parents are that full tree, else tree[P.P...]."""
    width = sum(1 for parent in parents if parent == 0)
    depth = max(token_tree.depths(parents), default=0)
    if width and depth and parents == token_tree.full(width, depth):
        return f"tree({width}x{depth})"
    return "tree[" + ".".join(str(parent) for parent in parents) + "]"


def format_case(case: Case) -> str:
    layer = format_layer(case.spec, case.layer_options)
    return f"{layer}:{format_batch(case.batch, case.trees)}@{case.seed}"
