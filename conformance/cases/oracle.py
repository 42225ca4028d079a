"""The float64 oracle: attention for one request, written for obviousness.

It shares no code with any backend (it never sees a paged cache, a block table or a slot), so a
bug cannot hide in both. Every backend's output is compared with this.
"""

from __future__ import annotations

import torch

from backends import token_tree

# Queries are processed in chunks so that the float64 logits of all heads, [H, q, s], stay under
# this many elements (256 MiB) however long the request.
_LOGITS_ELEMENTS = 1 << 25


def visible_keys(
    context_len: int,
    queries: range,
    seq_len: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[len(queries), seq_len] bool: which keys the request's new tokens ``queries`` (indices
    among its new tokens) see: causal, and within the window."""
    query_positions = context_len + torch.arange(queries.start, queries.stop, device=device)
    distance = query_positions[:, None] - torch.arange(seq_len, device=device)[None, :]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    return allowed


def indexed_keys(
    topk_indices: torch.Tensor, context_len: int, seq_len: int, sparse_window: int | None = None
) -> torch.Tensor:
    """[q, seq_len] bool: which keys a sparse layer's new tokens see (``backends.base``): the
    positions their index rows list, up to their own (an entry past it, -1, or past the sequence
    is no key), and with a window part W the W most recent positions too."""
    num_queries = topk_indices.shape[0]
    query_positions = context_len + torch.arange(num_queries, device=topk_indices.device)
    rows = topk_indices.long()
    listed = (rows >= 0) & (rows <= query_positions[:, None])
    seen = torch.zeros(num_queries, seq_len + 1, dtype=torch.bool, device=topk_indices.device)
    seen.scatter_(1, torch.where(listed, rows, seq_len), True)  # unlisted entries land in a spare column
    seen = seen[:, :seq_len]
    if sparse_window is not None:
        distance = query_positions[:, None] - torch.arange(seq_len, device=topk_indices.device)[None, :]
        seen |= (distance >= 0) & (distance < sparse_window)
    return seen


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    sparse_window: int | None = None,
    tree_steps: tuple[tuple[int, ...], ...] | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one request's new tokens over its whole sequence, in float64.

    query [q, H, Dk]: the request's q new tokens, at positions context_len .. context_len + q - 1.
    key [s, Hkv, Dk], value [s, Hkv, Dv]: every token of the request, s = context_len + q.
    Query head h reads KV head h // (H / Hkv). A token sees position j when j <= its own
    position and, with a sliding window W, when its position - j < W. ``sinks`` [H] (learned
    attention sinks): query head h's softmax denominator gains exp(sinks[h]), its numerator nothing.
    ``topk_indices`` [q, topk] (a sparse layer): each token sees only the keys ``indexed_keys``
    says (its listed positions up to its own, and the ``sparse_window`` most recent). ``tree_steps``
    (token trees, ``backends.token_tree.visible_in_steps``): the new tokens as steps, each a tree by
    its parents; a token sees the keys before its step and its ancestors and itself, at positions
    its step's start + depth (one step's tree: a verify's; a chain is today's causal rule).
    Returns [q, H, Dv] float64; with ``return_lse``, also [q, H] float64: the natural log of each
    softmax's denominator, log Σ_j exp(s_j) (+ exp(sink)), over the scaled, capped, masked logits.
    """
    num_queries, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = key.shape
    if seq_len != context_len + num_queries:
        raise ValueError(f"key has {seq_len} rows; expected context {context_len} + {num_queries} queries")
    group_size = num_heads // num_kv_heads
    # Heads as a batch dimension: query [Hkv, group, q, Dk], key [Hkv, s, Dk], value [Hkv, s, Dv].
    # (One matmul per KV head group rather than a Python loop over heads: an MLA layer has 128.)
    query = query.double().reshape(num_queries, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
    key = key.double().permute(1, 0, 2)
    value = value.double().permute(1, 0, 2)
    out = torch.empty(num_kv_heads, group_size, num_queries, value.shape[-1], dtype=torch.float64, device=query.device)
    lse = torch.empty(num_kv_heads, group_size, num_queries, dtype=torch.float64, device=query.device)

    sparse = (
        None
        if topk_indices is None
        else indexed_keys(topk_indices.to(query.device), context_len, seq_len, sparse_window)
    )
    chunk_len = max(1, _LOGITS_ELEMENTS // (num_heads * max(seq_len, 1)))  # seq_len 0: an empty request
    trees = (
        None
        if tree_steps is None
        else token_tree.visible_in_steps(tree_steps, context_len, sliding_window, query.device)
    )
    for chunk_start in range(0, num_queries, chunk_len):
        chunk = slice(chunk_start, min(chunk_start + chunk_len, num_queries))
        if tree_steps is None:
            allowed = visible_keys(context_len, range(chunk.start, chunk.stop), seq_len, sliding_window, query.device)
        else:
            allowed = trees[chunk]
        if sparse is not None:
            allowed &= sparse[chunk]
        rows = query[:, :, chunk, :].reshape(num_kv_heads, -1, head_dim)  # [Hkv, group * q, Dk]
        logits = (rows @ key.transpose(1, 2)).view(num_kv_heads, group_size, -1, seq_len) * scale
        if logits_soft_cap is not None:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        logits = logits.masked_fill(~allowed, float("-inf"))
        top = logits.max(dim=-1, keepdim=True).values
        if sinks is not None:
            sink = sinks.double().view(num_kv_heads, group_size, 1, 1)
            top = torch.maximum(top, sink)
        weights = torch.exp(logits - top)
        denominator = weights.sum(dim=-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + torch.exp(sink - top)
        weights = weights / denominator
        out[:, :, chunk, :] = (weights.view(num_kv_heads, -1, seq_len) @ value).view(
            num_kv_heads, group_size, -1, value.shape[-1]
        )
        lse[:, :, chunk] = (top + denominator.log()).squeeze(-1)
    out = out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, value.shape[-1])
    return (out, lse.permute(2, 0, 1).reshape(num_queries, num_heads)) if return_lse else out


def mla_reference(
    query: torch.Tensor,
    latent: torch.Tensor,
    *,
    kv_lora_rank: int,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA for one request: every head attends over one shared latent entry per token.

    query [q, H, kv_lora_rank + rope_dim]; latent [s, kv_lora_rank + rope_dim]. Scores use the
    whole entry (latent part and rope part); values are the latent part alone. The window and the
    cap act on those scores as on any other attention's.
    Returns [q, H, kv_lora_rank] float64.
    """
    return attention_reference(
        query,
        latent[:, None, :],
        latent[:, None, :kv_lora_rank],
        context_len=context_len,
        scale=scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        return_lse=return_lse,
    )


def layer_reference(
    spec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    *,
    context_len: int,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
    tree_steps: tuple[tuple[int, ...], ...] | None = None,
    return_lse: bool = False,
    **options,
):
    """The oracle for one request of a layer of ``spec`` (an ``AttentionSpec``): absorbed MLA, or
    MHA/GQA with the layer's window, cap and ``sinks``; a sparse layer's tokens over the keys of
    their ``topk_indices`` rows; token trees' over their ancestors (``tree_steps``). ``options``
    (scale, sliding_window, logits_soft_cap, sparse_window) override the layer's: a parameter
    dropped or mis-applied."""
    options = {
        "scale": spec.softmax_scale,
        "sliding_window": spec.sliding_window,
        "logits_soft_cap": spec.logits_soft_cap,
        "sparse_window": spec.sparse_window,
        **options,
    }
    if not spec.layout.attends:  # an indexer: its answer is a choice of positions, it has no LSE
        reference = index_reference(query, key, index_weights, context_len=context_len)
        return (reference, None) if return_lse else reference
    if spec.sparse_topk is not None and topk_indices is None:
        raise ValueError("a sparse layer's oracle needs the request's index rows (topk_indices)")
    layout = spec.layout  # MLA: one latent head, its latent part the value (``LayerKind``)
    return attention_reference(
        query,
        layout.key_heads(key),
        layout.value_heads(spec, key, value),
        context_len=context_len,
        sinks=sinks,
        topk_indices=topk_indices,
        tree_steps=tree_steps,
        return_lse=return_lse,
        **options,
    )


INDEX_RTOL = 2.0**-8  # bf16's unit roundoff: an indexer's logits are judged to this (``harness.index_choice``)


def index_tolerance(query: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[q] float64: each token's logit tolerance, ``2^-8 · max_s Σ_h |w_h| · |q_h · k_s|`` (what
    rounding each head's score to bf16 once can move a logit: ``harness.index_choice``).
    query [q, H, D], keys [s, D], weights [q, H]."""
    if not keys.numel():
        return torch.zeros(query.shape[0], dtype=torch.float64)
    scores = torch.einsum("qhd,sd->qhs", query.double(), keys.double().to(query.device)).abs()
    return INDEX_RTOL * torch.einsum("qh,qhs->qs", weights.double().abs(), scores).amax(dim=1).cpu()


def index_reference(query: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, *, context_len: int):
    """An indexer's answer for one request's new tokens, as every check but ``indexer`` (which
    asks about the stored keys first, and names a wrong choice in words) holds a choice against it
    (``harness.answers``): float64 ``[q, s]``, the logits (``index_logits``) over ``keys`` (an fp8
    cache's as the backend stored them, dequantized: ``stored_cache``), in units of each token's
    tolerance (``index_tolerance``); -inf past each token's own position."""
    tolerance = index_tolerance(query, keys, weights).clamp(min=1e-300).to(query.device)
    return index_logits(query, keys, weights, context_len=context_len) / tolerance[:, None]


def index_logits(query: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, *, context_len: int) -> torch.Tensor:
    """An indexer's logits for one request's new tokens, in float64: ``[q, s]``, token i (at
    position context_len + i) over position j, ``Σ_h weights[i, h] · max(0, query[i, h] · keys[j])``,
    -inf past the token's own position. query [q, H, D], keys [s, D] (dequantized), weights [q, H]."""
    scores = torch.einsum("qhd,sd->qhs", query.double(), keys.double()).clamp(min=0)
    logits = torch.einsum("qh,qhs->qs", weights.double(), scores)
    seen = visible_keys(context_len, range(query.shape[0]), keys.shape[0], device=query.device)
    return logits.masked_fill(~seen, float("-inf"))
