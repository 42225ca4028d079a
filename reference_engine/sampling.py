"""Sampling parameters and target probabilities: temperature, top-k, top-p, per-request seeds.

Everything stays on the device: a request's seed drives its own generator, and greedy requests
(temperature 0) take the argmax, so no host value is ever read back.
"""
from __future__ import annotations

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


def filtered_probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
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
    uniform = torch.rand(probabilities.shape, generator=generator, device=probabilities.device).clamp_(min=1e-20)
    log_probabilities = torch.where(probabilities > 0, probabilities.log(), float("-inf"))
    return (log_probabilities - (-uniform.log()).log()).argmax(dim=-1)
