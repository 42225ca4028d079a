"""A layer's per-token inputs: what ``forward`` is handed a row of for each query row besides the
query (``LayerParameters``): a sparse layer's index rows, an indexer's head weights. One object
each, so that every place that moves a step's rows (a reordered batch, a graph's persistent
buffers, the draft loop's and the steady run's banks) moves all of them, and fills the rows past the
real tokens with what a padding row holds, without knowing which kind of layer it serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from backends.base import AttentionSpec
from conformance.cases import case_data


@dataclass(frozen=True)
class TokenInput:
    name: str  # the ``LayerParameters`` field
    padding: float  # what a padding row holds
    dtype: torch.dtype
    width: Callable[[AttentionSpec], int]
    has: Callable[[AttentionSpec], bool]  # whether a layer of this spec is handed it
    draw: Callable[..., torch.Tensor]  # (case, generator) -> a case's rows, on the CPU, from the batch's generator

    def empty(self, spec: AttentionSpec, rows: int, device: torch.device | str) -> torch.Tensor:
        """``rows`` padding rows: a persistent buffer before any load."""
        return torch.full((rows, self.width(spec)), self.padding, dtype=self.dtype, device=device)

    def load(self, buffer: torch.Tensor, real: torch.Tensor) -> None:
        """``real``'s rows at the top of ``buffer``, padding rows after them (device copies only)."""
        buffer.fill_(self.padding)
        buffer[: real.shape[0]].copy_(real)


TOKEN_INPUTS = (
    # A sparse layer's index rows (-1: no entry; an indexer's own output is such rows, not an input).
    TokenInput(
        "topk_indices",
        -1,
        torch.int32,
        lambda spec: spec.sparse_topk,
        lambda spec: spec.sparse_topk is not None and spec.layout.attends,
        case_data.topk_indices,
    ),
    # An indexer's head weights (a padding row weighs nothing).
    TokenInput(
        "index_weights",
        0.0,
        torch.float32,
        lambda spec: spec.num_heads,
        lambda spec: not spec.layout.attends,
        case_data.index_weights,
    ),
)


def inputs_of(spec: AttentionSpec) -> tuple[TokenInput, ...]:
    """The per-token inputs a layer of ``spec`` is handed."""
    return tuple(token_input for token_input in TOKEN_INPUTS if token_input.has(spec))


def drawn(case, generator: torch.Generator, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A case's per-token inputs, on ``device``."""
    return {each.name: each.draw(case, generator).to(device) for each in inputs_of(case.spec)}


def buffers(spec: AttentionSpec, rows: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A layer's persistent per-token input buffers, ``rows`` long, all padding."""
    return {token_input.name: token_input.empty(spec, rows, device) for token_input in inputs_of(spec)}


def load(spec: AttentionSpec, buffers_: dict[str, torch.Tensor], real: dict[str, torch.Tensor]) -> None:
    """Each of ``real``'s rows at the top of its buffer, padding after them."""
    for token_input in inputs_of(spec):
        token_input.load(buffers_[token_input.name], real[token_input.name])


def handed(spec: AttentionSpec, real: dict[str, torch.Tensor], rows: int, device) -> dict[str, torch.Tensor]:
    """Copies of ``real``'s per-token inputs as ``forward`` is handed them, ``rows`` long: the real
    tokens' rows, then padding rows."""
    copies = buffers(spec, rows, device)
    load(spec, copies, real)
    return copies
