"""determinism: bitwise-equal output for identical inputs, and a request's output independent of
the rest of its batch — verified where claimed, measured and reported everywhere.

* ``deterministic``: the same step (same backend, cache and inputs) runs twice; the outputs must
  be equal bit for bit. (The graphs check compares two replays of one state the same way.)
* ``batch_invariant``: the batch runs whole, then reversed, then its first and its last request
  alone, on the same backend and cache; every request's rows must equal its rows in the whole
  batch bit for bit. A kernel whose split count, tile or reduction order follows the batch
  (the number of requests, the longest length, the mix of query lengths) changes bits here.

A backend that claims a property and breaks it FAILs; one that does not claim it PASSes with the
measurement stated, so a report shows which backends could claim it.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check
from conformance.harness.answers import answer_for
from conformance.harness.step import prepare_case, run_step
from conformance.results import CaseResult, Outcome, Verdict


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    differs = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    index = tuple(int(i) for i in differs.nonzero()[0])
    return (
        f"{int(differs.sum())} elements differ, first at {index} (token, then head and channel, or an "
        f"indexer's entry): {float(a[index])!r} vs {float(b[index])!r}"
    )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def rows_of(out: torch.Tensor, starts: list[int], request: int) -> torch.Tensor:
    return out[starts[request] : starts[request + 1]]


def batch_variants(batch: tuple[tuple[int, int], ...]) -> list[tuple[str, list[int]]]:
    """Other batches holding the same requests (none for a batch of one). A request alone is a
    real one: an empty request (0+0) is no batch by itself."""
    num_reqs = len(batch)
    if num_reqs < 2:
        return []
    real = [request for request, (_, query_len) in enumerate(batch) if query_len]
    return [
        ("reversed order", list(range(num_reqs))[::-1]),
        ("first request alone", real[:1]),
        ("last request alone", real[-1:]),
    ]


class DeterminismCheck(Check):
    name = "determinism"
    drives_trees = True  # its step hands the case's trees to the backend and the oracle
    kinds = EVERY_KIND
    question = "bitwise-equal on identical inputs; a request's output independent of the rest of the batch?"
    evidence_labels = {"deterministic": "not deterministic", "batch_invariant": "not batch-invariant"}

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        claims = backend_cls.capabilities
        prepared = prepare_case(backend_cls, case, device)
        host_lengths = claims.needs_cpu_seq_lens
        canonical = answer_for(case.spec).canonical  # an indexer's choice: a set, in any order
        first = canonical(run_step(prepared, with_host_lengths=host_lengths).clone())
        second = canonical(run_step(prepared, with_host_lengths=host_lengths).clone())
        metrics: dict[str, Any] = {"deterministic": bitwise_equal(first, second)}
        evidence: dict[str, Any] = {}
        if not metrics["deterministic"]:
            evidence["deterministic"] = f"two runs of one step: {first_difference(first, second)}"

        starts = prepared.batch.query_start_loc
        variance = None
        for label, order in batch_variants(case.batch):
            sub = prepared.over(prepared.batch.reordered(order))
            out = canonical(run_step(sub, with_host_lengths=host_lengths))
            sub_starts = sub.batch.query_start_loc
            for position, request in enumerate(order):
                mine, whole = rows_of(out, sub_starts, position), rows_of(first, starts, request)
                if not bitwise_equal(mine, whole):
                    variance = f"request {request}, {label}: {first_difference(mine, whole)}"
                    break
            if variance:
                break
        metrics["batch_invariant"] = variance is None if case.num_reqs > 1 else None
        if variance:
            evidence["batch_invariant"] = variance

        broken = [
            name for name in ("deterministic", "batch_invariant") if getattr(claims, name) and metrics[name] is False
        ]
        if broken:
            reason = "; ".join(f"claims {name} but {evidence[name]}" for name in broken)
            return Outcome(Verdict.FAIL, reason, metrics=metrics, evidence=evidence)
        measured = ", ".join(
            f"{name} {'yes' if value else 'no'}{'' if getattr(claims, name) else ' (not claimed)'}"
            for name, value in metrics.items()
            if value is not None
        )
        return Outcome(Verdict.PASS, f"measured: {measured}", metrics=metrics, evidence=evidence)

    def aggregate(self, cases: list[CaseResult]) -> dict[str, Any]:
        """Whether the measurements would support each claim over the whole run."""
        summary = {}
        for name in ("deterministic", "batch_invariant"):
            values = [case.metrics.get(name) for case in cases if case.metrics.get(name) is not None]
            if values:
                summary[f"{name}_everywhere"] = all(values)
                summary[f"{name}_cases"] = f"{sum(values)} of {len(values)}"
        return summary
