"""The fp8 KV cache's two conversions as plain PyTorch (the contract in ``base.py``): what
``write_kv`` stores and what ``forward`` attends over. The readable way, for torch_naive and for
checking a kernel; the harness's own quantizer (``conformance/inputs/kv_quantization.py``) is
written apart from this one, so a mistake here cannot hide in both.
"""
from __future__ import annotations

import torch


def to_cache(rows: torch.Tensor, scale: float | torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``rows / scale`` saturated to the format's largest finite number and rounded to nearest even
    (PyTorch's conversion rounds to nearest even; the clamp keeps e5m2 from overflowing to inf).
    ``scale``: the host float, or the 1-element device tensor (nothing read on the host)."""
    limit = torch.finfo(cache_dtype).max
    return (rows.float() / scale).clamp(-limit, limit).to(cache_dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """The number a stored element stands for, in float32."""
    return stored.float() * scale
