"""The oracle against a hand-written formula and against torch SDPA, on tiny inputs."""

import math

import pytest
import torch

from conformance.cases.oracle import attention_reference, mla_reference


def handwritten(query, key, value, context_len, scale, window=None, cap=None):
    """Plain Python loops over floats: the formula, nothing else."""
    num_queries, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_queries, num_heads, value.shape[-1], dtype=torch.float64)
    for i in range(num_queries):
        position = context_len + i
        for h in range(num_heads):
            kv = h // group
            logits = {}
            for j in range(seq_len):
                if j > position or (window is not None and position - j >= window):
                    continue
                s = sum(float(query[i, h, d]) * float(key[j, kv, d]) for d in range(query.shape[-1])) * scale
                logits[j] = cap * math.tanh(s / cap) if cap is not None else s
            top = max(logits.values())
            weights = {j: math.exp(s - top) for j, s in logits.items()}
            total = sum(weights.values())
            for j, w in weights.items():
                out[i, h] += (w / total) * value[j, kv].double()
    return out


@pytest.mark.parametrize(
    "context_len,num_queries,num_heads,num_kv_heads,window,cap",
    [
        (0, 1, 2, 2, None, None),
        (5, 3, 4, 2, None, None),
        (0, 6, 4, 1, None, None),
        (7, 2, 2, 1, 4, None),
        (3, 4, 2, 2, None, 1.5),
        (6, 3, 4, 2, 3, 2.0),
    ],
)
def test_matches_handwritten_formula(context_len, num_queries, num_heads, num_kv_heads, window, cap):
    generator = torch.Generator().manual_seed(context_len * 31 + num_queries)
    seq_len = context_len + num_queries
    query = torch.randn(num_queries, num_heads, 5, generator=generator)
    key = torch.randn(seq_len, num_kv_heads, 5, generator=generator)
    value = torch.randn(seq_len, num_kv_heads, 3, generator=generator)
    got = attention_reference(
        query, key, value, context_len=context_len, scale=0.7, sliding_window=window, logits_soft_cap=cap
    )
    expected = handwritten(query, key, value, context_len, 0.7, window, cap)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_matches_torch_sdpa_with_context():
    generator = torch.Generator().manual_seed(0)
    context_len, num_queries, heads, dim = 9, 4, 4, 8
    seq_len = context_len + num_queries
    query = torch.randn(num_queries, heads, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(seq_len, heads, dim, generator=generator, dtype=torch.float64)
    value = torch.randn(seq_len, heads, dim, generator=generator, dtype=torch.float64)
    mask = torch.arange(seq_len)[None, :] <= (context_len + torch.arange(num_queries))[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    got = attention_reference(query, key, value, context_len=context_len, scale=1 / math.sqrt(dim))
    torch.testing.assert_close(got, expected)


def test_matches_torch_sdpa_gqa_prefill():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(7, 8, 16, generator=generator, dtype=torch.float64)
    key = torch.randn(7, 2, 16, generator=generator, dtype=torch.float64)
    value = torch.randn(7, 2, 16, generator=generator, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.repeat_interleave(4, 1).transpose(0, 1),
        value.repeat_interleave(4, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(attention_reference(query, key, value, context_len=0, scale=0.25), expected)


def test_mla_is_attention_over_the_latent():
    generator = torch.Generator().manual_seed(2)
    rank, rope, heads, context_len, num_queries = 6, 2, 3, 4, 2
    query = torch.randn(num_queries, heads, rank + rope, generator=generator)
    latent = torch.randn(context_len + num_queries, rank + rope, generator=generator)
    got = mla_reference(query, latent, kv_lora_rank=rank, context_len=context_len, scale=0.3)
    expected = handwritten(query, latent[:, None, :], latent[:, None, :rank], context_len, 0.3)
    assert got.shape == (num_queries, heads, rank)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rejects_inconsistent_lengths():
    with pytest.raises(ValueError):
        attention_reference(torch.zeros(2, 1, 4), torch.zeros(5, 1, 4), torch.zeros(5, 1, 4), context_len=2, scale=1.0)
