"""The fp8 KV cache's two conversions as plain PyTorch (the contract in ``base.py``): what
``write_kv`` stores and what ``forward`` attends over. The readable way, for torch_naive and for
checking a kernel; the harness's own quantizer (``conformance/cases/kv_quantization.py``) is
written apart from this one, so a mistake here cannot hide in both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backends.base import Fp8Scales


def to_cache(rows: torch.Tensor, scale: float | torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``rows / scale`` saturated to the format's largest finite number and rounded to nearest even
    (PyTorch's conversion rounds to nearest even; the clamp keeps e5m2 from overflowing to inf).
    ``scale``: the host float, or the 1-element device tensor (nothing read on the host)."""
    limit = torch.finfo(cache_dtype).max
    return (rows.float() / scale).clamp(-limit, limit).to(cache_dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """The number a stored element stands for, in float32."""
    return stored.float() * scale


def required(scales: "Fp8Scales | None") -> "Fp8Scales":
    """An fp8 layer's scales, or a clear error for a caller that left them out."""
    if scales is None:
        raise ValueError("an fp8 KV cache or query needs the layer's scales (``layer.scales`` of write_kv and forward)")
    return scales


def scale_tensors(spec, scales: "Fp8Scales | None") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's (k, v) 1-element device scales for a kernel that reads them on the device;
    (None, None) for a cache in the compute dtype."""
    if not spec.fp8_kv_cache:
        return None, None
    scales = required(scales)
    return scales.k_scale_tensor, scales.v_scale_tensor


def scale_floats(spec, scales: "Fp8Scales | None") -> tuple[float, float]:
    """A layer's (k, v) host scales for a kernel that takes them as arguments (vLLM's
    ``_k_scale_float``: fixed per layer, so a graph may bake them); (1, 1) without fp8."""
    if not spec.fp8_kv_cache:
        return 1.0, 1.0
    scales = required(scales)
    return scales.k_scale, scales.v_scale


def query_values(spec, query: torch.Tensor, scales: "Fp8Scales | None") -> torch.Tensor:
    """The query ``forward`` attends with: an fp8 query dequantized (``stored × q_scale``, the
    device scale: nothing read on the host) into the compute dtype's float32; else as handed."""
    if not spec.fp8_query:
        return query
    return query.float() * required(scales).q_scale_tensor


def token_scales(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Each row's own scale (an indexer's keys, DeepSeek's ue8m0 scales): the smallest power of two
    at least ``max|row| / largest``, float32 ``[n]``; 1 for a row of zeros."""
    largest = torch.finfo(cache_dtype).max
    amax = rows.float().abs().amax(dim=-1)
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / largest))), torch.ones_like(amax))
