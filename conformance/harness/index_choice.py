"""Judging an indexer's choice (``backends.base``: "The indexer"): a token's top-k is right when it
holds every position whose logit beats the k-th largest by more than the tolerance, and none that
falls short of it by more (positions within the tolerance of the k-th may go either way: a kernel's
rounding can swap near-ties), each position once, none past the token's own, and as many as the
token has up to k.

The tolerance is what rounding each head's score ``q_h · k`` to bf16 once (half a unit in the last
place, 2^-8 of it) can move a logit: ``2^-8 · max_s Σ_h |w_h| · |q_h · k_s|`` per token, the largest
weighted score magnitude a key of its request reaches (``cases.oracle.index_tolerance``).
Products of bf16 queries and e4m3 keys (times power-of-two scales) are exact in fp32 and their fp32
sums far closer; a key dequantized without its scale, a logit without its weights or its ReLU, or a
top-k over positions the token may not index moves far more."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChoiceProblem:
    token: int  # among the batch's tokens
    what: str


def judge_rows(
    rows: torch.Tensor, logits: torch.Tensor, tolerances: torch.Tensor, context_len: int, topk: int, first_token: int
) -> tuple[ChoiceProblem | None, float]:
    """The worst row of one request's tokens (``rows`` [q, topk] as the backend wrote them,
    ``logits`` [q, s] the oracle's, -inf past each token), None when every one is right, and its
    miss: how many tolerances its worst choice lies beyond the k-th largest logit (inf for a rule
    broken: an entry that is no position, past the token's own, twice, or too few)."""
    worst, found = 0.0, None
    for i in range(rows.shape[0]):
        token, position = first_token + i, context_len + i
        row = rows[i].long().cpu()
        chosen = row[row >= 0]
        if bool((row < -1).any()):
            return ChoiceProblem(token, f"wrote {int(row[row < -1][0])}: an entry is a position or -1"), float("inf")
        if bool((chosen > position).any()):
            past = int(chosen[chosen > position][0])
            return ChoiceProblem(token, f"chose position {past}, past its own ({position})"), float("inf")
        if chosen.unique().numel() != chosen.numel():
            return ChoiceProblem(token, "chose a position twice"), float("inf")
        need = min(topk, position + 1)
        if chosen.numel() != need:
            return ChoiceProblem(token, f"chose {chosen.numel()} positions of the {need} it has"), float("inf")
        line = logits[i, : position + 1].double().cpu()
        kth = float(line.topk(need).values[-1])
        tol = float(tolerances[i])
        picked = torch.zeros(position + 1, dtype=torch.bool)
        picked[chosen] = True
        short = (kth - line[picked]).clamp(min=0)  # chosen, below the k-th
        beyond = (line[~picked] - kth).clamp(min=0)  # left out, above it
        misses = torch.cat([short, beyond]) / max(tol, 1e-300)
        miss = float(misses.max()) if misses.numel() else 0.0
        if miss > max(worst, 1.0):
            if bool((short > tol).any()):
                index = int(short.argmax())
                s = int(picked.nonzero().flatten()[index])  # line[picked] is in position order
                what = f"chose position {s} (logit {float(line[s]):.4g}) below the k-th largest logit {kth:.4g}"
            else:
                others = (~picked).nonzero().flatten()
                s = int(others[int(beyond.argmax())])
                what = f"left out position {s} (logit {float(line[s]):.4g}) above the k-th largest logit {kth:.4g}"
            found = ChoiceProblem(token, f"{what}, {miss:.1f}× the tolerance {tol:.3g}")
        worst = max(worst, miss)
    return found, worst
