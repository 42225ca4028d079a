"""The float64 oracle: attention for one request, written for obviousness.

It shares no code with any backend (it never sees a paged cache, a block table or a slot), so a
bug cannot hide in both. Every backend's output is compared with this.
"""
from __future__ import annotations

import torch

# Queries are processed in chunks so a long prefill does not build a [q, s] float64 matrix per
# head all at once.
_QUERY_CHUNK = 512


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one request's new tokens over its whole sequence, in float64.

    query [q, H, Dk]: the request's q new tokens, at positions context_len .. context_len + q - 1.
    key [s, Hkv, Dk], value [s, Hkv, Dv]: every token of the request, s = context_len + q.
    Query head h reads KV head h // (H / Hkv). A token sees position j when j <= its own
    position and, with a sliding window W, when its position - j < W.
    Returns [q, H, Dv] float64.
    """
    num_queries, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    if seq_len != context_len + num_queries:
        raise ValueError(f"key has {seq_len} rows; expected context {context_len} + {num_queries} queries")
    group_size = num_heads // num_kv_heads
    query, key, value = query.double(), key.double(), value.double()
    out = torch.empty(num_queries, num_heads, value.shape[-1], dtype=torch.float64, device=query.device)

    key_positions = torch.arange(seq_len, device=query.device)
    for chunk_start in range(0, num_queries, _QUERY_CHUNK):
        chunk = slice(chunk_start, min(chunk_start + _QUERY_CHUNK, num_queries))
        query_positions = context_len + torch.arange(chunk.start, chunk.stop, device=query.device)
        distance = query_positions[:, None] - key_positions[None, :]  # [q, s]
        allowed = distance >= 0
        if sliding_window is not None:
            allowed &= distance < sliding_window
        for head in range(num_heads):
            kv_head = head // group_size
            logits = (query[chunk, head, :] @ key[:, kv_head, :].T) * scale  # [q, s]
            if logits_soft_cap is not None:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            logits = logits.masked_fill(~allowed, float("-inf"))
            weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[chunk, head, :] = weights @ value[:, kv_head, :]
    return out


def mla_reference(
    query: torch.Tensor,
    latent: torch.Tensor,
    *,
    kv_lora_rank: int,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA for one request: every head attends over one shared latent entry per token.

    query [q, H, kv_lora_rank + rope_dim]; latent [s, kv_lora_rank + rope_dim]. Scores use the
    whole entry (latent part and rope part); values are the latent part alone.
    Returns [q, H, kv_lora_rank] float64.
    """
    return attention_reference(
        query,
        latent[:, None, :],
        latent[:, None, :kv_lora_rank],
        context_len=context_len,
        scale=scale,
    )
