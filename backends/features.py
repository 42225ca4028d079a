"""The contract's features: what a case may ask of a backend beyond attention over a cache in its
compute dtype, one row each of one table (``FEATURES``).

A row says the feature's name (a backend claims it in ``Capabilities.features``, says why it does
not in ``Capabilities.not_claimed``; the results JSON and ``conformance list`` show the name), the
words a SKIP uses for it, and which cases ask for it (``asked``, read from the case's ``Needs``).
``Capabilities.skip_reason`` reads the table and nothing else, so a new feature is one row here,
the case attribute that asks for it (the case grammar) and what the oracle does with it; no check
names a feature to decide whether a case runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from backends.base import AttentionSpec


@dataclass(frozen=True)
class Needs:
    """What one case asks of a backend: its layer, the query lengths of its batch, and what its
    steps hand ``forward`` beyond the layer (an ``lse`` buffer)."""

    spec: "AttentionSpec"
    query_lens: tuple[int, ...] = ()
    lse: bool = False
    # A step with token trees (``backends.base``: "Token trees"): its longest request, each of them
    # a tree to a backend (a chain is one too), so the longest is what a tree kernel must hold; 0: no tree.
    tree_tokens: int = 0
    dcp: int = 1  # decode context parallelism: the ranks a step's KV is sharded over (1: none)

    @property
    def trees(self) -> bool:
        return self.tree_tokens > 0

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)


@dataclass(frozen=True)
class Feature:
    """One row of the table: a thing a case may ask that a backend claims or does not."""

    name: str
    words: Callable[[Needs], str]  # the feature as this case asks it, for "<words> not supported"
    asked: Callable[[Needs], bool]

    def __str__(self) -> str:
        return self.name


FEATURES: dict[str, Feature] = {}


def feature(name: str, words: str | Callable[[Needs], str], asked: Callable[[Needs], bool]) -> Feature:
    """Add a row to ``FEATURES`` (in the order a SKIP reason tells them) and return it."""
    if name in FEATURES:
        raise ValueError(f"feature {name!r} is already in the table")
    row = Feature(name, words if callable(words) else (lambda needs, text=words: text), asked)
    FEATURES[name] = row
    return row


def by_name(name: str) -> Feature:
    try:
        return FEATURES[name]
    except KeyError:
        raise ValueError(f"unknown feature {name!r} (known: {', '.join(FEATURES)})") from None


FP8_E4M3 = feature(
    "fp8_e4m3_kv_cache",
    "KV cache fp8e4m3",
    # per-tensor scales; DeepSeek's fp8_ds_mla (e4m3 too, its scales its own) is a row of its own
    lambda needs: needs.spec.kv_cache_dtype == torch.float8_e4m3fn and needs.spec.kv_scale_block is None,
)
FP8_E5M2 = feature(
    "fp8_e5m2_kv_cache", "KV cache fp8e5m2", lambda needs: needs.spec.kv_cache_dtype == torch.float8_e5m2
)
FP8_KV_CACHES = frozenset({FP8_E4M3, FP8_E5M2})
FP8_DS_MLA = feature(
    "fp8_ds_mla_kv_cache",
    "DeepSeek's fp8_ds_mla KV cache (e4m3 latent, a float32 scale per 128 values a token, the rope part unquantized)",
    lambda needs: needs.spec.kv_scale_block is not None,
)
SLIDING_WINDOW = feature("sliding_window", "sliding window", lambda needs: needs.spec.sliding_window is not None)
LOGITS_SOFT_CAP = feature("logits_soft_cap", "logits soft cap", lambda needs: needs.spec.logits_soft_cap is not None)
VALUE_HEAD_DIM = feature(
    "value_head_dim",
    lambda needs: (
        f"a value head dim ({needs.spec.value_head_dim}) other than the query/key head dim ({needs.spec.head_dim})"
    ),
    lambda needs: needs.spec.value_head_dim not in (None, needs.spec.head_dim),
)
ATTENTION_SINKS = feature("attention_sinks", "learned attention sinks", lambda needs: needs.spec.attention_sinks)
LSE = feature("lse", "the log-sum-exp (the case hands forward an lse buffer)", lambda needs: needs.lse)
SPARSE_TOPK = feature(
    "sparse_topk",
    lambda needs: f"sparse attention over {needs.spec.sparse_topk} indexed positions a token (DeepSeek's DSA)",
    lambda needs: needs.spec.sparse_topk is not None and needs.spec.layout.attends,
)
SPARSE_WINDOW = feature(
    "sparse_window",
    lambda needs: f"a sparse layer's window part ({needs.spec.sparse_window} most recent positions, DeepSeek-V4's)",
    lambda needs: needs.spec.sparse_window is not None,
)
DCP = feature(
    "dcp",
    lambda needs: (
        f"decode context parallelism over {needs.dcp} ranks (a rank's shard of each request's KV; a row with no "
        "key on it gives output 0 and LSE -inf)"
    ),
    lambda needs: needs.dcp > 1,
)
FP8_QUERY = feature(
    "fp8_query",
    "an fp8 query (e4m3, its per-tensor q_scale: vLLM's quantized query input)",
    lambda needs: needs.spec.fp8_query,
)
EMPTY_REQUESTS = feature(
    "empty_requests",
    "empty requests (query length 0, vLLM's graph padding)",
    lambda needs: 0 in needs.query_lens,
)
TOKEN_TREES = feature(
    "token_trees",
    "token trees (a verify request's drafts as a tree: each token sees its ancestors, not its siblings)",
    lambda needs: needs.trees,
)
