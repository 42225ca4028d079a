"""What a layer's ``forward`` answers, and how an answer is held against the oracle's: one object
per kind of answer, so that the checks that drive steps (graphs, the draft loop, the steady run,
syncs) serve an attention and an indexer alike.

* ``VALUES`` (an attention, MHA or MLA): ``[rows, heads, v_head_dim]`` in the compute dtype; a
  buffer is NaN until written; an element passes within the dtype's tolerance of the float64
  oracle (``comparison.compare_with_oracle``).
* ``CHOICE`` (an indexer): int32 ``[rows, sparse_topk]`` positions; a buffer holds -2 (no position,
  nor -1) until written. The oracle's answer is each token's logits over the positions of its
  request (``-inf`` where it may not look), in units of the token's tolerance
  (``index_choice.tolerance``), and a row passes when it is a valid choice (each entry a visible
  position or -1, none twice, as many as the token has up to k) and no chosen logit lies more
  than one unit below the k-th largest, no left-out one more than one unit above it
  (``index_choice.judge_rows`` says the same one token at a time, in words).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from backends.base import AttentionSpec
from conformance.harness.comparison import compare_with_oracle, how_far_off, mismatched_rows, worst_place

UNWRITTEN_CHOICE = -2  # never a position, nor -1 (no entry)


class Answer(abc.ABC):
    unwritten: float

    def empty(self, spec: AttentionSpec, rows: int, device, guard: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, whole): a ``rows``-row output buffer holding ``unwritten``; ``guard`` extra columns
        of the buffer behind it (a strided output's), which must stay so."""
        shape = spec.layout.output_shape(spec, rows)
        width = int(torch.Size(shape[1:]).numel())
        whole = torch.full((rows, width + guard), self.unwritten, dtype=spec.layout.output_dtype(spec), device=device)
        return whole[:, :width].view(shape), whole

    def written(self, tensor: torch.Tensor) -> torch.Tensor:
        """bool, element by element: what a backend wrote (no longer ``unwritten``)."""
        return tensor != self.unwritten

    def canonical(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` in the form two equal answers share bit for bit (what determinism compares)."""
        return out

    @abc.abstractmethod
    def negated(self, reference: torch.Tensor) -> torch.Tensor:
        """The oracle's answer for the step run negated (query, keys and values): a later layer's."""

    @abc.abstractmethod
    def compare(
        self,
        out: torch.Tensor,
        reference: torch.Tensor,
        query_start_loc: list[int],
        atol: float,
        rtol: float,
        allowance: torch.Tensor | None = None,
    ) -> tuple[bool, dict[str, Any], dict[str, Any]]:
        """(passed, metrics, evidence) as ``compare_with_oracle`` gives them."""

    @abc.abstractmethod
    def mismatched_rows(
        self, out: torch.Tensor, reference: torch.Tensor, allowance: torch.Tensor | None, atol: float, rtol: float
    ) -> torch.Tensor:
        """bool [rows]: the rows ``compare`` fails."""

    # A failed comparison in words (``compare``'s metrics and its evidence's ``worst``).
    @abc.abstractmethod
    def how_far_off(self, errors: dict[str, Any]) -> str:
        """How many answers are off: "3 NaN/Inf outputs", "12 of 4096 elements beyond tolerance"."""

    @abc.abstractmethod
    def count(self, errors: dict[str, Any]) -> str:
        """How many are off and by how much: "12 elements, max abs error 0.5"."""

    @abc.abstractmethod
    def worst_place(self, worst: dict[str, Any]) -> str:
        """Where the worst one is, and its values."""


class Values(Answer):
    unwritten = float("nan")

    def written(self, tensor: torch.Tensor) -> torch.Tensor:
        return ~torch.isnan(tensor)

    def negated(self, reference: torch.Tensor) -> torch.Tensor:
        return reference.neg()

    def compare(self, out, reference, query_start_loc, atol, rtol, allowance=None):
        return compare_with_oracle(out, reference, query_start_loc, atol, rtol, allowance)

    def mismatched_rows(self, out, reference, allowance, atol, rtol):
        return mismatched_rows(out, reference, allowance, atol, rtol)

    def how_far_off(self, errors):
        return how_far_off(errors)

    def count(self, errors):
        # The largest error is of the finite outputs only: said of NaN rows alone it would read 0.
        mismatched = errors["mismatched"]
        text = f"{mismatched} element{'' if mismatched == 1 else 's'}"
        if errors["non_finite"]:
            text += f" ({errors['non_finite']} NaN/Inf)"
        if mismatched == errors["non_finite"]:
            return text
        return f"{text}, max abs error {errors['max_abs_error']:.3g}"

    def worst_place(self, worst):
        return worst_place(worst)


class Choice(Answer):
    unwritten = UNWRITTEN_CHOICE

    def negated(self, reference: torch.Tensor) -> torch.Tensor:
        return reference  # Σ_h w_h·relu(q_h·k): a negated query over negated keys scores the same

    def canonical(self, out: torch.Tensor) -> torch.Tensor:
        return out.sort(dim=-1).values  # a choice is a set: its order is the backend's

    def misses(self, out: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: how many tolerances its worst choice lies beyond the k-th largest logit (inf
        for a row that is no valid choice), the position that does, and that k-th logit."""
        reference = reference.to(out.device).double()
        tokens, width = reference.shape
        topk = out.shape[1]
        rows = out.long()
        visible = torch.isfinite(reference)
        need = visible.sum(dim=1).clamp(max=topk)
        inside = (rows >= 0) & (rows < width)
        safe = rows.clamp(0, max(width - 1, 0))
        sees = visible.gather(1, safe) if width else torch.zeros_like(inside)
        broken = ((rows < -1) | ((rows >= 0) & ~(inside & sees))).any(dim=1)
        ordered = rows.sort(dim=1).values
        broken |= ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
        broken |= (rows >= 0).sum(dim=1) != need
        chosen = torch.zeros(tokens, width + 1, dtype=torch.bool, device=out.device)
        chosen.scatter_(1, torch.where(inside, rows, width), True)
        chosen = chosen[:, :width]
        ranked = reference.masked_fill(~visible, float("-inf")).sort(dim=1, descending=True).values
        kth = ranked.gather(1, (need - 1).clamp(min=0)[:, None])
        short = torch.where(chosen & visible, kth - reference, 0.0).clamp(min=0)
        beyond = torch.where(~chosen & visible, reference - kth, 0.0).clamp(min=0)
        excess = torch.maximum(short, beyond)
        miss, position = excess.max(dim=1) if width else (excess.new_zeros(tokens), need.new_zeros(tokens))
        miss = miss.masked_fill(broken, float("inf"))
        return miss, position, kth[:, 0]

    def compare(self, out, reference, query_start_loc, atol, rtol, allowance=None):
        miss, position, kth = self.misses(out, reference)
        wrong = ~(miss <= 1.0)
        token = int(miss.argmax()) if miss.numel() else 0
        request = max(r for r in range(len(query_start_loc) - 1) if query_start_loc[r] <= token)
        finite = miss.masked_fill(~torch.isfinite(miss), 0.0)
        metrics = {
            "max_abs_error": float(finite.max()) if miss.numel() else 0.0,  # in tolerances of the token's logits
            "max_rel_error": 0.0,
            "mismatch_fraction": float(wrong.double().mean()) if miss.numel() else 0.0,
            "mismatched": int(wrong.sum()),
            "elements": int(miss.numel()),
            "non_finite": int((~torch.isfinite(miss)).sum()),  # rows that are no valid choice
            "tolerance_ratio": float(miss.max()) if miss.numel() else 0.0,
        }
        where = int(position[token]) if miss.numel() else 0
        evidence = {
            "worst": {
                "request": request,
                "token": token - query_start_loc[request],
                "head": 0,
                "channel": where,  # the position furthest beyond the k-th logit
                "got": float(reference[token, where]) if miss.numel() and reference.shape[1] else float("nan"),
                "expected": float(kth[token]) if miss.numel() else float("nan"),
            }
        }
        return not bool(wrong.any()), metrics, evidence

    def mismatched_rows(self, out, reference, allowance, atol, rtol, chunk_rows: int = 1024):
        """A chunk of rows at a time, as ``comparison.mismatched_rows`` (a steady bank's logits
        over its longest request, several float64 copies of them, would take its memory)."""
        bad = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        for start in range(0, out.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            bad[rows] = ~(self.misses(out[rows], reference[rows])[0] <= 1.0)
        return bad

    def how_far_off(self, errors):
        invalid = f", {errors['non_finite']} of them no valid choice" if errors["non_finite"] else ""
        return f"{errors['mismatched']} of {errors['elements']} tokens' choices beyond tolerance{invalid}"

    def count(self, errors):
        invalid = f", {errors['non_finite']} no valid choice" if errors["non_finite"] else ""
        return f"{errors['mismatched']} tokens, up to {errors['max_abs_error']:.3g} tolerances off{invalid}"

    def worst_place(self, worst):
        return (
            f"request {worst['request']} token {worst['token']}: position {worst['channel']}, logit "
            f"{worst['got']:.4g} against the k-th largest {worst['expected']:.4g} (in tolerances)"
        )


VALUES, CHOICE = Values(), Choice()


def answer_for(spec: AttentionSpec) -> Answer:
    """What a layer of ``spec`` answers: an attention's values, or an indexer's choice."""
    return VALUES if spec.layout.attends else CHOICE
