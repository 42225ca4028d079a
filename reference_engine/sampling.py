"""Sampling parameters and target probabilities: temperature, top-k, top-p, per-request seeds.

Everything stays on the device: a request's seed drives its own generator, and greedy requests
(temperature 0) take the argmax, so no host value is ever read back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 32
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering. logits [..., V]."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probabilities = logits.softmax(dim=-1)
    if top_p < 1.0:
        sorted_probabilities, order = probabilities.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities >= top_p
        sorted_probabilities = sorted_probabilities.masked_fill(drop, 0.0)
        probabilities = torch.zeros_like(probabilities).scatter(-1, order, sorted_probabilities)
        probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
    return probabilities


def sample(probabilities: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row by the Gumbel-max trick: argmax(log p - log(-log u)), no host sync."""
    return gumbel_argmax(
        probabilities, torch.rand(probabilities.shape, generator=generator, device=probabilities.device)
    )


def gumbel_argmax(probabilities: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``sample`` with its uniforms given: a token per row of ``probabilities`` [..., V]."""
    log_probabilities = torch.where(probabilities > 0, probabilities.log(), float("-inf"))
    return (log_probabilities - (-uniform.clamp(min=1e-20).log()).log()).argmax(dim=-1)


# --- the batched engine's sampling: per-row parameters as device tensors, counter-based noise ---

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) over int64 tensors holding values < 2**32;
    the multipliers are below 2**31, so no product overflows int64."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(
    seed: torch.Tensor, counter: torch.Tensor, lane: int, shape_tail: tuple[int, ...] = ()
) -> torch.Tensor:
    """Uniforms in (0, 1) from (seed, counter, lane[, element]) alone: a request's noise for output
    position ``counter`` is the same whichever batch, step or loop (sync or async) draws it, and
    needs neither a generator (graph capture) nor a host value. seed, counter: int64, broadcastable;
    ``shape_tail`` adds trailing dimensions, each element hashed with its flat index."""
    x = _mix32((seed & _MASK32) * 0x2545F491 + lane)
    x = _mix32(x ^ (counter & _MASK32))
    if shape_tail:
        index = torch.arange(math.prod(shape_tail), device=x.device).view(shape_tail)
        x = _mix32(x.reshape(*x.shape, *([1] * len(shape_tail))) ^ index)
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def batched_filtered_probabilities(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``filtered_probabilities`` with one (temperature, top_k, top_p) per row: logits [B, n, V],
    parameters [B]. Rows with temperature 0 get a temperature of 1 here (their caller takes the
    argmax instead); top_k 0 and top_p 1 are off, as for one request."""
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    keep = (top_k[:, None, None] == 0) | (rank < top_k[:, None, None])
    ordered_probabilities = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = ordered_probabilities.cumsum(dim=-1) - ordered_probabilities >= top_p[:, None, None]
    ordered_probabilities = ordered_probabilities.masked_fill(drop & (top_p[:, None, None] < 1.0), 0.0)
    ordered_probabilities = ordered_probabilities / ordered_probabilities.sum(dim=-1, keepdim=True)
    return torch.zeros_like(ordered_probabilities).scatter(-1, order, ordered_probabilities)
