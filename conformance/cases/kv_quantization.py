"""The fp8 KV cache as the contract defines it, and the two questions asked of a backend's.

``write_kv`` stores ``value / scale`` rounded to the nearest fp8 number (ties to even), saturated
to the format's largest finite magnitude (448 for e4m3, 57344 for e5m2), as vLLM's cache writers
do; ``forward`` computes the attention of the dequantized cache (``stored × scale``). So a
backend is asked two separate things, each with its own evidence:

(a) **what ``write_kv`` stored**: the cache bytes against this module's ``quantize``. A vendor may
    legitimately round a value that lies on a rounding boundary the other way (it multiplies by
    ``1 / scale`` in fp32 instead of dividing, say), so a stored number one step (one *ulp* of the
    format) from ours is allowed on at most ``ONE_ULP_FRACTION`` of the elements; two steps
    anywhere, or one step on more elements (truncation instead of rounding moves about half of
    them), is a failure naming slot, head and channel.
(b) **what ``forward`` computed from it**: the float64 attention of the backend's *own* stored
    cache, read back through ``read_kv`` and dequantized, so a rounding allowed in (a) does not
    compound into (b). The cache is then exact (an fp8 number times a scale is exact in float64)
    and the tolerances are the output dtype's, as for any other case: a kernel's only error is
    its arithmetic in the compute dtype (dequantized keys and values rounded to bf16 or fp16 by
    at most half an ulp of that dtype, well inside its tolerance).
"""

from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ONE_ULP_FRACTION = 0.01  # of the stored elements: rounding-boundary cases, not a rounding rule
DEFAULT_K_SCALE = 0.1  # far from 1 and not a power of two: a dropped, swapped or doubled scale
DEFAULT_V_SCALE = 4.0  # moves scores or outputs by an order of magnitude
DEFAULT_Q_SCALE = 0.05  # an fp8 query's (``qfp8``): a dropped one moves every score 20-fold


def is_fp8(dtype: torch.dtype | None) -> bool:
    return dtype in FP8_DTYPES.values()


def fp8_name(dtype: torch.dtype) -> str:
    return next(name for name, value in FP8_DTYPES.items() if value == dtype)


def largest(dtype: torch.dtype) -> float:
    """The format's largest finite magnitude: where ``quantize`` saturates."""
    return float(torch.finfo(dtype).max)


def quantize(values: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The contract's stored form of ``values``: ``values / scale`` in float64, saturated, rounded
    to the nearest ``dtype`` number (ties to even). NaN stays NaN. ``scale``: one float, or a tensor
    that broadcasts against ``values`` (a scale a row)."""
    limit = largest(dtype)
    scaled = (values.double() / scale).clamp(-limit, limit)
    # Through float32 (torch casts to fp8 from it): that can round differently from the float64
    # value only within float32's precision of a midpoint between two fp8 numbers, one of the
    # boundary cases (a) allows.
    return scaled.float().to(dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What ``forward`` must attend over: float64, exact."""
    return stored.double() * scale


def ordinal(stored: torch.Tensor) -> torch.Tensor:
    """Each fp8 number's position on the number line (int64): neighbouring numbers differ by 1,
    +0 and -0 are both 0; NaN gets a position no number has."""
    bits = stored.view(torch.uint8).long()
    magnitude = bits & 0x7F
    position = torch.where(bits >= 0x80, -magnitude, magnitude)
    nan = torch.isnan(stored.float())
    return torch.where(nan, torch.full_like(position, 1 << 20), position)


def ulps_apart(stored: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many fp8 numbers lie between each stored element and the contract's (0: equal)."""
    return (ordinal(stored) - ordinal(expected)).abs()


def token_scales(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An indexer's fp8 keys' scales as the contract defines them: per token, the smallest power of
    two at least ``max|key| / largest`` (DeepSeek's ue8m0), float64 ``[n]``; 1 for a zero row. By
    ``frexp``, apart from the backends' ``log2``: ``x = m · 2^e`` with ``0.5 <= m < 1`` needs
    ``2^e``, or ``2^(e-1)`` when ``m`` is exactly one half."""
    needed = keys.double().abs().amax(dim=-1) / largest(dtype)
    mantissa, exponent = torch.frexp(needed)
    power = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.where(needed > 0, torch.ldexp(torch.ones_like(needed), power), torch.ones_like(needed))


def block_scales(latent: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's fp8_ds_mla scales as the contract defines them: for each token and each block of
    ``block`` latent values, ``max(max|x| / largest, FLT_MIN)`` in float32 (vLLM's writer), float32
    ``[n, L / block]``."""
    amax = latent.float().reshape(latent.shape[0], -1, block).abs().amax(dim=-1)
    # A tensor divisor: CUDA would multiply by the reciprocal of a Python number (``fp8_ds_mla``).
    return (amax / torch.full_like(amax, largest(dtype))).clamp(min=torch.finfo(torch.float32).tiny)


def block_quantize(latent: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored ``[n, L]`` in ``dtype``, scales ``[n, L / block]``): each block over its own scale,
    rounded to nearest even (``quantize``'s rule, element by element)."""
    scales = block_scales(latent, block, dtype)
    blocks = latent.reshape(latent.shape[0], -1, block)
    return quantize(blocks, scales.double()[..., None], dtype).reshape(latent.shape), scales
